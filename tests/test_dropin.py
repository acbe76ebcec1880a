"""Drop-in for torch.optim users (issue 44, rows 2, 3, 7, 10 and 15).

- Row 3: torch.optim's keyword arguments at values that change nothing (``maximize=False``,
  ``foreach=None``, ``fused=None``/``False``, ``capturable=False``, ``differentiable=False``,
  ``amsgrad=False``, ``decoupled_weight_decay=True``) and a 0-d tensor ``lr`` are accepted by every
  optimizer class and change nothing, bit for bit; other values are refused with the reason.
- Row 10: the same rule inside a param group: at construction, ``add_param_group``, a load, a step.
- Row 7: two optimizers taking turns on one parameter, and a hyperparameter made invalid in
  ``param_groups`` after construction, are refused at the step, before anything changes.
- Row 2: ``OnebitAdam`` continues a torch Adam/AdamW run from its state dict (2 gloo ranks: it
  tracks AdamW's own continuation; the switch to 1-bit equals the native freeze bit for bit), says
  which hyperparameters it cannot continue, and hands a state dict back to torch.optim.AdamW.
- Row 15: the README's "coming from AdamW" settings are AdamW's maths; 1-bit LAMB's step is
  ``lr * ||p||`` (its learning-rate range, said in the tuning guide); GradScaler with
  ``overlap_backward`` is refused with or without ``unscale_()``.
"""

from __future__ import annotations

import copy
import gc
import logging
import re
from pathlib import Path

import pytest
import torch

from conftest import all_equal, clone_params, short_schedules, tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = short_schedules()
CLASSES = list(SCHEDULES)
STEPS = 8
NEUTRAL = dict(maximize=False, foreach=None, fused=None, capturable=False, differentiable=False, amsgrad=False,
               decoupled_weight_decay=True)


def _make(cls, params, **kwargs):
    return cls(params, **{"lr": 1e-2, "weight_decay": 0.01, "comm_backend_name": "local", **SCHEDULES[cls], **kwargs})


def _grads(model: torch.nn.Module, t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _train(model, opt, steps=range(1, STEPS + 1)) -> list[torch.Tensor]:
    for t in steps:
        _grads(model, t)
        opt.step()
    return clone_params(model.parameters())


def _runs_like_plain(cls, build) -> None:
    """``build(params)`` trains exactly as the plain optimizer of ``cls`` does (every plan of its
    short schedule), bit for bit."""
    plain_model, model = tiny_mlp(6, 16, 3), tiny_mlp(6, 16, 3)
    expected = _train(plain_model, _make(cls, plain_model.parameters()))
    assert all_equal(_train(model, build(model.parameters())), expected)


# ----------------------------------------------------------------------------- row 3: keyword arguments


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_torch_arguments_that_change_nothing_are_accepted_and_change_nothing(cls):
    _runs_like_plain(cls, lambda params: _make(cls, params, lr=torch.tensor(1e-2, dtype=torch.float64),
                                               **{**NEUTRAL, "fused": False}))
    # decoupled_weight_decay=False is torch.optim.Adam's default: nothing to couple without weight decay
    plain_model, model = tiny_mlp(6, 16, 3), tiny_mlp(6, 16, 3)
    plain = _train(plain_model, _make(cls, plain_model.parameters(), weight_decay=0.0))
    assert all_equal(_train(model, _make(cls, model.parameters(), weight_decay=0.0, decoupled_weight_decay=False)), plain)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(maximize=True), TypeError, r"does not take torch.optim's maximize=True: onebit minimizes; negate the loss"),
    (dict(foreach=True), TypeError, r"foreach=True: onebit always updates .* \(or pass foreach=None\)"),
    (dict(foreach=False), TypeError, r"foreach=False: onebit always updates"),
    (dict(fused=True), TypeError, r"fused=True: .* \(or pass fused=None or fused=False\)"),
    (dict(capturable=True), TypeError, r"capturable=True: CUDA graph capture is not supported"),
    (dict(differentiable=True), TypeError, r"differentiable=True: a step through 1-bit compression"),
    (dict(amsgrad=True), TypeError, r"does not take amsgrad=True: AMSGrad is not implemented; remove it"),
    (dict(decoupled_weight_decay=False, weight_decay=0.1), ValueError,
     r"decoupled_weight_decay=False in a param group: onebit's weight decay is decoupled, AdamW's"),
    (dict(lr=torch.tensor([1e-2])), TypeError, r"lr must be a real number or a 0-d real tensor, got a tensor of shape \(1,\)"),
    (dict(lr=torch.tensor(1e-2, requires_grad=True)), TypeError, r"a tensor lr that requires grad is not supported"),
])
def test_torch_arguments_that_change_something_are_refused_with_the_reason(cls, kwargs, error, message):
    with pytest.raises(error, match=message):
        _make(cls, tiny_mlp(6, 16, 3).parameters(), **kwargs)


