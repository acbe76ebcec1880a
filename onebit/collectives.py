"""The error-compensated 1-bit compressed all-reduce, written once over (codec, transport).

The buffer is cut into segments (one per parameter tensor, see
:class:`onebit.compression.SegmentLayout`); everything below holds for each segment on its own,
and all segments travel in the same two collectives.

Phase 1 (every rank as worker): ``b = x + e_w``; scale ``s_w = rms(b)``; ``e_w <- b - s_w sign(b)``;
packed signs split into ``n`` chunks; **all-to-all** (rank ``j`` receives chunk ``j`` of every
rank, each row carrying its sender's scales).

Phase 2 (rank ``j`` as server of chunk ``j``): ``c = (sum_i s_w,i q_i) / n + e_s``;
``s_s = rms(c)``; ``e_s <- c - s_s sign(c)``; **all-gather** of the packed server chunks with
their scales; every rank decodes the same bytes, so the output is bit-identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends.base import COMPLETED, CommBackend, Pending
from .compression import chunk_bytes, padded_length, read_scales, row_bytes, write_scale_
from .kernels import REFERENCE, KernelSet

__all__ = ["CompressionState", "compressed_allreduce_", "start_worker_", "start_server_", "finish_"]


class CompressionState:
    """Persistent per-buffer state of the compressed all-reduce on one rank.

    Holds the worker error (``padded`` elements), the server error (``padded / n``), the segment
    table and the wire buffers, allocated once. ``edges`` are the segment boundaries
    ``[0, o_1, ..., padded]`` (default: one segment), each segment a multiple of ``8 n`` long
    (:class:`onebit.compression.SegmentLayout` gives them; for one segment ``padded`` must follow
    :func:`onebit.compression.padded_length`).
    """

    def __init__(self, padded: int, world_size: int, device: torch.device | str,
                 edges: Sequence[int] | None = None) -> None:
        n = world_size
        if edges is None:
            if padded != padded_length(padded, world_size):
                raise ValueError(
                    f"buffer length {padded} is not padded for world size {world_size}; "
                    f"use onebit.compression.padded_length (here {padded_length(padded, world_size)})"
                )
            edges = [0, padded]
        edges = [int(e) for e in edges]
        if (len(edges) < 2 or edges[0] != 0 or edges[-1] != padded
                or any(b <= a or (b - a) % (8 * n) for a, b in zip(edges[:-1], edges[1:]))):
            raise ValueError(
                f"segment edges must run from 0 to {padded} in steps that are positive multiples of {8 * n} "
                "(use onebit.compression.SegmentLayout)"
            )
        self.padded = padded
        self.world_size = n
        self.segments = len(edges) - 1
        self.bounds = torch.tensor(edges, dtype=torch.int64)  # the kernels' segment table (host)
        row = row_bytes(padded, n, self.segments)
        self.worker_error = torch.zeros(padded, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(padded // n, dtype=torch.float32, device=device)
        self.send = torch.zeros(n, row, dtype=torch.uint8, device=device)
        self.recv = torch.zeros(n, row, dtype=torch.uint8, device=device)
        self.gather_in = torch.zeros(row, dtype=torch.uint8, device=device)
        self.gather_out = torch.zeros(n, row, dtype=torch.uint8, device=device)
        self.pending: Pending = COMPLETED  # the collective of the stage in progress
        self.stage = 0  # the last stage started: 0 none (or finished), 1 worker, 2 server
        # Staged stages (overlap_backward) write their new errors here, leaving the errors as they
        # are until commit_() (allocated at the first staged stage).
        self.next_worker_error: torch.Tensor | None = None
        self.next_server_error: torch.Tensor | None = None
        self.staged: set[str] = set()
        # The input times a multiplier, for kernels that cannot multiply as they read (allocated at
        # the first such stage; see start_worker_).
        self.scaled_input: torch.Tensor | None = None

    def reset_errors_(self) -> None:
        """Zero both error-feedback buffers (after a checkpoint load or a change of layout)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def staged_error(self, which: str) -> torch.Tensor:
        """The buffer a staged ``'worker'`` or ``'server'`` stage writes its new error to."""
        name = f"next_{which}_error"
        if getattr(self, name) is None:
            setattr(self, name, torch.empty_like(getattr(self, f"{which}_error")))
        self.staged.add(which)
        return getattr(self, name)

    def commit_(self) -> None:
        """Adopt the errors of the staged stages (swapping buffers: the previous errors stay in
        ``next_*_error`` until the next staged stage)."""
        for which in self.staged:
            current, name = f"{which}_error", f"next_{which}_error"
            new, old = getattr(self, name), getattr(self, current)
            setattr(self, current, new)
            setattr(self, name, old)
        self.staged = set()

    def discard_(self) -> None:
        """Wait for the collective in flight and drop what the staged stages computed: the errors
        stay as they were."""
        self.pending.wait()
        self.pending, self.stage = COMPLETED, 0
        self.staged = set()


def compressed_allreduce_(
    buffer: torch.Tensor,
    state: CompressionState,
    backend: CommBackend,
    kernels: KernelSet = REFERENCE,
) -> torch.Tensor:
    """Replace ``buffer`` (flat float32, ``state.padded`` elements) by its compressed mean over
    ranks, updating the error buffers in ``state``. Two collective calls. Returns ``buffer``.

    The three stages below run it in pieces, so that several buffers can be pipelined (each
    buffer's transfers overlap the codec work of the others): every rank calls
    ``start_worker_`` for every buffer, then ``start_server_`` for every buffer, then ``finish_``
    for every buffer, in the same buffer order."""
    start_worker_(buffer, state, backend, kernels)
    start_server_(state, backend, kernels)
    return finish_(buffer, state, kernels)


