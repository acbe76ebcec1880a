"""OnebitLamb: real gloo ranks (and the local backend) against a single-process simulation of the
whole algorithm written from the class docstring's equations; the DeepSpeed defects it fixes; its
arguments, checkpoints and DDP integration."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import all_equal, seeded_params, tiny_mlp
from distributed import one_thread, run_ranks
from onebit import OnebitAdam, OnebitLamb, load_checkpoint, save_checkpoint
from onebit.integrations import attach_ddp
from onebit.lamb import SMOOTHING
from onebit.testing import simulate_compressed_allreduce

LR, WD, BETAS, EPS = 2e-2, 0.01, (0.9, 0.999), 1e-8
FREEZE, STEPS = 3, 10
# (trust_ratio="frozen": DeepSpeed's rule, which the oracle below follows unless told "live")
LAMB = dict(max_coeff=10.0, min_coeff=0.01, coeff_beta=0.5, factor_max=4.0, factor_min=0.5, factor_threshold=0.1,
            trust_ratio="frozen")
# (the frozen rule's arguments, left out for trust_ratio="live", which refuses them)
NO_FACTOR = {key: None for key in ("coeff_beta", "factor_max", "factor_min", "factor_threshold")}
MASKED_ROWS = slice(6, 8)  # rows 6, 7 of the first weight: momentum kept at exactly 0
DEAD_COLUMN = 5  # input feature 5 is 0 during warmup: column 5 of the first weight has v == 0


# ----------------------------------------------------------------------------- the model and data


class Net(torch.nn.Module):
    """Linear(6, 8) with bias, Tanh, Linear(8, 3) with a zero-initialised bias; ``extra`` (5
    elements) whose gradient is None on every third step; ``zero`` (7 elements) whose gradient is
    always 0 (its momentum and variance are all zero when compression starts)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = tiny_mlp(6, 8, 3)
        with torch.no_grad():
            self.body[2].bias.zero_()
        self.extra = torch.nn.Parameter(torch.randn(5))
        self.zero = torch.nn.Parameter(torch.randn(7))


INDEX = {name: i for i, (name, _) in enumerate(Net().named_parameters())}  # order of net.parameters()


def _mask(net: Net) -> torch.Tensor:
    mask = torch.ones_like(net.body[0].weight)
    mask[MASKED_ROWS] = 0
    return mask


def _masks(net: Net) -> list[torch.Tensor | None]:
    """Per parameter (in ``net.parameters()`` order), its momentum mask or None."""
    return [_mask(net) if p is net.body[0].weight else None for p in net.parameters()]


def _set_grads(net: Net, rank: int, t: int, freeze_step: int = FREEZE) -> None:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    if t <= freeze_step:
        x[:, DEAD_COLUMN] = 0.0
    net.zero_grad()
    torch.nn.functional.mse_loss(net.body(x), y).backward()
    net.extra.grad = None if t % 3 == 0 else torch.randn(5, generator=gen)
    net.zero.grad = torch.zeros(7)
    # Multiples of 2**-12: their sum over ranks is exact in any order (gloo sums a 3-rank
    # all-reduce in an order of its own), so the oracle can be compared bit for bit.
    for p in net.parameters():
        if p.grad is not None:
            p.grad.mul_(2.0**12).round_().div_(2.0**12)


def _optimizer(net: Net, backend: str, freeze_step: int = FREEZE, **kwargs) -> OnebitLamb:
    """(In the momentum space, DeepSpeed's numerics, which the oracle below follows.)"""
    return OnebitLamb(net.parameters(), lr=LR, freeze_step=freeze_step, betas=BETAS, eps=EPS, weight_decay=WD,
                      comm_backend_name=backend, momentum_masks={net.body[0].weight: _mask(net)},
                      **{"compression_space": "momentum", **LAMB, **kwargs})


# ----------------------------------------------------------------------------- the oracle


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x))


def lamb_factor(max_ratio: float, prelim: float | None, update: float | None, last: float, hp: dict) -> float:
    """The docstring's ``f``: the largest ratio over live coordinates, pulled towards 1 by weight
    decay, clamped to ``[factor_min, factor_max]`` and to within ``factor_threshold`` of ``last``."""
    f = max_ratio
    if prelim is not None:
        r = min(1.0, prelim / update) if update > 0 else 1.0
        f = f * r + (1.0 - r)
    f = min(max(f, hp["factor_min"]), hp["factor_max"])
    return min(max(f, last * (1 - hp["factor_threshold"])), last * (1 + hp["factor_threshold"]))


