"""onebit against its peers on a real, rate-capped link: step time, bytes on the wire, and scaling.

    sudo python benchmarks/slowlink.py                    # 1, 5, 10 Gbit/s; 25.2M params; 2 ranks
    python benchmarks/slowlink.py --quick --out-dir /tmp/q  # loopback smoke test (< 1 minute)

For each rate it builds a private network (``benchmarks/netns.py``: one namespace per rank, veth
pairs, ``tc tbf``), starts one rank per namespace (``benchmarks/peers.py``) and times, interleaved
in the same run: DDP + Adam, DDP + PowerSGD (rank 1 and 4) + Adam, OnebitAdam in warmup and in
compression, and ZeroOneAdam (0/1 Adam) on each of its kinds of step. It reads bytes per step from
``comm_stats()`` and from the veth counters, compares them with the ideals, profiles the compression
step (codec, wire, optimizer maths), prints :func:`onebit.estimate_speedup` next to the measured
speedup, and averages the time and bytes per step of 0/1 Adam, 1-bit Adam and DDP + Adam over a
whole run (``--run-schedule``: the per-kind medians weighted by the kinds' counts in that schedule,
``benchmarks/run_average.py``). Then, on loopback, it counts collectives and bytes per compression
step for 2, 3 and 4 ranks and for 10 and 1000 tensors.

It writes ``peers.json`` (raw numbers), ``peers.md`` (tables) and ``peers.png`` (chart) to
``--out-dir`` (default ``benchmarks/results``). Without root or iproute2 it says so and runs the
loopback parts only. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import inspect
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import onebit
from onebit.estimate import TCP_ETHERNET_EFFICIENCY, estimate_speedup, measure_local_costs

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402
import run_average  # noqa: E402
from peers import ZOADAM_CONFIGS, ZOADAM_PARTS, make_model as peers_model  # noqa: E402

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers.py"
# Headers per packet as counted by the veth: Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12.
HEADER_BYTES = 66
LABELS = {
    "adam": "DDP + Adam",
    "powersgd1": "DDP + PowerSGD r1 + Adam",
    "powersgd4": "DDP + PowerSGD r4 + Adam",
    "onebit_warmup": "OnebitAdam warmup",
    "onebit_compression": "OnebitAdam compression",
    "onebit_compression_momentum": "OnebitAdam compression, compression_space='momentum'",
    "onebit_warmup_overlap": "OnebitAdam warmup, overlap_backward",
    "onebit_warmup_bf16": "OnebitAdam warmup, reduce_dtype=torch.bfloat16",
    "onebit_compression_overlap": "OnebitAdam compression, overlap_backward",
    "onebit_ddp_compression": "DDP + attach_ddp + OnebitAdam compression",
    "onebit_ddp_nosync_compression": "DDP (no_sync) + attach_ddp + OnebitAdam compression",
    "onebit_ddp_view_compression": "DDP (gradient_as_bucket_view) + attach_ddp + OnebitAdam compression",
    "zoadam_variance": "ZeroOneAdam variance",
    "zoadam_compressed_gradient": "ZeroOneAdam compressed_gradient",
    "zoadam_compressed_gradient_after_variance": "ZeroOneAdam compressed_gradient after variance",
    "zoadam_local": "ZeroOneAdam local",
    "zoadam_sync": "ZeroOneAdam sync",
    "zoadam_variance_overlap": "ZeroOneAdam variance, overlap_backward",
    "zoadam_compressed_gradient_overlap": "ZeroOneAdam compressed_gradient, overlap_backward",
    "zoadam_compressed_gradient_after_variance_overlap": "ZeroOneAdam compressed_gradient after variance, overlap_backward",
}


def _where(obj) -> str:
    """path:line of a function's definition, relative to the repository."""
    try:
        obj = inspect.unwrap(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
        line = inspect.getsourcelines(obj)[1]
        root = Path(onebit.__file__).resolve().parent.parent
        return f"{path.relative_to(root) if path.is_relative_to(root) else path}:{line} {obj.__qualname__}"
    except (TypeError, OSError):
        return getattr(obj, "__qualname__", "?")


def profile_where() -> dict[str, str]:
    """Where each profiled part of the compression step (the labels of
    ``OnebitOptimizer.register_timer``) lives in the code that ran."""
    from onebit import buckets, collectives, frozen
    from onebit.adam import OnebitAdam
    from onebit.kernels import cpu

    return {
        "gather_grads": _where(buckets.grads_of),
        "finite_check": _where(buckets.all_finite),
        "compress_input": _where(frozen.FrozenVarianceOptimizer._compress_input) + " (the momentum update)",
        "codec_worker": _where(cpu.CpuKernels.worker_compress_) + " (fused C++)",
        "codec_server": _where(cpu.CpuKernels.server_compress_) + " (fused C++)",
        "codec_decode": _where(cpu.CpuKernels.decode_) + " (fused C++)",
        "update": _where(OnebitAdam._update_compressed) + " (the frozen denominator, once; the parameter update)",
        "comm": _where(collectives.compressed_allreduce_) + ": all_to_all + all_gather; the finiteness flag all-reduce",
        "rest": "the remainder of OnebitOptimizer.step: the keep mask, bookkeeping",
    }


def code_version() -> dict:
    """The commit and whether onebit/ differed from it: the tree may change between runs."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE.parent, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    changed = [line[3:] for line in git("status", "--porcelain", "onebit").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "onebit_changed_files": changed}


# ---------------------------------------------------------------------------------------------- launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, peer_args: list[str], *, link: netns.SlowLink | None, timeout_s: float) -> list[dict]:
    """Run ``peers.py`` on ``world_size`` ranks (in the link's namespaces, or on loopback) and
    return each rank's JSON. Kills the ranks it started when one fails or time runs out."""
    with tempfile.TemporaryDirectory(prefix="onebit-peers-") as tmp:
        env = {**os.environ, "WORLD_SIZE": str(world_size), "MASTER_PORT": str(_free_port()),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, str(PEERS), "--out", tmp, "--timeout-s", str(int(timeout_s)), *peer_args]
        procs = []
        try:
            for rank in range(world_size):
                rank_env = {**env, "RANK": str(rank)}
                if link is not None:
                    procs.append(link.popen(rank, argv, rank_env))
                else:
                    rank_env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
                    rank_env.pop("ONEBIT_BENCH_IFNAME", None)
                    procs.append(subprocess.Popen(argv, env=rank_env))
        except BaseException:  # a rank that could not start: the others would wait for it
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        netns.wait_ranks(procs, timeout_s)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]


# ---------------------------------------------------------------------------------------------- summaries


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarize_steps(ranks: list[dict]) -> dict:
    """Medians over steps; a step's time is the slowest rank's (ranks start it at a barrier)."""
    first = ranks[0]
    n, numel = first["world_size"], first["numel"]
    ideal_1bit = 2 * (n - 1) / n * numel / 8
    fp32_ring = 2 * (n - 1) / n * numel * 4
    configs = {}
    for name in first["configs"]:
        per_rank = [r["configs"][name] for r in ranks]
        steps = [max(rows[i]["step_s"] for rows in per_rank) for i in range(len(per_rank[0]))]
        row = {
            "label": LABELS.get(name, name),
            "steps_s": steps,
            "step_s": _median(steps),
            "step_s_quartiles": _quartiles(steps),
            "fwd_bwd_s": _median(x["fwd_bwd_s"] for x in per_rank[0]),
            "opt_s": _median(x["opt_s"] for x in per_rank[0]),
            "cpu_s": _median(x["cpu_s"] for x in per_rank[0]),
        }
        if "onebit" in per_rank[0][0]:
            row["stats_bytes_per_rank"] = [_median(x["onebit"]["bytes_sent"] for x in rows) for rows in per_rank]
            row["collectives"] = per_rank[0][-1]["onebit"]["collectives"]
            row["comm_s"] = _median(x["onebit"]["comm_time_s"] for x in per_rank[0])
            row["phase"] = per_rank[0][-1]["phase"]
            # the kinds of step timed (plan names before each step; for ZeroOneAdam each with the kind before it)
            row["kinds"] = sorted({(x.get("kind"), x.get("after") if name in first.get("zoadam", {}) else None)
                                  for rows in per_rank for x in rows}, key=str)
        if "link" in per_rank[0][0]:
            link = []
            for rows in per_rank:
                tx = _median(x["link"]["tx_bytes"] for x in rows)
                packets = _median(x["link"]["tx_packets"] for x in rows)
                payload = _median(x["link"]["tx_bytes"] - HEADER_BYTES * x["link"]["tx_packets"] for x in rows)
                link.append({"tx_bytes": tx, "tx_packets": packets, "tcp_payload_bytes": payload,
                             "ethernet_bytes_mtu1500": payload / TCP_ETHERNET_EFFICIENCY})
            row["link_per_rank"] = link
        if per_rank[0][0]["profile"]:
            profile = {k: _median(x["profile"].get(k, 0.0) for x in per_rank[0]) for k in per_rank[0][0]["profile"]}
            profile["comm"] = row.get("comm_s", 0.0)
            profile["rest"] = max(0.0, row["opt_s"] - sum(profile.values()))
            row["profile_s"] = profile
        configs[name] = row
    base = configs.get("adam")
    for name, row in configs.items():
        if base is not None:
            row["speedup_vs_adam"] = base["step_s"] / row["step_s"]
            paired = [a / b for a, b in zip(base["steps_s"], row["steps_s"])]
            row["speedup_vs_adam_paired_median"] = _median(paired)
    return {"world_size": n, "numel": numel, "tensors": first["tensors"], "batch": first["batch"],
            "width": first["width"], "rounds": first["rounds"], "buckets": first["buckets"],
            "zoadam": first.get("zoadam", {}),
            "ideal_1bit_bytes": ideal_1bit, "fp32_ring_bytes": fp32_ring,
            "load_average_1min_at_end": max(r["load_average_1min"] for r in ranks),
            "local_costs": first["local_costs"], "configs": configs}


def add_estimate(summary: dict, rate_gbit: float | None, isolated: dict | None) -> None:
    """The estimator's prediction for this run next to the measured speedup (compression vs Adam).

    ``estimate``: its local costs measured with :func:`onebit.estimate.measure_local_costs` by the
    ranks, both at once, after each of the first rounds (median): what ``python -m onebit.estimate``
    measures, under the run's conditions (the cores are shared); ``estimate_isolated``:
    measured by this process alone before the run; ``estimate_in_run``: the medians of the run
    itself (Adam's step, and OnebitAdam's step less its codec and communication), which tests the
    model rather than the measurement. ``compute_s`` is always the run's median forward+backward.
    """
    configs = summary["configs"]
    if rate_gbit is None or "adam" not in configs or "onebit_compression" not in configs:
        return
    comp = configs["onebit_compression"]
    measured = comp["speedup_vs_adam"]
    numel, n = summary["numel"], summary["world_size"]
    profile = comp.get("profile_s", {})
    codec_s = sum(v for k, v in profile.items() if k.startswith("codec"))
    sources = {"estimate": summary["local_costs"], "estimate_isolated": isolated}
    if codec_s > 0:
        sources["estimate_in_run"] = {
            "codec_gbps": 4 * numel / codec_s / 1e9, "adam_step_s": configs["adam"]["opt_s"],
            "onebit_step_s": max(0.0, comp["opt_s"] - codec_s - profile.get("comm", 0.0))}
    for key, costs in sources.items():
        if costs is None:
            continue
        est = estimate_speedup(numel, n, rate_gbit, compute_s=comp["fwd_bwd_s"], codec_gbps=costs["codec_gbps"],
                               adam_step_s=costs["adam_step_s"], onebit_step_s=costs["onebit_step_s"],
                               buckets=summary.get("buckets", {}).get("onebit_compression"))
        summary[key] = {**est.as_dict(), "measured_speedup": measured, "error": est.speedup / measured - 1.0}


def summarize_scaling(ranks: list[dict]) -> list[dict]:
    rows = []
    for row in ranks[0]["rows"]:
        world = row["world_size"]
        compression = [s for s in row["steps"] if s["phase"] == "compression"][-1]
        warmup = row["steps"][0]
        numel = row["numel"]
        ideal = 2 * (world - 1) / world * numel / 8
        scales = 8 * (world - 1) * row["tensors"]  # one float32 scale per tensor in every wire row
        rows.append({
            "world_size": world, "tensors": row["tensors"], "numel": numel, "buckets": row["buckets"],
            "compression_collectives": compression["collectives"],
            "compression_bytes": compression["bytes_sent"], "ideal_1bit_bytes": ideal, "scale_bytes": scales,
            "compression_bytes_vs_ideal": compression["bytes_sent"] / ideal,
            "compression_bytes_vs_ideal_plus_scales": compression["bytes_sent"] / (ideal + scales),
            "warmup_collectives": warmup["collectives"], "warmup_bytes": warmup["bytes_sent"],
            "fp32_ring_bytes": 2 * (world - 1) / world * numel * 4,
        })
    return rows


# ---------------------------------------------------------------------------------------------- output


def machine_info() -> dict:
    model = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, "onebit": onebit.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:,.0f}"


