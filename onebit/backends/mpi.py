"""Transport over MPI through mpi4py: no torch.distributed needed.

Only MPI's own collectives (``Allreduce``, ``Alltoall``, ``Allgather``, ``Barrier``, and the
nonblocking ``Ialltoall``/``Iallgather`` that let the compressed all-reduce of one bucket overlap
the codec of the next) on one communicator. Where the bytes live decides how they reach MPI:

* **CPU tensors** go to MPI as zero-copy numpy views of their memory.
* **Device tensors, ``cuda_aware=True``**: CUDA buffers are handed to MPI directly (mpi4py reads
  DLPack / ``__cuda_array_interface__``), after the stream that produced them is synchronized.
  The MPI library must be CUDA-aware (e.g. Open MPI built with UCX/CUDA, MVAPICH2-GDR).
* **Device tensors, ``cuda_aware=False``**: staged through pinned host buffers (allocated once per
  size and reused), then copied back to the device; their collectives are never left in flight.

mpi4py is imported when the backend is built, never at ``import onebit``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from .base import COMPLETED, CommBackend, Pending

logger = logging.getLogger(__name__)

__all__ = ["MPIBackend", "import_mpi", "check_not_a_stray_singleton"]

_INSTALL_HINT = (
    'install it with  pip install "onebit[mpich]"  on a machine without MPI (brings mpi4py and MPICH '
    'from its wheel), or  pip install "onebit[mpi]"  on a cluster (mpi4py only, built against the '
    "cluster's own MPI: load the MPI module first so that mpi4py finds its mpicc)"
)

# float dtypes MPI reduces natively; others are reduced in float32 (see all_reduce_mean_).
_REDUCE_TYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE"}


def import_mpi() -> Any:
    """Return ``mpi4py.MPI``, or raise an ImportError that says what to install.

    Two failures are turned into that ImportError, with the original exception as its cause:
    mpi4py not installed, and mpi4py installed but no MPI library it can load.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(f"comm_backend_name='mpi' needs mpi4py, which is not installed; {_INSTALL_HINT}") from exc
    except (RuntimeError, OSError) as exc:
        # mpi4py >= 4 raises RuntimeError("cannot load MPI library ...") when no libmpi is found.
        raise ImportError(
            f"mpi4py is installed but cannot load an MPI library ({str(exc).splitlines()[0]}); {_INSTALL_HINT}"
        ) from exc
    return MPI


def check_not_a_stray_singleton(world_size: int, environ: Mapping[str, str]) -> None:
    """Refuse a one-process MPI world inside a multi-process launch that is not MPI's (torchrun
    sets ``WORLD_SIZE``): every process would be its own world and the ranks would train apart."""
    launched = environ.get("WORLD_SIZE", "")
    if world_size == 1 and launched.isdigit() and int(launched) > 1:
        raise RuntimeError(
            f"comm_backend_name='mpi' but MPI sees a single process while the launcher reports "
            f"WORLD_SIZE={launched}: launch with  mpiexec -n {launched} python -m mpi4py script.py, "
            "or keep torchrun and use comm_backend_name='gloo' or 'nccl'"
        )


class _Request:
    """An MPI request and the buffers it reads and writes, kept alive until it completes."""

    def __init__(self, request: Any, buffers: tuple[Any, ...]) -> None:
        self._request = request
        self._buffers = buffers

    def wait(self) -> None:
        self._request.Wait()
        self._buffers = ()


