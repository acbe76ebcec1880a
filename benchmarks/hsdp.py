"""The HSDP recipe on an emulated 2 nodes x 2 ranks: bytes between nodes, optimizer state and step time.

    sudo python benchmarks/hsdp.py                            # 1 and 0.1 Gbit/s, 4.2M params, ~3 minutes
    sudo python benchmarks/hsdp.py --quick --out-dir /tmp/h   # small model, 2 rounds, 1 Gbit/s, < 1 minute

The layout is a 2 x 2 device mesh, ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate",
"shard"))``: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}. For each rate it
builds two "nodes" (``benchmarks/netns.py`` with ``ranks_per_node=2``: ranks 0, 1 share node A's
network namespace, ranks 2, 3 node B's; traffic inside a node goes over that namespace's loopback,
traffic between the nodes over one veth capped by ``tc tbf``), so the shard dimension stays inside
a node and the replicate dimension crosses the slow link. It starts four gloo ranks (this script
with ``--worker``) and times, interleaved round by round, one step of each of:

* ``hsdp_adamw``: native HSDP, ``fully_shard`` (each Linear, then the root) over the whole 2-D mesh,
  + ``torch.optim.AdamW`` (FSDP reduce-scatters inside the node, then all-reduces the fp32 gradient
  shard over "replicate", across the link);
* ``hsdp_onebit``: the recipe, ``fully_shard`` over ``mesh["shard"]`` and
  ``OnebitAdam(model.parameters(), group=mesh["replicate"], freeze_step=1)``, compression steps (the
  1-bit all-reduce of the momentum shard over "replicate");
* ``ddp_onebit``: plain data parallel, the unsharded model and ``OnebitAdam`` over all 4 ranks
  (``freeze_step=1``), compression steps: what the recipe's optimizer state is compared with.

Each step runs from a barrier to a barrier after ``optimizer.step()`` (zero_grad, forward, backward
and step inside); its time is the slower rank's. Between the barriers each node's first rank reads
its namespace's ``/sys/class/net`` counters (the veth: what the node sent to and received from the
other node; ``lo``: traffic inside the node); the onebit configurations also read
``comm_stats()["last_step"]["bytes_sent"]``. After the steps each rank sums its optimizer state
(``numel * element_size`` of every tensor in ``optimizer.state``, the local shard of a DTensor) and,
for onebit, its error-feedback buffers (``compression_errors()``, not in ``optimizer.state``).

Writes ``<name>.json`` (every per-step number) and ``<name>.md`` to ``--out-dir`` (default
``benchmarks/results``, name ``hsdp_2x2``; ``hsdp_quick`` with ``--quick``). Needs root and
iproute2; without them it says why and exits with status 0, writing nothing. See benchmarks/README.md.
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
from hierarchy import (_counters, _delta, _mb, _median, _ms, launch_workers,  # noqa: E402
                       parse_two_node_args, run_two_node, timing_medians, veth_medians)
from peers import make_model  # noqa: E402

CONFIGS = ("hsdp_adamw", "hsdp_onebit", "ddp_onebit")
LABELS = {"hsdp_adamw": "HSDP + AdamW (native, fp32)", "hsdp_onebit": "HSDP recipe + OnebitAdam (1-bit)",
          "ddp_onebit": "DDP-style OnebitAdam, unsharded"}
BASELINE = "hsdp_adamw"
BYTES_TARGET = 1 / 28   # slow-link bytes per compression step, hsdp_onebit vs hsdp_adamw
STATE_TARGET = 0.55     # optimizer state per rank, hsdp_onebit vs ddp_onebit (the unsharded optimizer)


# ---------------------------------------------------------------------------------------------- one rank


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


#: 1-bit Adam's state as AdamW's (float32 moments, what :func:`state_bytes` counts), not its compact
#: defaults: the comparison is of the layouts' sharding
FLOAT32_STATE = {"preconditioner_dtype": torch.float32, "error_dtype": torch.float32}


def state_bytes(optimizer) -> int:
    """Every tensor of the optimizer's state as its state dict saves it (a DTensor's local shard),
    on this rank: the moments, as AdamW's (1-bit Adam holds its frozen variance as ``d`` and ``1 /
    d`` after the switch, which ``optimizer.state`` does not show)."""
    saved = optimizer.state_dict()["state"]
    return _nbytes(t for entry in saved.values() for t in entry.values() if isinstance(t, torch.Tensor))


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Config:
    def __init__(self, name: str, args: argparse.Namespace, mesh) -> None:
        from onebit import OnebitAdam

        self.name = name
        self.onebit = name != "hsdp_adamw"
        model = make_model(args.params, args.width)
        if name == "hsdp_adamw":
            self.model = _shard(model, mesh)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        elif name == "hsdp_onebit":
            self.model = _shard(model, mesh["shard"])
            self.optimizer = OnebitAdam(self.model.parameters(), lr=1e-5, freeze_step=1, comm_backend_name="gloo",
                                        group=mesh["replicate"], **FLOAT32_STATE)
        else:
            self.model = model
            self.optimizer = OnebitAdam(self.model.parameters(), lr=1e-5, freeze_step=1, comm_backend_name="gloo",
                                        **FLOAT32_STATE)
        self.rows: list[dict] = []
        self.untimed: list[dict] = []

    def step(self, x: torch.Tensor, record: bool, reader: bool) -> None:
        phase = self.optimizer.phase if self.onebit else None  # the plan of the step about to run
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
        if self.onebit:
            stats = self.optimizer.comm_stats()
            row["phase"] = phase
            row["stats"] = {k: stats["last_step"][k] for k in ("bytes_sent", "comm_time_s", "collectives")}
            if record and phase != "compression":
                raise RuntimeError(f"{self.name}: timed a {phase} step")
        (self.rows if record else self.untimed).append(row)

    def sizes(self) -> dict:
        out = {"params_local_numel": sum(_local(p).numel() for p in self.model.parameters()),
               "params_local_bytes": _nbytes(p.detach() for p in self.model.parameters()),
               "state_bytes": state_bytes(self.optimizer),
               "state_keys": sorted({k for entry in self.optimizer.state_dict()["state"].values() for k in entry})}
        if self.onebit:
            out["error_bytes"] = _nbytes(t for pair in self.optimizer.compression_errors() for t in pair)
        return out


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
        torch.manual_seed(1000 + rank)
        x = torch.randn(args.batch, args.width)
        reader = rank % local == 0  # the node's counters: one reader per namespace
        for c in configs:  # FSDP's lazy init; OnebitAdam: the warmup step, then the first compression step
            for _ in range(2):
                c.step(x, record=False, reader=reader)
        for r in range(args.rounds):
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                c.step(x, record=True, reader=reader)
        dist.barrier()
        sizes = {c.name: c.sizes() for c in configs}
    finally:
        dist.destroy_process_group()
    full = make_model(args.params, args.width)
    result = {"rank": rank, "node": rank // local, "world_size": world, "ranks_per_node": local,
              "numel": sum(p.numel() for p in full.parameters()), "tensors": sum(1 for _ in full.parameters()),
              "load_average_1min": os.getloadavg()[0], "sizes": sizes,
              "configs": {c.name: c.rows for c in configs}, "untimed": {c.name: c.untimed for c in configs}}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- launch


def launch(link: netns.SlowLink, args: argparse.Namespace, port: int) -> list[dict]:
    """Four ranks (this script, ``--worker``) in the link's namespaces (see ``hierarchy.launch_workers``)."""
    return launch_workers(Path(__file__), "configs", args.configs, link, args, port)


