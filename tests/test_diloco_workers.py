"""Workers of many ranks with DDP inside them (issue 42, item 3): the recipe of
``docs/guides/algorithms.md``, 4 gloo ranks as 2 workers x 2 ranks.

A 2-D mesh ``("replicate", "shard")``: torch's ``DistributedDataParallel`` averages the gradients
over ``mesh["shard"]`` (the ranks of one worker, the fast network) as usual, and ``OnebitDiLoCo``
runs over ``mesh["replicate"]`` (one rank of each worker: the slow link). Every rank of a worker
holds the same gradients, takes the same inner steps and sends the same pseudo-gradient, so each
``replicate`` group computes the same outer step and the worker's ranks stay bit-identical.

Oracle: on the same ranks, OnebitDiLoCo over the same ``replicate`` group on a plain copy of the
model whose gradient is the mean of the worker's two batches (what DDP's average is: halving is
exact): the DDP run equals it bit for bit, step by step, and sends the same bytes per rank, so a
worker of k ranks sends k times one worker's 1-bit bytes over the slow link (the FSDP2 recipe,
``fully_shard`` over ``mesh["shard"]``, sends each rank's shard only: see
``tests/test_diloco_integrations.py``).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_mlp
from distributed import run_ranks
from onebit import OnebitDiLoCo

pytestmark = pytest.mark.slow  # 4 gloo ranks

H = 3
STEPS = 8  # outer steps at 3 and 6
LR = 1e-2


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)


def _loss(model: torch.nn.Module, rank: int, t: int) -> torch.Tensor:
    x, y = _batch(rank, t)
    return torch.nn.functional.mse_loss(model(x), y)


def _ddp_in_workers(rank: int, world_size: int, delay: int = 0) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    worker = rank // 2  # mesh rows: ranks 0, 1 are worker 0; ranks 2, 3 worker 1
    model = tiny_mlp(16, 32, 1, seed=0)
    ddp = DistributedDataParallel(model, process_group=mesh["shard"].get_group())
    opt = OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, group=mesh["replicate"], sync_delay=delay)
    plain, twin = tiny_mlp(16, 32, 1, seed=0), tiny_mlp(16, 32, 1, seed=0)
    oracle = OnebitDiLoCo(plain.parameters(), lr=LR, sync_every=H, group=mesh["replicate"], sync_delay=delay)
    trajectory, expected = [], []
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        _loss(ddp, rank, t).backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
        # the oracle: the mean of the worker's two batches' gradients, at the oracle's parameters
        grads = []
        for member in (2 * worker, 2 * worker + 1):
            with torch.no_grad():
                for p, q in zip(twin.parameters(), plain.parameters()):
                    p.copy_(q)
            twin.zero_grad(set_to_none=True)
            _loss(twin, member, t).backward()
            grads.append([p.grad.clone() for p in twin.parameters()])
        for p, a, b in zip(plain.parameters(), *grads):
            p.grad = (a + b) / 2
        oracle.step()
        expected.append([p.detach().clone() for p in plain.parameters()])
    return {"trajectory": trajectory, "expected": expected,
            "bytes": opt.comm_stats()["total"]["bytes_sent"], "oracle_bytes": oracle.comm_stats()["total"]["bytes_sent"]}


@pytest.mark.parametrize("delay", [0, 2], ids=["blocking", "sync_delay2"])
def test_ddp_inside_each_worker_equals_one_rank_per_worker(tmp_path, delay):
    """(With sync_delay 2 too: each exchange lands two steps after its outer step, at 5 and 8.)"""
    results = run_ranks(_ddp_in_workers, 4, tmp_path, delay, timeout=240.0)
    for rank, result in enumerate(results):
        for t, (mine, theirs) in enumerate(zip(result["trajectory"], result["expected"]), start=1):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (rank, t)
        assert result["bytes"] == result["oracle_bytes"] > 0
    for t in range(STEPS):  # the ranks of a worker agree bit for bit at every step; the workers differ between syncs
        for first, second in ((0, 1), (2, 3)):
            assert all(torch.equal(a, b) for a, b in zip(results[first]["trajectory"][t], results[second]["trajectory"][t]))
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["trajectory"][0], results[2]["trajectory"][0]))