def trust_ratio(p: torch.Tensor, u: torch.Tensor, hp: dict) -> float:
    """``clamp(||p|| / ||u||, min_coeff, max_coeff)``, 1 (clamped) where a norm is 0."""
    pn, un = _norm(p), _norm(u)
    c = pn / un if pn > 0 and un > 0 else 1.0
    return min(max(c, hp["min_coeff"]), hp["max_coeff"])


def max_ratio(v: torch.Tensor, fresh: torch.Tensor, live: torch.Tensor, eps: float) -> float:
    """``max (sqrt(v) + eps) / (sqrt(v_fresh) + eps)`` over the ``live`` coordinates (0 if none)."""
    ratio = (v.sqrt() + eps) / (fresh.sqrt() + eps)
    return float(ratio[live].max()) if bool(live.any()) else 0.0


def oracle(n: int, steps: int, freeze_step: int = FREEZE, hp: dict | None = None, lr: float = LR, wd: float = WD,
           betas=BETAS, eps: float = EPS, rule: str = "frozen"):
    """1-bit LAMB for ``n`` simulated ranks, per tensor, from OnebitLamb's docstring, with the trust
    ratio ``rule`` ``"frozen"`` or ``"live"``. Returns the parameters after every step and the final
    state."""
    hp = {**LAMB, **(hp or {})}
    frozen = rule == "frozen"
    b1, b2 = betas
    with one_thread():
        net = Net()
        params = list(net.parameters())
        masks = [None if mk is None else mk != 0 for mk in _masks(net)]
        st = [dict(m=torch.zeros_like(p), v=torch.zeros_like(p), fresh=torch.zeros_like(p), coeff=0.0, last=1.0)
              for p in params]
        errors = [(None, None)] * len(params)
        snapshots = []
        for t in range(1, steps + 1):
            grads = []  # grads[r][i]: rank r's gradient of tensor i (None: no gradient)
            for r in range(n):
                _set_grads(net, r, t)  # the data does not depend on the oracle's freeze_step
                grads.append([None if p.grad is None else p.grad.clone() for p in params])
            with torch.no_grad():
                absent = [all(g[i] is None for g in grads) for i in range(len(params))]
                if t <= freeze_step:
                    for i, (p, s) in enumerate(zip(params, st)):
                        if absent[i]:
                            continue  # no gradient on any rank: as in torch.optim, the tensor and its state stay
                        local = [torch.zeros_like(p) if g[i] is None else g[i] for g in grads]
                        g = local[0]
                        for other in local[1:]:
                            g = g + other
                        g = g / n
                        s["m"] = torch.lerp(s["m"], g, 1 - b1)  # b1 m + (1 - b1) g
                        s["v"] = torch.addcmul(s["v"] * b2, g, g, value=1 - b2)
                        if masks[i] is not None:
                            s["m"] = s["m"] * masks[i]
                        if t == freeze_step and frozen:
                            s["fresh"] = s["v"].clone()
                        u = torch.add(s["m"] / (s["v"].sqrt() + eps), p, alpha=wd)
                        c = trust_ratio(p, u, hp)
                        if frozen:
                            s["coeff"] = hp["coeff_beta"] * s["coeff"] + (1 - hp["coeff_beta"]) * c
                        p.sub_(u * (lr * c))
                else:
                    prev = [s["m"] for s in st]
                    if t == freeze_step + 1 and not frozen:  # the live ratio's average of u, from m / d
                        for s in st:
                            s["ubar"] = s["m"] / (s["v"].sqrt() + eps)
                    for i, (p, s) in enumerate(zip(params, st)):
                        if absent[i]:
                            continue
                        # Each tensor is compressed as if alone (its own scales), so tensor by tensor.
                        local = [(s["m"] * b1 if g[i] is None else torch.lerp(s["m"], g[i], 1 - b1)).reshape(-1)
                                 for g in grads]
                        sim = simulate_compressed_allreduce(local, *errors[i])
                        errors[i] = (sim.worker_errors, sim.server_errors)
                        keep = s["v"] != 0
                        if masks[i] is not None:
                            keep &= masks[i]
                        m = torch.where(keep, sim.output.view_as(p), 0.0)
                        s["m"] = m
                        if not frozen:  # the ratio from u averaged over steps; the step along this step's u
                            u0 = m / (s["v"].sqrt() + eps)
                            s["ubar"] = s["ubar"] * SMOOTHING + u0 * (1 - SMOOTHING)
                            c = trust_ratio(p, torch.add(s["ubar"], p, alpha=wd), hp)
                            p.sub_(torch.add(u0, p, alpha=wd) * (lr * c))
                            continue
                        g_rec = (m - b1 * prev[i]) / (1 - b1)
                        s["fresh"] = torch.addcmul(s["fresh"] * b2, g_rec, g_rec, value=1 - b2)
                        d = s["v"].sqrt() + eps
                        u0 = m / d
                        u = torch.add(u0, p, alpha=wd)
                        f = lamb_factor(max_ratio(s["v"], s["fresh"], keep, eps),
                                        _norm(u0) if wd else None, _norm(u) if wd else None, s["last"], hp)
                        s["last"] = f
                        p.sub_(u * (lr * (s["coeff"] * f)))
            snapshots.append([p.detach().clone() for p in params])
    return snapshots, st


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b)) / max(y.abs().max().item() for y in b)


