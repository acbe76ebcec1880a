"""Adam vs 1-bit Adam, or LAMB vs 1-bit LAMB, on the same BERT run: same seed, data, schedule and initial weights.

    python examples/bert/compare.py --steps 600 --out runs/demo --world-size 2
    python examples/bert/compare.py --optimizer lamb --steps 600 --out runs/lamb --world-size 2

Launches ``pretrain.py`` twice on ``--world-size`` local ranks (gloo by default; ``--launcher mpi``
uses ``mpiexec``): once with ``configs/adam.json`` (OnebitAdam with a ``freeze_step`` beyond the
last step, i.e. plain Adam with a full-precision gradient all-reduce every step) and once with
``configs/onebit_gloo.json`` and ``freeze_step`` = ``--freeze-fraction`` (20%) of the steps.
``--optimizer lamb`` does the same with OnebitLamb: ``configs/lamb.json`` (``freeze_step`` beyond
the last step: plain LAMB) against ``configs/onebit_lamb_gloo.json``. Writes
``OUT/comparison.json``, ``OUT/comparison.png`` (train and validation loss of both, and bytes sent)
and prints a table. Any other arguments are passed on to ``pretrain.py`` (e.g. ``--model mini``).

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
COMPARISONS = {"adam": ("adam", "onebit"), "lamb": ("lamb", "onebit_lamb")}
#: Each run's config (in ``configs/``; the 1-bit one's ``freeze_step`` is overridden), label and plot colour.
RUN_SPECS = {
    "adam": {"config": "adam.json", "label": "Adam", "color": "tab:blue"},
    "onebit": {"config": "onebit_gloo.json", "label": "1-bit Adam", "color": "tab:orange"},
    "lamb": {"config": "lamb.json", "label": "LAMB", "color": "tab:green"},
    "onebit_lamb": {"config": "onebit_lamb_gloo.json", "label": "1-bit LAMB", "color": "tab:red"},
}
RUNS = COMPARISONS["adam"]


def runs_of(comparison: dict) -> tuple[str, str]:
    """(full-precision run, 1-bit run) of a ``comparison`` (Adam's or LAMB's, by its entries)."""
    for runs in COMPARISONS.values():
        if runs[0] in comparison:
            return runs
    raise KeyError(f"no run of {sorted(COMPARISONS)} in the comparison (keys: {sorted(comparison)})")


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
    per_step = {phase: (stats[phase]["bytes_sent"] / stats[phase]["steps"] if stats[phase]["steps"] else None)
                for phase in ("warmup", "compression")}
    status, reason = run_status(summary)
    skipped = summary.get("skipped_steps", sum(stats[phase].get("skipped_steps", 0) for phase in ("warmup", "compression")))
    return {
        "status": status,
        "status_reason": reason,
        "final_val_loss": summary.get("final_val_loss", math.nan),
        "skipped_steps": skipped,
        "bytes_sent": summary["bytes_sent"]["warmup"] + summary["bytes_sent"]["compression"],
        "wall_s": summary["wall_s"],
        "bytes_per_step": per_step,
        "steps": summary["step"],
        "freeze_step": summary["freeze_step"],
        "params_in_sync": summary["params_in_sync"],
    }


def plot(results: dict[str, list[dict]], freeze_step: int, path: Path, status: dict[str, str] | None = None,
         y_max: float | None = None) -> None:
    """``status``: run name -> status; a run not ``finished`` gets it in its labels. ``y_max``:
    cap of the loss axis (a run that blew up leaves the top instead of squashing the others)."""
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
    ax_loss.text(freeze_step, 0.98, " freeze_step", transform=ax_loss.get_xaxis_transform(), va="top", color="gray")
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
    return [name for name in runs_of(comparison) if comparison[name].get("status", "finished") != "finished"]


def _label(name: str) -> str:
    return RUN_SPECS[name]["label"]


def table(comparison: dict) -> str:
    rows = [("", "final val loss", "MiB sent/rank", "KiB/step warmup", "KiB/step compression", "wall s", "skipped",
             "status")]
    for name in runs_of(comparison):
        r = comparison[name]
        per = r["bytes_per_step"]
        rows.append((
            _label(name),
            f"{r['final_val_loss']:.4f}",
            f"{r['bytes_sent'] / 2**20:,.1f}",
            "-" if per["warmup"] is None else f"{per['warmup'] / 1024:,.1f}",
            "-" if per["compression"] is None else f"{per['compression'] / 1024:,.1f}",
            f"{r['wall_s']:.1f}",
            str(r.get("skipped_steps", 0)),
            r.get("status", "finished").upper() if r.get("status", "finished") != "finished" else "ok",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    ratio = comparison["compression_bytes_ratio"]
    full = _label(runs_of(comparison)[0])
    per_step = "no compression step ran" if ratio is None else f"{ratio:.1f}x fewer bytes per compression step than {full}'s"
    lines.append(f"val loss ratio 1-bit/{full}: {comparison['val_loss_ratio']:.4f}; {per_step}; "
                 f"whole run: {comparison['total_bytes_ratio']:.1f}x fewer")
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
                   help="adam: Adam vs 1-bit Adam (OnebitAdam); lamb: LAMB vs 1-bit LAMB (OnebitLamb)")
    p.add_argument("--freeze-fraction", type=float, default=0.2,
                   help="the 1-bit run's freeze_step as a fraction of --steps")
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
    configs = {full: ["--config", str(HERE / "configs" / RUN_SPECS[full]["config"])],
               compressed_run: ["--config", str(HERE / "configs" / RUN_SPECS[compressed_run]["config"]),
                                "--freeze-step", str(freeze_step)]}
    if args.launcher == "mpi":
        configs = {name: [*cfg, "--comm-backend", "mpi"] for name, cfg in configs.items()}
    for name in runs:
        run_dir = out / name
        launch([*configs[name], "--out", str(run_dir), *common], args.world_size, run_dir,
               launcher=args.launcher, timeout=args.timeout, quiet=args.quiet)
    comparison = {name: summarize(out / name) for name in runs}
    reference, onebit = comparison[full], comparison[compressed_run]
    comparison["val_loss_ratio"] = (onebit["final_val_loss"] / reference["final_val_loss"]
                                    if reference["final_val_loss"] else math.nan)
    compressed = onebit["bytes_per_step"]["compression"]
    comparison["compression_bytes_ratio"] = reference["bytes_per_step"]["warmup"] / compressed if compressed else None
    comparison["total_bytes_ratio"] = reference["bytes_sent"] / onebit["bytes_sent"]
    comparison["world_size"] = args.world_size
    comparison["failed_runs"] = failed_runs(comparison)
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
    limits = [json.loads((out / name / "summary.json").read_text()).get("val_loss_limit") for name in runs]
    limits = [x for x in limits if x is not None]
    plot({name: read_metrics(out / name) for name in runs}, freeze_step, out / "comparison.png",
         status={name: comparison[name]["status"] for name in runs}, y_max=max(limits) if limits else None)
    print(table(comparison))
    print(f"plot: {out / 'comparison.png'}   numbers: {out / 'comparison.json'}")
    if comparison["failed_runs"]:
        print(f"compare.py: {', '.join(comparison['failed_runs'])} did not finish normally; exit status 1",
              file=sys.stderr)
    return comparison


def exit_status(comparison: dict) -> int:
    """0 when both runs finished normally, 1 when one diverged (or stopped early)."""
    return 1 if failed_runs(comparison) else 0


if __name__ == "__main__":
    sys.exit(exit_status(main()))