# ---------------------------------------------------------------------------------------------- summary


def model_inter_node_bytes(name: str, ranks: list[dict]) -> int:
    """What one node should send to the other per step (one direction), payload only: ``hsdp_adamw``
    its 2 ranks' fp32 ring all-reduces of their gradient shards over "replicate" (2 ranks each);
    ``hsdp_onebit`` their 1-bit all-reduces of the momentum shards (2 ranks, one per node, each);
    ``ddp_onebit`` the flat 1-bit all-reduce of the whole model over 4 ranks (what leaves the node)."""
    from onebit.estimate import fp32_allreduce_bytes, two_level_wire_bytes

    first = ranks[0]
    local, world, tensors = first["ranks_per_node"], first["world_size"], first["tensors"]
    replicas = world // local
    node0 = [r for r in ranks if r["node"] == 0]
    if name == "hsdp_adamw":
        return sum(fp32_allreduce_bytes(r["sizes"][name]["params_local_numel"], replicas) for r in node0)
    if name == "hsdp_onebit":
        return sum(two_level_wire_bytes(r["sizes"][name]["params_local_numel"], replicas, 1, segments=tensors)["flat"][0]
                   for r in node0)
    return two_level_wire_bytes(first["numel"], replicas, local, segments=tensors)["flat"][0]


