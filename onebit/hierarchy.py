"""Two-level 1-bit communication: ranks grouped into nodes, the network between nodes carrying
about ``2 (P-1)/P * M/8`` bytes per node and compressed all-reduce, against ``L (P-1)/P * M/8 + M/8``
for the flat one (``P`` nodes of ``L`` ranks, ``M`` the padded bucket).

Rank ``(p, l)`` is local rank ``l`` of node ``p``. Its **intra** group is node ``p``'s ranks (in
local-rank order); its **cross** group is local rank ``l`` of every node (in node order). Shard
``l`` of a buffer is chunk ``l`` of each segment when every segment is cut into ``L`` chunks
(:mod:`onebit.compression`'s layout with ``L`` rows); its sub-chunk ``p`` is chunk ``l P + p`` of
the ``n = P L`` chunks of the flat scheme, so the end of both variants is the flat decode of ``n``
rows. Two variants, both bit-identical on every rank (every rank decodes the same bytes):

``"compressed"`` (three error feedbacks; equal to the flat algorithm bit for bit when ``L = 1`` or
``P = 1``):

1. every rank: worker compression of the whole buffer into ``L`` rows; all-to-all in the intra group;
2. node server of shard ``l``: ``c = (sum_l' s q) / L + e_node``, recompressed into ``P`` rows
   (its sub-chunks); all-to-all in the cross group;
3. global server of sub-chunk ``(l, p)``: ``d = (sum_p' s q) / P + e_s``, recompressed; all-gather
   in the cross group, then of the ``P`` rows in the intra group; decode ``n`` rows.

``"node_mean"`` (exact node mean, 1-bit between nodes only):

1. every rank: all-to-all of the float32 shards in the intra group, then the node mean of shard
   ``l`` (summed in local-rank order);
2. worker compression of that mean into ``P`` rows (worker error ``M / L``); cross all-to-all;
3. as above from the global server on.

The stages are the flat algorithm's (:class:`TwoLevelState` is an
:class:`onebit.collectives.AllreduceState`, run by ``start_worker_``, ``start_server_`` and
``finish_``), so buckets are pipelined the same way.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .backends.base import CommBackend, Pending
from .collectives import AllreduceState
from .compression import chunk_bytes, read_scales, row_bytes, write_scale_
from .kernels import KernelSet
from .validation import check_choice, is_int

__all__ = ["VARIANTS", "Topology", "TwoLevelState", "check_hierarchy", "build_topology", "node_groups"]

logger = logging.getLogger(__name__)

#: ``hierarchy_variant`` values: the one chosen by default first.
VARIANTS = ("compressed", "node_mean")


def check_hierarchy(hierarchy: Any, variant: Any) -> None:
    """Validate the ``hierarchy`` and ``hierarchy_variant`` arguments (no side effects)."""
    if hierarchy is not None and hierarchy != "host" and not is_int(hierarchy, 1):
        raise ValueError(
            f"invalid hierarchy: {hierarchy!r}; expected None (flat), 'host' (ranks grouped by host name) "
            "or a positive int L (consecutive groups of L ranks)"
        )
    check_choice("hierarchy_variant", variant, VARIANTS)


def node_groups(node_ids: Sequence[Any]) -> list[list[int]] | str:
    """The ranks of each node (nodes in order of their lowest rank, ranks ascending), from each
    rank's node id; or, when a two-level scheme cannot apply, why (a sentence for the log)."""
    nodes: dict[Any, list[int]] = {}
    for rank, node in enumerate(node_ids):
        nodes.setdefault(node, []).append(rank)
    groups = list(nodes.values())
    sizes = sorted({len(g) for g in groups})
    if len(groups) == 1:
        return f"one node ({len(node_ids)} ranks): nothing crosses a network between nodes"
    if sizes == [1]:
        return f"one rank per node ({len(groups)} nodes): the two-level scheme would be the flat one"
    if len(sizes) > 1:
        return f"uneven nodes ({', '.join(str(len(g)) for g in groups)} ranks): shards would not line up"
    return groups


@dataclass(frozen=True)
class Topology:
    """This rank's place: ``nodes`` (``P``) nodes of ``local`` (``L``) ranks; it is local rank
    ``local_rank`` of node ``node``; ``intra`` and ``cross`` are the transports of its two groups."""

    nodes: int
    local: int
    node: int
    local_rank: int
    intra: CommBackend
    cross: CommBackend
    variant: str

    def new_state(self, padded: int, edges: Sequence[int], device: torch.device | str) -> TwoLevelState:
        """The state of a buffer's all-reduce on this topology (see :func:`onebit.collectives.new_state`)."""
        return TwoLevelState(padded, edges, self, device)


