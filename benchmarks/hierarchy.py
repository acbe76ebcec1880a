"""The two-level 1-bit all-reduce on an emulated 2 nodes x 2 ranks: bytes between nodes and step time.

    sudo python benchmarks/hierarchy.py                            # 1 and 0.1 Gbit/s, 8.4M params, ~2.5 minutes
    sudo python benchmarks/hierarchy.py --quick --out-dir /tmp/h   # small model, 2 rounds, < 1 minute

For each rate it builds two "nodes" (``benchmarks/netns.py`` with ``ranks_per_node=2``: one network
namespace per node shared by its two ranks, so traffic inside a node goes over that namespace's
loopback, and one veth between the nodes capped by ``tc tbf``), starts four gloo ranks (this script
with ``--worker``) and times, interleaved round by round, one step of each of:

* ``adam``: ``DistributedDataParallel`` + ``torch.optim.Adam`` (fp32 ring all-reduce of the gradients);
* ``flat``: ``OnebitAdam`` compression step, ``hierarchy=None`` (the flat compressed all-reduce);
* ``compressed`` / ``node_mean``: ``OnebitAdam`` compression step, ``hierarchy=2`` with that
  ``hierarchy_variant`` (:mod:`onebit.hierarchy`).

Each step runs from a barrier to a barrier after ``optimizer.step()``; its time is the slower rank's.
Between the barriers each node's first rank reads its namespace's ``/sys/class/net`` counters (the
veth: what the node sent to and received from the other node; ``lo``: traffic inside the node), and
every rank reads ``comm_stats()["last_step"]`` (``inter_node_bytes_sent``, ``intra_node_bytes_sent``,
``bytes_sent``). Before the steps the ranks time an all-to-all inside each node (both nodes at once)
to measure the loopback's rate, the "intra-node bandwidth" that :func:`onebit.estimate.estimate_two_level`
takes, and a 4-byte all-reduce for its per-message latency; its prediction is printed next to each
measurement.

Writes ``<name>.json`` (every per-step number) and ``<name>.md`` to ``--out-dir`` (default
``benchmarks/results``, name ``hierarchy_2x2``; ``hierarchy_quick`` with ``--quick``). Needs root
and iproute2; without them it says why and exits with status 0, writing nothing. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
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

SCHEMES = ("adam", "flat", "compressed", "node_mean")
LABELS = {"adam": "DDP + Adam (fp32)", "flat": "1-bit flat", "compressed": "1-bit two-level compressed",
          "node_mean": "1-bit two-level node_mean"}
ESTIMATE_KEY = {"adam": "fp32", "flat": "flat", "compressed": "compressed", "node_mean": "node_mean"}
# Headers per packet as the veth counts them: Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12.
HEADER_BYTES = 66
FIELDS = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")


# ---------------------------------------------------------------------------------------------- one rank


def _counters() -> dict[str, dict[str, int]]:
    out = {}
    for iface in (os.environ.get("ONEBIT_BENCH_IFNAME"), "lo"):
        if iface:
            base = Path("/sys/class/net") / iface / "statistics"
            out["veth" if iface != "lo" else "lo"] = {f: int((base / f).read_text()) for f in FIELDS}
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: {f: after[k][f] - before[k][f] for f in FIELDS} for k in after}


def _intra_gbps(group, numel: int, local: int, repeats: int = 3) -> float:
    """Payload rate (Gbit/s) of one rank inside its node: an fp32 all-to-all of ``numel`` elements
    in the node's group (every node at once), the median of ``repeats`` after one warmup."""
    per = max(1, numel // local)
    send, recv = torch.randn(local * per), torch.empty(local * per)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(recv, send, group=group)
        if i:
            times.append(time.perf_counter() - start)
    return 4 * per * (local - 1) * 8 / statistics.median(times) / 1e9


def _latency_s(world: int, repeats: int = 20) -> float:
    """Seconds per message: a 4-byte all-reduce on every rank (a ring's ``2 (n-1)`` messages in a
    row), the median of ``repeats``, divided by ``2 (n-1)``: the estimate's ``latency_s``."""
    flag = torch.zeros(1)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flag)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / (2 * (world - 1))