# ----------------------------------------------------------------------------- 1. against the oracle


def _train_rank(rank, world_size, backend, steps, save_at=None, path=None, **kwargs):
    """Train ``Net`` for ``steps`` steps (``kwargs`` to the optimizer); with ``save_at``, also save an
    exact-resume checkpoint to ``path`` after that step (which must not change the run)."""
    net = Net()
    opt = _optimizer(net, backend, **kwargs)
    snapshots, phases, grads_untouched = [], [], []
    for t in range(1, steps + 1):
        _set_grads(net, rank, t)
        grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
        phases.append(opt.phase)
        opt.step()
        grads_untouched.append(all((g is None and p.grad is None) or torch.equal(g, p.grad)
                                   for g, p in zip(grads, net.parameters())))
        snapshots.append([p.detach().clone() for p in net.parameters()])
        if t == save_at:
            save_checkpoint(path, opt, model=net, exact_resume=True)
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()]
    return {"snapshots": snapshots, "state": state, "phases": phases, "grads_untouched": grads_untouched}


def _check_against_oracle(results, n, rule="frozen"):
    """Every rank equals the oracle bit for bit: parameters at every step and the final state. (The
    oracle spells ``u + wd p`` as ``torch.add(u, p, alpha=wd)`` and ``b2 v + (1 - b2) g^2`` as
    ``addcmul``, the fused forms the optimizer uses: written naively they round differently, by
    up to 3e-8 of max |p| over these 10 steps.)"""
    expected, final = oracle(n, STEPS, rule=rule)
    for t in range(STEPS):
        for rank in range(n):  # bit-identical on every rank, with no broadcast
            assert all_equal(results[rank]["snapshots"][t], results[0]["snapshots"][t]), (rank, t + 1)
        assert all_equal(results[0]["snapshots"][t], expected[t]), \
            f"step {t + 1}: max|Δ|/max|p| = {_relative(results[0]['snapshots'][t], expected[t]):.3g}"
    assert results[0]["phases"] == ["warmup"] * FREEZE + ["compression"] * (STEPS - FREEZE)
    for state, ref in zip(results[0]["state"], final):
        assert state["lamb_coeff_freeze"].item() == ref["coeff"]
        assert state["last_factor"].item() == ref["last"]
        for name, key in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            assert torch.equal(state[name], ref[key]), name
        if rule == "frozen":
            assert torch.equal(state["exp_avg_sq_fresh"], ref["fresh"])
        else:  # the fresh variance is the frozen rule's: never allocated
            assert "exp_avg_sq_fresh" not in state
    # What the oracle comparison implies, spelled out:
    assert all(all(r["grads_untouched"]) for r in results)  # step() never writes p.grad
    assert all(torch.isfinite(p).all() for snapshot in results[0]["snapshots"] for p in snapshot)
    zero = results[0]["state"][INDEX["zero"]]  # the always-zero gradient: momentum 0, nothing raised
    assert torch.all(zero["exp_avg"] == 0) and torch.all(zero["exp_avg_sq"] == 0)
    w = results[0]["state"][INDEX["body.0.weight"]]
    assert torch.all(w["exp_avg"][MASKED_ROWS] == 0)
    assert torch.all(w["exp_avg"][:, DEAD_COLUMN] == 0) and torch.all(w["exp_avg_sq"][:, DEAD_COLUMN] == 0)
    # The zero-initialised bias moved in warmup and in compression, and (frozen) its ratio entered the average.
    assert (results[0]["state"][INDEX["body.2.bias"]]["lamb_coeff_freeze"].item() > 0) == (rule == "frozen")
    biases = [s[INDEX["body.2.bias"]] for s in results[0]["snapshots"]]
    assert all(not torch.equal(a, b) for a, b in zip(biases, biases[1:]))
    return expected


