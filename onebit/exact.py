"""The exact float32 mean as an all-reduce state: ``compression="none"``, the twin that a 1-bit
all-reduce is measured against.

It follows the protocol of :class:`onebit.collectives.AllreduceState` (the stages
:func:`~onebit.collectives.start_worker_` → :func:`~onebit.collectives.start_server_` →
:func:`~onebit.collectives.finish_`), so an optimizer uses it where it would use the compressed
all-reduce, with the same buckets, keep masks and statistics: stage 1 starts a float32 all-reduce
of the buffer (``2 (n - 1) / n * 4`` bytes per element), stage 2 has nothing to do, stage 3 waits
and applies the keep mask. No error feedback: its errors are empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .backends.base import COMPLETED, CommBackend, Pending
from .collectives import AllreduceState
from .kernels import KernelSet
from .kernels.reference import unpack_signs

__all__ = ["ExactAverage"]


class ExactAverage(AllreduceState):
    """The float32 mean of a buffer over the ranks, in place, through the stages of the compressed
    all-reduce; not stageable (``overlap_backward``)."""

    def __init__(self, padded: int, world_size: int, device: torch.device | str, edges: Sequence[int]) -> None:
        super().__init__(padded, world_size, edges)
        self.worker_error = torch.zeros(0, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(0, dtype=torch.float32, device=device)
        self._averaged: torch.Tensor | None = None

    def check(self, buffer: torch.Tensor, backend: CommBackend | None, staged: bool) -> None:
        if staged:
            raise ValueError("the exact average (compression='none') cannot be staged: pass overlap_backward=False")
        if backend is not None and backend.world_size != self.world_size:
            raise ValueError(f"state was built for world size {self.world_size}, backend has {backend.world_size}")
        super().check(buffer, backend, staged)

    def start_worker(self, buffer: torch.Tensor, backend: CommBackend | None, kernels: KernelSet, staged: bool,
                     codec: dict[str, Any]) -> Pending:
        self._averaged = buffer
        return backend.start_all_reduce_mean_(buffer)

    def start_server(self, backend: CommBackend | None, kernels: KernelSet, staged: bool) -> Pending:
        return COMPLETED

    def finish(self, buffer: torch.Tensor, kernels: KernelSet, keep: torch.Tensor | None,
               codec: dict[str, Any]) -> None:
        averaged, self._averaged = self._averaged, None
        if averaged is not buffer:
            buffer.copy_(averaged)
        if keep is not None:
            buffer.masked_fill_(unpack_signs(keep)[:self.padded] < 0, 0.0)

    def error_slices(self, start: int, end: int) -> list[torch.Tensor]:
        return []

    def health_input(self, buffer: torch.Tensor, multiplier: torch.Tensor | None = None,
                     bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        return torch.zeros_like(buffer), buffer, self.sizes()
