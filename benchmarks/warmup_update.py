"""The cost of 1-bit Adam's warmup update written a piece at a time (since 2026-11-28) against the
whole direction in a buffer of the bucket's size (before): one rank, interleaved rounds.

    python benchmarks/warmup_update.py --params 25.2e6 --rounds 30

Both variants run ``onebit.adam.adam_step_``'s operations on the same bucket: the moments, then
the update; ``pieces`` is the library's (``_adam_update_in_pieces_``, a million elements at a
time), ``whole`` writes ``adam_direction_`` into a flat scratch buffer and steps from its views,
as the library did. Prints the median time of each and their ratio, checks that the parameters
end bit for bit equal, and writes ``results/warmup_update.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from onebit import OnebitAdam
from onebit import functional as F
from onebit.adam import _adam_update_in_pieces_, decayed_step_

HERE = Path(__file__).resolve().parent


def _whole(bucket, group, bc1, bc2) -> None:
    m, v = bucket.buffers["exp_avg"], bucket.buffers["exp_avg_sq"]
    direction = F.adam_direction_(bucket.scratch("update"), m, v, group["eps"], bc1, bc2)
    decayed_step_(bucket, bucket.view(direction), group["lr"], group["weight_decay"])


def _setup(numel: int, layers: int) -> tuple[list[torch.nn.Parameter], OnebitAdam]:
    torch.manual_seed(0)
    side = int((numel / layers) ** 0.5)
    params = [torch.nn.Parameter(torch.randn(side, side)) for _ in range(layers)]
    opt = OnebitAdam(params, lr=1e-3, freeze_step=10**6, weight_decay=0.01, bias_correction=True,
                     comm_backend_name="local")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # buckets, moments
    return params, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25.2e6)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args()
    variants = {"pieces": _adam_update_in_pieces_, "whole": _whole}
    runs = {name: _setup(int(args.params), args.layers) for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, update in variants.items():
            _, opt = runs[name]
            group = opt.param_groups[0]
            start = time.perf_counter()
            with torch.no_grad():
                for bucket in opt._buckets:
                    update(bucket, group, 0.1, 0.001)
            times[name].append(time.perf_counter() - start)
    same = all(torch.equal(a, b) for a, b in zip(runs["pieces"][0], runs["whole"][0]))
    numel = sum(p.numel() for p in runs["pieces"][0])
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "params": numel, "rounds": args.rounds, "median_s": med, "ratio_pieces_to_whole": med["pieces"] / med["whole"],
              "bit_identical": same}
    lines = ["# 1-bit Adam's warmup update: in pieces vs a whole buffer", "",
             f"{result['machine']}; {result['date']}; {numel:,} parameters in {args.layers} tensors, one rank, "
             f"{args.rounds} interleaved rounds (the update after the moments; `whole` keeps its buffer between "
             "rounds, as warmup did).", "",
             "| variant | median s | vs whole |", "|---|---:|---:|"]
    lines += [f"| {name} | {med[name]:.4f} | {med[name] / med['whole']:.3f} |" for name in variants]
    lines += ["", f"Parameters bit for bit equal after {args.rounds} rounds: {same}."]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "warmup_update.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / "warmup_update.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