# Everything that needs two gloo ranks runs in one spawn (the spawn costs more than the runs): the
# oracle run (which also saves an exact-resume checkpoint after step SAVE_AT, a compression step)
# and the DDP runs. Fresh processes then resume from that checkpoint.
SAVE_AT = 5
DDP_STEPS = 7


def _ddp_run(rank: int, use_ddp: bool) -> dict:
    model = tiny_mlp(6, 8, 3)
    with torch.no_grad():
        model[2].bias.zero_()
    opt = OnebitLamb(model.parameters(), lr=LR, freeze_step=FREEZE, weight_decay=WD, comm_backend_name="gloo", **LAMB)
    net = model
    if use_ddp:
        net = DDP(model)
        attach_ddp(net, opt)
    snapshots, synced, phases = [], [], []
    for t in range(1, DDP_STEPS + 1):
        gen = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        phases.append(opt.phase)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        synced.append(getattr(net, "require_forward_param_sync", None))  # whether DDP synchronized this backward
        opt.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return {"snapshots": snapshots, "synced": synced, "phases": phases, "stats": opt.comm_stats()}


def _two_rank_session(rank, world_size, path):
    return {"train": _train_rank(rank, world_size, "gloo", STEPS, SAVE_AT, path),
            "live": _train_rank(rank, world_size, "gloo", STEPS, trust_ratio="live", **NO_FACTOR),
            "plain": _ddp_run(rank, False), "ddp": _ddp_run(rank, True)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lamb_two_ranks")
    path = tmp / "ckpt.pt"
    return path, run_ranks(_two_rank_session, 2, tmp, str(path))


@pytest.mark.slow
def test_two_gloo_ranks_match_the_oracle(two_ranks):
    _check_against_oracle([r["train"] for r in two_ranks[1]], 2)


@pytest.mark.slow
def test_two_gloo_ranks_match_the_oracle_with_the_live_ratio(two_ranks):
    _check_against_oracle([r["live"] for r in two_ranks[1]], 2, rule="live")


@pytest.mark.slow
def test_three_gloo_ranks_match_the_oracle(tmp_path):
    _check_against_oracle(run_ranks(_train_rank, 3, tmp_path, "gloo", STEPS), 3)


def test_local_backend_matches_the_oracle_for_one_rank():
    _check_against_oracle([_train_rank(0, 1, "local", STEPS)], 1)


def test_local_backend_matches_the_oracle_with_the_live_ratio():
    _check_against_oracle([_train_rank(0, 1, "local", STEPS, trust_ratio="live", **NO_FACTOR)], 1, rule="live")


def test_the_oracle_can_fail():
    """The comparison sees a switch to compression one step late, a factor fixed at 1, and the
    other trust ratio rule."""
    run = _train_rank(0, 1, "local", STEPS)["snapshots"][-1]
    late, _ = oracle(1, STEPS, freeze_step=FREEZE + 1)
    assert _relative(run, late[-1]) > 1e-4
    no_factor, _ = oracle(1, STEPS, hp={"factor_min": 1.0, "factor_max": 1.0})
    assert _relative(run, no_factor[-1]) > 1e-4
    live_run = _train_rank(0, 1, "local", STEPS, trust_ratio="live", **NO_FACTOR)["snapshots"][-1]
    assert _relative(live_run, oracle(1, STEPS)[0][-1]) > 1e-4
    assert _relative(run, oracle(1, STEPS, rule="live")[0][-1]) > 1e-4


# ----------------------------------------------------------------------------- 2. DeepSpeed's defects, fixed

DEFAULT_FACTOR = dict(factor_min=0.5, factor_max=4.0, factor_threshold=0.1)


def _linear() -> torch.nn.Linear:
    torch.manual_seed(1)
    lin = torch.nn.Linear(6, 4)
    with torch.no_grad():
        lin.bias.zero_()
    return lin


def _random_grads(params, t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_every_step_uses_its_gradient():
    """No hidden dry run: step 1 moves every parameter."""
    net = Net()
    opt = _optimizer(net, "local")
    before = [p.detach().clone() for p in net.parameters()]
    _set_grads(net, 0, 1)
    opt.step()
    assert opt.step_count == 1
    assert all(not torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_zero_initialised_bias_gets_the_clamped_ratio_and_keeps_moving():
    lin = _linear()
    lr, b1, b2 = 0.1, 0.9, 0.999
    opt = OnebitLamb(lin.parameters(), lr=lr, freeze_step=1, max_coeff=0.3, coeff_beta=0.9, weight_decay=WD,
                     comm_backend_name="local", trust_ratio="frozen")
    _random_grads(lin.parameters(), 1)
    g = lin.bias.grad.clone()
    opt.step()
    u = torch.zeros(4).lerp_(g, 1 - b1) / (torch.zeros(4).addcmul_(g, g, value=1 - b2).sqrt() + 1e-8)  # + wd * 0
    # ||p|| = 0: the ratio is 1 clamped to max_coeff (DeepSpeed: 1, i.e. -lr u, 3.3 times as far).
    assert torch.equal(lin.bias.detach(), u * -(lr * 0.3))
    # ... and it enters the average (DeepSpeed skipped it: c_frozen stayed 0 and the bias never
    # moved again after a one-step warmup).
    assert opt.state[lin.bias]["lamb_coeff_freeze"].item() == pytest.approx((1 - 0.9) * 0.3, rel=1e-15)
    for t in range(2, 7):
        before = lin.bias.detach().clone()
        _random_grads(lin.parameters(), t)
        opt.step()
        assert opt.phase == "compression"
        assert (lin.bias.detach() - before).abs().min() > 1e-4  # every coordinate moves, every step


def test_freeze_step_1_copies_the_variance_and_the_factor_starts_near_1():
    lin = _linear()
    params = list(lin.parameters())
    opt = OnebitLamb(params, lr=0.01, freeze_step=1, comm_backend_name="local", compression_space="momentum",
                     trust_ratio="frozen")
    _random_grads(params, 1)
    opt.step()
    for p in params:
        state = opt.state[p]
        assert torch.equal(state["exp_avg_sq_fresh"], state["exp_avg_sq"]) and bool((state["exp_avg_sq"] > 0).all())
    for t in range(2, 7):
        prev = {p: opt.state[p]["exp_avg"].clone() for p in params}
        last = {p: opt.state[p]["last_factor"].item() for p in params}
        _random_grads(params, t)
        opt.step()
        for p in params:
            state = opt.state[p]
            v, fresh, live = state["exp_avg_sq"], state["exp_avg_sq_fresh"], state["exp_avg_sq"] != 0
            expected = lamb_factor(max_ratio(v, fresh, live, 1e-8), None, None, last[p], DEFAULT_FACTOR)
            assert state["last_factor"].item() == expected
            if t == 2:
                assert 0.9 <= expected <= 1.001  # largest ratio about 1 / sqrt(beta2)
                # Without the copy (DeepSpeed with freeze_step 1), v_fresh would be (1 - beta2) g~^2:
                # the factor would hit the threshold, 1.1 (and ramp by 10% a step after).
                g_rec = (state["exp_avg"] - 0.9 * prev[p]) / (1 - 0.9)
                missed = lamb_factor(max_ratio(v, (1 - 0.999) * g_rec * g_rec, live, 1e-8), None, None, 1.0,
                                     DEFAULT_FACTOR)
                assert missed == pytest.approx(1.1)


def test_masked_row_does_not_pin_the_factor():
    """A masked coordinate's fresh variance only decays (its reconstructed gradient is 0), so its
    ratio sqrt(v) / sqrt(v_fresh) grows as beta2^(-k/2): counted, it would set the factor."""
    [w] = seeded_params((4, 6), seed=2)
    mask = torch.ones(4, 6)
    mask[3] = 0
    hp = dict(factor_min=0.5, factor_max=4.0, factor_threshold=10.0)
    opt = OnebitLamb([w], lr=0.01, freeze_step=2, betas=(0.9, 0.5), comm_backend_name="local",
                     momentum_masks={w: mask}, trust_ratio="frozen", **hp)
    g0 = torch.randn(4, 6)
    with_masked = None
    for t in range(1, 7):
        last = opt.state[w]["last_factor"].item()
        w.grad = g0 + 0.1 * torch.randn(4, 6)
        opt.step()
        if t <= 2:
            continue
        state = opt.state[w]
        v, fresh = state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        assert torch.all(state["exp_avg"][3] == 0) and torch.all(v[3] > 0)
        live = (v != 0) & (mask != 0)
        expected = lamb_factor(max_ratio(v, fresh, live, 1e-8), None, None, last, hp)
        assert state["last_factor"].item() == expected
        with_masked = lamb_factor(max_ratio(v, fresh, v != 0, 1e-8), None, None, last, hp)
    # After 4 compression steps the masked ratio is about 0.5^-2 = 4: the factor_max.
    assert with_masked > expected + 1.0, (with_masked, expected)


# ----------------------------------------------------------------------------- 3. arguments


# (amsgrad: torch.optim's flag, accepted at False, refused at True: tests/test_dropin.py)
@pytest.mark.parametrize("key", ["bias_correction", "max_grad_norm", "eps_inside_sqrt"])
def test_deepspeed_keys_it_ignored_are_refused(key):
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError, match=f"OnebitLamb does not take {key}=False: "):
        OnebitLamb(params, comm_backend_name="local", **{key: False})
    with pytest.raises(ValueError, match=f"param group key '{key}' is not read by OnebitLamb"):
        OnebitLamb([{"params": params, key: False}], comm_backend_name="local")


@pytest.mark.parametrize("kwargs, message", [
    (dict(coeff_beta=1.0), r"invalid coeff_beta: 1\.0; it must be finite and in \[0\.0, 1\.0\)"),
    (dict(coeff_beta=-0.1), r"invalid coeff_beta: -0\.1; it must be finite and in \[0\.0, 1\.0\)"),
    (dict(factor_min=2.0, factor_max=1.0), r"factor_min \(2\.0\) must not exceed factor_max \(1\.0\)"),
    (dict(min_coeff=5.0, max_coeff=1.0), r"min_coeff \(5\.0\) must not exceed max_coeff \(1\.0\)"),
    (dict(freeze_step=0), r"invalid freeze_step: 0; it must be >= 1"),
])
def test_invalid_arguments_are_refused_naming_the_value(kwargs, message):
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=message):
        OnebitLamb(params, comm_backend_name="local", trust_ratio="frozen", **kwargs)


def test_invalid_coefficient_bounds_in_a_param_group_are_refused():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"min_coeff \(0\.5\) must not exceed max_coeff \(0\.2\)"):
        OnebitLamb([{"params": params, "min_coeff": 0.5, "max_coeff": 0.2}], comm_backend_name="local")


