"""torch.optim's conventions on real gloo ranks, and misuse that fails loudly (issue 24).

One launch of 2 ranks runs every check for every optimizer of the family (process start-up is
most of a distributed test's time): gradients that are None on every rank or on some, a
forgotten DDP adapter, an adapter attached too late, and ``synchronize()``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import LogMessages, clone_params, released_buffers, short_schedules, tiny_mlp
from distributed import run_ranks
from onebit.integrations import attach_ddp

pytestmark = pytest.mark.slow

SCHEDULES = short_schedules()
STEPS = 12


def _model() -> torch.nn.Module:
    return tiny_mlp(6, 16, 3)


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * t + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _backward(model: torch.nn.Module, rank: int, t: int) -> None:
    x, y = _batch(rank, t)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _none_grads(cls, rank: int) -> dict:
    """Layer 0 has no gradient on any rank from step 2 on; layer 2's bias has none on rank 1 only."""
    model = _model()
    opt = cls(model.parameters(), lr=1e-2, **SCHEDULES[cls])
    untouched, identical = [], []
    for t in range(1, STEPS + 1):
        _backward(model, rank, t)
        if t > 1:
            for p in model[0].parameters():
                p.grad = None
            if rank == 1:
                model[2].bias.grad = None
        before = clone_params(model[0].parameters())
        state = [{k: v.clone() for k, v in opt.state[p].items() if k not in opt.STATE.shared_scalars}
                 for p in model[0].parameters()]
        opt.step()
        # (a buffer the phase holds in another form, 1-bit Adam's variance behind its bfloat16 1 / d, is
        # left out: test_released_variance.py checks that it stands for the same 1 / d)
        untouched.append(t == 1 or (
            all(torch.equal(a, b) for a, b in zip(before, model[0].parameters()))
            and all(torch.equal(opt.state[p][k], v) for p, s in zip(model[0].parameters(), state) for k, v in s.items()
                    if k in opt.state[p] or k not in released_buffers(opt, p))))
        identical.append(opt.replicas_identical)
    return {"untouched": untouched, "identical": identical, "params": clone_params(model.parameters()),
            "bias_moved": not torch.equal(model[2].bias, _model()[2].bias)}


def _forgotten_adapter(cls, rank: int, divergence: str) -> dict:
    records = LogMessages()
    logging.getLogger("onebit").addHandler(records)
    model = DDP(_model())
    opt = cls(model.parameters(), lr=1e-2, divergence=divergence, **SCHEDULES[cls])
    raised = None
    try:
        for t in range(1, 4):
            _backward(model, rank, t)
            opt.step()
    except FloatingPointError as exc:
        raised = (t, str(exc))
    finally:
        logging.getLogger("onebit").removeHandler(records)
    return {"warnings": records.messages, "raised": raised}


def _attached(cls, rank: int) -> dict:
    """With the adapter: no warning. Attached after a step: refused."""
    records = LogMessages()
    logging.getLogger("onebit").addHandler(records)
    model = DDP(_model())
    opt = cls(model.parameters(), lr=1e-2, **SCHEDULES[cls])
    attach_ddp(model, opt)
    for t in range(1, 4):
        _backward(model, rank, t)
        opt.step()
    logging.getLogger("onebit").removeHandler(records)
    late_model = DDP(_model())
    late = cls(late_model.parameters(), lr=1e-2, **SCHEDULES[cls])
    _backward(late_model, rank, 1)
    late.step()
    try:
        attach_ddp(late_model, late)
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    return {"warnings": records.messages, "refused": refused}


def _synchronize(cls, rank: int) -> dict:
    model = _model()
    opt = cls(model.parameters(), lr=1e-2, **SCHEDULES[cls])
    out = {}
    for t in range(1, STEPS + 1):
        _backward(model, rank, t)
        opt.step()
        if opt.plan_for(t).name == "local" and "after_local" not in out:
            out["identical_before"] = opt.replicas_identical
            opt.synchronize()
            out["after_local"] = clone_params(model.parameters())
            out["identical_after"] = opt.replicas_identical
    opt.synchronize()  # identical already: a check
    out["final"] = clone_params(model.parameters())
    if rank == 1:
        with torch.no_grad():
            model[0].bias.add_(1.0)
    try:
        opt.synchronize()
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    return out


def _session(rank: int, world_size: int) -> dict:
    results = {}
    for cls in SCHEDULES:
        results[cls.__name__] = {
            "none": _none_grads(cls, rank),
            "forgotten": _forgotten_adapter(cls, rank, "warn"),
            "forgotten_raise": _forgotten_adapter(cls, rank, "raise"),
            "attached": _attached(cls, rank),
            "synchronize": _synchronize(cls, rank),
        }
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_session, 2, tmp_path_factory.mktemp("contract"), timeout=240)


@pytest.mark.parametrize("name", [cls.__name__ for cls in SCHEDULES])
def test_no_gradient_on_any_rank_leaves_a_layer_alone_and_none_on_some_counts_as_zero(two_ranks, name):
    runs = [two_ranks[r][name]["none"] for r in range(2)]
    for run in runs:
        assert all(run["untouched"]), run["untouched"]
        assert run["bias_moved"]  # rank 1's None counted as zero there; rank 0's gradient moved it
    if runs[0]["identical"][-1]:  # (0/1 Adam's and DiLoCo's ranks differ after a local step, by design)
        assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))
    else:
        assert name in ("ZeroOneAdam", "OnebitDiLoCo")


@pytest.mark.parametrize("name", [cls.__name__ for cls in SCHEDULES])
def test_a_forgotten_adapter_is_said_or_raised_within_the_first_steps(two_ranks, name):
    warned = [w for w in two_ranks[0][name]["forgotten"]["warnings"] if "a framework averages them already" in w]
    assert len(warned) == 1 and "attach_ddp(ddp_model, optimizer)" in warned[0]
    assert two_ranks[1][name]["forgotten"]["warnings"] == []  # rank 0 speaks
    for rank in range(2):
        raised = two_ranks[rank][name]["forgotten_raise"]["raised"]
        assert raised is not None and raised[0] == 1 and "divergence='raise'" in raised[1]


@pytest.mark.parametrize("name", [cls.__name__ for cls in SCHEDULES])
def test_an_attached_adapter_is_quiet_and_a_late_one_is_refused(two_ranks, name):
    for rank in range(2):
        attached = two_ranks[rank][name]["attached"]
        assert not [w for w in attached["warnings"] if "averages them already" in w]
        assert attached["refused"] is not None and "after 1 step() call(s)" in attached["refused"]


@pytest.mark.parametrize("name", [cls.__name__ for cls in SCHEDULES])
def test_synchronize_aligns_the_ranks_and_checks_them(two_ranks, name):
    runs = [two_ranks[r][name]["synchronize"] for r in range(2)]
    if name == "ZeroOneAdam":
        assert runs[0]["identical_before"] is False and runs[0]["identical_after"] is True
        assert all(torch.equal(a, b) for a, b in zip(runs[0]["after_local"], runs[1]["after_local"]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["final"], runs[1]["final"]))
    for run in runs:
        assert run["mismatch"] is not None and "the parameters of ranks [1] differ from rank 0's" in run["mismatch"]
