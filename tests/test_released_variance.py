"""1-bit Adam with a bfloat16 preconditioner releases the frozen variance once compression starts
(issue 43): its bfloat16 ``1 / d`` is the state, and the variance is derived again from it where
it is needed (the state dict, a new layout, another ``eps``).

The oracles: ``1 / d`` computed here from the variance, float32 operation by float32 operation
(what the optimizer derives: ``sqrt(v) / sqrt(bc2) + eps``, its reciprocal, rounded once to
bfloat16); and the same optimizer with the release turned off, which holds the variance and
derives the same ``1 / d`` from it: releasing must change no bit of a run."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from conftest import tiny_mlp
from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from onebit.frozen import FrozenVarianceOptimizer

BF16 = torch.bfloat16


def _inverse(v: torch.Tensor, eps: float, bc2: float) -> torch.Tensor:
    d = torch.sqrt(v)
    if bc2 != 1.0:
        d = d / bc2**0.5
    return torch.reciprocal(d + eps).masked_fill_(v == 0, 0.0).to(BF16)


def _denominator(v: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    return torch.sqrt(v) + eps


def _variance_sweep() -> torch.Tensor:
    """Float32 variances over every exponent (normal and subnormal), largest and 0 included."""
    bits = torch.arange(0, 0x7F800000, 9973, dtype=torch.int64)
    bits = torch.cat([bits, torch.tensor([0x7F7FFFFF, 1, 0x00800000, 0])])
    return bits.to(torch.int32).view(torch.float32)


def _compact(params, **kwargs) -> OnebitAdam:
    return OnebitAdam(params, lr=1e-3, comm_backend_name="local", preconditioner_dtype=BF16, **kwargs)


@pytest.mark.parametrize("eps", [1e-8, 1e-3, 1e-20])
@pytest.mark.parametrize("freeze_step", [1, 3])
def test_the_saved_variance_derives_the_held_inverse_bit_for_bit(eps, freeze_step):
    v = _variance_sweep()
    p = torch.nn.Parameter(torch.zeros(v.numel()))
    opt = _compact([p], freeze_step=freeze_step, eps=eps, bias_correction=True)
    for _ in range(freeze_step):
        p.grad = torch.full_like(p, 1e-3)
        opt.step()
    with torch.no_grad():  # the variance of the sweep, frozen at the switch
        opt.state[p]["exp_avg_sq"].copy_(v)
    p.grad = torch.full_like(p, 1e-3)
    opt.step()
    assert "exp_avg_sq" not in opt.state[p]
    bc2 = 1 - 0.999**freeze_step
    (bucket,) = opt._buckets
    held = opt._frozen_denominator.held_inverse(bucket)[:v.numel()]
    assert torch.equal(held.view(torch.int16), _inverse(v, eps, bc2).view(torch.int16))
    saved = opt.state_dict()["state"][0]["exp_avg_sq"]
    assert saved.dtype == torch.float32 and bool((saved >= 0).all()) and bool(torch.isfinite(saved).all())
    assert torch.equal(_inverse(saved, eps, bc2).view(torch.int16), held.view(torch.int16))
    # the variance to bfloat16's precision where it is well above eps**2
    clear = (v > 1e4 * eps**2) & (v > 1e-30) & (v < 1e30)
    assert torch.allclose(saved[clear], v[clear], rtol=2**-6, atol=0)


def _maybe(release, releases):
    return lambda opt, bucket: release and releases(opt, bucket)


def _train(release: bool, monkeypatch, build=None, **kwargs):
    """A run through every path that reads the state from outside a step: a copy, a layer frozen
    and unfrozen (a new layout), and an exact resume from the state dict into a new optimizer."""
    build = build or _compact
    for cls in (FrozenVarianceOptimizer, ZeroOneAdam):
        monkeypatch.setattr(cls, "_releases_variance", _maybe(release, cls._releases_variance))
    model = tiny_mlp(6, 16, 3)
    opt = build(model.parameters(), freeze_step=3, weight_decay=0.01, **kwargs)
    trajectory, variance_held = [], []

    def step(t):
        gen = torch.Generator().manual_seed(t)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
        variance_held.append(any("exp_avg_sq" in b.buffers for b in opt._buckets))

    for t in range(1, 6):
        step(t)
    model, opt = copy.deepcopy((model, opt))
    for t in range(6, 8):
        step(t)
    model[0].requires_grad_(False)
    for t in range(8, 10):
        step(t)
    model[0].requires_grad_(True)
    for t in range(10, 12):
        step(t)
    saved, errors = opt.state_dict(), [(w.clone(), s.clone()) for w, s in opt.compression_errors()]
    opt = build(model.parameters(), freeze_step=3, weight_decay=0.01, **kwargs)
    opt.restore(saved, errors)
    for t in range(12, 15):
        step(t)
    return trajectory, variance_held, saved


@pytest.mark.parametrize("extra", [{}, {"compression_space": "momentum"}, {"overlap_backward": True}],
                         ids=["preconditioned", "momentum", "overlap"])
def test_releasing_the_variance_changes_no_bit(extra, monkeypatch):
    released, held_r, saved_r = _train(True, monkeypatch, **extra)
    kept, held_k, saved_k = _train(False, monkeypatch, **extra)
    for t, (a, b) in enumerate(zip(released, kept), start=1):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), t
    assert held_k == [True] * len(held_k)
    assert held_r == [True] * 3 + [False] * (len(held_r) - 3)  # (released after the first compressed update)
    # saved: the variance kept, and the one derived from 1 / d, which loads into the same 1 / d
    for entry_r, entry_k in zip(saved_r["state"].values(), saved_k["state"].values()):
        assert entry_r.keys() == entry_k.keys()
        assert torch.equal(entry_r["exp_avg"], entry_k["exp_avg"])
        assert not torch.equal(entry_r["exp_avg_sq"], entry_k["exp_avg_sq"])
        assert torch.equal(_inverse(entry_r["exp_avg_sq"], 1e-8, 1.0), _inverse(entry_k["exp_avg_sq"], 1e-8, 1.0))


def _wide_adam(params, **kwargs):
    return OnebitAdam(params, lr=1e-3, comm_backend_name="local", preconditioner_dtype=torch.float32, **kwargs)


@functools.cache
def _lamb(dtype):
    def build(params, **kwargs):
        return OnebitLamb(params, lr=1e-3, comm_backend_name="local", preconditioner_dtype=dtype, **kwargs)
    return build


@functools.cache
def _zero_one(space):
    def build(params, freeze_step, **kwargs):
        return ZeroOneAdam(params, lr=1e-3, comm_backend_name="local", var_freeze_step=freeze_step, var_update_scaler=1,
                           local_step_scaler=2, local_step_clipper=4, compression_space=space, **kwargs)
    return build


@pytest.mark.parametrize("build", [_wide_adam, _lamb(torch.float32), _lamb(BF16), _zero_one("momentum"),
                                   _zero_one("preconditioned")],
                         ids=["adam-float32", "lamb-float32", "lamb-bfloat16", "zero-one", "zero-one-preconditioned"])
@pytest.mark.parametrize("overlap", [False, True])
def test_releasing_a_variance_that_d_and_its_inverse_stand_for_changes_no_bit(build, overlap, monkeypatch):
    """A float32 preconditioner holds ``d`` and ``1 / d`` in the preconditioned space: they stand for
    the variance, released (1-bit LAMB's live trust ratio reads nothing else either); 0/1 Adam's
    denominator stands for it in phase 2. The saved variance is one that gives the same ``d``, bit
    for bit (:func:`onebit.functional.variance_of_denominator`)."""
    released, held_r, saved_r = _train(True, monkeypatch, build, overlap_backward=overlap)
    kept, held_k, saved_k = _train(False, monkeypatch, build, overlap_backward=overlap)
    for t, (a, b) in enumerate(zip(released, kept), start=1):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), t
    assert held_k == [True] * len(held_k)
    assert held_r == [True] * 3 + [False] * (len(held_r) - 3)
    for entry_r, entry_k in zip(saved_r["state"].values(), saved_k["state"].values()):
        assert entry_r.keys() == entry_k.keys()
        assert torch.equal(entry_r["exp_avg"], entry_k["exp_avg"])
        if build is _lamb(BF16):  # (what a bfloat16 preconditioner holds: 1 / d, rounded once)
            assert torch.equal(_inverse(entry_r["exp_avg_sq"], 1e-8, 1.0), _inverse(entry_k["exp_avg_sq"], 1e-8, 1.0))
        else:
            assert torch.equal(_denominator(entry_r["exp_avg_sq"]), _denominator(entry_k["exp_avg_sq"]))
        assert torch.equal(entry_r["exp_avg_sq"] == 0, entry_k["exp_avg_sq"] == 0)


def test_the_released_variance_holds_two_bytes_a_parameter_instead_of_four(monkeypatch):
    def held(release):
        releases = FrozenVarianceOptimizer._releases_variance
        monkeypatch.setattr(FrozenVarianceOptimizer, "_releases_variance", lambda opt, b: release and releases(opt, b))
        p = torch.nn.Parameter(torch.zeros(1000))
        opt = _compact([p], freeze_step=1)
        for _ in range(2):
            p.grad = torch.randn_like(p)
            opt.step()
        (bucket,) = opt._buckets
        return sum(b.nbytes for b in bucket.buffers.values()), opt._frozen_denominator.held_inverse(bucket).nbytes
    (released, inverse), (kept, same) = held(True), held(False)
    assert inverse == same == 2 * 1000 and kept - released == 4 * 1000


def test_another_eps_derives_from_the_variance_the_inverse_stands_for():
    p = torch.nn.Parameter(torch.zeros(64))
    opt = _compact([p], freeze_step=1, eps=1e-3)  # (bias_correction=False: bc2 1)
    for t in range(3):
        p.grad = torch.randn(64, generator=torch.Generator().manual_seed(t))
        opt.step()
    saved = opt.state_dict()["state"][0]["exp_avg_sq"]
    opt.param_groups[0]["eps"] = 1e-2
    p.grad = torch.randn(64)
    opt.step()
    (bucket,) = opt._buckets
    held = opt._frozen_denominator.held_inverse(bucket)[:64]
    assert torch.equal(held.view(torch.int16), _inverse(saved, 1e-2, 1.0).view(torch.int16))


def test_loads_into_and_out_of_float32_state():
    """A float32-preconditioner checkpoint loads into the compact optimizer (released at once) and
    the compact one's into a float32 optimizer, whose variance is then the saved one."""
    model = tiny_mlp(6, 16, 3)
    wide = OnebitAdam(model.parameters(), lr=1e-3, comm_backend_name="local", freeze_step=2,
                      preconditioner_dtype=torch.float32)
    for t in range(4):
        model(torch.randn(4, 6)).square().mean().backward()
        wide.step()
    narrow = _compact(model.parameters(), freeze_step=2)
    narrow.load_state_dict(wide.state_dict())  # in compression: released at once
    assert not any("exp_avg_sq" in narrow.state[p] for p in model.parameters())
    model(torch.randn(4, 6)).square().mean().backward()
    narrow.step()
    saved = narrow.state_dict()
    back = OnebitAdam(model.parameters(), lr=1e-3, comm_backend_name="local", freeze_step=2,
                      preconditioner_dtype=torch.float32)
    back.load_state_dict(saved)  # (in compression: the float32 d and 1 / d held, the variance released too)
    resaved = back.state_dict()
    for i, p in enumerate(model.parameters()):
        assert "exp_avg_sq" not in back.state[p]
        again, loaded = resaved["state"][i]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"]
        assert torch.equal(_denominator(again), _denominator(loaded))  # (the same float32 d and 1 / d: exact)
        assert torch.equal(again == 0, loaded == 0)
        v, w = wide.state_dict()["state"][i]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"]
        assert torch.allclose(w, v, rtol=2**-6, atol=math.sqrt(1e-8) * 1e-6)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_lamb_keeps_its_variance_for_the_frozen_rule_only(dtype):
    """1-bit LAMB's frozen rule reads the frozen variance itself (its factor, its fresh variance):
    kept; the live trust ratio reads ``d`` and ``1 / d`` alone: released."""
    for rule, kept in (("frozen", True), ("live", False)):
        model = tiny_mlp(6, 16, 3)
        opt = OnebitLamb(model.parameters(), lr=1e-3, comm_backend_name="local", freeze_step=1,
                         preconditioner_dtype=dtype, trust_ratio=rule)
        for _ in range(3):
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
        assert all(("exp_avg_sq" in opt.state[p]) == kept for p in model.parameters()), rule


def test_a_bucket_with_a_momentum_mask_keeps_its_variance():
    """``1 / d`` is 0 under a mask, which cannot stand for the variance there: such buckets keep it."""
    model = tiny_mlp(6, 16, 3)
    weight = model[0].weight
    mask = torch.ones_like(weight)
    mask[:, :2] = 0
    opt = _compact(model.parameters(), freeze_step=1, momentum_masks={weight: mask}, bucket_size=weight.numel())
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    assert "exp_avg_sq" in opt.state[weight] and bool((opt.state[weight]["exp_avg_sq"][:, :2] > 0).all())
    assert not all("exp_avg_sq" in opt.state[p] for p in model.parameters())  # (the unmasked buckets released it)


def test_saved_variances_are_tensors_of_their_own():
    """Each saved ``exp_avg_sq`` has storage of its parameter's size (``torch.save`` of one entry
    writes that entry, not its bucket)."""
    model = tiny_mlp(6, 16, 3)
    opt = _compact(model.parameters(), freeze_step=1)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    for entry, p in zip(opt.state_dict()["state"].values(), model.parameters()):
        assert entry["exp_avg_sq"].untyped_storage().nbytes() == 4 * p.numel()


def test_loads_that_change_the_numerics_say_so(caplog):
    """A momentum-space checkpoint restored into the defaults (bfloat16 state for the preconditioned
    space) warns; float32 errors restored into bfloat16 ones are said to be rounded."""
    model = tiny_mlp(6, 16, 3)
    wide = OnebitAdam(model.parameters(), lr=1e-3, comm_backend_name="local", freeze_step=1,
                      compression_space="momentum")
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        wide.step()
    errors = [(w.clone(), s.clone()) for w, s in wide.compression_errors()]
    assert errors and errors[0][0].dtype == torch.float32
    narrow = OnebitAdam(model.parameters(), lr=1e-3, comm_backend_name="local", freeze_step=1)
    with caplog.at_level("INFO", logger="onebit"):
        narrow.restore(wide.state_dict(), errors)
        model(torch.randn(4, 6)).square().mean().backward()
        narrow.step()
    text = caplog.text
    assert "restores compression_space='momentum'" in text and "float32" in text
    assert "rounded from torch.float32 to torch.bfloat16: not an exact resume" in text


@pytest.mark.parametrize("eps", [1e-8, 1e-3, 1e-20, 1.0])
@pytest.mark.parametrize("bc2", [1.0, 1 - 0.999**3, 0.5])
def test_a_float32_denominator_gives_back_a_variance_of_the_same_denominator(eps, bc2, monkeypatch):
    """:func:`onebit.functional.variance_of_denominator` over every float32 exponent (normal and
    subnormal, largest and 0), in pieces of 4099 elements: ``sqrt(v') / sqrt(bc2) + eps`` is the
    given ``d`` bit for bit, ``v'`` is 0 exactly where the variance was (``live`` says where), and
    ``v'`` is ``v`` itself where ``d`` resolves it."""
    from onebit import functional

    monkeypatch.setattr(functional, "WIDEN_CHUNK", 4099)
    v = _variance_sweep()
    d = functional.adam_denominator_(torch.empty_like(v), v, eps, bc2)
    again = functional.variance_of_denominator(d, eps, bc2, v != 0)
    assert torch.equal(functional.adam_denominator_(torch.empty_like(again), again, eps, bc2), d)
    assert torch.equal(again == 0, v == 0) and bool((again >= 0).all())
    clear = (v.sqrt() > 1e4 * eps) & (v > 1e-30) & (v < 1e30)
    assert clear.sum() > 1000 and torch.allclose(again[clear], v[clear], rtol=1e-6, atol=0)
