"""The one-level model: the step times of DDP + Adam and of a 1-bit Adam compression step on a
link of a given rate (the formulas: :mod:`onebit.estimate`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import MappingProxyType

from ..compression import allreduce_wire_bytes, compressed_wire_bytes, padded_length
from ..engine import DEFAULT_BUCKET_SIZE
from ._args import device_type, int_at_least, real
from .measure import measure_local_costs

# TCP payload per 1500-byte frame (IPv4 + TCP with timestamps: 1448 bytes) over the 1514 bytes the
# frame takes on an Ethernet link (without preamble, FCS and inter-frame gap).
TCP_ETHERNET_EFFICIENCY = 1448 / 1514
DEFAULT_LATENCY_S = 50e-6
#: The fp32 all-reduce's own work per device, GB/s of fp32 data, when ``reduce_gbps`` is not given.
#: cpu: gloo's sums and copies with DDP's bucket copies, what the 10 Gbit/s runs of
#: ``benchmarks/slowlink.py`` show on the project's 2-core machines (~0.5 GB/s); cuda: NCCL reduces
#: on the GPU at memory speed, far faster than any link, so the wire alone sets the time (inf).
REDUCE_GBPS = MappingProxyType({"cpu": 0.5, "cuda": math.inf})


@dataclass(frozen=True)
class SpeedupEstimate:
    """The estimate and its parts (seconds per step; bytes one rank sends per step).

    ``upper_bound`` is True when ``compute_s`` is 0 (not given): forward and backward then cost
    nothing in both steps, and a real step's speedup is lower."""

    speedup: float
    baseline_step_s: float
    compressed_step_s: float
    fp32_wire_s: float
    fp32_reduce_s: float
    onebit_wire_s: float
    onebit_wire_exposed_s: float
    buckets: int
    codec_s: float
    latency_s: float
    compute_s: float
    adam_step_s: float
    onebit_step_s: float
    fp32_bytes: int
    onebit_bytes: int
    codec_gbps: float
    reduce_gbps: float
    bandwidth_gbps: float
    num_params: int
    world_size: int
    device: str
    upper_bound: bool

    def __float__(self) -> float:
        return self.speedup

    def as_dict(self) -> dict:
        return asdict(self)


