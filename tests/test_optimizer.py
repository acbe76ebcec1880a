"""OnebitAdam in one process (LocalBackend): numerics, phase, groups, masks, buckets, checkpoints."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

import onebit
from conftest import clone_params
from onebit import OnebitAdam


def _model(seed: int = 0, tensors: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for i in range(tensors):
        layers += [torch.nn.Linear(5, 5), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(5, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 5, generator=gen), torch.randn(16, 2, generator=gen)


def _backward(model, step: int) -> None:
    x, y = _batch(step)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _train(model, opt, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class DeepSpeedAdam:
    """Hand-written reference of the warmup numerics: no bias correction, eps outside the sqrt,
    decoupled weight decay ``p -= lr * (m / (sqrt(v) + eps) + wd * p)``."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, grads):
        b1, b2 = self.betas
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m.copy_(b1 * m + (1 - b1) * g)
            v.copy_(b2 * v + (1 - b2) * g * g)
            p.sub_(self.lr * (m / (v.sqrt() + self.eps) + self.wd * p))


def test_warmup_matches_deepspeed_numerics():
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=50, weight_decay=0.1, comm_backend_name="local")
    ref = DeepSpeedAdam(ref_model.parameters(), 1e-2, (0.9, 0.999), 1e-8, 0.1)
    for step in range(10):
        _backward(model, step)
        opt.step()
        _backward(ref_model, step)
        ref.step([p.grad for p in ref_model.parameters()])
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bias_correction_matches_torch_adamw():
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=50, weight_decay=0.05, bias_correction=True,
                     comm_backend_name="local")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05, eps=1e-8)
    _train(model, opt, 10)
    _train(ref_model, ref, 10)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bias_correction_changes_the_update():
    runs = []
    for flag in (False, True):
        model = _model()
        _train(model, OnebitAdam(model.parameters(), lr=1e-2, freeze_step=5, bias_correction=flag,
                                 comm_backend_name="local"), 3)
        runs.append(clone_params(model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(*runs))


def test_every_step_updates_including_the_first():
    model = _model()
    before = clone_params(model.parameters())
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1, comm_backend_name="local")
    _train(model, opt, 1)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    before = clone_params(model.parameters())
    assert opt.phase == "compression"
    _train(model, opt, 1, start=1)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_phase_is_derived_from_step_and_freeze_step():
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=3, comm_backend_name="local")
    phases = []
    for step in range(5):
        phases.append(opt.phase)
        _train(model, opt, 1, start=step)
    assert phases == ["warmup"] * 3 + ["compression"] * 2
    assert opt.step_count == 5
    stats = opt.comm_stats()
    assert stats["warmup"]["steps"] == 3 and stats["compression"]["steps"] == 2


def test_compression_freezes_the_variance_and_keeps_momentum_moving():
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, comm_backend_name="local",
                     compression_space="momentum")
    _train(model, opt, 2)
    p = next(model.parameters())
    v_before = opt.state[p]["exp_avg_sq"].clone()
    m_before = opt.state[p]["exp_avg"].clone()
    _train(model, opt, 3, start=2)
    assert torch.equal(opt.state[p]["exp_avg_sq"], v_before)
    assert not torch.equal(opt.state[p]["exp_avg"], m_before)
    # After a compressed all-reduce the momentum is a scaled sign: one magnitude per server chunk.
    assert opt.state[p]["exp_avg"].abs().unique().numel() == 1


def test_phase_switch_is_logged_once(caplog):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, comm_backend_name="local")
    with caplog.at_level(logging.INFO, logger="onebit"):
        _train(model, opt, 6)
    assert sum("switching to 1-bit" in r.message for r in caplog.records) == 1


