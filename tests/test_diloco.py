"""OnebitDiLoCo (the local-step mode, issue 41) against its oracles.

Inner steps are torch's AdamW, bit for bit (one process). On 2 and 3 gloo ranks, each training on
its own data, every rank's parameters after every step equal a single-process simulation written
from the maths: per rank a torch AdamW, and every ``sync_every``-th step the pseudo-gradients
``global - params`` averaged by :func:`onebit.testing.simulate_compressed_allreduce` (one segment
per tensor, the errors carried from one outer step to the next) and a Nesterov step of torch's SGD
on the global parameters. The ranks agree bit for bit after every outer step and differ between.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle

import pytest
import torch

import onebit
from distributed import run_ranks
from onebit import OnebitDiLoCo, load_checkpoint, save_checkpoint
from onebit.compression import SegmentLayout
from onebit.testing import simulate_compressed_allreduce

H = 3
STEPS = 8
LR = 1e-2


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _backward(model: torch.nn.Module, rank: int, t: int) -> None:
    x, y = _batch(rank, t)
    torch.nn.functional.mse_loss(model(x), y).backward()


def test_inner_steps_are_torch_adamw():
    """Between outer steps: torch.optim.AdamW's numbers exactly, with a parameter that has no
    gradient on one step (left alone, its own step count behind, as in torch); a second group
    with another lr, no weight decay and no bias correction against the formula."""
    model, twin = _model(), _model()
    opt = OnebitDiLoCo([{"params": [model[0].weight, model[2].weight]},
                        {"params": [model[0].bias, model[2].bias], "lr": 3e-3, "weight_decay": 0.0,
                         "bias_correction": False}], lr=LR, sync_every=100, comm_backend_name="local")
    reference = torch.optim.AdamW([twin[0].weight, twin[2].weight], lr=LR)
    m = [torch.zeros_like(p) for p in (twin[0].bias, twin[2].bias)]
    v = [torch.zeros_like(p) for p in (twin[0].bias, twin[2].bias)]
    for t in range(1, 6):
        for net in (model, twin):
            net.zero_grad(set_to_none=True)
            _backward(net, 0, t)
            if t == 2:  # no gradient for one tensor of each group this step
                net[2].weight.grad = net[2].bias.grad = None
        opt.step()
        reference.step()
        with torch.no_grad():
            for p, mi, vi in zip((twin[0].bias, twin[2].bias), m, v):
                if p.grad is not None:
                    mi.lerp_(p.grad, 0.1)
                    vi.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                    p.addcdiv_(mi, vi.sqrt().add_(1e-8), value=-3e-3)
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b), (t, float((a - b).abs().max()))
    assert opt.comm_stats()["inner"]["steps"] == 5 and opt.comm_stats()["inner"]["bytes_sent"] == 0
    assert opt.state[model[2].weight]["inner_step"] == 4 and opt.state[model[0].weight]["inner_step"] == 5


def simulate(world_size: int, steps: int = STEPS, outer_lr: float = 0.7, momentum: float = 0.9,
             compression: str = "onebit", error_feedback: str = "buffer", outer_bits: int = 1,
             inner=lambda params: torch.optim.AdamW(params, lr=LR), error_dtype=None) -> list[list]:
    """Every rank's parameters after every step, from the maths (see the module docstring);
    ``error_feedback="model"``: the worker errors start every outer step at 0, and each rank
    continues from the global parameters minus its own (unpadded) worker error. ``outer_bits=2``:
    a second compressed all-reduce of the first's residuals (each rank's worker error as its
    input, the server errors as its server errors), added to the average; its errors carry on."""
    models = [_model() for _ in range(world_size)]
    inners = [inner(m.parameters()) for m in models]
    glob = _model()
    outer = torch.optim.SGD(glob.parameters(), lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    numels = [p.numel() for p in glob.parameters()]
    errors = (None, None)
    out = []
    for t in range(1, steps + 1):
        for rank, (m, inner) in enumerate(zip(models, inners)):
            m.zero_grad(set_to_none=True)
            _backward(m, rank, t)
            inner.step()
        if t % H == 0:
            deltas = [torch.cat([(g - p).detach().reshape(-1) for g, p in zip(glob.parameters(), m.parameters())])
                      for m in models]
            if compression == "none":
                average = torch.stack(deltas).sum(0) / world_size
            else:
                sim = simulate_compressed_allreduce(deltas, *errors, numels=numels, error_dtype=error_dtype)
                errors, average = (sim.worker_errors, sim.server_errors), sim.output
                if outer_bits == 2:  # the residuals, with the second pass's (carried) server errors
                    starts = SegmentLayout.build(numels, world_size).starts
                    residuals = [torch.cat([e[a:a + k] for a, k in zip(starts, numels)]) for e in sim.worker_errors]
                    again = simulate_compressed_allreduce(residuals, None, sim.server_errors, numels=numels,
                                                          error_dtype=error_dtype)
                    errors, average = (again.worker_errors, again.server_errors), average + again.output
            for g, piece in zip(glob.parameters(), average.split(numels)):
                g.grad = piece.view_as(g).clone()
            outer.step()
            residuals = [[torch.zeros_like(g) for g in glob.parameters()] for _ in models]
            if error_feedback == "model" and compression == "onebit":
                starts = SegmentLayout.build(numels, world_size).starts
                residuals = [[e[start:start + g.numel()].view_as(g) for start, g in zip(starts, glob.parameters())]
                             for e in errors[0]]
                errors = (None, errors[1])
            with torch.no_grad():
                for m, residual in zip(models, residuals):
                    for p, g, r in zip(m.parameters(), glob.parameters(), residual):
                        p.copy_(g - r)
        out.append([[p.detach().clone() for p in m.parameters()] for m in models])
    return out


def _train_rank(rank: int, world_size: int, compression: str = "onebit", error_feedback: str | None = None,
                outer_bits: int | None = None, error_dtype: torch.dtype | None = None) -> dict:
    model = _model()
    opt = OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, outer_lr=0.7, outer_momentum=0.9,
                       comm_backend_name="gloo", compression=compression, error_feedback=error_feedback,
                       outer_bits=outer_bits, error_dtype=error_dtype)
    trajectory, identical, sent = [], [], []
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, t)
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
        identical.append(opt.replicas_identical)
        sent.append(opt.comm_stats()["last_step"]["bytes_sent"])
    return {"trajectory": trajectory, "identical": identical, "sent": sent, "stats": opt.comm_stats(),
            "worker_error_norm": float(sum(w.norm() for w, _ in opt.compression_errors())),
            "global": [opt.state[p]["global_params"].clone() for p in model.parameters()]}


def _both_rank(rank: int, world_size: int) -> dict:
    # (one pass with the classic error feedback, the simulation's first scheme; then each option alone)
    return {"onebit": _train_rank(rank, world_size, "onebit", "buffer", 1), "none": _train_rank(rank, world_size, "none"),
            "model": _train_rank(rank, world_size, "onebit", "model", 1),
            "model_bf16": _train_rank(rank, world_size, "onebit", "model", 1, torch.bfloat16),
            "two_bf16": _train_rank(rank, world_size, "onebit", "buffer", 2, torch.bfloat16),
            "two": _train_rank(rank, world_size, "onebit", "buffer", 2)}


@pytest.fixture(scope="module", params=[2, 3], ids=["n2", "n3"])
def ranks(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """Every rank's runs with the 1-bit and the exact outer average (one spawn per world size)."""
    return request.param, run_ranks(_both_rank, request.param, tmp_path_factory.mktemp("diloco"))


