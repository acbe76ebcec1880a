"""A soak test of the whole state machine: hypothesis draws sequences of actions (steps, non-finite
gradients on a random rank, saves, loads, changes of learning rate) over both phases; 2 gloo ranks
play each sequence and check the invariants after every action; the last checkpoint is then
loaded on another world size (1 process).

``ONEBIT_SOAK_EXAMPLES`` (default 3) sets how many sequences run: a few in CI, hundreds on demand.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distributed import run_ranks
from onebit import OnebitAdam, OnebitLamb, load_checkpoint, save_checkpoint

EXAMPLES = int(os.environ.get("ONEBIT_SOAK_EXAMPLES", "3"))
OPTIMIZERS = {"adam": OnebitAdam, "lamb": OnebitLamb}

action = st.one_of(
    st.tuples(st.just("step"), st.sampled_from([-1, -1, -1, 0, 1])),  # the rank with a NaN gradient, or none
    st.tuples(st.just("save"), st.booleans()),  # exact_resume
    st.tuples(st.just("load"), st.booleans()),
    st.tuples(st.just("lr"), st.sampled_from([1e-3, 3e-3, 1e-2])),
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))


def _snapshot(model, opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        torch.as_tensor(v).clone().float() for p in model.parameters() for v in opt.state[p].values()]


def _play(rank: int, world_size: int, kind: str, actions: list, path: str) -> dict:
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters(), lr=3e-3, freeze_step=3, comm_backend_name="gloo")
    applied, saved, t = 0, None, 0
    for name, arg in actions:
        if name == "step":
            t += 1
            gen = torch.Generator().manual_seed(31 * t + rank)
            x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if arg == rank:
                next(model.parameters()).grad[0, 0] = float("nan")
            opt.step()
            applied += arg < 0  # a NaN on any rank skips the step on every rank
        elif name == "save":
            save_checkpoint(path, opt, model=model, exact_resume=arg)
            saved = (_snapshot(model, opt), opt.step_count)
        elif name == "load" and saved is not None:
            load_checkpoint(path, opt, model=model, exact_resume=arg)
            assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), saved[0])), "loaded != saved"
            applied = saved[1]
        elif name == "lr":
            for group in opt.param_groups:
                group["lr"] = arg
        # The invariants, after every action.
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)
        assert all(torch.equal(e, flat) for e in everyone), f"parameters differ between ranks after {name}"
        assert all(bool(torch.isfinite(v).all()) for v in _snapshot(model, opt)), f"non-finite state after {name}"
        assert opt.step_count == applied, f"step count {opt.step_count}, {applied} steps applied"
    return {"saved": None if saved is None else saved[0], "step": None if saved is None else saved[1]}


@pytest.mark.timeout(600)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 3,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(OPTIMIZERS)), actions=st.lists(action, min_size=6, max_size=24))
def test_any_sequence_of_steps_saves_loads_and_faults_keeps_the_invariants(tmp_path_factory, kind, actions):
    actions = [("step", -1)] * 2 + actions + [("save", True), ("step", -1)] * 2  # both phases, a last save
    tmp = tmp_path_factory.mktemp("soak")
    path = str(tmp / "ckpt.pt")
    results = run_ranks(_play, 2, tmp / "ranks", kind, actions, path)
    # The last checkpoint on another world size (one process): it loads, equal to what was saved.
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters(), lr=3e-3, freeze_step=3, comm_backend_name="local")
    load_checkpoint(path, opt, model=model, exact_resume=True)
    assert opt.step_count == results[0]["step"]
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), results[0]["saved"]))
