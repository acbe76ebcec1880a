"""OnebitDiLoCo's ``sync_delay`` (issue 42, part 2: a fragment's exchange overlapped with the next
inner steps, Streaming DiLoCo's overlap).

At the outer step ``t0`` of a fragment the pseudo-gradients are formed and their 1-bit exchange
starts; ``tau`` inner steps later (after that step's inner step) it lands: ``progress = p -
(global - delta_i)``, the outer step on the average, ``p = global [- residual] + sync_mix *
progress``. The oracle is a single-process simulation written from that rule (per rank a torch
AdamW; the averages by :func:`onebit.testing.simulate_compressed_allreduce`, a second pass sending
the first's worker errors with its server errors; torch's Nesterov SGD on the global parameters
of the fragment). On 2 and 3 gloo ranks every rank follows it within 1e-6, the global parameters
are the same on every rank bit for bit, and an exact resume with an exchange in flight (saved
right after it started, and after its server stage) continues bit for bit.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from conftest import all_equal, clone_params, max_abs_diff
from distributed import run_ranks
from onebit import OnebitDiLoCo, load_checkpoint, save_checkpoint
from onebit.fragments import fragment_at
from onebit.compression import SegmentLayout
from onebit.testing import simulate_compressed_allreduce
from test_diloco_fragments import FRAGMENTS, H, LR, _backward, _model

STEPS = 11
CLASSIC = {"error_feedback": "buffer", "outer_bits": 1, "outer_lr": 0.7, "outer_momentum": 0.9}
# name -> the optimizer's settings (H 4: fragments=2 leaves room for tau 1, fragments=1 for tau <= 3)
CASES = {
    "classic_f2_tau1": {**CLASSIC, "fragments": 2, "sync_delay": 1},
    "classic_f1_tau2": {**CLASSIC, "fragments": 1, "sync_delay": 2},
    "defaults_f1_tau3_mix": {"fragments": 1, "sync_delay": 3, "sync_mix": 0.5},
    "defaults_f2_tau1_mix0": {"fragments": 2, "sync_delay": 1, "sync_mix": 0.0},
    "none_f2_tau1": {"compression": "none", "fragments": 2, "sync_delay": 1, "outer_lr": 0.7, "outer_momentum": 0.9},
}


def _make(model: torch.nn.Module, backend: str = "gloo", **kwargs) -> OnebitDiLoCo:
    return OnebitDiLoCo(model.parameters(), **{"lr": LR, "sync_every": H, "comm_backend_name": backend, **kwargs})


def simulate(world_size: int, settings: dict, steps: int = STEPS) -> list[list]:
    """Every rank's parameters after every step, from the rule (see the module docstring)."""
    fragments, tau = settings.get("fragments", 1), settings["sync_delay"]
    mix = settings.get("sync_mix", 1.0)
    exact = settings.get("compression") == "none"
    passes = 1 if exact else settings.get("outer_bits", 2)
    model_feedback = not exact and settings.get("error_feedback", "model") == "model"
    members = FRAGMENTS[fragments]
    models = [_model() for _ in range(world_size)]
    inners = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    glob = list(_model().parameters())
    outer = torch.optim.SGD(glob, lr=settings.get("outer_lr", 1.0), momentum=settings.get("outer_momentum", 0.0),
                            nesterov=settings.get("outer_momentum", 0.0) > 0)
    errors = [(None, None)] * fragments
    in_flight = {}  # step it lands -> (fragment, deltas, average, residuals)
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
            if exact:
                average, residuals = torch.stack(deltas).sum(0) / world_size, None
            else:
                inputs, (workers, servers) = deltas, errors[k]
                layout = SegmentLayout.build(numels, world_size)
                average = None
                for _ in range(passes):  # (pass k + 1 sends what pass k left: its worker errors' elements)
                    sim = simulate_compressed_allreduce(inputs, workers, servers, numels=numels)
                    average = sim.output if average is None else average + sim.output
                    inputs = [torch.cat([e[s:s + n] for s, n in zip(layout.starts, numels)]) for e in sim.worker_errors]
                    workers, servers = None, sim.server_errors
                residuals = inputs
                errors[k] = (None if model_feedback else sim.worker_errors, sim.server_errors)
            in_flight[t + tau] = (k, deltas, average, residuals)
        if t in in_flight:
            k, deltas, average, residuals = in_flight.pop(t)
            mine = members[k]
            numels = [glob[i].numel() for i in mine]
            progress = [torch.cat([list(m.parameters())[i].detach().reshape(-1) for i in mine]) - (
                torch.cat([glob[i].detach().reshape(-1) for i in mine]) - d) for m, d in zip(models, deltas)]
            for g in glob:
                g.grad = None
            for i, piece in zip(mine, average.split(numels)):
                glob[i].grad = piece.view_as(glob[i]).clone()
            outer.step()
            with torch.no_grad():
                for rank, m in enumerate(models):
                    base = torch.cat([glob[i].detach().reshape(-1) for i in mine])
                    if model_feedback:
                        base = base - residuals[rank]
                    new = base + mix * progress[rank]
                    for i, piece in zip(mine, new.split(numels)):
                        list(m.parameters())[i].copy_(piece.view_as(glob[i]))
        out.append([clone_params(m.parameters()) for m in models])
    return out


