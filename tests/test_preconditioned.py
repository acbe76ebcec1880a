"""``compression_space="preconditioned"`` (issue 27): the 1-bit all-reduce averages
``u = m / (sqrt(v) + eps)`` instead of ``m``, so a coordinate's 1-bit error is in units of Adam's
step there. Checked against an oracle written from the docstring, on 1 and 3 simulated ranks."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

from conftest import all_equal
from distributed import run_ranks
from onebit import OnebitAdam, OnebitLamb, from_config
from onebit.kernels import REFERENCE, registry
from onebit.testing import simulate_compressed_allreduce

LR, EPS, WD, BETAS, FREEZE = 1e-2, 1e-8, 0.01, (0.9, 0.999), 3
SHAPES = ((40,), (6, 5))


def _grads(rank: int, t: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * t + rank)
    grads = [torch.randn(shape, generator=gen) for shape in SHAPES]
    if t <= FREEZE:
        grads[0][:4] = 0.0  # four coordinates without variance: kept at zero momentum afterwards
    # multiples of 2**-12: sums over ranks are exact in any order
    return [g.mul(2.0**12).round_().div_(2.0**12) for g in grads]


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]


def oracle(n: int, steps: int, update_bound: float | None = None, clamped: list | None = None,
           preconditioner_dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """1-bit Adam in the preconditioned space for ``n`` simulated ranks, tensor by tensor: warmup
    is Adam on the mean gradient; then ``m_r = lerp(m, g_r)``, ``u_r = m_r * (1 / d)`` (0 where
    ``v == 0``; with ``update_bound`` c, clamped to ``+-c (1 - b1) / sqrt((1 - b2) (1 - b1**2 / b2))``),
    ``u = compressed mean of u_r`` (0 where ``v == 0``), ``m = u d``, ``p = p (1 - lr wd) - lr m / d``.
    ``clamped`` (a list) receives the number of coordinates the bound changed at each compressed step.
    ``preconditioner_dtype=torch.bfloat16``: ``1 / d`` rounded once to bfloat16, ``m = u / (1 / d)``
    (0 where it is 0), ``p = p (1 - lr wd) - lr m (1 / d)``."""
    b1, b2 = BETAS
    params = [p.detach().clone() for p in _params()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    errors = [(None, None)] * len(params)
    out = []
    for t in range(1, steps + 1):
        grads = [_grads(r, t) for r in range(n)]
        for i in range(len(params)):
            if t <= FREEZE:
                g = sum(grads[r][i] for r in range(n)) / n
                m[i] = torch.lerp(m[i], g, 1 - b1)
                v[i] = torch.addcmul(v[i] * b2, g, g, value=1 - b2)
                update = torch.add(m[i] / (v[i].sqrt() + EPS), params[i], alpha=WD)
                params[i] = torch.add(params[i], update, alpha=-LR)
                continue
            d = v[i].sqrt() + EPS
            keep = v[i] != 0
            inverse = torch.where(keep, torch.reciprocal(d), 0.0).to(preconditioner_dtype)
            local = [(torch.lerp(m[i], grads[r][i], 1 - b1) * inverse).reshape(-1) for r in range(n)]
            if update_bound is not None:
                bound = update_bound * (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
                if clamped is not None:
                    clamped.append(sum(int((x.abs() > bound).sum()) for x in local))
                local = [x.clamp(-bound, bound) for x in local]
            sim = simulate_compressed_allreduce(local, *errors[i])
            errors[i] = (sim.worker_errors, sim.server_errors)
            u = torch.where(keep, sim.output.view_as(d), 0.0)
            if preconditioner_dtype == torch.float32:
                m[i] = u * d
                params[i] = torch.addcdiv(params[i] * (1.0 - LR * WD), m[i], d, value=-LR)
            else:
                m[i] = torch.where(inverse != 0, u / inverse, 0.0)
                params[i] = torch.addcmul(params[i] * (1.0 - LR * WD), m[i], inverse, value=-LR)
        out.append([p.clone() for p in params])
    return out


def _train(rank: int, world_size: int, steps: int, backend: str | None = None,
           kernels: str = "auto", update_bound: float | None = None,
           preconditioner_dtype: torch.dtype | None = None) -> list[list[torch.Tensor]]:
    params = _params()
    opt = OnebitAdam(params, lr=LR, freeze_step=FREEZE, betas=BETAS, eps=EPS, weight_decay=WD,
                     comm_backend_name=backend, compression_space="preconditioned", kernels=kernels,
                     update_bound=update_bound, preconditioner_dtype=preconditioner_dtype, error_dtype=torch.float32)
    out = []
    for t in range(1, steps + 1):
        for p, g in zip(params, _grads(rank, t)):
            p.grad = g
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


# The reference codec as a kernel set without ``multipliers``: the engine multiplies in passes of its own;
# and one that multiplies as it reads but takes no ``limit=`` (a kernel set written before it): the
# engine multiplies and clamps in a pass of its own.
registry.register("reference-unfused", lambda: dataclasses.replace(REFERENCE, name="reference-unfused",
                                                                   multipliers=False))


def _no_limit(x, error, packed, **kwargs):
    if "limit" in kwargs:
        raise TypeError("worker_compress_() got an unexpected keyword argument 'limit'")
    return REFERENCE.worker_compress_(x, error, packed, **kwargs)


registry.register("reference-nolimits", lambda: dataclasses.replace(REFERENCE, name="reference-nolimits",
                                                                    worker_compress_=_no_limit, limits=False))


def _no_divisor(signs, scales, out, keep=None, **kwargs):
    if "divisor" in kwargs:
        raise TypeError("decode_() got an unexpected keyword argument 'divisor'")
    return REFERENCE.decode_(signs, scales, out, keep, **kwargs)


# A kernel set of float32 multipliers and no divisor= (as the CUDA kernels): the engine widens a
# bfloat16 multiplier and divides in a pass of its own.
registry.register("reference-nodivisors", lambda: dataclasses.replace(
    REFERENCE, name="reference-nodivisors", decode_=_no_divisor, divisors=False, multiplier_dtypes=(torch.float32,)))


@pytest.mark.parametrize("update_bound", [None, 0.02])
@pytest.mark.parametrize("kernels", ["cpu", "reference", "reference-unfused", "reference-nolimits", "reference-nodivisors"])
def test_one_rank_matches_the_oracle(kernels, update_bound):
    """With the multiplies in the codec's passes (``cpu``, ``reference``) or in passes of their
    own (a kernel set without ``multipliers``), with and without
    ``update_bound`` (its clamp in the codec's worker pass, or in the multiply's pass of its own):
    the oracle, bit for bit."""
    clamped = []
    got, want = _train(0, 1, 8, "local", kernels, update_bound), oracle(1, 8, update_bound, clamped)
    for t, (a, b) in enumerate(zip(got, want), start=1):
        assert all_equal(a, b), t
    if update_bound is not None:  # the bound changed what was compressed: the comparison can tell
        assert sum(clamped) > 0, clamped
        assert not all_equal(want[-1], oracle(1, 8)[-1])
    # preconditioner_dtype=torch.bfloat16: 1 / d alone, in bfloat16 (the decode divides by it where the
    # kernels can, in a pass of its own where they cannot; a bfloat16 multiplier widened where they cannot take it)
    narrow = oracle(1, 8, update_bound, preconditioner_dtype=torch.bfloat16)
    got = _train(0, 1, 8, "local", kernels, update_bound, torch.bfloat16)
    for t, (a, b) in enumerate(zip(got, narrow), start=1):
        assert all_equal(a, b), t
    assert not all_equal(narrow[-1], want[-1])


@pytest.mark.slow
@pytest.mark.parametrize("preconditioner_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("update_bound", [None, 0.02])
def test_three_gloo_ranks_match_the_oracle(tmp_path, update_bound, preconditioner_dtype):
    results = run_ranks(_train, 3, tmp_path, 8, None, "auto", update_bound, preconditioner_dtype)
    want = oracle(3, 8, update_bound, preconditioner_dtype=preconditioner_dtype)
    for t in range(8):
        for rank in range(3):
            assert all_equal(results[rank][t], want[t]), (rank, t + 1)


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_a_tiny_frozen_variance_cannot_take_a_huge_step(cls):
    """The mechanism of issue 27: a coordinate whose warmup gradients were tiny (a rare token's
    embedding row) has a tiny frozen variance; in the momentum space its decoded momentum is the
    segment's scale (set by the other coordinates), and its step ``lr * scale / (sqrt(v) + eps)``
    is thousands of ``lr``. In the preconditioned space the scale is one of Adam steps: a few ``lr``."""
    largest = {}
    for space in ("momentum", "preconditioned"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1000))
        opt = cls([p], lr=1e-3, freeze_step=5, comm_backend_name="local", compression_space=space)
        moves = []
        for t in range(20):
            g = torch.randn(1000)
            g[:10] *= 1e-4  # rare coordinates: gradients 10^4 times smaller than the others, throughout
            p.grad = g
            before = p.detach().clone()
            opt.step()
            moves.append(float((p.detach() - before).abs().max()) / 1e-3)
        largest[space] = max(moves[5:])
    assert largest["momentum"] > 50 * largest["preconditioned"], largest
    assert largest["preconditioned"] < 100, largest


def _largest_moves(cls, **kwargs) -> float:
    """A coordinate whose gradient outgrows its frozen variance: ten coordinates have gradients
    10^4 times smaller than the others during warmup, the same size after it. The largest step
    after the freeze, in units of ``lr``."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = cls([p], lr=1e-3, freeze_step=5, comm_backend_name="local", **kwargs)
    moves = []
    for t in range(1, 21):
        g = torch.randn(1000)
        if t <= 5:
            g[:10] *= 1e-4
        p.grad = g
        before = p.detach().clone()
        opt.step()
        moves.append(float((p.detach() - before).abs().max()) / 1e-3)
    return max(moves[5:])


