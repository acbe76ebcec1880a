"""Checkpoint files: atomic saves, damaged files, other models, exact resume across world sizes."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
import torch

import onebit
from conftest import all_equal, tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam, load_checkpoint, save_checkpoint


def _model(width: int = 6) -> torch.nn.Module:
    return tiny_mlp(width, 5, 2)


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, model[0].in_features, generator=gen), torch.randn(8, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _local(width: int = 6):
    model = _model(width)
    return model, OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="local")


def _fingerprint(model, opt):
    return [p.detach().clone() for p in model.parameters()] + [
        t.clone() for p in model.parameters() for t in opt.state[p].values()] + [torch.tensor(opt.step_count)]


def test_round_trip_restores_model_optimizer_and_extra(tmp_path):
    model, opt = _local()
    _train(model, opt, 0, range(4))
    save_checkpoint(tmp_path / "ckpt.pt", opt, model=model, extra={"epoch": 3})
    model2, opt2 = _local()
    assert load_checkpoint(tmp_path / "ckpt.pt", opt2, model=model2) == {"epoch": 3}
    assert all_equal(_fingerprint(model, opt), _fingerprint(model2, opt2))
    assert not list(tmp_path.glob(".*tmp*")), "no temporary file is left behind"


def test_crash_before_rename_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    model, opt = _local()
    _train(model, opt, 0, range(2))
    save_checkpoint(tmp_path / "ckpt.pt", opt, model=model)
    good = _fingerprint(model, opt)
    _train(model, opt, 0, range(2, 5))

    def crash(src, dst):
        raise OSError("simulated crash between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path / "ckpt.pt", opt, model=model)
    monkeypatch.undo()
    model2, opt2 = _local()
    load_checkpoint(tmp_path / "ckpt.pt", opt2, model=model2)
    assert all_equal(good, _fingerprint(model2, opt2))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_file_is_rejected_and_nothing_changes(tmp_path, damage):
    model, opt = _local()
    _train(model, opt, 0, range(3))
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, opt, model=model)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00junk" * 100, "empty": b""}[damage])
    model2, opt2 = _local()
    _train(model2, opt2, 1, range(1))
    before = _fingerprint(model2, opt2)
    with pytest.raises(ValueError, match="is truncated or corrupt"):
        load_checkpoint(path, opt2, model=model2)
    assert all_equal(before, _fingerprint(model2, opt2))


def test_checkpoint_of_another_model_is_rejected_and_nothing_changes(tmp_path):
    model, opt = _local()
    _train(model, opt, 0, range(3))
    save_checkpoint(tmp_path / "ckpt.pt", opt, model=model)
    other, other_opt = _local(width=7)
    before = _fingerprint(other, other_opt)
    with pytest.raises(ValueError, match=r"has shape \(5, 6\), the model has \(5, 7\)"):
        load_checkpoint(tmp_path / "ckpt.pt", other_opt, model=other)
    assert all_equal(before, _fingerprint(other, other_opt))


def _rewrite_state_part(path, change) -> None:
    """Apply ``change`` to the state part of the checkpoint at ``path`` and record its new digest."""
    manifest = torch.load(path, weights_only=True)
    part_id, _ = manifest["parts"]["state"]
    part = path.with_name(f"{path.name}.state-{part_id}")
    state = torch.load(part, weights_only=True)
    change(state)
    torch.save(state, part)
    manifest["parts"]["state"] = (part_id, hashlib.sha256(part.read_bytes()).hexdigest())
    torch.save(manifest, path)


def test_newer_formats_are_rejected(tmp_path):
    model, opt = _local()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, opt, model=model)
    _rewrite_state_part(path, lambda state: [g["onebit"].update(format_version=4) for g in state["optimizer"]["param_groups"]])
    with pytest.raises(ValueError, match="format_version 4 is newer than this onebit supports"):
        load_checkpoint(path, opt, model=model)
    manifest = torch.load(path, weights_only=True)
    torch.save({**manifest, "version": 3}, path)
    with pytest.raises(ValueError, match="manifest version 3, newer than this onebit reads"):
        load_checkpoint(path, opt, model=model)


def test_a_damaged_state_part_is_caught_by_its_digest_and_nothing_changes(tmp_path):
    model, opt = _local()
    _train(model, opt, 0, range(3))
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, opt, model=model)
    (part,) = tmp_path.glob("ckpt.pt.state-*")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit: torch.load alone might not notice
    part.write_bytes(bytes(data))
    model2, opt2 = _local()
    before = _fingerprint(model2, opt2)
    with pytest.raises(ValueError, match="does not match the digest its manifest records"):
        load_checkpoint(path, opt2, model=model2)
    assert all_equal(before, _fingerprint(model2, opt2))


def test_a_single_file_checkpoint_of_onebit_0_1_still_loads(tmp_path):
    model, opt = _local()
    _train(model, opt, 0, range(3))
    legacy = {"format": "onebit-checkpoint", "optimizer": opt.state_dict(), "model": model.state_dict(),
              "extra": {"epoch": 1}, "world_size": 1}
    torch.save(legacy, tmp_path / "old.pt")
    model2, opt2 = _local()
    assert load_checkpoint(tmp_path / "old.pt", opt2, model=model2, exact_resume=True) == {"epoch": 1}
    assert all_equal(_fingerprint(model, opt), _fingerprint(model2, opt2))


def test_saves_keep_only_the_parts_the_manifest_can_name(tmp_path):
    model, opt = _local()
    path = tmp_path / "ckpt.pt"
    for k in range(4):
        _train(model, opt, 0, range(k, k + 1))
        save_checkpoint(path, opt, model=model, exact_resume=True)
        manifest = torch.load(path, weights_only=True)
        assert {p.name for p in tmp_path.glob("ckpt.pt.state-*")} == {f"ckpt.pt.state-{manifest['parts']['state'][0]}"}
        ranks = {p.name for p in tmp_path.glob("ckpt.pt.rank0-*")}
        assert f"ckpt.pt.rank0-{manifest['parts']['ranks'][0][0]}" in ranks and len(ranks) <= 2
    (tmp_path / ".ckpt.pt.rank0-deadbeef.tmp-999999").write_bytes(b"half a file")
    save_checkpoint(path, opt, model=model, exact_resume=True)
    assert not list(tmp_path.glob(".*tmp*")), "stale temporary files of killed writers are removed"


def test_a_plain_torch_file_is_not_taken_for_a_checkpoint(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    _, opt = _local()
    with pytest.raises(ValueError, match="is not a onebit checkpoint file"):
        load_checkpoint(tmp_path / "other.pt", opt)


def _resume_rank(rank, world_size, path, mode):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="gloo")
    if mode == "straight":
        _train(model, opt, rank, range(1, 9))
    elif mode == "save":
        _train(model, opt, rank, range(1, 5))
        save_checkpoint(path, opt, model=model, exact_resume=True)
        return None
    else:
        load_checkpoint(path, opt, model=model, exact_resume=True)
        _train(model, opt, rank, range(5, 9))
    return {"params": [p.detach().clone() for p in model.parameters()], "errors": opt.comm_stats()["worker_error_norm"]}


@pytest.mark.slow
def test_exact_resume_on_the_same_world_size_is_bit_identical(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    straight = run_ranks(_resume_rank, 2, tmp_path / "a", path, "straight")
    run_ranks(_resume_rank, 2, tmp_path / "b", path, "save")
    resumed = run_ranks(_resume_rank, 2, tmp_path / "c", path, "load")
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(straight[r]["params"], resumed[r]["params"]))


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, loaded_on", [(3, 2), (2, 3)])
def test_resume_on_another_world_size_falls_back_to_the_reset(tmp_path, saved_on, loaded_on):
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_resume_rank, saved_on, tmp_path / "save", path, "save")
    resumed = run_ranks(_resume_rank, loaded_on, tmp_path / "load", path, "load")
    for r in range(loaded_on):
        assert all(torch.equal(a, b) for a, b in zip(resumed[r]["params"], resumed[0]["params"]))
        assert all(torch.isfinite(p).all() for p in resumed[r]["params"])


def test_fallback_is_logged_once(tmp_path, caplog):
    model, opt = _local()
    _train(model, opt, 0, range(3))
    save_checkpoint(tmp_path / "ckpt.pt", opt, model=model)  # no rank files
    with caplog.at_level(logging.INFO, logger="onebit"):
        load_checkpoint(tmp_path / "ckpt.pt", opt, model=model, exact_resume=True)
    assert sum("exact resume not possible" in r.message for r in caplog.records) == 1
    assert onebit.__version__


def test_exact_resume_logs_restored_not_reset(tmp_path, caplog):
    model, opt = _local()
    _train(model, opt, 0, range(4))
    save_checkpoint(tmp_path / "ckpt.pt", opt, model=model, exact_resume=True)
    model2, opt2 = _local()
    with caplog.at_level(logging.INFO, logger="onebit"):
        load_checkpoint(tmp_path / "ckpt.pt", opt2, model=model2, exact_resume=True)
        _train(model2, opt2, 0, range(4, 5))
    messages = [r.message for r in caplog.records]
    assert sum("compression errors restored (exact resume)" in m for m in messages) == 1
    assert not any("errors reset" in m for m in messages)
    assert any("resuming with 1-bit compressed momentum" in m for m in messages)
    assert not any("switching to" in m for m in messages)
    assert opt2.comm_stats()["worker_error_norm"] > 0