def build_topology(backend: CommBackend, hierarchy: Any, variant: str) -> Topology | None:
    """The two-level topology of ``backend``'s ranks, or ``None`` (flat, with one log line on rank
    0 saying why) for one node, one rank per node, or uneven nodes. ``hierarchy``: ``"host"`` (ranks
    grouped by host name, all-gathered) or an int ``L`` (consecutive groups of ``L`` ranks). Needs
    a torch.distributed transport: the groups are new process groups of its group."""
    from .backends.torch_dist import TorchDistBackend

    n = backend.world_size
    if n == 1:
        return None
    if not isinstance(backend, TorchDistBackend):
        raise ValueError(
            f"hierarchy={hierarchy!r} needs a torch.distributed transport (comm_backend_name 'gloo', 'nccl', "
            f"'hccl'), got {backend.name!r}; use hierarchy=None with this transport"
        )
    import torch.distributed as dist

    if hierarchy == "host":
        hosts: list[Any] = [None] * n
        dist.all_gather_object(hosts, socket.gethostname(), group=backend.group)
        groups: list[list[int]] | str = node_groups(hosts)
    elif n % hierarchy:
        groups = f"{n} ranks are not whole groups of hierarchy={hierarchy}"
    else:
        groups = node_groups([rank // hierarchy for rank in range(n)])
    if isinstance(groups, str):
        if backend.rank == 0:
            logger.info("onebit: hierarchy=%r falls back to the flat all-reduce: %s", hierarchy, groups)
        return None
    members = dist.get_process_group_ranks(backend.group) if backend.group is not None else list(range(n))
    node = next(p for p, ranks in enumerate(groups) if backend.rank in ranks)
    local_rank = groups[node].index(backend.rank)
    # Only a group's members create it, each group once, intra before cross on every rank.
    intra = dist.new_group([members[r] for r in groups[node]], use_local_synchronization=True)
    cross = dist.new_group([members[g[local_rank]] for g in groups], use_local_synchronization=True)
    topology = Topology(len(groups), len(groups[0]), node, local_rank, TorchDistBackend(intra),
                        TorchDistBackend(cross), variant)
    if backend.rank == 0:
        logger.info("onebit: two-level 1-bit all-reduce (%s): %d nodes of %d ranks", variant, topology.nodes,
                    topology.local)
    return topology


def _runs(edges: Sequence[int]) -> list[tuple[int, int, int]]:
    """The segments as runs ``(start, count, size)`` of consecutive segments of equal size (the
    blocks of a tensor under ``scale_block_size`` form one run), so that moving every segment's
    chunks is a few strided copies, not one per segment."""
    runs: list[tuple[int, int, int]] = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if runs and runs[-1][2] == hi - lo:
            start, count, size = runs[-1]
            runs[-1] = (start, count + 1, size)
        else:
            runs.append((lo, 1, hi - lo))
    return runs


def _to_rows_(source: torch.Tensor, rows: torch.Tensor, runs: list[tuple[int, int, int]], unit: int) -> None:
    """Cut each segment's part of ``source`` (segment ``[lo, hi)`` of the buffer is
    ``source[lo/unit : hi/unit]``) into ``R = rows.shape[0]`` equal chunks and put chunk ``r`` in
    row ``r`` at ``lo / (unit R)``: the row layout of :func:`onebit.kernels.reference.worker_compress_`."""
    r = rows.shape[0]
    for start, count, size in runs:
        piece = size // unit
        part = piece // r
        src = source[start // unit:start // unit + count * piece].view(count, r, part).transpose(0, 1)
        dst = rows[:, start // (unit * r):start // (unit * r) + count * part].view(r, count, part)
        dst.copy_(src)


class TwoLevelState(AllreduceState):
    """Per-bucket state of the two-level compressed all-reduce on one rank: its error feedbacks,
    wire buffers, and the collective in flight (an :class:`onebit.collectives.AllreduceState`
    whose stages run on the topology's own groups; not staged). ``worker_error`` and
    ``server_error`` are what :meth:`onebit.OnebitOptimizer.compression_errors` returns (for
    ``"compressed"`` the server error holds the node server's ``M / L`` elements followed by the
    global server's ``M / n``)."""

    def __init__(self, padded: int, edges: Sequence[int], topology: Topology, device: torch.device | str) -> None:
        p, local = topology.nodes, topology.local
        n = p * local
        super().__init__(padded, n, edges)
        self.topology = topology
        self.variant = topology.variant
        self.shard_bounds = torch.div(self.bounds, local, rounding_mode="floor")  # the shard's own segments
        self.runs = _runs(edges)
        shard = padded // local
        compressed = self.variant == "compressed"
        self.worker_error = torch.zeros(padded if compressed else shard, dtype=torch.float32, device=device)
        node_part = shard if compressed else 0
        self.server_error = torch.zeros(node_part + padded // n, dtype=torch.float32, device=device)
        self.node_error = self.server_error[:node_part]
        self.global_error = self.server_error[node_part:]
        k = self.segments
        if compressed:  # 1-bit rows of the whole buffer, one per local rank, and the node server's output
            self.intra_send = torch.zeros(local, row_bytes(padded, local, k), dtype=torch.uint8, device=device)
            self.intra_recv = torch.zeros_like(self.intra_send)
            self.node_packed = torch.zeros(chunk_bytes(padded, local), dtype=torch.uint8, device=device)
        else:  # float32 shards, one per local rank, and this rank's node mean
            self.intra_send = torch.zeros(local, shard, dtype=torch.float32, device=device)
            self.intra_recv = torch.zeros_like(self.intra_send)
            self.node_mean = torch.zeros(shard, dtype=torch.float32, device=device)
        row = row_bytes(padded, n, k)
        self.cross_send = torch.zeros(p, row, dtype=torch.uint8, device=device)
        self.cross_recv = torch.zeros_like(self.cross_send)
        self.gather_in = torch.zeros(row, dtype=torch.uint8, device=device)
        self.cross_out = torch.zeros(p, row, dtype=torch.uint8, device=device)
        self.gathered = torch.zeros(local, p * row, dtype=torch.uint8, device=device)

    def error_slices(self, start: int, end: int) -> list[torch.Tensor]:
        """None: a step that leaves a parameter alone lets its two-level errors change (as it
        always has; their shard and chunk layouts would give its slices)."""
        return []

    def health_input(self, buffer: torch.Tensor, multiplier: torch.Tensor | None = None,
                     bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``"node_mean"``: the worker stage compressed the node mean of this rank's shard
        (segments ``1/L`` long), not the bucket's buffer."""
        if self.variant == "compressed":
            return super().health_input(buffer, multiplier, bound)
        return self.worker_error, self.node_mean, [size // self.topology.local for size in self.sizes()]

    def layout_key(self) -> list[tuple[int, int, str]]:
        """``[(nodes, local, variant)]``: the errors of another topology have other shapes."""
        return [(self.topology.nodes, self.topology.local, self.variant)]

    # ----------------------------------------------------------------- the stages

    def check(self, buffer: torch.Tensor, backend: CommBackend | None, staged: bool) -> None:
        if staged:
            raise ValueError("a two-level compressed all-reduce cannot be staged")
        super().check(buffer, backend, staged)

    def start_worker(self, buffer: torch.Tensor, backend: CommBackend | None, kernels: KernelSet, staged: bool,
                     codec: dict[str, Any]) -> Pending:
        """Stage 1: the intra-node all-to-all (of 1-bit rows, or of float32 shards)."""
        intra = self.topology.intra
        if self.variant == "compressed":
            signs = chunk_bytes(self.padded, self.topology.local)
            scales = kernels.worker_compress_(buffer, self.worker_error, self.intra_send[:, :signs], bounds=self.bounds)
            write_scale_(self.intra_send, scales)
        else:
            _to_rows_(buffer, self.intra_send, self.runs, 1)
        return intra.start_all_to_all(self.intra_recv, self.intra_send)

    def start_server(self, backend: CommBackend | None, kernels: KernelSet, staged: bool) -> Pending:
        """Stage 2: the node server (or the node mean and its worker compression), the cross
        all-to-all, then the global server and the cross all-gather."""
        topo = self.topology
        signs = chunk_bytes(self.padded, self.world_size)
        if self.variant == "compressed":
            intra_signs = chunk_bytes(self.padded, topo.local)
            scales = kernels.server_compress_(
                self.intra_recv[:, :intra_signs], read_scales(self.intra_recv, self.segments), self.node_error,
                self.node_packed, bounds=self.bounds)
            _to_rows_(self.node_packed, self.cross_send[:, :signs], self.runs, 8 * topo.local)
        else:
            mean = self.node_mean.copy_(self.intra_recv[0])
            for row in self.intra_recv[1:]:  # local-rank order, as the oracle sums
                mean.add_(row)
            mean.div_(torch.tensor(float(topo.local), device=mean.device))
            scales = kernels.worker_compress_(mean, self.worker_error, self.cross_send[:, :signs],
                                              bounds=self.shard_bounds)
        write_scale_(self.cross_send, scales)
        topo.cross.start_all_to_all(self.cross_recv, self.cross_send).wait()
        scales = kernels.server_compress_(
            self.cross_recv[:, :signs], read_scales(self.cross_recv, self.segments), self.global_error,
            self.gather_in[:signs], bounds=self.shard_bounds)
        write_scale_(self.gather_in.view(1, -1), scales)
        return topo.cross.start_all_gather(self.cross_out, self.gather_in)

    def finish(self, buffer: torch.Tensor, kernels: KernelSet, keep: torch.Tensor | None,
               codec: dict[str, Any]) -> None:
        """Stage 3: the intra-node all-gather of the node's ``P`` rows, then the decode of all
        ``n`` rows (row ``l P + p`` is sub-chunk ``p`` of shard ``l``: the flat scheme's chunk)."""
        self.topology.intra.all_gather(self.gathered, self.cross_out.view(-1))
        rows = self.gathered.view(self.world_size, -1)
        signs = chunk_bytes(self.padded, self.world_size)
        kernels.decode_(rows[:, :signs], read_scales(rows, self.segments), buffer, keep, bounds=self.bounds)
