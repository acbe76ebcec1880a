"""``reduce_dtype=torch.bfloat16``: the full-precision all-reduce of warmup steps sends bfloat16.

Oracles: a one-rank optimizer fed the bfloat16 average computed here (the warmup is Adam on the
averaged gradient), and the same optimizer with float32 for the bytes. The 2-rank runs share one
launch: a plain loop, ``overlap_backward=True`` and DDP + ``attach_ddp`` must land on the same
bits; a DDP without its adapter must still be said.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam, from_config
from onebit.backends import LocalBackend
from onebit.integrations import attach_ddp
from onebit.stats import allreduce_wire_bytes

STEPS, FREEZE = 5, 3


def _model() -> torch.nn.Module:
    return tiny_mlp(6, 16, 3)


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _train(rank: int, mode: str, dtype, world_size: int = 2) -> dict:
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, comm_backend_name="gloo", reduce_dtype=dtype,
                     overlap_backward=mode.startswith("overlap"))
    net = model
    if mode in ("ddp", "forgotten"):
        net = DDP(model)
        if mode == "ddp":
            attach_ddp(net, opt)
    grads, snapshots, sent = [], [], []
    for step in range(1, STEPS + 1):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        if mode.endswith("clipped"):  # changed after backward: with overlap, step() sends them again
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if mode == "alone" and rank != 0:  # the last layer's bias has a gradient on rank 0 only
            model[-1].bias.grad = None
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
        sent.append(opt.comm_stats()["last_step"]["bytes_sent"])
        if step == 1 and mode == "alone":  # the averages the warmup step used (one bucket)
            (bucket,) = opt._buckets
            averaged = [g.view_as(p).clone() for g, p in zip(bucket.dense_grads(), bucket.params)]
    return {"grads": grads, "snapshots": snapshots, "sent": sent, **({"averaged": averaged} if mode == "alone" else {})}


def _session(rank: int, world_size: int) -> dict:
    out = {(mode, str(dtype)): _train(rank, mode, dtype) for mode, dtype in (
        ("plain", None), ("plain", torch.bfloat16), ("overlap", torch.bfloat16), ("ddp", torch.bfloat16),
        ("clipped", torch.bfloat16), ("overlap_clipped", torch.bfloat16))}
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("onebit").addHandler(handler)
    try:
        _train(rank, "forgotten", torch.bfloat16)
    finally:
        logging.getLogger("onebit").removeHandler(handler)
    out["forgotten_warnings"] = [m for m in records if "a framework averages them already" in m]
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_session, 2, tmp_path_factory.mktemp("reduce_dtype"), timeout=240)


def _bf16_mean(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """What the bfloat16 all-reduce gives: each rank's gradient rounded to bfloat16, summed in
    bfloat16 (2 ranks: one rounding), divided in bfloat16."""
    total = per_rank[0].to(torch.bfloat16) + per_rank[1].to(torch.bfloat16)
    return (total / len(per_rank)).float()


def test_warmup_is_adam_on_the_bfloat16_average(two_ranks):
    run = [two_ranks[r][("plain", "torch.bfloat16")] for r in range(2)]
    model = _model()
    oracle = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, comm_backend_name="local")
    rounded = False
    for step in range(FREEZE):
        for i, p in enumerate(model.parameters()):
            p.grad = _bf16_mean([run[r]["grads"][step][i] for r in range(2)])
            exact = (run[0]["grads"][step][i] + run[1]["grads"][step][i]) / 2
            rounded |= not torch.equal(p.grad, exact)
        oracle.step()
        for p, q in zip(model.parameters(), run[0]["snapshots"][step]):
            assert torch.equal(p.detach(), q), f"step {step + 1}"
    assert rounded  # the oracle's averages differ from float32 ones: the test can tell the two apart
    # and the float32 run took other steps
    fp32 = two_ranks[0][("plain", "None")]["snapshots"][0]
    assert any(not torch.equal(a, b) for a, b in zip(fp32, run[0]["snapshots"][0]))


def test_warmup_sends_half_the_bytes_and_replicas_stay_identical(two_ranks):
    fp32 = two_ranks[0][("plain", "None")]["sent"]
    bf16 = two_ranks[0][("plain", "torch.bfloat16")]["sent"]
    params = list(_model().parameters())
    wire = sum(p.numel() for p in params) + len(params)  # the gradients and a presence flag each
    half = allreduce_wire_bytes(2 * wire, 2)  # what 2 bytes an element instead of 4 saves
    digest = allreduce_wire_bytes(4 * 8, 2)  # the double-averaging check's float64 digest (steps 1-2)
    assert [a - b for a, b in zip(fp32, bf16)] == [half - digest] * 2 + [half] * (FREEZE - 2) + [0] * (STEPS - FREEZE)
    for key in (("plain", "torch.bfloat16"), ("overlap", "torch.bfloat16"), ("ddp", "torch.bfloat16")):
        for a, b in zip(two_ranks[0][key]["snapshots"], two_ranks[1][key]["snapshots"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), key


@pytest.mark.parametrize("mode", ["overlap", "ddp"])
def test_overlap_and_attach_ddp_land_on_the_plain_loops_bits(two_ranks, mode):
    for rank in range(2):
        plain = two_ranks[rank][("plain", "torch.bfloat16")]["snapshots"]
        other = two_ranks[rank][(mode, "torch.bfloat16")]["snapshots"]
        for step, (a, b) in enumerate(zip(plain, other), start=1):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank}, step {step}"


def test_gradients_changed_after_backward_are_sent_again_in_bfloat16(two_ranks):
    for rank in range(2):
        plain = two_ranks[rank][("clipped", "torch.bfloat16")]["snapshots"]
        redone = two_ranks[rank][("overlap_clipped", "torch.bfloat16")]["snapshots"]
        assert all(torch.equal(x, y) for a, b in zip(plain, redone) for x, y in zip(a, b)), rank
    unclipped = two_ranks[0][("plain", "torch.bfloat16")]["snapshots"][0]
    assert any(not torch.equal(x, y) for x, y in zip(unclipped, plain[0]))  # the clipping did change them


def _three(rank: int, world_size: int) -> dict:
    return _train(rank, "alone", torch.bfloat16, world_size)


def test_three_ranks_a_gradient_on_one_rank_counts_and_replicas_stay_identical(tmp_path):
    runs = run_ranks(_three, 3, tmp_path, timeout=180)
    for step in range(STEPS):
        assert all(torch.equal(x, y) for r in (1, 2) for x, y in zip(runs[0]["snapshots"][step], runs[r]["snapshots"][step]))
    # the bias with a gradient on rank 0 only moved in warmup: its presence averaged to 1/3, not 0
    assert not torch.equal(runs[0]["snapshots"][0][-1], _model()[-1].bias.detach())
    # step 1's averages against the exact mean of the three ranks' gradients (None counts as 0):
    # within the bfloat16 roundings (of each gradient, of the partial sums, of the division: each
    # within 2**-9 of what it rounds; gloo orders the sum its own way), and not exact
    rounded = False
    for i, averaged in enumerate(runs[0]["averaged"]):
        grads = [runs[r]["grads"][0][i] for r in range(3)]
        grads = [torch.zeros_like(averaged) if g is None else g for g in grads]
        exact = sum(grads) / 3
        assert ((averaged - exact).abs() <= 2 ** -7 * sum(g.abs() for g in grads) / 3).all(), i
        rounded |= not torch.allclose(averaged, exact, rtol=1e-6, atol=0)
        assert all(torch.equal(averaged, runs[r]["averaged"][i]) for r in (1, 2))
    assert rounded  # bfloat16 was sent, not float32


def test_copies_keep_it():
    import copy
    import pickle

    opt = OnebitAdam(_model().parameters(), lr=1e-3, comm_backend_name="local", reduce_dtype=torch.bfloat16)
    assert copy.deepcopy(opt).reduce_dtype is torch.bfloat16
    assert pickle.loads(pickle.dumps(opt)).reduce_dtype is torch.bfloat16


def test_a_forgotten_adapter_is_still_said(two_ranks):
    assert len(two_ranks[0]["forgotten_warnings"]) == 1
    assert two_ranks[1]["forgotten_warnings"] == []


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("cls, schedule", [(OnebitAdam, dict(freeze_step=2)), (OnebitLamb, dict(freeze_step=2)),
                                           (ZeroOneAdam, dict(var_freeze_step=4))])
def test_one_rank_sends_nothing_so_rounds_nothing(cls, schedule):
    runs = []
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = _model()
        opt = cls(model.parameters(), lr=1e-2, comm_backend_name="local", reduce_dtype=dtype, **schedule)
        for step in range(1, 6):
            x, y = _batch(0, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("value, kept", [(None, None), (torch.float32, None), ("float32", None),
                                         (torch.bfloat16, torch.bfloat16), ("bfloat16", torch.bfloat16)])
def test_accepted_values(value, kept):
    opt = OnebitAdam(_model().parameters(), lr=1e-3, comm_backend_name="local", reduce_dtype=value)
    assert opt.reduce_dtype is kept


@pytest.mark.parametrize("value", [torch.float16, torch.float64, "bf16", torch.int8, 16])
def test_other_values_are_refused_by_name(value):
    with pytest.raises(ValueError, match=f"invalid reduce_dtype: {value!r}"):
        OnebitAdam(_model().parameters(), lr=1e-3, comm_backend_name="local", reduce_dtype=value)


def test_config_files_name_it():
    config = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2, "reduce_dtype": "bfloat16",
                                                             "comm_backend_name": "local"}}}
    assert from_config(_model().parameters(), config).reduce_dtype is torch.bfloat16
    config["optimizer"]["params"]["reduce_dtype"] = "half"
    with pytest.raises((TypeError, ValueError), match="reduce_dtype"):
        from_config(_model().parameters(), config)


class _MpiNamed(LocalBackend):
    name = "mpi"


def test_the_mpi_transport_refuses_it():
    with pytest.raises(ValueError, match="saves nothing on the MPI transport"):
        OnebitAdam(_model().parameters(), lr=1e-3, backend=_MpiNamed(), reduce_dtype=torch.bfloat16)
