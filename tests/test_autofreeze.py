"""freeze_step='auto' (onebit.autofreeze): the decision, its equivalence with a fixed freeze_step,
checkpoints, bounds and bad input, on one process; on 2 gloo ranks, the same decision on every
rank without a collective of its own."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from conftest import all_equal, clone_params, tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam, OnebitLamb, autofreeze, from_config

CLASSES = [OnebitAdam, OnebitLamb]


def _model(seed: int = 0) -> torch.nn.Module:
    return tiny_mlp(8, 32, 1, seed=seed)


def _data(t: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(32, 8, generator=gen)
    return x, x[:, :2].sum(dim=1, keepdim=True).sin()


def _train(model, opt, steps: range, rank: int = 0) -> None:
    for t in steps:
        x, y = _data(t, rank)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _make(cls, model, **kwargs):
    lr = 1e-3 if cls is OnebitAdam else 1e-2
    return cls(model.parameters(), lr=lr, comm_backend_name="local", **kwargs)


@pytest.mark.parametrize("cls", CLASSES)
def test_auto_decides_from_the_data_and_equals_that_fixed_freeze_step(cls, caplog):
    model = _model()
    with caplog.at_level(logging.INFO, logger="onebit"):
        opt = _make(cls, model, freeze_step="auto")
        _train(model, opt, range(1, 301))
    chosen = opt.freeze_step
    assert chosen is not None and autofreeze.MIN_STEPS <= chosen < 300 and (chosen - 1) % autofreeze.WINDOW == 0
    lines = [r.getMessage() for r in caplog.records if "freeze_step='auto'" in r.getMessage()]
    assert len(lines) == 1 and f"step {chosen}: freeze_step='auto' makes this the last warmup step" in lines[0]
    # the oracle: the same run with that step fixed in advance, bit for bit
    fixed_model = _model()
    fixed = _make(cls, fixed_model, freeze_step=chosen)
    _train(fixed_model, fixed, range(1, 301))
    assert all_equal(clone_params(model.parameters()), clone_params(fixed_model.parameters()))
    assert opt.comm_stats()["warmup"]["steps"] == chosen


def test_the_plan_is_warmup_until_decided_and_compression_after_the_latest_bound():
    opt = _make(OnebitAdam, _model(), freeze_step="auto", freeze_bounds=(20, 50))
    assert [opt.plan_for(t).name for t in (1, 50, 51)] == ["warmup", "warmup", "compression"]
    model = _model()
    never = _make(OnebitAdam, model, freeze_step="auto", freeze_bounds=(10**6, None))
    _train(model, never, range(1, 41))
    assert never.freeze_step is None and never.next_plan.name == "warmup"


def test_the_latest_bound_freezes_when_the_criterion_does_not(monkeypatch):
    monkeypatch.setattr(autofreeze, "CHANGE_TO_FREEZE", -1.0)  # never settled
    model = _model()
    opt = _make(OnebitAdam, model, freeze_step="auto", freeze_bounds=(20, 35))
    _train(model, opt, range(1, 41))
    assert opt.freeze_step == 35 and opt.comm_stats()["compression"]["steps"] == 5


@pytest.mark.parametrize("cls", CLASSES)
def test_a_checkpoint_before_the_decision_resumes_to_the_same_decision_bit_for_bit(cls):
    model = _model()
    opt = _make(cls, model, freeze_step="auto")
    _train(model, opt, range(1, 26))  # past a check (its comparison is in the state dict), before any freeze
    assert opt.freeze_step is None
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["onebit"]["freeze_step"] == "auto"
    assert saved["param_groups"][0]["onebit"]["auto_freeze"]["previous"] is not None
    resumed_model = copy.deepcopy(model)
    resumed = _make(cls, resumed_model, freeze_step=7)  # the checkpoint's schedule wins
    resumed.load_state_dict(saved)
    _train(model, opt, range(26, 301))
    _train(resumed_model, resumed, range(26, 301))
    assert resumed.freeze_step == opt.freeze_step is not None
    # during warmup nothing is compressed: the load reset no compression error that mattered
    assert all_equal(clone_params(model.parameters()), clone_params(resumed_model.parameters()))


def test_a_skipped_step_does_not_count_as_a_window(monkeypatch):
    """A step skipped for non-finite gradients leaves the step count, so the next call is the same
    step again: its check must not compare the variance with itself (a 0% change) and freeze."""
    monkeypatch.setattr(autofreeze, "CHANGE_TO_FREEZE", 1e-12)  # only a variance that did not move at all
    model = _model()
    opt = _make(OnebitAdam, model, freeze_step="auto")
    _train(model, opt, range(1, 31))
    for _ in range(3):  # step 31 skipped three times: NaN gradients
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan"))
        opt.step()
    assert opt.step_count == 30 and opt.freeze_step is None
    _train(model, opt, range(31, 61))
    assert opt.freeze_step is None


def _decide(totals, corrected, previous=None, zeros=0.0, min_steps=20):
    """Run the checks at steps 11, 21, ... over given totals: the step chosen, or None."""
    auto = autofreeze.AutoFreeze(min_steps=min_steps)
    auto.previous = previous
    for k, (total, fixed) in enumerate(zip(totals, corrected), start=1):
        done = k * autofreeze.WINDOW
        if auto.check(done + 1, done, lambda: (total, zeros, 1000, fixed)) is not None:
            return done + 1
    return None


def test_growth_that_is_only_an_uncorrected_variance_filling_up_does_not_hold_the_freeze_back():
    """Without bias correction ``sqrt(v)`` grows while its average fills up from 0, with
    gradients of a steady size: the growth test looks at the bias-corrected total, so a frozen
    total growing 1.5% per window with a steady corrected one freezes at the first check it can;
    gradients that grow (the corrected total growing 1.5% too) do not freeze."""
    filling = [100.0 * 1.015 ** k for k in range(6)]
    assert _decide(filling, [50.0] * 6) == 21
    assert _decide(filling, [50.0 * 1.015 ** k for k in range(6)]) is None
    assert _decide(filling, [50.0] * 6, zeros=5.0) == 21  # zeros that stay put: nothing woke up
    # more than 2% per window of the total actually frozen is not settled, whatever the cause
    assert _decide([100.0 * 1.03 ** k for k in range(6)], [50.0] * 6) is None
    # a state saved before the corrected total was kept (two numbers): the frozen total's growth
    # judges the first comparison (the stricter test), the corrected one the next
    old = autofreeze.AutoFreeze.from_state({"min_steps": 1, "max_steps": None, "checked": 0, "previous": [100.0, 0.0]})
    assert old.previous == (100.0, 0.0, None)
    assert autofreeze.AutoFreeze.from_state(old.state()).previous == (100.0, 0.0, None)
    assert _decide(filling[1:], [50.0] * 5, previous=old.previous, min_steps=1) == 21
    assert _decide(filling[1:], [50.0] * 5, previous=(100.0, 0.0, 50.0), min_steps=1) == 11


@pytest.mark.parametrize("bias_correction", [False, True])
def test_measure_gives_the_frozen_and_the_bias_corrected_totals(bias_correction):
    model = _model()
    opt = _make(OnebitAdam, model, freeze_step="auto", bias_correction=bias_correction, betas=(0.9, 0.99))
    _train(model, opt, range(1, 16))
    total, zeros, count, corrected = autofreeze.measure(opt._buckets, opt.param_groups, 15)
    root = sum(float(b.buffers["exp_avg_sq"].sqrt().sum()) for b in opt._buckets)
    bc2 = 1 - 0.99 ** 15
    assert corrected == pytest.approx(root / bc2 ** 0.5, rel=1e-6)
    assert total == pytest.approx(corrected if bias_correction else root, rel=1e-6)
    assert count == sum(p.numel() for p in model.parameters()) and zeros == 0


def test_bad_input_is_refused_with_the_fix():
    params = _model().parameters
    with pytest.raises(ValueError, match="freeze_bounds=\\(1, 5\\) applies only to freeze_step='auto'"):
        OnebitAdam(params(), freeze_step=10, freeze_bounds=(1, 5), comm_backend_name="local")
    with pytest.raises(ValueError, match="invalid freeze_step 'automatic': give an int >= 1 or 'auto'"):
        OnebitAdam(params(), freeze_step="automatic", comm_backend_name="local")
    with pytest.raises(ValueError, match="latest automatic freeze must be None or an int >= the earliest \\(30\\)"):
        OnebitAdam(params(), freeze_step="auto", freeze_bounds=(30, 10), comm_backend_name="local")
    with pytest.raises(ValueError, match="freeze_bounds must be \\(earliest, latest\\)"):
        OnebitLamb(params(), freeze_step="auto", freeze_bounds=30, comm_backend_name="local")


def test_a_config_accepts_auto():
    opt = from_config(_model().parameters(), {"optimizer": {"type": "OneBitAdam", "params": {
        "lr": 1e-3, "freeze_step": "auto", "freeze_bounds": [20, 200], "comm_backend_name": "local"}}})
    assert opt.freeze_step is None and opt.plan_for(201).name == "compression"


def _two_ranks(rank: int, world: int) -> dict:
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step="auto")
    fixed_model = _model()
    fixed = OnebitAdam(fixed_model.parameters(), lr=1e-3, freeze_step=10**6)
    collectives = []
    for t in range(1, 201):
        for m, o in ((model, opt), (fixed_model, fixed)):
            x, y = _data(t, rank)
            o.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        if opt.freeze_step is None or t <= opt.freeze_step:  # both in warmup: the same collectives
            collectives.append((opt.comm_stats()["last_step"]["collectives"], fixed.comm_stats()["last_step"]["collectives"]))
    return {"chosen": opt.freeze_step, "collectives": collectives}


@pytest.mark.slow
def test_every_rank_decides_the_same_step_with_no_collective_of_its_own(tmp_path):
    results = run_ranks(_two_ranks, 2, tmp_path, timeout=120)
    assert results[0]["chosen"] == results[1]["chosen"] is not None
    for r in results:
        assert r["collectives"] and all(a == b for a, b in r["collectives"])