def test_param_groups_use_their_own_lr_and_weight_decay():
    model = _model()
    ref_model = copy.deepcopy(model)
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = OnebitAdam([{"params": first, "lr": 1e-1, "weight_decay": 0.5}, {"params": rest}],
                     lr=1e-2, freeze_step=50, comm_backend_name="local")
    rfirst, rrest = list(ref_model.parameters())[:2], list(ref_model.parameters())[2:]
    ref = [DeepSpeedAdam(rfirst, 1e-1, (0.9, 0.999), 1e-8, 0.5), DeepSpeedAdam(rrest, 1e-2, (0.9, 0.999), 1e-8, 0.0)]
    for step in range(4):
        _backward(model, step)
        opt.step()
        _backward(ref_model, step)
        ref[0].step([p.grad for p in rfirst])
        ref[1].step([p.grad for p in rrest])
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_uncompressed_group_runs_plain_adam_in_both_phases():
    plain, compressed = _model(0), _model(1)
    ref_model = copy.deepcopy(plain)
    opt = OnebitAdam([{"params": plain.parameters(), "compress": False}, {"params": compressed.parameters()}],
                     lr=1e-2, freeze_step=2, comm_backend_name="local", compression_space="momentum")
    ref = DeepSpeedAdam(ref_model.parameters(), 1e-2, (0.9, 0.999), 1e-8, 0.0)
    for step in range(6):
        x, y = _batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(plain(x), y) + torch.nn.functional.mse_loss(compressed(x), y)
        loss.backward()
        opt.step()
        ref_model.zero_grad()
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        ref.step([p.grad for p in ref_model.parameters()])
    for a, b in zip(plain.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # ... while the other group did compress (its momentum is a scaled sign).
    assert opt.state[compressed[0].weight]["exp_avg"].abs().unique().numel() == 1


def test_none_gradient_counts_as_zero():
    p = torch.nn.Parameter(torch.ones(8))
    q = torch.nn.Parameter(torch.ones(8))
    opt = OnebitAdam([p, q], lr=0.1, freeze_step=10, comm_backend_name="local")
    p.grad = torch.ones(8)
    q.grad = None
    opt.step()
    assert torch.equal(opt.state[q]["exp_avg"], torch.zeros(8))
    assert torch.equal(q.detach(), torch.ones(8))
    assert not torch.equal(p.detach(), torch.ones(8))


def test_masked_momentum_stays_exactly_zero_in_both_phases():
    model = _model()
    weight = model[0].weight
    mask = torch.ones_like(weight)
    mask[:, 2:] = 0
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, comm_backend_name="local",
                     momentum_masks={weight: mask})
    for step in range(8):
        _train(model, opt, 1, start=step)
        m = opt.state[weight]["exp_avg"]
        assert torch.all(m[:, 2:] == 0)
        assert torch.count_nonzero(m[:, :2]) > 0


def test_mask_takes_effect_against_an_unmasked_run():
    runs = []
    for use_mask in (False, True):
        model = _model()
        masks = {model[0].weight: torch.zeros_like(model[0].weight)} if use_mask else None
        opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="local", momentum_masks=masks)
        start = model[0].weight.detach().clone()
        _train(model, opt, 4)
        runs.append(torch.equal(model[0].weight, start))
    assert runs == [False, True]


def test_bucket_size_sets_the_number_of_buckets():
    model = _model(tensors=3)  # 8 tensors: 5x5 weights (25) and biases (5), last 10 + 2
    total = sum(p.numel() for p in model.parameters())
    one = OnebitAdam(model.parameters(), freeze_step=1, comm_backend_name="local")
    many = OnebitAdam(model.parameters(), freeze_step=1, comm_backend_name="local", bucket_size=30)
    assert one.num_buckets == 1
    assert many.num_buckets > 1
    assert sum(b.numel for b in many._buckets) == total


def test_lr_scheduler_drives_the_learning_rate():
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1.0, freeze_step=2, comm_backend_name="local")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        _train(model, opt, 1, start=step)
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)


def test_add_param_group_after_construction_trains_the_new_group():
    model = _model()
    extra = torch.nn.Parameter(torch.zeros(4))
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="local")
    opt.add_param_group({"params": [extra], "lr": 0.5})
    extra.grad = torch.ones(4)
    opt.step()
    assert torch.all(extra < 0)


# ------------------------------------------------------------------ checkpoints


def _trained(steps: int, freeze_step: int = 3):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=freeze_step, weight_decay=0.01,
                     comm_backend_name="local")
    _train(model, opt, steps)
    return model, opt


def _snapshot(obj):
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.clone(), id(obj))
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


def _same(a, b) -> bool:
    if isinstance(a, tuple) and len(a) == 3 and a and a[0] == "tensor":
        return isinstance(b, tuple) and torch.equal(a[1], b[1]) and a[2] == b[2]
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_state_dict_is_a_world_size_independent_copy():
    model, opt = _trained(5)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["onebit"] == {"format_version": 3, "algorithm": "OnebitAdam", "step": 5, "freeze_step": 3,
                                               "compression_space": "preconditioned"}
    for index, p in enumerate(model.parameters()):
        assert sd["state"][index]["exp_avg"].shape == p.shape
        assert set(sd["state"][index]) == {"exp_avg", "exp_avg_sq"}
    saved = sd["state"][0]["exp_avg"].clone()
    _train(model, opt, 2, start=5)
    assert torch.equal(sd["state"][0]["exp_avg"], saved)  # later steps do not leak into the copy


