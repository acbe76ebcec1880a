"""Communication statistics: bytes each rank sends, collective calls, and time, by kind of step.

Bytes follow the bandwidth-optimal algorithm of each collective (what a ring or pairwise
exchange sends from one rank), so they compare across transports:

* all-reduce of ``B`` bytes: ``2 (n-1) / n * B``;
* all-to-all of ``B`` input bytes: ``(n-1) / n * B`` (the rows for the other ranks);
* all-gather of ``B`` bytes per rank: ``(n-1) * B``.

A framework's collectives that a step depends on (DDP's gradient all-reduce under
:func:`onebit.integrations.attach_ddp`) are counted too, when the adapter reports them
(:meth:`InstrumentedBackend.record_framework`): in ``bytes_sent`` and ``collectives``, and on
their own in ``framework_bytes_sent``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .backends.base import CommBackend, Pending
from .compression import allreduce_wire_bytes
from .kernels import KernelSet

__all__ = ["PhaseStats", "InstrumentedBackend", "StepTimers", "timed_kernels", "l2_norm"]


@dataclass
class PhaseStats:
    steps: int = 0
    skipped_steps: int = 0
    bytes_sent: int = 0
    collectives: int = 0
    comm_time_s: float = 0.0
    step_time_s: float = 0.0
    # bytes of a framework's collectives for these steps (in bytes_sent too; their time is not in comm_time_s)
    framework_bytes_sent: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class _Timed:
    """A collective in flight, recorded when it completes: its time is the time to start it plus
    the time spent waiting for it (what the caller could not overlap)."""

    def __init__(self, owner: InstrumentedBackend, handle: Pending, nbytes: int, seconds: float) -> None:
        self._owner, self._nbytes, self._seconds = owner, nbytes, seconds
        self._handle: Pending | None = handle

    def wait(self) -> None:
        if self._handle is None:
            return
        start = time.perf_counter()
        self._handle.wait()
        self._handle = None
        self._owner._record(self._nbytes, self._seconds + time.perf_counter() - start)


class InstrumentedBackend(CommBackend):
    """Wraps a transport and counts what passes through it, under the kind of the current step
    (one of ``names``: the optimizer's plan names).

    Owned by the optimizer; times are host wall-clock seconds around each call, and for a started
    collective its start plus its wait (on an asynchronous device this is the time to enqueue,
    unless the transport itself waits).
    """

    def __init__(self, inner: CommBackend, names: tuple[str, ...]) -> None:
        self.inner = inner
        self.name = inner.name
        self.names = names
        self.reset()

    def reset(self) -> None:
        self.kind = self.names[0]
        self.totals = {name: PhaseStats() for name in self.names}
        self.last_step = PhaseStats()
        # a framework's bytes reported before the step they serve began (DDP's, during backward)
        self._early = PhaseStats()
        self._in_step = False
        for level in getattr(self, "levels", {}).values():
            level.reset()

    def add_levels(self, intra: CommBackend, cross: CommBackend) -> tuple[InstrumentedBackend, InstrumentedBackend]:
        """Count a two-level all-reduce's intra-node and inter-node groups too (returned wrapped):
        their bytes join this backend's in :meth:`stats_dict`, and also appear on their own."""
        self.levels = {"intra_node": InstrumentedBackend(intra, self.names),
                       "inter_node": InstrumentedBackend(cross, self.names)}
        return self.levels["intra_node"], self.levels["inter_node"]

    def begin_step(self, kind: str) -> None:
        self.kind = kind
        self.last_step, self._early = self._early, PhaseStats()
        self._in_step = True
        for level in getattr(self, "levels", {}).values():
            level.begin_step(kind)

    def stats_dict(self, kind: str | None) -> dict[str, Any]:
        """The statistics of plan ``kind`` (``None``: the last step). With levels: ``bytes_sent``
        and ``collectives`` count every group, and ``intra_node_bytes_sent`` /
        ``inter_node_bytes_sent`` the two-level all-reduce's groups alone (what crosses the network
        between nodes is ``inter_node_bytes_sent``; the group-wide collectives, e.g. the
        finiteness flag, are in ``bytes_sent`` only)."""
        out = (self.last_step if kind is None else self.totals.get(kind, PhaseStats())).as_dict()
        for name, level in getattr(self, "levels", {}).items():
            stats = level.last_step if kind is None else level.totals.get(kind, PhaseStats())
            out["bytes_sent"] += stats.bytes_sent
            out["collectives"] += stats.collectives
            out["comm_time_s"] += stats.comm_time_s
            out[f"{name}_bytes_sent"] = stats.bytes_sent
        return out

    def total_dict(self) -> dict[str, Any]:
        """:meth:`stats_dict` summed over every plan name."""
        total: dict[str, Any] = {}
        for name in self.names:
            for key, value in self.stats_dict(name).items():
                total[key] = total.get(key, 0) + value
        return total

    def end_step(self, applied: bool, seconds: float) -> None:
        for stats in (self.totals[self.kind], self.last_step):
            stats.steps += int(applied)
            stats.skipped_steps += int(not applied)
            stats.step_time_s += seconds
        self._in_step = False

    def record_framework(self, kind: str, nbytes: int) -> None:
        """Count one collective of ``nbytes`` (sent by this rank, as the module docstring counts)
        that a framework ran for a step of plan ``kind``: under ``kind``, and in the last step's
        statistics of that step (reported before it began, e.g. during backward: when it begins)."""
        if kind not in self.totals:
            raise ValueError(f"unknown plan name {kind!r}; expected one of {', '.join(map(repr, self.names))}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        for stats in (self.totals[kind], self.last_step if self._in_step else self._early):
            stats.bytes_sent += nbytes
            stats.framework_bytes_sent += nbytes
            stats.collectives += 1

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def _record(self, nbytes: int, seconds: float) -> None:
        for stats in (self.totals[self.kind], self.last_step):
            stats.bytes_sent += nbytes
            stats.collectives += 1
            stats.comm_time_s += seconds

    def all_reduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.all_reduce_mean_(tensor)
        nbytes = allreduce_wire_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        self._record(nbytes, time.perf_counter() - start)
        return out

    def _all_to_all_bytes(self, input: torch.Tensor) -> int:
        n = self.world_size
        return input.numel() * input.element_size() * (n - 1) // n

    def _all_gather_bytes(self, input: torch.Tensor) -> int:
        return input.numel() * input.element_size() * (self.world_size - 1)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.all_to_all(output, input)
        self._record(self._all_to_all_bytes(input), time.perf_counter() - start)
        return out

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.all_gather(output, input)
        self._record(self._all_gather_bytes(input), time.perf_counter() - start)
        return out

    def start_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        start = time.perf_counter()
        handle = self.inner.start_all_to_all(output, input)
        return _Timed(self, handle, self._all_to_all_bytes(input), time.perf_counter() - start)

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        start = time.perf_counter()
        handle = self.inner.start_all_gather(output, input)
        return _Timed(self, handle, self._all_gather_bytes(input), time.perf_counter() - start)

    def start_all_reduce_mean_(self, tensor: torch.Tensor) -> Pending:
        start = time.perf_counter()
        handle = self.inner.start_all_reduce_mean_(tensor)
        nbytes = allreduce_wire_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        return _Timed(self, handle, nbytes, time.perf_counter() - start)

    def barrier(self) -> None:
        self.inner.barrier()


def timed_kernels(kernels: KernelSet, timed: Callable[[str], AbstractContextManager[Any]]) -> KernelSet:
    """``kernels`` with each call inside ``timed(label)``: ``codec_worker``, ``codec_server``,
    ``codec_decode``."""
    def wrap(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with timed(label):
                return fn(*args, **kwargs)
        return run
    # (replace: what the kernels can do, separate_errors and multipliers, stays as it was)
    return dataclasses.replace(kernels, worker_compress_=wrap("codec_worker", kernels.worker_compress_),
                               server_compress_=wrap("codec_server", kernels.server_compress_),
                               decode_=wrap("codec_decode", kernels.decode_))


class StepTimers:
    """The labelled parts of an optimizer step: each is a ``torch.profiler.record_function`` range
    ``onebit.<label>``, and, when callbacks are registered, its host wall time is handed to each
    ``callback(label, seconds)``."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[str, float], None]] = []

    def add(self, callback: Callable[[str, float], None]) -> None:
        if not callable(callback):
            raise TypeError(f"timer must be callable, got {type(callback).__name__}")
        self.callbacks.append(callback)

    @contextlib.contextmanager
    def __call__(self, label: str) -> Iterator[None]:
        with torch.profiler.record_function(f"onebit.{label}"):
            if not self.callbacks:
                yield
                return
            start = time.perf_counter()
            try:
                yield
            finally:
                elapsed = time.perf_counter() - start
                for callback in self.callbacks:
                    callback(label, elapsed)


def l2_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of several tensors together, summed in float64."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))