def test_simulation_can_fail():
    """The oracle tells the delays and mixes apart: each case ends farther from the others than
    the comparison's tolerance."""
    runs = {name: simulate(2, settings) for name, settings in CASES.items()}
    runs["classic_f1_tau1"] = simulate(2, {**CLASSIC, "fragments": 1, "sync_delay": 1})
    runs["defaults_f1_tau3_mix1"] = simulate(2, {"fragments": 1, "sync_delay": 3})
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert max_abs_diff(runs[a][-1], runs[b][-1]) > 1e-3, (a, b)


def test_the_plans_and_a_bad_delay():
    model = _model()
    opt = _make(model, "local", sync_every=8, fragments=2, sync_delay=2)
    assert [opt.plan_for(t).name for t in range(1, 10)] == [
        "inner", "inner", "inner", "outer", "inner", "inner", "inner", "outer", "inner"]
    assert [opt._sync_start(t) for t in range(1, 10)] == [None] * 4 + [4, 4, None, None, 8]
    for kwargs, pattern in [({"sync_delay": 4, "fragments": 2, "sync_every": 8}, r"pass sync_delay <= 3"),
                            ({"sync_delay": -1}, r"sync_delay must be an int >= 0"),
                            ({"sync_delay": 1.5}, r"sync_delay must be an int >= 0"),
                            ({"sync_delay": 1, "sync_mix": 1.5}, r"sync_mix"),
                            ({"sync_mix": 0.5}, r"with sync_delay=0 none is: pass sync_delay > 0 too")]:
        with pytest.raises(ValueError, match=pattern):
            _make(_model(), "local", **kwargs)


def test_a_parameter_without_a_gradient_at_the_outer_step_is_left_alone():
    """The last layer has no gradient at the outer step (4): when the exchange lands (6) its
    global parameters are as they were, and the layer keeps its own values (no gradient at 6
    either: no inner step moves it); the others moved."""
    model = _model()
    opt = _make(model, "local", sync_delay=2)
    for t in range(1, 7):
        opt.zero_grad(set_to_none=True)
        _backward(model, 0, t)
        if t in (4, 6):  # (at 6 too, so that no inner step moves it)
            model[4].weight.grad = None
        if t == 6:
            before = {name: (p.detach().clone(), opt.state[p]["global_params"].clone())
                      for name, p in model.named_parameters()}
        opt.step()
    global_now = opt.state[model[4].weight]["global_params"]
    assert torch.equal(global_now, before["4.weight"][1])
    assert torch.equal(model[4].weight.detach(), before["4.weight"][0])
    assert not torch.equal(opt.state[model[0].weight]["global_params"], before["0.weight"][1])


def test_a_parameter_without_a_gradient_at_the_outer_step_only_keeps_its_outer_state():
    """No gradient at the outer step (4) only: the landing (6) leaves its global parameters and
    outer momentum as they were, while the layers that had one moved theirs."""
    model = _model()
    opt = _make(model, "local", sync_delay=2, **CLASSIC)
    for t in range(1, 7):
        opt.zero_grad(set_to_none=True)
        _backward(model, 0, t)
        if t == 4:
            model[4].weight.grad = None
        if t == 6:
            before = {name: {k: opt.state[p][k].clone() for k in ("global_params", "outer_momentum_buffer")}
                      for name, p in model.named_parameters()}
        opt.step()
    for key in ("global_params", "outer_momentum_buffer"):
        assert torch.equal(opt.state[model[4].weight][key], before["4.weight"][key])
        assert not torch.equal(opt.state[model[0].weight][key], before["0.weight"][key])


