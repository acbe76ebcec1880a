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

import abc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .backends.base import COMPLETED, CommBackend, Pending
from .compression import chunk_bytes, padded_length, read_scales, row_bytes, write_scale_
from .kernels import REFERENCE, KernelSet

__all__ = ["AllreduceState", "CompressionState", "new_state", "compressed_allreduce_", "start_worker_", "start_server_",
           "finish_"]


class AllreduceState(abc.ABC):
    """The protocol of a compressed all-reduce's state: what one rank keeps of one buffer's
    all-reduce between calls (error feedbacks, wire buffers, the collective in flight) and the
    codec work of each stage on it. Each topology subclasses it in a file of its own: flat,
    :class:`CompressionState`; two-level, :class:`onebit.hierarchy.TwoLevelState`. The engine and
    the optimizers use only what is declared here, so a new topology touches its own file.

    :func:`start_worker_` → :func:`start_server_` → :func:`finish_` run the stages: they keep
    ``stage`` and ``pending``, wait for the previous stage's collective, raise on a stage out of
    order (nothing changed then), and multiply the input where the codec cannot
    (``fuses_multipliers``). A subclass only does each stage's own work, in :meth:`start_worker`,
    :meth:`start_server` and :meth:`finish`, and allocates ``worker_error`` and ``server_error``
    (what :meth:`onebit.OnebitOptimizer.compression_errors` returns) in its ``__init__`` after
    calling this one, or when first used (:class:`CompressionState`: see :meth:`allocate_errors_`).
    The stages of every rank start the same collectives in the same order.
    """

    #: whether :meth:`start_worker` and :meth:`finish` take ``multiplier`` (and ``limit``) into
    #: the codec's pass when the kernels can; else the stage functions multiply in a pass of their own
    fuses_multipliers = False

    worker_error: torch.Tensor
    server_error: torch.Tensor

    def __init__(self, padded: int, world_size: int, edges: Sequence[int]) -> None:
        self.padded = padded  # the buffer's length
        self.world_size = world_size
        self.edges = tuple(int(e) for e in edges)  # the segment boundaries [0, ..., padded]
        self.segments = len(self.edges) - 1
        self.bounds = torch.tensor(self.edges, dtype=torch.int64)  # the kernels' segment table (host)
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

    # ----------------------------------------------------------------- the stages' own work

    def check(self, buffer: torch.Tensor, backend: CommBackend | None, staged: bool) -> None:
        """Raise ``ValueError`` when stage 1 cannot run on ``buffer`` (before anything changes)."""
        if buffer.dtype != torch.float32 or buffer.dim() != 1 or buffer.numel() != self.padded:
            raise ValueError(
                f"buffer must be a flat float32 tensor of {self.padded} elements, got "
                f"{buffer.dtype} of shape {tuple(buffer.shape)}"
            )

    @abc.abstractmethod
    def start_worker(self, buffer: torch.Tensor, backend: CommBackend | None, kernels: KernelSet, staged: bool,
                     codec: dict[str, Any]) -> Pending:
        """Stage 1: compress ``buffer`` (checked) with the worker error and start the first
        collective; return its handle. ``codec``: keywords for the worker kernel (``multiplier``,
        ``limit``), only when ``fuses_multipliers``. ``staged``: new errors go to
        :meth:`staged_error`'s buffers (a state that cannot stage refuses it in :meth:`check`)."""

    @abc.abstractmethod
    def start_server(self, backend: CommBackend | None, kernels: KernelSet, staged: bool) -> Pending:
        """Stage 2, once stage 1's collective is complete: recompress with the server error(s)
        and start the last collective; return its handle."""

    @abc.abstractmethod
    def finish(self, buffer: torch.Tensor, kernels: KernelSet, keep: torch.Tensor | None,
               codec: dict[str, Any]) -> None:
        """Stage 3, once stage 2's collective is complete: decode every rank's bytes into
        ``buffer`` (``+0.0`` where the packed bits ``keep`` are clear; ``codec`` as above)."""

    # ----------------------------------------------------------------- what the engine reads

    @abc.abstractmethod
    def error_slices(self, start: int, end: int) -> list[torch.Tensor]:
        """The views of the errors that belong to the buffer's elements ``[start, end)`` (one
        parameter's segments), which a step that leaves the parameter alone keeps as they are."""

    def health_input(self, buffer: torch.Tensor, multiplier: torch.Tensor | None = None,
                     bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """For the health check (:func:`onebit.health.error_ratio`): the worker error, what this
        rank's stage 1 compressed (``buffer`` times ``multiplier``, clamped to ``bound``) and
        their segments' sizes."""
        compressed = buffer if multiplier is None else buffer * multiplier
        return self.worker_error, compressed if bound is None else compressed.clamp(-bound, bound), self.sizes()

    def sizes(self) -> list[int]:
        """The segments' lengths in the buffer."""
        return [b - a for a, b in zip(self.edges[:-1], self.edges[1:])]

    def layout_key(self) -> list[tuple[Any, ...]]:
        """What the layout digest (:mod:`onebit.layout`) adds for this topology: ``[]`` (so the
        digests of flat layouts, saved in checkpoints, stay what they were)."""
        return []

    def reset_errors_(self) -> None:
        """Zero every error-feedback buffer (after a checkpoint load or a change of layout)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def allocate_errors_(self) -> None:
        """Allocate the errors (zeros) where a state allocates them when first used; before a step
        that compresses holds some of them (:meth:`onebit.buckets.Bucket.hold`)."""

    def held_errors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(worker_error, server_error)`` to read (e.g. their norms) without allocating them where
        a state allocates them late: zeros of their shapes until then."""
        return self.worker_error, self.server_error

    # ----------------------------------------------------------------- staging (overlap_backward)

    def staged_error(self, which: str) -> torch.Tensor:
        """The buffer a staged ``'worker'`` or ``'server'`` stage writes its new error to."""
        name = f"next_{which}_error"
        if getattr(self, name) is None:
            setattr(self, name, torch.empty_like(getattr(self, f"{which}_error")))
        self.staged.add(which)
        return getattr(self, name)

    def stage_errors(self, kernels: KernelSet, which: str, staged: bool) -> tuple[torch.Tensor, dict]:
        """The error a stage reads and the keyword that sends the new one elsewhere when staged."""
        error = getattr(self, f"{which}_error")
        if not staged:
            return error, {}
        target = self.staged_error(which)
        if kernels.separate_errors:
            return error, {"error_out": target}
        target.copy_(error)  # a kernel that updates in place: on a copy
        return target, {}

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


class CompressionState(AllreduceState):
    """Persistent per-buffer state of the (flat) compressed all-reduce on one rank.

    Holds the worker error (``padded`` elements), the server error (``padded / n``), the segment
    table and the wire buffers, allocated at the first compression (an optimizer in warmup holds
    none of them: see :attr:`allocated`). ``edges`` are the segment boundaries
    ``[0, o_1, ..., padded]`` (default: one segment), each segment a multiple of ``8 n`` long
    (:class:`onebit.compression.SegmentLayout` gives them; for one segment ``padded`` must follow
    :func:`onebit.compression.padded_length`).
    """

    fuses_multipliers = True

    def __init__(self, padded: int, world_size: int, device: torch.device | str,
                 edges: Sequence[int] | None = None, error_dtype: torch.dtype = torch.float32) -> None:
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
        super().__init__(padded, n, edges)
        self.device = torch.device(device)
        self.error_dtype = error_dtype
        # Allocated when first needed: an optimizer's warmup never compresses (see ``allocated``).
        self._worker_error: torch.Tensor | None = None
        self._server_error: torch.Tensor | None = None
        self._wire: dict[str, torch.Tensor] = {}  # send, recv, gather_in, gather_out

    @property
    def allocated(self) -> bool:
        """Whether the errors exist (zeros until then): reading :attr:`worker_error` or
        :attr:`server_error`, or running a stage, allocates them."""
        return self._worker_error is not None

    @property
    def worker_error(self) -> torch.Tensor:
        self.allocate_errors_()
        return self._worker_error

    @worker_error.setter
    def worker_error(self, value: torch.Tensor) -> None:  # (commit_ swaps buffers)
        self.allocate_errors_()
        self._worker_error = value

    @property
    def server_error(self) -> torch.Tensor:
        self.allocate_errors_()
        return self._server_error

    @server_error.setter
    def server_error(self, value: torch.Tensor) -> None:
        self.allocate_errors_()
        self._server_error = value

    def allocate_errors_(self) -> None:
        if self._worker_error is None:
            self._worker_error = torch.zeros(self.padded, dtype=self.error_dtype, device=self.device)
            self._server_error = torch.zeros(self.padded // self.world_size, dtype=self.error_dtype, device=self.device)

    # The byte buffers of the two collectives (a row per rank, but in ``gather_in``), allocated at
    # the first compression.
    send = property(lambda self: self._wire_buffer("send"))
    recv = property(lambda self: self._wire_buffer("recv"))
    gather_in = property(lambda self: self._wire_buffer("gather_in"))
    gather_out = property(lambda self: self._wire_buffer("gather_out"))

    def _wire_buffer(self, name: str) -> torch.Tensor:
        if not self._wire:
            n, row = self.world_size, row_bytes(self.padded, self.world_size, self.segments)
            self._wire = {name: torch.zeros(shape, dtype=torch.uint8, device=self.device) for name, shape
                          in (("send", (n, row)), ("recv", (n, row)), ("gather_in", (row,)), ("gather_out", (n, row)))}
        return self._wire[name]

    def held_errors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._worker_error is None:  # zeros of their shapes (a stride-0 view of one float)
            zero = torch.zeros(1, dtype=self.error_dtype, device=self.device)
            return zero.expand(self.padded), zero.expand(self.padded // self.world_size)
        return self._worker_error, self._server_error

    def reset_errors_(self) -> None:
        if self.allocated:  # (else zeros already)
            super().reset_errors_()

    def check(self, buffer: torch.Tensor, backend: CommBackend | None, staged: bool) -> None:
        n = backend.world_size
        if n != self.world_size:
            raise ValueError(f"state was built for world size {self.world_size}, backend has {n}")
        super().check(buffer, backend, staged)

    def start_worker(self, buffer: torch.Tensor, backend: CommBackend | None, kernels: KernelSet, staged: bool,
                     codec: dict[str, Any]) -> Pending:
        """Worker compression of the whole buffer into ``n`` rows; the all-to-all."""
        signs = chunk_bytes(self.padded, self.world_size)
        send, recv = self.send, self.recv
        worker_scales = self._codec(kernels, "worker", staged, lambda error, out: kernels.worker_compress_(
            buffer, error, send[:, :signs], bounds=self.bounds, **out, **codec))
        write_scale_(send, worker_scales)
        return backend.start_all_to_all(recv, send)

    def start_server(self, backend: CommBackend | None, kernels: KernelSet, staged: bool) -> Pending:
        """Server compression of this rank's chunk; the all-gather."""
        signs = chunk_bytes(self.padded, self.world_size)
        recv, gather_in, gather_out = self.recv, self.gather_in, self.gather_out
        server_scales = self._codec(kernels, "server", staged, lambda error, out: kernels.server_compress_(
            recv[:, :signs], read_scales(recv, self.segments), error, gather_in[:signs], bounds=self.bounds, **out))
        write_scale_(gather_in.view(1, -1), server_scales)
        return backend.start_all_gather(gather_out, gather_in)

    def _codec(self, kernels: KernelSet, which: str, staged: bool,
               compress: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]) -> torch.Tensor:
        """``compress(error, out)`` of a ``'worker'`` or ``'server'`` stage; an error of a type the
        kernels do not take (bfloat16 for most) goes through a float32 copy, compressed in place and
        rounded back once into where the new error belongs: the bits the reference kernels give."""
        error, out = self.stage_errors(kernels, which, staged)
        if error.dtype in kernels.error_dtypes:
            return compress(error, out)
        wide = error.float()
        scales = compress(wide, {})
        out.get("error_out", error).copy_(wide)
        return scales

    def finish(self, buffer: torch.Tensor, kernels: KernelSet, keep: torch.Tensor | None,
               codec: dict[str, Any]) -> None:
        signs = chunk_bytes(self.padded, self.world_size)
        gather_out = self.gather_out
        kernels.decode_(gather_out[:, :signs], read_scales(gather_out, self.segments), buffer, keep,
                        bounds=self.bounds, **codec)

    def error_slices(self, start: int, end: int) -> list[torch.Tensor]:
        if not self.allocated:  # zeros, which a step that does not compress leaves as they are
            return []
        n = self.world_size
        return [self.worker_error[start:end], self.server_error[start // n:end // n]]


def new_state(padded: int, world_size: int, device: torch.device | str, edges: Sequence[int],
              topology: Any = None, error_dtype: torch.dtype = torch.float32) -> AllreduceState:
    """The state of a buffer's compressed all-reduce: flat without a ``topology``, else the
    topology's own (``topology.new_state(padded, edges, device)``, e.g.
    :class:`onebit.hierarchy.Topology`; float32 errors only). ``error_dtype``: the type its
    compression errors are held in."""
    if topology is None:
        return CompressionState(padded, world_size, device, edges, error_dtype)
    if error_dtype != torch.float32:
        raise ValueError(f"error_dtype={error_dtype} is not offered with hierarchy= yet (its three error feedbacks "
                         "are float32); pass error_dtype=torch.float32 or hierarchy=None")
    return topology.new_state(padded, edges, device)


def compressed_allreduce_(
    buffer: torch.Tensor,
    state: AllreduceState,
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


def start_worker_(buffer: torch.Tensor, state: AllreduceState, backend: CommBackend, kernels: KernelSet,
                  staged: bool = False, multiplier: torch.Tensor | None = None, bound: float | None = None) -> None:
    """Stage 1: compress ``buffer`` with the worker error and start the all-to-all of its signs.
    ``staged``: the new worker error goes to a buffer of its own, adopted by
    :meth:`AllreduceState.commit_` (or dropped by ``discard_``). ``multiplier``: compress
    ``buffer * multiplier`` instead (``buffer`` left as it is; in the codec's pass where the
    kernels can); ``bound`` (with ``multiplier``): ``buffer * multiplier`` clamped to
    ``[-bound, bound]`` (in the same pass where the kernels can). (The state's topology does
    the work of each stage, on its own groups: see :class:`AllreduceState`; a two-level state,
    :class:`onebit.hierarchy.TwoLevelState`, is not staged.)"""
    codec = {}
    if multiplier is not None:
        if multiplier.dtype not in kernels.multiplier_dtypes:  # (a bfloat16 one, widened: the same products)
            multiplier = multiplier.float()
        if _fuses(kernels, state) and (bound is None or kernels.limits):
            codec = {"multiplier": multiplier} if bound is None else {"multiplier": multiplier, "limit": bound}
        else:  # a pass of its own, into a buffer the state keeps
            if state.scaled_input is None or state.scaled_input.shape != buffer.shape:
                state.scaled_input = torch.empty_like(buffer)
            buffer = torch.mul(buffer, multiplier, out=state.scaled_input)
            if bound is not None:
                buffer.clamp_(-bound, bound)
    state.check(buffer, backend, staged)
    state.pending = state.start_worker(buffer, backend, kernels, staged, codec)
    state.stage = 1


def start_server_(state: AllreduceState, backend: CommBackend, kernels: KernelSet, staged: bool = False) -> None:
    """Stage 2: once this rank's chunk has arrived, average and recompress it with the server
    error, and start the all-gather of the result (``staged``: as in :func:`start_worker_`)."""
    _expect_stage(state, 1, "start_server_", "start_worker_")
    state.pending.wait()
    state.pending = state.start_server(backend, kernels, staged)
    state.stage = 2


def finish_(buffer: torch.Tensor, state: AllreduceState, kernels: KernelSet,
            keep: torch.Tensor | None = None, multiplier: torch.Tensor | None = None,
            divisor: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 3: once every server chunk has arrived, decode them into ``buffer`` (``+0.0`` where
    the packed bits ``keep``, if given, are clear: see :func:`onebit.kernels.reference.decode_`),
    multiplied by ``multiplier`` or divided by ``divisor`` (``+0.0`` where it is 0) if given, in
    the decode's pass where the kernels can."""
    _expect_stage(state, 2, "finish_", "start_server_")
    if multiplier is not None and divisor is not None:
        raise ValueError("finish_ takes a multiplier or a divisor, not both")
    fused = multiplier is not None and _fuses(kernels, state)
    divides = divisor is not None and kernels.divisors and state.fuses_multipliers
    state.pending.wait()
    state.pending, state.stage = COMPLETED, 0
    state.finish(buffer, kernels, keep, {"multiplier": multiplier} if fused else {"divisor": divisor} if divides else {})
    if multiplier is not None and not fused:  # a pass of its own (a kept +0.0 stays +0.0: multipliers are >= 0)
        buffer.mul_(multiplier)
    if divisor is not None and not divides:  # (divisors are >= 0: a kept +0.0 stays +0.0, or is 0 / 0)
        buffer.div_(divisor).masked_fill_(divisor == 0, 0.0)
    return buffer


def _fuses(kernels: KernelSet, state: AllreduceState) -> bool:
    """Whether the codec multiplies as it reads and writes (else a pass of its own does)."""
    return kernels.multipliers and state.fuses_multipliers


def _expect_stage(state: AllreduceState, stage: int, name: str, previous: str) -> None:
    if state.stage != stage:
        done = {0: "no stage (or finish_)", 1: "start_worker_", 2: "start_server_"}[state.stage]
        raise RuntimeError(f"{name} called on a buffer whose last stage was {done}; call {previous} first")