def test_a_format_2_state_dict_still_loads():
    """Format 2 kept the "onebit" entry at the top level; format 3 keeps it in every param group
    (where torch.distributed.checkpoint's get_optimizer_state_dict keeps it)."""
    _, opt = _trained(5)
    sd = opt.state_dict()
    old = {"state": sd["state"], "param_groups": [{k: v for k, v in g.items() if k != "onebit"} for g in sd["param_groups"]],
           "onebit": {**sd["param_groups"][0]["onebit"], "format_version": 2}}
    _, opt2 = _trained(2)
    opt2.load_state_dict(old)
    assert opt2.step_count == 5 and opt2.state_dict()["param_groups"] == sd["param_groups"]
    assert all(torch.equal(opt2.state_dict()["state"][i]["exp_avg"], sd["state"][i]["exp_avg"]) for i in sd["state"])


def test_checkpoint_round_trip_continues_identically_after_the_error_reset():
    model, opt = _trained(5)
    sd = opt.state_dict()
    model2 = copy.deepcopy(model)
    opt2 = OnebitAdam(model2.parameters(), lr=0.5, freeze_step=99, comm_backend_name="local")
    opt2.load_state_dict(sd)
    assert opt2.step_count == 5 and opt2.phase == "compression" and opt2.freeze_step == 3
    assert opt2.param_groups[0]["lr"] == 1e-2
    assert opt2.comm_stats()["worker_error_norm"] == 0.0
    opt.reset_compression_errors()  # what the load did to opt2
    _train(model, opt, 4, start=5)
    _train(model2, opt2, 4, start=5)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_does_not_mutate_input():
    _, opt = _trained(5)
    sd = opt.state_dict()
    before = _snapshot(sd)
    model2 = _model(seed=1)
    opt2 = OnebitAdam(model2.parameters(), lr=1e-3, freeze_step=3, comm_backend_name="local")
    opt2.load_state_dict(sd)
    _train(model2, opt2, 3, start=5)
    assert _same(before, _snapshot(sd))


def _corrupt(sd, how):
    sd = copy.deepcopy(sd)
    if how == "shape":
        sd["state"][0]["exp_avg"] = torch.zeros(3, 3)
    elif how == "missing":
        del sd["state"][1]
    elif how == "groups":
        sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0]))
    elif how == "version":
        sd["param_groups"][0]["onebit"]["format_version"] = 99
    elif how == "nan":
        sd["state"][0]["exp_avg_sq"][0, 0] = float("nan")
    elif how == "torch":
        for group in sd["param_groups"]:
            del group["onebit"]
    elif how == "step":
        sd["param_groups"][0]["onebit"]["step"] = -1
    elif how == "lr":
        sd["param_groups"][0]["lr"] = -1.0
    return sd


@pytest.mark.parametrize(
    "how, pattern",
    [
        ("shape", r"exp_avg of parameter 0 has shape \(3, 3\), the parameter has \(5, 5\)"),
        ("missing", r"no exp_avg/exp_avg_sq for parameter 1"),
        ("groups", r"2 param groups, this optimizer has 1"),
        ("version", r"format_version 99 is newer"),
        ("nan", r"contains NaN or inf"),
        ("torch", r"no 'onebit' entry in its param groups.*torch.optim state dict"),
        ("step", r"step must be an int >= 0, got -1"),
        ("lr", r"param group 0: invalid lr: -1.0"),
    ],
)
def test_bad_checkpoint_is_rejected_without_changing_the_optimizer(how, pattern):
    _, opt = _trained(5)
    bad = _corrupt(opt.state_dict(), how)
    model2, opt2 = _trained(2)
    before = opt2.state_dict()
    with pytest.raises(ValueError, match=pattern):
        opt2.load_state_dict(bad)
    after = opt2.state_dict()
    assert all(torch.equal(after["state"][i]["exp_avg"], before["state"][i]["exp_avg"]) for i in before["state"])
    assert after["param_groups"] == before["param_groups"]


# ------------------------------------------------------------------ bad input


