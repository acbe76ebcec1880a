"""Several optimizer configurations of the BERT example, one after the other, in one table.

    python examples/bert/sweep.py --steps 600 --out runs/sweep --runs ds_adam ds_onebit demo_adam demo_onebit

Each run is ``pretrain.py`` on ``--world-size`` local gloo ranks (same seed, data, schedule and
initial weights), with the optimizer section below and the default ``--param-groups decay``.
Prints a markdown table (final validation loss, its ratio to the Adam run of the same settings,
bytes per compression step, the compression errors, status) and writes ``OUT/sweep.json``. Any
other arguments go to ``pretrain.py``.

With ``--seeds S1 S2 ...`` every run is made once per seed (``OUT/seed<S>/<run>``; the seed picks
the initial weights and the batches), each compared with its Adam run of the same seed, and a
second table gives each run's ratios side by side with their mean and worst: at 600 steps a 1-bit
run near the edge of stability can finish within 1% of Adam with one seed and stall with another.

The runs:

* ``ds_adam`` / ``ds_onebit``: DeepSpeed's defaults as a migrating user writes them
  (``lr 1e-3, weight_decay 0.01``; no bias correction, betas (0.9, 0.999)), ``freeze_step`` 1e9
  (Adam) and 20% of the steps;
* ``demo_adam`` / ``demo_onebit``: the demo's ``configs/adam.json`` / ``configs/onebit_gloo.json``;
* ``lamb`` / ``lamb_onebit``: LAMB and 1-bit LAMB, ``configs/onebit_lamb_gloo.json`` (its
  ``freeze_step`` 100; LAMB with 1e9); ``lamb98`` / ``lamb98_onebit``: the same with betas (0.9, 0.98);
* ``zo_demo``: 0/1 Adam, ``configs/zoadam_gloo.json`` (``var_freeze_step`` 20% of the steps);
  ``zo_ds`` / ``zo_ds16``: 0/1 Adam with a DeepSpeed-like schedule (``lr 1e-3``, betas (0.9, 0.98),
  ``weight_decay 0.01``, no bias correction, ``var_freeze_step`` 20%, ``var_update_scaler`` 8 / 16,
  ``local_step_scaler`` 60, ``local_step_clipper`` 8); all three against ``demo_adam``;
  ``zo_ds_adam``: Adam with ``zo_ds``'s settings (no bias correction, betas (0.9, 0.98));
* ``zo_*_bound``, ``demo_onebit_bound``, ``ds_onebit_bound``, ``lamb_onebit_bound``, ``lamb98_onebit_bound``:
  those with ``update_bound = 1`` (0/1 Adam: no coordinate steps further than Adam could; 1-bit Adam
  and LAMB: ``m / d`` clamped to Adam's largest before the 1-bit all-reduce; the default of all three
  since 2026-11-26); ``*_nobound``: with ``update_bound = None`` (no clamp: the rule before; 0/1
  Adam's ``zo_*_nobound`` are DeepSpeed's numerics);
* ``lambgrid_lr<LR>_b<B>`` (LR in 2e-3, 5e-3, 1e-2; B in 98, 999 for beta2 0.98 / 0.999): LAMB at
  ``configs/onebit_lamb_gloo.json`` with that lr and beta2; ``lambgrid_lr<LR>_b<B>_<rule>_<space>``:
  1-bit LAMB there with ``freeze_step`` 20% of the steps, ``trust_ratio`` ``live`` / ``frozen`` and
  ``compression_space`` ``mom`` / ``pre`` (``update_bound`` each space's default), against that LAMB;
* ``lamb_onebit_live`` / ``lamb_onebit_frozen`` (and ``lamb98_``): 1-bit LAMB with ``trust_ratio``
  ``"live"`` (each compression step's own trust ratio; the default since 2026-11-26) / ``"frozen"``
  (DeepSpeed's rule: the warmup ratios averaged, times the factor ``f``, with DeepSpeed's
  ``coeff_beta``, ``factor_*``);
* ``diloco_h<H>`` (H in 4, 8, 16, 32, 64): ``OnebitDiLoCo``, ``configs/diloco_gloo.json`` (the
  demo's AdamW inside, a plain average outside: ``outer_lr`` 1, ``outer_momentum`` 0) with
  ``sync_every`` H and one 1-bit pass with the classic error feedback (``error_feedback``
  "buffer", ``outer_bits`` 1); ``diloco_h<H>_bits2_model``: the defaults (two passes, the residual
  in the model); ``diloco_h<H>_nesterov``: DiLoCo's published outer step (lr 0.7, Nesterov 0.9);
  ``*_none``: the same with ``compression="none"`` (the exact float32 mean); ``*_buffer`` /
  ``*_model``: with ``error_feedback`` "buffer" / "model"; ``*_bits2`` / ``*_bits3``: ``outer_bits`` 2 / 3
  (``*_bits2_model``: and ``error_feedback`` "model"); ``*_block<K>``: with one scale per K
  elements; all against ``demo_adam``;
* ``diloco_h32_bits2_model[_frag<P>]_tau<D>``: the defaults at H 32 (with ``fragments`` P) and
  ``sync_delay`` D (1 or 2: each exchange lands D steps after its outer step, with the local
  progress made meanwhile); ``*_mix0`` / ``*_mix05``: with ``sync_mix`` 0 / 0.5 (the share of that
  progress kept; default 1); ``diloco_h64_bits2_model_frag4_tau2``: the same at H 64, 4 fragments,
  delay 2; all against ``demo_adam``;
* ``*_block<K>``: the 1-bit run with ``scale_block_size = K`` (one scale per K elements);
* ``*_bf16``: the 1-bit run with ``reduce_dtype = "bfloat16"`` (its full-precision all-reduces send
  bfloat16: half the bytes of a warmup step);
* ``*_bf16err``: the 1-bit run with ``error_dtype = "bfloat16"`` (its compression errors held in
  bfloat16: half their memory); ``*_compact`` (1-bit Adam and LAMB): and ``preconditioner_dtype =
  "bfloat16"`` (the frozen ``1 / d`` alone, in bfloat16); ``*_float32`` (1-bit Adam and LAMB): both
  float32 (1-bit Adam's defaults are compact in the preconditioned space since 2026-11-28);
* ``*_jitter``: the 1-bit run with float32 state and its initial weights moved by two float32 ulps
  (``--perturb-init 2.4e-7``): how far the last bits alone move a run's end (its noise);
* ``*_pre`` / ``*_mom``: the 1-bit run with ``compression_space = "preconditioned"`` (the 1-bit
  all-reduce averages ``m / (sqrt(v) + eps)``; the default of 1-bit Adam and 1-bit LAMB) /
  ``"momentum"`` (it averages ``m``: DeepSpeed's numerics, the default before 2026-11-26).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import launch  # noqa: E402

from onebit.lamb import OnebitLamb  # noqa: E402

DEEPSPEED_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.01, "comm_backend_name": "gloo"}
DEMO = json.loads((HERE / "configs" / "onebit_gloo.json").read_text())["optimizer"]["params"]
LAMB = json.loads((HERE / "configs" / "onebit_lamb_gloo.json").read_text())["optimizer"]["params"]
ZOADAM = json.loads((HERE / "configs" / "zoadam_gloo.json").read_text())["optimizer"]["params"]
# (fragments 1 and no delay written out: the names below say where they differ, whatever the defaults)
DILOCO = {**json.loads((HERE / "configs" / "diloco_gloo.json").read_text())["optimizer"]["params"],
          "fragments": 1, "sync_delay": 0}


def configs(steps: int) -> dict[str, tuple[dict, str, str]]:
    """name -> (optimizer params, name of the baseline run it compares with, optimizer type)."""
    freeze = max(1, round(0.2 * steps))
    zo_ds = {**DEEPSPEED_DEFAULTS, "betas": [0.9, 0.98], "var_freeze_step": freeze, "var_update_scaler": 8,
             "local_step_scaler": 60, "local_step_clipper": 8}
    runs = {
        "ds_adam": ({**DEEPSPEED_DEFAULTS, "freeze_step": 10**9}, "ds_adam", "OneBitAdam"),
        "ds_onebit": ({**DEEPSPEED_DEFAULTS, "freeze_step": freeze}, "ds_adam", "OneBitAdam"),
        "demo_adam": ({**DEMO, "freeze_step": 10**9}, "demo_adam", "OneBitAdam"),
        "demo_onebit": ({**DEMO, "freeze_step": freeze}, "demo_adam", "OneBitAdam"),
        "lamb": ({**LAMB, "freeze_step": 10**9}, "lamb", "OneBitLamb"),
        "lamb_onebit": (LAMB, "lamb", "OneBitLamb"),
        "lamb98": ({**LAMB, "betas": [0.9, 0.98], "freeze_step": 10**9}, "lamb98", "OneBitLamb"),
        "lamb98_onebit": ({**LAMB, "betas": [0.9, 0.98]}, "lamb98", "OneBitLamb"),
        "zo_demo": ({**ZOADAM, "var_freeze_step": freeze}, "demo_adam", "ZeroOneAdam"),
        "zo_ds_adam": ({**DEEPSPEED_DEFAULTS, "betas": [0.9, 0.98], "freeze_step": 10**9}, "zo_ds_adam", "OneBitAdam"),
        "zo_ds": (zo_ds, "demo_adam", "ZeroOneAdam"),
        "zo_ds16": ({**zo_ds, "var_update_scaler": 16}, "demo_adam", "ZeroOneAdam"),
    }
    for h in (4, 8, 16, 32, 64):  # the local-step mode, against the demo's Adam
        # (one 1-bit pass with the classic error feedback: what the table called OnebitDiLoCo before the
        # defaults became two passes with the residual in the model, diloco_h<H>_bits2_model)
        classic = {**DILOCO, "error_feedback": "buffer", "outer_bits": 1}
        runs[f"diloco_h{h}"] = ({**classic, "sync_every": h}, "demo_adam", "OneBitDiLoCo")
        runs[f"diloco_h{h}_nesterov"] = ({**classic, "sync_every": h, "outer_lr": 0.7, "outer_momentum": 0.9},
                                         "demo_adam", "OneBitDiLoCo")
        for name in (f"diloco_h{h}", f"diloco_h{h}_nesterov"):
            params, adam, kind = runs[name]
            exact = {k: v for k, v in params.items() if k not in ("error_feedback", "outer_bits")}
            runs[f"{name}_none"] = ({**exact, "compression": "none"}, adam, kind)
            runs[f"{name}_buffer"] = ({**params, "error_feedback": "buffer"}, adam, kind)
            runs[f"{name}_model"] = ({**params, "error_feedback": "model"}, adam, kind)
            runs[f"{name}_bits2"] = ({**params, "outer_bits": 2}, adam, kind)
            runs[f"{name}_bits2_model"] = ({**params, "outer_bits": 2, "error_feedback": "model"}, adam, kind)
            runs[f"{name}_bits3"] = ({**params, "outer_bits": 3}, adam, kind)
            for block in (128, 1024):
                runs[f"{name}_block{block}"] = ({**params, "scale_block_size": block}, adam, kind)
    for fragments in (2, 4):  # fragments=P (Streaming DiLoCo's, without overlap), at H 32: the classic scheme
        # and the defaults (two passes, the residual in the model)
        for name in ("diloco_h32", "diloco_h32_bits2_model"):
            params, adam, kind = runs[name]
            runs[f"{name}_frag{fragments}"] = ({**params, "fragments": fragments}, adam, kind)
    params, adam, kind = runs["diloco_h64_bits2_model"]  # (H 64 with 4 fragments and a delay of 2)
    runs["diloco_h64_bits2_model_frag4_tau2"] = ({**params, "fragments": 4, "sync_delay": 2}, adam, kind)
    for fragments in (1, 2, 4):  # sync_delay=tau (Streaming DiLoCo's overlap) at the defaults, H 32
        name = "diloco_h32_bits2_model" + ("" if fragments == 1 else f"_frag{fragments}")
        params, adam, kind = runs[name]
        for tau in (1, 2):
            runs[f"{name}_tau{tau}"] = ({**params, "sync_delay": tau}, adam, kind)
            for mix in (0, 0.5):
                runs[f"{name}_tau{tau}_mix{str(mix).replace('.', '')}"] = (
                    {**params, "sync_delay": tau, "sync_mix": mix}, adam, kind)
    for block in (128, 1024, 4096):
        for base in ("ds", "demo"):
            params, adam, kind = runs[f"{base}_onebit"]
            runs[f"{base}_onebit_block{block}"] = ({**params, "scale_block_size": block}, adam, kind)
    for name in ("zo_demo", "zo_ds", "zo_ds16", "demo_onebit", "ds_onebit", "lamb_onebit", "lamb98_onebit"):
        params, adam, kind = runs[name]
        runs[f"{name}_bound"] = ({**params, "update_bound": 1.0}, adam, kind)
        runs[f"{name}_nobound"] = ({**params, "update_bound": None}, adam, kind)
    for name in ("lamb_onebit", "lamb98_onebit"):
        params, lamb, kind = runs[name]
        runs[f"{name}_live"] = ({**params, "trust_ratio": "live"}, lamb, kind)
        # (with DeepSpeed's factor arguments written out, as its docs' config does)
        runs[f"{name}_frozen"] = ({**params, "trust_ratio": "frozen", **OnebitLamb.FROZEN_DEFAULTS}, lamb, kind)
    for lr in ("2e-3", "5e-3", "1e-2"):  # 1-bit LAMB's grid: lr x beta2, each rule against LAMB of the same setting
        for beta2 in ("98", "999"):
            base = f"lambgrid_lr{lr}_b{beta2}"
            setting = {**LAMB, "lr": float(lr), "betas": [0.9, float(f"0.{beta2}")], "freeze_step": freeze}
            runs[base] = ({**setting, "freeze_step": 10**9}, base, "OneBitLamb")
            for rule in ("live", "frozen"):
                for space, short in (("momentum", "mom"), ("preconditioned", "pre")):
                    runs[f"{base}_{rule}_{short}"] = ({**setting, "trust_ratio": rule, "compression_space": space},
                                                      base, "OneBitLamb")
    for name, (params, adam, kind) in list(runs.items()):
        if name != adam:  # a 1-bit run
            runs[f"{name}_bf16"] = ({**params, "reduce_dtype": "bfloat16"}, adam, kind)
    for name, (params, adam, kind) in list(runs.items()):
        if name != adam:  # a 1-bit run
            runs[f"{name}_pre"] = ({**params, "compression_space": "preconditioned"}, adam, kind)
            if kind == "ZeroOneAdam" or params.get("update_bound") is None:  # (1-bit Adam's bound is refused there)
                runs[f"{name}_mom"] = ({**params, "compression_space": "momentum"}, adam, kind)
    for name, (params, adam, kind) in list(runs.items()):
        if name != adam:  # a 1-bit run
            frozen = kind in ("OneBitAdam", "OneBitLamb")  # (a frozen preconditioner: float32 unless named)
            runs[f"{name}_bf16err"] = ({**params, "error_dtype": "bfloat16",
                                        **({"preconditioner_dtype": "float32"} if frozen else {})}, adam, kind)
            if frozen:
                runs[f"{name}_compact"] = ({**params, "error_dtype": "bfloat16", "preconditioner_dtype": "bfloat16"},
                                           adam, kind)
                runs[f"{name}_float32"] = ({**params, "error_dtype": "float32", "preconditioner_dtype": "float32"},
                                           adam, kind)
            # float32 state, the initial weights moved by two ulps: how far a run's last bits alone move its end
            runs[f"{name}_jitter"] = ({**params, "error_dtype": "float32", PERTURB: 2.4e-7,
                                       **({"preconditioner_dtype": "float32"} if frozen else {})}, adam, kind)
    return runs


#: A run's entry that is not the optimizer's: pretrain.py's --perturb-init (the ``*_jitter`` runs)
PERTURB = "perturb_init"


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# The plans that send 1-bit: 1-bit Adam's and LAMB's, 0/1 Adam's (the KiB column averages over them).
COMPRESSED_PLANS = ("compression", "compressed_gradient", "sync", "outer")


def summarize(name: str, run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    compressed = [k for k in COMPRESSED_PLANS if k in summary["comm_stats"]]
    compression = [r for r in _records(run_dir) if r.get("event") == "train" and r.get("phase") in compressed]
    stats = summary["comm_stats"]
    steps = sum(stats[k]["steps"] for k in compressed)
    sent = sum(stats[k]["bytes_sent"] for k in compressed)
    if "fragments" in stats.get("outer", {}):  # (OnebitDiLoCo: with sync_delay the steps after an outer step complete it)
        sent = sum(f["bytes_sent"] for f in stats["outer"]["fragments"])
    return {
        "name": name,
        "final_val_loss": summary.get("final_val_loss"),
        "status": summary.get("status"),
        "skipped_steps": summary.get("skipped_steps"),
        "kib_per_compression_step": sent / steps / 1024 if steps else None,
        "mean_worker_error_norm": (sum(r["worker_error_norm"] for r in compression) / len(compression)
                                   if compression and "worker_error_norm" in compression[0] else None),
        "mean_error_to_momentum": (sum(r["error_to_momentum"] for r in compression if r.get("error_to_momentum"))
                                   / max(1, sum(1 for r in compression if r.get("error_to_momentum")))
                                   if compression else None),
        "max_update_to_lr": max((r["update_to_lr"] for r in compression if r.get("update_to_lr") is not None),
                                default=None),
        "bits_per_parameter_step": summary.get("bits_per_parameter_step"),
        "wall_s": summary.get("wall_s"),
    }


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # (--seed goes to pretrain.py)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--runs", nargs="+", default=["ds_adam", "ds_onebit", "demo_adam", "demo_onebit"])
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="make every run once per seed (pretrain.py's --seed), in OUT/seed<S>/")
    parser.add_argument("--plot", action="store_true",
                        help="also write OUT/sweep.png: validation loss per step, and final loss vs bits per parameter step "
                             "(with --seeds: the first seed's curves)")
    args, passthrough = parser.parse_known_args()
    if args.seeds is not None and any(arg == "--seed" or arg.startswith("--seed=") for arg in passthrough):
        parser.error("give the seeds with --seeds only (--seed goes to every run of a --seeds sweep)")
    runs = configs(args.steps)
    unknown = [r for r in args.runs if r not in runs]
    if unknown:
        parser.error(f"unknown runs {unknown}; expected some of {sorted(runs)}")
    out = Path(args.out)
    if args.seeds is None:
        results = sweep(runs, args, out, passthrough)
        (out / "sweep.json").write_text(json.dumps(results, indent=2))
        print_table(results)
        if args.plot:
            plot(results, out, out / "sweep.png")
        return
    by_seed = {}
    for seed in args.seeds:
        by_seed[seed] = sweep(runs, args, out / f"seed{seed}", [*passthrough, "--seed", str(seed)])
        print(f"seed {seed}:")
        print_table(by_seed[seed])
    (out / "sweep.json").write_text(json.dumps({str(seed): results for seed, results in by_seed.items()}, indent=2))
    if args.plot:
        first = args.seeds[0]
        plot(by_seed[first], out / f"seed{first}", out / "sweep.png")
    print()
    print("| run | " + " | ".join(f"seed {seed}" for seed in args.seeds) + " | mean vs Adam | worst vs Adam |")
    print("|---|" + "---:|" * (len(args.seeds) + 2))
    for name in args.runs:
        cells, ratios = [], []
        for seed in args.seeds:
            r = by_seed[seed][name]
            cells.append(f"{_fmt(r['final_val_loss'], '.4f')} ({_fmt(r['vs_adam'], '.4f')})")
            if r["vs_adam"] is not None and math.isfinite(r["vs_adam"]):
                ratios.append(r["vs_adam"])
            else:  # a diverged run (NaN) is the worst
                ratios.append(math.inf)
        complete = all(by_seed[seed][name]["vs_adam"] is not None for seed in args.seeds)
        mean = sum(ratios) / len(ratios) if complete else None
        print(f"| {name} | " + " | ".join(cells) + f" | {_fmt(mean, '.4f')} | {_fmt(max(ratios) if complete else None, '.4f')} |")


def sweep(runs: dict[str, tuple[dict, str, str]], args: argparse.Namespace, out: Path, passthrough: list[str]) -> dict:
    """Make (or read back, when a run's summary exists) each of ``args.runs`` in ``out``."""
    results = {}
    for name in args.runs:
        params, _, kind = runs[name]
        params = dict(params)
        perturb = ["--perturb-init", str(params.pop(PERTURB))] if PERTURB in params else []
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run_dir / "config.json"
        config.write_text(json.dumps({"optimizer": {"type": kind, "params": params}}, indent=2))
        if not (run_dir / "summary.json").exists():
            launch(["--config", str(config), "--out", str(run_dir), "--steps", str(args.steps), "--no-progress",
                    *perturb, *passthrough], args.world_size, run_dir, timeout=args.timeout, quiet=True)
        results[name] = summarize(name, run_dir)
    for name, result in results.items():
        adam = results.get(runs[name][1])
        ok = adam is not None and result["final_val_loss"] is not None and adam["final_val_loss"]
        result["vs_adam"] = result["final_val_loss"] / adam["final_val_loss"] if ok else None
    return results


def plot(results: dict, out: Path, path: Path) -> None:
    """Two panels: each run's validation loss against the step, and each run's final validation
    loss against its bits per parameter per step (log scale; runs that sent nothing left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_curve, ax_bits) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab20").colors
    for index, (name, r) in enumerate(results.items()):
        evals = [rec for rec in _records(out / name) if rec.get("event") == "eval"]
        line, = ax_curve.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], marker="o", ms=2.5, lw=1.2,
                              label=name, color=colors[index % len(colors)])
        bits, final = r.get("bits_per_parameter_step"), r.get("final_val_loss")
        if bits and final is not None and math.isfinite(final):
            ax_bits.scatter([bits], [final], color=line.get_color())
            ax_bits.annotate(name, (bits, final), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax_curve.set(xlabel="step", ylabel="validation loss", title="validation loss")
    finals = [r["final_val_loss"] for r in results.values() if r.get("final_val_loss") is not None
              and math.isfinite(r["final_val_loss"])]
    if finals:  # (the first evaluations, near ln(vocab), would hide the differences at the end)
        ax_curve.set_ylim(min(finals) - 0.1, max(finals) + 0.6)
    ax_curve.legend(fontsize=7)
    ax_bits.set(xscale="log", xlabel="bits per parameter per step (whole run, rank 0)", ylabel="final validation loss",
                title="final loss vs bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def print_table(results: dict) -> None:
    print("| run | final val loss | vs Adam | bits / param / step | KiB / compression step | mean worker error norm "
          "| mean error/momentum (worst tensor) | largest step / lr | status | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in results.values():
        print(f"| {r['name']} | {_fmt(r['final_val_loss'], '.4f')} | {_fmt(r['vs_adam'], '.4f')} "
              f"| {_fmt(r.get('bits_per_parameter_step'), '.3g')} "
              f"| {_fmt(r['kib_per_compression_step'], ',.1f')} | {_fmt(r['mean_worker_error_norm'], '.4g')} "
              f"| {_fmt(r['mean_error_to_momentum'], '.3g')} | {_fmt(r.get('max_update_to_lr'), ',.0f')} "
              f"| {r['status']} | {_fmt(r['wall_s'], '.0f')} |")


if __name__ == "__main__":
    main()
