"""1-bit Adam with a bfloat16 preconditioner releases the frozen variance once compression starts
(issue 43): its bfloat16 ``1 / d`` is the state, and the variance is derived again from it where
it is needed (the state dict, a new layout, another ``eps``).

The oracles: ``1 / d`` computed here from the variance, float32 operation by float32 operation
(what the optimizer derives: ``sqrt(v) / sqrt(bc2) + eps``, its reciprocal, rounded once to
bfloat16); and the same optimizer with the release turned off, which holds the variance and
derives the same ``1 / d`` from it: releasing must change no bit of a run."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import tiny_mlp
from onebit import OnebitAdam, OnebitLamb

BF16 = torch.bfloat16


def _inverse(v: torch.Tensor, eps: float, bc2: float) -> torch.Tensor:
    d = torch.sqrt(v)
    if bc2 != 1.0:
        d = d / bc2**0.5
    return torch.reciprocal(d + eps).masked_fill_(v == 0, 0.0).to(BF16)


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


def _train(release: bool, monkeypatch, **kwargs):
    """A run through every path that reads the state from outside a step: a copy, a layer frozen
    and unfrozen (a new layout), and an exact resume from the state dict into a new optimizer."""
    monkeypatch.setattr(OnebitAdam, "_VARIANCE_RELEASED", release)
    model = tiny_mlp(6, 16, 3)
    opt = _compact(model.parameters(), freeze_step=3, weight_decay=0.01, **kwargs)
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
    opt = _compact(model.parameters(), freeze_step=3, weight_decay=0.01, **kwargs)
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


def test_the_released_variance_holds_two_bytes_a_parameter_instead_of_four(monkeypatch):
    def held(release):
        monkeypatch.setattr(OnebitAdam, "_VARIANCE_RELEASED", release)
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
    back.load_state_dict(saved)
    for i, p in enumerate(model.parameters()):
        assert torch.equal(back.state[p]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"])
        v, w = wide.state_dict()["state"][i]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"]
        assert torch.allclose(w, v, rtol=2**-6, atol=math.sqrt(1e-8) * 1e-6)


def test_lamb_keeps_its_variance():
    """1-bit LAMB reads the frozen variance itself (its frozen rule, its fresh variance): not released."""
    model = tiny_mlp(6, 16, 3)
    opt = OnebitLamb(model.parameters(), lr=1e-3, comm_backend_name="local", freeze_step=1, preconditioner_dtype=BF16)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    assert all("exp_avg_sq" in opt.state[p] for p in model.parameters())


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