@pytest.mark.slow
def test_every_rank_follows_the_simulation(ranks):
    world_size, both = ranks
    results = [r["onebit"] for r in both]
    expected = simulate(world_size)
    for rank, result in enumerate(results):
        for t, (mine, theirs) in enumerate(zip(result["trajectory"], expected), start=1):
            for a, b in zip(mine, theirs[rank]):
                # float32 rounding only (torch's AdamW and SGD against the engine's fused passes)
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank} step {t}")
    for t in range(1, STEPS + 1):
        same = all(all(torch.equal(a, b) for a, b in zip(r["trajectory"][t - 1], results[0]["trajectory"][t - 1]))
                   for r in results)
        assert same == (t % H == 0), t  # bit-identical after every outer step, apart between
        # (the inner moments stay each rank's own even after an outer step: a checkpoint needs every rank's)
        assert results[0]["identical"][t - 1] is False
    sent = results[0]["sent"]
    # Inner steps send nothing, but for the first two: the layout check's 8-byte all-gather (step 1)
    # and the 32-byte digest that looks for a framework averaging the gradients (steps 1 and 2).
    assert 0 < sent[0] < 100 and 0 < sent[1] < 100, sent
    assert all((s > 0) == (t % H == 0) for t, s in enumerate(sent[2:], start=3)), sent
    numel = sum(p.numel() for p in _model().parameters())
    # A 1-bit all-reduce: about 2 (n - 1) / n bits per element (padding and scales on top).
    assert max(sent) < numel * 2 * (world_size - 1) / world_size / 8 + 200
    assert results[0]["stats"]["outer"]["steps"] == STEPS // H


