"""Should I compress? The expected speedup of a compression-phase step on a given link.

A first-order model of one data-parallel step on ``n`` ranks holding ``N`` float32 parameters,
each rank on a full-duplex link of ``B`` Gbit/s. What runs on one CPU is measured on this machine;
only the network is modelled::

    fp32 step   = compute_s + adam_step_s   + max(fp32_wire, fp32_reduce)    + 2 (n-1) latency_s
    1-bit step  = compute_s + onebit_step_s + codec + exposed(onebit_wire)  + 2 (n-1) latency_s

* ``fp32_wire = 2 (n-1)/n * 4N bytes / goodput``: a bandwidth-optimal (ring) all-reduce;
* ``fp32_reduce = 4N bytes / reduce_gbps``: the all-reduce's own CPU work (gloo sums and copies
  on the CPU, DDP copies into and out of its buckets; NCCL on GPUs: pass ``math.inf``). A ring
  all-reduce sums one chunk while the next is on the wire, so the slower of the two sets its time;
  the 1-bit codec runs before and after its transfers, so codec and wire add up;
* ``onebit_wire = 2 (n-1) * (M/(8n) + 4) bytes / goodput``: the all-to-all and all-gather of
  :func:`onebit.collectives.compressed_allreduce_`, ``M`` the padded length;
* ``exposed(w) = w - min(w, codec) * (k-1)/k`` with ``k`` buckets: OnebitAdam pipelines its
  buckets, so the transfers of all but one bucket can hide behind the codec work of the others
  (with one bucket nothing is hidden); with ``overlap_backward=True`` they start during backward
  instead: ``exposed(w) = w/k + max(0, w (k-1)/k - backward_s)`` (the last bucket's transfers
  start after backward; the others' hide behind what is left of it);
* ``goodput = B * wire_efficiency``: TCP payload rate (default 1448/1514: 1500-byte Ethernet frames);
* ``codec = 4M bytes / codec_gbps``: this rank's worker compress, server compress and decode;
* ``adam_step_s``: a ``torch.optim.Adam`` step on ``N`` parameters; ``onebit_step_s``: the rest of
  an ``OnebitAdam`` compression step (finiteness check, momentum, mask, update), i.e.
  a local step minus its codec time; ``compute_s``: forward + backward.

``codec_gbps``, ``adam_step_s`` and ``onebit_step_s`` are measured here when not given
(:func:`measure_local_costs`, on a sample of at most one default bucket, 16M parameters, scaled
linearly; a few seconds), so run the estimate on the machine that will train, with the thread count it will use.
The model leaves out what DDP's overlap of the all-reduce with backward hides (at most the
backward time) and the slowdown of memory-bound work when other processes share the memory bus.

Two levels (:func:`estimate_two_level`): ``P`` nodes of ``L`` ranks, the node's network link of
``B_node`` Gbit/s each direction (all its NICs together) and each rank's link inside the node of
``B_intra`` Gbit/s. Per scheme it counts the bytes each node sends to the others
(:func:`two_level_wire_bytes`, in units of ``M/8``, sign bytes only; the formulas add the 4-byte
scales)::

    fp32 ring all-reduce      64 (n-1)/n                  (a ring of node-contiguous ranks)
    flat 1-bit                L (P-1)/P + (n-1)/n         (personalized all-to-all, ring all-gather)
    compressed, node_mean     2 (P-1)/P                   (:mod:`onebit.hierarchy`)

and the bytes each rank sends inside its node: flat ``(L-1)/n + (n-1)/n`` (at most), compressed
``2 (L-1)/L``, node_mean ``32 (L-1)/L + (L-1)/L`` (float32 shards). The two-level stages run one
after another (intra, inter, inter, intra), so their wire time is
``inter / B_node + intra / B_intra``; the flat scheme's and the ring's transfers share their
stages, so each stage takes the slower of its inter- and intra-node parts.

Command line::

    python -m onebit.estimate --params 50e6 --world-size 8 --bandwidth-gbps 10
    python -m onebit.estimate --params 8.4e6 --world-size 4 --bandwidth-gbps 0.1 --ranks-per-node 2 --intra-gbps 2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from .compression import allreduce_wire_bytes, chunk_bytes, compressed_wire_bytes, padded_length, row_bytes
from .kernels import get_kernels
from .engine import DEFAULT_BUCKET_SIZE

__all__ = [
    "SpeedupEstimate",
    "LocalCosts",
    "estimate_speedup",
    "measure_codec_gbps",
    "measure_local_costs",
    "fp32_allreduce_bytes",
    "onebit_allreduce_bytes",
    "SCHEMES",
    "SchemeEstimate",
    "TwoLevelEstimate",
    "estimate_two_level",
    "two_level_wire_bytes",
    "TCP_ETHERNET_EFFICIENCY",
]

# TCP payload per 1500-byte frame (IPv4 + TCP with timestamps: 1448 bytes) over the 1514 bytes the
# frame takes on an Ethernet link (without preamble, FCS and inter-frame gap).
TCP_ETHERNET_EFFICIENCY = 1448 / 1514
DEFAULT_LATENCY_S = 50e-6
# gloo's CPU work in DDP's fp32 all-reduce (with its bucket copies), GB/s of fp32 data: what the
# 10 Gbit/s runs of benchmarks/slowlink.py show on the project's 2-core machines (~0.5 GB/s).
DEFAULT_REDUCE_GBPS = 0.5
DEFAULT_SAMPLE = 1 << 24  # one default OnebitAdam bucket: the same temporaries, the same allocator path
#: The schemes of :func:`estimate_two_level`: DDP's fp32 all-reduce, the flat 1-bit all-reduce, and
#: the two ``hierarchy_variant`` values.
SCHEMES = ("fp32", "flat", "compressed", "node_mean")
# Passes of the codec over the buffer, relative to the flat scheme's worker compress + server
# compress + decode (3 passes): each stage costs about one pass over the larger of its input and
# output. compressed: + the node server (L rows of M/L); node_mean: worker and server on the shard
# (2/L), decode (1), the node mean (1).
_CODEC_PASSES = {"flat": lambda L: 3.0, "compressed": lambda L: 3.0 + 1.0 / L,
                 "node_mean": lambda L: 2.0 + 2.0 / L}


@dataclass(frozen=True)
class LocalCosts:
    """What one rank's CPU spends per step on ``num_params`` parameters (measured)."""

    num_params: int
    codec_gbps: float
    adam_step_s: float
    onebit_step_s: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SpeedupEstimate:
    """The estimate and its parts (seconds per step; bytes one rank sends per step)."""

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
    bandwidth_gbps: float
    num_params: int
    world_size: int

    def __float__(self) -> float:
        return self.speedup

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------ validation