def summarize(ranks: list[dict], rate_gbit: float) -> dict:
    """Medians over rounds; a round's time is its slowest rank's; bytes per node (each direction)."""
    first = ranks[0]
    local, world = first["ranks_per_node"], first["world_size"]
    readers = [r for r in ranks if r["rank"] % local == 0]
    out = {}
    for name in first["configs"]:
        per_rank = [r["configs"][name] for r in ranks]
        rounds = len(per_rank[0])
        row = {"label": LABELS[name], **timing_medians(per_rank)}
        veth = []  # per node: what it sent (tx) and received (rx) on its veth, and on lo
        for reader in readers:
            veth.append(veth_medians(reader["node"], [x["counters"] for x in reader["configs"][name]]))
            # the untimed steps: for onebit the warmup step (full-precision all-reduce) comes first
            u = reader["untimed"][name]
            veth[-1]["untimed_both_bytes"] = [x["counters"]["veth"]["tx_bytes"] + x["counters"]["veth"]["rx_bytes"]
                                              for x in u]
            veth[-1]["untimed_phases"] = [x.get("phase") for x in u]
        row["veth_per_node"] = veth
        row["veth_both_bytes_max"] = max(v["both_bytes"] for v in veth)
        row["veth_tx_bytes_max"] = max(v["tx_bytes"] for v in veth)
        row["model_inter_node_bytes"] = model_inter_node_bytes(name, ranks)
        row["veth_payload_vs_model"] = max(v["tx_payload_bytes"] for v in veth) / row["model_inter_node_bytes"]
        sizes = [r["sizes"][name] for r in ranks]
        row["state_bytes_per_rank"] = [s["state_bytes"] for s in sizes]
        row["state_bytes_max"] = max(row["state_bytes_per_rank"])
        row["state_keys"] = sizes[0]["state_keys"]
        row["params_local_bytes_max"] = max(s["params_local_bytes"] for s in sizes)
        if "error_bytes" in sizes[0]:
            row["error_bytes_max"] = max(s["error_bytes"] for s in sizes)
        if "stats" in per_rank[0][0]:
            by_node: dict[int, float] = {}
            for r in ranks:
                sent = _median(x["stats"]["bytes_sent"] for x in r["configs"][name])
                by_node[r["node"]] = by_node.get(r["node"], 0) + sent
            row["stats_bytes_sent_per_node"] = [by_node[p] for p in sorted(by_node)]
            row["stats_bytes_sent_per_rank"] = [_median(x["stats"]["bytes_sent"] for x in r["configs"][name])
                                                for r in ranks]
            row["comm_s"] = _median(max(rows[i]["stats"]["comm_time_s"] for rows in per_rank) for i in range(rounds))
            row["collectives"] = per_rank[0][-1]["stats"]["collectives"]
        out[name] = row
    if BASELINE in out:
        base = out[BASELINE]
        for row in out.values():
            row["veth_bytes_vs_hsdp_adamw"] = row["veth_both_bytes_max"] / base["veth_both_bytes_max"]
            row["step_vs_hsdp_adamw"] = row["step_s"] / base["step_s"]
            row["state_vs_hsdp_adamw"] = row["state_bytes_max"] / base["state_bytes_max"]
    if "ddp_onebit" in out:
        for row in out.values():
            row["state_vs_ddp_onebit"] = row["state_bytes_max"] / out["ddp_onebit"]["state_bytes_max"]
    return {"rate_gbit": rate_gbit, "nodes": world // local, "ranks_per_node": local, "numel": first["numel"],
            "tensors": first["tensors"], "rounds": len(first["configs"][next(iter(first["configs"]))]),
            "load_average_1min_at_end": max(r["load_average_1min"] for r in ranks), "configs": out}


