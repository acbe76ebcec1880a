"""What each optimizer holds, by name, in each phase: the accounting of ``benchmarks/memory.py``
(:func:`held_buffers`, a walk over everything the optimizer object reaches) pinned per buffer, so
that a buffer that appears, or stays past the phase that needs it, fails here. Bytes, not RSS.

One rank (``comm_backend_name='local'``: the server error is then as long as the worker error), a
parameter of ``N`` elements and one of 1001 (so that the compressed layout pads), float32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import onebit
from onebit.compression import SegmentLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from memory import held_buffers  # noqa: E402

sys.path.pop(0)

N = 4096
SMALL = 1001
PADDED = SegmentLayout.build([N, SMALL], 1, None).padded  # the compressed layout's length
F32 = 4
ERRORS = {"bucket.compression._worker_error": PADDED * F32, "bucket.compression._server_error": PADDED * F32}
STATE = {"bucket.buffers[exp_avg]": PADDED * F32, "bucket.buffers[exp_avg_sq]": PADDED * F32}
WARMUP_SCRATCH = {"bucket._scratch[wire]": (N + SMALL + 2) * F32, "bucket._scratch[update]": PADDED * F32}


def _build(cls, **kwargs):
    params = [torch.nn.Parameter(torch.randn(N)), torch.nn.Parameter(torch.randn(SMALL))]
    return params, cls(params, comm_backend_name="local", **kwargs)


def _step(params, opt):
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


def _large(held: dict[str, int]) -> dict[str, int]:
    """The buffers of at least one byte per element (not the wire rows, scalars, masks' indices)."""
    return {name: size for name, size in held.items() if size >= PADDED}


def test_no_compression_errors_before_the_switch():
    params, opt = _build(onebit.OnebitAdam, freeze_step=3)
    state = opt._buckets[0].compression
    for _ in range(3):
        assert not state.allocated and not any("compression" in name for name in _large(held_buffers(opt)))
        _step(params, opt)
    assert opt.comm_stats()["worker_error_norm"] == 0.0 and not state.allocated  # reading the norms allocates nothing
    _step(params, opt)
    assert state.allocated and state.worker_error.abs().sum() > 0


@pytest.mark.parametrize("space", ["preconditioned", "momentum"])
def test_onebit_adam_holds_what_its_table_says(space):
    params, opt = _build(onebit.OnebitAdam, freeze_step=2, compression_space=space, preconditioner_dtype=torch.float32,
                         error_dtype=torch.float32)
    assert _large(held_buffers(opt)) == STATE
    _step(params, opt)
    _step(params, opt)
    assert _large(held_buffers(opt)) == {**STATE, **WARMUP_SCRATCH}
    _step(params, opt)
    frozen = {"_frozen_denominator._entries.flat": PADDED * F32}
    if space == "preconditioned":  # (d and 1 / d stand for the variance, released)
        frozen["_frozen_denominator._entries.inverse"] = PADDED * F32
        assert _large(held_buffers(opt)) == {"bucket.buffers[exp_avg]": PADDED * F32, **ERRORS, **frozen}
    else:
        assert _large(held_buffers(opt)) == {**STATE, **ERRORS, **frozen}


def test_onebit_adam_by_default_holds_its_compact_state():
    """``"auto"``: in the preconditioned space, bfloat16 errors and ``1 / d`` alone, the variance released."""
    params, opt = _build(onebit.OnebitAdam, freeze_step=2)
    for _ in range(3):
        _step(params, opt)
    assert _large(held_buffers(opt)) == {
        "bucket.buffers[exp_avg]": PADDED * F32, "_frozen_denominator._entries.views": PADDED * 2,
        "bucket.compression._worker_error": PADDED * 2, "bucket.compression._server_error": PADDED * 2}
    _, wide = _build(onebit.OnebitAdam, freeze_step=2, compression_space="momentum")
    assert wide.error_dtype == wide.preconditioner_dtype == torch.float32


def test_onebit_lamb_holds_what_its_table_says():
    params, opt = _build(onebit.OnebitLamb, freeze_step=2)
    _step(params, opt)
    _step(params, opt)
    assert _large(held_buffers(opt)) == {**STATE, **WARMUP_SCRATCH}
    _step(params, opt)
    assert _large(held_buffers(opt)) == {  # (the live trust ratio: d and 1 / d stand for the variance, released)
        "bucket.buffers[exp_avg]": PADDED * F32, **ERRORS, "bucket.buffers[smoothed_update]": PADDED * F32,
        "bucket._scratch[update]": PADDED * F32, "_frozen_denominator._entries.flat": PADDED * F32,
        "_frozen_denominator._entries.inverse": PADDED * F32}


def test_zero_one_adam_holds_what_its_table_says():
    """Phase 1's compressed-gradient steps take their input, and write their bounded update, where
    a variance step's averaged gradient lands (here, padded: the buffer it is spread into); phase 2
    holds its state alone (the frozen variance as its denominator): the bounded local step and the
    sync's clamp run a piece at a time."""
    params, opt = _build(onebit.ZeroOneAdam, var_freeze_step=6, var_update_scaler=1, local_step_scaler=2,
                         local_step_clipper=4)
    phase_one = {**STATE, "_still_denominator._entries.flat": PADDED * F32}
    kinds, held = [], []
    for _ in range(6):
        kinds.append(opt.phase)
        _step(params, opt)
        held.append(_large(held_buffers(opt)))
    assert kinds == ["variance", "compressed_gradient", "variance"] + ["compressed_gradient"] * 3, kinds
    assert held[0] == {**phase_one, **WARMUP_SCRATCH}
    assert held[1] == held[2] == held[5] == {**phase_one, **ERRORS, **WARMUP_SCRATCH}
    kinds = []
    for _ in range(4):  # phase 2: local steps and syncs; phase 1's scratch released
        kinds.append(opt.phase)
        _step(params, opt)
    assert {"local", "sync"} <= set(kinds), kinds
    assert _large(held_buffers(opt)) == {  # (the frozen variance released: its denominator stands for it)
        "bucket.buffers[exp_avg]": PADDED * F32, **ERRORS, "_still_denominator._entries.flat": PADDED * F32,
        "bucket.buffers[momentum_accumulator]": PADDED * F32, "bucket.buffers[sync_point]": PADDED * F32}


def test_diloco_allocates_its_errors_at_the_first_outer_step():
    """The errors come at the first outer step; the pseudo-gradient's buffer lives only through
    an outer step; the outer momentum exists only with outer_momentum > 0 (from construction)."""
    for momentum in (0.0, 0.9):
        params, opt = _build(onebit.OnebitDiLoCo, sync_every=3, outer_momentum=momentum)
        outer = {**STATE, "bucket.buffers[global_params]": PADDED * F32}
        if momentum:
            outer["bucket.buffers[outer_momentum_buffer]"] = PADDED * F32
        assert _large(held_buffers(opt)) == outer
        _step(params, opt)
        _step(params, opt)
        assert not opt._buckets[0].compression.allocated
        _step(params, opt)
        assert _large(held_buffers(opt)) == {**outer, **ERRORS}, momentum
        assert ("outer_momentum_buffer" in opt.state[params[0]]) == bool(momentum)


def test_held_buffers_counts_each_storage_once_and_never_the_parameters():
    params, opt = _build(onebit.OnebitAdam, freeze_step=1)
    _step(params, opt)
    held = held_buffers(opt)
    # the state's per-parameter entries are views of the bucket's buffers: named after the buffer, counted once
    assert not any(name.startswith("state") for name in held)
    adam_params = [torch.nn.Parameter(torch.randn(N))]
    adam = torch.optim.Adam(adam_params)
    adam_params[0].grad = torch.randn(N)
    adam.step()
    assert {k: v for k, v in held_buffers(adam).items() if v >= N} == {"state[exp_avg]": N * F32,
                                                                       "state[exp_avg_sq]": N * F32}


def test_a_warmup_step_holding_parameters_without_a_gradient_allocates_no_errors():
    """A parameter without a gradient is held through the step with its errors: in warmup there
    are none to hold, and none are allocated for it; at the first compressed step they are, and
    stay 0 for it."""
    params, opt = _build(onebit.OnebitAdam, freeze_step=1)
    params[0].grad, params[1].grad = torch.randn(N), None
    opt.step()
    state = opt._buckets[0].compression
    assert not state.allocated
    params[1].grad = None
    params[0].grad = torch.randn(N)
    opt.step()
    start = opt._buckets[0].layout.starts[1]
    assert state.allocated and state.worker_error[:start].abs().sum() > 0
    assert state.worker_error[start:].abs().sum() == 0 and state.server_error[start:].abs().sum() == 0


def _adam_oracle(params, grads_per_step, lr, betas, eps, weight_decay):
    """Adam with ``eps`` outside the root, bias-corrected, decoupled decay: OnebitAdam's warmup
    step, operation by operation (moments, the momentum a ``lerp``, ``m / (sqrt(v) / sqrt(bc2) + eps) / bc1``, then
    ``u + wd p`` and ``p - lr u``, each one rounding)."""
    params = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        bc1, bc2 = 1 - betas[0] ** t, 1 - betas[1] ** t
        for i, g in enumerate(grads):
            m[i].lerp_(g, 1 - betas[0])
            v[i].mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            u = m[i] / (torch.sqrt(v[i]) / bc2**0.5 + eps) / bc1
            params[i].add_(u.add_(params[i], alpha=weight_decay), alpha=-lr)
    return params


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_warmup_updates_in_pieces_without_a_buffer_of_the_direction(chunk, monkeypatch):
    """An unpadded bucket's warmup writes its update a piece at a time (here ``chunk`` elements):
    no ``update`` buffer is held, and the parameters are Adam's, bit for bit."""
    from onebit import functional

    monkeypatch.setattr(functional, "WIDEN_CHUNK", chunk)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(1024))]
    start = [p.detach().clone() for p in params]
    opt = onebit.OnebitAdam(params, lr=1e-2, freeze_step=100, weight_decay=0.1, bias_correction=True,
                            comm_backend_name="local")
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    (bucket,) = opt._buckets
    assert bucket.padded == bucket.numel and "update" not in bucket._scratch
    want = _adam_oracle(start, grads, 1e-2, (0.9, 0.999), 1e-8, 0.1)
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, want))


