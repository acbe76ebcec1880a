"""Transport over a torch.distributed process group (gloo, NCCL, HCCL, or any other).

One code path for every process-group backend: only ``all_reduce``, ``all_to_all_single`` and
``all_gather_into_tensor``, with the device taken from the tensors. Nothing here assumes CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .base import CommBackend, Pending

__all__ = ["TorchDistBackend"]

# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistBackend(CommBackend):
    """Collectives on ``group`` (default: the default process group).

    ``expected`` (``"gloo"``, ``"nccl"``, ``"hccl"``) is the ``comm_backend_name`` the user asked
    for; when given, the process group must use that backend, so that a config saying ``nccl``
    never runs silently on another transport.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, expected: str | None = None) -> None:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this build of torch")
        if not dist.is_initialized():
            wanted = expected or "gloo"
            raise RuntimeError(
                "torch.distributed is not initialized; call "
                f"torch.distributed.init_process_group(backend={wanted!r}) before creating the "
                "optimizer (under torchrun the environment provides rank, world size and address), "
                "or pass comm_backend_name='local' for a single process"
            )
        self._group = group
        actual = str(dist.get_backend(group)).lower()
        if expected is not None and expected not in actual:
            raise ValueError(
                f"comm_backend_name={expected!r} but the process group uses {actual!r}; pass "
                f"comm_backend_name={actual.split(':')[-1]!r} or initialize the process group with "
                f"backend={expected!r}"
            )
        self.name = expected or actual
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        # SUM then divide: ReduceOp.AVG is not implemented by every process-group backend.
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group)
        return tensor.div_(self._world_size)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        dist.all_to_all_single(output, input, group=self._group)
        return output

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        _all_gather_single(self._concatenated(output), input, group=self._group)
        return output

    def start_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        return dist.all_to_all_single(output, input, group=self._group, async_op=True)

    def start_all_reduce_mean_(self, tensor: torch.Tensor) -> Pending:
        return _Mean(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group, async_op=True), tensor,
                     self._world_size)

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        return _all_gather_single(self._concatenated(output), input, group=self._group, async_op=True)

    @staticmethod
    def _concatenated(output: torch.Tensor) -> torch.Tensor:
        """Some process groups (gloo) want an all-gather's output as a concatenation along dim 0, not a stack."""
        return output.view(output.shape[0] * output.shape[1], *output.shape[2:]) if output.dim() > 1 else output

    def barrier(self) -> None:
        dist.barrier(group=self._group)


class _Mean:
    """An all-reduce sum in flight; ``wait()`` divides by the world size once it is complete, as
    :meth:`TorchDistBackend.all_reduce_mean_` does."""

    def __init__(self, work: Any, tensor: torch.Tensor, world_size: int) -> None:
        self._work: Any = work
        self._tensor, self._world_size = tensor, world_size

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._tensor.div_(self._world_size)