@pytest.mark.slow
def test_error_feedback_in_the_model_follows_the_simulation(ranks):
    """error_feedback='model': the same 1-bit outer steps, but the residual stays in each rank's
    parameters (global parameters minus its worker error); the global parameters stay
    bit-identical on every rank, the parameters differ by the residuals, and the worker errors are
    0 between outer steps."""
    world_size, both = ranks
    expected = simulate(world_size, error_feedback="model")
    for rank, r in enumerate(both):
        for t, (mine, theirs) in enumerate(zip(r["model"]["trajectory"], expected), start=1):
            for a, b in zip(mine, theirs[rank]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank} step {t}")
        assert r["model"]["worker_error_norm"] == 0.0
        assert all(torch.equal(a, b) for a, b in zip(r["model"]["global"], both[0]["model"]["global"]))
    # not the buffer's trajectory: the residual moved the parameters after the first outer step
    assert not all(torch.equal(a, b) for a, b in zip(both[0]["model"]["trajectory"][H], both[0]["onebit"]["trajectory"][H]))
    assert both[0]["model"]["stats"]["outer"]["bytes_sent"] == both[0]["onebit"]["stats"]["outer"]["bytes_sent"]


@pytest.mark.slow
def test_bfloat16_errors_follow_the_simulation(ranks):
    """error_dtype=torch.bfloat16 with error_feedback='model': the residual each rank keeps in its
    parameters is its worker error rounded once to bfloat16, as is the server error it carries;
    with outer_bits=2 the second pass compresses the first's bfloat16 errors."""
    world_size, both = ranks
    for run, options in (("model_bf16", dict(error_feedback="model")), ("two_bf16", dict(outer_bits=2))):
        expected = simulate(world_size, error_dtype=torch.bfloat16, **options)
        for rank, r in enumerate(both):
            for t, (mine, theirs) in enumerate(zip(r[run]["trajectory"], expected), start=1):
                for a, b in zip(mine, theirs[rank]):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{run} rank {rank} step {t}")
    # not float32's residuals (so the comparison can fail)
    last = both[0]["model_bf16"]["trajectory"][-1]
    assert max(float((a - b).abs().max()) for a, b in zip(last, both[0]["model"]["trajectory"][-1])) > 1e-5


@pytest.mark.slow
def test_two_outer_bits_follow_the_simulation(ranks):
    """outer_bits=2: a second 1-bit all-reduce of each rank's residual, with errors of its own,
    added to the first's average; twice the bytes; closer to the exact mean than one pass."""
    world_size, both = ranks
    expected = simulate(world_size, outer_bits=2)
    for rank, r in enumerate(both):
        for t, (mine, theirs) in enumerate(zip(r["two"]["trajectory"], expected), start=1):
            for a, b in zip(mine, theirs[rank]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank} step {t}")
    one, two = both[0]["onebit"]["stats"]["outer"]["bytes_sent"], both[0]["two"]["stats"]["outer"]["bytes_sent"]
    assert 1.7 * one < two < 2 * one  # (twice the codec's bytes; the step's small flag once)


def test_a_second_pass_leaves_less_error_in_the_average():
    """The scheme outer_bits=2 runs (the test above: bit for bit against this simulation), on
    Gaussian pseudo-gradients of 4096 elements on 2, 3 and 4 workers, at a first outer step:
    the second pass's residual average leaves at most 0.8x the error of one pass (measured
    0.67, 0.74, 0.72); the rest waits in the errors for the next outer step."""
    for n in (2, 3, 4):
        g = torch.Generator().manual_seed(n)
        deltas = [torch.randn(4096, generator=g) * (1 + torch.rand(4096, generator=g)) for _ in range(n)]
        exact = torch.stack(deltas).mean(0)
        one = simulate_compressed_allreduce(deltas)
        residuals = [e[:4096] for e in one.worker_errors]
        two = one.output + simulate_compressed_allreduce(residuals, None, one.server_errors).output
        assert (two - exact).norm() < 0.8 * (one.output - exact).norm(), n


