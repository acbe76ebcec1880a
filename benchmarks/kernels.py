"""Throughput of the codec kernels (reference, fused CPU, numpy), and what they cost on 2 ranks.

    python benchmarks/kernels.py            # 1M, 8M and 32M floats; 8M floats on 2 gloo ranks
    python benchmarks/kernels.py --quick    # 1M floats only, 1M on 2 ranks

For each size N it times, best of several runs:

* worker: ``worker_compress_`` of N floats (b = x + e, scale, pack, error update);
* server: ``server_compress_`` of a chunk of N floats from 2 ranks (unpack 2 rows, weighted sum,
  /2, + e, scale, pack, error update);
* decode: ``decode_`` of 2 rows into N floats;

for ``reference``, ``cpu`` (all of torch's threads), ``cpu-1t`` (one thread) and ``numpy`` (the
straightforward multi-pass numpy codec: ``packbits``/``unpackbits``, as DeepSpeed's CPU path did),
next to ``copy``, a numpy copy of the N floats (the memory-bandwidth yardstick). Throughput is GB/s
of fp32 data (4N bytes over the best time); ratios are taken between numbers of the same run.
Then, on 2 gloo ranks of this machine (loopback: the network is nearly free, so this measures
what compression *costs*), interleaved in one run: a compressed all-reduce of N floats vs a plain
fp32 ``all_reduce``, and a compression-phase ``OnebitAdam.step()`` on one N-element tensor vs an
fp32 all-reduce of its gradient + ``torch.optim.Adam.step()``.
Last, many small tensors against one large one (``--many``): on the same 2 ranks, a compression-phase
``OnebitAdam.step()`` over ``--many-tensors`` tensors (1,000 by default) of ``--many-size`` floats
each (8,192) against the same step over one tensor of as many floats, interleaved; each tensor has
its own scales, and the whole step (finiteness, momentum, codec, update) must not cost a Python
loop of kernel calls per tensor.
It prints markdown tables and writes ``benchmarks/results/kernels.json`` and ``kernels.md``
(``kernels_many.json``/``.md`` for ``--many``).
Shared machines are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onebit import OnebitAdam
from onebit.backends.torch_dist import TorchDistBackend
from onebit.collectives import CompressionState, compressed_allreduce_
from onebit.compression import padded_length
from onebit.kernels import REFERENCE, KernelSet, get_kernels
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


def _rank(rank: int, n: int, repeats: int, store: str, out: str) -> None:
    """One of 2 gloo ranks: interleaved timings of the four operations, medians to ``out``."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    backend = TorchDistBackend(expected="gloo")
    kernels = get_kernels("cpu")
    padded = padded_length(n, 2)
    state = CompressionState(padded, 2, "cpu")
    buffer = torch.randn(padded)
    grad = torch.randn(n)

    onebit_param = torch.nn.Parameter(torch.randn(n))
    onebit = OnebitAdam([onebit_param], lr=1e-4, freeze_step=1, comm_backend_name="gloo")
    adam_param = torch.nn.Parameter(onebit_param.detach().clone())
    adam = torch.optim.Adam([adam_param], lr=1e-4)
    onebit_param.grad, adam_param.grad = grad.clone(), grad.clone()
    onebit.step()  # the warmup step; every later step is a compression step

    def adam_step():
        dist.all_reduce(adam_param.grad)
        adam_param.grad.div_(2)
        adam.step()

    ops = {
        "compressed_allreduce": lambda: compressed_allreduce_(buffer, state, backend, kernels),
        "fp32_allreduce": lambda: dist.all_reduce(grad),
        "onebit_compression_step": onebit.step,
        "fp32_allreduce_plus_adam_step": adam_step,
    }
    times = {name: [] for name in ops}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in ops.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({name: statistics.median(t[1:]) for name, t in times.items()}))
    dist.destroy_process_group()


