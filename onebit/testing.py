"""A single-process oracle of the compressed all-reduce, for tests and for studying the algorithm.

:func:`simulate_compressed_allreduce` runs the whole two-phase algorithm for ``n`` simulated ranks
in one process, written directly from the maths (no packing, no wire buffers, no backend), so
that the distributed implementation can be checked against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .compression import SegmentLayout
from .kernels.blocked import blocked_rms_scale

__all__ = ["SimulationResult", "simulate_compressed_allreduce", "HierarchicalResult", "simulate_hierarchical_allreduce"]


@dataclass
class SimulationResult:
    output: torch.Tensor  # the (unpadded) result every rank receives
    worker_errors: list[torch.Tensor]  # new worker error of each rank (padded layout)
    server_errors: list[torch.Tensor]  # new server error of each rank (padded length / n)
    worker_scales: torch.Tensor  # (n, k) float32: rank r's scale of each segment
    worker_signs: list[torch.Tensor]  # +1/-1 float32 per rank (padded layout)
    server_scales: torch.Tensor  # (n, k) float32: server j's scale of each segment
    server_signs: torch.Tensor  # +1/-1 float32 (padded layout), server j's chunks in place


def _rms(v: torch.Tensor) -> torch.Tensor:
    # The scale's definition includes its float64 summation order (onebit.kernels.blocked).
    return blocked_rms_scale(v)


def _sign(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v < 0, torch.tensor(-1.0), torch.tensor(1.0))


def _padded_inputs(inputs: list[torch.Tensor], layout: SegmentLayout) -> list[torch.Tensor]:
    """Each rank's input in the padded layout: every tensor at its start, zeros in the padding."""
    xs = []
    for values in inputs:
        x, flat, offset = torch.zeros(layout.padded), values.detach().float().cpu().reshape(-1), 0
        for start, numel in zip(layout.starts, layout.numels):
            x[start:start + numel] = flat[offset:offset + numel]
            offset += numel
        xs.append(x)
    return xs