@pytest.mark.slow
def test_compression_none_averages_exactly(ranks):
    """compression='none': the same steps with the exact float32 mean of the pseudo-gradients."""
    world_size, both = ranks
    expected = simulate(world_size, compression="none")
    for rank, r in enumerate(both):
        for t, (mine, theirs) in enumerate(zip(r["none"]["trajectory"], expected), start=1):
            for a, b in zip(mine, theirs[rank]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank} step {t}")
    # A float32 all-reduce of the padded buffer per outer step (and the small finiteness flag).
    exact = both[0]["none"]["stats"]["outer"]["bytes_sent"]
    numel_padded = sum(-(-p.numel() // (8 * world_size)) * 8 * world_size for p in _model().parameters())
    float32 = 2 * (world_size - 1) / world_size * 4 * numel_padded * (STEPS // H)
    assert float32 <= exact <= float32 + 64 * (STEPS // H)


def test_defaults_are_the_plain_average_every_32_steps():
    """The defaults (chosen on the BERT example, docs/guides/tuning.md): H 32, the plain average,
    two 1-bit passes with the residual in the model, 4 fragments and a delay of 2; with the exact
    mean, one float32 pass."""
    opt = OnebitDiLoCo(_model().parameters(), comm_backend_name="local")
    assert (opt.sync_every, opt.outer_lr, opt.outer_momentum, opt.compression) == (32, 1.0, 0.0, "onebit")
    assert (opt.outer_bits, opt.error_feedback) == (2, "model")
    # 4 fragments where the buckets allow (here the model's 4 tensors), each exchange landing 2 steps late
    assert (opt.fragments, opt.sync_delay, opt.sync_mix, opt.num_buckets) == (4, 2, 1.0, 4)
    assert [t for t in range(1, 33) if opt.plan_for(t).name == "outer"] == [8, 16, 24, 32]
    # below sync_every 16, the blocking outer step of all the parameters; a model of fewer buckets: fewer
    assert (OnebitDiLoCo(_model().parameters(), sync_every=8, comm_backend_name="local").fragments, 0) == (1, 0)
    small = OnebitDiLoCo(list(_model().parameters())[:2], comm_backend_name="local")
    assert (small.fragments, small.sync_delay) == (small.num_buckets, 2) and small.num_buckets < 4
    assert opt.param_groups[0]["bias_correction"] is True and opt.param_groups[0]["weight_decay"] == 1e-2
    exact = OnebitDiLoCo(_model().parameters(), compression="none", comm_backend_name="local")
    assert (exact.outer_bits, exact.error_feedback) == (1, "buffer")


def test_simulation_can_fail():
    """The oracle tells the outer rule apart: plain averaging (lr 1, no momentum) and DiLoCo's
    published outer step move the parameters by far more than the tolerance of the comparison."""
    a, b = simulate(2, steps=H), simulate(2, steps=H, outer_lr=1.0, momentum=0.0)
    assert max(float((x - y).abs().max()) for x, y in zip(a[-1][0], b[-1][0])) > 1e-3


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(sync_every=0), ValueError, r"sync_every must be an int >= 1 .*got 0"),
    (dict(sync_every=2.0), ValueError, r"sync_every must be an int >= 1 .*got 2.0"),
    (dict(outer_lr=0.0), ValueError, r"outer_lr must be > 0, got 0.0"),
    (dict(outer_lr=-1), ValueError, r"invalid outer_lr: -1"),
    (dict(outer_momentum=1.0), ValueError, r"invalid outer_momentum: 1.0; it must be finite and in \[0.0, 1.0\)"),
    (dict(outer_momentum=-0.1), ValueError, r"invalid outer_momentum"),
    (dict(overlap_backward=True), ValueError, r"overlap_backward=True\) is not supported"),
    (dict(hierarchy=2), ValueError, r"hierarchy=2\) is not supported"),
    (dict(error_feedback="params"), ValueError, r"invalid error_feedback: 'params'; expected one of 'buffer', 'model'"),
    (dict(outer_bits=0), ValueError, r"outer_bits must be an int from 1 to 8 .*got 0"),
    (dict(outer_bits=1.5), ValueError, r"outer_bits must be an int from 1 to 8 .*got 1.5"),
    (dict(compression="none", outer_bits=2), ValueError, r"averages exactly: it has no residual.*leave them"),
    (dict(compression="none", error_feedback="model"), ValueError, r"averages exactly: it has no residual"),
    (dict(outer_state="cpu"), ValueError, r"invalid outer_state: 'cpu'; expected one of 'device', 'host'"),
    (dict(freeze_step=10), TypeError, r"does not take freeze_step=10: OnebitDiLoCo has no full-precision warmup"),
])
def test_bad_input_is_refused(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        OnebitDiLoCo(_model().parameters(), comm_backend_name="local", **kwargs)


def _outer_state_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    runs = {}
    for feedback in ("model", "buffer"):
        for outer_state in ("device", "host"):
            model = _model()
            opt = OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, outer_lr=0.7, outer_momentum=0.9,
                               error_feedback=feedback, outer_state=outer_state, comm_backend_name="gloo")
            for t in range(1, STEPS + 1):
                opt.zero_grad(set_to_none=True)
                _backward(model, rank, t)
                opt.step()
            runs[feedback, outer_state] = ([p.detach().clone() for p in model.parameters()],
                                           {k: v.clone() for k, v in opt.state_dict()["state"][0].items()
                                            if isinstance(v, torch.Tensor)})
    mesh = init_device_mesh("cpu", (world_size,))
    shard = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 8), mesh, [Replicate()]))
    try:
        OnebitDiLoCo([shard], outer_state="host", comm_backend_name="gloo")
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"runs": runs, "refused": refused}


def test_outer_state_on_the_host_takes_the_same_steps(tmp_path):
    """outer_state='host' computes the pseudo-gradient and the parameters from the global ones
    by copies and one subtraction on the device: on the CPU the same bits as 'device', with
    outer momentum and either error feedback, over 2 gloo ranks and several outer steps (on a GPU
    tests/test_cuda.py checks the copies across devices and the memory). Sharded (DTensor)
    parameters are refused with the fix."""
    for result in run_ranks(_outer_state_rank, 2, tmp_path):
        for feedback in ("model", "buffer"):
            (params_d, state_d), (params_h, state_h) = result["runs"][feedback, "device"], result["runs"][feedback, "host"]
            assert all(torch.equal(a, b) for a, b in zip(params_d, params_h)), feedback
            assert state_d.keys() == state_h.keys() and "outer_momentum_buffer" in state_h
            assert all(torch.equal(state_d[k], state_h[k]) for k in state_d), feedback
        assert "outer_state='host') does not take sharded (DTensor) parameters" in result["refused"]
        assert "pass outer_state='device'" in result["refused"]