def _int_at_least(name: str, value, minimum: int) -> int:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value != int(value) or int(value) < minimum:
        raise ValueError(f"invalid {name}: {value!r}; expected an integer >= {minimum}")
    return int(value)


def _real(name: str, value, *, positive: bool, upper: float | None = None, allow_inf: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)
    ok = ok and (allow_inf or math.isfinite(value))
    if not ok or (value <= 0 if positive else value < 0) or (upper is not None and value > upper):
        bound = ("> 0" if positive else ">= 0") + (f" and <= {upper}" if upper is not None else "")
        raise ValueError(f"invalid {name}: {value!r}; expected a finite number {bound}")
    return float(value)


# ------------------------------------------------------------------------------------ bytes


def fp32_allreduce_bytes(num_params: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``num_params`` float32: ``2(n-1)/n * 4N``."""
    return allreduce_wire_bytes(4 * num_params, world_size)


def onebit_allreduce_bytes(num_params: int, world_size: int) -> int:
    """Bytes one rank sends in one compressed all-reduce of ``num_params`` elements (one bucket):
    ``2(n-1)/n * M/8`` sign bytes plus ``8(n-1)`` scale bytes, ``M`` the padded length."""
    return compressed_wire_bytes(padded_length(num_params, world_size), world_size)


def two_level_wire_bytes(num_params: int, nodes: int, ranks_per_node: int, *,
                         segments: int = 1) -> dict[str, tuple[int, int]]:
    """Bytes per compression step (one bucket of ``num_params`` elements in ``segments`` tensors)
    on ``nodes`` (P) nodes of ``ranks_per_node`` (L) ranks, for each of :data:`SCHEMES`:
    ``(inter, intra)``, ``inter`` what one node sends to the other nodes (each direction of its
    link), ``intra`` what one rank sends to the ranks of its own node (at most).

    With ``n = P L``, ``M`` the padded length, a row ``r_n = M/(8n) + 4 segments`` and
    ``r_L = M/(8L) + 4 segments``:

    * fp32 ring all-reduce: ``2(n-1)/n * 4N`` on each ring edge, one of which leaves each node;
    * flat: all-to-all ``L * L(P-1)`` rows ``r_n`` out of the node, ``L-1`` inside per rank; ring
      all-gather ``n-1`` rows ``r_n`` on each edge;
    * compressed: inter ``2 L (P-1) r_n`` (cross all-to-all and all-gather); intra
      ``(L-1) (r_L + P r_n)`` (1-bit all-to-all, all-gather of the node's ``P`` rows);
    * node_mean: inter as compressed; intra ``(L-1) (4M/L + P r_n)`` (float32 shards).
    """
    p = _int_at_least("nodes", nodes, 1)
    local = _int_at_least("ranks_per_node", ranks_per_node, 1)
    num_params = _int_at_least("num_params", num_params, 1)
    k = _int_at_least("segments", segments, 1)
    n = p * local
    padded = padded_length(num_params, n)
    row_n, row_l = row_bytes(padded, n, k), row_bytes(padded, local, k)
    ring = allreduce_wire_bytes(4 * num_params, n)
    cross = 2 * local * (p - 1) * row_n
    intra_gather = (local - 1) * p * row_n
    return {
        "fp32": (ring if p > 1 else 0, ring if local > 1 else 0),
        "flat": (local * local * (p - 1) * row_n + ((n - 1) * row_n if p > 1 else 0),
                 (local - 1) * row_n + ((n - 1) * row_n if local > 1 else 0)),
        "compressed": (cross, (local - 1) * row_l + intra_gather),
        "node_mean": (cross, (local - 1) * 4 * padded // local + intra_gather),
    }


# ------------------------------------------------------------------------------------ measurements


def _median_time(fn, repeats: int) -> float:
    fn()  # first touch of the buffers, kernel build or load, optimizer state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _codec_seconds(world_size: int, numel: int, repeats: int, kernels: str | None) -> tuple[float, int]:
    n = world_size
    impl = get_kernels("cpu", kernels)
    padded = padded_length(numel, n)
    signs, row = chunk_bytes(padded, n), row_bytes(padded, n)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(padded, generator=gen)
    worker_error = torch.zeros(padded)
    server_error = torch.zeros(padded // n)
    send = torch.zeros(n, row, dtype=torch.uint8)
    recv = torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=gen)
    gathered = torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, generator=gen) + 0.5
    out = torch.empty(padded)
    packed = torch.zeros(signs, dtype=torch.uint8)

    def once() -> None:
        impl.worker_compress_(x, worker_error, send[:, :signs])
        impl.server_compress_(recv[:, :signs], scales, server_error, packed)
        impl.decode_(gathered[:, :signs], scales, out)

    return _median_time(once, repeats), padded


def measure_codec_gbps(world_size: int = 2, numel: int = DEFAULT_SAMPLE, *, repeats: int = 3,
                       kernels: str | None = None) -> float:
    """Codec throughput on this CPU: GB/s of float32 input for one rank's share of a compressed
    all-reduce of ``numel`` elements on ``world_size`` ranks (worker compress, server compress of
    its chunk from ``world_size`` rows, decode), the median of ``repeats`` runs, with torch's
    current thread count. ``kernels`` as in ``OnebitAdam`` (default ``'auto'``). A ``numel`` larger
    than the caches (the default: 64 MiB of floats) shows memory speed, as in training."""
    n = _int_at_least("world_size", world_size, 1)
    numel = _int_at_least("numel", numel, 1)
    repeats = _int_at_least("repeats", repeats, 1)
    seconds, padded = _codec_seconds(n, numel, repeats, kernels)
    return 4 * padded / seconds / 1e9


def measure_local_costs(num_params: int, world_size: int = 2, *, sample: int = DEFAULT_SAMPLE, repeats: int = 3,
                        kernels: str | None = None) -> LocalCosts:
    """Measure on this CPU, on ``min(num_params, sample)`` parameters, scaled to ``num_params``:
    the codec throughput (:func:`measure_codec_gbps`), a ``torch.optim.Adam`` step, and an
    ``OnebitAdam`` compression step on one process (world size 1) minus its own codec time."""
    from .backends import LocalBackend
    from .adam import OnebitAdam

    num_params = _int_at_least("num_params", num_params, 1)
    n = _int_at_least("world_size", world_size, 1)
    size = min(num_params, _int_at_least("sample", sample, 8))
    repeats = _int_at_least("repeats", repeats, 1)
    scale = num_params / size
    codec_gbps = measure_codec_gbps(n, size, repeats=repeats, kernels=kernels)

    def tensors() -> list[torch.Tensor]:
        pieces = [1 << 20] * (size // (1 << 20)) + ([size % (1 << 20)] if size % (1 << 20) else [])
        out = []
        for k in pieces:
            p = torch.nn.Parameter(torch.randn(k) * 0.01)
            p.grad = torch.randn(k)
            out.append(p)
        return out

    params = tensors()
    adam = torch.optim.Adam(params, lr=1e-6)
    adam_s = _median_time(adam.step, repeats)
    del adam, params
    params = tensors()
    onebit = OnebitAdam(params, lr=1e-6, freeze_step=1, backend=LocalBackend(), kernels=kernels)
    onebit.step()  # warmup step: the variance is frozen after it
    # The codec's own time is taken out of each step as it ran in that step (a separate codec
    # measurement, subtracted, is noisier than the whole remainder on a loaded machine).
    in_codec = [0.0]

    def timer(label: str, seconds: float) -> None:
        if label.startswith("codec_"):
            in_codec[0] += seconds

    onebit.register_timer(timer)

    def maths() -> float:
        in_codec[0] = 0.0
        start = time.perf_counter()
        onebit.step()
        return time.perf_counter() - start - in_codec[0]

    maths()  # first compression step: the frozen denominator and masks are built once
    onebit_s = statistics.median(maths() for _ in range(repeats))
    return LocalCosts(num_params=num_params, codec_gbps=codec_gbps, adam_step_s=adam_s * scale,
                      onebit_step_s=onebit_s * scale)


# ------------------------------------------------------------------------------------ the estimate


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
    reduce_gbps: float = DEFAULT_REDUCE_GBPS,
    wire_efficiency: float = TCP_ETHERNET_EFFICIENCY,
    buckets: int | None = None,
    overlap_backward: bool = False,
    backward_s: float | None = None,
) -> SpeedupEstimate:
    """Expected speedup of a 1-bit Adam compression-phase step over a step with an fp32 ring
    all-reduce of the gradients and ``torch.optim.Adam`` (model: the module docstring).

    Args:
        num_params: float32 elements averaged per step (the trainable parameters).
        world_size: data-parallel ranks (>= 2).
        bandwidth_gbps: each rank's link rate in Gbit/s, each direction.
        codec_gbps: codec throughput, GB/s of float32 input (:func:`measure_codec_gbps`).
        compute_s: forward + backward seconds per step, without communication.
        adam_step_s: seconds of a ``torch.optim.Adam`` step on ``num_params``.
        onebit_step_s: seconds of an ``OnebitAdam`` compression step apart from codec and wire.
        latency_s: one-way latency per message; each all-reduce pays ``2(n-1)`` of them.
        reduce_gbps: CPU throughput of the fp32 all-reduce's own work, GB/s of fp32 data
            (``math.inf`` to leave it out, e.g. for NCCL on GPUs).
        wire_efficiency: TCP payload rate over link rate (default: 1500-byte Ethernet frames).
        buckets: compression buckets (``OnebitAdam.num_buckets``); default, the number OnebitAdam's
            default ``bucket_size`` gives for one tensor of ``num_params``: ``ceil(N / 2**24)``.
        overlap_backward: the optimizer's ``overlap_backward``: the transfers of all buckets but
            the last hide behind ``backward_s``.
        backward_s: the backward pass's seconds (default two thirds of ``compute_s``); only with
            ``overlap_backward``.

    ``codec_gbps``, ``adam_step_s`` and ``onebit_step_s`` left as None are measured on this machine
    (:func:`measure_local_costs`). Returns a :class:`SpeedupEstimate`; ``float(estimate)`` is the
    speedup (above 1: compression pays). Raises ``ValueError`` naming an argument out of range.
    """
    num_params = _int_at_least("num_params", num_params, 1)
    n = _int_at_least("world_size", world_size, 2)
    bandwidth = _real("bandwidth_gbps", bandwidth_gbps, positive=True)
    compute_s = _real("compute_s", compute_s, positive=False)
    latency_s = _real("latency_s", latency_s, positive=False)
    reduce_gbps = _real("reduce_gbps", reduce_gbps, positive=True, allow_inf=True)
    efficiency = _real("wire_efficiency", wire_efficiency, positive=True, upper=1.0)
    buckets = -(-num_params // DEFAULT_BUCKET_SIZE) if buckets is None else _int_at_least("buckets", buckets, 1)
    if not isinstance(overlap_backward, bool):
        raise ValueError(f"invalid overlap_backward: {overlap_backward!r}; expected True or False")
    if backward_s is not None and not overlap_backward:
        raise ValueError("backward_s applies only with overlap_backward=True; drop it or pass overlap_backward=True")
    backward_s = compute_s * 2 / 3 if backward_s is None else _real("backward_s", backward_s, positive=False)
    codec_gbps, adam_step_s, onebit_step_s = _local_costs(num_params, n, codec_gbps, adam_step_s, onebit_step_s)
    return _speedup(num_params, n, bandwidth, efficiency, compute_s, latency_s, reduce_gbps, buckets,
                    backward_s if overlap_backward else None, codec_gbps, adam_step_s, onebit_step_s)


def _local_costs(num_params: int, n: int, codec_gbps: float | None, adam_step_s: float | None,
                 onebit_step_s: float | None, needed: bool = True) -> tuple[float, float, float]:
    """The three local costs, checked; those left as None measured on this machine (when
    ``needed``; else left None)."""
    given = {"codec_gbps": codec_gbps, "adam_step_s": adam_step_s, "onebit_step_s": onebit_step_s}
    for name, value in given.items():
        if value is not None:
            _real(name, value, positive=name == "codec_gbps")
    if any(v is None for v in given.values()) and needed:
        measured = measure_local_costs(num_params, n)
        given = {k: getattr(measured, k) if v is None else v for k, v in given.items()}
    return tuple(None if given[k] is None else float(given[k]) for k in ("codec_gbps", "adam_step_s", "onebit_step_s"))


def _speedup(num_params: int, n: int, bandwidth: float, efficiency: float, compute_s: float, latency_s: float,
             reduce_gbps: float, buckets: int, backward_s: float | None, codec_gbps: float, adam_step_s: float,
             onebit_step_s: float) -> SpeedupEstimate:
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
        fp32_bytes=fp32_bytes, onebit_bytes=onebit_bytes, codec_gbps=codec_gbps, bandwidth_gbps=bandwidth,
        num_params=num_params, world_size=n,
    )


@dataclass(frozen=True)
class SchemeEstimate:
    """One scheme of :func:`estimate_two_level` (seconds per step; bytes per step)."""

    scheme: str
    inter_node_bytes: int
    intra_node_bytes: int
    inter_wire_s: float
    intra_wire_s: float
    wire_s: float
    local_s: float
    latency_s: float
    step_s: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TwoLevelEstimate:
    """Per-scheme estimates (``schemes``, keyed by :data:`SCHEMES`) for one configuration."""

    num_params: int
    nodes: int
    ranks_per_node: int
    inter_node_gbps: float
    intra_node_gbps: float
    compute_s: float
    schemes: dict

    def __getitem__(self, scheme: str) -> SchemeEstimate:
        return self.schemes[scheme]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["schemes"] = {k: v.as_dict() for k, v in self.schemes.items()}
        return out


def estimate_two_level(
    num_params: int,
    nodes: int,
    ranks_per_node: int,
    inter_node_gbps: float,
    intra_node_gbps: float,
    *,
    compute_s: float = 0.0,
    codec_gbps: float | None = None,
    adam_step_s: float | None = None,
    onebit_step_s: float | None = None,
    local_s: dict[str, float] | None = None,
    segments: int = 1,
    latency_s: float = DEFAULT_LATENCY_S,
    reduce_gbps: float = DEFAULT_REDUCE_GBPS,
    wire_efficiency: float = TCP_ETHERNET_EFFICIENCY,
) -> TwoLevelEstimate:
    """Wire time and step time of a compression-phase step for each of :data:`SCHEMES` on
    ``nodes`` (P) nodes of ``ranks_per_node`` (L) ranks (model: the module docstring).

    Args:
        num_params: float32 elements averaged per step (one bucket; no pipelining across buckets).
        nodes: ``P``, the number of nodes.
        ranks_per_node: ``L``, ranks on each node.
        inter_node_gbps: a node's link to the other nodes, Gbit/s each direction (all its NICs).
        intra_node_gbps: one rank's payload rate to the ranks of its node, Gbit/s each direction
            (NVLink, PCIe, or in an emulation the loopback).
        compute_s: forward + backward seconds per step.
        codec_gbps: as in :func:`estimate_speedup` (measured here when None and needed); the
            codec of each 1-bit scheme is the flat codec times its passes over the buffer
            (compressed ``1 + 1/(3L)``, node_mean ``(2 + 2/L)/3``).
        adam_step_s: as in :func:`estimate_speedup` (measured here when None and needed).
        onebit_step_s: as in :func:`estimate_speedup` (measured here when None and needed).
        local_s: seconds per step of each scheme apart from compute and communication (for fp32
            the Adam step; for 1-bit schemes maths and codec), overriding the modelled ones,
            e.g. measured in a run; schemes it leaves out are modelled.
        segments: tensors in the bucket (one float32 scale per tensor in each wire row).
        latency_s: per message; fp32 and flat pay ``2(n-1)``, the two-level schemes
            ``2(P-1) + 2(L-1)``.
        reduce_gbps: CPU throughput of the fp32 all-reduce's own work (see :func:`estimate_speedup`).
        wire_efficiency: TCP payload over link rate between nodes (inside a node: 1).

    Raises ``ValueError`` naming an argument out of range.
    """
    num_params = _int_at_least("num_params", num_params, 1)
    p, local = _nodes(nodes, ranks_per_node)
    inter = _real("inter_node_gbps", inter_node_gbps, positive=True)
    intra = _real("intra_node_gbps", intra_node_gbps, positive=True, allow_inf=True)
    compute_s = _real("compute_s", compute_s, positive=False)
    latency_s = _real("latency_s", latency_s, positive=False)
    reduce_gbps = _real("reduce_gbps", reduce_gbps, positive=True, allow_inf=True)
    efficiency = _real("wire_efficiency", wire_efficiency, positive=True, upper=1.0)
    local_s = _checked_local_s(local_s)
    costs = _local_costs(num_params, p * local, codec_gbps, adam_step_s, onebit_step_s, needed=bool(set(SCHEMES) - set(local_s)))
    nbytes = two_level_wire_bytes(num_params, p, local, segments=segments)
    rates = (inter * 1e9 / 8 * efficiency, intra * 1e9 / 8)  # payload bytes per second between and inside nodes
    schemes = {scheme: _scheme_estimate(scheme, nbytes[scheme], rates, num_params, p, local, segments, reduce_gbps,
                                        local_s, costs, compute_s, latency_s) for scheme in SCHEMES}
    return TwoLevelEstimate(num_params=num_params, nodes=p, ranks_per_node=local, inter_node_gbps=inter,
                            intra_node_gbps=intra, compute_s=compute_s, schemes=schemes)


def _nodes(nodes: int, ranks_per_node: int) -> tuple[int, int]:
    p = _int_at_least("nodes", nodes, 1)
    local = _int_at_least("ranks_per_node", ranks_per_node, 1)
    if p * local < 2:
        raise ValueError(f"invalid nodes * ranks_per_node: {p * local}; expected at least 2 ranks")
    return p, local


def _checked_local_s(local_s: dict[str, float] | None) -> dict[str, float]:
    local_s = dict(local_s or {})
    for key, value in local_s.items():
        if key not in SCHEMES:
            raise ValueError(f"invalid local_s key: {key!r}; expected one of {', '.join(map(repr, SCHEMES))}")
        _real(f"local_s[{key!r}]", value, positive=False)
    return local_s


def _scheme_estimate(scheme: str, nbytes: tuple[int, int], rates: tuple[float, float], num_params: int, p: int,
                     local: int, segments: int, reduce_gbps: float, local_s: dict[str, float],
                     costs: tuple[float | None, float | None, float | None], compute_s: float,
                     latency_s: float) -> SchemeEstimate:
    """One scheme of :func:`estimate_two_level`, from checked arguments (``costs``: codec GB/s, the
    Adam step's and the 1-bit step's seconds)."""
    n = p * local
    (inter_b, intra_b), (goodput, intra_rate) = nbytes, rates
    inter_s, intra_s = inter_b / goodput, intra_b / intra_rate
    padded = padded_length(num_params, n)
    if scheme == "fp32":  # every ring edge at once: the slowest sets the pace, or the CPU's reduce
        wire = max(inter_s, intra_s, 4 * num_params / (reduce_gbps * 1e9))
    elif scheme == "flat":  # all-to-all (inter and intra at once), then the ring all-gather
        ring = (n - 1) * row_bytes(padded, n, segments)
        a2a_inter, a2a_intra = inter_b - (ring if p > 1 else 0), intra_b - (ring if local > 1 else 0)
        wire = max(a2a_inter / goodput, a2a_intra / intra_rate) + max(
            ring / goodput if p > 1 else 0.0, ring / intra_rate if local > 1 else 0.0)
    else:  # intra all-to-all, cross all-to-all and all-gather, intra all-gather: one after another
        wire = inter_s + intra_s
    codec_gbps, adam_step_s, onebit_step_s = costs
    if scheme in local_s:
        here = float(local_s[scheme])
    elif scheme == "fp32":
        here = float(adam_step_s)
    else:
        here = float(onebit_step_s) + 4 * padded / (float(codec_gbps) * 1e9) * _CODEC_PASSES[scheme](local) / 3.0
    messages = 2 * (n - 1) if scheme in ("fp32", "flat") else 2 * (p - 1) + 2 * (local - 1)
    return SchemeEstimate(
        scheme=scheme, inter_node_bytes=inter_b, intra_node_bytes=intra_b, inter_wire_s=inter_s,
        intra_wire_s=intra_s, wire_s=wire, local_s=here, latency_s=messages * latency_s,
        step_s=compute_s + here + wire + messages * latency_s)


def format_two_level(est: TwoLevelEstimate) -> str:
    """A small table for people."""
    ms = lambda s: f"{s * 1e3:9.1f} ms"
    lines = [f"{est.num_params / 1e6:.1f}M float32 parameters, {est.nodes} nodes x {est.ranks_per_node} ranks, "
             f"{est.inter_node_gbps:g} Gbit/s per node between nodes, {est.intra_node_gbps:g} Gbit/s per rank inside",
             f"  {'scheme':<11} {'inter-node B/node':>18} {'intra-node B/rank':>18} {'wire':>12} {'step':>12}"]
    for s in est.schemes.values():
        lines.append(f"  {s.scheme:<11} {s.inter_node_bytes:>18,} {s.intra_node_bytes:>18,} {ms(s.wire_s)} {ms(s.step_s)}")
    return "\n".join(lines) + "\n"


def format_estimate(est: SpeedupEstimate) -> str:
    """A few lines of text for people."""
    ms = lambda s: f"{s * 1e3:8.1f} ms"
    return "\n".join([
        f"{est.num_params / 1e6:.1f}M float32 parameters, {est.world_size} ranks, {est.bandwidth_gbps:g} Gbit/s "
        f"per rank, codec {est.codec_gbps:.2f} GB/s",
        f"  bytes per rank per step: fp32 ring all-reduce {est.fp32_bytes:,}; 1-bit {est.onebit_bytes:,} "
        f"({est.fp32_bytes / est.onebit_bytes:.1f}x fewer)",
        f"  fp32 + Adam step: compute {ms(est.compute_s)} + Adam  {ms(est.adam_step_s)} + max(wire "
        f"{ms(est.fp32_wire_s)}, reduce {ms(est.fp32_reduce_s)}) = {ms(est.baseline_step_s)}",
        f"  1-bit step:       compute {ms(est.compute_s)} + maths {ms(est.onebit_step_s)} + wire "
        f"{ms(est.onebit_wire_exposed_s)} + codec  {ms(est.codec_s)} = {ms(est.compressed_step_s)}"
        f"  (wire {est.onebit_wire_s * 1e3:.1f} ms over {est.buckets} bucket(s), the rest hidden behind the codec)",
        f"  expected speedup of the compression phase: {est.speedup:.2f}x"
        + ("" if est.speedup > 1.05 else " (compression does not pay on this link)"),
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line: write the estimate (or its JSON with ``--json``) to standard output."""
    parser = argparse.ArgumentParser(prog="python -m onebit.estimate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 50e6")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--bandwidth-gbps", type=float, required=True, help="link rate per rank, Gbit/s")
    parser.add_argument("--compute-s", type=float, default=0.0, help="forward+backward seconds per step")
    parser.add_argument("--codec-gbps", type=float, default=None, help="default: measured here")
    parser.add_argument("--adam-step-s", type=float, default=None, help="default: measured here")
    parser.add_argument("--onebit-step-s", type=float, default=None, help="default: measured here")
    parser.add_argument("--latency-s", type=float, default=DEFAULT_LATENCY_S)
    parser.add_argument("--reduce-gbps", type=float, default=DEFAULT_REDUCE_GBPS)
    parser.add_argument("--buckets", type=int, default=None, help="compression buckets (default: ceil(params / 2**24))")
    parser.add_argument("--overlap-backward", action="store_true",
                        help="the optimizer's overlap_backward: all buckets' transfers but the last hide behind backward")
    parser.add_argument("--backward-s", type=float, default=None,
                        help="with --overlap-backward: backward seconds (default 2/3 of --compute-s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the measurements")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="two levels: ranks per node (the world size must be a multiple); "
                             "--bandwidth-gbps is then each node's link; prints every scheme")
    parser.add_argument("--intra-gbps", type=float, default=None,
                        help="two levels: each rank's bandwidth inside its node, Gbit/s (required with --ranks-per-node)")
    parser.add_argument("--json", action="store_true", help="write the estimate as JSON")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    params = int(args.params) if float(args.params).is_integer() else args.params
    if args.ranks_per_node is not None:
        if args.intra_gbps is None:
            parser.error("--ranks-per-node needs --intra-gbps")
        if args.ranks_per_node < 1 or args.world_size % args.ranks_per_node:
            parser.error(f"invalid --ranks-per-node: {args.ranks_per_node}; expected a positive divisor of "
                         f"--world-size {args.world_size}")
        try:
            two = estimate_two_level(params, args.world_size // args.ranks_per_node, args.ranks_per_node,
                                     args.bandwidth_gbps, args.intra_gbps, compute_s=args.compute_s,
                                     codec_gbps=args.codec_gbps, adam_step_s=args.adam_step_s,
                                     onebit_step_s=args.onebit_step_s, latency_s=args.latency_s,
                                     reduce_gbps=args.reduce_gbps)
        except ValueError as exc:
            parser.error(str(exc))
        sys.stdout.write(json.dumps(two.as_dict(), indent=2) + "\n" if args.json else format_two_level(two))
        return 0
    try:
        est = estimate_speedup(params, args.world_size, args.bandwidth_gbps, codec_gbps=args.codec_gbps,
                               compute_s=args.compute_s, adam_step_s=args.adam_step_s,
                               onebit_step_s=args.onebit_step_s, latency_s=args.latency_s,
                               reduce_gbps=args.reduce_gbps, buckets=args.buckets,
                               overlap_backward=args.overlap_backward, backward_s=args.backward_s)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(json.dumps(est.as_dict(), indent=2) + "\n" if args.json else format_estimate(est))
    return 0


if __name__ == "__main__":
    sys.exit(main())
