"""ZeroOneAdam checkpoints resume right, where DeepSpeed's did not (DEEPSPEED_LAMB_ZOADAM.md §2.6).

Every test trains a small model on real gloo ranks, each rank on its own data, with a schedule short
enough for every kind of step (``KINDS``), saves a checkpoint at step ``k``, trains on for a while
(the work a crash loses), then restarts: a fresh model with other weights and a fresh optimizer
load the checkpoint and train to the end. The oracle is the same run without the restart.

* With ``exact_resume`` on the same world size the final parameters equal the uninterrupted
  run's bit for bit on every rank: in the variance phase at an interval > 1 (DeepSpeed reset the
  interval and updated the variance from a local gradient), between syncs (each rank's own
  parameters, momentum and accumulator: DeepSpeed reset the schedule and took a phase-1 step on a
  local gradient), right after a sync, at the end of phase 1.
* Without it (or on another world size) every rank loads rank 0's state: right after the load
  every rank holds the same parameters and state, the schedule goes on as if uninterrupted,
  the variance is the same on every rank (and frozen in phase 2), and after the next sync the
  ranks are bit-identical. (The compression errors start afresh, so the run departs from the
  uninterrupted one by about the 1-bit quantization noise: on this tiny model as much as it moves.)
"""

from __future__ import annotations

import pytest
import torch

import onebit
from conftest import tiny_mlp
from distributed import run_ranks

SCHEDULE = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
STEPS = 24
# Steps 1..24 (V variance, G compressed gradient, S sync, L local).
KINDS = "VVVGVGVGGG" + "SSSLSLLLSLLLSL"
LOST = 2  # steps trained after the save and lost to the "crash"


def _model() -> torch.nn.Module:
    return tiny_mlp(6, 16, 4)


def _optimizer(model: torch.nn.Module) -> onebit.ZeroOneAdam:
    return onebit.ZeroOneAdam(model.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.01, comm_backend_name="gloo",
                              bucket_size=80, **SCHEDULE)


def _train(model, opt, rank: int, steps: range) -> None:
    for s in steps:
        gen = torch.Generator().manual_seed(1000 * s + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _snapshot(model, opt) -> dict:
    """The parameters and the state as saved (a variance released in phase 2: the one its denominator stands for)."""
    saved = opt.state_dict()["state"]
    return {"params": [p.detach().clone() for p in model.parameters()],
            "state": {name: [torch.as_tensor(saved[i][name]).clone() for i in range(len(saved))] for name in saved[0]},
            "step": opt.step_count}


def _rank(rank: int, world_size: int, directory: str, k: int | None, exact: bool) -> dict:
    model = _model()
    opt = _optimizer(model)
    if k is None:  # uninterrupted
        _train(model, opt, rank, range(1, STEPS + 1))
        return {"final": _snapshot(model, opt)}
    path = f"{directory}/ckpt-{k}-{exact}.pt"
    _train(model, opt, rank, range(1, k + 1))
    onebit.save_checkpoint(path, opt, model=model, exact_resume=exact)
    _train(model, opt, rank, range(k + 1, k + 1 + LOST))
    torch.distributed.barrier()  # the "restart": rank 0 has committed (it commits after save_checkpoint's all-gather)
    return _restart(rank, path, k, exact)


EXACT = (8, 10, 15, 16)
APPROXIMATE = (8, 16)


def _all_runs(rank: int, world_size: int, directory: str) -> dict:
    """Every run of these tests in one set of rank processes (spawning costs seconds)."""
    runs = {"uninterrupted": _rank(rank, world_size, directory, None, False)}
    runs.update({("exact", k): _rank(rank, world_size, directory, k, True) for k in EXACT})
    runs.update({("approximate", k): _rank(rank, world_size, directory, k, False) for k in APPROXIMATE})
    return runs


def _restart(rank: int, path: str, k: int, exact: bool) -> dict:
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other weights: the load must replace them
    opt = _optimizer(model)
    onebit.load_checkpoint(path, opt, model=model, exact_resume=exact)
    loaded = _snapshot(model, opt)
    plans = "".join(_letter(opt.plan_for(s).name) for s in range(k + 1, STEPS + 1))
    variance = opt.state_dict()["state"][0]["exp_avg_sq"].clone()
    trajectory = []
    for s in range(k + 1, STEPS + 1):
        _train(model, opt, rank, range(s, s + 1))
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return {"loaded": loaded, "plans": plans, "final": _snapshot(model, opt), "trajectory": trajectory,
            "variance_before": variance, "next_plan": opt.next_plan.name}


def _resume_on(rank: int, world_size: int, path: str, k: int) -> dict:
    return _restart(rank, path, k, exact=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zoadam_resume")
    return run_ranks(_all_runs, 2, directory, str(directory), timeout=600)


def _letter(name: str) -> str:
    return {"variance": "V", "compressed_gradient": "G", "sync": "S", "local": "L"}[name]


def test_schedule_of_these_tests():
    opt = onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(3))], backend=onebit.LocalBackend(), **SCHEDULE)
    assert "".join(_letter(opt.plan_for(s).name) for s in range(1, STEPS + 1)) == KINDS


