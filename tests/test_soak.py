"""A soak test of the whole state machine: hypothesis draws sequences of actions (steps, non-finite
gradients on a random rank, saves, loads, changes of learning rate) over both phases of every
optimizer; 2 gloo ranks play each sequence and check the invariants after every action; the last
checkpoint is then loaded on another world size (1 process).

The invariants: parameters identical on every rank (for 0/1 Adam whenever ``replicas_identical``:
after phase-1 steps and syncs; between syncs they differ by design), state finite, the step count
equal to the steps applied (a step skipped for a NaN does not count, except a local step of 0/1
Adam, which the other rank takes and which counts on both), and a loaded state equal to what was
saved (every rank's own with exact resume, else rank 0's on every rank).

``ONEBIT_SOAK_EXAMPLES`` (default 1) sets how many sequences run per optimizer: one in CI, hundreds
on demand.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.slow  # gloo ranks

EXAMPLES = int(os.environ.get("ONEBIT_SOAK_EXAMPLES", "1"))
OPTIMIZERS = {
    "adam": lambda params, backend: OnebitAdam(params, lr=3e-3, freeze_step=3, comm_backend_name=backend),
    "lamb": lambda params, backend: OnebitLamb(params, lr=3e-3, freeze_step=3, comm_backend_name=backend),
    # Steps: V G V, then S S L S L L L S ... (variance, 1-bit gradient, sync, local)
    "zoadam": lambda params, backend: ZeroOneAdam(params, lr=3e-3, var_freeze_step=3, var_update_scaler=1,
                                                  local_step_scaler=2, local_step_clipper=4,
                                                  comm_backend_name=backend),
}

action = st.one_of(
    st.tuples(st.just("step"), st.sampled_from([-1, -1, -1, 0, 1])),  # the rank with a NaN gradient, or none
    st.tuples(st.just("save"), st.booleans()),  # exact_resume
    st.tuples(st.just("load"), st.booleans()),
    st.tuples(st.just("lr"), st.sampled_from([1e-3, 3e-3, 1e-2])),
)


def _model() -> torch.nn.Module:
    return tiny_mlp(5, 9, 2)


def _snapshot(model, opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        torch.as_tensor(v).clone().float() for p in model.parameters() for v in opt.state[p].values()]


def _gathered(tensors: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return everyone


def _play(rank: int, world_size: int, kind: str, actions: list, path: str) -> dict:
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters(), "gloo")
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
            local = opt.next_plan.name == "local"
            opt.step()
            # A NaN on any rank skips the step on every rank, but a local step counts on both.
            applied += arg < 0 or local
        elif name == "save":
            save_checkpoint(path, opt, model=model, exact_resume=arg)
            saved = (_snapshot(model, opt), opt.step_count, arg)
        elif name == "load" and saved is not None:
            load_checkpoint(path, opt, model=model, exact_resume=arg)
            loaded = _snapshot(model, opt)
            everyone = _gathered(loaded, world_size)
            if not (arg and saved[2]):  # rank 0's state on every rank
                assert all(torch.equal(e, everyone[0]) for e in everyone), "ranks loaded different states"
            if (arg and saved[2]) or rank == 0:
                assert all(torch.equal(a, b) for a, b in zip(loaded, saved[0])), "loaded != saved"
            applied = saved[1]
        elif name == "lr":
            for group in opt.param_groups:
                group["lr"] = arg
        # The invariants, after every action.
        if opt.replicas_identical:
            everyone = _gathered([p.detach() for p in model.parameters()], world_size)
            assert all(torch.equal(e, everyone[0]) for e in everyone), f"parameters differ between ranks after {name}"
        assert all(bool(torch.isfinite(v).all()) for v in _snapshot(model, opt)), f"non-finite state after {name}"
        assert opt.step_count == applied, f"step count {opt.step_count}, {applied} steps applied"
    return {"saved": None if saved is None else saved[0], "step": None if saved is None else saved[1]}


@pytest.mark.timeout(600)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 3,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@given(actions=st.lists(action, min_size=6, max_size=24))
def test_any_sequence_of_steps_saves_loads_and_faults_keeps_the_invariants(tmp_path_factory, kind, actions):
    actions = [("step", -1)] * 4 + actions + [("save", True), ("step", -1)] * 2  # both phases, a last save
    tmp = tmp_path_factory.mktemp("soak")
    path = str(tmp / "ckpt.pt")
    results = run_ranks(_play, 2, tmp / "ranks", kind, actions, path)
    # The last checkpoint on another world size (one process): it loads, equal to what was saved.
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters(), "local")
    load_checkpoint(path, opt, model=model, exact_resume=True)
    assert opt.step_count == results[0]["step"]
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), results[0]["saved"]))
