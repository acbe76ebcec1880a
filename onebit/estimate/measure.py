"""What one rank spends per step apart from the network, measured on this machine.

Three costs, on a sample of at most one default bucket (16M parameters), scaled linearly to the
model: the codec's throughput (worker compress, server compress of this rank's chunk, decode), a
``torch.optim.Adam`` step, and the rest of an ``OnebitAdam`` compression step (its step less its
codec time). Each is timed ``repeats`` times after one untimed run; :class:`Measured` keeps every
run, so that the spread can be reported next to the median.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Callable

import torch

from ..compression import chunk_bytes, padded_length, row_bytes
from ..kernels import get_kernels
from ._args import device_type, int_at_least

#: One default OnebitAdam bucket: the same temporaries, the same allocator path, larger than caches.
DEFAULT_SAMPLE = 1 << 24
#: Timed runs of each cost when measuring for the command line.
DEFAULT_REPEATS = 5


@dataclass(frozen=True)
class LocalCosts:
    """What one rank spends per step on ``num_params`` parameters apart from the network."""

    num_params: int
    codec_gbps: float
    adam_step_s: float
    onebit_step_s: float

    def as_dict(self) -> dict:
        return asdict(self)

    def scaled(self, num_params: int) -> LocalCosts:
        """The same costs for ``num_params`` parameters: step times scale linearly, the codec's
        throughput stays."""
        scale = num_params / self.num_params
        return replace(self, num_params=num_params, adam_step_s=self.adam_step_s * scale,
                       onebit_step_s=self.onebit_step_s * scale)


@dataclass(frozen=True)
class Measured:
    """Every timed run of :func:`measure_spread` (each a :class:`LocalCosts`) and where it ran."""

    samples: tuple[LocalCosts, ...]
    device: str
    threads: int
    world_size: int
    measured_at: str  # UTC, ISO 8601

    @property
    def median(self) -> LocalCosts:
        """Each cost's median over the runs."""
        return LocalCosts(self.samples[0].num_params, *(statistics.median(getattr(s, k) for s in self.samples)
                                                        for k in ("codec_gbps", "adam_step_s", "onebit_step_s")))

    def bounds(self) -> tuple[LocalCosts, LocalCosts]:
        """``(low, high)``: each cost at the end of its range least (most) favourable to compression:
        the slowest (fastest) codec and 1-bit step, the fastest (slowest) Adam step."""
        codec = [s.codec_gbps for s in self.samples]
        adam = [s.adam_step_s for s in self.samples]
        onebit = [s.onebit_step_s for s in self.samples]
        n = self.samples[0].num_params
        return (LocalCosts(n, min(codec), min(adam), max(onebit)), LocalCosts(n, max(codec), max(adam), min(onebit)))

    def scaled(self, num_params: int) -> Measured:
        return replace(self, samples=tuple(s.scaled(num_params) for s in self.samples))

    def as_dict(self) -> dict:
        low, high = self.bounds()
        return {"median": self.median.as_dict(), "low": low.as_dict(), "high": high.as_dict(),
                "samples": [s.as_dict() for s in self.samples], "device": self.device, "threads": self.threads,
                "world_size": self.world_size, "measured_at": self.measured_at}

    @classmethod
    def from_dict(cls, data: dict) -> Measured:
        return cls(samples=tuple(LocalCosts(**s) for s in data["samples"]), device=data["device"],
                   threads=int(data["threads"]), world_size=int(data["world_size"]), measured_at=data["measured_at"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times(fn: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn``, after one untimed call (first touch of the buffers,
    kernel build or load, optimizer state); on a GPU each call is timed to its completion."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def checked_device(device) -> torch.device:
    """``device`` as a ``torch.device`` that this machine can measure on."""
    kind = device_type(device)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "cannot measure a CUDA job's local costs here: torch sees no CUDA device; run the estimate "
            "with device 'cuda' on the training machine, or give codec_gbps, adam_step_s and onebit_step_s "
            "(--codec-gbps, --adam-step-s, --onebit-step-s) measured there")
    return torch.device(device if isinstance(device, torch.device) else str(device))


def _codec_times(world_size: int, numel: int, repeats: int, kernels: str | None,
                 device: torch.device) -> tuple[list[float], int]:
    n = world_size
    impl = get_kernels(device, kernels)
    padded = padded_length(numel, n)
    signs, row = chunk_bytes(padded, n), row_bytes(padded, n)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(padded, generator=gen).to(device)
    worker_error = torch.zeros(padded, device=device)
    server_error = torch.zeros(padded // n, device=device)
    send = torch.zeros(n, row, dtype=torch.uint8, device=device)
    recv = torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=gen).to(device)
    gathered = torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=gen).to(device)
    scales = (torch.rand(n, generator=gen) + 0.5).to(device)
    out = torch.empty(padded, device=device)
    packed = torch.zeros(signs, dtype=torch.uint8, device=device)

    def once() -> None:
        impl.worker_compress_(x, worker_error, send[:, :signs])
        impl.server_compress_(recv[:, :signs], scales, server_error, packed)
        impl.decode_(gathered[:, :signs], scales, out)

    return _times(once, repeats, device), padded


def measure_codec_gbps(world_size: int = 2, numel: int = DEFAULT_SAMPLE, *, repeats: int = 3,
                       kernels: str | None = None, device: str = "cpu") -> float:
    """Codec throughput on this machine: GB/s of float32 input for one rank's share of a compressed
    all-reduce of ``numel`` elements on ``world_size`` ranks (worker compress, server compress of
    its chunk from ``world_size`` rows, decode), the median of ``repeats`` runs, with torch's
    current thread count, on ``device`` (``'cpu'`` or ``'cuda'``). ``kernels`` as in ``OnebitAdam``
    (default ``'auto'``). A ``numel`` larger than the caches (the default: 64 MiB of floats) shows
    memory speed, as in training."""
    n = int_at_least("world_size", world_size, 1)
    numel = int_at_least("numel", numel, 1)
    repeats = int_at_least("repeats", repeats, 1)
    times, padded = _codec_times(n, numel, repeats, kernels, checked_device(device))
    return 4 * padded / statistics.median(times) / 1e9


def _parameters(size: int, device: torch.device) -> list[torch.Tensor]:
    """``size`` parameters in tensors of 1M elements (and a remainder), with random gradients."""
    pieces = [1 << 20] * (size // (1 << 20)) + ([size % (1 << 20)] if size % (1 << 20) else [])
    out = []
    for k in pieces:
        p = torch.nn.Parameter(torch.randn(k, device=device) * 0.01)
        p.grad = torch.randn(k, device=device)
        out.append(p)
    return out


def _onebit_times(size: int, repeats: int, kernels: str | None, device: torch.device, codec_s: float) -> list[float]:
    """Seconds of an ``OnebitAdam`` compression step on one process less its codec time: on a CPU
    the codec's time as it ran in each step (a separate measurement, subtracted, is noisier on a
    loaded machine); on a GPU, where the step's host timers see only kernel launches, ``codec_s``."""
    from ..adam import OnebitAdam
    from ..backends import LocalBackend

    onebit = OnebitAdam(_parameters(size, device), lr=1e-6, freeze_step=1, backend=LocalBackend(), kernels=kernels)
    onebit.step()  # warmup step: the variance is frozen after it
    in_codec = [0.0]

    def timer(label: str, seconds: float) -> None:
        if label.startswith("codec_"):
            in_codec[0] += seconds

    onebit.register_timer(timer)

    def maths() -> float:
        in_codec[0] = 0.0
        _sync(device)
        start = time.perf_counter()
        onebit.step()
        _sync(device)
        return max(0.0, time.perf_counter() - start - (in_codec[0] if device.type == "cpu" else codec_s))

    maths()  # first compression step: the frozen denominator and masks are built once
    return [maths() for _ in range(repeats)]


def measure_spread(num_params: int, world_size: int = 2, *, sample: int = DEFAULT_SAMPLE,
                   repeats: int = DEFAULT_REPEATS, kernels: str | None = None, device: str = "cpu") -> Measured:
    """Measure the three local costs ``repeats`` times on ``min(num_params, sample)`` parameters on
    ``device``, each run scaled to ``num_params``: the codec throughput (as
    :func:`measure_codec_gbps`), a ``torch.optim.Adam`` step, and an ``OnebitAdam`` compression step
    on one process (world size 1) less its codec time. Raises ``ValueError`` for a CUDA device
    that torch does not see."""
    num_params = int_at_least("num_params", num_params, 1)
    n = int_at_least("world_size", world_size, 1)
    size = min(num_params, int_at_least("sample", sample, 8))
    repeats = int_at_least("repeats", repeats, 1)
    dev = checked_device(device)
    codec_s, padded = _codec_times(n, size, repeats, kernels, dev)
    adam = torch.optim.Adam(_parameters(size, dev), lr=1e-6)
    adam_s = _times(adam.step, repeats, dev)
    del adam
    onebit_s = _onebit_times(size, repeats, kernels, dev, statistics.median(codec_s))
    samples = tuple(LocalCosts(size, 4 * padded / c / 1e9, a, o).scaled(num_params)
                    for c, a, o in zip(codec_s, adam_s, onebit_s))
    return Measured(samples=samples, device=dev.type, threads=torch.get_num_threads(), world_size=n,
                    measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def measure_local_costs(num_params: int, world_size: int = 2, *, sample: int = DEFAULT_SAMPLE, repeats: int = 3,
                        kernels: str | None = None, device: str = "cpu") -> LocalCosts:
    """The median of :func:`measure_spread`'s runs: on ``min(num_params, sample)`` parameters,
    scaled to ``num_params``, the codec throughput, a ``torch.optim.Adam`` step, and an
    ``OnebitAdam`` compression step less its codec time."""
    return measure_spread(num_params, world_size, sample=sample, repeats=repeats, kernels=kernels,
                          device=device).median