def targets(runs: list[dict]) -> list[dict]:
    """The issue's targets, checked on every run that has the configurations they compare."""
    checks = []
    for run in runs:
        s = run["configs"]
        if "hsdp_onebit" not in s:
            continue
        if BASELINE in s:
            v = s["hsdp_onebit"]["veth_bytes_vs_hsdp_adamw"]
            checks.append({"rate_gbit": run["rate_gbit"], "target": "slow-link bytes per compression step <= 1/28 of "
                           "HSDP + AdamW's", "value": v, "shown": f"1/{1 / v:.1f}", "met": v <= BYTES_TARGET})
        if "ddp_onebit" in s:
            v = s["hsdp_onebit"]["state_vs_ddp_onebit"]
            checks.append({"rate_gbit": run["rate_gbit"], "target": "optimizer state per rank <= 0.55x the unsharded "
                           "optimizer's (ddp_onebit)", "value": v, "shown": f"{v:.3f}x", "met": v <= STATE_TARGET})
    return checks


# ---------------------------------------------------------------------------------------------- output


def _ratio(row: dict, key: str) -> str:
    return f"{row[key]:.3f}x" if key in row else "–"


def markdown(result: dict) -> str:
    m = result["machine"]
    first = result["runs"][0]
    out = [f"# HSDP recipe: {first['nodes']} nodes x {first['ranks_per_node']} ranks, emulated", "",
           f"{m['date']}; {m['cpu']}, {m['cores']} cores; torch {m['torch']}; onebit {m['onebit']} "
           f"(commit {result['code']['commit']}{', onebit/ modified' if result['code']['onebit_changed_files'] else ''}); "
           f"load average (1 min) {result['load_average_1min_start']:.2f} at the start, "
           f"{result['load_average_1min_end']:.2f} at the end.", "",
           f"Mesh 2 x 2 (\"replicate\", \"shard\"): shard groups {{0,1}} {{2,3}} inside the nodes, replicate groups "
           f"{{0,2}} {{1,3}} across the link. Model: {first['numel']:,} float32 parameters in {first['tensors']} "
           f"tensors (Linear {result['width']} x {result['width']}), batch {result['batch']}, one torch thread per "
           f"rank; {first['rounds']} interleaved rounds after 2 untimed steps each (onebit: warmup, then the first "
           "compression step; `freeze_step=1`); a step's time is the slower rank's, barrier to barrier with zero_grad, "
           "forward, backward and `optimizer.step()` inside; medians [quartiles]. Slow-link bytes: the veth's "
           "counters per node and step (headers included): A→B / B→A, and tx + rx of the busier node. State: "
           "`optimizer.state` tensors per rank (DTensors' local shards), the larger rank; onebit's error-feedback "
           "buffers (`compression_errors()`) listed apart, they are not in `optimizer.state`.", ""]
    for run in result["runs"]:
        s = run["configs"]
        out += [f"## {run['rate_gbit'] * 1000:g} Mbit/s between the nodes", "",
                "| configuration | veth MB/step A→B / B→A | veth MB/step/node (both ways) | vs HSDP+AdamW | "
                "model MB/node/dir | comm_stats sent MB (node A) | lo MB/step (node A) | state MB/rank (+ errors) | "
                "state vs ddp_onebit | step ms [q1–q3] | step vs HSDP+AdamW |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, row in s.items():
            veth = row["veth_per_node"]
            stats = row.get("stats_bytes_sent_per_node")
            q1, q3 = row["step_s_quartiles"]
            vs = row.get("veth_bytes_vs_hsdp_adamw")
            vs = "–" if vs is None else "1" if name == BASELINE else f"1/{1 / vs:.1f}"
            errors = f" (+ {_mb(row['error_bytes_max'])})" if "error_bytes_max" in row else ""
            out.append(f"| {row['label']} | {_mb(veth[0]['tx_bytes'])} / {_mb(veth[1]['tx_bytes'])} | "
                       f"{_mb(row['veth_both_bytes_max'])} | {vs} | "
                       f"{_mb(row['model_inter_node_bytes'])} | {_mb(stats[0] if stats else None)} | "
                       f"{_mb(veth[0]['lo_tx_bytes'])} | {_mb(row['state_bytes_max'])}{errors} | "
                       f"{_ratio(row, 'state_vs_ddp_onebit')} | {_ms(row['step_s'])} [{_ms(q1)}–{_ms(q3)}] | "
                       f"{_ratio(row, 'step_vs_hsdp_adamw')} |")
        out.append("")
        if "hsdp_onebit" in s:
            w = s["hsdp_onebit"]["veth_per_node"]
            untimed = [_mb(max(v["untimed_both_bytes"][i] for v in w)) for i in range(len(w[0]["untimed_both_bytes"]))]
            out.append("hsdp_onebit's untimed steps (phases " + ", ".join(str(p) for p in w[0]["untimed_phases"])
                       + "): veth MB/node (both ways) " + ", ".join(untimed) + ".")
        parts = ", ".join(f"{name} fwd+bwd {_ms(row['fwd_bwd_s'])} ms, opt {_ms(row['opt_s'])} ms"
                          + (f" (in collectives {_ms(row['comm_s'])} ms)" if "comm_s" in row else "")
                          for name, row in s.items())
        out += [f"Parts (medians, slower rank): {parts}.", ""]
    if result.get("targets"):
        out += ["## Targets", "", "| rate | target | measured | met |", "|---:|---|---:|---|"]
        for t in result["targets"]:
            out.append(f"| {t['rate_gbit'] * 1000:g} Mbit/s | {t['target']} | {t['shown']} | "
                       f"{'yes' if t['met'] else 'no'} |")
        out.append("")
    out += ["Model bytes (payload, one node, one direction): hsdp_adamw 2 ranks x a 2-rank fp32 ring all-reduce of "
            "the local gradient shard (`onebit.estimate.fp32_allreduce_bytes`); hsdp_onebit 2 ranks x a 2-rank 1-bit "
            "all-reduce of the local shard, and ddp_onebit the flat 1-bit all-reduce over 4 ranks "
            "(`onebit.estimate.two_level_wire_bytes(...)['flat']`).", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_two_node_args(argv, __doc__, choices_flag="configs", choices=list(CONFIGS), what="configuration(s)",
                               params=4.2e6, params_label="4.2M", timeouts=(100, 300), stem="hsdp")
    if args.worker:
        worker(args)
        return 0

    def say(run: dict) -> None:
        for row in run["configs"].values():
            print(f"  {row['label']:<34} step {_ms(row['step_s']):>7} ms  veth {_mb(row['veth_both_bytes_max']):>8} "
                  f"MB/step/node (both ways; model {_mb(row['model_inter_node_bytes'])} per direction)  "
                  f"state {_mb(row['state_bytes_max'])} MB/rank", flush=True)

    return run_two_node(args, argv, "hsdp", launch, summarize, targets, markdown, say)


if __name__ == "__main__":
    sys.exit(main())