def simulate_compressed_allreduce(
    inputs: list[torch.Tensor],
    worker_errors: list[torch.Tensor] | None = None,
    server_errors: list[torch.Tensor] | None = None,
    *,
    numels: Sequence[int] | None = None,
    scale_block_size: int | None = None,
) -> SimulationResult:
    """Compressed mean of ``inputs`` (one flat float32 tensor per simulated rank).

    ``numels``: the sizes of the tensors laid end to end in each input (default: one tensor);
    each tensor (or, with ``scale_block_size``, each block of one) is a segment, compressed on
    its own with its own scales, exactly as if it were alone, in the padded layout of
    :class:`onebit.compression.SegmentLayout`. Errors are in that layout (worker: the padded
    buffer; server ``j``: chunk ``j`` of every segment, in segment order) and default to zeros;
    they are not modified (new ones are returned). Scales are ``(n, k)``: row ``r`` holds rank
    (or server) ``r``'s scale of each of the ``k`` segments.
    """
    n = len(inputs)
    total = inputs[0].numel()
    numels = [total] if numels is None else list(numels)
    if sum(numels) != total:
        raise ValueError(f"numels {numels} add up to {sum(numels)}, the inputs have {total} elements")
    layout = SegmentLayout.build(numels, n, scale_block_size)
    padded, edges = layout.padded, layout.edges
    if worker_errors is None:
        worker_errors = [torch.zeros(padded) for _ in range(n)]
    if server_errors is None:
        server_errors = [torch.zeros(padded // n) for _ in range(n)]

    xs = _padded_inputs(inputs, layout)

    new_worker_errors = [torch.zeros(padded) for _ in range(n)]
    worker_signs = [torch.zeros(padded) for _ in range(n)]
    new_server_errors = [torch.zeros(padded // n) for _ in range(n)]
    server_signs = torch.zeros(padded)
    full = torch.zeros(padded)
    k = len(edges) - 1
    worker_scales, server_scales = torch.zeros(n, k), torch.zeros(n, k)
    for seg, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        for i in range(n):  # every rank as worker, on this segment alone
            b = xs[i][lo:hi] + worker_errors[i][lo:hi].cpu()
            s, q = _rms(b), _sign(b)
            worker_scales[i, seg] = s
            worker_signs[i][lo:hi] = q
            new_worker_errors[i][lo:hi] = b - s * q
        chunk = (hi - lo) // n
        for j in range(n):  # server j: chunk j of this segment
            part = slice(lo + j * chunk, lo + (j + 1) * chunk)
            mine = slice(lo // n, lo // n + chunk)  # where that chunk lies in server j's buffer
            total_j = worker_scales[0, seg] * worker_signs[0][part]
            for i in range(1, n):
                total_j = total_j + worker_scales[i, seg] * worker_signs[i][part]
            c = total_j / n + server_errors[j][mine].cpu()
            s, r = _rms(c), _sign(c)
            server_scales[j, seg] = s
            server_signs[part] = r
            new_server_errors[j][mine] = c - s * r
            full[part] = s * r
    output = torch.cat([full[start:start + numel] for start, numel in zip(layout.starts, numels)])
    return SimulationResult(
        output=output,
        worker_errors=new_worker_errors,
        server_errors=new_server_errors,
        worker_scales=worker_scales,
        worker_signs=worker_signs,
        server_scales=server_scales,
        server_signs=server_signs,
    )


@dataclass
class HierarchicalResult:
    output: torch.Tensor  # the (unpadded) result every rank receives
    worker_errors: list[torch.Tensor]  # per rank, as TwoLevelState.worker_error
    server_errors: list[torch.Tensor]  # per rank, as TwoLevelState.server_error


def simulate_hierarchical_allreduce(
    inputs: list[torch.Tensor],
    local: int,
    variant: str = "compressed",
    worker_errors: list[torch.Tensor] | None = None,
    server_errors: list[torch.Tensor] | None = None,
    *,
    numels: Sequence[int] | None = None,
    scale_block_size: int | None = None,
) -> HierarchicalResult:
    """The two-level compressed mean (:mod:`onebit.hierarchy`) of ``inputs``, one per simulated
    rank, ranks ``p * local + j`` forming node ``p``; written from the maths, as
    :func:`simulate_compressed_allreduce`, without packing, wire rows or groups.

    Errors are in :class:`onebit.hierarchy.TwoLevelState`'s layouts (rank ``(p, j)``'s shard
    ``j`` is chunk ``j`` of each segment cut in ``local`` chunks; its global server chunk is chunk
    ``j P + p`` of each segment cut in ``n``), default to zeros, and are not modified (new ones
    are returned). ``variant``: ``"compressed"`` or ``"node_mean"``.
    """
    n = len(inputs)
    if local < 1 or n % local:
        raise ValueError(f"{n} inputs are not whole nodes of local={local}")
    nodes = n // local
    total = inputs[0].numel()
    numels = [total] if numels is None else list(numels)
    layout = SegmentLayout.build(numels, n, scale_block_size)
    padded, edges = layout.padded, layout.edges
    shard = padded // local
    compressed = variant == "compressed"
    node_size = shard if compressed else 0
    if worker_errors is None:
        worker_errors = [torch.zeros(padded if compressed else shard) for _ in range(n)]
    if server_errors is None:
        server_errors = [torch.zeros(node_size + padded // n) for _ in range(n)]
    xs = _padded_inputs(inputs, layout)
    new_worker = [e.detach().cpu().clone() for e in worker_errors]
    new_server = [e.detach().cpu().clone() for e in server_errors]
    full = torch.zeros(padded)

    def rank(p: int, j: int) -> int:
        return p * local + j

    for lo, hi in zip(edges[:-1], edges[1:]):
        w, u = (hi - lo) // local, (hi - lo) // n  # a shard's piece of the segment; a global chunk
        node_lo, global_lo = lo // local, lo // n  # where this segment starts in a shard / a global chunk
        # The values sent across nodes: (scale, signs) of rank (p, j) for its shard piece.
        crossing: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if compressed:
            worker = {}
            for r in range(n):  # every rank compresses the whole segment
                b = xs[r][lo:hi] + worker_errors[r][lo:hi].cpu()
                s, q = _rms(b), _sign(b)
                worker[r] = (s, q)
                new_worker[r][lo:hi] = b - s * q
            for p in range(nodes):
                for j in range(local):  # node server of shard j
                    piece = slice(j * w, (j + 1) * w)
                    acc = worker[rank(p, 0)][0] * worker[rank(p, 0)][1][piece]
                    for k in range(1, local):
                        acc = acc + worker[rank(p, k)][0] * worker[rank(p, k)][1][piece]
                    mine = slice(node_lo, node_lo + w)
                    c = acc / local + server_errors[rank(p, j)][:node_size][mine].cpu()
                    s, q = _rms(c), _sign(c)
                    crossing[p, j] = (s, q)
                    new_server[rank(p, j)][:node_size][mine] = c - s * q
        else:
            for p in range(nodes):
                for j in range(local):  # the node mean of shard j, then its 1-bit compression
                    piece = slice(lo + j * w, lo + (j + 1) * w)
                    mean = xs[rank(p, 0)][piece]
                    for k in range(1, local):
                        mean = mean + xs[rank(p, k)][piece]
                    mine = slice(node_lo, node_lo + w)
                    b = mean / local + worker_errors[rank(p, j)][mine].cpu()
                    s, q = _rms(b), _sign(b)
                    crossing[p, j] = (s, q)
                    new_worker[rank(p, j)][mine] = b - s * q
        for j in range(local):
            for p in range(nodes):  # global server of chunk p of shard j
                sub = slice(p * u, (p + 1) * u)
                acc = crossing[0, j][0] * crossing[0, j][1][sub]
                for k in range(1, nodes):
                    acc = acc + crossing[k, j][0] * crossing[k, j][1][sub]
                mine = slice(node_size + global_lo, node_size + global_lo + u)
                d = acc / nodes + server_errors[rank(p, j)][mine].cpu()
                s, q = _rms(d), _sign(d)
                new_server[rank(p, j)][mine] = d - s * q
                full[lo + j * w + p * u:lo + j * w + (p + 1) * u] = s * q
    output = torch.cat([full[start:start + numel] for start, numel in zip(layout.starts, numels)])
    return HierarchicalResult(output=output, worker_errors=new_worker, server_errors=new_server)