@pytest.mark.parametrize("cls, rule", [(OnebitAdam, {}), (OnebitLamb, {}), (OnebitLamb, {"trust_ratio": "frozen"})])
def test_update_bound_keeps_a_waking_coordinate_from_inflating_its_tensors_steps(cls, rule):
    # measured 2026-11-26: Adam 8,385 lr without the bound, 4.5 with it; LAMB (trust_ratio "live")
    # 83.9 and 1.03 (the ratio holds the tensor's step at lr ||p||, which the ten then take); "frozen" 625 and 0.57
    free, bounded = _largest_moves(cls, update_bound=None, **rule), _largest_moves(cls, update_bound=1.0, **rule)
    assert free > 50 * bounded, (free, bounded)  # without it m / d of the ten sets the tensor's scale
    assert _largest_moves(cls, **rule) == bounded  # the default ("auto") is this bound
    if cls is OnebitAdam:
        largest = 0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999))  # Adam's largest |m / sqrt(v)|, betas (0.9, 0.999)
        assert free > 30 * largest and bounded < 3 * largest, (free, bounded)  # clamped values, plus error feedback


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_update_bound_is_a_clamp_and_nothing_else(cls):
    """A bound no coordinate reaches is the unbounded run, bit for bit (the clamp runs inside the
    codec's fused multiply and rounds nothing); a small one changes it."""
    def run(**kwargs):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(200))
        opt = cls([p], lr=1e-3, freeze_step=3, comm_backend_name="local", **kwargs)
        for t in range(1, 10):
            p.grad = torch.randn(200, generator=torch.Generator().manual_seed(t))
            opt.step()
        return p.detach().clone()

    assert torch.equal(run(update_bound=None), run(update_bound=1e30))
    assert not torch.equal(run(update_bound=None), run(update_bound=0.05))


