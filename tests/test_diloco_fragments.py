"""OnebitDiLoCo's fragments (issue 42, part 1: Streaming DiLoCo's fragments, without overlap).

``fragments=P`` cuts the buckets into ``P`` runs of about equal size; fragment ``k`` takes its
outer step at the steps ``t`` with ``t % H == k * H // P``, the other fragments an inner step. The
oracle is a single-process simulation written from that rule: per rank a torch AdamW, and at the
step of fragment ``k`` the pseudo-gradients of its tensors averaged by
:func:`onebit.testing.simulate_compressed_allreduce` (one segment per tensor, each fragment's
errors carried from one of its outer steps to the next), then torch's Nesterov SGD on the global
parameters of that fragment alone. On 2 and 3 gloo ranks every rank follows it within 1e-6;
``fragments=1`` is the run without fragments bit for bit; the largest step sends about ``1/P`` of
what one outer step of every parameter sends, a round the same; an exact resume mid-round
continues bit for bit.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from conftest import all_equal, clone_params, max_abs_diff
from distributed import run_ranks
from onebit import OnebitDiLoCo, load_checkpoint, save_checkpoint
from onebit.fragments import assign, fragment_at, offset
from onebit.testing import simulate_compressed_allreduce

H = 4
STEPS = 9
LR = 1e-2
# The tensors of _model(): weight 8x6 (48), bias 8, weight 8x8 (64), bias 8, weight 3x8 (24), bias 3
# (155 elements). Buckets of at most ceil(155 / P) elements, cut by the middle of each bucket:
# P = 2: [48, 8] and [64, 8, 24, 3] (cap 78: 56 | 72 | 27; middles at 28, 92, 141.5 of 155);
# P = 3: [48], [8, 64], [8, 24, 3] (cap 52: 48 | 8 | 64 | 35).
FRAGMENTS = {1: [[0, 1, 2, 3, 4, 5]], 2: [[0, 1], [2, 3, 4, 5]], 3: [[0], [1, 2], [3, 4, 5]]}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


def _equal_layers(seed: int = 0) -> torch.nn.Module:
    """Four tensors of 4096 elements: fragments of exactly equal size for P in 1, 2, 4."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])