# ----------------------------------------------------------------------------- row 10: param groups


def _two_groups(model, **flags):
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    return [{"params": first, **flags}, {"params": second}]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_torch_flags_in_param_groups_that_change_nothing_are_accepted(cls):
    _runs_like_plain(cls, lambda params: _make(cls, [{"params": list(params), **NEUTRAL}]))

    def added(params):
        params = list(params)
        opt = _make(cls, params[:2])
        opt.add_param_group({"params": params[2:], **NEUTRAL, "lr": torch.tensor(1e-2, dtype=torch.float64)})
        return opt
    _runs_like_plain(cls, added)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("flag, value", [("maximize", True), ("amsgrad", True), ("fused", True), ("foreach", False),
                                         ("capturable", True), ("differentiable", True),
                                         ("decoupled_weight_decay", False)])
def test_torch_flags_in_param_groups_that_change_something_are_refused_everywhere(cls, flag, value):
    """At construction, ``add_param_group``, a load (which changes nothing) and a step (the
    group changed after construction: nothing changes either)."""
    message = rf"does not take torch.optim's {flag}={value!r} in a param group: .+; remove it"
    with pytest.raises(ValueError, match=message):
        _make(cls, _two_groups(tiny_mlp(6, 16, 3), **{flag: value}))
    model = tiny_mlp(6, 16, 3)
    params = list(model.parameters())
    opt = _make(cls, params[:2])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": params[2:], flag: value})
    assert len(opt.param_groups) == 1
    opt = _make(cls, _two_groups(model))
    _train(model, opt, range(1, 3))
    sd = opt.state_dict()
    sd["param_groups"][0][flag] = value
    before, saved, state = clone_params(params), copy.deepcopy(sd), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert _same_dict(sd, saved) and _same_dict(opt.state_dict(), state)
    opt.param_groups[0][flag] = value
    _grads(model, 3)
    with pytest.raises(ValueError, match=rf"param group 0 of {cls.__name__}: .*{flag}={value!r} .*The step was not taken"):
        opt.step()
    assert all_equal(clone_params(params), before) and _same_dict(opt.state_dict()["state"], state["state"])
    assert opt.step_count == 2