class Scheme:
    def __init__(self, name: str, params: float, width: int, local: int) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from onebit import OnebitAdam

        self.name = name
        self.model = make_model(params, width)
        self.forward = self.model
        if name == "adam":
            self.forward = DDP(self.model)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        else:
            hierarchy = None if name == "flat" else local
            variant = "compressed" if name == "flat" else name
            self.optimizer = OnebitAdam(self.model.parameters(), lr=1e-5, freeze_step=1, comm_backend_name="gloo",
                                        hierarchy=hierarchy, hierarchy_variant=variant)
            if hierarchy is not None and self.optimizer.topology is None:
                raise RuntimeError(f"{name}: OnebitAdam(hierarchy={local}) fell back to the flat all-reduce")
        self.rows: list[dict] = []

    def step(self, x: torch.Tensor, record: bool, reader: bool) -> None:
        dist.barrier()
        before = _counters() if reader else None
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.forward(x).square().mean().backward()
        middle = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        dist.barrier()
        if not record:
            return
        row = {"step_s": end - start, "fwd_bwd_s": middle - start, "opt_s": end - middle}
        if reader:
            row["counters"] = _delta(_counters(), before)
        if self.name != "adam":
            stats = self.optimizer.comm_stats()
            if stats["phase"] != "compression":
                raise RuntimeError(f"{self.name}: timed a {stats['phase']} step")
            row["stats"] = stats["last_step"]
        self.rows.append(row)