def test_a_bucket_with_a_bfloat16_parameter_keeps_the_whole_direction():
    """A piece boundary inside a bfloat16 parameter would round its tail elsewhere than the
    vectorized body: such buckets write the whole direction, as before."""
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(1024).bfloat16())]
    opt = onebit.OnebitAdam(params, lr=1e-2, freeze_step=100, comm_backend_name="local")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    (bucket,) = opt._buckets
    assert bucket.padded == bucket.numel and "update" in bucket._scratch


def _whole_bounded_sync(opt, bucket, group, averaged, denominator, totals, bc1):
    """A sync's move of the sync point over the whole buffers, op by op: ``avg(u)`` (or ``avg(u d) /
    d``, 0 where not finite) clamped to ``+-sum(lr) (update_bound B / bc1 + weight_decay |theta|)``
    per parameter (the padding's limit not multiplied), added to the sync point."""
    theta = bucket.buffers["sync_point"]
    if opt.compression_space == "preconditioned":
        move = averaged.clone()
    else:
        move = torch.div(averaged, denominator).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    bound = onebit.functional.update_bound(opt.update_bound, *group["betas"]) / bc1
    limit = theta.abs().mul_(group["weight_decay"]).add_(bound)
    for total, s in zip(totals, bucket.slices):
        limit[s].mul_(max(total, 0.0))
    theta.add_(torch.minimum(torch.maximum(move, -limit), limit))


