"""Run a function on real gloo ranks (spawned processes, FileStore) with a hard timeout.

``run_ranks(fn, world_size, tmp_path, *args)`` returns the list of ``fn(rank, world_size, *args)``
results, rank order. A rank that raises fails the test with its traceback; a rank that does not
finish within ``timeout`` seconds (a hung collective) is killed and fails the test.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60


def _worker(fn, rank: int, world_size: int, out_dir: str, args: tuple, collective_timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"result{rank}.pt")
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, tmp_path: Path, *args, timeout: float = 120.0,
              collective_timeout: float = COLLECTIVE_TIMEOUT_S, allow_missing: bool = False) -> list:
    """``allow_missing``: a rank that exits without a result (on purpose) gives ``None``."""
    out = Path(tmp_path) / f"ranks{world_size}_{fn.__name__}"
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, str(out), args, collective_timeout)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {r: (out / f"error{r}.txt").read_text() for r in range(world_size) if (out / f"error{r}.txt").exists()}
    if errors:
        first = min(errors)
        pytest.fail(f"rank {first} of {world_size} raised:\n{errors[first]}", pytrace=False)
    if hung:
        pytest.fail(f"ranks {hung} of {world_size} did not finish within {timeout} s (hung collective?)", pytrace=False)
    results = []
    for r in range(world_size):
        path = out / f"result{r}.pt"
        if not path.exists() and allow_missing:
            results.append(None)
            continue
        results.append(torch.load(path, weights_only=False))
    return results


@contextlib.contextmanager
def one_thread():
    """Run with one thread, as the ranks do (an oracle's gradients must be the ranks' bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def dcp_save(model, opt, path: str) -> None:
    """``torch.distributed.checkpoint``: save the model's and the optimizer's state dicts to ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def dcp_load(model, opt, path: str) -> None:
    """``torch.distributed.checkpoint``: load ``path`` into ``model`` and ``opt`` (in place)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