def _sgd(params, **kwargs):
    return torch.optim.SGD(params, **{"lr": LR, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2, **kwargs})


def _inner_rank(rank: int, world_size: int) -> dict:
    out = {}
    for feedback in ("buffer", "model"):
        model = _model()
        opt = OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, outer_lr=0.7, outer_momentum=0.9,
                           error_feedback=feedback, outer_bits=1, comm_backend_name="gloo",
                           inner=functools.partial(torch.optim.SGD, momentum=0.9, nesterov=True))
        trajectory = []
        for t in range(1, STEPS + 1):
            opt.zero_grad(set_to_none=True)
            _backward(model, rank, t)
            opt.step()
            trajectory.append([p.detach().clone() for p in model.parameters()])
        momenta = [opt.inner_optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        opt.synchronize()
        synced = ([p.detach().clone() for p in model.parameters()],
                  [opt.inner_optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()])
        out[feedback] = {"trajectory": trajectory, "momenta": momenta, "synced": synced,
                         "keys": sorted(opt.state_dict()["state"][0])}
    return out


@pytest.mark.slow
def test_an_inner_torch_sgd_follows_the_simulation(tmp_path):
    """inner=functools.partial(torch.optim.SGD, momentum=0.9, nesterov=True): the inner steps are
    that SGD's (lr and weight decay from OnebitDiLoCo's groups), the outer steps the same 1-bit
    average and Nesterov step as with the built-in AdamW, on 2 gloo ranks against the simulation
    with per-rank SGDs; synchronize() averages the parameters and the SGD momenta."""
    results = run_ranks(_inner_rank, 2, tmp_path)
    for feedback in ("buffer", "model"):
        expected = simulate(2, error_feedback=feedback, inner=_sgd)
        for rank, result in enumerate(results):
            for t, (mine, theirs) in enumerate(zip(result[feedback]["trajectory"], expected), start=1):
                for a, b in zip(mine, theirs[rank]):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{feedback} rank {rank} step {t}")
        first, second = results[0][feedback], results[1][feedback]
        assert not all(torch.equal(a, b) for a, b in zip(first["momenta"], second["momenta"]))
        for a, b, m0, m1 in zip(first["synced"][1], second["synced"][1], first["momenta"], second["momenta"]):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, (m0 + m1) / 2, rtol=0, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(first["synced"][0], second["synced"][0]))
        assert first["keys"] == ["global_params", "inner:momentum_buffer", "outer_momentum_buffer"]


def _run_local(steps: int = STEPS, reload_at: int | None = None, scaler: bool = False, **kwargs) -> tuple[list, OnebitDiLoCo]:
    """One process (the local transport runs the whole 1-bit all-reduce), outer steps every H;
    ``reload_at``: a state dict and the compression errors restored into a fresh optimizer there."""
    def build(model):
        groups = [{"params": [model[0].weight, model[2].weight]},
                  {"params": [model[0].bias, model[2].bias], "lr": 3e-3, "weight_decay": 0.0}]
        return OnebitDiLoCo(groups, lr=LR, sync_every=H, outer_lr=0.7, outer_momentum=0.9, comm_backend_name="local",
                            **kwargs)

    model = _model()
    opt = build(model)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) if scaler else None
    for t in range(1, steps + 1):
        if t == reload_at:
            state, errors = opt.state_dict(), [(w.clone(), s.clone()) for w, s in opt.compression_errors()]
            values = [p.detach().clone() for p in model.parameters()]
            model = _model(seed=5)
            opt = build(model)
            with torch.no_grad():
                for p, q in zip(model.parameters(), values):
                    p.copy_(q)
            opt.restore(state, errors)
        opt.zero_grad(set_to_none=True)
        x, y = _batch(0, t)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if grad_scaler is None:
            loss.backward()
            opt.step()
        else:
            grad_scaler.scale(loss).backward()
            grad_scaler.step(opt)
            grad_scaler.update()
    return [p.detach().clone() for p in model.parameters()], opt


def test_an_inner_torch_adamw_is_the_built_in_one_bit_for_bit():
    """inner=torch.optim.AdamW gives the built-in fused AdamW's numbers exactly (two groups, 1-bit
    outer steps with Nesterov momentum), keeps its state in its own optimizer (saved as "inner:"
    entries), and shares OnebitDiLoCo's param groups: a scheduler reaches it."""
    built_in, _ = _run_local()
    torch_adamw, opt = _run_local(inner=torch.optim.AdamW)
    assert all(torch.equal(a, b) for a, b in zip(built_in, torch_adamw))
    assert opt.inner_optimizer.param_groups[1] is opt.param_groups[1]
    entry = opt.state_dict()["state"][0]
    assert {"inner:exp_avg", "inner:exp_avg_sq", "inner:step", "global_params"} <= set(entry)
    assert "exp_avg" not in entry and "exp_avg" not in opt.state[opt.param_groups[0]["params"][0]]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5)
    assert opt.inner_optimizer.param_groups[1]["lr"] == 3e-3 * 0.5
    del scheduler