def _backward(model: torch.nn.Module, rank: int, t: int) -> None:
    g = torch.Generator().manual_seed(1000 * t + rank)
    d_in, d_out = model[0].in_features, model[-1].out_features
    x, y = torch.randn(8, d_in, generator=g), torch.randn(8, d_out, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _make(model: torch.nn.Module, backend: str = "gloo", **kwargs) -> OnebitDiLoCo:
    """(One 1-bit pass with the classic error feedback, the scheme the simulation writes out.)"""
    classic = {} if kwargs.get("compression") == "none" else {"error_feedback": "buffer", "outer_bits": 1}
    return OnebitDiLoCo(model.parameters(), **{"lr": LR, "sync_every": H, "outer_lr": 0.7, "outer_momentum": 0.9,
                                               "comm_backend_name": backend, **classic, **kwargs})


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("sync_every, fragments", [(1, 1), (4, 1), (4, 2), (4, 3), (4, 4), (8, 3), (7, 5), (32, 4)])
def test_each_fragment_has_its_step_of_every_round(sync_every, fragments):
    """fragment_at(t) is the k with t % H == k * H // P (the documented rule, by brute force),
    each fragment once per round; with P = 1, t % H == 0."""
    for t in range(1, 3 * sync_every + 1):
        expected = [k for k in range(fragments) if t % sync_every == k * sync_every // fragments]
        assert fragment_at(t, sync_every, fragments) == (expected[0] if expected else None), t
        assert offset(expected[0], sync_every, fragments) == t % sync_every if expected else True
    round_ = [fragment_at(t, sync_every, fragments) for t in range(1, sync_every + 1)]
    assert sorted(k for k in round_ if k is not None) == list(range(fragments))
    if fragments == 1:
        assert round_ == [None] * (sync_every - 1) + [0]


@pytest.mark.parametrize("numels, fragments, expected", [
    ([25, 25, 25, 25], 4, [0, 1, 2, 3]),
    ([25, 25, 25, 25], 2, [0, 0, 1, 1]),
    ([10, 80, 5, 5], 4, [0, 1, 2, 3]),  # (by the middles alone fragment 1 would be empty)
    ([56, 72, 27], 2, [0, 1, 1]),
    ([1] * 6, 4, [0, 1, 1, 2, 3, 3]),
    ([7], 1, [0]),
    ([5, 5], 3, [0, 1]),  # fewer buckets than fragments: the last stay empty
])
def test_the_buckets_are_cut_into_runs_of_about_equal_size(numels, fragments, expected):
    kinds = assign(numels, fragments)
    assert kinds == expected
    assert all(b - a in (0, 1) for a, b in zip(kinds, kinds[1:]))


def test_fragments_of_the_model_and_their_steps():
    model = _model()
    for fragments, members in FRAGMENTS.items():
        opt = _make(model, "local", fragments=fragments)
        params = list(model.parameters())
        assert [opt.fragment_of(p) for p in params] == [k for k, m in enumerate(members) for _ in m]
        expected = ["outer" if any(t % H == k * H // fragments for k in range(fragments)) else "inner"
                    for t in range(1, 2 * H + 1)]
        assert [opt.plan_for(t).name for t in range(1, 2 * H + 1)] == expected
    assert _make(model, "local", fragments=2).num_buckets == 3 and _make(model, "local").num_buckets == 1
    # bucket_size still caps the buckets when it is the smaller
    assert _make(model, "local", fragments=2, bucket_size=40).num_buckets == 4  # 48 | 8 | 64 | 35


def test_fragments_one_is_the_run_without_fragments():
    """One process: the same steps, state dict and statistics bit for bit (the 2- and 3-rank
    runs below check the same with the 1-bit all-reduce)."""
    runs = []
    for kwargs in ({}, {"fragments": 1}):
        model = _model()
        opt = _make(model, "local", **kwargs)
        for t in range(1, STEPS + 1):
            opt.zero_grad(set_to_none=True)
            _backward(model, 0, t)
            opt.step()
        runs.append((clone_params(model.parameters()), opt.state_dict()))
    assert all_equal(runs[0][0], runs[1][0])
    assert "fragments" not in runs[1][1]["param_groups"][0]["onebit"]  # (state dicts of the default unchanged)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(fragments=0), r"fragments must be an int >= 1 .*got 0"),
    (dict(fragments=2.0), r"fragments must be an int >= 1 .*got 2.0"),
    (dict(fragments=True), r"fragments must be an int >= 1 .*got True"),
    (dict(fragments="2"), r"fragments must be an int >= 1 .*got '2'"),
    (dict(fragments=5), r"fragments=5 > sync_every=4: .*pass fragments <= sync_every \(or sync_every >= 5\)"),
    (dict(fragments=2, sync_every=1), r"fragments=2 > sync_every=1"),
])
def test_bad_fragments_are_refused(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        _make(_model(), "local", **kwargs)


def test_too_few_buckets_are_refused_with_the_fix():
    """A tensor is never split: one of 4096 elements beside one of 4 cannot make 3 fragments."""
    params = [torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match=r"fragments=3\): the trainable parameters make 2 buckets, one fewer than a "
                       r"fragment each needs \(a tensor is never split: the largest has 4096 of the 4100 elements\); "
                       r"pass fragments <= 2"):
        OnebitDiLoCo(params, sync_every=4, fragments=3, comm_backend_name="local")
    assert OnebitDiLoCo(params, sync_every=4, fragments=2, comm_backend_name="local").num_buckets == 2


def test_fragment_of_a_stranger_is_refused():
    opt = _make(_model(), "local", fragments=2)
    with pytest.raises(ValueError, match=r"fragment_of: the tensor of shape \(3,\) is not a trainable parameter"):
        opt.fragment_of(torch.zeros(3))


# ----------------------------------------------------------------------------- state


def _train(model: torch.nn.Module, opt: OnebitDiLoCo, steps) -> None:
    for t in steps:
        opt.zero_grad(set_to_none=True)
        _backward(model, 0, t)
        opt.step()


def test_a_round_trip_mid_round_continues_bit_for_bit():
    """A save after step 3 (fragment 1 synced at 2, fragment 0 not yet) loaded into an optimizer
    built with other settings (the same fragments: the same buckets) continues bit for bit; the
    schedule, fragments included, travels with the state."""
    model = _model()
    opt = _make(model, "local", fragments=2)
    _train(model, opt, range(1, STEPS + 1))
    straight = clone_params(model.parameters())

    model = _model()
    opt = _make(model, "local", fragments=2)
    _train(model, opt, range(1, 4))
    state, errors = opt.state_dict(), [(w.clone(), s.clone()) for w, s in opt.compression_errors()]
    assert state["param_groups"][0]["onebit"]["fragments"] == 2
    values = clone_params(model.parameters())
    model = _model(seed=5)
    opt = OnebitDiLoCo(model.parameters(), sync_every=8, fragments=2, comm_backend_name="local")
    with torch.no_grad():
        for p, q in zip(model.parameters(), values):
            p.copy_(q)
    opt.restore(state, errors)
    assert (opt.sync_every, opt.fragments) == (H, 2)
    _train(model, opt, range(4, STEPS + 1))
    assert all_equal(clone_params(model.parameters()), straight)


def test_a_checkpoint_without_fragments_loads_as_one_and_a_bad_one_is_refused():
    model = _model()
    opt = _make(model, "local", fragments=2)
    _train(model, opt, range(1, 3))
    state = opt.state_dict()
    old = {**state, "param_groups": [{**g, "onebit": {k: v for k, v in g["onebit"].items() if k != "fragments"}}
                                     for g in state["param_groups"]]}
    loaded = _make(_model(), "local", fragments=2)
    loaded.load_state_dict(old)
    assert loaded.fragments == 1 and loaded.plan_for(2).name == "inner" and loaded.plan_for(4).name == "outer"
    bad = {**state, "param_groups": [{**g, "onebit": {**g["onebit"], "fragments": 5}} for g in state["param_groups"]]}
    with pytest.raises(ValueError, match=r"fragments=5 > sync_every=4 in the checkpoint"):
        loaded.load_state_dict(bad)
    assert loaded.fragments == 1  # (nothing changed)


def test_more_fragments_than_buckets_after_a_load_leave_the_last_empty(caplog):
    """A state of fragments=2 loaded into an optimizer built without (one bucket): fragments
    restored, said once; fragment 1 holds nothing, its steps are inner steps."""
    model = _model()
    opt = _make(model, "local", fragments=2)
    _train(model, opt, range(1, 3))
    loaded = _make(_model(), "local")
    with caplog.at_level(logging.WARNING, logger="onebit"):
        loaded.load_state_dict(opt.state_dict())
        assert [loaded.plan_for(t).name for t in range(1, 9)] == ["inner"] * 3 + ["outer"] + ["inner"] * 3 + ["outer"]
    assert loaded.fragments == 2
    assert [r.getMessage() for r in caplog.records].count(
        "onebit: OnebitDiLoCo fragments=2, but its 1 buckets (laid out when it was built, for the parameters training "
        "then) fill 1 of them: the steps of the others are inner steps. Build the optimizer with fragments=2 to cut "
        "the parameters into that many") == 1


# ----------------------------------------------------------------------------- 2 and 3 ranks


def simulate(world_size: int, fragments: int, steps: int = STEPS, compression: str = "onebit") -> list[list]:
    """Every rank's parameters after every step, from the maths (see the module docstring)."""
    members = FRAGMENTS[fragments]
    models = [_model() for _ in range(world_size)]
    inners = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    glob = list(_model().parameters())
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    errors = [(None, None)] * fragments
    out = []
    for t in range(1, steps + 1):
        for rank, (m, inner) in enumerate(zip(models, inners)):
            m.zero_grad(set_to_none=True)
            _backward(m, rank, t)
            inner.step()
        for k, mine in enumerate(members):
            if t % H != k * H // fragments:
                continue
            numels = [glob[i].numel() for i in mine]
            deltas = [torch.cat([(glob[i] - list(m.parameters())[i]).detach().reshape(-1) for i in mine]) for m in models]
            if compression == "none":
                average = torch.stack(deltas).sum(0) / world_size
            else:
                sim = simulate_compressed_allreduce(deltas, *errors[k], numels=numels)
                errors[k], average = (sim.worker_errors, sim.server_errors), sim.output
            for i, g in enumerate(glob):  # (a parameter without a gradient: torch's SGD leaves it and its momentum)
                g.grad = None
            for i, piece in zip(mine, average.split(numels)):
                glob[i].grad = piece.view_as(glob[i]).clone()
            outer.step()
            with torch.no_grad():
                for m in models:
                    for i in mine:
                        list(m.parameters())[i].copy_(glob[i])
        out.append([clone_params(m.parameters()) for m in models])
    return out


def test_simulation_can_fail(monkeypatch):
    """The oracle tells the fragments apart: P = 1, 2 and 3, and P = 2 with its fragments in the
    other order, end farther apart than the tolerance of the comparison."""
    runs = [simulate(2, fragments) for fragments in (1, 2, 3)]
    monkeypatch.setitem(FRAGMENTS, 2, FRAGMENTS[2][::-1])
    runs.append(simulate(2, 2))
    assert all(max_abs_diff(a[-1], runs[1][-1]) > 1e-3 for a in runs[:1] + runs[2:])


def _run(rank: int, make_model=_model, steps: int = STEPS, **kwargs) -> dict:
    model = make_model()
    opt = _make(model, **kwargs)
    trajectory, identical, sent = [], [], []
    for t in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, t)
        opt.step()
        trajectory.append(clone_params(model.parameters()))
        identical.append(opt.replicas_identical)
        sent.append(opt.comm_stats()["last_step"]["bytes_sent"])
    opt.synchronize()
    return {"trajectory": trajectory, "identical": identical, "sent": sent, "stats": opt.comm_stats(),
            "global": [opt.state[p]["global_params"].clone() for p in model.parameters()],
            "synchronized": opt.replicas_identical}


def _resumed_at(rank: int, directory: str, at: int) -> list[list[torch.Tensor]]:
    """The fragments=2 run, saved with save_checkpoint(exact_resume=True) after step ``at`` and
    continued by a new model and optimizer (another seed and sync_every) loaded from it."""
    model = _model()
    opt = _make(model, fragments=2)
    trajectory = []
    for t in range(1, STEPS + 1):
        if t == at + 1:
            path = os.path.join(directory, f"at{at}.pt")
            save_checkpoint(path, opt, model=model, exact_resume=True)
            model = _model(seed=5)
            opt = OnebitDiLoCo(model.parameters(), sync_every=7, fragments=2, comm_backend_name="gloo")
            load_checkpoint(path, opt, model=model, exact_resume=True)
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, t)
        opt.step()
        trajectory.append(clone_params(model.parameters()))
    return trajectory