def _same_dict(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_dict(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_dict(x, y) for x, y in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------- row 7: shared parameters, later changes


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_two_optimizers_taking_turns_on_a_parameter_are_refused(cls):
    model = tiny_mlp(6, 16, 3)
    first = _make(cls, model.named_parameters())
    second = OnebitAdam(model.parameters(), comm_backend_name="local", freeze_step=3)
    _train(model, first, [1])
    _train(model, second, [2])  # the second may take over (e.g. a checkpoint loaded into it)...
    before, state = clone_params(model.parameters()), copy.deepcopy(first.state_dict())
    _grads(model, 3)
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.step\(\): another optimizer, OnebitAdam, holds the same "
                                         r"parameter '0\.weight' and stepped it since this .+'s last step"):
        first.step()  # ...but the first stepping again would take turns
    assert all_equal(clone_params(model.parameters()), before) and _same_dict(first.state_dict(), state)
    assert first.step_count == 1
    del second
    gc.collect()
    first.step()  # the other one is gone
    assert first.step_count == 2


def test_a_second_optimizer_built_to_load_a_checkpoint_may_step():
    """Resuming in the same process: the state dict of the first loaded into a second, which steps on."""
    model, reference_model = tiny_mlp(6, 16, 3), tiny_mlp(6, 16, 3)
    first, reference = _make(OnebitAdam, model.parameters()), _make(OnebitAdam, reference_model.parameters())
    _train(model, first, range(1, 5))
    _train(reference_model, reference, range(1, 5))
    resumed = _make(OnebitAdam, model.parameters())
    resumed.load_state_dict(first.state_dict())
    reference.reset_compression_errors()
    assert all_equal(_train(model, resumed, range(5, 9)), _train(reference_model, reference, range(5, 9)))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_an_invalid_hyperparameter_set_after_construction_is_refused_at_the_step_and_changes_nothing(cls, overlap):
    if overlap and cls not in (OnebitAdam, OnebitLamb, ZeroOneAdam):
        pytest.skip("OnebitDiLoCo has no overlap_backward")
    extra = dict(overlap_backward=True) if overlap else {}
    model, reference_model = tiny_mlp(6, 16, 3), tiny_mlp(6, 16, 3)
    opt, reference = _make(cls, model.parameters(), **extra), _make(cls, reference_model.parameters(), **extra)
    _train(model, opt, range(1, 5))
    _train(reference_model, reference, range(1, 5))
    before, state = clone_params(model.parameters()), copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["betas"] = (1.5, 0.999)
    _grads(model, 5)  # (with overlap, backward starts the step's communication with the bad beta1)
    with pytest.raises(ValueError, match=rf"param group 0 of {cls.__name__}: invalid betas\[0\]: 1\.5; it must be "
                                         r"finite and in \[0\.0, 1\.0\)\. The step was not taken and nothing changed"):
        opt.step()
    assert all_equal(clone_params(model.parameters()), before) and _same_dict(opt.state_dict()["state"], state["state"])
    assert opt.step_count == 4
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    opt.param_groups[0]["lr"] = torch.tensor(1e-2, dtype=torch.float64)  # a 0-d tensor set later is read as its value
    assert all_equal(_train(model, opt, range(5, STEPS + 1)), _train(reference_model, reference, range(5, STEPS + 1)))
    assert opt.param_groups[0]["lr"] == 1e-2 and isinstance(opt.param_groups[0]["lr"], float)


# ----------------------------------------------------------------------------- row 2: from and to torch AdamW


def _adamw_run(model, steps, **kwargs) -> torch.optim.AdamW:
    adamw = torch.optim.AdamW(model.parameters(), **{"lr": 1e-2, "weight_decay": 0.05, **kwargs})
    _train(model, adamw, steps)
    return adamw


def _relative(a, b) -> float:
    """The largest ``||p - q|| / ||q||`` over pairs of tensors."""
    return max(((p - q).norm() / q.norm()).item() for p, q in zip(a, b))


def test_onebit_adam_continues_an_adamw_run_in_warmup():
    model = tiny_mlp(6, 16, 3)
    adamw = _adamw_run(model, range(1, 11))
    sd = adamw.state_dict()
    saved = copy.deepcopy(sd)
    twin = copy.deepcopy(model)
    opt = OnebitAdam(twin.parameters(), comm_backend_name="local", freeze_step=1000)  # bias_correction=False: replaced
    opt.load_state_dict(sd)
    assert _same_dict(sd, saved)  # the input is not changed
    assert opt.step_count == 10 and opt.phase == "warmup"
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["bias_correction"], group["betas"]) == (1e-2, 0.05, True, (0.9, 0.999))
    expected = _train(model, adamw, range(11, 31))
    assert _relative(_train(twin, opt, range(11, 31)), expected) < 2e-6


