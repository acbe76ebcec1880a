"""Time and bytes per step averaged over a whole training run, from the per-kind steps of one run.

``slowlink.py`` times each kind of step on its own (``peers.py``: ``onebit_warmup``,
``onebit_compression``, the ``zoadam_*`` configurations, ``adam``), interleaved in the same run.
A training run is a schedule of those kinds: this module counts them with the optimizers' own
``plan_for`` (``ZeroOneAdam.plan_for``, ``OnebitAdam.plan_for``) and weights each kind's median by
its count, which is what timing every step of the run would give, less the one-time costs (the
first step, the allocations at a phase switch, the keep mask built at 1-bit Adam's first
compression step). The same weights over each interleaved round give per-round averages, whose
ratios are the "paired" comparison.

ZeroOneAdam's compressed_gradient steps are counted in two kinds, because they cost differently: one
right after a variance step rebuilds the frozen-coordinate mask and the denominator (``v`` changed),
the others do not. A sync right after a variance step (only when ``var_freeze_step`` is itself a
variance step) is counted as a sync; its rebuild is then not included, and ``counts`` says so.
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from onebit import OnebitAdam, ZeroOneAdam

__all__ = ["RUN_SCHEDULE", "parse_schedule", "schedule_counts", "add_run_average", "run_average_markdown",
           "run_average_lines"]

#: The run the averages describe: a BERT-example-sized run of 600 steps, 20% of them before the
#: variance freezes (ZeroOneAdam's ``var_freeze_step`` and OnebitAdam's ``freeze_step``).
RUN_SCHEDULE = {"steps": 600, "var_freeze_step": 120, "var_update_scaler": 16, "local_step_scaler": 40,
                "local_step_clipper": 8, "freeze_step": 120}
ZOADAM_KEYS = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
#: Each optimizer of the comparison: its label and, for each kind of step, the configuration that times it.
OPTIMIZERS = {
    "adam": ("DDP + Adam", {"step": "adam"}),
    "onebit": ("OnebitAdam (1-bit Adam)", {"warmup": "onebit_warmup", "compression": "onebit_compression"}),
    "onebit_overlap": ("OnebitAdam, overlap_backward", {"warmup": "onebit_warmup_overlap",
                                                        "compression": "onebit_compression_overlap"}),
    "onebit_bf16": ("OnebitAdam, reduce_dtype=torch.bfloat16", {"warmup": "onebit_warmup_bf16",
                                                                "compression": "onebit_compression"}),
    "zoadam": ("ZeroOneAdam (0/1 Adam)", {
        "variance": "zoadam_variance",
        "compressed_gradient_after_variance": "zoadam_compressed_gradient_after_variance",
        "compressed_gradient": "zoadam_compressed_gradient",
        "local": "zoadam_local",
        "sync": "zoadam_sync",
    }),
    # (local steps and syncs start nothing during backward: their rows are the same optimizer's)
    "zoadam_overlap": ("ZeroOneAdam, overlap_backward", {
        "variance": "zoadam_variance_overlap",
        "compressed_gradient_after_variance": "zoadam_compressed_gradient_after_variance_overlap",
        "compressed_gradient": "zoadam_compressed_gradient_overlap",
        "local": "zoadam_local",
        "sync": "zoadam_sync",
    }),
}


def parse_schedule(text: str | None) -> dict[str, int]:
    """``RUN_SCHEDULE`` with ``key=value,...`` overrides (``freeze_step`` follows ``var_freeze_step``
    unless given)."""
    schedule = dict(RUN_SCHEDULE)
    if not text:
        return schedule
    given = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in RUN_SCHEDULE:
            raise ValueError(f"bad run schedule item {item!r}; expected key=int with key one of {', '.join(RUN_SCHEDULE)}")
        try:
            given[key] = int(value)
        except ValueError:
            raise ValueError(f"bad run schedule item {item!r}: {value!r} is not an int") from None
        if given[key] < 1:
            raise ValueError(f"bad run schedule item {item!r}: it must be >= 1")
    schedule.update(given)
    if "var_freeze_step" in given and "freeze_step" not in given:
        schedule["freeze_step"] = schedule["var_freeze_step"]
    return schedule


def schedule_counts(schedule: dict[str, int]) -> dict:
    """Steps of each kind in a run of ``schedule['steps']`` steps, per optimizer, from its ``plan_for``."""
    params = [torch.nn.Parameter(torch.zeros(1))]
    zoadam = ZeroOneAdam(params, comm_backend_name="local", **{k: schedule[k] for k in ZOADAM_KEYS})
    onebit = OnebitAdam(params, freeze_step=schedule["freeze_step"], comm_backend_name="local")
    steps = schedule["steps"]
    zo, previous, sync_after_variance = Counter(), None, 0
    for step in range(1, steps + 1):
        kind = zoadam.plan_for(step).name
        if kind == "compressed_gradient" and previous == "variance":
            zo["compressed_gradient_after_variance"] += 1
        else:
            zo[kind] += 1
            sync_after_variance += kind == "sync" and previous == "variance"
        previous = kind
    ob = Counter(onebit.plan_for(step).name for step in range(1, steps + 1))
    return {
        "adam": {"step": steps},
        "onebit": {kind: ob.get(kind, 0) for kind in OPTIMIZERS["onebit"][1]},
        "onebit_overlap": {kind: ob.get(kind, 0) for kind in OPTIMIZERS["onebit"][1]},
        "onebit_bf16": {kind: ob.get(kind, 0) for kind in OPTIMIZERS["onebit"][1]},
        "zoadam": {kind: zo.get(kind, 0) for kind in OPTIMIZERS["zoadam"][1]},
        "zoadam_overlap": {kind: zo.get(kind, 0) for kind in OPTIMIZERS["zoadam"][1]},
        "zoadam_sync_after_variance": sync_after_variance,
    }


def _weighted(counts: dict[str, int], values: dict[str, float | None]) -> float | None:
    if any(values[kind] is None for kind, n in counts.items() if n):
        return None
    return sum(n * values[kind] for kind, n in counts.items() if n) / sum(counts.values())


def _max(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def add_run_average(summary: dict, schedule: dict[str, int]) -> None:
    """``summary['run_average']``: for each optimizer whose every kind of step was timed in this
    run, the mean step time, bytes and collectives per step over ``schedule``."""
    summary.pop("run_average", None)
    configs = summary["configs"]
    counts = schedule_counts(schedule)
    optimizers = {}
    for key, (label, kinds) in OPTIMIZERS.items():
        n = counts[key]
        if any(count and kinds[kind] not in configs for kind, count in n.items()):
            continue
        rows = {kind: configs[kinds[kind]] for kind, count in n.items() if count}
        rounds = min(len(row["steps_s"]) for row in rows.values())
        stats = {kind: _max(row.get("stats_bytes_per_rank") or [None]) for kind, row in rows.items()}
        veth = {kind: _max(x["tcp_payload_bytes"] for x in row["link_per_rank"]) if row.get("link_per_rank") else None
                for kind, row in rows.items()}
        collectives = {kind: row.get("collectives") for kind, row in rows.items()}
        if key == "adam":  # DDP has no comm_stats(): its bytes are on the veth only
            stats = {"step": None}
        per_round = [_weighted(n, {kind: row["steps_s"][r] for kind, row in rows.items()}) for r in range(rounds)]
        step_s = _weighted(n, {kind: row["step_s"] for kind, row in rows.items()})
        optimizers[key] = {
            "label": label, "counts": n, "configs": {kind: kinds[kind] for kind in rows},
            "step_s": step_s, "run_s": step_s * schedule["steps"], "step_s_by_round": per_round,
            "stats_bytes_per_step": _weighted(n, stats), "tcp_payload_bytes_per_step": _weighted(n, veth),
            "collectives_per_step": _weighted(n, collectives),
            "kind_step_s": {kind: row["step_s"] for kind, row in rows.items()},
        }
    if not optimizers:
        return
    out = {"schedule": dict(schedule), "counts": counts, "method": (
        "per-kind medians of this run weighted by the number of steps of each kind in the schedule "
        "(counted with ZeroOneAdam.plan_for and OnebitAdam.plan_for); not a timed run of every step"),
        "optimizers": optimizers}
    base = optimizers.get("adam")
    for row in optimizers.values():
        if base is not None:
            row["speedup_vs_adam"] = base["step_s"] / row["step_s"]
            row["speedup_vs_adam_paired_median"] = statistics.median(
                a / b for a, b in zip(base["step_s_by_round"], row["step_s_by_round"]))
    zo, ob = optimizers.get("zoadam"), optimizers.get("onebit")
    if zo is not None and ob is not None:
        out["zoadam_vs_onebit"] = {
            "speedup": ob["step_s"] / zo["step_s"],
            "speedup_paired_median": statistics.median(
                b / z for b, z in zip(ob["step_s_by_round"], zo["step_s_by_round"])),
            "zoadam_not_slower": zo["step_s"] <= ob["step_s"],
            "stats_bytes_ratio": _ratio(zo["stats_bytes_per_step"], ob["stats_bytes_per_step"]),
            "tcp_payload_bytes_ratio": _ratio(zo["tcp_payload_bytes_per_step"], ob["tcp_payload_bytes_per_step"]),
            "collectives_ratio": _ratio(zo["collectives_per_step"], ob["collectives_per_step"]),
        }
    summary["run_average"] = out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:,.0f}"


def _mb(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 1e6:,.2f} MB"


def _schedule_text(schedule: dict[str, int]) -> str:
    return (f"{schedule['steps']} steps; ZeroOneAdam var_freeze_step {schedule['var_freeze_step']}, "
            f"var_update_scaler {schedule['var_update_scaler']}, local_step_scaler {schedule['local_step_scaler']}, "
            f"local_step_clipper {schedule['local_step_clipper']}; OnebitAdam freeze_step {schedule['freeze_step']}")


def run_average_markdown(summary: dict, labels: dict[str, str]) -> list[str]:
    """The per-kind table and the run-average table of one run (empty when there is no average)."""
    ra = summary.get("run_average")
    if not ra:
        return []
    configs, optimizers = summary["configs"], ra["optimizers"]
    out = ["", f"### Each kind of step, and the run ({_schedule_text(ra['schedule'])})", "",
           "| optimizer | kind of step (configuration) | steps in the run | step, ms: median (quartiles) | fwd+bwd "
           "| optimizer step | collectives | bytes/step/rank (stats) | TCP payload/step/rank (veth) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, row in optimizers.items():
        for kind, name in row["configs"].items():
            c = configs[name]
            veth = _max(x["tcp_payload_bytes"] for x in c["link_per_rank"]) if c.get("link_per_rank") else None
            out.append(f"| {row['label']} | {kind} (`{name}`) | {row['counts'][kind]} | {_ms(c['step_s'])} "
                       f"({_ms(c['step_s_quartiles'][0])}–{_ms(c['step_s_quartiles'][1])}) | {_ms(c['fwd_bwd_s'])} | "
                       f"{_ms(c['opt_s'])} | {c.get('collectives', '–')} | "
                       f"{_mb(_max(c.get('stats_bytes_per_rank') or [None]))} | {_mb(veth)} |")
    out += ["", f"Averaged over the run: {ra['method']}.", "",
            "| optimizer | time/step, mean over the run | run time | vs DDP + Adam (paired) | bytes/step/rank "
            "(stats) | TCP payload/step/rank (veth) | collectives/step |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in optimizers.values():
        collectives = row["collectives_per_step"]
        out.append(f"| {row['label']} | {_ms(row['step_s'])} ms | {row['run_s']:,.0f} s | "
                   f"{row.get('speedup_vs_adam', 0):.2f}x ({row.get('speedup_vs_adam_paired_median', 0):.2f}x) | "
                   f"{_mb(row['stats_bytes_per_step'])} | {_mb(row['tcp_payload_bytes_per_step'])} | "
                   f"{'–' if collectives is None else f'{collectives:.2f}'} |")
    out += [""] + run_average_lines(summary)
    if ra["counts"]["zoadam_sync_after_variance"]:
        out.append(f"({ra['counts']['zoadam_sync_after_variance']} sync step(s) right after a variance step are "
                   "counted as plain syncs: their mask rebuild is not included.)")
    return out


def run_average_lines(summary: dict) -> list[str]:
    """One sentence: 0/1 Adam against 1-bit Adam over the run."""
    ra = summary.get("run_average") or {}
    cmp = ra.get("zoadam_vs_onebit")
    if not cmp:
        return []
    zo, ob = ra["optimizers"]["zoadam"], ra["optimizers"]["onebit"]
    payload = cmp["tcp_payload_bytes_ratio"]
    return [f"0/1 Adam vs 1-bit Adam over the run: {_ms(zo['step_s'])} vs {_ms(ob['step_s'])} ms per step, "
            f"1-bit / 0/1 = {cmp['speedup']:.2f}x (median of per-round ratios {cmp['speedup_paired_median']:.2f}x): "
            f"0/1 Adam's average step is {'not ' if not cmp['zoadam_not_slower'] else ''}≤ 1-bit Adam's; "
            f"bytes {_x(cmp['stats_bytes_ratio'])} (stats)"
            + (f", {_x(payload)} (veth TCP payload)" if payload is not None else "")
            + f", collectives {_x(cmp['collectives_ratio'])} of 1-bit Adam's."]


def _x(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}x"
