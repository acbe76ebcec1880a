"""OnebitDiLoCo with workers of 2 ranks on an emulated 2 nodes x 2 ranks: utilisation and bytes.

    sudo python benchmarks/diloco_workers.py                            # 0.1 and 1 Gbit/s, 8.4M params
    sudo python benchmarks/diloco_workers.py --quick --out-dir /tmp/w   # small model, 2 rounds, < 1 minute

Each node is one worker (``benchmarks/netns.py`` with ``ranks_per_node=2``: its two ranks share a
network namespace, traffic inside it goes over the loopback, traffic between the nodes over one veth
capped by ``tc tbf``). The mesh is ``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))``:
"shard" inside a node, "replicate" across the link. Interleaved round by round, one step of each of:

* ``ddp_adam``: ``DistributedDataParallel`` over all 4 ranks + ``torch.optim.Adam`` (the fp32
  all-reduce of every gradient crosses the link at every step): the synchronous baseline;
* ``ddp_inner`` / ``ddp_outer``: DDP over "shard" (inside the worker) + ``OnebitDiLoCo`` over
  "replicate" (the recipe of ``docs/guides/algorithms.md``): an inner step (nothing crosses the
  link) and an outer step (the inner step, then the 1-bit all-reduce of the pseudo-gradient across
  the link, at the defaults: two passes);
* ``fsdp_inner`` / ``fsdp_outer``: the same with ``fully_shard`` over "shard" instead of DDP (each
  rank sends the 1-bit average of its shard only).

A run with ``sync_every=H`` takes ``H - 1`` inner steps per outer step: its average step is
``((H - 1) inner + outer) / H``, and its **utilisation** is ``inner / average``: the share of the
time the worker computes (its own fast all-reduce or FSDP collectives inside the node count as
compute here: they are what the worker does without the slow link). Each step runs from a barrier
to a barrier; its time is the slower rank's; medians over rounds. The veth's counters give the
bytes between the nodes per step, the loopback's those inside a node.

Writes ``<name>.json`` and ``<name>.md`` to ``--out-dir`` (default ``benchmarks/results``, name
``diloco_workers_2x2``; ``diloco_workers_quick`` with ``--quick``). Needs root and iproute2; without
them it says why and exits with status 0, writing nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import netns  # noqa: E402
from hierarchy import (_counters, _delta, _mb, _median, _ms, launch_workers, parse_two_node_args,  # noqa: E402
                       run_two_node, timing_medians, veth_medians)
from hsdp import _shard  # noqa: E402
from peers import make_model  # noqa: E402

CONFIGS = ("ddp_adam", "ddp_inner", "ddp_outer", "fsdp_inner", "fsdp_outer")
LABELS = {"ddp_adam": "DDP + Adam over 4 ranks (fp32)", "ddp_inner": "DDP in the worker: inner step",
          "ddp_outer": "DDP in the worker: outer step", "fsdp_inner": "FSDP2 in the worker: inner step",
          "fsdp_outer": "FSDP2 in the worker: outer step"}
SYNC_EVERY = (8, 16, 32, 64)
UTILISATION_TARGET = 0.90  # issue 42: workers of 2 ranks at 100 Mbit/s, at the defaults (H 32)


# ---------------------------------------------------------------------------------------------- one rank


class Config:
    def __init__(self, name: str, args: argparse.Namespace, mesh) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from onebit import OnebitDiLoCo

        self.name = name
        model = make_model(args.params, args.width)
        if name == "ddp_adam":
            self.model = DDP(model)
            self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
            return
        inside = "fsdp" if name.startswith("fsdp") else "ddp"
        self.model = _shard(model, mesh["shard"]) if inside == "fsdp" else DDP(model, process_group=mesh["shard"].get_group())
        # an inner step at every step, or an outer step at every step (the defaults otherwise)
        sync_every = 10 ** 9 if name.endswith("inner") else 1
        self.optimizer = OnebitDiLoCo(model.parameters(), lr=1e-5, sync_every=sync_every, group=mesh["replicate"],
                                      comm_backend_name="gloo")

    def step(self, x: torch.Tensor, reader: bool) -> dict:
        dist.barrier()
        before = _counters() if reader else None
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.model(x).square().mean().backward()
        middle = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        dist.barrier()
        row = {"step_s": end - start, "fwd_bwd_s": middle - start, "opt_s": end - middle}
        if reader:
            row["counters"] = _delta(_counters(), before)
        if self.name != "ddp_adam":
            row["bytes_sent"] = self.optimizer.comm_stats()["last_step"]["bytes_sent"]
        return row


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's reduce_scatter_tensor under FSDP2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = args.ranks_per_node
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))
        configs = [Config(name, args, mesh) for name in args.configs]
        torch.manual_seed(1000 + rank // local)  # (a worker's ranks may share or split its batch: time is the same)
        x = torch.randn(args.batch, args.width)
        reader = rank % local == 0  # the node's counters: one reader per namespace
        for c in configs:  # lazy inits, the layout check and the first steps' adapter checks
            for _ in range(3):
                c.step(x, reader)
        rows: dict[str, list[dict]] = {c.name: [] for c in configs}
        for r in range(args.rounds):
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                rows[c.name].append(c.step(x, reader))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    full = make_model(args.params, args.width)
    result = {"rank": rank, "node": rank // local, "world_size": world, "ranks_per_node": local,
              "numel": sum(p.numel() for p in full.parameters()), "tensors": sum(1 for _ in full.parameters()),
              "load_average_1min": os.getloadavg()[0], "configs": rows}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


def launch(link: netns.SlowLink, args: argparse.Namespace, port: int) -> list[dict]:
    return launch_workers(Path(__file__), "configs", args.configs, link, args, port)


# ---------------------------------------------------------------------------------------------- summary


def summarize(ranks: list[dict], rate_gbit: float) -> dict:
    first = ranks[0]
    local, world = first["ranks_per_node"], first["world_size"]
    readers = [r for r in ranks if r["rank"] % local == 0]
    out = {}
    for name in first["configs"]:
        per_rank = [r["configs"][name] for r in ranks]
        row = {"label": LABELS[name], **timing_medians(per_rank)}
        veth = [veth_medians(reader["node"], [x["counters"] for x in reader["configs"][name]]) for reader in readers]
        row["veth_per_node"] = veth
        row["veth_tx_bytes_max"] = max(v["tx_bytes"] for v in veth)
        row["lo_tx_bytes_max"] = max(v["lo_tx_bytes"] for v in veth)
        if "bytes_sent" in per_rank[0][0]:
            row["bytes_sent_per_rank"] = [_median(x["bytes_sent"] for x in rows) for rows in per_rank]
        out[name] = row
    utilisation = {}
    for inside in ("ddp", "fsdp"):
        inner, outer = out.get(f"{inside}_inner"), out.get(f"{inside}_outer")
        if inner is None or outer is None:
            continue
        for h in SYNC_EVERY:
            average = ((h - 1) * inner["step_s"] + outer["step_s"]) / h
            utilisation[f"{inside}_h{h}"] = {
                "inside": inside, "sync_every": h, "average_step_s": average, "utilisation": inner["step_s"] / average,
                "vs_ddp_adam": out["ddp_adam"]["step_s"] / average if "ddp_adam" in out else None,
                "inter_node_bytes_per_step": ((h - 1) * inner["veth_tx_bytes_max"] + outer["veth_tx_bytes_max"]) / h,
                "intra_node_bytes_per_step": ((h - 1) * inner["lo_tx_bytes_max"] + outer["lo_tx_bytes_max"]) / h}
    return {"rate_gbit": rate_gbit, "nodes": world // local, "ranks_per_node": local, "numel": first["numel"],
            "tensors": first["tensors"], "rounds": len(first["configs"][next(iter(first["configs"]))]),
            "load_average_1min_at_end": max(r["load_average_1min"] for r in ranks), "configs": out,
            "utilisation": utilisation}


def targets(runs: list[dict]) -> list[dict]:
    checks = []
    for run in runs:
        if abs(run["rate_gbit"] - 0.1) > 1e-9:
            continue
        for key in ("ddp_h32", "fsdp_h32"):
            if key in run["utilisation"]:
                v = run["utilisation"][key]["utilisation"]
                checks.append({"rate_gbit": run["rate_gbit"], "target": f"{key[:-4].upper()} workers of 2 ranks, H 32: "
                               f"utilisation >= {UTILISATION_TARGET:.0%}", "value": v, "shown": f"{v:.1%}",
                               "met": v >= UTILISATION_TARGET})
    return checks


def markdown(result: dict) -> str:
    m = result["machine"]
    first = result["runs"][0]
    out = [f"# OnebitDiLoCo, workers of {first['ranks_per_node']} ranks: {first['nodes']} nodes, emulated", "",
           f"{m['date']}; {m['cpu']}, {m['cores']} cores; torch {m['torch']}; onebit {m['onebit']} "
           f"(commit {result['code']['commit']}); load average (1 min) {result['load_average_1min_start']:.2f} at the "
           f"start, {result['load_average_1min_end']:.2f} at the end.", "",
           f"Model: {first['numel']:,} float32 parameters in {first['tensors']} tensors (Linear {result['width']}), "
           f"batch {result['batch']} per rank, one torch thread per rank; {first['rounds']} interleaved rounds after 3 "
           "untimed steps each. A step's time is the slower rank's, barrier to barrier; medians. Bytes: the veth "
           "(between the nodes) and loopback (inside a node) counters of the busier node, headers included.", ""]
    for run in result["runs"]:
        s = run["configs"]
        out += [f"## {run['rate_gbit'] * 1000:g} Mbit/s between the nodes", "",
                "| step | ms [q1–q3] | fwd+bwd ms | opt ms | between nodes MB/step (tx) | inside a node MB/step (lo) |",
                "|---|---:|---:|---:|---:|---:|"]
        for row in s.values():
            q1, q3 = row["step_s_quartiles"]
            out.append(f"| {row['label']} | {_ms(row['step_s'])} [{_ms(q1)}–{_ms(q3)}] | {_ms(row['fwd_bwd_s'])} | "
                       f"{_ms(row['opt_s'])} | {_mb(row['veth_tx_bytes_max'])} | {_mb(row['lo_tx_bytes_max'])} |")
        out += ["", "| workers | H | average step ms | utilisation | vs DDP + Adam | between nodes KB/step | "
                "inside a node MB/step |", "|---|---:|---:|---:|---:|---:|---:|"]
        for u in run["utilisation"].values():
            vs = "–" if u["vs_ddp_adam"] is None else f"{u['vs_ddp_adam']:.1f}x"
            out.append(f"| {u['inside'].upper()} inside | {u['sync_every']} | {_ms(u['average_step_s'])} | "
                       f"{u['utilisation']:.1%} | {vs} | {u['inter_node_bytes_per_step'] / 1e3:.1f} | "
                       f"{_mb(u['intra_node_bytes_per_step'])} |")
        out.append("")
    if result.get("targets"):
        out += ["## Targets", "", "| rate | target | measured | met |", "|---:|---|---:|---|"]
        for t in result["targets"]:
            out.append(f"| {t['rate_gbit'] * 1000:g} Mbit/s | {t['target']} | {t['shown']} | {'yes' if t['met'] else 'no'} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_two_node_args(argv, __doc__, choices_flag="configs", choices=list(CONFIGS), what="configuration(s)",
                               params=8.4e6, params_label="8.4M", timeouts=(120, 600), stem="diloco_workers")
    if args.worker:
        worker(args)
        return 0

    def say(run: dict) -> None:
        for u in run["utilisation"].values():
            print(f"  {u['inside']:<5} H {u['sync_every']:>3}: utilisation {u['utilisation']:.1%}, "
                  f"{u['inter_node_bytes_per_step'] / 1e3:.1f} KB/step between nodes", flush=True)

    return run_two_node(args, argv, "diloco_workers", launch, summarize, targets, markdown, say)


if __name__ == "__main__":
    sys.exit(main())