def test_an_adamw_state_dict_of_steps_not_taken_by_every_parameter_starts_them_from_zeros():
    model = tiny_mlp(6, 16, 3)
    adamw = _adamw_run(model, range(1, 4))
    sd = adamw.state_dict()
    del sd["state"][3]  # as if the last bias never had a gradient
    opt = OnebitAdam(copy.deepcopy(model).parameters(), comm_backend_name="local")
    opt.load_state_dict(sd)
    last = list(opt.state.values())[3]
    assert not last["exp_avg"].any() and not last["exp_avg_sq"].any() and opt.step_count == 3


@pytest.mark.parametrize("change, message", [
    (lambda sd: sd["param_groups"][0].update(amsgrad=True), r"param group 0 has amsgrad=True \(AMSGrad is not implemented\)"),
    (lambda sd: sd["param_groups"][0].update(maximize=True), r"param group 0 has maximize=True \(onebit minimizes"),
    (lambda sd: sd["param_groups"][0].update(decoupled_weight_decay=False),
     r"param group 0 has decoupled_weight_decay=False \(onebit's weight decay is decoupled, AdamW's"),
    (lambda sd: sd["param_groups"][0].pop("decoupled_weight_decay"),
     r"param group 0 has weight_decay=0\.05 and does not say whether it is decoupled .+ set "
     r"param_groups\[0\]\['decoupled_weight_decay'\] = True in the dict if it came from AdamW"),
    (lambda sd: sd["state"][1].update(step=torch.tensor(7.0)),
     r"its parameters are at different steps \(7 for parameters \[1\], 10 for parameters \[0, 2, 3\]\)"),
    (lambda sd: sd["state"][0].update(step=torch.tensor(2.5)), r"the state of parameter 0 has step tensor\(2\.5000\)"),
])
def test_an_adamw_state_dict_onebit_cannot_continue_is_refused_naming_what(change, message):
    model = tiny_mlp(6, 16, 3)
    sd = _adamw_run(model, range(1, 11)).state_dict()
    change(sd)
    opt = OnebitAdam(copy.deepcopy(model).parameters(), comm_backend_name="local")
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"cannot load optimizer state: a torch.optim Adam/AdamW state dict cannot "
                                         r"continue in OnebitAdam: .*" + message):
        opt.load_state_dict(sd)
    assert _same_dict(opt.state_dict(), state)


def test_every_problem_of_an_adamw_state_dict_is_named_at_once():
    model = tiny_mlp(6, 16, 3)
    sd = _adamw_run(model, range(1, 3)).state_dict()
    sd["param_groups"][0].update(amsgrad=True, maximize=True)
    with pytest.raises(ValueError, match=r"maximize=True .+; param group 0 has amsgrad=True"):
        OnebitAdam(copy.deepcopy(model).parameters(), comm_backend_name="local").load_state_dict(sd)


@pytest.mark.parametrize("cls", [OnebitLamb, ZeroOneAdam], ids=lambda c: c.__name__)
def test_other_algorithms_name_the_route_for_an_adamw_state_dict(cls):
    model = tiny_mlp(6, 16, 3)
    sd = _adamw_run(model, range(1, 3)).state_dict()
    with pytest.raises(ValueError, match=rf"this is a torch.optim Adam/AdamW state dict; {cls.__name__} cannot continue "
                                         r"from it\. OnebitAdam can \(build OnebitAdam\(params, bias_correction=True"):
        _make(cls, copy.deepcopy(model).parameters()).load_state_dict(sd)


def test_onebit_adam_hands_its_state_to_torch_adamw():
    """The reverse: AdamW (and Adam, which takes the dict's decoupled weight decay) continues from
    OnebitAdam's state as OnebitAdam's own warmup does; the round trip gives the moments back."""
    model = tiny_mlp(6, 16, 3)
    opt = OnebitAdam(model.parameters(), lr=1e-2, weight_decay=0.05, bias_correction=True, comm_backend_name="local",
                     freeze_step=1000)
    _train(model, opt, range(1, 11))
    for torch_cls in (torch.optim.AdamW, torch.optim.Adam):
        twin = copy.deepcopy(model)
        adam = torch_cls(twin.parameters())
        sd = opt.torch_state_dict()
        adam.load_state_dict(sd)  # (torch keeps the dict's step tensors and counts on in them)
        assert adam.param_groups[0]["decoupled_weight_decay"] is True and adam.param_groups[0]["weight_decay"] == 0.05
        own_model, own = copy.deepcopy((model, opt))  # (together: the copy optimizes the copied parameters)
        assert _relative(_train(twin, adam, range(11, 21)), _train(own_model, own, range(11, 21))) < 2e-6
    back = OnebitAdam(copy.deepcopy(model).parameters(), comm_backend_name="local")
    back.load_state_dict(opt.torch_state_dict())
    assert back.step_count == 10
    assert all(torch.equal(back.state_dict()["state"][i][name], opt.state_dict()["state"][i][name])
               for i in range(4) for name in ("exp_avg", "exp_avg_sq"))