def start_worker_(buffer: torch.Tensor, state: CompressionState, backend: CommBackend, kernels: KernelSet,
                  staged: bool = False, multiplier: torch.Tensor | None = None, bound: float | None = None) -> None:
    """Stage 1: compress ``buffer`` with the worker error and start the all-to-all of its signs.
    ``staged``: the new worker error goes to a buffer of its own, adopted by
    :meth:`CompressionState.commit_` (or dropped by ``discard_``). ``multiplier``: compress
    ``buffer * multiplier`` instead (``buffer`` left as it is; in the codec's pass where the
    kernels can); ``bound`` (with ``multiplier``): ``buffer * multiplier`` clamped to
    ``[-bound, bound]`` (in the same pass where the kernels can). (A two-level state,
    :class:`onebit.hierarchy.TwoLevelState`, runs its own stages on its own groups, as do the two
    functions below; not staged.)"""
    scaled = {}
    if multiplier is not None:
        if _fuses(kernels, state) and (bound is None or kernels.limits):
            scaled = {"multiplier": multiplier} if bound is None else {"multiplier": multiplier, "limit": bound}
        else:  # a pass of its own, into a buffer the state keeps
            if state.scaled_input is None or state.scaled_input.shape != buffer.shape:
                state.scaled_input = torch.empty_like(buffer)
            buffer = torch.mul(buffer, multiplier, out=state.scaled_input)
            if bound is not None:
                buffer.clamp_(-bound, bound)
    if not isinstance(state, CompressionState):
        if staged:
            raise ValueError("a two-level compressed all-reduce cannot be staged")
        return state.start_worker_(buffer, kernels)
    n = backend.world_size
    if n != state.world_size:
        raise ValueError(f"state was built for world size {state.world_size}, backend has {n}")
    if buffer.dtype != torch.float32 or buffer.dim() != 1 or buffer.numel() != state.padded:
        raise ValueError(
            f"buffer must be a flat float32 tensor of {state.padded} elements, got "
            f"{buffer.dtype} of shape {tuple(buffer.shape)}"
        )
    signs = chunk_bytes(state.padded, n)
    error, out = _errors(kernels, state, "worker", staged)
    worker_scales = kernels.worker_compress_(buffer, error, state.send[:, :signs], bounds=state.bounds, **out, **scaled)
    write_scale_(state.send, worker_scales)
    state.pending = backend.start_all_to_all(state.recv, state.send)
    state.stage = 1


def start_server_(state: CompressionState, backend: CommBackend, kernels: KernelSet, staged: bool = False) -> None:
    """Stage 2: once this rank's chunk has arrived, average and recompress it with the server
    error, and start the all-gather of the result (``staged``: as in :func:`start_worker_`)."""
    _expect_stage(state, 1, "start_server_", "start_worker_")
    if not isinstance(state, CompressionState):
        return state.start_server_(kernels)
    state.pending.wait()
    signs = chunk_bytes(state.padded, state.world_size)
    error, out = _errors(kernels, state, "server", staged)
    server_scales = kernels.server_compress_(
        state.recv[:, :signs], read_scales(state.recv, state.segments), error, state.gather_in[:signs],
        bounds=state.bounds, **out,
    )
    write_scale_(state.gather_in.view(1, -1), server_scales)
    state.pending = backend.start_all_gather(state.gather_out, state.gather_in)
    state.stage = 2


def finish_(buffer: torch.Tensor, state: CompressionState, kernels: KernelSet,
            keep: torch.Tensor | None = None, multiplier: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 3: once every server chunk has arrived, decode them into ``buffer`` (``+0.0`` where
    the packed bits ``keep``, if given, are clear: see :func:`onebit.kernels.reference.decode_`),
    multiplied by ``multiplier`` if given (in the decode's pass where the kernels can)."""
    _expect_stage(state, 2, "finish_", "start_server_")
    fused = multiplier is not None and _fuses(kernels, state)
    if not isinstance(state, CompressionState):
        state.finish_(buffer, kernels, keep)
    else:
        state.pending.wait()
        state.pending, state.stage = COMPLETED, 0
        signs = chunk_bytes(state.padded, state.world_size)
        kernels.decode_(state.gather_out[:, :signs], read_scales(state.gather_out, state.segments), buffer, keep,
                        bounds=state.bounds, **({"multiplier": multiplier} if fused else {}))
    if multiplier is not None and not fused:  # a pass of its own (a kept +0.0 stays +0.0: multipliers are >= 0)
        buffer.mul_(multiplier)
    return buffer


def _fuses(kernels: KernelSet, state: CompressionState) -> bool:
    """Whether the codec multiplies as it reads and writes (else a pass of its own does)."""
    return kernels.multipliers and isinstance(state, CompressionState)


def _errors(kernels: KernelSet, state: CompressionState, which: str, staged: bool) -> tuple[torch.Tensor, dict]:
    """The error a stage reads and the keyword that sends the new one elsewhere when staged."""
    error = getattr(state, f"{which}_error")
    if not staged:
        return error, {}
    target = state.staged_error(which)
    if kernels.separate_errors:
        return error, {"error_out": target}
    target.copy_(error)  # a kernel that updates in place: on a copy
    return target, {}


def _expect_stage(state: CompressionState, stage: int, name: str, previous: str) -> None:
    if state.stage != stage:
        done = {0: "no stage (or finish_)", 1: "start_worker_", 2: "start_server_"}[state.stage]
        raise RuntimeError(f"{name} called on a buffer whose last stage was {done}; call {previous} first")
