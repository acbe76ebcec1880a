"""Step time and bytes of OnebitAdam, warmup vs compression, on N gloo ranks of this machine.

    python benchmarks/step_time.py --params 4e6 --world-size 2 --steps 20

Each rank trains a stack of square linear layers (synthetic data). The script reports, per phase,
the median step time (optimizer step only and the whole step), the bytes each rank sent per step
(from ``optimizer.comm_stats()``) against the 1-bit ideal ``2(n-1)/n * N/8`` and the fp32 ring
all-reduce ``2(n-1)/n * 4N``, and writes ``benchmarks/results/step_time.json``.
Loopback is not a slow network: see benchmarks/README.md for what this does and does not show.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from onebit import OnebitAdam

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_ranks import run_local_ranks  # noqa: E402


def _model(params: float, width: int) -> torch.nn.Module:
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _rank(rank: int, world_size: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    model = _model(args.params, args.width)
    opt = OnebitAdam(model.parameters(), lr=1e-4, freeze_step=args.steps, comm_backend_name="gloo",
                     kernels=args.kernels)
    x = torch.randn(args.batch, args.width)
    timings = {"warmup": [], "compression": []}
    for step in range(2 * args.steps):
        phase = opt.phase
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        backward_done = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        timings[phase].append((end - start, end - backward_done, opt.comm_stats()["last_step"]))
    if rank == 0:
        numel = sum(p.numel() for p in model.parameters())
        result = {"numel": numel, "world_size": world_size, "phases": {}}
        for phase, rows in timings.items():
            rows = rows[2:]  # skip the first steps of each phase (allocation, switch)
            last = rows[-1][2]
            result["phases"][phase] = {
                "step_s_median": statistics.median(r[0] for r in rows),
                "optimizer_step_s_median": statistics.median(r[1] for r in rows),
                "comm_s_median": statistics.median(r[2]["comm_time_s"] for r in rows),
                "bytes_per_step": last["bytes_sent"],
                "collectives_per_step": last["collectives"],
            }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=4e6, help="approximate number of parameters")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per phase")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--kernels", default=None, help="codec implementation (default: auto)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_time.json"))
    args = parser.parse_args()
    result = run_local_ranks(_rank, args.world_size, args)
    n, numel = result["world_size"], result["numel"]
    ideal = 2 * (n - 1) / n * numel / 8
    fp32 = 2 * (n - 1) / n * numel * 4
    result.update(machine=f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                  date=datetime.date.today().isoformat(), ideal_1bit_bytes=ideal, fp32_ring_bytes=fp32)
    print(f"{numel / 1e6:.2f}M parameters, {n} gloo ranks on {result['machine']}")
    print("| phase | step (median) | optimizer step | comm | bytes/step/rank | vs 1-bit ideal | vs fp32 ring | collectives |")
    print("|---|---|---|---|---|---|---|---|")
    for phase, r in result["phases"].items():
        print(f"| {phase} | {r['step_s_median'] * 1e3:.1f} ms | {r['optimizer_step_s_median'] * 1e3:.1f} ms "
              f"| {r['comm_s_median'] * 1e3:.1f} ms | {r['bytes_per_step']:,} | {r['bytes_per_step'] / ideal:.3f}x "
              f"| {fp32 / r['bytes_per_step']:.1f}x fewer | {r['collectives_per_step']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
