"""The codec and a compression step on one GPU: what the CUDA kernels cost per element.

    python benchmarks/gpu_codec.py --out DIR            # on a GPU (scripts/gpu_check.sh runs it)
    python benchmarks/gpu_codec.py --quick --out DIR    # 1M and 16M floats, a 16M-parameter step

Timed with CUDA events, the median of ``--repeats`` runs after a warm one:

* per element, for the ``cuda`` kernels and the pure-torch ``reference`` on the GPU: ``worker``
  (``worker_compress_`` of N floats), ``server`` (``server_compress_`` of an N-float chunk from 2
  ranks), ``decode`` (2 rows into N floats), over one segment; the ``cuda`` kernels also over a
  table of 1,000 segments (a bucket of many tensors); next to ``copy`` and ``mul`` of N floats,
  the cost of one extra pass (what a caller pays for a kernel set without the keywords:
  ``error_out=`` is a copy, ``multiplier=`` a multiply, ``limit=`` a clamp; the CUDA kernels take
  all three in their own passes);
* on a single-rank process group (NCCL; gloo if NCCL does not start), one tensor of ``--params``
  floats (100M) in one bucket: a compression-phase ``OnebitAdam.step()`` with the ``cuda``
  kernels (default options: ``compression_space='preconditioned'`` and ``update_bound='auto'``,
  whose multiply and clamp the kernels do as they read and write; and with
  ``compression_space='momentum'``, ``update_bound=None``, which need neither), with the ``reference`` kernels, against an fp32
  ``all_reduce`` of the gradient + ``torch.optim.Adam.step()`` (foreach, and fused). One rank
  sends nothing over a network: this is what compression costs on the GPU beside Adam's own step,
  not what it saves on the wire;
* whether a CUDA graph captures the codec's three calls and replays them (onebit does not claim
  this: the optimizers refuse ``capturable``; recorded for later, never a failure).

Writes ``gpu_codec.json`` (every number, the device and versions), ``gpu_codec.md`` (the tables,
also printed) and ``gpu_codec_summary.txt`` (a few lines for the check's summary) under ``--out``
(default ``$OUT``, else ``runs/gpu_check``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from onebit import OnebitAdam
from onebit.kernels import REFERENCE, KernelSet, get_kernels
from onebit.kernels.registry import register

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2  # rows the server and the decode read
MANY_SEGMENTS = 1000


def _time(fn, repeats: int, device: str) -> dict:
    """Milliseconds per call (median and best of ``repeats``, after a warm call): by CUDA events on
    a GPU, by the clock on the CPU (``--device cpu`` only checks that the script runs)."""
    fn()
    times = []
    if device == "cpu":
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    else:
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "best_ms": min(times)}


def _empty_cache(device: str) -> None:
    if device != "cpu":
        torch.cuda.empty_cache()


def _bounds(n: int, segments: int) -> torch.Tensor | None:
    """``segments`` segments of nearly equal length over ``n`` floats (multiples of 8 * RANKS)."""
    if segments == 1:
        return None
    unit = 8 * RANKS
    units = n // unit
    edges = [unit * (units * i // segments) for i in range(segments + 1)]
    return torch.tensor(edges, dtype=torch.int64)


def codec_cases(kernels: KernelSet, n: int, segments: int = 1, device: str = "cuda") -> dict:
    """The three operations on N floats (2 ranks' rows), as callables."""
    gen = torch.Generator(device=device).manual_seed(0)
    bounds = _bounds(n, segments)
    server_bounds = _bounds(RANKS * n, segments)  # the server reads chunk j of a buffer of RANKS * n floats
    x, error = torch.randn(n, device=device, generator=gen), torch.randn(n, device=device, generator=gen) * 0.1
    packed = torch.empty(RANKS, n // 8 // RANKS, dtype=torch.uint8, device=device)
    recv = torch.randint(0, 256, (RANKS, n // 8), dtype=torch.uint8, device=device, generator=gen)
    server_scales = torch.rand(RANKS, segments, device=device, generator=gen)
    server_error = torch.randn(n, device=device, generator=gen) * 0.1
    server_packed = torch.empty(n // 8, dtype=torch.uint8, device=device)
    gathered = recv[:, :n // 8 // RANKS]
    out = torch.empty(n, device=device)
    return {
        "worker": lambda: kernels.worker_compress_(x, error, packed, bounds=bounds),
        "server": lambda: kernels.server_compress_(recv, server_scales, server_error, server_packed,
                                                   bounds=server_bounds),
        "decode": lambda: kernels.decode_(gathered, server_scales, out, bounds=bounds),
    }


def codec(impls: dict[str, KernelSet], sizes: list[int], repeats: int, device: str) -> list[dict]:
    rows = []
    for n in sizes:
        a, b = torch.randn(n, device=device), torch.randn(n, device=device)
        passes = {"copy": lambda: a.copy_(b), "mul": lambda: torch.mul(a, b, out=a)}
        for op, fn in passes.items():
            rows.append({"impl": "torch", "op": op, "n": n, "segments": 1, **_time(fn, repeats, device)})
        for name, impl in impls.items():
            for segments in (1, MANY_SEGMENTS) if name != "reference" and n >= 16 * MANY_SEGMENTS else (1,):
                try:
                    for op, fn in codec_cases(impl, n, segments, device).items():
                        row = {"impl": name, "op": op, "n": n, "segments": segments}
                        rows.append(row)
                        row.update(_time(fn, repeats, device))
                except Exception as exc:  # noqa: BLE001 (recorded; the other cases still run)
                    row["error"] = f"{type(exc).__name__}: {exc}"
                _empty_cache(device)
    for row in rows:
        if "error" not in row:
            row["ns_per_element"] = row["median_ms"] * 1e6 / row["n"]
            row["fp32_GB_per_s"] = 4 * row["n"] / (row["median_ms"] * 1e-3) / 1e9
    return rows


def _init_group(store: str, device: str) -> str:
    """A single-rank process group: NCCL where it starts, else gloo. Returns the backend's name."""
    for backend in ("nccl", "gloo") if device != "cpu" else ("gloo",):
        try:
            dist.init_process_group(backend, init_method=f"file://{store}-{backend}", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=120))
            probe = torch.ones(8, device=device)
            dist.all_reduce(probe)
            probe.cpu()
            return backend
        except Exception as exc:  # noqa: BLE001 (any failure: try the next transport, say why)
            print(f"a single-rank {backend} group failed ({type(exc).__name__}: {exc}); trying the next")
            if dist.is_initialized():
                dist.destroy_process_group()
    raise RuntimeError("neither NCCL nor gloo gave a single-rank process group")


def steps(n: int, repeats: int, backend: str, native: str, device: str) -> list[dict]:
    """A compression-phase step of OnebitAdam on one n-float tensor vs all_reduce + torch Adam."""
    gen = torch.Generator(device=device).manual_seed(1)
    grad = torch.randn(n, device=device, generator=gen) * 1e-3
    rows = []

    def onebit(kernels: str, **options) -> dict:
        param = torch.nn.Parameter(torch.randn(n, device=device, generator=gen))
        opt = OnebitAdam([param], lr=1e-4, freeze_step=1, comm_backend_name=backend, kernels=kernels,
                         bucket_size=n, **options)
        param.grad = grad.clone()
        opt.step()  # the warmup step; every later step compresses
        if opt.phase != "compression":
            raise RuntimeError(f"the step after the warmup step is a {opt.phase!r} step, not a compression step")
        return _time(opt.step, repeats, device)

    def adam(**options) -> dict:
        param = torch.nn.Parameter(torch.randn(n, device=device, generator=gen))
        opt = torch.optim.Adam([param], lr=1e-4, **options)
        param.grad = grad.clone()

        def step():
            dist.all_reduce(param.grad)
            opt.step()

        return _time(step, repeats, device)

    # The same kernels without their fused options (error_out=, multiplier=, limit=): the caller's
    # own passes (a copy of the error, a multiply, a clamp), timed next to the fused step.
    unfused = f"{native}-unfused"
    register(unfused, lambda: dataclasses.replace(get_kernels(device, native), name=unfused, separate_errors=False,
                                                  multipliers=False, limits=False))
    cases = {
        f"onebit_compression_step ({native} kernels; preconditioned, update_bound auto)": lambda: onebit(native),
        f"onebit_compression_step ({native} kernels without error_out/multiplier/limit; preconditioned, "
        "update_bound auto)": lambda: onebit(unfused),
        f"onebit_compression_step ({native} kernels; preconditioned, update_bound auto; again)": lambda: onebit(native),
        f"onebit_compression_step ({native} kernels; momentum space, no bound)":
            lambda: onebit(native, compression_space="momentum", update_bound=None),
        "onebit_compression_step (reference kernels; preconditioned, update_bound auto)": lambda: onebit("reference"),
        "all_reduce + torch.optim.Adam (foreach)": lambda: adam(),
        "all_reduce + torch.optim.Adam (fused)": lambda: adam(fused=True),
    }
    for name, case in cases.items():
        try:
            rows.append({"case": name, "n": n, **case()})
        except Exception as exc:  # noqa: BLE001 (recorded, and the other cases still run)
            rows.append({"case": name, "n": n, "error": f"{type(exc).__name__}: {exc}"})
        _empty_cache(device)  # the case's tensors are gone: give their memory back before the next
    return rows


def graph_probe(kernels: KernelSet, n: int) -> str:
    """Capture the codec's three calls in a CUDA graph and replay them; the reason if it fails."""
    try:
        cases = codec_cases(kernels, n)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream, as capture wants
            for fn in cases.values():
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in cases.values():
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return "captured and replayed"
    except Exception as exc:  # noqa: BLE001 (a probe: the reason is the result)
        return f"capture failed: {type(exc).__name__}: {exc}"


def _environment(device: str) -> dict:
    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": platform.processor() or platform.machine(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cupy": cupy_version, "python": platform.python_version()}
    if device != "cpu":
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_GiB=round(props.total_memory / 2**30, 1))
    return env


def _markdown(env: dict, codec_rows: list[dict], step_rows: list[dict], backend: str, probe: str) -> list[str]:
    lines = [f"# onebit codec on {env['device']} (torch {env['torch']}, CUDA {env['cuda']}, CuPy {env['cupy']}), "
             f"{env['date']}", "", "| impl | op | N | segments | median ms | ns/element | GB/s of fp32 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in codec_rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['op']} | {r['n']:,} | {r['segments']} | failed: {r['error']} | | |")
            continue
        lines.append(f"| {r['impl']} | {r['op']} | {r['n']:,} | {r['segments']} | {r['median_ms']:.3f} | "
                     f"{r['ns_per_element']:.4f} | {r['fp32_GB_per_s']:.0f} |")
    lines += ["", f"Steps on one tensor in one bucket, a single-rank {backend} group:", "",
              "| case | N | median ms | best ms |", "|---|---:|---:|---:|"]
    for r in step_rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['n']:,} | failed: {r['error']} | |")
        else:
            lines.append(f"| {r['case']} | {r['n']:,} | {r['median_ms']:.2f} | {r['best_ms']:.2f} |")
    lines += ["", f"CUDA graph capture of the codec's three calls: {probe}"]
    return lines


def _summary(codec_rows: list[dict], step_rows: list[dict], backend: str, probe: str) -> list[str]:
    """A few lines for the check's one-screen summary: the largest size, and the steps."""
    largest = max(r["n"] for r in codec_rows)
    lines = [f"codec, {largest:,} floats, ns/element (GB/s of fp32):"]
    for (impl, segments) in sorted({(r["impl"], r["segments"]) for r in codec_rows if r["n"] == largest}):
        cells = [f"{r['op']} failed" if "error" in r else f"{r['op']} {r['ns_per_element']:.3f} ({r['fp32_GB_per_s']:.0f})"
                 for r in codec_rows if r["n"] == largest and (r["impl"], r["segments"]) == (impl, segments)]
        lines.append(f"  {impl + (f' x{segments} segments' if segments > 1 else ''):22} " + ", ".join(cells))
    lines.append(f"steps, {step_rows[0]['n']:,} parameters, one {backend} rank, median ms:")
    for r in step_rows:
        lines.append(f"  {r.get('median_ms', float('nan')):9.2f}  {r['case']}" + (f": {r['error']}" if "error" in r else ""))
    lines.append(f"CUDA graph capture of the codec: {probe}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M and 16M floats; a 16M-parameter step")
    parser.add_argument("--sizes", type=lambda s: [int(float(v)) for v in s.split(",")], default=None,
                        help="comma-separated float counts, multiples of 16 (default 1M,16M,100M)")
    parser.add_argument("--params", type=lambda v: int(float(v)), default=None,
                        help="parameters of the step comparison (default 100M)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "runs" / "gpu_check"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the same runs with the CPU kernels, to check the script itself (tests do)")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on a GPU (--device cpu checks the script)")
        return 3
    sizes = args.sizes or ([2**20, 2**24] if args.quick else [2**20, 2**24, 100_000_000])
    params = args.params or (2**24 if args.quick else 100_000_000)
    env = _environment(device)
    native = "cuda" if device == "cuda" else "cpu"
    impls = {native: get_kernels(device, native), "reference": REFERENCE}
    started = time.perf_counter()
    codec_rows = codec(impls, sizes, args.repeats, device)
    with tempfile.TemporaryDirectory() as tmp:
        backend = _init_group(os.path.join(tmp, "store"), device)
        try:
            step_rows = steps(params, args.repeats, backend, native, device)
        finally:
            dist.destroy_process_group()
    probe = graph_probe(impls[native], 2**20) if device == "cuda" else "not tried on the CPU"
    lines = _markdown(env, codec_rows, step_rows, backend, probe)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_codec.md").write_text("\n".join(lines) + "\n")
    (args.out / "gpu_codec_summary.txt").write_text("\n".join(_summary(codec_rows, step_rows, backend, probe)) + "\n")
    data = {"environment": env, "codec": codec_rows, "steps": step_rows, "process_group": backend,
            "graph_capture": probe, "seconds": round(time.perf_counter() - started, 1)}
    (args.out / "gpu_codec.json").write_text(json.dumps(data, indent=2) + "\n")
    return 1 if any("error" in r for r in codec_rows + step_rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