@pytest.mark.parametrize("inner", [torch.optim.AdamW, functools.partial(torch.optim.SGD, momentum=0.9)],
                         ids=["AdamW", "SGD"])
def test_an_inner_optimizers_state_resumes_and_copies_exactly(inner):
    """A state dict restored mid-round into a fresh optimizer continues bit for bit (the inner
    optimizer's state included); copy.deepcopy and pickle carry it; GradScaler's unscaled
    gradients reach the inner optimizer (a power-of-two scale: the unscaled run's numbers)."""
    straight, opt = _run_local(inner=inner)
    resumed, _ = _run_local(reload_at=5, inner=inner)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        for p, q in zip(opt.param_groups[0]["params"], twin.param_groups[0]["params"]):
            for name, value in opt.inner_optimizer.state[p].items():
                assert torch.equal(twin.inner_optimizer.state[q][name], value), name
    scaled, _ = _run_local(inner=inner, scaler=True)
    assert all(torch.equal(a, b) for a, b in zip(straight, scaled))


def _awkward(inner, steps: int = 10) -> list[torch.Tensor]:
    """zero_grad(set_to_none=False), a layer frozen for steps 3 to 5 (keeping its stale gradient),
    the second group's lr 0 at the outer step 6: what the engine leaves alone, the inner optimizer
    must leave alone too (parameters and state)."""
    model = _model()
    groups = [{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias, model[2].bias]}]
    opt = OnebitDiLoCo(groups, lr=LR, sync_every=H, outer_momentum=0.9, outer_lr=0.7, comm_backend_name="local",
                       inner=inner)
    for t in range(1, steps + 1):
        model[0].weight.requires_grad_(not 3 <= t <= 5)
        opt.param_groups[1]["lr"] = 0.0 if t == 6 else LR
        opt.zero_grad(set_to_none=False)
        _backward(model, 0, t)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_an_inner_optimizer_steps_only_what_the_engine_steps():
    assert all(torch.equal(a, b) for a, b in zip(_awkward(None), _awkward(torch.optim.AdamW)))


def test_a_stateless_inner_optimizer_saves_loads_and_copies():
    """torch.optim.SGD without momentum keeps no state: its state dict loads, and copies work."""
    straight, opt = _run_local(inner=torch.optim.SGD)
    resumed, _ = _run_local(reload_at=5, inner=torch.optim.SGD)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    assert len(copy.deepcopy(opt).inner_optimizer.state) == 0
    assert opt.state_dict()["param_groups"][0]["inner_states"] == 0


def test_a_refused_param_group_changes_nothing():
    model = _model()
    opt = OnebitDiLoCo([model[0].weight, model[0].bias], comm_backend_name="local", inner=torch.optim.SGD)
    with pytest.raises(ValueError, match="betas=.* would be ignored"):
        opt.add_param_group({"params": [model[2].weight, model[2].bias], "betas": (0.8, 0.9)})
    assert len(opt.param_groups) == len(opt.inner_optimizer.param_groups) == 1
    assert model[2].weight not in opt.state