def worker(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = args.ranks_per_node
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        nodes = [dist.new_group(list(range(p * local, (p + 1) * local))) for p in range(world // local)]
        numel = sum(p.numel() for p in make_model(args.params, args.width).parameters())
        intra_gbps = _intra_gbps(nodes[rank // local], numel, local)
        latency_s = _latency_s(world)
        schemes = [Scheme(name, args.params, args.width, local) for name in args.schemes]
        torch.manual_seed(1000 + rank)
        x = torch.randn(args.batch, args.width)
        reader = rank % local == 0  # the node's counters: one reader per namespace
        for s in schemes:  # OnebitAdam: the warmup step, then the first compression step (frozen denominator)
            for _ in range(1 if s.name == "adam" else 2):
                s.step(x, record=False, reader=reader)
        for r in range(args.rounds):
            for s in schemes[r % len(schemes):] + schemes[:r % len(schemes)]:
                s.step(x, record=True, reader=reader)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result = {"rank": rank, "node": rank // local, "world_size": world, "ranks_per_node": local, "numel": numel,
              "tensors": sum(1 for _ in make_model(args.params, args.width).parameters()),
              "intra_gbps": intra_gbps, "latency_s": latency_s, "load_average_1min": os.getloadavg()[0],
              "schemes": {s.name: s.rows for s in schemes}}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- launch


def launch(link: netns.SlowLink, args: argparse.Namespace, port: int) -> list[dict]:
    return launch_workers(Path(__file__), "schemes", args.schemes, link, args, port)


def launch_workers(script: Path, flag: str, choices: list[str], link: netns.SlowLink, args: argparse.Namespace,
                   port: int) -> list[dict]:
    """The ranks (``script --worker``, comparing ``--<flag> choices``) in the link's namespaces; every
    process under ``timeout``; the ranks are killed when one fails or time runs out. Each rank's
    ``rank<r>.json``, in rank order."""
    world = link.world_size
    with tempfile.TemporaryDirectory(prefix=f"onebit-{script.stem}-") as tmp:
        argv = ["timeout", str(int(args.timeout_s)), sys.executable, str(script.resolve()), "--worker",
                "--out", tmp, "--params", str(args.params), "--width", str(args.width), "--batch", str(args.batch),
                "--rounds", str(args.rounds), f"--{flag}", ",".join(choices),
                "--ranks-per-node", str(link.ranks_per_node), "--timeout-s", str(args.timeout_s)]
        env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        netns.wait_ranks([link.popen(rank, argv, {**env, "RANK": str(rank)}) for rank in range(world)],
                         args.timeout_s + 10)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------------------------- summary


def _median(values) -> float:
    return statistics.median(list(values))


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def timing_medians(per_rank: list[list[dict]]) -> dict:
    """Medians over rounds of each rank's rows (``step_s``, ``fwd_bwd_s``, ``opt_s``); a round's time
    is its slowest rank's."""
    rounds = len(per_rank[0])

    def slowest(key: str) -> list[float]:
        return [max(rows[i][key] for rows in per_rank) for i in range(rounds)]

    steps = slowest("step_s")
    return {"steps_s": steps, "step_s": _median(steps), "step_s_quartiles": _quartiles(steps),
            "fwd_bwd_s": _median(slowest("fwd_bwd_s")), "opt_s": _median(slowest("opt_s"))}


def veth_medians(node: int, counters: list[dict]) -> dict:
    """A node's interface counters, median over rounds: its veth's tx / rx / both ways (bytes and
    tx packets, and the payload without headers) and its loopback's tx."""
    def median(f) -> float:
        return _median(f(x) for x in counters)

    return {"node": node, "tx_bytes": median(lambda x: x["veth"]["tx_bytes"]),
            "rx_bytes": median(lambda x: x["veth"]["rx_bytes"]),
            "both_bytes": median(lambda x: x["veth"]["tx_bytes"] + x["veth"]["rx_bytes"]),
            "tx_packets": median(lambda x: x["veth"]["tx_packets"]),
            "tx_payload_bytes": median(lambda x: x["veth"]["tx_bytes"] - HEADER_BYTES * x["veth"]["tx_packets"]),
            "lo_tx_bytes": median(lambda x: x["lo"]["tx_bytes"])}


def summarize(ranks: list[dict], rate_gbit: float) -> dict:
    """Medians over rounds; a round's time is its slowest rank's; bytes per node (each direction)."""
    from onebit.estimate import estimate_two_level

    first = ranks[0]
    local, world = first["ranks_per_node"], first["world_size"]
    nodes = world // local
    readers = [r for r in ranks if r["rank"] % local == 0]
    out = {}
    for name in first["schemes"]:
        per_rank = [r["schemes"][name] for r in ranks]
        rounds = len(per_rank[0])
        row = {"label": LABELS[name], **timing_medians(per_rank)}
        # per node: what it sent (tx) and received (rx) on its veth, and on lo
        veth = [veth_medians(reader["node"], [x["counters"] for x in reader["schemes"][name]]) for reader in readers]
        row["veth_per_node"] = veth
        row["veth_tx_bytes_max"] = max(v["tx_bytes"] for v in veth)
        if "stats" in per_rank[0][0]:
            by_node: dict[int, dict[str, float]] = {}
            for r in ranks:
                node = by_node.setdefault(r["node"], {})
                for key in ("bytes_sent", "inter_node_bytes_sent", "intra_node_bytes_sent"):
                    if key in r["schemes"][name][0]["stats"]:
                        node[key] = node.get(key, 0) + _median(x["stats"][key] for x in r["schemes"][name])
            row["stats_per_node"] = [by_node[p] for p in sorted(by_node)]
            row["comm_s"] = _median(max(rows[i]["stats"]["comm_time_s"] for rows in per_rank) for i in range(rounds))
            row["collectives"] = per_rank[0][-1]["stats"]["collectives"]
        out[name] = row
    intra_gbps = _median(r["intra_gbps"] for r in ranks)
    latency_s = _median(r["latency_s"] for r in ranks)
    summary = {"rate_gbit": rate_gbit, "nodes": nodes, "ranks_per_node": local, "numel": first["numel"],
               "tensors": first["tensors"], "rounds": len(first["schemes"][next(iter(first["schemes"]))]),
               "intra_gbps_measured": intra_gbps, "latency_s_measured": latency_s,
               "load_average_1min_at_end": max(r["load_average_1min"] for r in ranks), "schemes": out}
    # The estimate, with the run's own local times (so its error is the wire model's): compute is the
    # 1-bit steps' forward + backward (DDP's includes its overlapped all-reduce); for DDP + Adam the
    # optimizer step; for the 1-bit schemes the optimizer step less its time in collectives.
    onebit_names = [n for n in out if n != "adam"]
    compute = _median(out[n]["fwd_bwd_s"] for n in onebit_names) if onebit_names else out["adam"]["fwd_bwd_s"]
    local_s = {ESTIMATE_KEY[n]: max(0.0, out[n]["opt_s"] - out[n]["comm_s"]) for n in onebit_names}
    if "adam" in out:
        local_s["fp32"] = out["adam"]["opt_s"]
    local_s = {key: local_s.get(key, 0.0) for key in ESTIMATE_KEY.values()}  # (schemes not run: not reported)
    est = estimate_two_level(first["numel"], nodes, local, rate_gbit, intra_gbps, compute_s=compute, local_s=local_s,
                             segments=first["tensors"], latency_s=latency_s)
    summary["estimate"] = est.as_dict()
    for name, row in out.items():
        e = est[ESTIMATE_KEY[name]]
        row["estimate_step_s"] = e.step_s
        row["estimate_wire_s"] = e.wire_s
        row["estimate_inter_node_bytes"] = e.inter_node_bytes
        row["estimate_intra_node_bytes"] = e.intra_node_bytes
        row["estimate_step_error"] = e.step_s / row["step_s"] - 1.0
        row["veth_payload_vs_model"] = max(v["tx_payload_bytes"] for v in out[name]["veth_per_node"]) / e.inter_node_bytes
    if "flat" in out:
        for name in ("compressed", "node_mean", "adam"):
            if name in out:
                out[name]["veth_bytes_vs_flat"] = out[name]["veth_tx_bytes_max"] / out["flat"]["veth_tx_bytes_max"]
                out[name]["step_vs_flat"] = out[name]["step_s"] / out["flat"]["step_s"]
    if "adam" in out:
        for name in onebit_names:
            out[name]["veth_bytes_vs_ddp"] = out[name]["veth_tx_bytes_max"] / out["adam"]["veth_tx_bytes_max"]
    return summary


def targets(runs: list[dict]) -> list[dict]:
    """The issue's targets, checked on every run that has the schemes they compare."""
    checks = []
    for run in runs:
        s = run["schemes"]
        rate = run["rate_gbit"]
        for name in ("compressed", "node_mean"):
            if name not in s:
                continue
            if "flat" in s:
                checks.append({"rate_gbit": rate, "scheme": name, "target": "inter-node bytes <= 0.6x flat's",
                               "value": s[name]["veth_bytes_vs_flat"], "met": s[name]["veth_bytes_vs_flat"] <= 0.6})
            if "adam" in s:
                checks.append({"rate_gbit": rate, "scheme": name, "target": "inter-node bytes <= 1/50 of DDP's",
                               "value": s[name]["veth_bytes_vs_ddp"], "met": s[name]["veth_bytes_vs_ddp"] <= 1 / 50})
            if "flat" in s and rate <= 0.1:
                checks.append({"rate_gbit": rate, "scheme": name, "target": "step time <= flat's at 100 Mbit/s",
                               "value": s[name]["step_vs_flat"], "met": s[name]["step_vs_flat"] <= 1.0})
    return checks


# ---------------------------------------------------------------------------------------------- output


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def _mb(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 1e6:,.3f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    first = result["runs"][0]
    out = [f"# Two-level 1-bit all-reduce: {first['nodes']} nodes x {first['ranks_per_node']} ranks, emulated", "",
           f"{m['date']}; {m['cpu']}, {m['cores']} cores; torch {m['torch']}; onebit {m['onebit']} "
           f"(commit {result['code']['commit']}{', onebit/ modified' if result['code']['onebit_changed_files'] else ''}); "
           f"load average (1 min) {result['load_average_1min_start']:.2f} at the start, "
           f"{result['load_average_1min_end']:.2f} at the end.", "",
           f"Model: {first['numel']:,} float32 parameters in {first['tensors']} tensors (Linear {result['width']} x "
           f"{result['width']}), batch {result['batch']}, one torch thread per rank; {first['rounds']} interleaved "
           f"rounds after a warmup; a step's time is the slower rank's, barrier to barrier after `optimizer.step()`; "
           "medians [quartiles]. Bytes per step: the inter-node veth's counters (each node's tx = one direction, "
           "headers included), `comm_stats()['last_step']` summed over the node's 2 ranks, and the model "
           "(`onebit.estimate.two_level_wire_bytes`, per node and direction).", ""]
    for run in result["runs"]:
        s = run["schemes"]
        out += [f"## {run['rate_gbit'] * 1000:g} Mbit/s between the nodes (intra-node loopback measured at "
                f"{run['intra_gbps_measured']:.2f} Gbit/s per rank; latency {run['latency_s_measured'] * 1e3:.2f} ms "
                "per message)", "",
                "| scheme | veth MB/step A→B / B→A | comm_stats inter-node MB (node) | model inter-node MB | "
                "lo MB/step (node A) | step ms [q1–q3] | estimate ms (error) |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for name, row in s.items():
            veth = row["veth_per_node"]
            stats = row.get("stats_per_node")
            inter = stats[0].get("inter_node_bytes_sent") if stats else None
            q1, q3 = row["step_s_quartiles"]
            out.append(f"| {row['label']} | {_mb(veth[0]['tx_bytes'])} / {_mb(veth[1]['tx_bytes'])} | {_mb(inter)} | "
                       f"{_mb(row['estimate_inter_node_bytes'])} | {_mb(veth[0]['lo_tx_bytes'])} | "
                       f"{_ms(row['step_s'])} [{_ms(q1)}–{_ms(q3)}] | {_ms(row['estimate_step_s'])} "
                       f"({row['estimate_step_error'] * 100:+.0f}%) |")
        out.append("")
        ratios = []
        for name in ("compressed", "node_mean"):
            if name in s and "veth_bytes_vs_flat" in s[name]:
                ratios.append(f"{name}: veth bytes {s[name]['veth_bytes_vs_flat']:.3f}x flat's"
                              + (f", 1/{1 / s[name]['veth_bytes_vs_ddp']:.1f} of DDP's" if "veth_bytes_vs_ddp" in s[name]
                                 else "") + f"; step {s[name]['step_vs_flat']:.2f}x flat's")
        if ratios:
            out += ["- " + r for r in ratios] + [""]
        parts = ", ".join(f"{row['label']} fwd+bwd {_ms(row['fwd_bwd_s'])} ms, opt {_ms(row['opt_s'])} ms"
                          + (f" (in collectives {_ms(row['comm_s'])} ms)" if "comm_s" in row else "")
                          for row in s.values())
        out += [f"Parts (medians, slower rank): {parts}.", ""]
    if result.get("targets"):
        out += ["## Targets", "", "| rate | scheme | target | measured | met |", "|---:|---|---|---:|---|"]
        for t in result["targets"]:
            out.append(f"| {t['rate_gbit'] * 1000:g} Mbit/s | {t['scheme']} | {t['target']} | {t['value']:.4f} | "
                       f"{'yes' if t['met'] else 'no'} |")
        out.append("")
    out += ["The estimate is `onebit.estimate.estimate_two_level` with the run's own non-communication times "
            "(compute: the 1-bit steps' forward + backward; local: DDP's Adam step, or each 1-bit optimizer step less "
            "its time in collectives), the nominal inter-node rate, and the loopback rate and per-message latency "
            "measured by the ranks before the steps (an fp32 all-to-all inside each node; a 4-byte all-reduce over "
            "2 (n-1) messages), so its error is the wire model's.", ""]
    return "\n".join(out)


def machine_info() -> dict:
    import platform

    import onebit

    model = "unknown"
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")), model)
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, "onebit": onebit.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def code_version() -> dict:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=HERE.parent, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    changed = [line[3:] for line in git("status", "--porcelain", "onebit").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "onebit_changed_files": changed}


def parse_two_node_args(argv: list[str] | None, doc: str, *, choices_flag: str, choices: list[str], what: str,
                        params: float, params_label: str, timeouts: tuple[int, int], stem: str) -> argparse.Namespace:
    """The command line every two-node benchmark shares (this one and ``hsdp.py``), parsed, with the
    size defaults filled in (``--quick``: a small model, 2 rounds) and ``--<choices_flag>`` (what it
    compares: ``--schemes``, ``--configs``) checked against ``choices`` (``what``: their name, plural)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, 2 rounds, 1 Gbit/s: a smoke test")
    parser.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=None,
                        help="inter-node rates in Gbit/s (default 1,0.1; --quick: 1)")
    parser.add_argument("--params", type=float, default=None, help=f"approximate parameters (default {params_label})")
    parser.add_argument("--width", type=int, default=None, help="Linear width (default 1024)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 11; --quick: 2)")
    parser.add_argument(f"--{choices_flag}", type=lambda v: v.split(","), default=list(choices),
                        help="comma-separated, from " + ", ".join(choices))
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=None,
                        help=f"per launch (default {timeouts[1]}; --quick {timeouts[0]})")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--name", default=None, help=f"output stem (default {stem}_2x2; --quick: {stem}_quick)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.params = args.params or (2.6e5 if args.quick else params)
    args.width = args.width or (256 if args.quick else 1024)
    args.rounds = args.rounds or (2 if args.quick else 11)
    args.timeout_s = args.timeout_s or (timeouts[0] if args.quick else timeouts[1])
    bad = [c for c in getattr(args, choices_flag) if c not in choices]
    if bad:
        parser.error(f"unknown {what} {', '.join(bad)}; expected some of {', '.join(choices)}")
    return args


def run_two_node(args: argparse.Namespace, argv: list[str] | None, stem: str, launch, summarize, targets, markdown,
                 say) -> int:
    """Every rate: the link, the ranks, the summary (``say(run)`` prints its rows); then the
    targets, the markdown, and ``<stem>.json`` / ``.md`` in ``--out-dir``. Without namespaces: SKIP, 0."""
    rates = args.rates or ([1.0] if args.quick else [1.0, 0.1])
    reason = netns.unavailable_reason()
    if reason:
        print(f"SKIP: the two-node emulation needs network namespaces: {reason}")
        return 0
    result = {"quick": args.quick, "machine": machine_info(), "code": code_version(),
              "load_average_1min_start": os.getloadavg()[0], "argv": sys.argv[1:] if argv is None else argv,
              "width": args.width, "batch": args.batch, "runs": []}
    world = args.nodes * args.ranks_per_node
    for i, rate in enumerate(rates):
        print(f"--- {rate:g} Gbit/s between {args.nodes} nodes of {args.ranks_per_node} ranks, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        started = time.monotonic()
        with netns.SlowLink(world, rate, ranks_per_node=args.ranks_per_node) as link:
            ranks = launch(link, args, port=29600 + (os.getpid() + i) % 300)
        run = summarize(ranks, rate)
        run["wall_s"] = time.monotonic() - started
        result["runs"].append(run)
        say(run)
    result["targets"] = targets(result["runs"])
    result["load_average_1min_end"] = os.getloadavg()[0]
    text = markdown(result)
    print(text)
    name = args.name or (f"{stem}_quick" if args.quick else f"{stem}_2x2")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{name}.md").write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_two_node_args(argv, __doc__, choices_flag="schemes", choices=list(SCHEMES), what="scheme(s)",
                               params=8.4e6, params_label="8.4M", timeouts=(90, 400), stem="hierarchy")
    if args.worker:
        worker(args)
        return 0

    def say(run: dict) -> None:
        for row in run["schemes"].values():
            print(f"  {row['label']:<28} step {_ms(row['step_s']):>7} ms (estimate {_ms(row['estimate_step_s']):>6})  "
                  f"veth {_mb(row['veth_tx_bytes_max']):>8} MB/step/direction "
                  f"(model {_mb(row['estimate_inter_node_bytes'])})", flush=True)

    return run_two_node(args, argv, "hierarchy", launch, summarize, targets, markdown, say)


if __name__ == "__main__":
    sys.exit(main())
