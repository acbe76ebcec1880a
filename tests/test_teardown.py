"""Nothing keeps the process group alive after ``destroy_process_group()``: its gloo worker threads
are gone. A group kept alive past it left those threads running into interpreter finalization,
where one releasing a finished collective's tensors aborted the rank at exit ("terminate called
without an active exception", SIGABRT; about 1 run in 20 of ``examples/elastic_train.py``).

Two references did that: torch's ``torch.distributed.nn.functional``, imported by the first
``Optimizer.add_param_group`` (through ``torch._dynamo``), binds the default group as a default
argument when it is imported after ``init_process_group`` (``onebit`` imports it first); and
``attach_ddp``'s plan callback held the DDP model, which holds the optimizer through DDP's C++
reducer: a cycle the garbage collector cannot see (the callback now holds the model weakly)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distributed import run_ranks
from onebit import OnebitAdam, ZeroOneAdam
from onebit.integrations import attach_ddp

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the thread names in /proc")


def _gloo_threads() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(name for name in names if "gloo" in name)


def _train_then_destroy(rank: int, world_size: int, case: str) -> tuple[list[str], list[str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    forward = model
    if case == "ddp":
        forward = DistributedDataParallel(model)
        optimizer = OnebitAdam(forward.parameters(), lr=1e-3, freeze_step=2)
        attach_ddp(forward, optimizer)
    else:
        optimizer = (OnebitAdam if case == "adam" else ZeroOneAdam)(model.parameters(), lr=1e-3, **(
            {"freeze_step": 2} if case == "adam" else {"var_freeze_step": 2}))
    for t in range(5):
        optimizer.zero_grad()
        forward(torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * t + rank))).square().mean().backward()
        optimizer.step()
    before = _gloo_threads()
    dist.destroy_process_group()
    del forward, model, optimizer
    gc.collect()
    return before, _gloo_threads()


@pytest.mark.parametrize("case", ["adam", "zoadam", "ddp"])
def test_destroy_process_group_ends_the_gloo_threads(tmp_path, case):
    for rank, (before, after) in enumerate(run_ranks(_train_then_destroy, 2, tmp_path, case)):
        assert before, f"rank {rank}: no gloo thread while the group was alive (the check would see nothing)"
        assert after == [], f"rank {rank}: gloo threads still running after destroy_process_group(): {after}"
