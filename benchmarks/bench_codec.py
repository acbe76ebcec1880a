"""Throughput of the codec kernels: reference (pure torch) vs the fused CPU kernels vs numpy.

    python benchmarks/bench_codec.py            # 1M, 8M and 32M floats
    python benchmarks/bench_codec.py --quick    # 1M only

For each size N it times, best of several runs:

* worker: ``worker_compress_`` of N floats (b = x + e, scale, pack, error update);
* server: ``server_compress_`` of a chunk of N floats from 2 ranks (unpack 2 rows, weighted sum,
  /2, + e, scale, pack, error update);
* decode: ``decode_`` of 2 rows into N floats;

for ``reference``, ``cpu`` (all of torch's threads), ``cpu-1t`` (one thread) and ``numpy`` (the
straightforward multi-pass numpy codec: ``packbits``/``unpackbits``, as DeepSpeed's CPU path did),
next to ``copy``, a numpy copy of the N floats (the memory-bandwidth yardstick). Throughput is GB/s
of fp32 data (4N bytes over the best time); ratios are taken between numbers of the same run.
It prints a markdown table and writes ``benchmarks/results/codec.json`` and ``codec.md``.
Shared machines are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from onebit.kernels import REFERENCE, KernelSet
from onebit.kernels import cpu as cpu_kernels

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = 2  # rows unpacked by the server and decode


# ------------------------------------------------------------------------------------------------
# The numpy baseline: one pass per step, as a straightforward codec writes it.


def _np_worker(x: np.ndarray, e: np.ndarray, packed: np.ndarray) -> np.float32:
    b = x + e
    scale = np.float32(np.sqrt(np.dot(b.astype(np.float64), b.astype(np.float64)) / b.size))
    positive = ~(b < 0)
    packed[:] = np.packbits(positive)
    np.subtract(b, np.where(positive, scale, -scale), out=e)
    return scale


def _np_server(signs: np.ndarray, scales: np.ndarray, e: np.ndarray, packed: np.ndarray) -> np.float32:
    acc = np.zeros(e.size, dtype=np.float32)
    for i in range(signs.shape[0]):
        acc += (np.unpackbits(signs[i]).astype(np.float32) * 2 - 1) * scales[i]
    c = acc / np.float32(signs.shape[0]) + e
    scale = np.float32(np.sqrt(np.dot(c.astype(np.float64), c.astype(np.float64)) / c.size))
    positive = ~(c < 0)
    packed[:] = np.packbits(positive)
    np.subtract(c, np.where(positive, scale, -scale), out=e)
    return scale


def _np_decode(signs: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    values = np.unpackbits(signs, axis=1).astype(np.float32) * 2 - 1
    np.multiply(values, scales[:, None], out=out.reshape(signs.shape[0], -1))


# ------------------------------------------------------------------------------------------------


def _best(fn, repeats: int) -> float:
    fn()  # warm: page faults, caches, the first call's allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _torch_cases(impl: KernelSet, n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    chunk = n // 8
    packed = torch.empty(1, chunk + 4, dtype=torch.uint8)
    recv = torch.randint(0, 256, (RANKS, chunk + 4), dtype=torch.uint8, generator=g)
    scales = torch.rand(RANKS, generator=g)
    es = torch.randn(n, generator=g) * 0.1
    gathered = torch.randint(0, 256, (RANKS, n // 8 // RANKS + 4), dtype=torch.uint8, generator=g)
    out = torch.empty(n)
    return {
        "worker": lambda: impl.worker_compress_(x, e, packed[:, :chunk]),
        "server": lambda: impl.server_compress_(recv[:, :chunk], scales, es, packed[0, :chunk]),
        "decode": lambda: impl.decode_(gathered[:, :-4], scales, out),
    }


def _numpy_cases(n: int) -> dict:
    rng = np.random.default_rng(0)
    x, e = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32) * np.float32(0.1)
    packed = np.empty(n // 8, dtype=np.uint8)
    recv = rng.integers(0, 256, (RANKS, n // 8), dtype=np.uint8)
    scales = rng.random(RANKS, dtype=np.float32)
    es = rng.standard_normal(n, dtype=np.float32) * np.float32(0.1)
    gathered = rng.integers(0, 256, (RANKS, n // 8 // RANKS), dtype=np.uint8)
    out = np.empty(n, dtype=np.float32)
    return {
        "worker": lambda: _np_worker(x, e, packed),
        "server": lambda: _np_server(recv, scales, es, packed),
        "decode": lambda: _np_decode(gathered, scales, out),
    }


class _OneThread:
    def __init__(self, impl: KernelSet) -> None:
        self.impl = impl

    def __getattr__(self, name):
        fn = getattr(self.impl, name)

        def run(*args):
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return fn(*args)
            finally:
                torch.set_num_threads(before)

        return run


def _machine(cpu_loaded) -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels_path": "avx2" if cpu_loaded.vector_path else "scalar",
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M floats only")
    parser.add_argument("--sizes", type=lambda s: [int(float(v)) for v in s.split(",")],
                        help="comma-separated float counts (default 1M,8M,32M)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = args.sizes or ([1 << 20] if args.quick else [1 << 20, 8 << 20, 32 << 20])

    with tempfile.TemporaryDirectory() as tmp:  # a cold build, for the compile time
        start = time.perf_counter()
        cpu_kernels.build(Path(tmp))
        compile_s = time.perf_counter() - start
    native = cpu_kernels.load()
    impls = {"reference": REFERENCE, "cpu": native.kernel_set(), "cpu-1t": _OneThread(native.kernel_set())}

    rows = []
    for n in sizes:
        nbytes = 4 * n
        src, dst = np.ones(n, dtype=np.float32), np.empty(n, dtype=np.float32)
        copy_s = _best(lambda: np.copyto(dst, src), args.repeats)
        timings = {name: {op: _best(fn, args.repeats if name != "reference" or n <= (1 << 20) else 2)
                          for op, fn in _torch_cases(impl, n).items()}
                   for name, impl in impls.items()}
        timings["numpy"] = {op: _best(fn, args.repeats) for op, fn in _numpy_cases(n).items()}
        for op in ("worker", "server", "decode"):
            gbs = {name: nbytes / t[op] / 1e9 for name, t in timings.items()}
            rows.append({
                "n": n, "op": op, "gbs": gbs, "copy_gbs": nbytes / copy_s / 1e9,
                "cpu_vs_reference": gbs["cpu"] / gbs["reference"], "cpu_vs_numpy": gbs["cpu"] / gbs["numpy"],
                "cpu_vs_copy": gbs["cpu"] / (nbytes / copy_s / 1e9),
            })

    machine = _machine(native)
    head = ("| floats | op | reference | numpy | cpu (1 thread) | cpu | numpy copy | cpu / reference | "
            "cpu / numpy | cpu / copy |")
    lines = [
        f"Codec throughput, GB/s of fp32 data (best of {args.repeats}); machine: {machine['cpu']}, "
        f"{machine['cores']} cores, torch {machine['torch']} with {machine['torch_threads']} threads, "
        f"CPU kernels: {machine['cpu_kernels_path']}, compiled in {compile_s:.1f} s; load average "
        f"{machine['load_average_1min']} at the end (other processes share these cores).",
        "",
        head,
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        g = r["gbs"]
        lines.append(
            f"| {r['n'] / (1 << 20):.0f}M | {r['op']} | {g['reference']:.2f} | {g['numpy']:.2f} | {g['cpu-1t']:.2f} | "
            f"{g['cpu']:.2f} | {r['copy_gbs']:.2f} | {r['cpu_vs_reference']:.0f}x | {r['cpu_vs_numpy']:.1f}x | "
            f"{r['cpu_vs_copy']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "codec.md").write_text(table + "\n")
    (args.out / "codec.json").write_text(json.dumps(
        {"machine": machine, "compile_s": compile_s, "repeats": args.repeats, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
