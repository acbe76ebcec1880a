"""The local-step mode (OnebitDiLoCo) on a rate-capped link: time per step and compute utilisation.

    sudo python benchmarks/local_steps.py                      # 0.1 and 1 Gbit/s, two models, 2 ranks
    python benchmarks/local_steps.py --loopback --rounds 3     # no namespaces: a smoke test

For each model and rate it builds a private network (``benchmarks/netns.py``), starts one rank per
namespace (``benchmarks/peers.py``) and times, interleaved in the same run, DDP + Adam and
OnebitDiLoCo's two kinds of step: the inner step (an AdamW step, no communication at all: the loop
without communication) and the outer step (the inner step, then the 1-bit all-reduce of the
pseudo-gradient: ``outer_bits`` passes, at the defaults). A run with ``sync_every=H`` takes ``H - 1``
inner steps per outer step, so its
average step is ``((H - 1) inner + outer) / H``; the table gives it for several H with

- **utilisation** = inner / average: the share of the time spent computing, the rest the link;
- **vs DDP + Adam**: DDP + Adam's step time over the average.

Medians over ``--rounds`` rounds; each round's time of a step is the slowest rank's. Writes
``local_steps.json`` and ``local_steps.md`` to ``--out-dir`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import netns  # noqa: E402
from slowlink import code_version, launch, machine_info  # noqa: E402

#: name -> (approximate parameters, width, batch): the 25.2M model of the other benchmarks, and a
#: smaller one (8 x Linear(1024, 1024), batch 64) whose outer step weighs more against its compute.
MODELS = {"25.2M": (25.2e6, 2048, 32), "8x1024": (8.4e6, 1024, 64)}
SYNC_EVERY = (4, 8, 16, 32, 64, 128)
PARTS = {"adam": "adam", "inner": "diloco_inner", "outer": "diloco_outer"}


def medians(ranks: list[dict]) -> dict[str, float]:
    """Per part, the median over rounds of the slowest rank's step time (seconds)."""
    out = {}
    for key, part in PARTS.items():
        rounds = zip(*(r["configs"][part] for r in ranks))
        out[key] = statistics.median(max(row["step_s"] for row in rows) for rows in rounds)
    return out


def bytes_per_step(ranks: list[dict]) -> dict[str, int]:
    """Rank 0's bytes sent by each kind of OnebitDiLoCo step (its comm_stats), median over rounds."""
    return {key: int(statistics.median(row["onebit"]["bytes_sent"] for row in ranks[0]["configs"][PARTS[key]]))
            for key in ("inner", "outer")}


def table_rows(times: dict[str, float]) -> list[dict]:
    rows = []
    for h in SYNC_EVERY:
        average = ((h - 1) * times["inner"] + times["outer"]) / h
        rows.append({"sync_every": h, "average_s": average, "utilisation": times["inner"] / average,
                     "vs_ddp_adam": times["adam"] / average})
    return rows


def markdown(result: dict) -> str:
    lines = [f"# OnebitDiLoCo on a capped link ({result['date']}, {result['machine'].get('cpu', '')}, "
             f"{result['world_size']} ranks, one thread each; {result['code'].get('commit', '')})", ""]
    for run in result["runs"]:
        t = run["medians"]
        rate = "loopback" if run["rate_gbit"] is None else f"{run['rate_gbit']:g} Gbit/s"
        lines += [f"## {run['model']} ({run['numel'] / 1e6:.1f}M parameters), {rate}", "",
                  f"DDP + Adam {t['adam'] * 1e3:,.0f} ms a step; OnebitDiLoCo inner step (no communication) "
                  f"{t['inner'] * 1e3:,.0f} ms, outer step {t['outer'] * 1e3:,.0f} ms "
                  f"({run['bytes_sent']['outer'] / 2**20:,.2f} MiB sent by rank 0).", "",
                  "| sync_every | average step | utilisation | vs DDP + Adam |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['sync_every']} | {r['average_s'] * 1e3:,.0f} ms | {r['utilisation']:.1%} | "
                  f"{r['vs_ddp_adam']:.2f}x |" for r in run["rows"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",")], default=[0.1, 1.0],
                        help="link rates in Gbit/s (comma-separated)")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS),
                        help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--loopback", action="store_true", help="no namespaces: time on loopback")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; expected some of {', '.join(MODELS)}")
    use_netns = not args.loopback
    if use_netns and netns.unavailable_reason():
        parser.error(f"no slow link here ({netns.unavailable_reason()}); pass --loopback for a smoke test")
    result = {"date": datetime.date.today().isoformat(), "machine": machine_info(), "code": code_version(),
              "world_size": args.world_size, "rounds": args.rounds, "load_average_1min_start": os.getloadavg()[0],
              "runs": []}
    for model in args.models:
        params, width, batch = MODELS[model]
        peer_args = ["--params", str(params), "--width", str(width), "--batch", str(batch), "--rounds",
                     str(args.rounds), "--warmup-steps", "1", "--cost-rounds", "0", "--configs", "adam,diloco"]
        for rate in (args.rates if use_netns else [None]):
            print(f"--- {model}, {'loopback' if rate is None else f'{rate:g} Gbit/s'}, load {os.getloadavg()[0]:.2f}",
                  flush=True)
            if rate is None:
                ranks = launch(args.world_size, peer_args, link=None, timeout_s=args.timeout_s)
            else:
                with netns.SlowLink(args.world_size, rate) as link:
                    ranks = launch(args.world_size, peer_args, link=link, timeout_s=args.timeout_s)
            times = medians(ranks)
            result["runs"].append({"model": model, "numel": ranks[0]["numel"], "rate_gbit": rate, "medians": times,
                                   "bytes_sent": bytes_per_step(ranks), "rows": table_rows(times)})
    result["load_average_1min_end"] = os.getloadavg()[0]
    text = markdown(result)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "local_steps.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "local_steps.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
