"""torch.optim's conventions, for every optimizer of the family (issue 24).

Parametrized over :data:`OPTIMIZERS`, in the manner of torch's ``TestOptimRenewed`` over its
``OptimizerInfo``s: the cases are built from one table, ``conftest.short_schedules()``, and an
optimizer class registered (by its ``CONFIG_TYPE``) but missing from that table fails
``test_every_registered_optimizer_is_in_the_table``; added there, it gets every check. Each case
takes its short schedule, so that a few steps run through every plan the algorithm has (1-bit Adam
and LAMB: warmup, compression; 0/1 Adam: variance, compressed_gradient, local, sync), on one
process (the ``local`` transport runs the whole compressed all-reduce with its error feedback).
"""

from __future__ import annotations

import copy
import inspect
import logging
import pickle
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from conftest import all_equal, clone_params, released_buffers, short_schedules, tiny_mlp
from onebit import OnebitAdam, OnebitDiLoCo, OnebitOptimizer
from onebit.validation import TORCH_FLAGS


@dataclass
class Case:
    cls: type
    schedule: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        space = self.extra.get("compression_space") or self.extra.get("compression")
        auto = "-auto" if self.schedule.get("freeze_step") == "auto" else ""
        overlap = "-overlap" if self.extra.get("overlap_backward") else ""
        bound = "-bound" if self.extra.get("update_bound") else ""
        inner = f"-inner{self.extra['inner'].__name__}" if self.extra.get("inner") else ""
        delay = "-delay" if self.schedule.get("sync_delay") else ""
        errors = "-bf16errors" if self.extra.get("error_dtype") else ""
        errors += "-bf16preconditioner" if self.extra.get("preconditioner_dtype") else ""
        return self.cls.__name__ + (f"-{space}" if space else "") + auto + overlap + bound + inner + delay + errors

    def make(self, params, lr: float = 1e-2, **kwargs):
        return self.cls(params, lr=lr, comm_backend_name="local", **{**self.schedule, **self.extra, **kwargs})


def _cases(cls: type, schedule: dict[str, Any]) -> list[Case]:
    """Every case of one optimizer: its short schedule, in each compression space, with
    ``overlap_backward``; 1-bit Adam and LAMB also with ``freeze_step='auto'`` and with an
    ``update_bound`` (0/1 Adam bounds its steps by default)."""
    base = dict(weight_decay=0.01)
    if cls is OnebitDiLoCo:  # no compression spaces, no overlap (its inner steps send nothing): 1 bit or none
        # (and with inner=: a torch optimizer takes the inner steps, its state its own; and with
        # sync_delay: each outer step's exchange lands at the next step, with the progress made meanwhile)
        return [Case(cls, schedule, base), Case(cls, schedule, {**base, "compression": "none"}),
                Case(cls, schedule, {**base, "inner": torch.optim.AdamW}),
                Case(cls, {**schedule, "sync_delay": 1}, base),
                Case(cls, {**schedule, "sync_delay": 1}, {**base, "error_dtype": torch.bfloat16})]
    cases = [Case(cls, schedule, base), Case(cls, schedule, {**base, "compression_space": "preconditioned"})]
    if "freeze_step" in schedule:
        # freeze_step='auto' whose latest bound makes it freeze when the schedule does
        cases.append(Case(cls, dict(freeze_step="auto", freeze_bounds=(1, schedule["freeze_step"])), base))
        # update_bound: m / d clamped before the 1-bit all-reduce (in the codec's worker pass)
        cases.append(Case(cls, schedule, {**base, "update_bound": 0.5}))
        # the frozen preconditioner 1 / d alone, in bfloat16 (and the errors in bfloat16), in each space
        compact = {"preconditioner_dtype": torch.bfloat16, "error_dtype": torch.bfloat16}
        cases.append(Case(cls, schedule, {**base, **compact}))
        cases.append(Case(cls, schedule, {**base, **compact, "compression_space": "momentum"}))
    # overlap_backward: the communication starts from gradient hooks during backward
    cases.append(Case(cls, schedule, {**base, "overlap_backward": True}))
    # error_dtype: the compression errors held in bfloat16 (staged ones too, with the overlap)
    cases.append(Case(cls, schedule, {**base, "overlap_backward": True, "error_dtype": torch.bfloat16}))
    return cases