def _two_ranks(n: int, repeats: int, rank_fn=None, *extra) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        mp.start_processes(rank_fn or _rank, args=(n, repeats, os.path.join(tmp, "store"), out, *extra), nprocs=2,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def _many_rank(rank: int, size: int, repeats: int, store: str, out: str, tensors: int) -> None:
    """One of 2 gloo ranks, one thread: compression steps over ``tensors`` tensors of ``size``
    floats vs over one tensor of ``tensors * size`` floats, interleaved; medians to ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    setups = {}
    for name, shapes in (("one_tensor", [tensors * size]), ("many_tensors", [size] * tensors)):
        params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in shapes]
        opt = OnebitAdam(params, lr=1e-4, freeze_step=1, comm_backend_name="gloo")
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()  # the warmup step; every later step is a compression step
        setups[name] = opt
    times = {name: [] for name in setups}
    for _ in range(repeats + 1):  # the first round warms up
        for name, opt in setups.items():
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({
            **{name: statistics.median(t[1:]) for name, t in times.items()},
            "collectives": {name: opt.comm_stats()["last_step"]["collectives"] for name, opt in setups.items()},
            "bytes": {name: opt.comm_stats()["last_step"]["bytes_sent"] for name, opt in setups.items()},
        }))
    dist.destroy_process_group()


def many_tensors(args) -> None:
    """The many-tensor table (``--many``)."""
    ranks = _two_ranks(args.many_size, args.repeats, _many_rank, args.many_tensors)
    ratio = ranks["many_tensors"] / ranks["one_tensor"]
    machine = _machine(cpu_kernels.load())
    total = args.many_size * args.many_tensors
    lines = [
        f"OnebitAdam compression step, 2 gloo ranks on loopback, one thread each, median of {args.repeats} "
        f"interleaved rounds; {machine['cpu']}, load average {machine['load_average_1min']} at the end:",
        "",
        "| layout | floats | step ms | collectives | bytes sent / rank |",
        "|---|---:|---:|---:|---:|",
        f"| 1 tensor | {total:,} | {ranks['one_tensor'] * 1e3:.1f} | {ranks['collectives']['one_tensor']} | "
        f"{ranks['bytes']['one_tensor']:,} |",
        f"| {args.many_tensors:,} tensors of {args.many_size:,} | {total:,} | {ranks['many_tensors'] * 1e3:.1f} | "
        f"{ranks['collectives']['many_tensors']} | {ranks['bytes']['many_tensors']:,} |",
        "",
        f"many / one: {ratio:.2f}x (target <= 1.3x)",
    ]
    _write(args.out, "kernels_many", lines,
           {"machine": machine, "repeats": args.repeats, "tensors": args.many_tensors, "size": args.many_size,
            "median_s": {k: ranks[k] for k in ("one_tensor", "many_tensors")}, "ratio": ratio,
            "collectives": ranks["collectives"], "bytes": ranks["bytes"]})


def _write(out: Path, stem: str, lines: list[str], data: dict) -> None:
    """Print the table, and write it (``stem.md``) and the numbers (``stem.json``) under ``out``."""
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(table + "\n")
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M floats only")
    parser.add_argument("--sizes", type=lambda s: [int(float(v)) for v in s.split(",")],
                        help="comma-separated float counts (default 1M,8M,32M)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks-size", type=lambda v: int(float(v)), default=None,
                        help="floats for the 2-rank comparison (default 8M, 1M with --quick)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--many", action="store_true", help="only the many-tensor step comparison")
    parser.add_argument("--many-tensors", type=int, default=1000)
    parser.add_argument("--many-size", type=int, default=8192)
    args = parser.parse_args()
    if args.many:
        many_tensors(args)
        return
    ranks_n = args.ranks_size or ((1 << 20) if args.quick else (8 << 20))
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
    ranks = _two_ranks(ranks_n, args.repeats)
    step_ratio = ranks["onebit_compression_step"] / ranks["fp32_allreduce_plus_adam_step"]
    lines += [
        "",
        f"2 gloo ranks on loopback, one tensor of {ranks_n / (1 << 20):.0f}M floats, median of {args.repeats} "
        "interleaved rounds (ms):",
        "",
        "| compressed all-reduce | fp32 all_reduce | OnebitAdam compression step | fp32 all_reduce + Adam.step | "
        "step ratio |",
        "|---:|---:|---:|---:|---:|",
        f"| {ranks['compressed_allreduce'] * 1e3:.1f} | {ranks['fp32_allreduce'] * 1e3:.1f} | "
        f"{ranks['onebit_compression_step'] * 1e3:.1f} | {ranks['fp32_allreduce_plus_adam_step'] * 1e3:.1f} | "
        f"{step_ratio:.2f}x |",
    ]
    _write(args.out, "kernels", lines,
           {"machine": machine, "compile_s": compile_s, "repeats": args.repeats, "rows": rows,
            "two_ranks": {"floats": ranks_n, "median_s": ranks, "step_ratio": step_ratio}})


if __name__ == "__main__":
    main()
