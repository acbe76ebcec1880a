"""A transport for a single process (world size 1): every collective is a copy."""

from __future__ import annotations

import torch

from .base import CommBackend

__all__ = ["LocalBackend"]


class LocalBackend(CommBackend):
    """World size 1. The compressed all-reduce still runs (with its error feedback), so a
    single-process run follows the same numerics as one rank of a distributed run."""

    name = "local"

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        return output.copy_(input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        return output.copy_(input.reshape(output.shape))

    def barrier(self) -> None:
        return None
