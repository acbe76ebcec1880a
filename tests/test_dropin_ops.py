"""Switching an existing job to onebit (issue 44, rows 4, 5, 6, 11, 12, 13, 14): a DeepSpeed config's
problems in one error, the same comm_stats() keys for every optimizer, the automatic freeze saying
what it waits for, checkpoints that resume as the README says, DDP's bytes counted, nanoGPT-style
gradient accumulation under attach_ddp with overlap, and collective calls made on rank 0 only."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import onebit
from conftest import all_equal, clone_params, short_schedules, tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam, OnebitDiLoCo, OnebitLamb, ZeroOneAdam, autofreeze, from_config
from onebit.compression import allreduce_wire_bytes
from onebit.config import ConfigError
from onebit.integrations import attach_ddp

ROOT = Path(__file__).resolve().parents[1]


def _batch(t: int, rank: int = 0, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(n, 6, generator=gen)
    return x, x[:, :2].sum(dim=1, keepdim=True).sin().expand(n, 3).contiguous()


def _train(model, opt, steps, rank: int = 0) -> None:
    for t in steps:
        x, y = _batch(t, rank)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


# ----------------------------------------------------------------------------- row 4: configs

# DeepSpeed's 1-bit LAMB config as a user brings it: three problems in the optimizer section.
_LAMB_CONFIG = {
    "train_batch_size": 64,
    "fp16": {"enabled": True, "loss_scale": 0},
    "gradient_clipping": 1.0,
    "optimizer": {"type": "OneBitLamb", "params": {
        "lr": "1e-3", "max_grad_norm": 1.0, "bias_correction": False, "freeze_step": 10, "cuda_aware": False,
        "coeff_beta": 0.9}},
}


def test_every_problem_of_a_config_is_in_one_error():
    with pytest.raises(ConfigError) as info:
        from_config(tiny_mlp(6, 8, 3).parameters(), _LAMB_CONFIG)
    message = str(info.value)
    assert message.startswith("3 problems in optimizer.params of OneBitLamb:")
    assert "optimizer.params.lr must be a number, got '1e-3'" in message
    assert "optimizer.params.max_grad_norm is not supported by OneBitLamb" in message
    assert "optimizer.params.bias_correction is not supported by OneBitLamb" in message
    # one exception a caller can catch as either kind the single problems raise
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


def test_a_single_problem_raises_its_own_exception():
    config = {"optimizer": {"type": "OneBitAdam", "params": {"lr": "0.001", "freeze_step": 5}}}
    with pytest.raises(TypeError, match=r"optimizer.params.lr must be a number") as info:
        from_config(tiny_mlp(6, 8, 3).parameters(), config)
    assert not isinstance(info.value, ConfigError)


def test_sections_a_plain_loop_must_apply_are_named_in_a_warning_saying_what_to_do(caplog):
    config = {**_LAMB_CONFIG, "bf16": {"enabled": False}, "steps_per_print": 10,
              "optimizer": {"type": "OneBitLamb",
                            "params": {"lr": 1e-3, "freeze_step": 10, "comm_backend_name": "local"}}}
    with caplog.at_level(logging.INFO, logger="onebit.config"):
        from_config(tiny_mlp(6, 8, 3).parameters(), config)
    records = [r for r in caplog.records if r.name == "onebit.config"]
    assert [r.levelno for r in records] == [logging.WARNING]
    message = records[0].getMessage()
    assert "'fp16': fp16 loss scaling: use torch.autocast" in message and "GradScaler" in message
    assert "'gradient_clipping': clipping: call torch.nn.utils.clip_grad_norm_" in message
    assert "'bf16'" not in message.split("(not read either")[0]  # disabled: nothing to do
    assert "not read either: bf16, steps_per_print, train_batch_size" in message


def test_sections_with_nothing_to_apply_stay_an_info_line(caplog):
    config = {"train_batch_size": 64, "fp16": {"enabled": False}, "gradient_clipping": 0.0,
              "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10, "comm_backend_name": "local"}}}
    with caplog.at_level(logging.INFO, logger="onebit.config"):
        from_config(tiny_mlp(6, 8, 3).parameters(), config)
    assert [r.levelno for r in caplog.records if r.name == "onebit.config"] == [logging.INFO]


# ----------------------------------------------------------------------------- row 5: comm_stats keys

_EVERY_PLAN = {"warmup", "compression", "variance", "compressed_gradient", "local", "sync", "inner", "outer"}
_COMMON = {"backend", "world_size", "phase", "step", "buckets", "total", "last_step", "worker_error_norm",
           "server_error_norm", "skipped_in_a_row", "error_to_momentum", "update_to_lr"}


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb, ZeroOneAdam, OnebitDiLoCo], ids=lambda c: c.__name__)
def test_comm_stats_has_every_plan_of_every_optimizer_and_a_total(cls):
    model = tiny_mlp(6, 8, 3)
    opt = cls(model.parameters(), lr=1e-3, comm_backend_name="local", **short_schedules()[cls])
    _train(model, opt, range(1, 9))
    stats = opt.comm_stats()
    assert _EVERY_PLAN | _COMMON <= set(stats) <= _EVERY_PLAN | _COMMON | {"max_factor"}  # (LAMB's own extra)
    assert set(opt.stats_plan_names()) == _EVERY_PLAN
    used = set(cls.PLAN_NAMES)
    for name in _EVERY_PLAN - used:  # plans this optimizer never runs: zero
        assert stats[name] == stats["total"] | {k: 0 for k in stats["total"]}
    # the total is the sum over the plans, and counts every step
    for key, value in stats["total"].items():
        assert value == pytest.approx(sum(stats[name][key] for name in used))
    assert stats["total"]["steps"] == 8 and sum(stats[name]["steps"] for name in used) == 8
    assert stats["compression"]["bytes_sent"] >= 0  # the README's key, for every optimizer


# ----------------------------------------------------------------------------- row 6: the automatic freeze


def test_the_automatic_freeze_says_what_each_check_measured_and_why_it_waits(caplog, monkeypatch):
    monkeypatch.setattr(autofreeze, "CHANGE_TO_FREEZE", -1.0)  # never settled: it waits at every check
    model = tiny_mlp(6, 8, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-3, comm_backend_name="local", freeze_step="auto",
                     freeze_bounds=(20, 45))
    with caplog.at_level(logging.INFO, logger="onebit"):
        _train(model, opt, range(1, 51))
    waits = [r.getMessage() for r in caplog.records if "the automatic freeze waits" in r.getMessage()]
    # checks at the start of steps 11, 21, 31, 41: one INFO line each
    assert [int(re.match(r"onebit: step (\d+):", m).group(1)) for m in waits] == [11, 21, 31, 41]
    assert "first check, with nothing to compare with yet" in waits[0]
    assert re.search(r"over steps 11-20 the frozen denominator changed by [+-]\d+\.\d+% \(bias-corrected: "
                     r"[+-]\d+\.\d+%\) and \d+ coordinates left a zero variance; waiting because", waits[1])
    assert "step 21 is before the earliest bound" not in waits[1] and "the denominator changed more than" in waits[1]
    assert "latest bound: step 45" in waits[1]
    bound = [r for r in caplog.records if r.levelno == logging.WARNING and "latest bound" in r.getMessage()]
    assert len(bound) == 1 and "step 45: the automatic freeze reached its latest bound (45)" in bound[0].getMessage()
    assert "over steps 31-40" in bound[0].getMessage()  # what it last measured
    assert opt.freeze_step == 45


def test_the_automatic_freeze_that_decides_warns_nothing(caplog):
    model = tiny_mlp(6, 8, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-3, comm_backend_name="local", freeze_step="auto")
    with caplog.at_level(logging.INFO, logger="onebit"):
        _train(model, opt, range(1, 301))
    assert opt.freeze_step is not None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    waits = [r for r in caplog.records if "the automatic freeze waits" in r.getMessage()]
    assert len(waits) == (opt.freeze_step - 1) // autofreeze.WINDOW - 1  # every check but the deciding one


# ----------------------------------------------------------------------------- row 11: README's checkpoints


def _readme_checkpoint_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Checkpoints", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_checkpoint_example_keeps_the_errors_it_says_it_keeps(tmp_path, monkeypatch):
    code = _readme_checkpoint_block()
    assert "exact_resume=True" in code.split("load_checkpoint", 1)[1]
    model = tiny_mlp(6, 8, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, comm_backend_name="local")
    _train(model, opt, range(1, 6))
    saved = [(w.clone(), s.clone()) for w, s in opt.compression_errors()]
    assert any(w.abs().sum() > 0 for w, _ in saved)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"opt": opt, "model": model})  # saves, then loads into opt
    # the same world size, layout and step: the errors are kept, as the README's text says
    assert all(torch.equal(w, w0) and torch.equal(s, s0) for (w, s), (w0, s0) in zip(opt.compression_errors(), saved))


def test_a_load_that_drops_what_an_exact_save_saved_says_so(tmp_path, caplog):
    model = tiny_mlp(6, 8, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, comm_backend_name="local")
    _train(model, opt, range(1, 6))
    onebit.save_checkpoint(tmp_path / "run.ckpt", opt, model=model, exact_resume=True)
    onebit.save_checkpoint(tmp_path / "plain.ckpt", opt, model=model)
    with caplog.at_level(logging.INFO, logger="onebit"):
        onebit.load_checkpoint(tmp_path / "plain.ckpt", opt, model=model)  # nothing exact to drop: no warning
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        onebit.load_checkpoint(tmp_path / "run.ckpt", opt, model=model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "was saved with exact_resume=True and is loaded without it" in warnings[0]
    assert "Pass exact_resume=True to load_checkpoint" in warnings[0]
    assert all(float(w.abs().sum()) == 0 for w, _ in opt.compression_errors())  # what the warning says


# ----------------------------------------------------------------------------- rows 12, 13: DDP

FREEZE, STEPS, MICRO = 3, 7, 2


def _ddp_loop(rank, world_size, overlap, flag_by_hand):
    """nanoGPT's loop: DDP, ``attach_ddp``, two micro-batches per step with DDP's sync flag set by
    hand before each forward (or ``no_sync()``), and clipping where it keeps overlap (on the steps
    whose gradients DDP averages)."""
    model = tiny_mlp(6, 16, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, comm_backend_name="gloo",
                     overlap_backward=overlap, bucket_size=64)
    net = DDP(model)
    attach_ddp(net, opt)
    synced, flags, per_step = [], [], []
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            x, y = _batch(10 * t + micro, rank)
            if flag_by_hand:
                net.require_backward_grad_sync = micro == MICRO - 1  # as nanoGPT's train.py does
                (torch.nn.functional.mse_loss(net(x), y) / MICRO).backward()
            elif micro < MICRO - 1:
                with net.no_sync():
                    (torch.nn.functional.mse_loss(net(x), y) / MICRO).backward()
            else:
                (torch.nn.functional.mse_loss(net(x), y) / MICRO).backward()
        synced.append(net.require_forward_param_sync)  # whether DDP synchronized this step's last backward
        if opt.next_plan.average_gradients:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        flags.append(net.require_backward_grad_sync)
        per_step.append(opt.comm_stats()["last_step"])
    return {"params": clone_params(model.parameters()), "stats": opt.comm_stats(), "redone": opt.overlap_redone,
            "synced": synced, "flags": flags, "per_step": per_step,
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    return {(overlap, by_hand): run_ranks(_ddp_loop, 2, root / f"{overlap}-{by_hand}", overlap, by_hand, timeout=180)
            for overlap, by_hand in ((False, True), (True, True), (True, False))}


@pytest.mark.slow
def test_comm_stats_under_attach_ddp_count_ddp_s_all_reduce(ddp_runs):
    run = ddp_runs[(False, True)][0]
    warmup, compression, total = (run["stats"][k] for k in ("warmup", "compression", "total"))
    # the oracle: DDP all-reduces every gradient byte once per warmup step, and nothing after
    ddp_bytes = allreduce_wire_bytes(run["grad_bytes"], 2)
    assert warmup["framework_bytes_sent"] == FREEZE * ddp_bytes
    assert compression["framework_bytes_sent"] == 0
    # + the optimizer's own few check bytes (measured: 8 in 3 warmup steps)
    assert warmup["framework_bytes_sent"] < warmup["bytes_sent"] < warmup["framework_bytes_sent"] + 64
    assert warmup["collectives"] > FREEZE  # DDP's one bucket a step, and the optimizer's own
    for t, step in enumerate(run["per_step"], 1):  # in each step's own statistics too
        assert step["framework_bytes_sent"] == (ddp_bytes if t <= FREEZE else 0)
    assert total["bytes_sent"] == warmup["bytes_sent"] + compression["bytes_sent"]
    # savings computed from comm_stats() are those of the wire: a compression step sends far less
    per_warmup = warmup["bytes_sent"] / FREEZE
    per_compression = compression["bytes_sent"] / (STEPS - FREEZE)
    assert per_warmup > ddp_bytes and per_compression < per_warmup / 2


@pytest.mark.slow
def test_attach_ddp_follows_ddp_s_sync_flag_however_it_is_set(ddp_runs):
    reference = ddp_runs[(False, True)]
    for key in ((True, True), (True, False)):
        runs = ddp_runs[key]
        for r in range(2):
            # the overlap did not redo any step: it started only on each step's last micro-batch
            assert runs[r]["redone"] is False, key
            # bit-identical to the run without overlap, on every rank
            assert all_equal(runs[r]["params"], reference[0]["params"])
            assert all_equal(reference[r]["params"], reference[0]["params"])
            # the same collectives as without overlap, the bytes but the agreement's 4 (nothing sent twice)
            for ours, theirs in zip(runs[r]["per_step"][FREEZE:], reference[r]["per_step"][FREEZE:]):
                assert ours["collectives"] == theirs["collectives"], key
                assert ours["bytes_sent"] == theirs["bytes_sent"] + 4, key
    for key, runs in ddp_runs.items():
        # DDP synchronized the warmup steps only; the user's flag is left as the user set it
        assert runs[0]["synced"] == [t <= FREEZE for t in range(1, STEPS + 1)], key
        assert runs[0]["flags"] == [True] * STEPS, key


# ----------------------------------------------------------------------------- row 14: rank 0 only


def _rank0_only(rank, world_size, path):
    model = tiny_mlp(6, 8, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="gloo")
    _train(model, opt, range(1, 5), rank)
    out = {}
    if rank == 0:  # nanoGPT's pattern, with the README's exact_resume: the other rank never comes
        try:
            onebit.save_checkpoint(path / "exact.ckpt", opt, model=model, exact_resume=True, timeout_s=2)
        except RuntimeError as exc:
            out["error"] = str(exc)
        onebit.save_checkpoint(path / "plain.ckpt", opt, model=model)  # no collective: rank 0 alone is fine
    torch.distributed.barrier()
    onebit.load_checkpoint(path / "plain.ckpt", opt, model=model)
    # every rank; it returns once rank 0 committed, so a load right after it finds the checkpoint
    onebit.save_checkpoint(path / "both.ckpt", opt, model=model, exact_resume=True, timeout_s=30)
    onebit.load_checkpoint(path / "both.ckpt", opt, model=model, exact_resume=True, timeout_s=30)
    out["params"] = clone_params(model.parameters())
    return out


@pytest.mark.slow
def test_a_collective_checkpoint_call_on_rank_0_only_fails_naming_the_rule(tmp_path):
    results = run_ranks(_rank0_only, 2, tmp_path, tmp_path, timeout=90)
    error = results[0]["error"]
    assert "onebit.save_checkpoint(exact_resume=True): rank 0 waited 2 s for ranks [1]" in error
    assert "call it on every rank" in error and "not under `if rank == 0:`" in error
    assert not (tmp_path / "exact.ckpt").exists()  # nothing committed
    assert all_equal(results[0]["params"], results[1]["params"])


def _failed_commit(rank, world_size, path):
    """Rank 0 cannot write the manifest (the disk filled up, say): every rank raises, none
    returns as if the checkpoint were saved."""
    import onebit.checkpoint as checkpoint

    model = tiny_mlp(6, 8, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="gloo")
    _train(model, opt, range(1, 5), rank)
    write = checkpoint._atomic_write

    def no_manifest(data, target):
        if Path(target).name == "exact.ckpt":
            raise OSError(28, "No space left on device")
        write(data, target)

    checkpoint._atomic_write = no_manifest
    try:
        onebit.save_checkpoint(path / "exact.ckpt", opt, model=model, exact_resume=True, timeout_s=30)
    except (OSError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        checkpoint._atomic_write = write
    return {"error": None}


@pytest.mark.slow
def test_an_exact_save_that_rank_0_cannot_commit_raises_on_every_rank(tmp_path):
    results = run_ranks(_failed_commit, 2, tmp_path, tmp_path, timeout=90)
    assert results[0]["error"] == "OSError: [Errno 28] No space left on device"
    assert results[1]["error"].startswith("RuntimeError: save_checkpoint: rank 0 could not commit the checkpoint at")
    assert not (tmp_path / "exact.ckpt").exists()


def test_the_handshake_timeout_is_checked():
    model = tiny_mlp(6, 8, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="local")
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds > 0, got 0"):
        onebit.save_checkpoint("unused.ckpt", opt, exact_resume=True, timeout_s=0)


def _zero_one_under_ddp(rank, world_size):
    model = tiny_mlp(6, 8, 3)
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, comm_backend_name="gloo", **short_schedules()[ZeroOneAdam])
    net = DDP(model)
    attach_ddp(net, opt)
    _train(net, opt, range(1, 9), rank)  # ends on a local step: the replicas differ
    before = (opt.replicas_identical, clone_params(model.parameters()))
    opt.synchronize()  # what the guides say to call, on every rank, before rank 0 saves or evaluates alone
    return {"before": before, "after": (opt.replicas_identical, clone_params(model.parameters()))}


@pytest.mark.slow
def test_zero_one_adam_under_attach_ddp_needs_synchronize_as_the_guides_say(tmp_path):
    results = run_ranks(_zero_one_under_ddp, 2, tmp_path, timeout=90)
    assert results[0]["before"][0] is False and not all_equal(results[0]["before"][1], results[1]["before"][1])
    assert results[0]["after"][0] is True and all_equal(results[0]["after"][1], results[1]["after"][1])
    guides = {name: (ROOT / "docs" / "guides" / name).read_text(encoding="utf-8") for name in ("ddp.md", "training-loop.md")}
    assert all("synchronize()" in text for text in guides.values())