def fp32_allreduce_bytes(num_params: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``num_params`` float32: ``2(n-1)/n * 4N``."""
    return allreduce_wire_bytes(4 * num_params, world_size)


def onebit_allreduce_bytes(num_params: int, world_size: int) -> int:
    """Bytes one rank sends in one compressed all-reduce of ``num_params`` elements (one bucket):
    ``2(n-1)/n * M/8`` sign bytes plus ``8(n-1)`` scale bytes, ``M`` the padded length."""
    return compressed_wire_bytes(padded_length(num_params, world_size), world_size)


def reduce_gbps_for(device, reduce_gbps: float | None) -> float:
    """``reduce_gbps`` checked, or the device's default (:data:`REDUCE_GBPS`) when None."""
    if reduce_gbps is None:
        return REDUCE_GBPS[device_type(device)]
    return real("reduce_gbps", reduce_gbps, positive=True, allow_inf=True)


def estimate_speedup(
    num_params: int,
    world_size: int,
    bandwidth_gbps: float,
    *,
    codec_gbps: float | None = None,
    compute_s: float = 0.0,
    adam_step_s: float | None = None,
    onebit_step_s: float | None = None,
    latency_s: float = DEFAULT_LATENCY_S,
    reduce_gbps: float | None = None,
    wire_efficiency: float = TCP_ETHERNET_EFFICIENCY,
    buckets: int | None = None,
    overlap_backward: bool = False,
    backward_s: float | None = None,
    device: str = "cpu",
) -> SpeedupEstimate:
    """Expected speedup of a 1-bit Adam compression-phase step over a step with an fp32 ring
    all-reduce of the gradients and ``torch.optim.Adam`` (model: :mod:`onebit.estimate`).

    Args:
        num_params: float32 elements averaged per step (the trainable parameters).
        world_size: data-parallel ranks (>= 2).
        bandwidth_gbps: each rank's link rate in Gbit/s, each direction.
        codec_gbps: codec throughput, GB/s of float32 input (:func:`measure_codec_gbps`).
        compute_s: forward + backward seconds per step, without communication. 0 (the default)
            makes the estimate an upper bound (``SpeedupEstimate.upper_bound``).
        adam_step_s: seconds of a ``torch.optim.Adam`` step on ``num_params``.
        onebit_step_s: seconds of an ``OnebitAdam`` compression step apart from codec and wire.
        latency_s: one-way latency per message; each all-reduce pays ``2(n-1)`` of them.
        reduce_gbps: throughput of the fp32 all-reduce's own work, GB/s of fp32 data
            (``math.inf`` leaves it out); default by ``device`` (:data:`REDUCE_GBPS`).
        wire_efficiency: TCP payload rate over link rate (default: 1500-byte Ethernet frames).
        buckets: compression buckets (``OnebitAdam.num_buckets``); default, the number OnebitAdam's
            default ``bucket_size`` gives for one tensor of ``num_params``: ``ceil(N / 2**24)``.
        overlap_backward: the optimizer's ``overlap_backward``: the transfers of all buckets but
            the last hide behind ``backward_s``.
        backward_s: the backward pass's seconds (default two thirds of ``compute_s``); only with
            ``overlap_backward``.
        device: ``'cpu'`` or ``'cuda'``, where the job's tensors live: picks the default
            ``reduce_gbps`` and where missing local costs are measured.

    ``codec_gbps``, ``adam_step_s`` and ``onebit_step_s`` left as None are measured on this machine
    (:func:`measure_local_costs`, on ``device``). Returns a :class:`SpeedupEstimate`;
    ``float(estimate)`` is the speedup (above 1: compression pays). Raises ``ValueError`` naming an
    argument out of range.
    """
    num_params, n = int_at_least("num_params", num_params, 1), int_at_least("world_size", world_size, 2)
    bandwidth = real("bandwidth_gbps", bandwidth_gbps, positive=True)
    compute_s, latency_s = real("compute_s", compute_s, positive=False), real("latency_s", latency_s, positive=False)
    device = device_type(device)
    reduce_gbps = reduce_gbps_for(device, reduce_gbps)
    efficiency = real("wire_efficiency", wire_efficiency, positive=True, upper=1.0)
    buckets = -(-num_params // DEFAULT_BUCKET_SIZE) if buckets is None else int_at_least("buckets", buckets, 1)
    backward_s = _overlapped_backward(overlap_backward, backward_s, compute_s)
    costs = local_costs(num_params, n, codec_gbps, adam_step_s, onebit_step_s, device=device)
    return _speedup(num_params, n, bandwidth, efficiency, compute_s, latency_s, reduce_gbps, buckets, backward_s,
                    *costs, device)


def _overlapped_backward(overlap_backward: bool, backward_s: float | None, compute_s: float) -> float | None:
    """The backward seconds the transfers can hide behind (None: no overlap), checked."""
    if not isinstance(overlap_backward, bool):
        raise ValueError(f"invalid overlap_backward: {overlap_backward!r}; expected True or False")
    if backward_s is not None and not overlap_backward:
        raise ValueError("backward_s applies only with overlap_backward=True; drop it or pass overlap_backward=True")
    if not overlap_backward:
        return None
    return compute_s * 2 / 3 if backward_s is None else real("backward_s", backward_s, positive=False)


def local_costs(num_params: int, n: int, codec_gbps: float | None, adam_step_s: float | None,
                onebit_step_s: float | None, *, needed: bool = True, device: str = "cpu") -> tuple[float, float, float]:
    """The three local costs, checked; those left as None measured on this machine's ``device``
    (when ``needed``; else left None)."""
    given = {"codec_gbps": codec_gbps, "adam_step_s": adam_step_s, "onebit_step_s": onebit_step_s}
    for name, value in given.items():
        if value is not None:
            real(name, value, positive=name == "codec_gbps")
    if any(v is None for v in given.values()) and needed:
        measured = measure_local_costs(num_params, n, device=device)
        given = {k: getattr(measured, k) if v is None else v for k, v in given.items()}
    return tuple(None if given[k] is None else float(given[k]) for k in ("codec_gbps", "adam_step_s", "onebit_step_s"))


def _speedup(num_params: int, n: int, bandwidth: float, efficiency: float, compute_s: float, latency_s: float,
             reduce_gbps: float, buckets: int, backward_s: float | None, codec_gbps: float, adam_step_s: float,
             onebit_step_s: float, device: str) -> SpeedupEstimate:
    """:func:`estimate_speedup`'s model of both steps, from checked arguments (``backward_s``
    None: no overlap with backward)."""
    goodput = bandwidth * 1e9 / 8 * efficiency  # TCP payload bytes per second
    fp32_bytes = fp32_allreduce_bytes(num_params, n)
    onebit_bytes = onebit_allreduce_bytes(num_params, n)
    fp32_wire_s = fp32_bytes / goodput
    fp32_reduce_s = 4 * num_params / (reduce_gbps * 1e9)
    onebit_wire_s = onebit_bytes / goodput
    codec_s = 4 * padded_length(num_params, n) / (codec_gbps * 1e9)
    latency = 2 * (n - 1) * latency_s
    baseline = compute_s + adam_step_s + max(fp32_wire_s, fp32_reduce_s) + latency
    if backward_s is not None:
        exposed_s = onebit_wire_s / buckets + max(0.0, onebit_wire_s * (buckets - 1) / buckets - backward_s)
    else:
        exposed_s = onebit_wire_s - min(onebit_wire_s, codec_s) * (buckets - 1) / buckets
    compressed = compute_s + onebit_step_s + codec_s + exposed_s + latency
    return SpeedupEstimate(
        speedup=baseline / compressed, baseline_step_s=baseline, compressed_step_s=compressed,
        fp32_wire_s=fp32_wire_s, fp32_reduce_s=fp32_reduce_s, onebit_wire_s=onebit_wire_s,
        onebit_wire_exposed_s=exposed_s, buckets=buckets, codec_s=codec_s,
        latency_s=latency, compute_s=compute_s, adam_step_s=adam_step_s, onebit_step_s=onebit_step_s,
        fp32_bytes=fp32_bytes, onebit_bytes=onebit_bytes, codec_gbps=codec_gbps, reduce_gbps=reduce_gbps,
        bandwidth_gbps=bandwidth, num_params=num_params, world_size=n, device=device, upper_bound=compute_s == 0,
    )


#: Said after the speedup when ``compute_s`` is 0.
UPPER_BOUND_NOTE = ("an upper bound: no compute time was given (compute_s, --compute-s), so forward and backward "
                    "count as 0 s; a real step's speedup is lower")


def format_estimate(est: SpeedupEstimate) -> str:
    """A few lines of text for people."""
    ms = lambda s: f"{s * 1e3:8.1f} ms"
    reduce = "off" if math.isinf(est.reduce_gbps) else f"at {est.reduce_gbps:g} GB/s"
    verdict = "" if est.speedup > 1.05 else " (compression does not pay on this link)"
    return "\n".join([
        f"{est.num_params / 1e6:.1f}M float32 parameters, {est.world_size} ranks, {est.bandwidth_gbps:g} Gbit/s "
        f"per rank, {est.device}, codec {est.codec_gbps:.2f} GB/s, fp32 reduce {reduce}",
        f"  bytes per rank per step: fp32 ring all-reduce {est.fp32_bytes:,}; 1-bit {est.onebit_bytes:,} "
        f"({est.fp32_bytes / est.onebit_bytes:.1f}x fewer)",
        f"  fp32 + Adam step: compute {ms(est.compute_s)} + Adam  {ms(est.adam_step_s)} + max(wire "
        f"{ms(est.fp32_wire_s)}, reduce {ms(est.fp32_reduce_s)}) = {ms(est.baseline_step_s)}",
        f"  1-bit step:       compute {ms(est.compute_s)} + maths {ms(est.onebit_step_s)} + wire "
        f"{ms(est.onebit_wire_exposed_s)} + codec  {ms(est.codec_s)} = {ms(est.compressed_step_s)}"
        f"  (wire {est.onebit_wire_s * 1e3:.1f} ms over {est.buckets} bucket(s), the rest hidden behind the codec)",
        f"  expected speedup of the compression phase: {'at most ' if est.upper_bound else ''}{est.speedup:.2f}x"
        + verdict + (f"\n  ({UPPER_BOUND_NOTE})" if est.upper_bound else ""),
    ]) + "\n"
