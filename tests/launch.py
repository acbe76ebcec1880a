"""Run a multi-process job (mpiexec, torchrun) from a test with a hard time limit.

The job runs in its own process session under ``timeout``; if it outlives the limit, the whole
session (launcher and ranks) is killed and the test fails, so a hung collective never stalls CI.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def mpiexec() -> str | None:
    """The mpiexec beside this Python (the ``mpich`` wheel installs one into the venv), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def torchrun() -> str:
    """The torchrun beside this Python, else on PATH; without one, the test is skipped."""
    found = shutil.which("torchrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if found is None:
        pytest.skip("torchrun is not on PATH")
    return found


def run_job(command: list[str], timeout: float, *, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run ``command`` (stdout and stderr together) and return it; fail the test after ``timeout`` s."""
    if shutil.which("timeout") is None:
        pytest.skip("the timeout command (coreutils) is needed to bound a multi-process job")
    bounded = ["timeout", "-k", "5", str(int(timeout)), *command]
    proc = subprocess.Popen(bounded, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session started above: the launcher and its ranks
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(command[:4])} ... did not finish within {timeout + 15} s:\n{out[-5000:]}")
    if proc.returncode == 124:
        pytest.fail(f"{' '.join(command[:4])} ... was stopped after {timeout} s (hung?):\n{out[-5000:]}")
    return subprocess.CompletedProcess(bounded, proc.returncode, out, None)