def guide_optimizer() -> type:
    """The smallest complete optimizer of ``docs/guides/extending.md``, taken from the page itself
    (its first python block), so that the guide's example passes this suite as written."""
    from test_docs import ROOT, python_blocks

    page = ROOT / "docs" / "guides" / "extending.md"
    line, code, _ = python_blocks(page)[0]
    module = types.ModuleType("extending_guide")  # importable by name: copies pickle the class
    exec(compile("\n" * (line - 1) + code, str(page), "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    return module.OnebitMomentumSGD


SCHEDULES = short_schedules()
OPTIMIZERS = ([case for cls, schedule in SCHEDULES.items() for case in _cases(cls, schedule)]
              + [Case(guide_optimizer(), {}, dict(weight_decay=0.01))])
STEPS = 12


@pytest.fixture(params=OPTIMIZERS, ids=repr)
def case(request) -> Case:
    return request.param


def _model(seed: int = 0) -> torch.nn.Module:
    return tiny_mlp(6, 16, 3, seed=seed)


def _grads(model: torch.nn.Module, t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _entries(opt, p) -> dict[str, Any]:
    """The state of ``p`` as the optimizer keeps it: its own entries and, with OnebitDiLoCo's
    ``inner=``, the inner optimizer's, named ``"inner:<name>"`` as its state dict saves them."""
    entries = dict(opt.state[p])
    inner = getattr(opt, "inner_optimizer", None)
    if inner is not None:
        entries.update({"inner:" + k: v for k, v in inner.state.get(p, {}).items()})
    return entries


def _momentum(entries: dict[str, Any]) -> torch.Tensor | None:
    """The momentum among a parameter's state entries (its own, or an inner optimizer's)."""
    return entries.get("exp_avg", entries.get("inner:exp_avg"))


def _state_copy(opt, p) -> dict[str, Any]:
    """The state of ``p``, less the scalars that advance with the step on every rank whatever the
    gradients (0/1 Adam's sum of learning rates since the last sync)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in _entries(opt, p).items()
            if k not in opt.STATE.shared_scalars}


def _same_state(after: dict[str, Any], before: dict[str, Any], released: frozenset[str] = frozenset()) -> bool:
    """Every entry of ``before`` unchanged in ``after`` (which may hold the buffers of a phase that
    began, e.g. 0/1 Adam's accumulator), but for the ``released`` ones, which a phase that began may
    hold in another form (1-bit Adam's frozen variance with a bfloat16 preconditioner: that what it
    holds instead is the same ``1 / d`` is checked in ``test_released_variance.py``)."""
    kept = {k: v for k, v in before.items() if k not in released or k in after}
    return kept.keys() <= after.keys() and all(
        torch.equal(after[k], v) if isinstance(v, torch.Tensor) else after[k] == v for k, v in kept.items())


def _unlisted() -> list[str]:
    """The config names of the registered optimizer classes that the table leaves out."""
    return [name for name, cls in OnebitOptimizer.registered().items() if cls not in SCHEDULES]


def test_every_registered_optimizer_is_in_the_table():
    assert _unlisted() == [], "add it to conftest.short_schedules(), and every contract check runs on it"


def test_an_optimizer_left_out_of_the_table_is_named(fresh_optimizer_registry):
    class ToyAdam(OnebitAdam):
        CONFIG_TYPE = "ToyAdam"

    assert _unlisted() == ["ToyAdam"]


def test_the_schedules_run_through_every_plan(case):
    opt = case.make(_model().parameters())
    assert {opt.plan_for(t).name for t in range(1, STEPS + 1)} == set(case.cls.PLAN_NAMES)


# ----------------------------------------------------------------------------- gradients that are None


def test_a_parameter_without_gradient_is_left_alone_with_its_state(case):
    """A layer frozen after step 1 (its gradients None) stays put, parameter and state, on every
    plan, as in torch.optim; the other layer trains exactly as it would alone (each tensor has its
    own compression scales, so nothing of the frozen one leaks into it)."""
    model = _model()
    frozen, live = list(model[0].parameters()), list(model[2].parameters())
    opt = case.make(model.parameters())
    alone_model = _model()
    alone = case.make(alone_model[2].parameters())
    plans = set()
    for t in range(1, STEPS + 1):
        _grads(model, t)
        _grads(alone_model, t)
        if t > 1:
            for p in frozen:
                p.grad = None
            before = clone_params(frozen), [_state_copy(opt, p) for p in frozen]
        plans.add(opt.next_plan.name)
        opt.step()
        alone.step()
        if t == 1:  # from now on both models have the same (frozen) first layer
            alone_model[0].load_state_dict(model[0].state_dict())
        if t > 1:
            assert all_equal(clone_params(frozen), before[0]), (t, opt.plan_for(t).name)
            assert all(_same_state(_state_copy(opt, p), s, released_buffers(opt, p)) for p, s in zip(frozen, before[1])), t
        assert all_equal(clone_params(live), clone_params(alone_model[2].parameters())), t
    assert plans == set(case.cls.PLAN_NAMES)
    assert _momentum(_entries(opt, frozen[0])).abs().sum() > 0  # it had state to keep


def test_a_step_without_any_gradient_moves_nothing(case):
    model = _model()
    opt = case.make(model.parameters())
    for t in range(1, STEPS + 1):
        _grads(model, t)
        if t % 2 == 0:
            model.zero_grad(set_to_none=True)
            before = clone_params(model.parameters())
            opt.step()
            assert all_equal(clone_params(model.parameters()), before), (t, opt.plan_for(t).name)
        else:
            opt.step()


def test_a_layer_frozen_at_construction_trains_once_unfrozen(case, caplog):
    """Built over a frozen first layer (``requires_grad=False``), the optimizer trains it from the
    step it requires gradients, on every plan after that, while the other layer keeps its state."""
    model = _model()
    model[0].requires_grad_(False)
    opt = case.make(model.parameters())
    _train(model, opt, 1, 3)
    trained = _state_copy(opt, model[2].weight)
    model[0].requires_grad_(True)
    with caplog.at_level(logging.INFO, logger="onebit"):
        _grads(model, 3)
        weights = clone_params(model[2].parameters())
        opt.step()
    assert any("the trainable parameters changed (4 of 4 now)" in r.message for r in caplog.records)
    assert not all_equal(clone_params(model[2].parameters()), weights)
    assert _momentum(_entries(opt, model[0].weight)) is not None
    # (the variance, where the algorithm has one)
    kept = next(k for k in ("exp_avg_sq", "inner:exp_avg_sq", "exp_avg", "inner:exp_avg") if k in trained)
    assert _entries(opt, model[2].weight)[kept].abs().sum() >= trained[kept].abs().sum() * 0.5
    for t in range(4, STEPS + 1):
        _grads(model, t)
        before = clone_params(model[0].parameters())
        opt.step()
        assert not all_equal(clone_params(model[0].parameters()), before), (t, opt.plan_for(t).name)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_layer_frozen_and_unfrozen_keeps_its_state(case):
    model = _model()
    opt = case.make(model.parameters())
    _train(model, opt, 1, 4)
    kept = [_state_copy(opt, p) for p in model[0].parameters()]
    weights = clone_params(model[0].parameters())
    model[0].requires_grad_(False)
    _train(model, opt, 4, 6)
    assert all_equal(clone_params(model[0].parameters()), weights)
    assert all(_same_state(_state_copy(opt, p), s) for p, s in zip(model[0].parameters(), kept))
    assert _momentum(opt.state_dict()["state"][0]).shape == model[0].weight.shape  # saved while frozen
    model[0].requires_grad_(True)
    _grads(model, 6)
    assert all(_same_state(_state_copy(opt, p), s) for p, s in zip(model[0].parameters(), kept))
    opt.step()
    assert not all_equal(clone_params(model[0].parameters()), weights)


@pytest.mark.parametrize("how", ["restore", "deepcopy"])
def test_a_frozen_parameters_state_survives_a_load(case, how):
    """A layer frozen when the state is saved: an optimizer built with the layer frozen takes its
    saved state (an exact resume, or a copy) and, once it is unfrozen, continues as the run that
    never stopped (the state waiting for it was dropped on load before)."""
    def run(reload: bool) -> list[torch.Tensor]:
        model = _model()
        opt = case.make(model.parameters())
        _train(model, opt, 1, 4)
        model[0].requires_grad_(False)
        _train(model, opt, 4, 6)
        if reload and how == "deepcopy":
            model, opt = copy.deepcopy((model, opt))
        elif reload:
            twin = _model(seed=3)
            twin.load_state_dict(model.state_dict())
            twin[0].requires_grad_(False)
            fresh = case.make(twin.parameters())
            fresh.restore(opt.state_dict(), opt.compression_errors())
            model, opt = twin, fresh
        model[0].requires_grad_(True)
        _train(model, opt, 6, STEPS + 1)
        return clone_params(model.parameters())

    assert all_equal(run(True), run(False))


# ----------------------------------------------------------------------------- learning rate 0


def test_learning_rate_zero_moves_nothing_on_any_plan(case):
    model = _model()
    opt = case.make(model.parameters())
    for t in range(1, 3):
        _grads(model, t)
        opt.step()
    for group in opt.param_groups:
        group["lr"] = 0.0
    for t in range(3, STEPS + 4):
        _grads(model, t)
        before = clone_params(model.parameters())
        opt.step()
        assert all_equal(clone_params(model.parameters()), before), (t, opt.plan_for(t).name)


# ----------------------------------------------------------------------------- copies


def _train(model, opt, start: int, stop: int) -> None:
    for t in range(start, stop):
        _grads(model, t)
        opt.step()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("at", [2, 4, 7])
def test_a_copy_is_a_working_independent_optimizer(case, how, at):
    """``deepcopy((model, optimizer))`` and pickle give an optimizer that continues exactly as the
    original does, sharing no buffer with it."""
    model = _model()
    opt = case.make(model.parameters())
    _train(model, opt, 1, at)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    assert opt2.step_count == opt.step_count and opt2.phase == opt.phase
    original = [t.data_ptr() for p in model.parameters() for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    copied = [t.data_ptr() for p in model2.parameters() for t in opt2.state[p].values() if isinstance(t, torch.Tensor)]
    assert not set(original) & set(copied)
    _train(model2, opt2, at, STEPS)
    _train(model, opt, at, STEPS)
    assert all_equal(clone_params(model.parameters()), clone_params(model2.parameters()))
    assert [p for p in opt2.param_groups[0]["params"]] == list(model2.parameters())


# ----------------------------------------------------------------------------- state dicts


@pytest.mark.parametrize("saved_after", range(1, 9))
def test_loading_into_a_live_optimizer_continues_like_a_fresh_one(case, saved_after):
    """Rolling back: the state dict saved after step k, loaded into the optimizer that went on to
    step k + 3 (whatever its last plan was), continues exactly as a new optimizer loaded with it."""
    model = _model()
    opt = case.make(model.parameters())
    _train(model, opt, 1, saved_after + 1)
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    _train(model, opt, saved_after + 1, saved_after + 4)
    model.load_state_dict(weights)
    opt.load_state_dict(saved)
    fresh_model = _model(seed=1)
    fresh_model.load_state_dict(weights)
    fresh = case.make(fresh_model.parameters())
    fresh.load_state_dict(saved)
    _train(model, opt, saved_after + 1, saved_after + 7)
    _train(fresh_model, fresh, saved_after + 1, saved_after + 7)
    after = clone_params(model.parameters())
    assert all(bool(torch.isfinite(p).all()) for p in after)
    assert all_equal(after, clone_params(fresh_model.parameters()))


def test_load_state_dict_keeps_the_group_keys_of_a_scheduler(case):
    model = _model()
    opt = case.make(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for t in range(1, 6):
        _grads(model, t)
        opt.step()
        scheduler.step()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["initial_lr"] == 1e-2
    again = case.make(_model().parameters())
    again.load_state_dict(saved)
    resumed = torch.optim.lr_scheduler.StepLR(again, 2, gamma=0.5, last_epoch=4)  # raised KeyError before
    assert again.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.25
    resumed.step()
    scheduler.step()
    assert again.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_state_entries_of_other_tools_survive_state_dict(case):
    model = _model()
    opt = case.make(model.parameters())
    _train(model, opt, 1, 3)
    p = next(model.parameters())
    opt.state["hook_calls"] = 3
    opt.state[p]["ema_decay"] = 0.99
    opt.state[p]["seen"] = torch.tensor([1.0, 2.0])
    saved = opt.state_dict()
    again = case.make(_model().parameters())
    again.load_state_dict(saved)
    q = next(again.param_groups[0]["params"].__iter__())
    assert again.state["hook_calls"] == 3 and again.state[q]["ema_decay"] == 0.99
    assert torch.equal(again.state[q]["seen"], torch.tensor([1.0, 2.0]))
    # Loaded as torch does: a live optimizer's own extra entries are replaced by the saved ones.
    opt.state[p]["stale"] = 1
    opt.load_state_dict(saved)
    assert "stale" not in opt.state[p] and opt.state["hook_calls"] == 3
    _train(model, opt, 3, 5)


def test_named_parameters_are_accepted_and_their_names_saved(case):
    model = _model()
    opt = case.make(model.named_parameters())
    assert opt.param_groups[0]["params"] == list(model.parameters())
    _train(model, opt, 1, 4)
    names = [name for name, _ in model.named_parameters()]
    assert opt.state_dict()["param_groups"][0]["param_names"] == names
    with pytest.raises(ValueError, match="all parameters of a group must be given with names"):
        case.make([("w", torch.nn.Parameter(torch.ones(2))), torch.nn.Parameter(torch.ones(2))])


def test_an_empty_parameter_works_on_every_plan(case):
    model = _model()
    empty = torch.nn.Parameter(torch.zeros(0, 4))
    opt = case.make([*model.parameters(), empty])
    reference_model = _model()
    reference = case.make(reference_model.parameters())
    for t in range(1, STEPS + 1):
        _grads(model, t)
        _grads(reference_model, t)
        empty.grad = torch.zeros(0, 4)
        opt.step()
        reference.step()
    assert all_equal(clone_params(model.parameters()), clone_params(reference_model.parameters()))


def test_a_load_and_then_an_exact_restore_log_one_line_at_the_next_step(case, caplog):
    """What a framework's resume does: it loads the state (errors reset), then an exact resume
    restores this rank's errors. The next step says once what it starts from: restored."""
    model = _model()
    opt = case.make(model.parameters())
    _train(model, opt, 1, 8)
    saved, errors = opt.state_dict(), [(w.clone(), s.clone()) for w, s in opt.compression_errors()]
    with caplog.at_level(logging.INFO, logger="onebit"):
        opt.load_state_dict(saved)
        opt.restore(saved, compression_errors=errors)
        assert not [r for r in caplog.records if "loaded optimizer state" in r.message]
        _train(model, opt, 8, 10)
    loaded = [r.message for r in caplog.records if "loaded optimizer state" in r.message]
    assert len(loaded) == 1 and loaded[0].endswith("compression errors restored (exact resume)")


# ----------------------------------------------------------------------------- masks, faults, AMP


def test_masked_momentum_stays_zero_on_every_plan(case):
    if case.extra.get("inner"):
        pytest.skip("OnebitDiLoCo(inner=...) refuses momentum_masks (test_diloco.py::test_inner_refuses_momentum_masks)")
    model = _model()
    mask = torch.ones_like(model[0].weight)
    mask[3:5] = 0
    opt = case.make(model.parameters(), momentum_masks={model[0].weight: mask})
    for t in range(1, STEPS + 1):
        _grads(model, t)
        opt.step()
        assert torch.all(opt.state[model[0].weight]["exp_avg"][3:5] == 0), (t, opt.plan_for(t).name)
    assert opt.state[model[0].weight]["exp_avg"][:3].abs().sum() > 0


def test_a_nonfinite_gradient_skips_the_step_on_every_plan(case):
    """A NaN in a gradient, at a step of each plan: parameters, state and step count stay; the
    run then continues as if that call had not happened."""
    model = _model()
    opt = case.make(model.parameters())
    twin = _model()
    twin_opt = case.make(twin.parameters())
    for t in range(1, STEPS + 1):
        _grads(model, t)
        model[2].bias.grad[0] = float("nan")
        before = clone_params(model.parameters()), [_state_copy(opt, p) for p in model.parameters()], opt.step_count
        opt.step()
        assert all_equal(clone_params(model.parameters()), before[0]) and opt.step_count == before[2], t
        assert all(_same_state(_state_copy(opt, p), s) for p, s in zip(model.parameters(), before[1])), t
        _grads(model, t)
        opt.step()
        _grads(twin, t)
        twin_opt.step()
    assert all_equal(clone_params(model.parameters()), clone_params(twin.parameters()))


def test_grad_scaler_skips_overflows_and_unscales_exactly(case):
    """``torch.amp.GradScaler``: a step with an inf is skipped (and the scale backs off); scaled
    gradients (powers of 2) are unscaled exactly: the run equals the unscaled one bit for bit.
    With ``overlap_backward`` (gradients sent before the scale is known): refused at the first
    step that sends, with the fix, the parameters and state untouched."""
    model, plain = _model(), _model()
    opt, plain_opt = case.make(model.parameters()), case.make(plain.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    if case.extra.get("overlap_backward"):
        before, state = clone_params(model.parameters()), copy.deepcopy(opt.state_dict())
        for _ in range(2):  # step 1 checks the layout, step 2 starts during backward
            gen = torch.Generator().manual_seed(1)
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            with pytest.raises(ValueError, match="GradScaler.*overlap_backward=False"):
                scaler.step(opt)
            scaler.update()
        assert all_equal(before, model.parameters()) and opt.step_count == 0
        assert str(opt.state_dict()) == str(state)
        return
    for t in range(1, STEPS + 1):
        gen = torch.Generator().manual_seed(t)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        if t == 4:  # an overflow: skipped, the scale halves
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y) * float("inf")).backward()
            scaler.step(opt)
            scaler.update()
            assert scaler.get_scale() == 2.0**9 and opt.step_count == 3
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        _grads(plain, t)
        plain_opt.step()
    assert opt.step_count == STEPS
    assert all_equal(clone_params(model.parameters()), clone_params(plain.parameters()))


# ----------------------------------------------------------------------------- arguments


# (decoupled_weight_decay=True changes nothing, and False is checked against the weight decay;
# amsgrad=True is refused as DeepSpeed's key: tests/test_dropin.py, tests/test_config.py)
@pytest.mark.parametrize("flag", sorted(set(TORCH_FLAGS) - {"decoupled_weight_decay", "amsgrad"}))
def test_torch_flags_are_refused_with_the_reason(case, flag):
    with pytest.raises(TypeError, match=f"does not take torch.optim's {flag}=True: .+; remove it"):
        case.make(_model().parameters(), **{flag: True})


def test_an_unknown_keyword_is_named(case):
    key = "dampening" if "momentum" in inspect.signature(case.cls).parameters else "momentum"  # (SGD's names)
    with pytest.raises(TypeError, match=f"{case.cls.__name__} got an unexpected keyword argument '{key}'"):
        case.make(_model().parameters(), **{key: 0.9})


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
def test_a_compiled_step_runs_through_every_plan(case, caplog):
    """``torch.compile(opt.step)`` works (graph breaks allowed): finite, and near the eager run
    (inductor may round differently, and a 1-bit sign can flip on a value near 0)."""
    torch._dynamo.reset()
    model, eager_model = _model(), _model()
    opt, eager = case.make(model.parameters()), case.make(eager_model.parameters())
    step = torch.compile(opt.step)
    with caplog.at_level(logging.ERROR):
        for t in range(1, STEPS + 1):
            _grads(model, t)
            _grads(eager_model, t)
            step()
            eager.step()
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert bool(torch.isfinite(p).all())
        assert (p - q).abs().max() < 1e-2
    assert opt.step_count == STEPS
