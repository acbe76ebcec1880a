"""What ``freeze_step="auto"`` costs during warmup: the time of its check, per check and per step.

    python benchmarks/autofreeze_cost.py                 # the 25.2M-parameter model of peers.py
    python benchmarks/autofreeze_cost.py --params 1e8

Every ``onebit.autofreeze.WINDOW`` warmup steps the optimizer measures the frozen update's
denominator (``onebit.autofreeze.measure``: one pass over the variance); nothing else of the
decision costs time, and it sends nothing. This builds ``OnebitAdam(freeze_step="auto")`` on the
model of ``peers.py``, takes one step so that the variance exists, and times ``measure`` on one
thread (as each rank of the benchmarks runs). Compare ``per step`` with a warmup step's time from
``slowlink.py`` (``benchmarks/README.md``). Writes ``results/autofreeze_cost.{json,md}``.
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

from onebit import OnebitAdam
from onebit.autofreeze import WINDOW, measure

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers import make_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=25.2e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = make_model(args.params, args.width)
    opt = OnebitAdam(model.parameters(), lr=1e-5, freeze_step="auto", comm_backend_name="local")
    model(torch.randn(8, args.width)).square().mean().backward()
    opt.step()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        measure(opt._buckets, opt.param_groups, 1)
        times.append(time.perf_counter() - start)
    check_ms = 1000 * statistics.median(times)
    result = {
        "params": sum(p.numel() for p in model.parameters()), "repeats": args.repeats, "window": WINDOW,
        "check_ms_median": check_ms, "check_ms_quartiles": [1000 * q for q in statistics.quantiles(times, n=4)],
        "per_step_ms": check_ms / WINDOW,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "load_average": os.getloadavg()[0], "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
    }
    lines = [
        "# freeze_step=\"auto\": the cost of its check",
        f"{result['params']:,} parameters; {result['machine']}; one thread; load average {result['load_average']:.2f}; "
        f"{result['date']}",
        "",
        "| check (median of {0}) | quartiles | checks | per warmup step |".format(args.repeats),
        "|---:|---:|---:|---:|",
        f"| {check_ms:.1f} ms | {result['check_ms_quartiles'][0]:.1f}-{result['check_ms_quartiles'][2]:.1f} ms "
        f"| every {WINDOW} steps | {result['per_step_ms']:.2f} ms |",
    ]
    print("\n".join(lines))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autofreeze_cost.json").write_text(json.dumps(result, indent=2))
    (out / "autofreeze_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
