"""examples/train_from_config.py: one script, the transport chosen by the config alone.

Runs it under torchrun (gloo config) and under mpiexec (mpi config) on 2 ranks and checks that
both train, keep the parameters identical on every rank, and end with exactly the same weights.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from launch import mpiexec, run_job

pytestmark = pytest.mark.slow  # torchrun and mpiexec runs of the example

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_from_config.py"
CONFIGS = ROOT / "examples" / "configs"
STEPS = 30  # freeze_step is 20 in both configs: 10 compression steps
TIMEOUT_S = 120


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEBIT_TEST_MPI", "PMI_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _final_weights(save: Path, ranks: int) -> list[list[torch.Tensor]]:
    return [torch.load(f"{save}.rank{r}.pt") for r in range(ranks)]


def _check_training_log(output: str) -> None:
    assert "parameters identical on all 2 rank(s)" in output, output[-4000:]
    assert "switching to 1-bit compressed momentum" in output, output[-4000:]
    # One line naming the DeepSpeed sections onebit does not read.
    assert output.count("config sections not read by onebit") == 1, output[-4000:]


@pytest.fixture(scope="module")
def torchrun_weights(tmp_path_factory):
    save = tmp_path_factory.mktemp("torchrun") / "weights"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPT), "--config", str(CONFIGS / "onebit_gloo.json"), "--steps", str(STEPS), "--save", str(save)]
    proc = run_job(command, TIMEOUT_S, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    _check_training_log(proc.stdout)
    assert "backend gloo, 2 rank(s)" in proc.stdout and "torch.distributed in use: True" in proc.stdout
    return _final_weights(save, 2)


def test_example_trains_under_torchrun_with_the_gloo_config(torchrun_weights):
    for rank_weights in torchrun_weights[1:]:
        assert all(torch.equal(a, b) for a, b in zip(rank_weights, torchrun_weights[0]))
    assert all(bool(torch.isfinite(w).all()) for w in torchrun_weights[0])


def test_example_under_mpiexec_with_the_mpi_config_ends_with_the_same_weights_as_torchrun(torchrun_weights, tmp_path):
    if importlib.util.find_spec("mpi4py") is None or mpiexec() is None:
        pytest.skip('mpi4py and mpiexec are needed (pip install "onebit[mpich]")')
    save = tmp_path / "weights"
    command = [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py",
               str(SCRIPT), "--config", str(CONFIGS / "onebit_mpi.json"), "--steps", str(STEPS), "--save", str(save)]
    proc = run_job(command, TIMEOUT_S, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    _check_training_log(proc.stdout)
    assert "backend mpi, 2 rank(s)" in proc.stdout
    assert "torch.distributed in use: False" in proc.stdout
    mpi_weights = _final_weights(save, 2)
    for rank in range(2):
        for a, b in zip(mpi_weights[rank], torchrun_weights[rank]):
            assert torch.equal(a, b), "MPI and gloo runs of the example ended with different weights"
