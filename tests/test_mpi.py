"""MPIBackend: the conformance suite under mpiexec, equality with gloo, and the ImportError.

Two kinds of tests live here:

* ``@pytest.mark.mpi`` tests run on every rank of
  ``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/test_mpi.py`` (skipped
  without ``--with-mpi``). Run them by hand that way, with N = 2 or 3.
* Plain tests launch that command themselves (``-n 2`` and ``-n 3``, hard timeout, the job's
  processes killed on expiry), so a plain ``pytest`` run covers MPI wherever mpiexec and mpi4py
  are installed, and compare the MPI results with the gloo backend's.

The pytest process itself never initializes MPI: MPI runs only in the launched jobs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import conformance
from launch import mpiexec, run_job
from onebit.backends import resolve_backend

HERE = Path(__file__).resolve().parent
MPIEXEC_TIMEOUT_S = 150
ENV_WORLD_SIZE = "ONEBIT_TEST_MPI_WORLD_SIZE"  # set by the launcher: the -n it used
ENV_RESULTS = "ONEBIT_TEST_MPI_RESULTS"  # set by the launcher: where ranks save results
ENV_SHARED = "ONEBIT_TEST_MPI_SHARED"  # set by the launcher: a directory every rank sees


# ----------------------------------------------------------------------------- under mpiexec


@pytest.fixture
def mpi():
    from onebit.backends.mpi import import_mpi

    return import_mpi()


@pytest.fixture
def shared_dir(mpi, request):
    """A fresh directory seen by every rank of COMM_WORLD."""
    comm = mpi.COMM_WORLD
    base = os.environ.get(ENV_SHARED)
    path = None
    if comm.Get_rank() == 0:
        if base:
            Path(base).mkdir(parents=True, exist_ok=True)
        path = tempfile.mkdtemp(prefix=re.sub(r"\W", "_", request.node.name)[:40], dir=base or None)
    path = comm.bcast(path, root=0)
    yield Path(path)
    comm.Barrier()
    if comm.Get_rank() == 0 and not base:
        shutil.rmtree(path, ignore_errors=True)


def _launched_world_size(comm) -> int:
    value = os.environ.get(ENV_WORLD_SIZE)
    return int(value) if value else comm.Get_size()


def _save(name: str, rank: int, result=None) -> None:
    """Under the launcher: record that test ``name`` passed on ``rank`` (and its result)."""
    directory = os.environ.get(ENV_RESULTS)
    if directory:
        torch.save(result, Path(directory) / f"{name}_rank{rank}.pt")


@pytest.mark.mpi
@pytest.mark.parametrize("check", conformance.CHECK_NAMES)
def test_mpi_backend_conforms(mpi, shared_dir, check):
    from onebit.backends.mpi import MPIBackend

    backend = MPIBackend()
    assert backend.name == "mpi" and backend.comm is mpi.COMM_WORLD
    result = conformance.CHECKS[check](backend, shared_dir, _launched_world_size(mpi.COMM_WORLD))
    _save(check, backend.rank, result)


@pytest.mark.mpi
def test_mpi_backend_is_what_comm_backend_name_mpi_builds(mpi):
    from onebit.backends.mpi import MPIBackend

    backend = resolve_backend("mpi")
    assert isinstance(backend, MPIBackend)
    assert (backend.rank, backend.world_size) == (mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size())
    _save("resolve_backend", backend.rank)


@pytest.mark.mpi
def test_mpi_backend_works_within_a_sub_communicator(mpi, shared_dir):
    """Ranks 0 and 1 form one communicator (in reversed order), any others another: each runs the
    suite inside its own communicator, with its own ranks and world size."""
    from onebit.backends.mpi import MPIBackend

    world = mpi.COMM_WORLD
    color = 0 if world.Get_rank() < 2 else 1
    sub = world.Split(color, key=-world.Get_rank())
    try:
        backend = MPIBackend(sub)
        expected = min(2, world.Get_size()) if color == 0 else world.Get_size() - 2
        assert backend.world_size == expected
        assert backend.rank == sub.Get_rank()
        if color == 0 and expected == 2:
            assert backend.rank == 1 - world.Get_rank()  # key=-rank reverses the order
        directory = shared_dir / f"color{color}"
        for name in ("rank_and_world_size_are_consistent", "all_to_all_sends_row_j_to_rank_j",
                     "compressed_allreduce_equals_the_oracle_exactly", "barrier_waits_for_every_rank"):
            conformance.CHECKS[name](backend, directory / name, expected)
    finally:
        sub.Free()
    _save("sub_communicator", world.Get_rank())


def _staging_backend():
    """An MPIBackend that stages CPU tensors through host buffers as it does device tensors."""
    from onebit.backends.mpi import MPIBackend

    class Staging(MPIBackend):
        def _direct(self, tensor):
            return False

    return Staging()


@pytest.mark.mpi
def test_mpi_backend_staging_path_conforms_and_reuses_its_buffers(mpi, shared_dir):
    backend = _staging_backend()
    n = _launched_world_size(mpi.COMM_WORLD)
    for name in ("all_reduce_mean_is_the_exact_mean", "all_to_all_sends_row_j_to_rank_j",
                 "all_gather_stacks_inputs_in_rank_order", "compressed_allreduce_equals_the_oracle_exactly"):
        conformance.CHECKS[name](backend, shared_dir / name, n)
    buffers = len(backend._staging)
    assert buffers > 0
    conformance.check_compressed_allreduce_equals_the_oracle_exactly(backend, shared_dir, n)
    assert len(backend._staging) == buffers, "staging buffers were not reused for the same sizes"
    _save("staging", backend.rank)


@pytest.mark.mpi
def test_mpi_backend_rejects_what_is_not_a_communicator(mpi):
    from onebit.backends.mpi import MPIBackend

    with pytest.raises(TypeError, match="must be an mpi4py communicator, got object"):
        MPIBackend(object())
    with pytest.raises(ValueError, match="COMM_NULL"):
        MPIBackend(mpi.COMM_NULL)
    backend = MPIBackend()
    with pytest.raises(ValueError, match="contiguous"):
        backend.all_reduce_mean_(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="floating-point"):
        backend.all_reduce_mean_(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="cuda_aware=True hands CUDA buffers"):
        MPIBackend(cuda_aware=True).all_reduce_mean_(torch.zeros(4, device="meta"))
    _save("rejects", backend.rank)


# ----------------------------------------------------------------------------- launchers


def _skip_reason() -> str | None:
    if any(os.environ.get(v) for v in (ENV_WORLD_SIZE, "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
        return "already inside an mpiexec job"
    if importlib.util.find_spec("mpi4py") is None:
        return 'mpi4py is not installed (pip install "onebit[mpich]")'
    if mpiexec() is None:
        return 'mpiexec not found (pip install "onebit[mpich]" brings one)'
    return None


class _MpiexecRuns:
    """Runs ``mpiexec -n N ... pytest --with-mpi -m mpi tests/test_mpi.py`` once per N, on demand."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.runs: dict[int, tuple[subprocess.CompletedProcess, Path]] = {}

    def get(self, n: int) -> tuple[subprocess.CompletedProcess, Path]:
        if n not in self.runs:
            self.runs[n] = self._run(n)
        return self.runs[n]

    def _run(self, n: int) -> tuple[subprocess.CompletedProcess, Path]:
        results = self.base / f"results{n}"
        results.mkdir()
        env = {
            **os.environ,
            ENV_WORLD_SIZE: str(n),
            ENV_RESULTS: str(results),
            ENV_SHARED: str(self.base / f"shared{n}"),
            "OMP_NUM_THREADS": "1",
        }
        command = [
            mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py",
            "-m", "pytest", "--with-mpi", "-m", "mpi", "-q", "-p", "no:cacheprovider", str(HERE / "test_mpi.py"),
        ]
        return run_job(command, MPIEXEC_TIMEOUT_S, env=env, cwd=HERE.parent), results


