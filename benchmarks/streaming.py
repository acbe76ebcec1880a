"""OnebitDiLoCo's ``sync_delay`` on a rate-capped link: how much of the outer step's exchange the
inner steps hide, measured over whole rounds of consecutive steps.

    sudo python benchmarks/streaming.py                            # 0.1 Gbit/s, 25.2M params, 2 ranks
    sudo python benchmarks/streaming.py --quick --out-dir /tmp/s   # small model, 1 round, < 1 minute

Two ranks in two network namespaces joined by one veth capped by ``tc tbf`` (``benchmarks/netns.py``).
Each configuration trains its own copy of the model (stacked ``Linear(2048, 2048)``, batch 32);
interleaved round by round, each runs one **round**: ``H`` consecutive steps (forward, backward,
``optimizer.step()``), from a barrier to a barrier, with nothing in between. The round is aligned
so that no exchange is in flight at its ends (it ends with the step where the last fragment's
exchange lands), so each round carries one outer step of every fragment and all of its waiting:

* ``compute``: OnebitDiLoCo with no outer step in the round (``sync_every`` 10**9): inner steps
  only, nothing sent: the time of the loop without communication;
* ``defaults``: OnebitDiLoCo's defaults at ``sync_every`` 32 (two 1-bit passes, 4 fragments,
  ``sync_delay`` 2);
* ``tau<D>`` (``fragments`` 1) and ``f<P>_tau<D>``: the same with ``sync_delay`` ``D`` and
  ``fragments`` ``P`` given.

**Utilisation** is ``compute``'s round time over the configuration's: the share of the time spent
computing. The time of a round is the slower rank's; medians over rounds. Writes ``<name>.json``
and ``<name>.md`` to ``--out-dir`` (default ``benchmarks/results``, name ``streaming_2r``; with
``--quick``, ``streaming_quick``). Needs root and iproute2; without them it says why and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import netns  # noqa: E402
from peers import make_model  # noqa: E402
from slowlink import code_version, machine_info  # noqa: E402

SYNC_EVERY = 32
CONFIGS = ("compute", "defaults", "tau0", "tau1", "tau2", "tau4", "f4_tau0", "f4_tau2")
UTILISATION_TARGET = 0.95  # issue 42: 2 ranks at 100 Mbit/s, 25.2M parameters, with the defaults


def settings(name: str, sync_every: int) -> dict:
    """A configuration's OnebitDiLoCo settings."""
    if name == "compute":
        return {"sync_every": 10 ** 9}
    if name == "defaults":  # (fragments and sync_delay left out: OnebitDiLoCo's own choice for H)
        return {"sync_every": sync_every}
    fragments, _, delay = name.removeprefix("f").partition("_tau") if name.startswith("f") else ("1", "", name[3:])
    return {"sync_every": sync_every, "fragments": int(fragments), "sync_delay": int(delay)}


def round_end(opt) -> int:
    """The step (mod H) a round ends at: where the last fragment's exchange lands."""
    from onebit.fragments import offset

    last = offset(opt.fragments - 1, opt.sync_every, opt.fragments)
    return (last + opt.sync_delay) % opt.sync_every


