"""Adam vs 1-bit Adam, LAMB vs 1-bit LAMB, or Adam vs 0/1 Adam on the same BERT run: same seed, data, schedule, initial weights.

    python examples/bert/compare.py --steps 600 --out runs/demo --world-size 2
    python examples/bert/compare.py --optimizer lamb --steps 600 --out runs/lamb --world-size 2
    python examples/bert/compare.py --optimizer zoadam --steps 600 --out runs/zoadam --world-size 2 \
        --onebit-from runs/demo

Launches ``pretrain.py`` twice on ``--world-size`` local ranks (gloo by default; ``--launcher mpi``
uses ``mpiexec``): once with ``configs/adam.json`` (OnebitAdam with a ``freeze_step`` beyond the
last step, i.e. plain Adam with a full-precision gradient all-reduce every step) and once with
``configs/onebit_gloo.json`` and ``freeze_step`` = ``--freeze-fraction`` (20%) of the steps.
``--optimizer lamb`` does the same with OnebitLamb: ``configs/lamb.json`` (``freeze_step`` beyond
the last step: plain LAMB) against ``configs/onebit_lamb_gloo.json``. ``--optimizer zoadam`` runs
``configs/adam.json`` against ZeroOneAdam (0/1 Adam, ``configs/zoadam_gloo.json``, whose
``var_freeze_step`` is ``--freeze-fraction`` of the steps); ``--onebit-from DIR`` adds a finished
1-bit Adam run of the same settings (``DIR`` or ``DIR/onebit``, e.g. the ``--optimizer adam``
comparison's) to the table, the plot and the bytes ratios, without running it again. Writes
``OUT/comparison.json``, ``OUT/comparison.png`` (train and validation loss of each run, and bytes
sent) and prints a table. Any other arguments are passed on to ``pretrain.py`` (e.g. ``--model mini``).

A run that diverged (``pretrain.py``'s ``status``: a validation loss that is not finite or blew up
past ``max(ln(vocab size), initial) + 1`` nats, or training stalled on non-finite gradients; or a
final loss that is not finite) is marked DIVERGED in the table, with the reason, and
``comparison.json`` says so in its ``status``; everything is still written, and the script then
exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRETRAIN = HERE / "pretrain.py"
#: ``--optimizer`` -> (the full-precision run, the 1-bit run): the names of their directories
#: under ``--out`` and of their entries in ``comparison.json``.
COMPARISONS = {"adam": ("adam", "onebit"), "lamb": ("lamb", "onebit_lamb"), "zoadam": ("adam", "zoadam")}
#: Each run's config (in ``configs/``), label and plot colour; for a 1-bit run also: the flag that
#: sets the length of its first phase (``--freeze-fraction`` of the steps), the short name of the
#: ratio line, and the kind of step whose bytes it compares with the full-precision step.
RUN_SPECS = {
    "adam": {"config": "adam.json", "label": "Adam", "color": "tab:blue"},
    "onebit": {"config": "onebit_gloo.json", "label": "1-bit Adam", "color": "tab:orange",
               "first_phase": "freeze_step", "short": "1-bit", "one_bit_step": "compression"},
    "lamb": {"config": "lamb.json", "label": "LAMB", "color": "tab:green"},
    "onebit_lamb": {"config": "onebit_lamb_gloo.json", "label": "1-bit LAMB", "color": "tab:red",
                    "first_phase": "freeze_step", "short": "1-bit", "one_bit_step": "compression"},
    "zoadam": {"config": "zoadam_gloo.json", "label": "0/1 Adam", "color": "tab:purple",
               "first_phase": "var_freeze_step", "short": "0/1 Adam", "one_bit_step": "sync"},
}
RUNS = COMPARISONS["adam"]
#: The entry of a 1-bit Adam run read with ``--onebit-from`` (a third row of the zoadam comparison).
REFERENCE = "onebit"
#: The comparisons that ``--onebit-from`` applies to.
WITH_REFERENCE = ("zoadam",)
#: The kinds of step of a run whose summary does not list them (written before 0/1 Adam).
DEFAULT_PLANS = ("warmup", "compression")


def runs_of(comparison: dict) -> tuple[str, str]:
    """(full-precision run, 1-bit run) of a ``comparison``: by its ``optimizer`` entry, or (a
    comparison written before it had one) by its entries."""
    if comparison.get("optimizer") in COMPARISONS:
        return COMPARISONS[comparison["optimizer"]]
    for runs in COMPARISONS.values():
        if all(name in comparison for name in runs):
            return runs
    raise KeyError(f"no runs of {sorted(COMPARISONS)} in the comparison (keys: {sorted(comparison)})")


def rows_of(comparison: dict) -> list[str]:
    """The runs in the table and the plot: the full-precision run, the 1-bit Adam run read with
    ``--onebit-from`` (zoadam comparison), the 1-bit run."""
    full, compressed = runs_of(comparison)
    extra = [REFERENCE] if comparison.get("onebit_reference") else []
    return [full, *extra, compressed]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def launch(script_args: list[str], world_size: int, log_dir: Path, *, launcher: str = "torch",
           timeout: float | None = None, quiet: bool = False) -> None:
    """Run ``pretrain.py script_args`` on ``world_size`` local ranks and wait for it.

    ``launcher="torch"`` starts one process per rank with the environment ``torchrun`` would give
    (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); ``"mpi"`` runs
    ``mpiexec -n N python -m mpi4py pretrain.py``. Rank 0 writes to this terminal (unless
    ``quiet``), the others to ``log_dir/rank{r}.log``. If a rank fails or ``timeout`` seconds
    pass, every rank is killed and a RuntimeError carries the end of the logs.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    try:
        if launcher == "mpi":
            mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
            log = open(log_dir / "mpiexec.log", "w")
            logs.append(log)
            cmd = [mpiexec, "-n", str(world_size), sys.executable, "-m", "mpi4py", str(PRETRAIN), *script_args]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log if quiet else None,
                                          stderr=subprocess.STDOUT if quiet else None))
        elif launcher == "torch":
            port = str(_free_port())
            for rank in range(world_size):
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
                log = open(log_dir / f"rank{rank}.log", "w")
                logs.append(log)
                to_log = rank != 0 or quiet
                procs.append(subprocess.Popen([sys.executable, str(PRETRAIN), *script_args], env=rank_env,
                                              stdout=log if to_log else None, stderr=subprocess.STDOUT if to_log else None))
        else:
            raise ValueError(f"unknown launcher {launcher!r}; expected 'torch' or 'mpi'")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed or (deadline is not None and time.monotonic() > deadline):
                _stop(procs)
                for log in logs:
                    log.flush()
                tails = "\n".join(f"--- {f.name} ---\n" + "\n".join(f.read_text(errors="replace").splitlines()[-30:])
                                  for f in sorted(log_dir.glob("*.log")))
                why = f"rank(s) {failed} exited with {[codes[r] for r in failed]}" if failed else f"timed out after {timeout} s"
                raise RuntimeError(f"pretrain.py {' '.join(script_args)}: {why}\n{tails}")
            if all(c == 0 for c in codes):
                return
            time.sleep(0.2)
    finally:
        _stop(procs)
        for log in logs:
            log.close()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def run_status(summary: dict) -> tuple[str, str | None]:
    """``(status, reason)`` of a run from its ``summary.json``: ``pretrain.py``'s verdict (``status``
    and ``status_reason``, see its ``judge_run``), except that a final validation loss that is not
    finite always makes the run ``"diverged"`` and a missing one makes it ``"stopped"``. Only
    ``"finished"`` is a run to compare; ``reason`` is ``None`` for it."""
    loss = summary.get("final_val_loss")
    if loss is None:
        return "stopped", f"no final val loss: the run stopped at step {summary.get('step')}"
    if not math.isfinite(loss):
        reason = summary.get("status_reason") if summary.get("status") == "diverged" else None
        return "diverged", reason or f"final val loss {loss}"
    status = summary.get("status", "finished")
    return status, (None if status == "finished" else summary.get("status_reason") or status)