def _p():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(lr=-1.0), ValueError, r"invalid lr: -1.0"),
        (dict(lr=float("nan")), ValueError, r"invalid lr: nan"),
        (dict(lr="0.1"), TypeError, r"lr must be a real number, got '0.1'"),
        (dict(eps=-1e-8), ValueError, r"invalid eps: -1e-08"),
        (dict(eps=0.0), ValueError, r"invalid eps: 0; it must be > 0"),
        (dict(weight_decay=-0.1), ValueError, r"invalid weight_decay: -0.1"),
        (dict(betas=(1.0, 0.999)), ValueError, r"invalid betas\[0\]: 1.0"),
        (dict(betas=(0.9, -0.1)), ValueError, r"invalid betas\[1\]: -0.1"),
        (dict(betas=0.9), TypeError, r"betas must be a pair"),
        (dict(freeze_step=-5), ValueError, r"invalid freeze_step: -5"),
        (dict(freeze_step=0), ValueError, r"invalid freeze_step: 0"),
        (dict(freeze_step=2.5), TypeError, r"freeze_step must be an int, got 2.5"),
        (dict(freeze_step=True), TypeError, r"freeze_step must be an int, got True"),
        (dict(bucket_size=0), ValueError, r"invalid bucket_size: 0"),
        (dict(comm_backend_name="ncl"), ValueError,
         r"unknown comm_backend_name 'ncl'; expected one of 'gloo', 'hccl', 'local', 'mpi', 'nccl'"),
        (dict(comm_backend_name="gloo"), RuntimeError, r"torch.distributed is not initialized.*init_process_group"),
        (dict(comm_backend_name="local", cuda_aware=True), ValueError, r"cuda_aware=True applies only to"),
        (dict(comm_backend_name="local", backend=onebit.LocalBackend()), ValueError, r"either backend= or comm_backend_name="),
        (dict(backend="local"), TypeError, r"backend must be a onebit.backends.CommBackend, got str"),
        (dict(kernels="fast"), ValueError, r"unknown kernel implementation 'fast'"),
    ],
)
def test_bad_constructor_arguments_raise_clear_errors(kwargs, exc, pattern):
    kwargs = {"freeze_step": 10, **kwargs}
    if "backend" not in kwargs and "comm_backend_name" not in kwargs:
        kwargs["comm_backend_name"] = "local"
    with pytest.raises(exc, match=pattern):
        OnebitAdam(_p(), **kwargs)


@pytest.mark.parametrize(
    "params, exc, pattern",
    [
        ([], ValueError, r"empty parameter list"),
        ([torch.zeros(3, dtype=torch.complex64, requires_grad=True)], ValueError, r"complex parameter of shape \(3,\)"),
        ([torch.zeros(3, dtype=torch.int64)], ValueError, r"dtype torch.int64 is not floating point"),
        ([{"params": _p(), "lr": -2.0}], ValueError, r"invalid lr: -2.0"),
        ([{"params": _p(), "exp_avg_mask": torch.ones(3)}], ValueError, r"momentum_masks=\{param: mask\}"),
        ([{"params": _p(), "compress": "yes"}], TypeError, r"compress must be True or False, got 'yes'"),
    ],
)
def test_bad_params_raise_clear_errors(params, exc, pattern):
    with pytest.raises(exc, match=pattern):
        OnebitAdam(params, freeze_step=10, comm_backend_name="local")


@pytest.mark.parametrize(
    "make_mask, exc, pattern",
    [
        (lambda p: torch.ones(2), ValueError, r"momentum mask of shape \(2,\) does not match its parameter of shape \(3,\)"),
        (lambda p: torch.ones(3, device="meta"), ValueError, r"momentum mask is on meta but its parameter is on cpu"),
        (lambda p: torch.full((3,), 0.5), ValueError, r"only 0 and 1"),
        (lambda p: [1, 0, 1], TypeError, r"momentum mask must be a tensor"),
    ],
)
def test_bad_masks_are_rejected(make_mask, exc, pattern):
    params = _p()
    with pytest.raises(exc, match=pattern):
        OnebitAdam(params, freeze_step=10, comm_backend_name="local", momentum_masks={params[0]: make_mask(params[0])})


def test_mask_for_a_foreign_tensor_is_rejected():
    with pytest.raises(ValueError, match=r"not a trainable parameter of this optimizer"):
        OnebitAdam(_p(), freeze_step=10, comm_backend_name="local", momentum_masks={torch.zeros(3): torch.ones(3)})


def test_sparse_gradient_is_rejected_before_anything_changes():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OnebitAdam(emb.parameters(), freeze_step=10, comm_backend_name="local")
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match=r"sparse gradients"):
        opt.step()
    assert torch.equal(emb.weight, before) and opt.step_count == 0


def test_multi_process_launch_without_process_group_raises(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match=r"reports 4 processes but torch.distributed is not initialized"):
        OnebitAdam(_p(), freeze_step=10)


def test_single_process_default_is_local():
    opt = OnebitAdam(_p(), freeze_step=10)
    assert opt.backend.name == "local" and opt.backend.world_size == 1
    assert math.isclose(opt.comm_stats()["worker_error_norm"], 0.0)


