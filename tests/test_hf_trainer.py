"""OnebitAdam in transformers.Trainer under torchrun (2 gloo ranks), with the DDP hook attached."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # HF Trainer under torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from launch import torchrun  # noqa: E402
from onebit.compression import padded_length  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_trainer_with_onebit_on_two_ranks(tmp_path):
    cmd = [torchrun(), "--standalone", "--nproc-per-node", "2", str(ROOT / "examples/hf_trainer/train.py"),
           "--steps", "12", "--freeze-step", "4", "--output-dir", str(tmp_path / "out"),
           "--result", str(tmp_path / "result")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["param_sum"] == results[1]["param_sum"]  # identical weights, no broadcast
    assert results[0]["param_abs_sum"] == results[1]["param_abs_sum"]
    stats = results[0]["stats"]
    assert stats["warmup"]["steps"] == 4 and stats["compression"]["steps"] == 8
    # Warmup gradients were averaged once, by DDP (counted apart): the optimizer sent only the 8-byte layout check.
    assert stats["warmup"]["bytes_sent"] - stats["warmup"]["framework_bytes_sent"] == 8
    assert stats["warmup"]["framework_bytes_sent"] > 0
    # Compression: 1-bit momentum, each tensor padded to a multiple of 16 on 2 ranks: padded / 8
    # sign bytes, plus one 4-byte scale per tensor in each of the 2 collectives, plus the 12-byte flag
    # (finiteness, error ratio, missing gradients).
    per_step = stats["last_step"]["bytes_sent"]
    sizes = results[0]["sizes"]
    assert per_step == sum(padded_length(s, 2) for s in sizes) // 8 + 8 * len(sizes) + 12
    assert per_step <= 1.15 * results[0]["numel"] / 8