def summarize(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    stats = summary["comm_stats"]
    plans = summary.get("plans", DEFAULT_PLANS)
    per_step = {phase: (stats[phase]["bytes_sent"] / stats[phase]["steps"] if stats[phase]["steps"] else None)
                for phase in plans}
    status, reason = run_status(summary)
    skipped = summary.get("skipped_steps", sum(stats[phase].get("skipped_steps", 0) for phase in plans))
    return {
        "status": status,
        "status_reason": reason,
        "final_val_loss": summary.get("final_val_loss", math.nan),
        "skipped_steps": skipped,
        "bytes_sent": sum(summary["bytes_sent"][phase] for phase in plans),
        "wall_s": summary["wall_s"],
        "bytes_per_step": per_step,
        "steps_per_plan": {phase: stats[phase]["steps"] for phase in plans},
        "steps": summary["step"],
        "world_size": summary.get("world_size"),
        "freeze_step": summary["freeze_step"],
        "params_in_sync": summary["params_in_sync"],
        # False when the run ended between 0/1 Adam's syncs: the ranks' parameters differ by design.
        "replicas_identical": summary.get("replicas_identical", True),
    }


def onebit_reference(path: Path, settings: dict, world_size: int) -> Path:
    """The run directory of a finished 1-bit Adam run with these ``settings`` (pretrain.py's
    model, data and schedule flags) on ``world_size`` ranks: ``path`` or ``path/onebit``."""
    run_dir = path / REFERENCE if (path / REFERENCE / "summary.json").is_file() else path
    hint = ("a finished 1-bit Adam run of the same flags: the 'onebit' directory of `compare.py --optimizer adam` "
            "(or that comparison's --out)")
    if not (run_dir / "summary.json").is_file() or not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"--onebit-from {path}: no summary.json and metrics.jsonl there or in {path / REFERENCE}; "
                         f"expected {hint}")
    summary = json.loads((run_dir / "summary.json").read_text())
    start = next((r for r in read_metrics(run_dir) if r.get("event") == "start"), {})
    kind = str(start.get("config", {}).get("optimizer", {}).get("type", "?"))
    problems = []
    if kind.lower() != "onebitadam" or summary["freeze_step"] >= summary["step"]:
        problems.append(f"it is not a 1-bit Adam run (type {kind}, freeze_step {summary['freeze_step']})")
    if run_status(summary)[0] != "finished":
        problems.append(f"it did not finish normally ({run_status(summary)[1]})")
    if summary.get("world_size") != world_size:
        problems.append(f"it ran on {summary.get('world_size')} ranks, not {world_size}")
    differ = {k: (start.get("settings", {}).get(k), v) for k, v in settings.items()
              if start.get("settings", {}).get(k) != v}
    if differ:
        problems.append("other settings (" + ", ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
                        + ")")
    if problems:
        raise ValueError(f"--onebit-from {run_dir}: {'; '.join(problems)}; expected {hint}")
    return run_dir