# ----------------------------------------------------------------------------- 4. checkpoints

BUFFERS, SCALARS = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"), ("lamb_coeff_freeze", "last_factor")


@pytest.mark.parametrize("steps, phase", [(2, "warmup"), (6, "compression")])
def test_state_dict_round_trip(steps, phase):
    net = Net()
    opt = _optimizer(net, "local")
    for t in range(1, steps + 1):
        _set_grads(net, 0, t)
        opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["onebit"]["algorithm"] == "OnebitLamb"
    assert sd["param_groups"][0]["onebit"]["step"] == steps and sd["param_groups"][0]["onebit"]["freeze_step"] == FREEZE
    net2 = Net()
    net2.load_state_dict(net.state_dict())
    opt2 = _optimizer(net2, "local", freeze_step=FREEZE + 5)  # the checkpoint's freeze_step wins
    opt2.load_state_dict(sd)
    assert opt2.step_count == steps and opt2.freeze_step == FREEZE and opt2.phase == opt.phase == phase
    for p, p2 in zip(net.parameters(), net2.parameters()):
        # (the fresh variance exists from step freeze_step on)
        assert ("exp_avg_sq_fresh" in opt2.state[p2]) == ("exp_avg_sq_fresh" in opt.state[p]) == (steps >= FREEZE)
        for name in BUFFERS:
            if name in opt.state[p]:
                assert torch.equal(opt.state[p][name], opt2.state[p2][name]), name
        for name in SCALARS:
            assert opt.state[p][name].item() == opt2.state[p2][name].item(), name
    # Restoring the scalars is tested: the ratios are averaged, and the factors moved from 1 (but
    # for ``zero``, whose update is all weight decay: r = 0, f = 1).
    factors = [opt2.state[p]["last_factor"].item() for name, p in net2.named_parameters() if name != "zero"]
    assert all(opt2.state[p]["lamb_coeff_freeze"].item() > 0 for p in net2.parameters())
    assert all((f == 1.0) == (phase == "warmup") for f in factors)
    # Both continue bit for bit alike once the original's compression errors are reset as the
    # load resets them (in warmup they are still zero).
    opt.reset_compression_errors()
    for t in range(steps + 1, steps + 5):
        for n_, o_ in ((net, opt), (net2, opt2)):
            _set_grads(n_, 0, t)
            o_.step()
        assert all_equal(list(net.parameters()), list(net2.parameters())), t


