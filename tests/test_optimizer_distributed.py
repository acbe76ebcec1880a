"""OnebitAdam on real gloo ranks against a single-process simulation of the whole algorithm."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import onebit
from conftest import tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam
from onebit.backends.torch_dist import TorchDistBackend
from onebit.compression import padded_length
from onebit.kernels import REFERENCE, registry
from onebit.testing import simulate_compressed_allreduce

LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8


def _model() -> torch.nn.Module:
    return tiny_mlp(6, 8, 3)


def _mask(model) -> torch.Tensor:
    mask = torch.ones_like(model[0].weight)
    mask[5:] = 0  # rows 5..7 of the first layer: momentum must stay exactly 0
    return mask


def _grads(model, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _tensors_in(params, begin: int, end: int) -> list[int]:
    """The sizes of the parameter tensors that make up ``[begin, end)`` of the flat vector."""
    sizes, offset = [], 0
    for p in params:
        if begin <= offset < end:
            sizes.append(p.numel())
        offset += p.numel()
    if sum(sizes) != end - begin:
        raise ValueError(f"[{begin}, {end}) does not cut at tensor boundaries")
    return sizes


def simulate(world_size, steps, freeze_step, start=None, buckets=None, scale_block_size=None, error_dtype=None):
    """The whole optimizer for ``world_size`` simulated ranks, from the maths. ``buckets``: the
    ``(begin, end)`` ranges of the flat parameter vector compressed separately (default: one);
    inside each, every tensor (or block of ``scale_block_size``) has its own scales;
    ``error_dtype``: the type the compression errors are held in."""
    model = _model()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    buckets = buckets or [(0, numel)]
    mask = torch.cat([_mask(model).reshape(-1), torch.ones(numel - _mask(model).numel())])
    m, v, first = torch.zeros(numel), torch.zeros(numel), 0
    if start is not None:
        with torch.no_grad():
            for p, saved in zip(params, start["params"]):
                p.copy_(saved)
        m = _flat(start["state"][i]["exp_avg"] for i in range(len(params)))
        v = _flat(start["state"][i]["exp_avg_sq"] for i in range(len(params)))
        first = start["step"]
    errors = [(None, None)] * len(buckets)
    snapshots = []
    b1, b2 = BETAS
    for t in range(first + 1, first + steps + 1):
        grads = []
        for rank in range(world_size):
            _grads(model, rank, t)
            grads.append(_flat(p.grad for p in params))
        if t <= freeze_step:
            g = torch.stack(grads).sum(0) / world_size
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
        else:
            local = [b1 * m + (1 - b1) * g for g in grads]
            pieces = []
            for k, (begin, end) in enumerate(buckets):
                sim = simulate_compressed_allreduce([x[begin:end] for x in local], *errors[k],
                                                    numels=_tensors_in(params, begin, end),
                                                    scale_block_size=scale_block_size, error_dtype=error_dtype)
                errors[k] = (sim.worker_errors, sim.server_errors)
                pieces.append(sim.output)
            m = torch.cat(pieces)
        m = m * mask
        with torch.no_grad():
            p_flat = _flat(params)
            p_flat = p_flat - LR * (m / (v.sqrt() + EPS) + WD * p_flat)
            offset = 0
            for p in params:
                p.copy_(p_flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        snapshots.append([p.detach().clone() for p in params])
    return snapshots


def _train_rank(rank, world_size, steps, freeze_step, checkpoint_in=None, checkpoint_out=None,
                bucket_size=2**24, scale_block_size=None, error_dtype=None, kernels=None, round_errors=False):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=LR, freeze_step=freeze_step, betas=BETAS, eps=EPS, weight_decay=WD,
                     comm_backend_name="gloo", momentum_masks={model[0].weight: _mask(model)},
                     bucket_size=bucket_size, scale_block_size=scale_block_size, error_dtype=error_dtype,
                     kernels=kernels, compression_space="momentum")  # (what simulate() follows: DeepSpeed's numerics)
    first = 0
    if checkpoint_in is not None:
        saved = torch.load(checkpoint_in)
        with torch.no_grad():
            for p, value in zip(model.parameters(), saved["params"]):
                p.copy_(value)
        opt.load_state_dict(saved["optimizer"])
        first = opt.step_count
    snapshots, masked_zero = [], []
    for t in range(first + 1, first + steps + 1):
        _grads(model, rank, t)
        opt.step()
        if round_errors:  # each new error rounded once to bfloat16 (held in float32)
            for errors in opt.compression_errors():
                for error in errors:
                    error.copy_(error.bfloat16())
        snapshots.append([p.detach().clone() for p in model.parameters()])
        masked_zero.append(bool(torch.all(opt.state[model[0].weight]["exp_avg"][5:] == 0)))
    if checkpoint_out is not None and rank == 0:
        sd = opt.state_dict()
        torch.save({"params": snapshots[-1], "optimizer": sd, "step": sd["param_groups"][0]["onebit"]["step"],
                    "state": sd["state"]}, checkpoint_out)
    return {"snapshots": snapshots, "masked_zero": masked_zero, "phase": opt.phase, "stats": opt.comm_stats(),
            "buckets": [b.numel for b in opt._buckets],
            "errors": [(w.clone(), s.clone()) for w, s in opt.compression_errors()]}


@pytest.mark.slow
@pytest.mark.parametrize("world_size,bucket_size,scale_block_size",
                         [(2, 2**24, None), (3, 2**24, None), (2, 30, None), (3, 2**24, 24), (2, 2**24, 16)])
def test_trajectory_matches_simulation_in_both_phases(tmp_path, world_size, bucket_size, scale_block_size):
    """One bucket of 4 tensors (48, 8, 24, 3 elements), each with its own scales; bucket_size 30
    makes 3 buckets (48 | 8 | 24 + 3), pipelined in compression; scale_block_size 24 cuts the
    first tensor into two blocks with their own scales."""
    steps, freeze_step = 8, 3
    results = run_ranks(_train_rank, world_size, tmp_path, steps, freeze_step, None, None, bucket_size,
                        scale_block_size)
    offsets = [0, 48, 56, 83]
    buckets = [(0, 83)] if bucket_size == 2**24 else list(zip(offsets, offsets[1:]))
    assert [end - begin for begin, end in buckets] == results[0]["buckets"]
    expected = simulate(world_size, steps, freeze_step, buckets=buckets, scale_block_size=scale_block_size)
    for t in range(steps):
        for rank in range(world_size):
            # Parameters are bit-identical on every rank, with no broadcast.
            assert all(torch.equal(a, b) for a, b in zip(results[rank]["snapshots"][t], results[0]["snapshots"][t]))
        for a, b in zip(results[0]["snapshots"][t], expected[t]):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    assert all(all(r["masked_zero"]) for r in results)
    assert results[0]["stats"]["warmup"]["steps"] == freeze_step
    assert results[0]["stats"]["compression"]["steps"] == steps - freeze_step


@pytest.mark.slow
@pytest.mark.parametrize("world_size,bucket_size", [(2, 2**24), (3, 30)])
def test_bfloat16_errors_round_each_new_error_once_on_every_kernel_set(tmp_path, world_size, bucket_size):
    """error_dtype=torch.bfloat16 holds the errors in bfloat16: bit for bit a float32 run whose new
    errors are rounded to bfloat16 after each step, with the CPU kernels and the reference kernels
    (both reading and writing bfloat16 themselves) and a kernel set of float32 errors only (as the
    CUDA kernels: each stage on a float32 copy) alike; and, on 2 ranks, the simulation with
    bfloat16 errors.
    (On 3 ranks the engine and the simulation differ in float32's last bit, which a bfloat16
    rounding can turn into one bfloat16 unit of an error: their trajectories then part by ~5e-6.)"""
    steps, freeze_step = 8, 3
    args = (steps, freeze_step, None, None, bucket_size, None)
    runs = {kernels: run_ranks(_train_rank, world_size, tmp_path / kernels, *args, torch.bfloat16, kernels)
            for kernels in ("auto", "reference", "reference-float32-errors")}
    rounded = run_ranks(_train_rank, world_size, tmp_path / "rounded", *args, None, "auto", True)
    for results in runs.values():
        for rank in range(world_size):
            assert all(w.dtype == s.dtype == torch.bfloat16 for w, s in results[rank]["errors"])
            for t in range(steps):
                assert all(torch.equal(a, b) for a, b in zip(results[rank]["snapshots"][t], rounded[rank]["snapshots"][t]))
            assert all(torch.equal(a.float(), b) and torch.equal(c.float(), d)
                       for (a, c), (b, d) in zip(results[rank]["errors"], rounded[rank]["errors"]))
    if world_size == 2:
        offsets = [0, 48, 56, 83]
        buckets = [(0, 83)] if bucket_size == 2**24 else list(zip(offsets, offsets[1:]))
        expected = simulate(world_size, steps, freeze_step, buckets=buckets, error_dtype=torch.bfloat16)
        for t in range(steps):
            for a, b in zip(runs["auto"][0]["snapshots"][t], expected[t]):
                torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    # float32 errors take another path (so the comparisons above can fail)
    plain = run_ranks(_train_rank, world_size, tmp_path / "float32", *args, None, "auto")
    gap = max(float((a - b).abs().max()) for a, b in zip(plain[0]["snapshots"][-1], rounded[0]["snapshots"][-1]))
    assert gap > 1e-5, gap


# The reference codec as a kernel set of float32 errors only (as the CUDA kernels): bfloat16 errors
# go through a float32 copy in each stage.
registry.register("reference-float32-errors", lambda: dataclasses.replace(
    REFERENCE, name="reference-float32-errors", error_dtypes=(torch.float32,)))


def _counted(name: str):
    def method(self, *args):
        self.calls += 1
        return getattr(TorchDistBackend, name)(self, *args)
    return method


class CountingBackend(TorchDistBackend):
    """Counts the torch.distributed calls actually issued, independently of onebit's statistics."""

    def __init__(self):
        super().__init__(expected="gloo")
        self.calls = 0

    all_reduce_mean_ = _counted("all_reduce_mean_")
    start_all_reduce_mean_ = _counted("start_all_reduce_mean_")
    all_to_all = _counted("all_to_all")
    all_gather = _counted("all_gather")
    start_all_to_all = _counted("start_all_to_all")
    start_all_gather = _counted("start_all_gather")


