"""Transports, chosen by name (``comm_backend_name``) or passed as an object (``backend``)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed

from .base import CommBackend
from .local import LocalBackend
from ..shards import mesh_group

__all__ = ["CommBackend", "LocalBackend", "BACKEND_NAMES", "resolve_backend"]

# Imported now, before any process group exists: torch.distributed.nn.functional's collectives
# take ``group=group.WORLD`` as a default argument, evaluated at import. Imported later (torch
# imports it with torch._dynamo, which the first ``Optimizer.add_param_group`` imports: every
# optimizer built after ``init_process_group``), the defaults keep the default process group
# alive after ``destroy_process_group()``: its gloo worker threads are never joined, and one still
# releasing a finished collective's tensors when the interpreter finalizes aborts the process
# ("terminate called without an active exception", SIGABRT at exit). (Once a group exists, the
# import would keep it alive: then it is left to torch.)
if torch.distributed.is_available() and not torch.distributed.is_initialized():
    import torch.distributed.nn  # noqa: F401

#: names accepted by ``comm_backend_name``
BACKEND_NAMES = ("gloo", "hccl", "local", "mpi", "nccl")
_TORCH_DIST_NAMES = ("gloo", "hccl", "nccl")


def _expected_world_size() -> int:
    # torchrun and most launchers export WORLD_SIZE; mpiexec exports one of these.
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 1


def _refuse_local_in_a_job() -> None:
    """``comm_backend_name='local'`` in a job of several processes would let each rank train alone,
    silently: refused, naming the fix (an explicit ``backend=LocalBackend()`` is how to mean it)."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else _expected_world_size()
    if world > 1:
        where = "the default process group has" if initialized else "the launcher reports"
        raise ValueError(
            f"comm_backend_name='local' trains each rank alone, but {where} {world} processes: omit "
            "comm_backend_name to average over the default process group, or pass 'gloo', 'nccl' or 'mpi'; "
            "to train every rank alone on purpose, pass backend=onebit.LocalBackend()")


def _given(backend: Any, comm_backend_name: Any, cuda_aware: bool) -> CommBackend:
    """A ``backend=`` object, used as it is."""
    if comm_backend_name is not None:
        raise ValueError(
            f"pass either backend= or comm_backend_name=, not both (got comm_backend_name={comm_backend_name!r})"
        )
    if not isinstance(backend, CommBackend):
        raise TypeError(f"backend must be a onebit.backends.CommBackend, got {type(backend).__name__}")
    if cuda_aware:
        raise ValueError("cuda_aware=True applies only to comm_backend_name='mpi'; configure a custom backend itself")
    return backend


def _checked_name(comm_backend_name: Any, cuda_aware: bool) -> str | None:
    """``comm_backend_name`` in lower case (None stays None), checked with ``cuda_aware``."""
    if comm_backend_name is not None and not isinstance(comm_backend_name, str):
        raise TypeError(f"comm_backend_name must be a string, got {type(comm_backend_name).__name__}")
    name = comm_backend_name.lower() if comm_backend_name is not None else None
    if name is not None and name not in BACKEND_NAMES:
        valid = ", ".join(repr(n) for n in BACKEND_NAMES)
        raise ValueError(f"unknown comm_backend_name {comm_backend_name!r}; expected one of {valid}")
    if cuda_aware and name != "mpi":
        raise ValueError(
            f"cuda_aware=True applies only to comm_backend_name='mpi' (got {comm_backend_name!r}); "
            "torch.distributed backends move device buffers themselves: leave cuda_aware=False"
        )
    return name


def resolve_backend(
    comm_backend_name: str | None = None,
    backend: CommBackend | None = None,
    *,
    cuda_aware: bool = False,
    group=None,
) -> CommBackend:
    """Build the transport the optimizer will use.

    * ``backend`` given: used as it is (``comm_backend_name`` must then be ``None``).
    * ``comm_backend_name`` in ``'gloo'``, ``'nccl'``, ``'hccl'``: the initialized torch.distributed
      process group (``group``, default the default group), which must use that backend.
    * ``'mpi'``: mpi4py's ``COMM_WORLD`` (or ``group``, an mpi4py communicator).
    * ``'local'``: one process, world size 1 (refused in a job of several processes: each rank
      would train alone; ``backend=LocalBackend()`` says so on purpose).
    * ``None``: the default process group if torch.distributed is initialized, else ``'local'``
      when the launcher reports a single process; a multi-process launch without an initialized
      process group raises instead of letting ranks train apart.
    """
    group = mesh_group(group)  # a 1-D DeviceMesh: its process group
    if backend is not None:
        return _given(backend, comm_backend_name, cuda_aware)
    name = _checked_name(comm_backend_name, cuda_aware)
    if name == "mpi":
        from .mpi import MPIBackend

        return MPIBackend(comm=group, cuda_aware=cuda_aware)
    if name == "local":
        if group is not None:
            raise ValueError("comm_backend_name='local' takes no process group")
        _refuse_local_in_a_job()
        return LocalBackend()
    if name in _TORCH_DIST_NAMES:
        from .torch_dist import TorchDistBackend

        return TorchDistBackend(group, expected=name)
    # name is None: infer.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .torch_dist import TorchDistBackend

        return TorchDistBackend(group)
    world = _expected_world_size()
    if world > 1:
        raise RuntimeError(
            f"the launcher reports {world} processes but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first, or pass comm_backend_name='mpi'"
        )
    return LocalBackend()