class MPIBackend(CommBackend):
    """Collectives on an mpi4py communicator (default ``MPI.COMM_WORLD``).

    Args:
        comm: an ``mpi4py.MPI.Intracomm`` holding the data-parallel ranks, e.g. a
            sub-communicator from ``COMM_WORLD.Split``. Collectives are issued on it directly.
        cuda_aware: hand CUDA buffers straight to MPI (the MPI library must be CUDA-aware).
            With ``False``, device tensors are staged through pinned host memory. CPU tensors
            never need either.

    Launch with ``mpiexec -n N python -m mpi4py train.py``: ``-m mpi4py`` aborts the whole job
    when one rank raises, instead of leaving the others waiting in a collective.
    """

    name = "mpi"

    def __init__(self, comm: Any = None, *, cuda_aware: bool = False) -> None:
        if not isinstance(cuda_aware, bool):
            raise TypeError(f"cuda_aware must be True or False, got {cuda_aware!r}")
        MPI = import_mpi()
        if comm is None:
            comm = MPI.COMM_WORLD
            check_not_a_stray_singleton(comm.Get_size(), os.environ)
        if not isinstance(comm, MPI.Comm):
            raise TypeError(
                f"comm (group=) for comm_backend_name='mpi' must be an mpi4py communicator, got "
                f"{type(comm).__name__}; pass e.g. MPI.COMM_WORLD.Split(color, key), or leave it None"
            )
        if comm == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL: this process is not in the data-parallel communicator")
        if comm.Is_inter():
            raise ValueError("comm is an inter-communicator; pass an intra-communicator (e.g. from Split)")
        self._MPI = MPI
        self._comm = comm
        self._rank = comm.Get_rank()
        self._world_size = comm.Get_size()
        self.cuda_aware = cuda_aware
        self._staging: dict[tuple[str, torch.device, int], torch.Tensor] = {}
        self._pinned = True

    @property
    def comm(self) -> Any:
        """The mpi4py communicator in use."""
        return self._comm

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # ----------------------------------------------------------------- buffers

    def _host_staging(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like ``like``, from a pinned byte buffer cached by (role, size)."""
        nbytes = like.numel() * like.element_size()
        key = (role, like.device, nbytes)
        raw = self._staging.get(key)
        if raw is None:
            if self._pinned:
                try:
                    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                except RuntimeError as exc:  # no pinned-memory allocator for this accelerator
                    self._pinned = False
                    logger.info("onebit: pinned host memory unavailable (%s); staging through pageable memory", exc)
            if raw is None:
                raw = torch.empty(nbytes, dtype=torch.uint8)
            self._staging[key] = raw
        return raw.view(like.dtype).view(like.shape)

    def _check(self, tensor: torch.Tensor, what: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError(f"{what} must be contiguous (MPI writes into its memory); call .contiguous() first")

    def _direct(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes to MPI without a host copy (CPU, or CUDA with ``cuda_aware``)."""
        kind = tensor.device.type
        if kind == "cpu":
            return True
        if not self.cuda_aware:
            return False
        if kind != "cuda":
            raise ValueError(
                f"cuda_aware=True hands CUDA buffers to MPI, but this tensor is on {tensor.device}; "
                "use cuda_aware=False to stage it through host memory"
            )
        # MPI reads the memory now, outside torch's stream order: wait for the kernels that wrote it.
        torch.cuda.current_stream(tensor.device).synchronize()
        return True

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> Any:
        """The tensor's memory as a flat uint8 buffer MPI can use: numpy view on CPU, else the tensor."""
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        return flat.numpy() if flat.device.type == "cpu" else flat

    @staticmethod
    def _values(tensor: torch.Tensor) -> Any:
        flat = tensor.detach().reshape(-1)
        return flat.numpy() if flat.device.type == "cpu" else flat

    # ----------------------------------------------------------------- collectives

    def all_reduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check(tensor, "all_reduce_mean_ tensor")
        if not tensor.is_floating_point():
            raise TypeError(f"all_reduce_mean_ needs a floating-point tensor, got {tensor.dtype}")
        if tensor.numel() == 0:
            return tensor
        MPI = self._MPI
        mpi_type = _REDUCE_TYPES.get(tensor.dtype)
        # float16/bfloat16 have no portable MPI type: sum in float32 and round once at the end.
        work = tensor if mpi_type is not None else tensor.to(torch.float32)
        datatype = getattr(MPI, mpi_type or "FLOAT")
        if self._direct(work):
            self._comm.Allreduce(MPI.IN_PLACE, [self._values(work), datatype], op=MPI.SUM)
        else:
            host = self._host_staging("reduce", work)
            host.copy_(work)
            self._comm.Allreduce(MPI.IN_PLACE, [self._values(host), datatype], op=MPI.SUM)
            work.copy_(host)
        if work is not tensor:
            tensor.copy_(work)
        # SUM then divide in torch, exactly as the torch.distributed backend does.
        return tensor.div_(self._world_size)

    def _check_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._check(output, "all_to_all output")
        self._check(input, "all_to_all input")
        n = self._world_size
        if input.dim() == 0 or input.shape[0] != n or output.shape != input.shape or output.dtype != input.dtype:
            raise ValueError(
                f"all_to_all needs input and output of the same dtype and shape (world_size={n}, ...), got "
                f"input {input.dtype} {tuple(input.shape)} and output {output.dtype} {tuple(output.shape)}"
            )

    def _check_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._check(output, "all_gather output")
        self._check(input, "all_gather input")
        n = self._world_size
        if tuple(output.shape) != (n, *input.shape) or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather needs output of shape (world_size={n}, *input.shape) and the input's dtype, got "
                f"input {input.dtype} {tuple(input.shape)} and output {output.dtype} {tuple(output.shape)}"
            )

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        self._check_all_to_all(output, input)
        return self._exchange(self._comm.Alltoall, output, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        self._check_all_gather(output, input)
        return self._exchange(self._comm.Allgather, output, input)

    def start_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        self._check_all_to_all(output, input)
        return self._start(self._comm.Ialltoall, self._comm.Alltoall, output, input)

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        self._check_all_gather(output, input)
        return self._start(self._comm.Iallgather, self._comm.Allgather, output, input)

    def _start(self, icollective: Any, collective: Any, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """A nonblocking collective on buffers MPI can use directly; staged tensors share the host
        staging buffers, so their collective runs to completion now."""
        if output.numel() == 0 or not (self._direct(input) and self._direct(output)):
            self._exchange(collective, output, input)
            return COMPLETED
        send, recv = self._bytes(input), self._bytes(output)
        return _Request(icollective(send, recv), (send, recv))

    def _exchange(self, collective: Any, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """Run a byte-moving collective (any dtype travels as its bytes)."""
        if output.numel() == 0:
            return output
        direct_in, direct_out = self._direct(input), self._direct(output)
        send = input if direct_in else self._host_staging("send", input).copy_(input)
        recv = output if direct_out else self._host_staging("recv", output)
        collective(self._bytes(send), self._bytes(recv))
        if not direct_out:
            output.copy_(recv)
        return output

    def barrier(self) -> None:
        self._comm.Barrier()