def test_the_health_check_runs_at_the_same_steps_with_a_delay(monkeypatch):
    """Every 16th compressed step measures the errors (at its landing with sync_delay) and the next
    one judges them: at step 34 with sync_every 2, with or without a delay."""
    from onebit.health import Health

    judged = []
    real = Health.judge
    monkeypatch.setattr(Health, "judge", lambda self, ratio, t, rank: (judged.append(t), real(self, ratio, t, rank)))
    for delay in (0, 1):
        judged.clear()
        model = _model()
        opt = _make(model, "local", sync_every=2, sync_delay=delay)
        for t in range(1, 41):
            opt.zero_grad(set_to_none=True)
            _backward(model, 0, t)
            opt.step()
        assert judged == [34], (delay, judged)


def test_an_exchange_in_flight_that_the_buckets_no_longer_match_is_dropped_with_a_warning(caplog):
    """Saved with fragment 0 in flight (fragments 2), loaded into an optimizer built with one
    fragment (one bucket: the schedule brings fragments=2 back over it): the exchange cannot be
    started again over the same parameters, so it is dropped, said once, and fragment 1's global
    parameters are left as they were."""
    model = _model()
    opt = _make(model, "local", sync_every=8, fragments=2, sync_delay=3)
    for t in range(1, 9):
        opt.zero_grad(set_to_none=True)
        _backward(model, 0, t)
        opt.step()
    state = opt.state_dict()
    assert state["param_groups"][0]["onebit"]["sync_pending"]["params"] == [0, 1]
    loaded = _make(model, "local", sync_every=8)
    loaded.load_state_dict(state)
    before = [loaded.state[p]["global_params"].clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="onebit"):
        for t in range(9, 12):
            loaded.zero_grad(set_to_none=True)
            _backward(model, 0, t)
            loaded.step()
    assert sum("the checkpoint held the exchange of the outer step 8 in flight" in r.getMessage()
               for r in caplog.records) == 1
    assert all(torch.equal(loaded.state[p]["global_params"], b) for p, b in zip(model.parameters(), before))


def test_a_dcp_checkpoint_with_the_exchange_in_flight_continues_bit_for_bit(tmp_path):
    """torch.distributed.checkpoint (the optimizer's state dict through get/set_optimizer_state_dict)
    and the compression errors saved beside it, after steps 4 (the exchange just started), 5 and 6
    (its server stage taken): the loaded run equals the straight one bit for bit."""
    from distributed import dcp_load, dcp_save
    from onebit.checkpoint import load_compression_errors, save_compression_errors

    settings = {"sync_delay": 3, "outer_momentum": 0.9, "outer_lr": 0.7}

    def run(at: int | None) -> list[list[torch.Tensor]]:
        model = _model()
        opt = _make(model, "local", **settings)
        trajectory = []
        for t in range(1, STEPS + 1):
            if t == at:
                path = str(tmp_path / f"at{at}")
                dcp_save(model, opt, path + "_dcp")
                save_compression_errors(path + "_errors", opt)
                model = _model(seed=3)
                opt = _make(model, "local", **settings)
                dcp_load(model, opt, path + "_dcp")
                load_compression_errors(path + "_errors", opt)
                assert opt._sync_pending is not None and opt._sync_pending["step"] == 4
            opt.zero_grad(set_to_none=True)
            _backward(model, 0, t)
            opt.step()
            trajectory.append(clone_params(model.parameters()))
        return trajectory

    straight = run(None)
    for at in (5, 6, 7):  # (saved before step ``at``: after steps 4, 5 and 6)
        for t, (mine, theirs) in enumerate(zip(run(at), straight), start=1):
            assert all_equal(mine, theirs), (at, t)


def _train(rank: int, settings: dict, steps: int = STEPS) -> dict:
    model = _model()
    opt = _make(model, **settings)
    trajectory, sent = [], []
    for t in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, t)
        opt.step()
        trajectory.append(clone_params(model.parameters()))
        sent.append(opt.comm_stats()["last_step"]["bytes_sent"])
    return {"trajectory": trajectory, "sent": sent, "stats": opt.comm_stats(),
            "global": [opt.state[p]["global_params"].clone() for p in model.parameters()]}