@pytest.mark.parametrize("dead", [1, 64])  # of 4096: kept as indices / as packed bits for the decode
def test_zero_variance_coordinates_do_not_explode_after_the_freeze(caplog, dead):
    """A coordinate with no gradient during warmup (a dead ReLU unit, an unused embedding row) has
    a frozen variance of 0; a 1-bit momentum cannot be 0, so m / (sqrt(v) + eps) would be
    +-scale / 1e-8. Such coordinates keep a zero momentum and do not move, and the log says how many."""
    p = torch.nn.Parameter(torch.ones(4096))
    opt = OnebitAdam([p], lr=1e-2, freeze_step=3, comm_backend_name="local")
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="onebit"):
        for step in range(8):
            g = torch.randn(4096, generator=gen)
            if step < 3:
                g[:dead] = 0.0
            p.grad = g
            opt.step()
    assert (opt._buckets[0].derived.frozen_keep is not None) == (dead == 64)  # both representations ran
    assert torch.equal(p.detach()[:dead], torch.ones(dead))
    assert torch.all(opt.state[p]["exp_avg"][:dead] == 0)
    # The others moved by lr * m / sqrt(v) per step: large where v is small, but nothing like the
    # lr * scale / eps (> 1e4 here) of a zero-variance coordinate.
    assert (p.detach()[dead:] - 1).abs().max() < 100.0
    assert not torch.equal(p.detach()[dead:], torch.ones(4096 - dead))
    assert any(f"{dead} coordinates with zero variance keep a zero momentum" in r.message for r in caplog.records)


@pytest.mark.parametrize("zeros", [1, 400])  # of 4000: indices, or packed bits for the decode
def test_momentum_mask_in_compression_keeps_masked_coordinates_at_zero(zeros):
    """Whichever way the mask is held, masked coordinates keep m = 0 and do not move; the others move."""
    p = torch.nn.Parameter(torch.ones(4000))
    mask = torch.ones(4000)
    mask[torch.randperm(4000, generator=torch.Generator().manual_seed(1))[:zeros]] = 0
    opt = OnebitAdam([p], lr=1e-2, freeze_step=2, comm_backend_name="local", momentum_masks={p: mask})
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        p.grad = torch.randn(4000, generator=gen)
        opt.step()
        assert torch.all(opt.state[p]["exp_avg"][mask == 0] == 0)
        assert torch.equal(p.detach()[mask == 0], torch.ones(zeros))
    assert (opt._buckets[0].derived.frozen_keep is not None) == (zeros == 400)
    assert torch.all(opt._buckets[0].buffers["exp_avg"][4000:] == 0)  # the padding stays 0 too
    assert torch.all(p.detach()[mask == 1] != 1)


def test_compression_reads_gradients_in_place_exactly_as_an_unscaled_copy():
    """In compression the momentum is updated from ``p.grad`` directly; with a GradScaler the
    gradients are first copied and unscaled. A power-of-two loss scale unscales exactly, so the
    two paths must give bit-identical trajectories."""
    results = []
    for scale in (None, 2.0**10):
        model = _model(tensors=2)
        opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="local")
        scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**6)
        for step in range(6):
            x, y = _batch(step)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        assert opt.phase == "compression" and opt.step_count == 6
        results.append(clone_params(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_huge_finite_gradients_are_not_taken_for_an_overflow():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = OnebitAdam([p], lr=1e-3, freeze_step=1, comm_backend_name="local")
    for _ in range(2):  # warmup, then compression (where the finiteness check runs on local grads)
        p.grad = torch.full((4,), 3e38)  # the float32 sum overflows; every element is finite
        opt.step()
    assert opt.step_count == 2
    assert opt.comm_stats()["compression"]["skipped_steps"] == 0


def test_state_dict_and_load_hooks_run_as_in_torch(tmp_path):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="local")
    _train(model, opt, 3)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("save post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o.step_count)))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    onebit.save_checkpoint(tmp_path / "c.pt", opt)
    onebit.load_checkpoint(tmp_path / "c.pt", opt)
    assert calls == ["save pre", "save post", "load pre", ("load post", 3)] * 2


def test_compression_releases_the_full_precision_scratch_buffers():
    """Warmup needs the gradients end to end for the all-reduce, and a flat buffer in the padded
    layout that holds the averaged gradient, then the update (8 bytes per parameter); compression
    reads p.grad and updates p in place, so it gives them back."""
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="local")
    bucket = opt._buckets[0]
    _train(model, opt, 2)
    assert sorted(bucket._scratch) == ["update", "wire"]
    _train(model, opt, 2, start=2)
    assert bucket._scratch == {}
    opt.load_state_dict(opt.state_dict())  # still compression: nothing to allocate again
    _train(model, opt, 1, start=4)
    assert bucket._scratch == {}