def _mb(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 1e6:,.2f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    changed = result["code"]["onebit_changed_files"]
    version = f"onebit at commit {result['code']['commit']}" + (f" (changed: {', '.join(changed)})" if changed else "")
    kind = "quick, loopback" if result["quick"] else ("rate-capped veth" if result["netns"] == "used" else "loopback")
    out = [f"# onebit vs peers ({kind})", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, onebit {m['onebit']}, "
           f"Python {m['python']}; {version}; {m['date']}; 1-min load average {result['load_average_1min_start']:.2f} "
           f"at the start, {result['load_average_1min_end']:.2f} at the end (the cores are shared).", ""]
    for run in result["runs"]:
        s = run["summary"]
        where = f"{run['rate_gbit']:g} Gbit/s tbf on veth, MTU {run['mtu']}" if run["rate_gbit"] else "loopback"
        out += [f"## {where}: {s['world_size']} ranks, {s['numel'] / 1e6:.1f}M parameters in {s['tensors']} "
                f"tensors, batch {s['batch']}, width {s['width']}, {s['rounds']} interleaved rounds", "",
                "| configuration | step, ms: median (quartiles) | fwd+bwd | optimizer step | speedup vs DDP+Adam "
                "(paired) | bytes/step/rank (stats) | TCP payload/step/rank (veth) |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for row in s["configs"].values():
            stats = row.get("stats_bytes_per_rank")
            link = row.get("link_per_rank")
            out.append(
                f"| {row['label']} | {_ms(row['step_s'])} ({_ms(row['step_s_quartiles'][0])}–"
                f"{_ms(row['step_s_quartiles'][1])}) | {_ms(row['fwd_bwd_s'])} | {_ms(row['opt_s'])} | "
                f"{row.get('speedup_vs_adam', 0):.2f}x ({row.get('speedup_vs_adam_paired_median', 0):.2f}x) | "
                f"{_mb(max(stats)) + ' MB' if stats else '–'} | "
                f"{_mb(max(x['tcp_payload_bytes'] for x in link)) + ' MB' if link else '–'} |")
        out += ["", f"Ideal per rank: 1-bit {_mb(s['ideal_1bit_bytes'])} MB, fp32 ring {_mb(s['fp32_ring_bytes'])} MB "
                f"(`2(n-1)/n * N/8` and `* 4N`)."]
        comp = s["configs"].get("onebit_compression", {})
        adam = s["configs"].get("adam", {})
        if comp.get("stats_bytes_per_rank"):
            sent = max(comp["stats_bytes_per_rank"])
            out.append(f"OnebitAdam compression, bytes from comm_stats(): {sent / s['ideal_1bit_bytes']:.4f}x "
                       f"the 1-bit ideal, {s['fp32_ring_bytes'] / sent:.1f}x below fp32 ring.")
        for name, row in (("OnebitAdam compression", comp), ("DDP + Adam", adam)):
            link = row.get("link_per_rank")
            if link:
                ideal = s["ideal_1bit_bytes"] if row is comp else s["fp32_ring_bytes"]
                worst = max(link, key=lambda x: x["tcp_payload_bytes"])
                out.append(
                    f"{name} on the veth: TCP payload {worst['tcp_payload_bytes'] / ideal:.4f}x its ideal; "
                    f"interface bytes {worst['tx_bytes'] / ideal:.4f}x ({worst['tx_packets']:.0f} packets/step, "
                    f"GSO segments); on a 1500-byte Ethernet wire ~{worst['ethernet_bytes_mtu1500'] / ideal:.4f}x "
                    f"(TCP/IP/Ethernet headers: +{(1 / TCP_ETHERNET_EFFICIENCY - 1) * 100:.1f}%).")
        if comp.get("profile_s"):
            out += ["", "Where the compression step's optimizer time goes (rank 0, medians, ms):", "",
                    "| part | ms | share of step | code |", "|---|---:|---:|---|"]
            for part, seconds in comp["profile_s"].items():
                out.append(f"| {part} | {_ms(seconds)} | {seconds / comp['step_s'] * 100:.0f}% | "
                           f"{result['profile_where'].get(part, '')} |")
            out.append(f"| forward+backward | {_ms(comp['fwd_bwd_s'])} | {comp['fwd_bwd_s'] / comp['step_s'] * 100:.0f}% | "
                       "model |")
        if s.get("estimate"):
            out += ["", "Estimate (`onebit.estimate_speedup`) against the measured speedup of the compression step "
                    "over DDP + Adam:", "", "| local costs from | codec GB/s | Adam step | 1-bit maths | fp32 step "
                    "| 1-bit step | estimate | measured | error |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for key, what in (("estimate", "onebit.estimate.measure_local_costs in the ranks, between rounds"),
                              ("estimate_isolated", "this process alone"), ("estimate_in_run", "the run's own medians")):
                e = s.get(key)
                if e:
                    out.append(f"| {what} | {e['codec_gbps']:.2f} | {_ms(e['adam_step_s'])} | {_ms(e['onebit_step_s'])} | "
                               f"{_ms(e['baseline_step_s'])} | {_ms(e['compressed_step_s'])} | {e['speedup']:.2f}x | "
                               f"{e['measured_speedup']:.2f}x | {e['error'] * 100:+.0f}% |")
        out += run_average.run_average_markdown(s, LABELS)
        out.append("")
    if result.get("scaling"):
        out += ["## Scaling (loopback): one compression step", "",
                "| ranks | tensors | params | buckets | collectives | bytes/rank | vs 1-bit ideal | "
                "warmup collectives | warmup bytes/rank |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["scaling"]:
            out.append(f"| {r['world_size']} | {r['tensors']} | {r['numel']:,} | {r['buckets']} | "
                       f"{r['compression_collectives']} | {r['compression_bytes']:,} | "
                       f"{r['compression_bytes_vs_ideal']:.4f}x | {r['warmup_collectives']} | {r['warmup_bytes']:,} |")
        out.append("")
    return "\n".join(out)


def chart(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return False
    runs = [r for r in result["runs"]]
    names = list(runs[0]["summary"]["configs"])
    estimated = [r for r in runs if r["summary"].get("estimate")]
    averaged = [r for r in runs if r["summary"].get("run_average")]
    panels = 2 + bool(estimated) + bool(averaged)
    if panels == 4:
        fig, grid = plt.subplots(2, 2, figsize=(16, 9))
        axes = list(grid.flat)
    else:
        fig, axes = plt.subplots(1, panels, figsize=(16 if panels == 3 else 12, 4.5),
                                 gridspec_kw={"width_ratios": [3, 3, 2] if panels == 3 else [1, 1]})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(runs))]
        axes[0].bar(xs, [r["summary"]["configs"][name]["step_s"] * 1e3 for r in runs], width, label=LABELS[name])
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(runs))])
    axes[0].set_xticklabels([f"{r['rate_gbit']:g} Gbit/s" if r["rate_gbit"] else "loopback" for r in runs])
    axes[0].set_ylabel("step time, median (ms)")
    axes[0].set_title(f"{runs[0]['summary']['numel'] / 1e6:.1f}M params, {runs[0]['summary']['world_size']} ranks")
    axes[0].legend(fontsize=8 if len(names) < 8 else 7)
    s = runs[0]["summary"]
    bars = {"fp32 ring ideal": s["fp32_ring_bytes"], "1-bit ideal": s["ideal_1bit_bytes"]}
    for name, row in s["configs"].items():
        if row.get("link_per_rank"):
            bars[LABELS[name] + " (veth)"] = max(x["tcp_payload_bytes"] for x in row["link_per_rank"])
        elif row.get("stats_bytes_per_rank"):
            bars[LABELS[name] + " (stats)"] = max(row["stats_bytes_per_rank"])
    bars = {k: v for k, v in bars.items() if v > 0}  # a log axis: local steps send nothing
    axes[1].barh(list(bars), [v / 1e6 for v in bars.values()], color="tab:gray")
    axes[1].set_xscale("log")
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].set_xlabel("MB sent per rank per step (log)")
    axes[1].set_title("bytes per step" + (" (first rate)" if len(runs) > 1 else ""))
    if estimated:
        xs = range(len(estimated))
        axes[2].bar([x - 0.2 for x in xs], [r["summary"]["estimate"]["measured_speedup"] for r in estimated], 0.4,
                    label="measured")
        axes[2].bar([x + 0.2 for x in xs], [r["summary"]["estimate"]["speedup"] for r in estimated], 0.4,
                    label="onebit.estimate_speedup")
        axes[2].set_xticks(list(xs))
        axes[2].set_xticklabels([f"{r['rate_gbit']:g} Gbit/s" for r in estimated])
        axes[2].axhline(1.0, color="black", linewidth=0.8)
        axes[2].set_ylabel("compression step vs DDP + Adam")
        axes[2].set_title("speedup: measured and estimated")
        axes[2].legend(fontsize=8)
    if averaged:
        ax = axes[-1]
        keys = list(averaged[0]["summary"]["run_average"]["optimizers"])
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            rows = [r["summary"]["run_average"]["optimizers"].get(key) for r in averaged]
            ax.bar([j + i * width for j in range(len(averaged))], [row["step_s"] * 1e3 if row else 0 for row in rows],
                   width, label=rows[0]["label"] if rows[0] else key)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(averaged))])
        ax.set_xticklabels([f"{r['rate_gbit']:g} Gbit/s" if r["rate_gbit"] else "loopback" for r in averaged])
        ax.set_ylabel("mean step time over the run (ms)")
        ax.set_title(f"mean step over a {averaged[0]['summary']['run_average']['schedule']['steps']}-step run")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="loopback only, small model: a CI smoke test")
    parser.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 5.0, 10.0],
                        help="link rates in Gbit/s (comma-separated)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--params", type=float, default=None, help="approximate parameters (default 25.2M)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    configs = [name for name in LABELS if not name.startswith("zoadam")] + list(ZOADAM_PARTS)
    parser.add_argument("--configs", default=None, help="comma-separated, from: " + ", ".join(configs)
                        + "; 'zoadam' stands for " + ",".join(ZOADAM_CONFIGS))
    parser.add_argument("--bucket-size", type=int, default=None,
                        help="elements per bucket of the onebit configurations (default: the optimizers' own)")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--loopback", action="store_true", help="time the peers on loopback, no namespaces")
    parser.add_argument("--no-scaling", action="store_true")
    parser.add_argument("--scaling-worlds", type=lambda s: [int(v) for v in s.split(",")], default=[2, 3, 4])
    parser.add_argument("--timeout-s", type=float, default=None)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--name", default=None, help="output file stem (default peers, or quick with --quick)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="measure nothing: recompute the estimates, tables and chart of a stored peers.json")
    parser.add_argument("--run-schedule", default=None,
                        help="the run the per-step averages describe, as key=value overrides of "
                             + ",".join(f"{k}={v}" for k, v in run_average.RUN_SCHEDULE.items())
                             + " (freeze_step, OnebitAdam's, follows var_freeze_step unless given)")
    args = parser.parse_args(argv)
    try:
        schedule = run_average.parse_schedule(args.run_schedule)
    except ValueError as exc:
        parser.error(str(exc))
    if args.from_json is not None:
        return rewrite(args.from_json, args.out_dir, args.name or args.from_json.stem,
                       schedule if args.run_schedule else None)

    quick = args.quick
    params = args.params or (1e6 if quick else 25.2e6)
    width = args.width or (256 if quick else 2048)
    batch = args.batch or (16 if quick else 32)
    rounds = args.rounds or (3 if quick else 8)
    timeout = args.timeout_s or (120 if quick else 900)
    peer_args = ["--params", str(params), "--width", str(width), "--batch", str(batch), "--rounds", str(rounds),
                 "--cost-rounds", "1" if quick else "5"]
    if args.configs:
        peer_args += ["--configs", args.configs]
    if args.bucket_size:
        peer_args += ["--bucket-size", str(args.bucket_size)]
    stem = args.name or ("quick" if quick else "peers")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    result = {"quick": quick, "machine": machine_info(), "code": code_version(), "profile_where": profile_where(),
              "load_average_1min_start": os.getloadavg()[0], "argv": sys.argv[1:], "runs": [], "scaling": None,
              "netns": None, "run_schedule": schedule}
    use_netns = not (quick or args.loopback)
    if use_netns:
        reason = netns.unavailable_reason()
        if reason:
            print(f"SKIP slow-link runs: {reason}")
            result["netns"] = f"skipped: {reason}"
            use_netns = False
    scaling_argv = ["--mode", "scaling", "--params", "1e5" if quick else "1e6", "--tensors", "10,1000",
                    "--worlds", ",".join(str(w) for w in args.scaling_worlds)]
    scaling_world = max(args.scaling_worlds)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        # --quick is a smoke test: its scaling launch runs beside the steps, to finish sooner.
        scaling = None
        if quick and not args.no_scaling:
            scaling = pool.submit(launch, scaling_world, scaling_argv, link=None, timeout_s=timeout)
        isolated = None
        if use_netns:
            result["netns"] = "used"
            torch.set_num_threads(1)  # as each rank
            numel = sum(p.numel() for p in peers_model(params, width).parameters())
            isolated = measure_local_costs(numel, args.world_size).as_dict()
            result["local_costs_isolated"] = isolated
            print(f"local costs, this process alone, one thread: {isolated}")
            for rate in args.rates:
                print(f"--- {rate:g} Gbit/s, {args.world_size} ranks, load {os.getloadavg()[0]:.2f}")
                with netns.SlowLink(args.world_size, rate, mtu=args.mtu) as link:
                    ranks = launch(args.world_size, peer_args, link=link, timeout_s=timeout)
                summary = summarize_steps(ranks)
                add_estimate(summary, rate, isolated)
                run_average.add_run_average(summary, schedule)
                result["runs"].append({"rate_gbit": rate, "mtu": args.mtu, "summary": summary})
                _print_run(result["runs"][-1])
        else:
            print(f"--- loopback, {args.world_size} ranks, load {os.getloadavg()[0]:.2f}")
            ranks = launch(args.world_size, peer_args, link=None, timeout_s=timeout)
            summary = summarize_steps(ranks)
            run_average.add_run_average(summary, schedule)
            result["runs"].append({"rate_gbit": None, "mtu": None, "summary": summary})
            _print_run(result["runs"][-1])
        if not args.no_scaling:
            ranks = scaling.result() if scaling else launch(scaling_world, scaling_argv, link=None, timeout_s=timeout)
            result["scaling"] = summarize_scaling(ranks)
    result["load_average_1min_end"] = os.getloadavg()[0]

    text = markdown(result)
    print(text)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(text)
    if not quick:
        chart(result, args.out_dir / f"{stem}.png")
    return 0