def test_inner_through_from_config():
    cfg = {"optimizer": {"type": "OneBitDiLoCo", "params": {"lr": 1e-3, "comm_backend_name": "local"}}}
    assert isinstance(onebit.from_config(_model().parameters(), cfg, inner=torch.optim.SGD).inner_optimizer,
                      torch.optim.SGD)
    cfg["optimizer"]["params"]["inner"] = "AdamW"
    with pytest.raises(ValueError, match=r"optimizer.params.inner cannot be written in a file.*from_config\("):
        onebit.from_config(_model().parameters(), cfg)
    adam = {"optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "local"}}}
    with pytest.raises(ValueError, match=r"applies to OneBitDiLoCo configs"):
        onebit.from_config(_model().parameters(), adam, inner=torch.optim.SGD)


def test_a_state_of_another_inner_is_refused():
    """The built-in AdamW's state and an inner optimizer's do not load into each other; a state
    after some steps that lacks the inner optimizer's entries (what a DCP load of a fresh
    optimizer's template would give) is refused rather than the inner state silently restarted."""
    _, built_in = _run_local(steps=4)
    _, sgd = _run_local(steps=4, inner=functools.partial(torch.optim.SGD, momentum=0.9))
    with pytest.raises(ValueError, match=r"saved by OnebitDiLoCo without inner= \(its built-in AdamW\)"):
        _run_local(steps=1, inner=torch.optim.AdamW)[1].load_state_dict(built_in.state_dict())
    with pytest.raises(ValueError, match=r"saved by OnebitDiLoCo\(inner=SGD\); build this OnebitDiLoCo with the same"):
        _run_local(steps=1)[1].load_state_dict(sgd.state_dict())
    with pytest.raises(ValueError, match=r"saved with inner=SGD, this OnebitDiLoCo's inner optimizer is a AdamW"):
        _run_local(steps=1, inner=torch.optim.AdamW)[1].load_state_dict(sgd.state_dict())
    torch_adamw = torch.optim.AdamW(_model().parameters()).state_dict()
    with pytest.raises(ValueError, match=r"this is a torch.optim state dict"):
        _run_local(steps=1, inner=torch.optim.AdamW)[1].load_state_dict(torch_adamw)
    stripped = sgd.state_dict()
    stripped["state"] = {k: {n: v for n, v in e.items() if not n.startswith("inner:")} for k, e in stripped["state"].items()}
    with pytest.raises(ValueError, match=r"parameters with inner optimizer state when saved.*onebit.save_checkpoint"):
        _run_local(steps=1, inner=torch.optim.SGD)[1].load_state_dict(stripped)


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(inner=onebit.OnebitAdam), ValueError, r"inner=OnebitAdam\): a onebit optimizer communicates"),
    (dict(inner="sgd"), TypeError, r"takes a torch.optim.Optimizer class or a callable .* got str"),
    (dict(inner=lambda groups: object()), TypeError, r"returned a object, not a torch.optim.Optimizer"),
    (dict(inner=lambda groups: torch.optim.SGD(_model().parameters())), ValueError, r"holds other param groups"),
    (dict(inner=torch.optim.SGD, betas=(0.8, 0.9)), ValueError, r"betas=\(0.8, 0.9\) would be ignored: SGD has no betas"),
    (dict(inner=torch.optim.SGD, eps=1e-6), ValueError, r"eps=1e-06 would be ignored"),
    (dict(inner=torch.optim.AdamW, bias_correction=False), ValueError, r"bias_correction=False is an option of the built-in"),
    (dict(inner=functools.partial(torch.optim.SGD, lr=0.1)), ValueError,
     r"lr=0.1 given to the SGD would be ignored.*Pass lr=0.1 to OnebitDiLoCo"),
    (dict(inner=functools.partial(torch.optim.AdamW, betas=(0.8, 0.9))), ValueError, r"betas=\(0.8, 0.9\) given to the AdamW"),
    (dict(inner=functools.partial(torch.optim.SGD, weight_decay=0.0)), ValueError,
     r"weight_decay=0.0 given to the SGD would be ignored"),
])
def test_bad_inner_is_refused(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        OnebitDiLoCo(_model().parameters(), comm_backend_name="local", **kwargs)


def test_inner_refuses_momentum_masks():
    model = _model()
    with pytest.raises(ValueError, match=r"inner=...\) takes no momentum_masks"):
        OnebitDiLoCo(model.parameters(), comm_backend_name="local", inner=torch.optim.SGD,
                     momentum_masks={model[0].weight: torch.ones_like(model[0].weight)})


def test_state_dict_round_trip_continues_bit_for_bit():
    """A save and load mid-round (one process, the compression errors restored as an exact resume
    does) continues exactly as the run without it; the schedule (sync_every, outer lr and
    momentum) travels with the state."""
    def run(reload_at: int | None) -> list[torch.Tensor]:
        model = _model()
        opt = OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, outer_lr=0.7, outer_momentum=0.9,
                           comm_backend_name="local")
        for t in range(1, STEPS + 1):
            if t == reload_at:
                state, errors = opt.state_dict(), [(w.clone(), s.clone()) for w, s in opt.compression_errors()]
                values = [p.detach().clone() for p in model.parameters()]
                model = _model(seed=5)
                opt = OnebitDiLoCo(model.parameters(), sync_every=7, outer_lr=0.3, outer_momentum=0.5,
                                   comm_backend_name="local")
                with torch.no_grad():
                    for p, q in zip(model.parameters(), values):
                        p.copy_(q)
                opt.restore(state, errors)
                assert (opt.sync_every, opt.outer_lr, opt.outer_momentum) == (H, 0.7, 0.9)
            opt.zero_grad(set_to_none=True)
            _backward(model, 0, t)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    straight = run(None)
    resumed = run(5)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_built_from_a_config():
    assert onebit.OnebitOptimizer.registered()["OneBitDiLoCo"] is OnebitDiLoCo
    opt = onebit.from_config(_model().parameters(), {"optimizer": {"type": "OneBitDiLoCo", "params": {
        "lr": 2e-3, "sync_every": 8, "outer_lr": 1.0, "outer_momentum": 0.0, "comm_backend_name": "local"}}})
    assert isinstance(opt, OnebitDiLoCo)
    assert (opt.sync_every, opt.outer_lr, opt.outer_momentum, opt.param_groups[0]["lr"]) == (8, 1.0, 0.0, 2e-3)