class Config:
    def __init__(self, name: str, args: argparse.Namespace) -> None:
        from onebit import OnebitDiLoCo

        self.name = name
        self.model = make_model(args.params, args.width)
        self.optimizer = OnebitDiLoCo(self.model.parameters(), lr=1e-5, comm_backend_name="gloo",
                                      **settings(name, args.sync_every))
        self.steps = args.sync_every

    def step(self, x: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(x).square().mean().backward()
        self.optimizer.step()

    def align(self, x: torch.Tensor) -> None:
        """Untimed steps until the next round starts right after an exchange landed."""
        if self.name == "compute":
            return
        while self.optimizer.step_count % self.optimizer.sync_every != round_end(self.optimizer):
            self.step(x)

    def round(self, x: torch.Tensor) -> dict:
        dist.barrier()
        start = time.perf_counter()
        before = self.optimizer.comm_stats()["total"]["bytes_sent"]
        for _ in range(self.steps):
            self.step(x)
        end = time.perf_counter()
        dist.barrier()
        return {"round_s": end - start, "bytes_sent": self.optimizer.comm_stats()["total"]["bytes_sent"] - before}


def worker(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        configs = [Config(name, args) for name in args.configs]
        torch.manual_seed(1000 + rank)
        x = torch.randn(args.batch, args.width)
        for c in configs:  # lazy inits, the layout check, the first steps' checks
            for _ in range(3):
                c.step(x)
        rows: dict[str, list[dict]] = {c.name: [] for c in configs}
        for r in range(args.rounds):
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                c.align(x)
                rows[c.name].append(c.round(x))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result = {"rank": rank, "world_size": world, "numel": sum(p.numel() for p in configs[0].model.parameters()),
              "load_average_1min": os.getloadavg()[0], "configs": rows}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


def launch(link: netns.SlowLink, args: argparse.Namespace, port: int) -> list[dict]:
    """The two ranks (``--worker``) in the link's namespaces, under ``timeout``; each rank's JSON."""
    with tempfile.TemporaryDirectory(prefix="onebit-streaming-") as tmp:
        argv = ["timeout", str(int(args.timeout_s)), sys.executable, str(Path(__file__).resolve()), "--worker",
                "--out", tmp, "--params", str(args.params), "--width", str(args.width), "--batch", str(args.batch),
                "--rounds", str(args.rounds), "--sync-every", str(args.sync_every), "--configs", ",".join(args.configs),
                "--timeout-s", str(args.timeout_s)]
        env = {**os.environ, "WORLD_SIZE": str(link.world_size), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        netns.wait_ranks([link.popen(rank, argv, {**env, "RANK": str(rank)}) for rank in range(link.world_size)],
                         args.timeout_s + 10)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(link.world_size)]


def summarize(ranks: list[dict], rate_gbit: float, sync_every: int) -> dict:
    names = list(ranks[0]["configs"])
    rounds = len(ranks[0]["configs"][names[0]])
    out = {}
    for name in names:
        times = [max(r["configs"][name][i]["round_s"] for r in ranks) for i in range(rounds)]
        out[name] = {"round_s": statistics.median(times), "rounds_s": times,
                     "step_s": statistics.median(times) / sync_every,
                     "bytes_per_step": statistics.median(row["bytes_sent"] for row in ranks[0]["configs"][name]) / sync_every}
    compute = out.get("compute")
    for name, row in out.items():
        row["utilisation"] = compute["round_s"] / row["round_s"] if compute else None
    return {"rate_gbit": rate_gbit, "numel": ranks[0]["numel"], "configs": out}


def markdown(result: dict) -> str:
    lines = [f"# OnebitDiLoCo's sync_delay on a capped link, {result['world_size']} ranks", "",
             f"{result['machine'].get('cpu', '')}; {result['date']}; commit {result['code'].get('commit', '?')}; "
             f"load average {result['load_average_1min_start']:.2f} at the start, {result['load_average_1min_end']:.2f} "
             "at the end.", "",
             f"Rounds of H = {result['sync_every']} consecutive steps (forward, backward, step), interleaved; the "
             "slower rank's time; medians over rounds. Utilisation: `compute`'s round time (no outer step, nothing "
             "sent) over the configuration's.", ""]
    for run in result["runs"]:
        lines += [f"## {run['rate_gbit']:g} Gbit/s, {run['numel'] / 1e6:.1f}M parameters", "",
                  "| configuration | settings | ms per step | utilisation | bytes per step |", "|---|---|---:|---:|---:|"]
        for name, row in run["configs"].items():
            u = "-" if row["utilisation"] is None else f"{row['utilisation']:.1%}"
            text = ", ".join(f"{k} {v}" for k, v in settings(name, result["sync_every"]).items())
            lines.append(f"| {name} | {text} | {row['step_s'] * 1e3:.1f} | {u} | {row['bytes_per_step'] / 1e3:.1f} KB |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, 1 round, 1 Gbit/s: a smoke test")
    parser.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=None,
                        help="link rates in Gbit/s (default 0.1; --quick: 1)")
    parser.add_argument("--params", type=float, default=None, help="approximate parameters (default 25.2M)")
    parser.add_argument("--width", type=int, default=None, help="Linear width (default 2048)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per configuration (default 4)")
    parser.add_argument("--sync-every", type=int, default=SYNC_EVERY)
    parser.add_argument("--configs", type=lambda v: v.split(","), default=list(CONFIGS))
    parser.add_argument("--timeout-s", type=float, default=None, help="per launch (default 1200; --quick 120)")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--name", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.params = args.params or (2.6e5 if args.quick else 25.2e6)
    args.width = args.width or (256 if args.quick else 2048)
    args.rounds = args.rounds or (1 if args.quick else 4)
    args.timeout_s = args.timeout_s or (120 if args.quick else 1200)
    if args.quick and not args.worker and args.sync_every == SYNC_EVERY:
        args.sync_every = 16
    for name in args.configs:
        if name not in CONFIGS and not name.startswith(("tau", "f")):
            parser.error(f"unknown configuration {name!r}; expected names like {', '.join(CONFIGS)}")
    if args.worker:
        worker(args)
        return 0
    reason = netns.unavailable_reason()
    if reason:
        print(f"SKIP: the capped link needs network namespaces: {reason}")
        return 0
    result = {"quick": args.quick, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine_info(), "code": code_version(), "world_size": 2, "sync_every": args.sync_every,
              "load_average_1min_start": os.getloadavg()[0], "runs": []}
    for i, rate in enumerate(args.rates or ([1.0] if args.quick else [0.1])):
        print(f"--- {rate:g} Gbit/s, load {os.getloadavg()[0]:.2f}", flush=True)
        with netns.SlowLink(2, rate) as link:
            ranks = launch(link, args, port=29600 + (os.getpid() + i) % 300)
        run = summarize(ranks, rate, args.sync_every)
        result["runs"].append(run)
        for name, row in run["configs"].items():
            u = "-" if row["utilisation"] is None else f"{row['utilisation']:.1%}"
            print(f"  {name:<10} {row['step_s'] * 1e3:8.1f} ms/step  utilisation {u}", flush=True)
    result["load_average_1min_end"] = os.getloadavg()[0]
    text = markdown(result)
    print(text)
    name = args.name or ("streaming_quick" if args.quick else "streaming_2r")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