def pretrain_settings(pretrain_args: list[str]) -> dict:
    """The model, data and schedule settings ``pretrain.py pretrain_args`` would record (its
    ``RESUME_KEYS``), without running it."""
    import importlib.util

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # pretrain.py imports bert_data
    spec = importlib.util.spec_from_file_location("_compare_pretrain", PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--out", "unused", *pretrain_args])
    return {key: getattr(args, key) for key in module.RESUME_KEYS}


def plot(results: dict[str, list[dict]], freeze_step: int, path: Path, status: dict[str, str] | None = None,
         y_max: float | None = None, freeze_label: str = "freeze_step") -> None:
    """``status``: run name -> status; a run not ``finished`` gets it in its labels. ``y_max``:
    cap of the loss axis (a run that blew up leaves the top instead of squashing the others).
    ``freeze_label``: the name of the dashed line at ``freeze_step``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {name: spec["color"] for name, spec in RUN_SPECS.items()}
    labels = {name: spec["label"] for name, spec in RUN_SPECS.items()}
    for name, state in (status or {}).items():
        if state != "finished":
            labels[name] = f"{labels[name]} ({state.upper()})"
    for name, records in results.items():
        train = [r for r in records if r["event"] == "train"]
        val = [r for r in records if r["event"] == "eval"]
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], color=colors[name], alpha=0.45, lw=1,
                     label=f"{labels[name]} train")
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], color=colors[name], marker="o", ms=3, lw=1.8,
                     label=f"{labels[name]} validation")
        ax_bytes.plot([0] + [r["step"] for r in train], [0] + [r["bytes_sent"] / 2**20 for r in train], color=colors[name],
                      lw=1.8, label=labels[name])
    for ax in (ax_loss, ax_bytes):
        ax.axvline(freeze_step, color="gray", ls="--", lw=1)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_loss.text(freeze_step, 0.98, f" {freeze_label}", transform=ax_loss.get_xaxis_transform(), va="top", color="gray")
    ax_loss.set_ylabel("masked-LM loss (nats)")
    ax_loss.set_title("Loss: train (thin) and validation (markers)")
    # Zoom on the part after the initial drop, where the two runs differ.
    later = [r["loss"] for records in results.values() for r in records
             if r["event"] == "train" and r["step"] >= 0.1 * max(x["step"] for x in records) and math.isfinite(r["loss"])]
    if later:
        low, high = min(later) - 0.05, max(later) + 0.1
        if y_max is not None and math.isfinite(y_max):
            high = max(low + 0.1, min(high, y_max))
        ax_loss.set_ylim(low, high)
    ax_loss.legend()
    ax_bytes.set_ylabel("MiB sent per rank (cumulative)")
    ax_bytes.set_title("Communication")
    ax_bytes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def failed_runs(comparison: dict) -> list[str]:
    """The runs of ``comparison`` that did not finish normally (diverged or stopped)."""
    return [name for name in rows_of(comparison) if comparison[name].get("status", "finished") != "finished"]


def _label(name: str) -> str:
    return RUN_SPECS[name]["label"]


def _kib(value: float | None) -> str:
    return "-" if value is None else f"{value / 1024:,.1f}"


def table(comparison: dict) -> str:
    """The comparison as printed. With at most two kinds of step over all runs (warmup,
    compression) each has a column of KiB per step; with more (0/1 Adam's variance,
    compressed_gradient, local and sync) they are listed below the table, with their step counts."""
    names = rows_of(comparison)
    plans = list(dict.fromkeys(plan for name in names for plan, per in comparison[name]["bytes_per_step"].items()
                               if per is not None))
    columns = plans if len(plans) <= 2 else []
    rows = [("", "final val loss", "MiB sent/rank", *(f"KiB/step {plan}" for plan in columns), "wall s", "skipped",
             "status")]
    for name in names:
        r = comparison[name]
        per = r["bytes_per_step"]
        rows.append((
            _label(name),
            f"{r['final_val_loss']:.4f}",
            f"{r['bytes_sent'] / 2**20:,.1f}",
            *(_kib(per.get(plan)) for plan in columns),
            f"{r['wall_s']:.1f}",
            str(r.get("skipped_steps", 0)),
            r.get("status", "finished").upper() if r.get("status", "finished") != "finished" else "ok",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    if not columns:
        lines.append("steps by kind (KiB per step and rank):")
        width = max(len(_label(name)) for name in names)
        for name in names:
            r = comparison[name]
            kinds = ", ".join(f"{plan} {r['steps_per_plan'][plan]} ({_kib(per)})"
                              for plan, per in r["bytes_per_step"].items() if per is not None)
            lines.append(f"  {_label(name).ljust(width)}  {kinds}")
    full_run, compressed_run = runs_of(comparison)
    spec = RUN_SPECS[compressed_run]
    ratio = comparison["compression_bytes_ratio"]
    full = _label(full_run)
    per_step = (f"no {spec['one_bit_step']} step ran" if ratio is None
                else f"{ratio:.1f}x fewer bytes per {spec['one_bit_step']} step than {full}'s")
    whole = f"whole run: {comparison['total_bytes_ratio']:.1f}x fewer"
    if comparison.get("total_bytes_ratio_vs_onebit") is not None:
        whole += f" than {full}'s, {comparison['total_bytes_ratio_vs_onebit']:.2f}x fewer than {_label(REFERENCE)}'s"
    elif comparison.get("optimizer") in WITH_REFERENCE:
        whole += f" (no {_label(REFERENCE)} run to compare: --onebit-from DIR adds one)"
    lines.append(f"val loss ratio {spec['short']}/{full}: {comparison['val_loss_ratio']:.4f}; {per_step}; {whole}")
    failed = failed_runs(comparison)
    for name in failed:
        r = comparison[name]
        lines.append(f"{r['status'].upper()}: {_label(name)}: {r.get('status_reason') or r['status']}")
    if failed:
        lines.append("the losses above do not compare two trained models: fix the run(s) marked "
                     f"{' and '.join(sorted({comparison[n]['status'].upper() for n in failed}))} first")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", required=True, help="directory for both runs, comparison.json and comparison.png")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--optimizer", choices=sorted(COMPARISONS), default="adam",
                   help="adam: Adam vs 1-bit Adam (OnebitAdam); lamb: LAMB vs 1-bit LAMB (OnebitLamb); "
                        "zoadam: Adam vs 0/1 Adam (ZeroOneAdam)")
    p.add_argument("--freeze-fraction", type=float, default=0.2,
                   help="the 1-bit run's freeze_step (0/1 Adam: var_freeze_step) as a fraction of --steps")
    p.add_argument("--onebit-from", default=None, metavar="DIR",
                   help="with --optimizer zoadam: a finished 1-bit Adam run of the same settings (DIR or DIR/onebit, "
                        "e.g. the --out of `compare.py --optimizer adam`), added to the table, plot and bytes ratios")
    p.add_argument("--launcher", choices=["torch", "mpi"], default="torch")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run before its ranks are killed")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args, passthrough = p.parse_known_args(argv)
    out = Path(args.out)
    freeze_step = max(1, round(args.freeze_fraction * args.steps))
    common = ["--steps", str(args.steps), *passthrough]
    if args.quiet:
        common.append("--no-progress")
    runs = full, compressed_run = COMPARISONS[args.optimizer]
    first_phase = RUN_SPECS[compressed_run]["first_phase"]
    reference = None
    if args.onebit_from is not None:
        if args.optimizer not in WITH_REFERENCE:
            p.error(f"--onebit-from adds a 1-bit Adam run to --optimizer zoadam, not to --optimizer {args.optimizer}")
        reference = onebit_reference(Path(args.onebit_from), pretrain_settings(common), args.world_size)
    configs = {full: ["--config", str(HERE / "configs" / RUN_SPECS[full]["config"])],
               compressed_run: ["--config", str(HERE / "configs" / RUN_SPECS[compressed_run]["config"]),
                                f"--{first_phase.replace('_', '-')}", str(freeze_step)]}
    if args.launcher == "mpi":
        configs = {name: [*cfg, "--comm-backend", "mpi"] for name, cfg in configs.items()}
    for name in runs:
        run_dir = out / name
        launch([*configs[name], "--out", str(run_dir), *common], args.world_size, run_dir,
               launcher=args.launcher, timeout=args.timeout, quiet=args.quiet)
    run_dirs = {name: out / name for name in runs}
    comparison: dict = {"optimizer": args.optimizer}
    comparison.update({name: summarize(run_dir) for name, run_dir in run_dirs.items()})
    baseline, onebit = comparison[full], comparison[compressed_run]
    comparison["val_loss_ratio"] = (onebit["final_val_loss"] / baseline["final_val_loss"]
                                    if baseline["final_val_loss"] else math.nan)
    compressed = onebit["bytes_per_step"][RUN_SPECS[compressed_run]["one_bit_step"]]
    comparison["compression_bytes_ratio"] = baseline["bytes_per_step"]["warmup"] / compressed if compressed else None
    comparison["total_bytes_ratio"] = baseline["bytes_sent"] / onebit["bytes_sent"]
    if reference is not None:
        comparison[REFERENCE] = summarize(reference)
        comparison["onebit_reference"] = str(reference)
        comparison["total_bytes_ratio_vs_onebit"] = comparison[REFERENCE]["bytes_sent"] / onebit["bytes_sent"]
        run_dirs = {full: run_dirs[full], REFERENCE: reference, compressed_run: run_dirs[compressed_run]}
    comparison["world_size"] = args.world_size
    comparison["failed_runs"] = failed_runs(comparison)
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
    limits = [json.loads((run_dir / "summary.json").read_text()).get("val_loss_limit") for run_dir in run_dirs.values()]
    limits = [x for x in limits if x is not None]
    plot({name: read_metrics(run_dir) for name, run_dir in run_dirs.items()}, freeze_step, out / "comparison.png",
         status={name: comparison[name]["status"] for name in run_dirs}, y_max=max(limits) if limits else None,
         freeze_label=first_phase)
    print(table(comparison))
    print(f"plot: {out / 'comparison.png'}   numbers: {out / 'comparison.json'}")
    if comparison["failed_runs"]:
        print(f"compare.py: {', '.join(comparison['failed_runs'])} did not finish normally; exit status 1",
              file=sys.stderr)
    return comparison


def exit_status(comparison: dict) -> int:
    """0 when every run finished normally, 1 when one diverged (or stopped early)."""
    return 1 if failed_runs(comparison) else 0


if __name__ == "__main__":
    sys.exit(exit_status(main()))