def test_handing_state_to_torch_without_bias_correction_is_refused_with_the_factor():
    model = tiny_mlp(6, 16, 3)
    opt = OnebitAdam(model.parameters(), comm_backend_name="local")
    _train(model, opt, range(1, 11))
    with pytest.raises(ValueError, match=r"param group 0 has bias_correction=False; torch's Adam always corrects its "
                                         r"moments, so at step 10 its steps would be 0\.1532x this optimizer's\. Set "
                                         r"optimizer\.param_groups\[0\]\['bias_correction'\] = True first"):
        opt.torch_state_dict()
    opt.param_groups[0]["bias_correction"] = True
    assert opt.torch_state_dict()["state"][0]["step"] == 10


def _switch_ranks(rank: int, world_size: int) -> dict:
    """An AdamW job under DDP for 10 steps; its state continued (a) by AdamW under DDP, (b) by
    OnebitAdam in warmup, (c) by OnebitAdam switching to 1-bit at once (``freeze_step`` 4 <= 10),
    (d) by OnebitAdam whose own state, the same values, froze at step 10."""
    torch.manual_seed(0)
    model = tiny_mlp(6, 16, 3)
    data = lambda t: (torch.Generator().manual_seed(100 * t + rank),)  # noqa: E731 (each rank its own batch)

    def grads(m, t):
        gen = data(t)[0]
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        m.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(m(x), y).backward()

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.05)
    for t in range(1, 11):
        grads(ddp, t)
        adamw.step()
    sd = copy.deepcopy(adamw.state_dict())
    twins = {name: copy.deepcopy(model) for name in ("warmup", "switch", "native")}
    warmup = OnebitAdam(twins["warmup"].parameters(), freeze_step=1000)
    warmup.load_state_dict(sd)
    switch = OnebitAdam(twins["switch"].parameters(), freeze_step=4)
    switch.load_state_dict(sd)
    phase_after_load = switch.phase
    native = OnebitAdam(twins["native"].parameters(), freeze_step=10, bias_correction=True)
    own = native.state_dict()
    for index, entry in sd["state"].items():
        own["state"][index] = {"exp_avg": entry["exp_avg"], "exp_avg_sq": entry["exp_avg_sq"]}
    for group in own["param_groups"]:
        group.update(lr=1e-2, weight_decay=0.05, onebit={**group["onebit"], "step": 10})
    native.load_state_dict(own)
    trajectories = {name: [] for name in ("adamw", "warmup", "switch", "native")}
    for t in range(11, 21):
        grads(ddp, t)
        adamw.step()
        trajectories["adamw"].append(clone_params(model.parameters()))
        for name, opt in (("warmup", warmup), ("switch", switch), ("native", native)):
            grads(twins[name], t)
            opt.step()
            trajectories[name].append(clone_params(twins[name].parameters()))
    stats = switch.comm_stats()
    return {"trajectories": trajectories, "phase_after_load": phase_after_load, "freeze_step": switch.freeze_step,
            "compression_steps": stats["compression"]["steps"], "warmup_steps": stats["warmup"]["steps"]}


