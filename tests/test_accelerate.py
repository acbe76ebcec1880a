"""onebit optimizers in a Hugging Face Accelerate loop: examples/accelerate/train.py on 2 gloo ranks
under torchrun, against the same optimizer in a plain loop on the same batches (the oracle, run by
the same processes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from conftest import max_abs_diff  # noqa: E402
from launch import run_job, torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARAMS = 8 * 32 + 32 + 32 * 4 + 4  # the example's MLP
STEPS = 12


def _run(tmp_path: Path, *flags: str) -> list[dict]:
    cmd = [torchrun(), "--standalone", "--nproc-per-node", "2", str(ROOT / "examples/accelerate/train.py"),
           "--steps", str(STEPS), "--freeze-step", "4", "--reference", "--result", str(tmp_path / "result"), *flags]
    proc = run_job(cmd, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [torch.load(tmp_path / f"result.rank{r}.pt") for r in range(2)]


CASES = {
    "adam": ("--optimizer", "adam"),
    "lamb": ("--optimizer", "lamb"),
    "zoadam_accumulate": ("--optimizer", "zoadam", "--accumulate", "2"),
    "adam_accumulate_bf16": ("--optimizer", "adam", "--accumulate", "2", "--mixed-precision", "bf16"),
    # overlap_backward: accelerate's no_sync() on the first micro-batch is the optimizer's too (attach_ddp)
    "adam_accumulate_overlap": ("--optimizer", "adam", "--accumulate", "2", "--overlap"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_accelerate_averages_once_and_tracks_the_plain_loop(tmp_path, case):
    ranks = _run(tmp_path, *CASES[case])
    plans = ranks[0]["plans"]
    assert plans == ranks[1]["plans"]
    averaged = {"warmup", "variance"}
    assert {"warmup", "compression"} <= set(plans) or {"variance", "compressed_gradient", "local", "sync"} <= set(plans)
    for rank in ranks:
        for plan, micro_batches in zip(plans, rank["collectives"]):
            *accumulating, boundary = micro_batches
            # Micro-batches that end no step: DDP sends nothing (accelerate's no_sync).
            assert all(counts == (0, 0) for counts in accumulating)
            # The last one: every gradient averaged exactly once when the plan averages gradients,
            # nothing otherwise (the optimizer sends the 1-bit momentum or gradient itself).
            assert boundary[1] == (PARAMS if plan in averaged else 0), (plan, boundary)
        assert not rank["redone"]
        stats = rank["stats"]
        first = "warmup" if "warmup" in plans else "variance"  # (comm_stats() has a key for every plan)
        assert stats[first]["steps"] == plans.count(first)
        # The optimizer sent no gradient of its own in those steps: one 8-byte layout check only.
        assert stats[first]["bytes_sent"] - stats[first]["framework_bytes_sent"] == 8  # (DDP's bytes counted apart)
    # Replicas: bit-identical after every step that communicated (0/1 Adam's local steps differ).
    for step, plan in enumerate(plans):
        if plan != "local":
            assert max_abs_diff(ranks[0]["trajectory"][step], ranks[1]["trajectory"][step]) == 0.0, (step, plan)
    # The oracle, bit for bit: DDP divides each gradient by 2 before summing and onebit after (both
    # exact for 2 ranks), and accelerate's bf16 autocast is the plain loop's torch.autocast.
    for rank in ranks:
        diffs = [max_abs_diff(a, b) for a, b in zip(rank["trajectory"], rank["reference"])]
        assert max(diffs) == 0.0, diffs


def test_attach_accelerate_refuses_what_it_cannot_serve():
    from onebit import OnebitAdam
    from onebit.integrations import attach_accelerate

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="onebit optimizer"):
        attach_accelerate(model, torch.optim.Adam(model.parameters()))
    opt = OnebitAdam(model.parameters(), comm_backend_name="local")

    class FullyShardedDataParallel(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(TypeError, match="FullyShardedDataParallel"):
        attach_accelerate(FullyShardedDataParallel(model), opt)
    attach_accelerate(model, opt)  # one process, not wrapped: nothing to attach