def _count_rank(rank, world_size):
    out = {}
    for tensors in (2, 200):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(500)) for _ in range(tensors)]
        backend = CountingBackend()
        opt = OnebitAdam(params, lr=1e-3, freeze_step=1, backend=backend)
        per_step = []
        for step in range(3):
            for i, p in enumerate(params):
                # rank 1 has no gradient for the first tensor: it counts as zeros, no hang
                p.grad = None if (rank == 1 and i == 0) else torch.randn(500)
            before = backend.calls
            opt.step()
            per_step.append(backend.calls - before)
        out[tensors] = {"calls": per_step, "stats": opt.comm_stats(), "numel": 500 * tensors,
                        "params": [p.detach().clone() for p in params[:3]]}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_per_step_do_not_grow_with_tensors(tmp_path, world_size):
    results = run_ranks(_count_rank, world_size, tmp_path)
    for result in results:
        # step 1: the layout check (an 8-byte all-gather) and one all-reduce of the gradients;
        # compression steps: the flag, one all-to-all and one all-gather, and (as rank 1 lacks a
        # gradient) the all-reduce of which tensors have one on some rank.
        assert result[2]["calls"] == [2, 4, 4]
        assert result[200]["calls"] == [2, 4, 4]
        assert result[200]["stats"]["last_step"]["collectives"] == 4
    for tensors in (2, 200):
        for rank in range(world_size):
            assert all(torch.equal(a, b) for a, b in zip(results[rank][tensors]["params"], results[0][tensors]["params"]))
    n, numel = world_size, results[0][200]["numel"]
    compressed = results[0][200]["stats"]["last_step"]["bytes_sent"]
    # Each 500-element tensor is padded on its own to a multiple of 8n (512 or 504) and carries
    # its own float32 scale in every wire row; the flag is a 3-float all-reduce (finiteness, error
    # ratio, missing gradients).
    padded = 200 * padded_length(500, n)
    scales = 2 * (n - 1) * 4 * 200
    flag = 2 * (n - 1) * 12 // n
    presence = 2 * (n - 1) * 4 * 200 // n
    assert compressed == 2 * (n - 1) * padded // (8 * n) + scales + flag + presence
    ideal = 2 * (n - 1) / n * numel / 8
    assert ideal <= compressed - scales - flag - presence <= 1.03 * ideal
    fp32 = results[0][200]["stats"]["warmup"]["bytes_sent"] - (n - 1) * 8  # less the layout check
    # exactly the gradients (no padding on that wire) and a presence flag per tensor
    assert fp32 == 2 * (n - 1) * (numel + 200) * 4 // n
    assert fp32 / compressed >= 25