def _resumed_at(rank: int, directory: str, settings: dict, at: int) -> list[list[torch.Tensor]]:
    """The run saved with save_checkpoint(exact_resume=True) after step ``at`` and continued by a
    new model and optimizer (another seed, no sync_delay given: the checkpoint's wins)."""
    model = _model()
    opt = _make(model, **settings)
    trajectory = []
    for t in range(1, STEPS + 1):
        if t == at + 1:
            path = os.path.join(directory, f"at{at}.pt")
            save_checkpoint(path, opt, model=model, exact_resume=True)
            model = _model(seed=5)
            opt = OnebitDiLoCo(model.parameters(), sync_every=7, fragments=settings.get("fragments", 1),
                               comm_backend_name="gloo")
            load_checkpoint(path, opt, model=model, exact_resume=True)
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, t)
        opt.step()
        trajectory.append(clone_params(model.parameters()))
    return trajectory


def _every_run(rank: int, world_size: int, directory: str) -> dict:
    out = {name: _train(rank, settings) for name, settings in CASES.items()}
    # (tau 3 from step 4: saved at 4, in flight before its server stage; at 5 and 6, after it)
    out["resumed"] = {at: _resumed_at(rank, directory, CASES["defaults_f1_tau3_mix"], at) for at in (4, 5, 6)}
    out["resumed_f2"] = {at: _resumed_at(rank, directory, CASES["classic_f2_tau1"], at) for at in (2, 4)}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["n2", "n3"])
def ranks(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """Every rank's runs (one spawn per world size)."""
    directory = tmp_path_factory.mktemp("delay")
    return request.param, run_ranks(_every_run, request.param, directory, str(directory), timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_follows_the_simulation(ranks, case):
    world_size, runs = ranks
    expected = simulate(world_size, CASES[case])
    for rank, run in enumerate(runs):
        for t, (mine, theirs) in enumerate(zip(run[case]["trajectory"], expected), start=1):
            for a, b in zip(mine, theirs[rank]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{case}: rank {rank} step {t}")
        # the global parameters are the same on every rank, bit for bit
        assert all_equal(run[case]["global"], runs[0][case]["global"])


@pytest.mark.slow
def test_the_exchange_sends_across_the_steps_in_between(ranks):
    """With tau 2 (fragments 1, H 4, outer steps 4 and 8): the outer step starts the all-to-all,
    the next step waits for it and starts the all-gather, the landing step waits for that (a
    collective's bytes count at the step that completes it; the outer step's own are its small
    flag all-reduce); the next step sends nothing. The bytes count for the fragment."""
    world_size, runs = ranks
    run = runs[0]["classic_f1_tau2"]
    sent = run["sent"]
    flag = sent[3 - 1]  # (an inner step: nothing)
    assert flag == 0 and 0 < sent[4 - 1] < sent[5 - 1] and sent[6 - 1] > 0 and sent[7 - 1] == 0, sent
    stats = run["stats"]
    assert stats["outer"]["steps"] == 2 and stats["inner"]["steps"] == STEPS - 2
    assert stats["inner"]["bytes_sent"] > 0  # (the steps in between complete the exchange)
    # (steps 1 and 2 also carry the layout check and the averaging check: not a fragment's)
    early = sent[0] + sent[1]
    assert sum(f["bytes_sent"] for f in stats["outer"]["fragments"]) == (
        stats["outer"]["bytes_sent"] + stats["inner"]["bytes_sent"] - early)
    assert [f["steps"] for f in stats["outer"]["fragments"]] == [2]
    for t in range(1, STEPS + 1):
        assert (fragment_at(t, H, 1) is not None) == (t % H == 0)


@pytest.mark.slow
def test_an_exact_resume_with_the_exchange_in_flight_continues_bit_for_bit(ranks):
    _, runs = ranks
    for run in runs:
        for key, case in (("resumed", "defaults_f1_tau3_mix"), ("resumed_f2", "classic_f2_tau1")):
            for at, trajectory in run[key].items():
                for t, (mine, straight) in enumerate(zip(trajectory, run[case]["trajectory"]), start=1):
                    assert all_equal(mine, straight), (case, at, t)