def _every_run(rank: int, world_size: int, directory: str) -> dict:
    out = {"plain": _run(rank), "none": _run(rank, fragments=2, compression="none")}
    out.update({fragments: _run(rank, fragments=fragments) for fragments in (1, 2, 3)})
    out["equal"] = {fragments: _run(rank, _equal_layers, steps=2 * H, fragments=fragments) for fragments in (1, 2, 4)}
    out["resumed"] = {at: _resumed_at(rank, directory, at) for at in (3, 4)}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["n2", "n3"])
def ranks(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """Every rank's runs (one spawn per world size)."""
    directory = tmp_path_factory.mktemp("fragments")
    return request.param, run_ranks(_every_run, request.param, directory, str(directory), timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("fragments", [2, 3])
def test_every_rank_follows_the_simulation(ranks, fragments):
    world_size, runs = ranks
    expected = simulate(world_size, fragments)
    members = FRAGMENTS[fragments]
    for rank, run in enumerate(runs):
        for t, (mine, theirs) in enumerate(zip(run[fragments]["trajectory"], expected), start=1):
            for a, b in zip(mine, theirs[rank]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank} step {t}")
        # the global parameters are the same on every rank, bit for bit
        assert all_equal(run[fragments]["global"], runs[0][fragments]["global"])
        assert run[fragments]["synchronized"] is True
    for t in range(1, STEPS + 1):
        k = fragment_at(t, H, fragments)
        for i in range(6):
            same = all(torch.equal(r[fragments]["trajectory"][t - 1][i], runs[0][fragments]["trajectory"][t - 1][i])
                       for r in runs)
            assert same == (k is not None and i in members[k]), (t, i)  # only the fragment just synced is the same
        assert runs[0][fragments]["identical"][t - 1] is False
    sent = runs[0][fragments]["sent"]  # (steps 1 and 2 carry the layout check and the averaging check too)
    assert all((s > 0) == (fragment_at(t, H, fragments) is not None) for t, s in enumerate(sent[2:], start=3)), sent
    stats = runs[0][fragments]["stats"]["outer"]
    assert stats["steps"] == sum(fragment_at(t, H, fragments) is not None for t in range(1, STEPS + 1))
    numels = [p.numel() for p in _model().parameters()]
    assert [f["numel"] for f in stats["fragments"]] == [sum(numels[i] for i in mine) for mine in members]
    assert [f["steps"] for f in stats["fragments"]] == [
        sum(fragment_at(t, H, fragments) == k for t in range(1, STEPS + 1)) for k in range(fragments)]
    assert sum(f["bytes_sent"] for f in stats["fragments"]) == stats["bytes_sent"]


@pytest.mark.slow
def test_compression_none_with_fragments_averages_exactly(ranks):
    world_size, runs = ranks
    expected = simulate(world_size, 2, compression="none")
    for rank, run in enumerate(runs):
        for t, (mine, theirs) in enumerate(zip(run["none"]["trajectory"], expected), start=1):
            for a, b in zip(mine, theirs[rank]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank} step {t}")


@pytest.mark.slow
def test_fragments_one_equals_the_run_without_fragments(ranks):
    _, runs = ranks
    for run in runs:
        for mine, plain in zip(run[1]["trajectory"], run["plain"]["trajectory"]):
            assert all_equal(mine, plain) and len(mine) == len(plain)
        assert run[1]["sent"] == run["plain"]["sent"]
        assert run[1]["stats"]["outer"]["bytes_sent"] == run["plain"]["stats"]["outer"]["bytes_sent"]


@pytest.mark.slow
def test_the_peak_is_divided_by_the_fragments_and_a_round_sends_the_same(ranks):
    """Four equal tensors: the largest step of fragments=P sends 1/P of fragments=1's (plus the
    step's small flag all-reduce), and two rounds send the same bytes whatever P."""
    world_size, runs = ranks
    equal = runs[0]["equal"]
    whole = max(equal[1]["sent"][2:])  # (steps 1 and 2 also carry the layout check and the averaging check)
    for fragments in (2, 4):
        peak = max(equal[fragments]["sent"][2:])
        # whole = C + f and peak = C / P + f, with f the step's flag all-reduce (a few float32)
        assert 0 <= peak * fragments - whole <= (fragments - 1) * 2 * (world_size - 1) / world_size * 4 * 5, (
            fragments, peak, whole)
        total = equal[fragments]["stats"]["outer"]["bytes_sent"]
        assert total == pytest.approx(equal[1]["stats"]["outer"]["bytes_sent"], rel=0.05), fragments
        assert equal[fragments]["stats"]["outer"]["steps"] == 2 * fragments


@pytest.mark.slow
def test_an_exact_resume_mid_round_continues_bit_for_bit(ranks):
    """Saved after step 3 (fragment 1 synced at step 2, fragment 0 due at 4) and after step 4
    (right after fragment 0's outer step): the resumed runs equal the straight one bit for bit."""
    _, runs = ranks
    for run in runs:
        for at, trajectory in run["resumed"].items():
            for t, (mine, straight) in enumerate(zip(trajectory, run[2]["trajectory"]), start=1):
                assert all_equal(mine, straight), (at, t)