def rewrite(path: Path, out_dir: Path, stem: str, schedule: dict | None = None) -> int:
    """Recompute the estimates of a stored result with the current model (and the run averages with
    ``schedule``) and write its outputs."""
    result = json.loads(path.read_text())
    for run in result["runs"]:
        for key in ("estimate", "estimate_isolated", "estimate_in_run"):
            run["summary"].pop(key, None)
        add_estimate(run["summary"], run["rate_gbit"], result.get("local_costs_isolated"))
        stored = (run["summary"].get("run_average") or {}).get("schedule")
        run_average.add_run_average(run["summary"], schedule or stored or run_average.RUN_SCHEDULE)
        _print_run(run)
    result["estimate_model"] = "recomputed by --from-json with the current onebit.estimate"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(result))
    if not result["quick"]:
        chart(result, out_dir / f"{stem}.png")
    return 0


def _print_run(run: dict) -> None:
    s = run["summary"]
    for row in s["configs"].values():
        print(f"  {row['label']:<44} step {_ms(row['step_s']):>7} ms  fwd+bwd {_ms(row['fwd_bwd_s']):>7}  "
              f"opt {_ms(row['opt_s']):>7}  vs adam {row.get('speedup_vs_adam', 0):.2f}x")
    for key in ("estimate", "estimate_isolated", "estimate_in_run"):
        est = s.get(key)
        if est:
            print(f"  {key}: {est['speedup']:.2f}x vs measured {est['measured_speedup']:.2f}x")
    for row in (s.get("run_average") or {}).get("optimizers", {}).values():
        print(f"  run average, {row['label']:<32} step {_ms(row['step_s']):>7} ms  "
              f"vs adam {row.get('speedup_vs_adam', 0):.2f}x  counts {row['counts']}")
    for line in run_average.run_average_lines(s):
        print("  " + line)


if __name__ == "__main__":
    sys.exit(main())