def test_an_adamw_job_on_two_ranks_continues_in_onebit_adam_then_switches_to_one_bit(tmp_path):
    ranks = run_ranks(_switch_ranks, 2, tmp_path, timeout=240)
    for r in ranks:
        paths = r["trajectories"]
        # warmup tracks AdamW's own continuation (DDP's average against onebit's: rounding only)
        assert max(_relative(p, q) for p, q in zip(paths["warmup"], paths["adamw"])) < 2e-6
        # freeze_step 4 <= the loaded step 10: 1-bit at once, the variance frozen as loaded, bit for
        # bit the run whose own state froze at step 10
        assert r["phase_after_load"] == "compression" and r["freeze_step"] == 10
        assert (r["compression_steps"], r["warmup_steps"]) == (10, 0)
        assert all(all_equal(p, q) for p, q in zip(paths["switch"], paths["native"]))
    for name in ("warmup", "switch"):  # every rank holds the same parameters
        assert all(all_equal(p, q) for p, q in zip(ranks[0]["trajectories"][name], ranks[1]["trajectories"][name]))


# ----------------------------------------------------------------------------- row 15: where users look


def test_the_readme_s_adamw_settings_are_adamw():
    """The README's "Which optimizer" row for AdamW users names ``bias_correction=True``; with it
    OnebitAdam's warmup is AdamW to rounding, and the default (DeepSpeed's, no bias correction) is not."""
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| Adam or AdamW"))
    assert "OnebitAdam(bias_correction=True" in row
    reference = tiny_mlp(6, 16, 3)
    expected = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.05), range(1, 21))
    for bias_correction, within in ((True, True), (False, False)):
        model = tiny_mlp(6, 16, 3)
        opt = OnebitAdam(model.parameters(), lr=1e-2, weight_decay=0.05, bias_correction=bias_correction,
                         comm_backend_name="local", freeze_step=1000)
        assert (_relative(_train(model, opt, range(1, 21)), expected) < 1e-6) == within


def test_lamb_steps_by_lr_times_the_parameter_norm_as_the_tuning_guide_says():
    """1-bit LAMB's step moves each tensor by ``lr * ||p||`` (the trust ratio, when it is within
    its bounds): why its learning rate is not Adam's (docs/guides/tuning.md says the range)."""
    text = (ROOT / "docs" / "guides" / "tuning.md").read_text()
    assert re.search(r"\*\*`lr` of 1-bit LAMB\*\*.*lr · ‖p‖", text)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(32, 32))
    opt = OnebitLamb([weight], lr=1e-3, comm_backend_name="local", freeze_step=10)
    before = weight.detach().clone()
    weight.grad = torch.randn(32, 32)
    opt.step()
    assert (weight.detach() - before).norm().item() == pytest.approx(1e-3 * before.norm().item(), rel=1e-4)


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_-then-step"])
def test_grad_scaler_with_overlap_is_refused_with_or_without_unscale(unscale):
    model = tiny_mlp(6, 16, 3)
    opt = OnebitAdam(model.parameters(), comm_backend_name="local", freeze_step=2, overlap_backward=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _train(model, opt, range(1, 3))  # (compression next: a plan that starts during backward)
    before = clone_params(model.parameters())
    model.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(torch.ones(8, 6)), torch.zeros(8, 3))).backward()
    if unscale:
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match=r"overlap_backward=True\) cannot be used with torch.amp.GradScaler"):
        scaler.step(opt)
    assert all_equal(clone_params(model.parameters()), before) and opt.step_count == 2


def test_a_load_of_adamw_state_says_what_it_changed(caplog):
    model = tiny_mlp(6, 16, 3)
    sd = _adamw_run(model, range(1, 11)).state_dict()
    twin = copy.deepcopy(model)
    opt = OnebitAdam(twin.parameters(), comm_backend_name="local", freeze_step=4)
    opt.load_state_dict(sd)
    with caplog.at_level(logging.INFO, logger="onebit"):
        _grads(twin, 11)
        opt.step()
    assert ("onebit: loaded a torch.optim Adam/AdamW state dict at step 10 (next: a compression step; "
            "bias_correction=True from now on, as in torch's Adam; freeze_step 10 (was 4): the variance is frozen as "
            "loaded); compression errors reset") in caplog.messages
