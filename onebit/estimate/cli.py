"""``python -m onebit.estimate``: the estimate from the command line.

Local costs not given as flags are measured once per machine and kept in a cache file
(:mod:`onebit.estimate.cache`), so that two identical calls print the same estimate; the runs'
spread is printed with the speedup it implies.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from ._args import DEVICES
from .cache import ENV_VAR, cached_spread, default_cache_path
from .measure import DEFAULT_REPEATS, Measured
from .model import DEFAULT_LATENCY_S, REDUCE_GBPS, TCP_ETHERNET_EFFICIENCY, estimate_speedup, format_estimate
from .two_level import estimate_two_level, format_two_level

_COSTS = ("codec_gbps", "adam_step_s", "onebit_step_s")
_DESCRIPTION = "Should I compress? The expected speedup of a 1-bit Adam compression-phase step on a given link."
_EPILOG = (f"Local costs not given are measured on this machine (on --device) once and cached in "
           f"{default_cache_path()} (set {ENV_VAR} to move it, --cache-file, --no-cache, --remeasure); the "
           "spread of the measured runs is printed with the speedups it implies. Without --compute-s the "
           "speedup is an upper bound.")


def build_parser() -> argparse.ArgumentParser:
    """The command line's flags, each with its help."""
    parser = argparse.ArgumentParser(prog="python -m onebit.estimate", description=_DESCRIPTION, epilog=_EPILOG)
    add = parser.add_argument
    add("--params", type=float, required=True, help="number of trainable float32 parameters, e.g. 50e6")
    add("--world-size", type=int, required=True, help="data-parallel ranks (at least 2)")
    add("--bandwidth-gbps", type=float, required=True,
        help="each rank's link rate, Gbit/s each direction (with --ranks-per-node: each node's link)")
    add("--device", choices=DEVICES, default="cpu",
        help="where the job's tensors live: sets the default --reduce-gbps and where local costs are measured "
             "(default: cpu)")
    add("--compute-s", type=float, default=0.0,
        help="forward + backward seconds per step; without it (0) the speedup is an upper bound")
    add("--codec-gbps", type=float, default=None,
        help="codec throughput, GB/s of float32 input (default: measured here, or cached)")
    add("--adam-step-s", type=float, default=None,
        help="seconds of a torch.optim.Adam step on all parameters (default: measured here, or cached)")
    add("--onebit-step-s", type=float, default=None,
        help="seconds of a 1-bit Adam compression step apart from codec and wire (default: measured here, or cached)")
    add("--latency-s", type=float, default=DEFAULT_LATENCY_S,
        help=f"one-way latency per message, seconds; an all-reduce pays 2 (n-1) of them (default: {DEFAULT_LATENCY_S:g})")
    add("--reduce-gbps", type=float, default=None,
        help="throughput of the fp32 all-reduce's own work (sums, copies), GB/s of fp32 data; inf leaves it out "
             "(default by --device: " + ", ".join(f"{d} {v:g}" for d, v in REDUCE_GBPS.items()) + ")")
    add("--wire-efficiency", type=float, default=TCP_ETHERNET_EFFICIENCY,
        help=f"payload rate over link rate (default: {TCP_ETHERNET_EFFICIENCY:.4f}, TCP in 1500-byte Ethernet frames)")
    add("--buckets", type=int, default=None, help="compression buckets (default: ceil(params / 2**24))")
    add("--overlap-backward", action="store_true",
        help="the optimizer's overlap_backward: all buckets' transfers but the last hide behind backward")
    add("--backward-s", type=float, default=None,
        help="with --overlap-backward: backward seconds (default 2/3 of --compute-s)")
    add("--threads", type=int, default=None, help="torch threads for the measurements (default: torch's)")
    add("--kernels", default=None, help="codec kernels to measure, as OnebitAdam's kernels= (default: auto)")
    add("--repeats", type=int, default=DEFAULT_REPEATS,
        help=f"timed runs of each local cost when measuring (default: {DEFAULT_REPEATS})")
    add("--remeasure", action="store_true", help="measure the local costs again and replace the cached ones")
    add("--no-cache", action="store_true", help="measure now and neither read nor write the cache file")
    add("--cache-file", type=Path, default=None, help=f"the cache file (default: {default_cache_path()})")
    add("--ranks-per-node", type=int, default=None,
        help="two levels: ranks per node (the world size must be a multiple); --bandwidth-gbps is then each "
             "node's link; prints every scheme")
    add("--intra-gbps", type=float, default=None,
        help="two levels: each rank's bandwidth inside its node, Gbit/s (required with --ranks-per-node)")
    add("--json", action="store_true", help="write the estimate as JSON (infinite values as null)")
    return parser


