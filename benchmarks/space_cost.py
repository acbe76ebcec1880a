"""What ``compression_space="preconditioned"`` costs per compression step, against the momentum space
(DeepSpeed's), measured side by side in one run.

    python benchmarks/space_cost.py                         # 2 ranks, 25.2M params, 30 rounds
    python benchmarks/space_cost.py --optimizer lamb --rounds 10
    python benchmarks/space_cost.py --bound                 # and update_bound=None: results/space_cost_bound.*
    python benchmarks/space_cost.py --optimizer lamb --trust-ratio   # and LAMB's trust_ratio="frozen"
    python benchmarks/space_cost.py --compact               # compressed state: results/space_cost_compact.*

Each rank builds one model per configuration (the model of ``peers.py``, same initial values) and
runs their compression steps interleaved: every round runs one step of each configuration, in a
rotating order, so that a slow moment of the machine hits all of them alike. Reported per
configuration: the median of ``optimizer.step()`` and of the whole step (forward, backward, step),
the paired ratio against the first configuration (median of the per-round ratios), and the bytes
each rank sent per step. Gloo on loopback: the wire is not a slow network here (see slowlink.py);
what differs between the spaces is CPU work. Writes ``results/space_cost[_<optimizer>].{json,md}``.
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

from onebit import OnebitAdam, OnebitLamb

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from local_ranks import run_local_ranks  # noqa: E402
from peers import make_model  # noqa: E402

OPTIMIZERS = {"adam": OnebitAdam, "lamb": OnebitLamb}


def _configs(args: argparse.Namespace) -> list[tuple[str, dict]]:
    if args.compact:  # float32 state first; then the errors in bfloat16, and 1 / d alone in bfloat16 too; each space
        wide = {"error_dtype": torch.float32, "preconditioner_dtype": torch.float32}
        errors = {**wide, "error_dtype": torch.bfloat16}
        compact = {**errors, "preconditioner_dtype": torch.bfloat16}
        return [("preconditioned", wide), ("preconditioned, bf16 errors", errors), ("preconditioned, compact", compact),
                ("momentum", {"compression_space": "momentum"}),
                ("momentum, compact", {"compression_space": "momentum", **compact})]
    # "preconditioned" is the default: with update_bound="auto", i.e. m / d clamped at 1 in the codec's pass
    out = [("momentum", {"compression_space": "momentum"}), ("preconditioned", {"compression_space": "preconditioned"})]
    if args.unfused:  # the multiplies in passes of their own (as with kernels without `multipliers`)
        out.append(("preconditioned, multiplies unfused", {"compression_space": "preconditioned", "kernels": "cpu-unfused"}))
    if args.bound:  # without the clamp of m / d (the default before 2026-11-26)
        out.append(("preconditioned, update_bound=None", {"compression_space": "preconditioned", "update_bound": None}))
    if args.trust_ratio:  # 1-bit LAMB's frozen rule (the default before 2026-11-26) beside the live one
        out.append(("preconditioned, trust_ratio='frozen'", {"compression_space": "preconditioned",
                                                             "trust_ratio": "frozen"}))
    return out


def _rank(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    if args.unfused:
        import dataclasses

        from onebit.kernels import get_kernels, registry
        cpu = get_kernels(torch.device("cpu"), "cpu")
        registry.register("cpu-unfused", lambda: dataclasses.replace(cpu, name="cpu-unfused", multipliers=False))
    torch.manual_seed(rank)
    x = torch.randn(args.batch, args.width)
    runs = []
    for name, options in _configs(args):
        model = make_model(args.params, args.width)
        opt = OPTIMIZERS[args.optimizer](model.parameters(), lr=1e-5, freeze_step=2, comm_backend_name="gloo",
                                         **options)
        runs.append({"name": name, "model": model, "opt": opt, "step": [], "total": [], "bytes": 0})
    for run in runs:  # warmup and the first compression steps (allocation, the switch)
        for _ in range(4):
            _step(run, x)
    for r in range(args.rounds):
        for k in range(len(runs)):
            run = runs[(r + k) % len(runs)]
            dist.barrier()
            total, step = _step(run, x)
            run["total"].append(total)
            run["step"].append(step)
            run["bytes"] = run["opt"].comm_stats()["last_step"]["bytes_sent"]
    if rank == 0:
        base = runs[0]
        result = {"numel": sum(p.numel() for p in base["model"].parameters()), "world_size": world,
                  "optimizer": args.optimizer, "rounds": args.rounds, "configs": []}
        for run in runs:
            result["configs"].append({
                "name": run["name"],
                "optimizer_step_ms": statistics.median(run["step"]) * 1e3,
                "step_ms": statistics.median(run["total"]) * 1e3,
                "optimizer_step_paired": statistics.median(a / b for a, b in zip(run["step"], base["step"])),
                "step_paired": statistics.median(a / b for a, b in zip(run["total"], base["total"])),
                "bytes_per_step": run["bytes"],
            })
        result["load_average_1min"] = os.getloadavg()[0]
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _step(run: dict, x: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    run["opt"].zero_grad()
    run["model"](x).square().mean().backward()
    backward_done = time.perf_counter()
    run["opt"].step()
    end = time.perf_counter()
    return end - start, end - backward_done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--params", type=float, default=25.2e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--unfused", action="store_true",
                        help="add the preconditioned space with the multiplies in passes of their own")
    parser.add_argument("--bound", action="store_true",
                        help="add the preconditioned space without its default bound, update_bound=None "
                             "(writes space_cost[_lamb]_bound.*)")
    parser.add_argument("--trust-ratio", action="store_true",
                        help="(--optimizer lamb) add trust_ratio='frozen', DeepSpeed's rule, beside the default "
                             "'live' (writes space_cost_lamb_trust.*)")
    parser.add_argument("--compact", action="store_true",
                        help="compressed state instead: error_dtype and preconditioner_dtype bfloat16 beside the "
                             "defaults, in each space (writes space_cost[_lamb]_compact.*)")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.trust_ratio and args.optimizer != "lamb":
        parser.error("--trust-ratio is 1-bit LAMB's: pass --optimizer lamb")
    result = run_local_ranks(_rank, args.world_size, args)
    result.update(machine=f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    lines = [f"{type_name(args.optimizer)} compression steps, {result['numel'] / 1e6:.1f}M parameters, "
             f"{result['world_size']} gloo ranks (loopback, one thread each), {args.rounds} interleaved rounds; "
             f"{result['machine']}; load average {result['load_average_1min']:.2f}; {result['date']}.", "",
             "| configuration | optimizer.step() ms | paired vs first | whole step ms | paired vs first | bytes/step/rank |",
             "|---|---:|---:|---:|---:|---:|"]
    for c in result["configs"]:
        lines.append(f"| {c['name']} | {c['optimizer_step_ms']:.1f} | {c['optimizer_step_paired']:.3f}x | "
                     f"{c['step_ms']:.1f} | {c['step_paired']:.3f}x | {c['bytes_per_step']:,} |")
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = ("" if args.optimizer == "adam" else f"_{args.optimizer}") + ("_bound" if args.bound else "")
    suffix += ("_trust" if args.trust_ratio else "") + ("_compact" if args.compact else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"space_cost{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"space_cost{suffix}.md").write_text(text)


def type_name(optimizer: str) -> str:
    return OPTIMIZERS[optimizer].__name__


if __name__ == "__main__":
    main()
