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
    error_dtype: torch.dtype | None = None,
) -> SimulationResult:
    """Compressed mean of ``inputs`` (one flat float32 tensor per simulated rank).

    ``numels``: the sizes of the tensors laid end to end in each input (default: one tensor);
    each tensor (or, with ``scale_block_size``, each block of one) is a segment, compressed on
    its own with its own scales, exactly as if it were alone, in the padded layout of
    :class:`onebit.compression.SegmentLayout`. Errors are in that layout (worker: the padded
    buffer; server ``j``: chunk ``j`` of every segment, in segment order) and default to zeros;
    they are not modified (new ones are returned). Scales are ``(n, k)``: row ``r`` holds rank
    (or server) ``r``'s scale of each of the ``k`` segments. ``error_dtype``: the type the new
    errors are held in (default: the given errors', else float32): each is computed in float32 and
    rounded once to it (``OnebitOptimizer(error_dtype=...)``).
    """
    n = len(inputs)
    layout, numels, xs = _laid_out(inputs, numels, scale_block_size)
    padded, edges = layout.padded, layout.edges
    if error_dtype is None:
        error_dtype = torch.float32 if worker_errors is None else worker_errors[0].dtype
    if worker_errors is None:
        worker_errors = [torch.zeros(padded) for _ in range(n)]
    if server_errors is None:
        server_errors = [torch.zeros(padded // n) for _ in range(n)]
    k = len(edges) - 1
    result = SimulationResult(
        output=torch.zeros(padded),  # the padded output until the end
        worker_errors=[torch.zeros(padded, dtype=error_dtype) for _ in range(n)],
        server_errors=[torch.zeros(padded // n, dtype=error_dtype) for _ in range(n)],
        worker_scales=torch.zeros(n, k),
        worker_signs=[torch.zeros(padded) for _ in range(n)],
        server_scales=torch.zeros(n, k),
        server_signs=torch.zeros(padded),
    )
    for seg, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        _flat_workers(result, seg, lo, hi, xs, worker_errors)
        _flat_servers(result, seg, lo, hi, server_errors)
    result.output = _unpadded(result.output, layout, numels)
    return result


def _laid_out(inputs: list[torch.Tensor], numels: Sequence[int] | None,
              scale_block_size: int | None) -> tuple[SegmentLayout, list[int], list[torch.Tensor]]:
    """The segment layout of ``inputs`` (tensors of ``numels``, default one), the ``numels`` and
    each rank's input in that layout."""
    total = inputs[0].numel()
    numels = [total] if numels is None else list(numels)
    if sum(numels) != total:
        raise ValueError(f"numels {numels} add up to {sum(numels)}, the inputs have {total} elements")
    layout = SegmentLayout.build(numels, len(inputs), scale_block_size)
    return layout, numels, _padded_inputs(inputs, layout)


def _unpadded(full: torch.Tensor, layout: SegmentLayout, numels: list[int]) -> torch.Tensor:
    return torch.cat([full[start:start + numel] for start, numel in zip(layout.starts, numels)])


def _weighted_sum(terms: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``sum s * q`` over ``terms`` (scale, signs), added in their order."""
    (s, q), *rest = terms
    acc = s * q
    for s, q in rest:
        acc = acc + s * q
    return acc


def _flat_workers(result: SimulationResult, seg: int, lo: int, hi: int, xs: list[torch.Tensor],
                  worker_errors: list[torch.Tensor]) -> None:
    """Every rank as worker, on segment ``seg`` (``[lo, hi)``) alone."""
    for i in range(len(xs)):
        b = xs[i][lo:hi] + worker_errors[i][lo:hi].cpu()
        s, q = _rms(b), _sign(b)
        result.worker_scales[i, seg] = s
        result.worker_signs[i][lo:hi] = q
        result.worker_errors[i][lo:hi] = b - s * q


def _flat_servers(result: SimulationResult, seg: int, lo: int, hi: int, server_errors: list[torch.Tensor]) -> None:
    """Server ``j`` on chunk ``j`` of segment ``seg``, for every ``j``; the output's chunks."""
    n = len(server_errors)
    chunk = (hi - lo) // n
    for j in range(n):
        part = slice(lo + j * chunk, lo + (j + 1) * chunk)
        mine = slice(lo // n, lo // n + chunk)  # where that chunk lies in server j's buffer
        total_j = _weighted_sum([(result.worker_scales[i, seg], result.worker_signs[i][part]) for i in range(n)])
        c = total_j / n + server_errors[j][mine].cpu()
        s, r = _rms(c), _sign(c)
        result.server_scales[j, seg] = s
        result.server_signs[part] = r
        result.server_errors[j][mine] = c - s * r
        result.output[part] = s * r


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
    layout, numels, xs = _laid_out(inputs, numels, scale_block_size)
    padded, edges = layout.padded, layout.edges
    shard = padded // local
    compressed = variant == "compressed"
    node_size = shard if compressed else 0
    if worker_errors is None:
        worker_errors = [torch.zeros(padded if compressed else shard) for _ in range(n)]
    if server_errors is None:
        server_errors = [torch.zeros(node_size + padded // n) for _ in range(n)]
    run = _TwoLevelRun(xs, worker_errors, server_errors, [e.detach().cpu().clone() for e in worker_errors],
                       [e.detach().cpu().clone() for e in server_errors], local, n // local, node_size)
    full = torch.zeros(padded)
    crossing = _compressed_crossing if compressed else _node_mean_crossing
    for lo, hi in zip(edges[:-1], edges[1:]):
        _global_servers(run, lo, hi, crossing(run, lo, hi), full)
    return HierarchicalResult(output=_unpadded(full, layout, numels), worker_errors=run.new_worker,
                              server_errors=run.new_server)


@dataclass
class _TwoLevelRun:
    """One simulated call of the two-level scheme: the inputs, the errors before and after, the
    shape of the nodes (``node_size``: the node server's part of a server error, 0 without one)."""

    xs: list[torch.Tensor]
    worker_errors: list[torch.Tensor]
    server_errors: list[torch.Tensor]
    new_worker: list[torch.Tensor]
    new_server: list[torch.Tensor]
    local: int
    nodes: int
    node_size: int

    def rank(self, p: int, j: int) -> int:
        return p * self.local + j


# The values sent across nodes for a segment: (scale, signs) of rank (p, j) for its shard piece.
_Crossing = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


def _compressed_crossing(run: _TwoLevelRun, lo: int, hi: int) -> _Crossing:
    """``"compressed"``: every rank compresses the whole segment; node server ``(p, j)``
    averages and recompresses shard ``j``'s piece."""
    local, rank = run.local, run.rank
    w, node_lo = (hi - lo) // local, lo // local  # a shard's piece of the segment; where it starts in a shard
    worker = {}
    for r in range(len(run.xs)):
        b = run.xs[r][lo:hi] + run.worker_errors[r][lo:hi].cpu()
        s, q = _rms(b), _sign(b)
        worker[r] = (s, q)
        run.new_worker[r][lo:hi] = b - s * q
    crossing: _Crossing = {}
    for p in range(run.nodes):
        for j in range(local):
            piece = slice(j * w, (j + 1) * w)
            acc = _weighted_sum([(worker[rank(p, k)][0], worker[rank(p, k)][1][piece]) for k in range(local)])
            mine = slice(node_lo, node_lo + w)
            c = acc / local + run.server_errors[rank(p, j)][:run.node_size][mine].cpu()
            s, q = _rms(c), _sign(c)
            crossing[p, j] = (s, q)
            run.new_server[rank(p, j)][:run.node_size][mine] = c - s * q
    return crossing


def _node_mean_crossing(run: _TwoLevelRun, lo: int, hi: int) -> _Crossing:
    """``"node_mean"``: the node mean of shard ``j``'s piece, then its 1-bit compression."""
    local, rank = run.local, run.rank
    w, node_lo = (hi - lo) // local, lo // local
    crossing: _Crossing = {}
    for p in range(run.nodes):
        for j in range(local):
            piece = slice(lo + j * w, lo + (j + 1) * w)
            mean = run.xs[rank(p, 0)][piece]
            for k in range(1, local):
                mean = mean + run.xs[rank(p, k)][piece]
            mine = slice(node_lo, node_lo + w)
            b = mean / local + run.worker_errors[rank(p, j)][mine].cpu()
            s, q = _rms(b), _sign(b)
            crossing[p, j] = (s, q)
            run.new_worker[rank(p, j)][mine] = b - s * q
    return crossing


def _global_servers(run: _TwoLevelRun, lo: int, hi: int, crossing: _Crossing, full: torch.Tensor) -> None:
    """Global server ``(p, j)`` of chunk ``p`` of shard ``j``'s piece; the output's chunks."""
    local, nodes, rank = run.local, run.nodes, run.rank
    w, u = (hi - lo) // local, (hi - lo) // (nodes * local)  # a shard's piece of the segment; a global chunk
    global_lo = lo // (nodes * local)  # where this segment starts in a global chunk
    for j in range(local):
        for p in range(nodes):
            sub = slice(p * u, (p + 1) * u)
            acc = _weighted_sum([(crossing[k, j][0], crossing[k, j][1][sub]) for k in range(nodes)])
            mine = slice(run.node_size + global_lo, run.node_size + global_lo + u)
            d = acc / nodes + run.server_errors[rank(p, j)][mine].cpu()
            s, q = _rms(d), _sign(d)
            run.new_server[rank(p, j)][mine] = d - s * q
            full[lo + j * w + p * u:lo + j * w + (p + 1) * u] = s * q