def _zero_one_run(monkeypatch, chunk: int, whole: bool, space: str, bias_correction: bool) -> list[torch.Tensor]:
    from onebit import functional, zoadam

    monkeypatch.setattr(functional, "WIDEN_CHUNK", chunk)
    if whole:  # the local step's whole-buffer path, and a sync's clamp over the whole buffers
        monkeypatch.setattr(zoadam, "by_pieces", lambda bucket: False)
        monkeypatch.setattr(zoadam.ZeroOneAdam, "_bounded_sync", _whole_bounded_sync)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37, 11)), torch.nn.Parameter(torch.randn(301)),
              torch.nn.Parameter(torch.randn(5))]
    opt = onebit.ZeroOneAdam(params, lr=1e-2, weight_decay=0.05, var_freeze_step=10, var_update_scaler=2,
                             local_step_scaler=3, local_step_clipper=4, bias_correction=bias_correction,
                             compression_space=space, comm_backend_name="local")
    generator = torch.Generator().manual_seed(1)
    kinds = set()
    for t in range(30):
        for p in params:  # (small gradients now and then: the bound clamps)
            p.grad = torch.randn(p.shape, generator=generator) * (1e-3 if t % 5 == 0 else 1.0)
        kinds.add(opt.phase)
        opt.step()
    assert kinds == {"variance", "compressed_gradient", "local", "sync"}
    state = [opt.state[p][key] for p in params for key in ("exp_avg", "momentum_accumulator", "sync_point")]
    return [p.detach().clone() for p in params] + state


@pytest.mark.parametrize("space", ["momentum", "preconditioned"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_zero_one_adam_bounded_steps_in_pieces_are_the_whole_buffers_steps(monkeypatch, space, bias_correction):
    """0/1 Adam's bounded local steps and syncs run a piece of the flat buffers at a time (here 7
    elements: pieces end inside parameters): parameters and state are those of the whole clamped
    ``m / d`` in one buffer and of a sync clamped over the whole buffers (written out above), bit
    for bit."""
    with monkeypatch.context() as patch:
        pieces = _zero_one_run(patch, 7, False, space, bias_correction)
    with monkeypatch.context() as patch:
        whole = _zero_one_run(patch, 1 << 30, True, space, bias_correction)
    assert all(torch.equal(a, b) for a, b in zip(pieces, whole))


def test_zero_one_adam_phase_one_holds_one_buffer_of_gradients_where_nothing_is_padded():
    """Unpadded: a compressed-gradient step's input is the full-precision all-reduce's own buffer,
    kept between the kinds of step (no other buffer of the bucket's size)."""
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(1024))]
    opt = onebit.ZeroOneAdam(params, var_freeze_step=6, var_update_scaler=1, comm_backend_name="local")
    for _ in range(6):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        (bucket,) = opt._buckets
        assert bucket.padded == bucket.numel and set(bucket._scratch) == {"wire"}, set(bucket._scratch)
    assert bucket.compressed is not None and bucket.compressed.data_ptr() == bucket._scratch["wire"].data_ptr()
    bucket.release_scratch()  # (as phase 2 begins: the last compressed input, a view of it, goes too)
    assert bucket.compressed is None