def test_the_checkpoint_s_trust_ratio_rule_wins(caplog):
    """A checkpoint restores its rule (its scalars and fresh variance are that rule's) and says so;
    one saved before the rule was (no ``trust_ratio``) is of the frozen rule, the only one then.
    Restored, the run goes on bit for bit as the original."""
    net = Net()
    opt = _optimizer(net, "local", trust_ratio="live", **NO_FACTOR)
    for t in range(1, 6):
        _set_grads(net, 0, t)
        opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["onebit"]["trust_ratio"] == "live"
    net2 = Net()
    net2.load_state_dict(net.state_dict())
    opt2 = _optimizer(net2, "local")
    assert opt2.trust_ratio == "frozen"
    with caplog.at_level(logging.INFO, logger="onebit"):
        opt2.load_state_dict(saved)
    assert opt2.trust_ratio == "live"
    assert any("trust_ratio 'live' restored from the checkpoint (was 'frozen')" in r.message for r in caplog.records)
    opt.reset_compression_errors()  # as the load reset opt2's
    for t in range(6, 9):
        for n_, o_ in ((net, opt), (net2, opt2)):
            _set_grads(n_, 0, t)
            o_.step()
        assert all_equal(list(net.parameters()), list(net2.parameters())), t
    older = {**saved, "param_groups": [{**g, "onebit": {k: v for k, v in g["onebit"].items() if k != "trust_ratio"}}
                                       for g in saved["param_groups"]]}
    net3 = Net()
    default = OnebitLamb(net3.parameters(), lr=LR, freeze_step=FREEZE, comm_backend_name="local")
    assert default.trust_ratio == "live"
    default.load_state_dict(older)
    assert default.trust_ratio == "frozen" and default.factor_max == 4.0 and default.coeff_beta == 0.9
    bad = {**saved, "param_groups": [{**g, "onebit": {**g["onebit"], "trust_ratio": "sometimes"}}
                                     for g in saved["param_groups"]]}
    with pytest.raises(ValueError, match=r"trust_ratio in the checkpoint: 'sometimes'; expected one of 'live', 'frozen'"):
        default.load_state_dict(bad)
    assert default.trust_ratio == "frozen"  # a refused load changes nothing


