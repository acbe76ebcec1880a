"""Where the time of an OnebitAdam compression step goes, op by op, with the source line of each.

    python benchmarks/profile_step.py                      # 2 ranks on loopback, 25.2M params
    python benchmarks/profile_step.py --params 4e6 --steps 2

Two gloo ranks (loopback: the wire part of a compression step is small; the slow-link numbers are
in slowlink.py) train the model of ``peers.py`` with ``OnebitAdam(freeze_step=2)``; after the
warmup steps, ``--steps`` compression steps of ``optimizer.step()`` run under ``torch.profiler``
with Python stacks. Rank 0 prints the ops by self CPU time per step, each with the line in onebit
that called it (the fused codec runs in C++ through ctypes, so it shows as the Python line that
calls it), and writes ``profile_step.json`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from onebit import OnebitAdam

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from local_ranks import run_local_ranks  # noqa: E402
from peers import make_model  # noqa: E402


def _site(event) -> str:
    """The innermost Python function in onebit that the op ran under (``path(def line): name``)."""
    parent = event.cpu_parent
    while parent is not None:
        if "onebit/" in parent.name and "(" in parent.name:
            return parent.name[parent.name.index("onebit/"):]
        parent = parent.cpu_parent
    return "?"


def _op_name(name: str) -> str:
    if name.startswith("<built-in method wait"):
        return "wait for the collective (peer skew + transfer)"
    if "onebit/" in name and "(" in name:
        own = " (its own time: the fused C++ codec, called through ctypes)" if "kernels/cpu.py" in name else " (own time)"
        return "Python frame " + name[name.index("onebit/"):] + own
    return name


def _rank(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    model = make_model(args.params, args.width)
    opt = OnebitAdam(model.parameters(), lr=1e-5, freeze_step=2, comm_backend_name="gloo", kernels=args.kernels,
                     compression_space=args.compression_space)
    x = torch.randn(args.batch, args.width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        dist.barrier()
        opt.step()

    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(args.steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            dist.barrier()
            with torch.profiler.record_function("onebit.step"):
                opt.step()
    if rank == 0:
        steps = [e for e in prof.events() if e.name == "onebit.step"]
        step_us = sum(e.cpu_time_total for e in steps) / len(steps)
        windows = [(e.time_range.start, e.time_range.end) for e in steps]
        by_site: dict[tuple[str, str], float] = defaultdict(float)
        for e in prof.events():
            if e.name == "onebit.step" or not any(a <= e.time_range.start and e.time_range.end <= b for a, b in windows):
                continue
            by_site[(_op_name(e.name), _site(e))] += e.self_cpu_time_total / len(steps)
        rows = sorted(({"op": op, "site": site, "ms": us / 1e3} for (op, site), us in by_site.items()),
                      key=lambda r: -r["ms"])
        python_ms = step_us / 1e3 - sum(r["ms"] for r in rows)
        Path(out).write_text(json.dumps({"numel": sum(p.numel() for p in model.parameters()), "world_size": world,
                                         "step_ms": step_us / 1e3, "python_and_ctypes_ms": python_ms,
                                         "ops": rows, "load_average_1min": os.getloadavg()[0]}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25.2e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--compression-space", default="momentum", choices=("momentum", "preconditioned"))
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args()
    result = run_local_ranks(_rank, args.world_size, args)
    lines = [f"OnebitAdam compression step (compression_space={args.compression_space!r}), "
             f"{result['numel'] / 1e6:.1f}M params, {result['world_size']} gloo ranks "
             f"(loopback), rank 0, mean of {args.steps} profiled steps: {result['step_ms']:.0f} ms; load average "
             f"{result['load_average_1min']:.2f}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
             "", "| op | under | ms/step | share |", "|---|---|---:|---:|"]
    for row in result["ops"]:
        if row["ms"] >= 0.5:
            lines.append(f"| {row['op']} | {row['site']} | {row['ms']:.1f} | {row['ms'] / result['step_ms'] * 100:.0f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.compression_space == "momentum" else f"_{args.compression_space}"
    (args.out_dir / f"profile_step{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"profile_step{suffix}.md").write_text(text)


if __name__ == "__main__":
    main()