@pytest.fixture(scope="module")
def mpiexec_runs(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    return _MpiexecRuns(tmp_path_factory.mktemp("mpiexec"))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_mpi_suite_passes_on_every_rank_under_mpiexec(mpiexec_runs, n):
    proc, results = mpiexec_runs.get(n)
    tail = proc.stdout[-6000:]
    assert proc.returncode == 0, f"mpiexec -n {n} exited with {proc.returncode}:\n{tail}"
    assert not re.search(r"\d+ (failed|errors?|skipped)\b", proc.stdout), tail
    # Every MPI test reached its end on every rank (each leaves a file there when it passes).
    expected = len(conformance.CHECK_NAMES) + 4
    for rank in range(n):
        passed = sorted(p.name for p in results.glob(f"*_rank{rank}.pt"))
        assert len(passed) == expected, f"rank {rank}: {len(passed)} of {expected} MPI tests passed {passed}:\n{tail}"
    assert not list(results.glob(f"*_rank{n}.pt")), "more ranks than launched"


@pytest.mark.slow
def test_mpi_and_gloo_give_identical_compressed_allreduce_and_training_on_2_ranks(mpiexec_runs, tmp_path_factory):
    proc, results = mpiexec_runs.get(2)
    assert proc.returncode == 0, proc.stdout[-6000:]
    gloo = conformance.gloo_suite(2, tmp_path_factory.mktemp("gloo2"))
    compressed = "compressed_allreduce_equals_the_oracle_exactly"
    training = "onebit_adam_keeps_parameters_identical_on_every_rank"
    for rank in range(2):
        assert gloo[rank][compressed][0] == "ok" and gloo[rank][training][0] == "ok", gloo[rank]
        mpi_compressed = torch.load(results / f"{compressed}_rank{rank}.pt")
        mpi_training = torch.load(results / f"{training}_rank{rank}.pt")
        gloo_compressed, gloo_training = gloo[rank][compressed][1], gloo[rank][training][1]
        assert len(mpi_compressed) == len(gloo_compressed) == conformance.ROUNDS
        for t, (a, b) in enumerate(zip(mpi_compressed, gloo_compressed)):
            assert torch.equal(a, b), f"rank {rank}, round {t}: MPI and gloo compressed all-reduce differ"
        assert mpi_training["losses"] == gloo_training["losses"]
        for i, (a, b) in enumerate(zip(mpi_training["params"], gloo_training["params"])):
            assert torch.equal(a, b), f"rank {rank}, parameter {i}: MPI and gloo training differ"


# ----------------------------------------------------------------------------- the ImportError


def test_missing_mpi4py_raises_importerror_naming_both_extras(monkeypatch):
    from onebit import OnebitAdam
    from onebit.backends.mpi import MPIBackend

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    for build in (lambda: MPIBackend(), lambda: resolve_backend("mpi"),
                  lambda: OnebitAdam([torch.nn.Parameter(torch.zeros(2))], comm_backend_name="mpi")):
        with pytest.raises(ImportError, match=r"needs mpi4py, which is not installed") as info:
            build()
        message = str(info.value)
        assert 'pip install "onebit[mpich]"' in message and 'pip install "onebit[mpi]"' in message
        assert isinstance(info.value.__cause__, ImportError)


@pytest.fixture(scope="module")
def fresh_process_without_libmpi():
    """In a new Python whose mpi4py is pointed at a libmpi that does not exist: whether
    ``import onebit`` imported mpi4py, and what building the MPI backend raised."""
    code = (
        "import json, sys\n"
        "import onebit, onebit.backends.mpi\n"
        "imported = 'mpi4py' in sys.modules\n"
        "try:\n"
        "    onebit.backends.mpi.MPIBackend()\n"
        "except ImportError as exc:\n"
        "    error = [str(exc), type(exc.__cause__).__name__]\n"
        "else:\n"
        "    error = None\n"
        "print(json.dumps({'imported': imported, 'error': error}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith((ENV_WORLD_SIZE, "PMI_"))}
    env["MPI4PY_LIBMPI"] = "/nonexistent/libmpi.so.12"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_onebit_does_not_import_mpi4py(fresh_process_without_libmpi):
    assert fresh_process_without_libmpi["imported"] is False


def test_mpi4py_without_an_mpi_library_raises_importerror_naming_both_extras(fresh_process_without_libmpi):
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed")
    if fresh_process_without_libmpi["error"] is None:
        pytest.skip("this mpi4py build ignores MPI4PY_LIBMPI (not an MPI-ABI build): cannot simulate a missing libmpi")
    message, cause = fresh_process_without_libmpi["error"]
    assert "mpi4py is installed but cannot load an MPI library" in message
    assert 'pip install "onebit[mpich]"' in message and 'pip install "onebit[mpi]"' in message
    assert cause == "RuntimeError"


@pytest.mark.parametrize("world_size, environ, refused", [
    (1, {"WORLD_SIZE": "2"}, True),  # torchrun started 2 processes, each its own MPI world
    (1, {}, False),  # a plain one-process run
    (1, {"WORLD_SIZE": "1"}, False),
    (2, {"WORLD_SIZE": "2"}, False),  # MPI sees the whole job
])
def test_a_singleton_mpi_world_under_a_multi_process_launcher_is_refused(world_size, environ, refused):
    from onebit.backends.mpi import check_not_a_stray_singleton

    if refused:
        with pytest.raises(RuntimeError, match=r"reports WORLD_SIZE=2: launch with  mpiexec -n 2 python -m mpi4py"):
            check_not_a_stray_singleton(world_size, environ)
    else:
        assert check_not_a_stray_singleton(world_size, environ) is None


def test_cuda_aware_must_be_a_bool_before_mpi_is_touched(monkeypatch):
    from onebit.backends.mpi import MPIBackend

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(TypeError, match="cuda_aware must be True or False, got 'yes'"):
        MPIBackend(cuda_aware="yes")