def test_the_live_rule_refuses_the_frozen_rule_s_arguments():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"factor_max=2\.0: read only by trust_ratio='frozen' .*pass trust_ratio='frozen'"):
        OnebitLamb(params, comm_backend_name="local", factor_max=2.0)
    with pytest.raises(ValueError, match=r"invalid trust_ratio: 'fixed'; expected one of 'live', 'frozen'"):
        OnebitLamb(params, comm_backend_name="local", trust_ratio="fixed")
    frozen = OnebitLamb(params, comm_backend_name="local", trust_ratio="frozen", factor_max=2.0)
    assert (frozen.factor_max, frozen.factor_min, frozen.coeff_beta) == (2.0, 0.5, 0.9)


def test_the_other_algorithm_s_state_dict_is_refused():
    p = torch.nn.Parameter(torch.randn(4))
    lamb = OnebitLamb([p], freeze_step=2, comm_backend_name="local")
    adam = OnebitAdam([p], freeze_step=2, comm_backend_name="local")
    p.grad = torch.randn(4)
    lamb.step()
    adam.step()
    with pytest.raises(ValueError, match="saved by 'OnebitAdam', this optimizer is 'OnebitLamb'"):
        lamb.load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="saved by 'OnebitLamb', this optimizer is 'OnebitAdam'"):
        adam.load_state_dict(lamb.state_dict())