def _measured_costs(args: argparse.Namespace, params: int) -> tuple[dict, Measured | None, bool, Path | None]:
    """``(costs, measurement, from_cache, cache_path)``: the flags' local costs, the missing ones
    from the cache or measured now (``measurement`` None when every one was given)."""
    given = {k: getattr(args, k) for k in _COSTS}
    if all(v is not None for v in given.values()):
        return given, None, False, None
    path = None if args.no_cache else (args.cache_file or default_cache_path())
    measured, from_cache = cached_spread(params, args.world_size, path=path, refresh=args.remeasure,
                                         device=args.device, kernels=args.kernels, repeats=args.repeats)
    median = measured.median
    return {k: getattr(median, k) if v is None else v for k, v in given.items()}, measured, from_cache, path


def _describe(args: argparse.Namespace, measured: Measured | None, from_cache: bool, path: Path | None) -> list[str]:
    """Lines saying where the local costs came from, and their spread."""
    if measured is None:
        return ["  local costs: given"]
    median = measured.median
    low, high = measured.bounds()

    def part(name: str, label: str, scale: float, unit: str) -> str:
        if getattr(args, name) is not None:
            return f"{label} {getattr(args, name) * scale:.2f} {unit} (given)"
        lo, hi = sorted((getattr(low, name) * scale, getattr(high, name) * scale))
        return f"{label} {getattr(median, name) * scale:.2f} {unit} ({lo:.2f}-{hi:.2f})"

    where = f"read from {path}" if from_cache else "measured now"
    return [f"  local costs {where} ({measured.measured_at}, {measured.device}, {measured.threads} threads, "
            f"{len(measured.samples)} runs; median (min-max)): " + ", ".join([
                part("codec_gbps", "codec", 1, "GB/s"), part("adam_step_s", "Adam step", 1e3, "ms"),
                part("onebit_step_s", "1-bit maths", 1e3, "ms")]),
            "  " + ("--remeasure measures them again" if from_cache else
                    f"saved in {path}" if path is not None else "not cached (--no-cache)")]


def _speedup_range(args: argparse.Namespace, params: int, measured: Measured) -> tuple[float, float]:
    """The speedups at both ends of the measured spread (the flags' costs kept as given)."""
    out = []
    for bound in measured.bounds():
        costs = {k: getattr(bound, k) if getattr(args, k) is None else getattr(args, k) for k in _COSTS}
        out.append(_estimate(args, params, costs).speedup)
    return min(out), max(out)


def _estimate(args: argparse.Namespace, params: int, costs: dict):
    return estimate_speedup(params, args.world_size, args.bandwidth_gbps, compute_s=args.compute_s,
                            latency_s=args.latency_s, reduce_gbps=args.reduce_gbps,
                            wire_efficiency=args.wire_efficiency, buckets=args.buckets,
                            overlap_backward=args.overlap_backward, backward_s=args.backward_s, device=args.device,
                            **costs)


def _check_two_level(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.ranks_per_node is None:
        return
    if args.intra_gbps is None:
        parser.error("--ranks-per-node needs --intra-gbps")
    if args.ranks_per_node < 1 or args.world_size % args.ranks_per_node:
        parser.error(f"invalid --ranks-per-node: {args.ranks_per_node}; expected a positive divisor of "
                     f"--world-size {args.world_size}")


def _two_level(args: argparse.Namespace, params: int, costs: dict):
    return estimate_two_level(params, args.world_size // args.ranks_per_node, args.ranks_per_node,
                              args.bandwidth_gbps, args.intra_gbps, compute_s=args.compute_s,
                              latency_s=args.latency_s, reduce_gbps=args.reduce_gbps,
                              wire_efficiency=args.wire_efficiency, device=args.device, **costs)


def _jsonable(value):
    """``value`` with infinite and NaN floats as None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    """Command line: write the estimate (or its JSON with ``--json``) to standard output."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    params = int(args.params) if float(args.params).is_integer() else args.params
    _check_two_level(parser, args)
    try:
        costs, measured, from_cache, path = _measured_costs(args, params)
        if args.ranks_per_node is not None:
            est, band = _two_level(args, params, costs), None
        else:
            est = _estimate(args, params, costs)
            band = _speedup_range(args, params, measured) if measured is not None else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        source = "given" if measured is None else "cache" if from_cache else "measured"
        data = {**est.as_dict(), "speedup_range": band,
                "local_costs": {"source": source, "cache_file": None if path is None else str(path),
                                "measurement": None if measured is None else measured.as_dict()}}
        sys.stdout.write(json.dumps(_jsonable(data), indent=2) + "\n")
        return 0
    text = format_two_level(est) if args.ranks_per_node is not None else format_estimate(est)
    lines = _describe(args, measured, from_cache, path)
    if band is not None:
        lines.append(f"  over the measured spread: {band[0]:.2f}x to {band[1]:.2f}x")
    sys.stdout.write(text + "\n".join(lines) + "\n")
    return 0