# k: 8 = phase 1 at variance interval 4 (the next two steps are compressed-gradient steps; DeepSpeed's
# reset interval 1 took them for variance updates on local gradients); 10 = the end of phase 1;
# 15 = right after a sync; 16 = between syncs (a local step; ranks differ).
@pytest.mark.slow
@pytest.mark.parametrize("k", EXACT)
def test_exact_resume_is_bit_identical(k, runs):
    results = [r[("exact", k)] for r in runs]
    for rank, (got, want) in enumerate(zip(results, (r["uninterrupted"] for r in runs))):
        assert got["loaded"]["step"] == k
        for a, b in zip(got["final"]["params"], want["final"]["params"]):
            assert torch.equal(a, b), (k, rank, float((a - b).abs().max()))
        for name, tensors in want["final"]["state"].items():
            assert all(torch.equal(a, b) for a, b in zip(got["final"]["state"][name], tensors)), (k, rank, name)
    ranks_differ = any(not torch.equal(a, b) for a, b in zip(results[0]["loaded"]["params"], results[1]["loaded"]["params"]))
    assert ranks_differ == (KINDS[k - 1] == "L")  # each rank resumed its own parameters between syncs


@pytest.mark.slow
@pytest.mark.parametrize("k", APPROXIMATE)
def test_resume_without_exact_state_is_the_same_on_every_rank(k, runs):
    _check_common_resume([r[("approximate", k)] for r in runs], k)


@pytest.mark.slow
def test_resume_on_three_ranks_from_two(tmp_path):
    k = 16  # between syncs: the two ranks' parameters differ; rank 0's are saved
    run_ranks(_rank, 2, tmp_path / "save", str(tmp_path), k, False)
    results = run_ranks(_resume_on, 3, tmp_path / "load", f"{tmp_path}/ckpt-{k}-False.pt", k)
    _check_common_resume(results, k)


def _check_common_resume(results: list[dict], k: int) -> None:
    first = results[0]
    for r in results:
        # Right after the load: rank 0's saved state on every rank, and the schedule where it was.
        assert r["loaded"]["step"] == k and r["plans"] == KINDS[k:]
        assert all(torch.equal(a, b) for a, b in zip(r["loaded"]["params"], first["loaded"]["params"]))
        for name, tensors in first["loaded"]["state"].items():
            assert all(torch.equal(a, b) for a, b in zip(r["loaded"]["state"][name], tensors)), name
        # After the next sync (and at the end, a sync step) every rank holds the same bits.
        for s, params in enumerate(r["trajectory"], start=k + 1):
            same = all(torch.equal(a, b) for a, b in zip(params, first["trajectory"][s - k - 1]))
            if KINDS[s - 1] != "L":
                assert same, s
        final = r["final"]
        assert all(torch.isfinite(p).all() for p in final["params"])
        # The variance changes only on variance steps, from averaged gradients: the same everywhere.
        assert all(torch.equal(a, b) for a, b in zip(final["state"]["exp_avg_sq"], first["final"]["state"]["exp_avg_sq"]))
        if k > SCHEDULE["var_freeze_step"]:
            assert torch.equal(r["variance_before"], final["state"]["exp_avg_sq"][0])  # frozen


def _save_without_model(rank: int, world_size: int, path: str) -> bool:
    model = _model()
    opt = _optimizer(model)
    _train(model, opt, rank, range(1, 17))  # step 16 is local
    assert not opt.replicas_identical
    with pytest.raises(ValueError, match="pass model=model"):
        onebit.save_checkpoint(path, opt, exact_resume=True)
    onebit.save_checkpoint(path, opt, model=model, exact_resume=True)
    return True


@pytest.mark.slow
def test_exact_resume_between_syncs_needs_the_model(tmp_path):
    assert run_ranks(_save_without_model, 2, tmp_path, str(tmp_path / "ckpt.pt")) == [True, True]


def test_a_compress_false_group_round_trips_in_phase_two():
    # Only compressed buckets have the phase-2 buffers; the state dict loads back into either phase.
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    opt = onebit.ZeroOneAdam([{"params": [a]}, {"params": [b], "compress": False}], var_freeze_step=1,
                             backend=onebit.LocalBackend())
    phase_one = opt.state_dict()
    for _ in range(2):
        a.grad, b.grad = torch.ones(4), torch.ones(3)
        opt.step()
    saved = opt.state_dict()
    assert "sync_point" in saved["state"][0] and "sync_point" not in saved["state"][1]
    opt.load_state_dict(phase_one)
    assert "sync_point" not in opt.state[a] and opt.step_count == 0
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[a]["sync_point"], saved["state"][0]["sync_point"]) and opt.step_count == 2