def _resume_rank(rank, world_size, path):
    out = {}
    for exact in (True, False):
        net = Net()
        opt = _optimizer(net, "gloo")
        load_checkpoint(path, opt, model=net, exact_resume=exact)
        assert opt.step_count == SAVE_AT and opt.phase == "compression"
        snapshots = []
        for t in range(SAVE_AT + 1, STEPS + 1):
            _set_grads(net, rank, t)
            opt.step()
            snapshots.append([p.detach().clone() for p in net.parameters()])
        out["exact" if exact else "reset"] = snapshots
    return out


@pytest.mark.slow
def test_exact_resume_on_two_ranks_continues_bit_for_bit(two_ranks, tmp_path):
    path, results = two_ranks
    resumed = run_ranks(_resume_rank, 2, tmp_path, str(path))
    for rank in range(2):
        straight = results[rank]["train"]["snapshots"][SAVE_AT:]
        assert all(all_equal(a, b) for a, b in zip(resumed[rank]["exact"], straight))
        # Without the rank files the errors are reset: another (valid) trajectory.
        assert not all_equal(resumed[rank]["reset"][-1], straight[-1])


# ----------------------------------------------------------------------------- 5. attach_ddp


@pytest.mark.slow
def test_attach_ddp_trains_through_both_phases_like_plain_onebit(two_ranks):
    results = two_ranks[1]
    phases = ["warmup"] * FREEZE + ["compression"] * (DDP_STEPS - FREEZE)
    for rank in range(2):
        plain, ddp = results[rank]["plain"], results[rank]["ddp"]
        assert ddp["phases"] == plain["phases"] == phases
        assert ddp["synced"] == [phase == "warmup" for phase in phases]  # DDP syncs on warmup steps only
        assert all_equal(ddp["snapshots"][-1], results[0]["ddp"]["snapshots"][-1])
        for a, b in zip(ddp["snapshots"], plain["snapshots"]):
            # DDP divides each gradient by 2 before summing, onebit sums then divides: both exact
            # for 2 ranks, so this is measured 0.0; float tolerance nonetheless.
            assert _relative(a, b) <= 1e-6
    ddp, plain = results[0]["ddp"]["stats"], results[0]["plain"]["stats"]
    own = ddp["warmup"]["bytes_sent"] - ddp["warmup"]["framework_bytes_sent"]  # (DDP's bytes counted apart)
    assert own < plain["warmup"]["bytes_sent"] / 10  # not all-reduced twice
    assert ddp["compression"]["bytes_sent"] == plain["compression"]["bytes_sent"] > 0


def test_a_factor_at_its_ceiling_is_reported_and_warned_about_once(caplog):
    # A fresh variance far below the frozen one: large warmup gradients, then tiny ones, and a beta2
    # that lets the fresh variance follow them within a few steps.
    [p] = seeded_params(64)
    opt = OnebitLamb([p], lr=1e-3, freeze_step=2, betas=(0.9, 0.5), factor_max=1.5, factor_threshold=0.5,
                     comm_backend_name="local", trust_ratio="frozen")
    assert opt.comm_stats()["max_factor"] == 1.0
    with caplog.at_level(logging.WARNING, logger="onebit"):
        for t in range(8):
            p.grad = torch.randn(64) * (10.0 if t < 2 else 1e-3)
            opt.step()
    assert opt.comm_stats()["max_factor"] == 1.5
    warnings = [r for r in caplog.records if "factor reached factor_max=1.5" in r.message]
    assert len(warnings) == 1
    raising = OnebitLamb([torch.nn.Parameter(torch.randn(64))], lr=1e-3, freeze_step=2, betas=(0.9, 0.5),
                         factor_max=1.5, factor_threshold=0.5, comm_backend_name="local", divergence="raise",
                         trust_ratio="frozen")
    with pytest.raises(FloatingPointError, match="factor reached factor_max"):
        for t in range(8):
            for q in raising.param_groups[0]["params"]:
                q.grad = torch.randn(64) * (10.0 if t < 2 else 1e-3)
            raising.step()