def _resumed_at(rank: int, directory: str, at: int | None, **settings) -> list[list[torch.Tensor]]:
    """The plain run, saved with onebit.save_checkpoint(exact_resume=True) after step ``at`` and
    continued by a new model and optimizer (another seed, other settings) loaded from it (the
    schedule and ``settings`` travel with the state); ``at=None``: straight through."""
    model = _model()
    opt = OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, outer_momentum=0.9, comm_backend_name="gloo",
                       **settings)
    trajectory = []
    for t in range(1, STEPS + 1):
        if at is not None and t == at + 1:
            path = os.path.join(directory, f"at{at}.pt")
            save_checkpoint(path, opt, model=model, exact_resume=True)
            model = _model(seed=5)
            opt = OnebitDiLoCo(model.parameters(), sync_every=7, comm_backend_name="gloo")
            load_checkpoint(path, opt, model=model, exact_resume=True)
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, t)
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


def _under_ddp(rank: int, world_size: int, directory: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit.integrations import attach_ddp

    out = {"resumed": {at: _resumed_at(rank, directory, at) for at in (H, H + 1)}}
    two = dict(outer_bits=2, error_feedback="model")
    out["two"] = {"straight": _resumed_at(rank, directory, None, **two), "resumed": _resumed_at(rank, directory, H, **two)}
    for mode in ("plain", "ddp"):
        model = _model()
        opt = OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, outer_momentum=0.9, comm_backend_name="gloo")
        net = model
        if mode == "ddp":
            net = DDP(model)
            attach_ddp(net, opt)
        trajectory, synced = [], []
        for t in range(1, STEPS + 1):
            opt.zero_grad(set_to_none=True)
            x, y = _batch(rank, t)
            torch.nn.functional.mse_loss(net(x), y).backward()
            synced.append(getattr(net, "require_forward_param_sync", None))  # whether DDP synchronized it
            opt.step()
            trajectory.append([p.detach().clone() for p in model.parameters()])
        out[mode] = {"trajectory": trajectory, "synced": synced, "stats": opt.comm_stats()}
    return out


@pytest.mark.slow
def test_ddp_never_averages_gradients_and_changes_nothing(tmp_path):
    """Under DDP with attach_ddp every rank trains alone between outer steps: DDP's gradient
    synchronisation is off on every step, and the run equals the plain loop's bit for bit. (In the
    same launch: exact resumes through onebit.save_checkpoint, saved after an outer step and after
    an inner step.)"""
    results = run_ranks(_under_ddp, 2, tmp_path, str(tmp_path))
    for r in results:
        # onebit.save_checkpoint's exact resume, saved right after an outer step or after an inner
        # step, continues bit for bit (the ranks' inner moments differ even after an outer step)
        for at, trajectory in r["resumed"].items():
            for t, (mine, plain) in enumerate(zip(trajectory, r["plain"]["trajectory"]), start=1):
                assert all(torch.equal(a, b) for a, b in zip(mine, plain)), (at, t)
        # outer_bits=2 and error_feedback="model" travel with the state (the loader was built with the defaults)
        for t, (mine, straight) in enumerate(zip(r["two"]["resumed"], r["two"]["straight"]), start=1):
            assert all(torch.equal(a, b) for a, b in zip(mine, straight)), t
        assert r["ddp"]["synced"] == [False] * STEPS
        for mine, plain in zip(r["ddp"]["trajectory"], r["plain"]["trajectory"]):
            assert all(torch.equal(a, b) for a, b in zip(mine, plain))
        assert r["ddp"]["stats"]["outer"]["bytes_sent"] == r["plain"]["stats"]["outer"]["bytes_sent"]


@pytest.mark.slow
def test_local_steps_benchmark_on_loopback(tmp_path):
    """benchmarks/local_steps.py's smoke test (loopback, one round): it times DDP + Adam and both
    kinds of OnebitDiLoCo step, and only the outer step sends."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "local_steps.py"
    subprocess.run([sys.executable, str(script), "--loopback", "--rounds", "1", "--models", "8x1024",
                    "--out-dir", str(tmp_path)], check=True, timeout=600, capture_output=True)
    result = json.loads((tmp_path / "local_steps.json").read_text())
    (run,) = result["runs"]
    assert set(run["medians"]) == {"adam", "inner", "outer"} and all(v > 0 for v in run["medians"].values())
    assert run["bytes_sent"]["inner"] == 0 and run["bytes_sent"]["outer"] > 0
    assert [r["sync_every"] for r in run["rows"]] == [4, 8, 16, 32, 64, 128]
    assert all(0 < r["utilisation"] <= 1.5 for r in run["rows"])
    assert "| sync_every | average step | utilisation | vs DDP + Adam |" in (tmp_path / "local_steps.md").read_text()
