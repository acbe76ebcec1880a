"""examples/fsdp/train_hsdp.py under torchrun on 4 ranks: the HSDP recipe with gradient accumulation
and bfloat16 mixed precision trains through the switch with identical replicas, saves a DCP
checkpoint, and a second run resumes from it on another layout (FSDP over all 4 ranks)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from launch import run_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "fsdp" / "train_hsdp.py"


def _run(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPT), *args]
    proc = run_job(command, 180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def test_hsdp_example_trains_saves_and_resumes_on_another_layout(tmp_path):
    checkpoint = tmp_path / "dcp"
    out = _run("--steps", "14", "--freeze-step", "6", "--bf16", "--accumulate", "2", "--save", str(checkpoint))
    assert out.count("step 7: variance frozen, switching to 1-bit compressed momentum") == 1, out[-4000:]
    assert "replicas identical after step 14" in out and f"saved a torch.distributed.checkpoint to {checkpoint}" in out
    assert "for 3201 of 6337 parameters" in out  # the state of rank 0's shard (uneven: 6337 is odd)
    out = _run("--replicas", "1", "--steps", "4", "--freeze-step", "6", "--load", str(checkpoint))
    # one optimizer per rank (a group of one each); the first shard's says it
    assert out.count("loaded optimizer state at step 14 (next: a compression step); compression errors reset") == 1, out[-4000:]
    assert "replicas identical after step 18" in out