@pytest.mark.slow
def test_checkpoint_saved_on_2_ranks_loads_on_3(tmp_path):
    path = tmp_path / "ckpt.pt"
    run_ranks(_train_rank, 2, tmp_path, 5, 3, None, str(path))
    saved = torch.load(path)
    assert saved["optimizer"]["param_groups"][0]["onebit"]["step"] == 5
    results = run_ranks(_train_rank, 3, tmp_path, 3, 3, str(path))
    assert results[0]["phase"] == "compression"
    # The 3-rank continuation equals the simulation of 3 ranks started from the checkpoint with
    # zero compression errors (the load resets them).
    expected = simulate(3, 3, 3, start=saved)
    for t in range(3):
        for rank in range(3):
            assert all(torch.equal(a, b) for a, b in zip(results[rank]["snapshots"][t], results[0]["snapshots"][t]))
        for a, b in zip(results[0]["snapshots"][t], expected[t]):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_padded_length_rule():
    assert padded_length(1000, 2) == 1008
    assert padded_length(1008, 3) == 1008
    assert padded_length(0, 4) == 32


def _local_in_a_job(rank: int, world_size: int) -> dict:
    """comm_backend_name='local' inside a job of several ranks (what the one-process snippets of the
    docs say): refused with the fix; an explicit LocalBackend() trains alone, as asked."""
    try:
        onebit.OnebitAdam(_model().parameters(), comm_backend_name="local")
        refused = None
    except ValueError as exc:
        refused = str(exc)
    alone = onebit.OnebitAdam(_model().parameters(), backend=onebit.LocalBackend())
    return {"refused": refused, "alone": alone.backend.world_size}


@pytest.mark.slow
def test_local_backend_by_name_is_refused_in_a_job_of_several_ranks(tmp_path, monkeypatch):
    """Issue 44, row 1: ranks 7e-2 apart after 8 steps, silently, before."""
    for result in run_ranks(_local_in_a_job, 2, tmp_path):
        assert result["refused"] == (
            "comm_backend_name='local' trains each rank alone, but the default process group has 2 processes: omit "
            "comm_backend_name to average over the default process group, or pass 'gloo', 'nccl' or 'mpi'; to "
            "train every rank alone on purpose, pass backend=onebit.LocalBackend()")
        assert result["alone"] == 1
    monkeypatch.setenv("WORLD_SIZE", "4")  # a launcher's job before init_process_group
    with pytest.raises(ValueError, match=r"but the launcher reports 4 processes: omit comm_backend_name"):
        onebit.OnebitAdam(_model().parameters(), comm_backend_name="local")
