"""Faults under distribution: non-finite gradients, GradScaler, layout mismatch, a dead rank."""

from __future__ import annotations

import os
import time

import pytest
import torch

from conftest import clone_params, tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam

pytestmark = pytest.mark.slow  # every test spawns gloo ranks


def _model(width: int = 6) -> torch.nn.Module:
    return tiny_mlp(width, 4, 2)


def _backward(model, rank: int, step: int, scaler=None) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, model[0].in_features, generator=gen), torch.randn(8, 2, generator=gen)
    model.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    (loss if scaler is None else scaler.scale(loss)).backward()


def _state(model, opt):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
        # (as saved: 1-bit Adam's defaults release the variance after the freeze, holding 1 / d in bfloat16)
        "exp_avg_sq": [opt.state_dict()["state"][i]["exp_avg_sq"] for i, _ in enumerate(model.parameters())],
        "errors": [(b.compression.worker_error.clone(), b.compression.server_error.clone()) for b in opt._buckets],
        "step": opt.step_count,
    }


def _same(a, b) -> bool:
    flat = lambda s: s["params"] + s["exp_avg"] + s["exp_avg_sq"] + [t for pair in s["errors"] for t in pair]
    return a["step"] == b["step"] and all(torch.equal(x, y) for x, y in zip(flat(a), flat(b)))


def _nan_rank(rank, world_size, nan_step, policy):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, comm_backend_name="gloo", nonfinite_grads=policy)
    before = after = None
    raised = None
    for step in range(1, 7):
        _backward(model, rank, step)
        if step == nan_step and rank == world_size - 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        if step == nan_step:
            before = _state(model, opt)
        try:
            opt.step()
        except FloatingPointError as exc:
            raised = str(exc)
            break
        if step == nan_step:
            after = _state(model, opt)
    return {"before": before, "after": after, "raised": raised, "final": _state(model, opt),
            "stats": opt.comm_stats()}


@pytest.mark.parametrize("nan_step, phase", [(2, "warmup"), (5, "compression")])
def test_nan_on_one_rank_skips_the_step_everywhere(tmp_path, nan_step, phase):
    results = run_ranks(_nan_rank, 2, tmp_path, nan_step, "skip")
    for r in results:
        assert _same(r["before"], r["after"]), "a skipped step must leave everything untouched"
        assert r["stats"][phase]["skipped_steps"] == 1
        assert r["final"]["step"] == 5  # 6 calls, one skipped
        assert all(torch.isfinite(t).all() for t in r["final"]["params"])
    # compression errors are rank-local; everything else is identical across ranks
    shared = lambda s: {**s, "errors": []}
    assert _same(shared(results[0]["final"]), shared(results[1]["final"]))


@pytest.mark.parametrize("nan_step", [2, 5])
def test_nan_with_raise_policy_raises_on_every_rank(tmp_path, nan_step):
    results = run_ranks(_nan_rank, 2, tmp_path, nan_step, "raise")
    for r in results:
        assert r["raised"] is not None and "non-finite gradients" in r["raised"]
        assert _same(r["before"], r["final"])


def _scaler_rank(rank, world_size):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="gloo")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    snapshots = []
    for step in range(1, 7):
        _backward(model, rank, step, scaler)
        if step in (2, 4) and rank == 0:  # a rank-local overflow, once in each phase
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return {"snapshots": snapshots, "step": opt.step_count}


def test_grad_scaler_overflow_on_one_rank_keeps_ranks_identical(tmp_path):
    results = run_ranks(_scaler_rank, 2, tmp_path)
    assert results[0]["step"] == results[1]["step"] == 4
    for a, b in zip(results[0]["snapshots"], results[1]["snapshots"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # the overflowing steps changed nothing
    assert all(torch.equal(x, y) for x, y in zip(results[0]["snapshots"][0], results[0]["snapshots"][1]))


def _unscaled_rank(rank, world_size, use_scaler):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="gloo")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    for step in range(1, 5):
        _backward(model, rank, step, scaler if use_scaler else None)
        if use_scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return clone_params(model.parameters())


def test_grad_scaler_unscales_before_communicating(tmp_path):
    plain = run_ranks(_unscaled_rank, 2, tmp_path, False)
    scaled = run_ranks(_unscaled_rank, 2, tmp_path / "scaled", True)
    for a, b in zip(plain[0], scaled[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _layout_rank(rank, world_size):
    model = _model(width=6 if rank == 0 else 7)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="gloo")
    _backward(model, rank, 1)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except ValueError as exc:
        return {"error": str(exc), "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters()))}
    return {"error": None}


def test_layout_mismatch_raises_the_same_error_on_every_rank(tmp_path):
    results = run_ranks(_layout_rank, 2, tmp_path, timeout=60)
    assert results[0]["error"] == results[1]["error"]
    assert "parameter layout differs between ranks: ranks [1] do not match rank 0" in results[0]["error"]
    assert results[0]["unchanged"] and results[1]["unchanged"]


def _peer_fails(rank, world_size, failure):
    """Three steps on both ranks; then rank 1 dies ("exit") or stalls ("stuck") and rank 0 times
    its next step, which must raise instead of hanging."""
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="gloo")
    for step in range(1, 4):
        _backward(model, rank, step)
        opt.step()
    if rank == 1:
        if failure == "exit":
            os._exit(0)  # a peer dies between steps, in the compression phase
        time.sleep(8)  # alive but stuck: never joins the next step's collectives
        return {"error": None, "seconds": 0.0}
    _backward(model, rank, 4)
    start = time.monotonic()
    try:
        opt.step()
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_dead_peer_makes_the_survivor_raise_within_the_timeout(tmp_path):
    results = run_ranks(_peer_fails, 2, tmp_path, "exit", timeout=90, collective_timeout=10, allow_missing=True)
    assert results[1] is None
    assert results[0]["error"] is not None
    assert results[0]["seconds"] < 10 + 5


def test_stuck_peer_makes_the_other_rank_raise_after_the_process_group_timeout(tmp_path):
    results = run_ranks(_peer_fails, 2, tmp_path, "stuck", timeout=90, collective_timeout=5)
    assert results[0]["error"] is not None
    assert 4 <= results[0]["seconds"] < 5 + 5