@pytest.mark.parametrize("bias_correction", [False, True])
def test_update_bound_is_c_times_adams_largest_ratio_of_m_hat(bias_correction, caplog):
    """The clamp of ``m / d`` is ``c B bc1``, so that ``m_hat / d = (m / bc1) / d`` is within ``c B``."""
    opt = OnebitAdam([torch.nn.Parameter(torch.zeros(8))], lr=1e-3, freeze_step=2, betas=(0.9, 0.98),
                     bias_correction=bias_correction, comm_backend_name="local", update_bound=0.5)
    (bucket,) = opt._buckets
    largest = 0.1 / math.sqrt(0.02 * (1 - 0.81 / 0.98))
    for t in (3, 10, 100):
        assert opt._codec_bound(bucket, t) == pytest.approx(0.5 * largest * ((1 - 0.9**t) if bias_correction else 1))
    opt.param_groups[0]["betas"] = (0.99, 0.9)  # changed after the constructor: unbounded, said once
    with caplog.at_level(logging.WARNING, logger="onebit"):
        assert opt._codec_bound(bucket, 3) is None and opt._codec_bound(bucket, 4) is None
    assert len([r for r in caplog.records if "clamps nothing" in r.getMessage()]) == 1


@pytest.mark.parametrize("bad, message", [
    (dict(update_bound=0), "0 would keep every parameter still"),
    (dict(update_bound=-1.0), "invalid update_bound"),
    (dict(update_bound="1"), "invalid update_bound '1': give 'auto'"),
    (dict(update_bound=[1.0]), "update_bound must be a real number"),
    (dict(update_bound=1.0, compression_space="momentum"), "only compression_space='preconditioned'"),
    (dict(update_bound=1.0, betas=(0.99, 0.9)), "needs beta1\\*\\*2 < beta2"),
])
def test_update_bound_refuses_what_it_cannot_do(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        OnebitAdam([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, freeze_step=2, comm_backend_name="local", **bad)


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_the_default_bound_is_one_in_the_preconditioned_space_and_none_in_the_momentum_space(cls, caplog):
    """``update_bound="auto"`` (the default): 1 where it applies; DeepSpeed's numerics (the
    momentum space) unclamped; a group whose betas leave Adam's step unbounded quietly unclamped
    (an explicit bound there is refused, above)."""
    p = [torch.nn.Parameter(torch.zeros(8))]
    assert cls(p, lr=1e-3, freeze_step=2, comm_backend_name="local").update_bound == 1.0
    assert cls(p, lr=1e-3, freeze_step=2, comm_backend_name="local", compression_space="momentum").update_bound is None
    opt = cls(p, lr=1e-3, freeze_step=2, comm_backend_name="local", betas=(0.99, 0.9))
    (bucket,) = opt._buckets
    with caplog.at_level(logging.WARNING, logger="onebit"):
        assert opt._codec_bound(bucket, 3) is None
    assert not [r for r in caplog.records if "clamps nothing" in r.getMessage()]
    params = {"lr": 1e-3, "freeze_step": 2, "update_bound": "auto", "comm_backend_name": "local"}
    config = {"optimizer": {"type": cls.CONFIG_TYPE, "params": params}}
    assert from_config(p, config).update_bound == 1.0


def test_the_space_is_saved_and_a_checkpoint_restores_it(caplog):
    """The default is the preconditioned space; a checkpoint of the momentum space (DeepSpeed's)
    restores its space (its compression errors are of it), and a checkpoint written before the
    space was saved (no ``compression_space``) is of the momentum space, the default then."""
    params = _params()
    opt = OnebitAdam(params, lr=LR, freeze_step=FREEZE, comm_backend_name="local", compression_space="momentum")
    for t in range(1, 6):
        for p, g in zip(params, _grads(0, t)):
            p.grad = g
        opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["onebit"]["compression_space"] == "momentum"
    default = OnebitAdam(_params(), lr=LR, freeze_step=FREEZE, comm_backend_name="local")
    assert default.compression_space == "preconditioned"
    assert default.state_dict()["param_groups"][0]["onebit"]["compression_space"] == "preconditioned"
    with caplog.at_level(logging.INFO, logger="onebit"):
        default.load_state_dict(saved)
    assert default.compression_space == "momentum"
    assert any("compression_space 'momentum' restored from the checkpoint" in r.message for r in caplog.records)
    older = {**saved, "param_groups": [{**g, "onebit": {k: v for k, v in g["onebit"].items() if k != "compression_space"}}
                                       for g in saved["param_groups"]]}
    fresh = OnebitAdam(_params(), lr=LR, freeze_step=FREEZE, comm_backend_name="local")
    fresh.load_state_dict(older)
    assert fresh.compression_space == "momentum"


def test_the_bound_follows_the_space_a_checkpoint_restores(caplog):
    """``update_bound="auto"`` is resolved against the space in force: a momentum-space
    checkpoint loaded into a default optimizer clamps nothing (the codec would not, and the
    health check must not either), a preconditioned one loaded into a momentum-space optimizer
    clamps at 1; an explicit bound meeting a restored momentum space says it clamps nothing."""
    def trained(**kwargs):
        params = _params()
        opt = OnebitAdam(params, lr=LR, freeze_step=FREEZE, comm_backend_name="local", **kwargs)
        for t in range(1, 6):
            for p, g in zip(params, _grads(0, t)):
                p.grad = g
            opt.step()
        return opt

    momentum, preconditioned = trained(compression_space="momentum").state_dict(), trained().state_dict()
    default = OnebitAdam(_params(), lr=LR, freeze_step=FREEZE, comm_backend_name="local")
    default.load_state_dict(momentum)
    assert default.update_bound is None and default._codec_bound(default._buckets[0], 10) is None
    other = OnebitAdam(_params(), lr=LR, freeze_step=FREEZE, comm_backend_name="local", compression_space="momentum")
    other.load_state_dict(preconditioned)
    assert other.update_bound == 1.0 and other._codec_bound(other._buckets[0], 10) is not None
    explicit = OnebitAdam(_params(), lr=LR, freeze_step=FREEZE, comm_backend_name="local", update_bound=0.5)
    with caplog.at_level(logging.WARNING, logger="onebit"):
        explicit.load_state_dict(momentum)
    assert explicit.update_bound is None
    assert any("update_bound=0.5 clamps nothing in the momentum space" in r.getMessage() for r in caplog.records)


def test_a_bound_float32_cannot_hold_clamps_nothing():
    opt = OnebitAdam(_params(), lr=LR, freeze_step=FREEZE, comm_backend_name="local", update_bound=1e38)
    assert opt._codec_bound(opt._buckets[0], 10) is None  # 1e38 * 7.27 overflows float32
    assert OnebitAdam(_params(), lr=LR, freeze_step=FREEZE, comm_backend_name="local",
                      update_bound=1e30)._codec_bound(opt._buckets[0], 10) > 1e30


def test_an_unknown_space_is_refused():
    with pytest.raises(ValueError, match="invalid compression_space: 'update'; expected one of 'momentum', 'preconditioned'"):
        OnebitAdam(_params(), comm_backend_name="local", compression_space="update")


# ----------------------------------------------------------------------------- the alarm


def _rare(cls, space: str, divergence: str = "warn", steps: int = 40, **kwargs):
    """The mechanism above, with parameters given by name: a tensor of frequent coordinates and
    ``embed`` whose first rows are rare."""
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({"dense": torch.nn.Parameter(torch.randn(500)),
                                    "embed": torch.nn.Parameter(torch.randn(500))})
    opt = cls(model.named_parameters(), lr=1e-3, freeze_step=5, comm_backend_name="local",
              compression_space=space, divergence=divergence, **kwargs)
    for _ in range(steps):
        for name, p in model.named_parameters():
            p.grad = torch.randn(500)
            if name == "embed":
                p.grad[:10] *= 1e-4
        opt.step()
    return opt


@pytest.mark.parametrize("cls, rule", [(OnebitAdam, {}), (OnebitLamb, {"trust_ratio": "frozen"})])
def test_the_alarm_names_the_tensor_whose_steps_blow_up(cls, rule, caplog):
    with caplog.at_level(logging.WARNING, logger="onebit"):
        _rare(cls, "momentum", **rule)
    warned = [r.message for r in caplog.records if "times its learning rate in one step" in r.message]
    assert len(warned) == 1 and "a coordinate of embed moved by" in warned[0]
    assert "compression_space='preconditioned'" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onebit"):
        opt = _rare(cls, "preconditioned", **rule)
    assert not [r for r in caplog.records if "times its learning rate" in r.message]
    assert opt._health.update_ratio_agreed is not None and opt._health.update_ratio_agreed < 10


def test_the_alarm_raises_with_divergence_raise():
    with pytest.raises(FloatingPointError, match=r"before step 22 a coordinate of embed moved by .* \(divergence='raise'\)"):
        _rare(OnebitAdam, "momentum", divergence="raise")
