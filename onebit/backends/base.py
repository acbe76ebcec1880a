"""The transport protocol: the few collectives the optimizer and the compressed all-reduce need.

A backend moves bytes and floats between ranks and knows nothing of compression. Every rank
must call the same methods in the same order with tensors of the same shapes and dtypes.
"""

from __future__ import annotations

import abc
from typing import Protocol

import torch

__all__ = ["CommBackend", "Pending", "COMPLETED"]


class Pending(Protocol):
    """A collective in flight: ``wait()`` returns once its output is complete."""

    def wait(self) -> object: ...


class _Completed:
    def wait(self) -> None:
        return None


#: the handle of a collective that already ran to completion
COMPLETED: Pending = _Completed()


class CommBackend(abc.ABC):
    """Abstract transport. Subclass it to plug in a custom transport (``OnebitAdam(backend=...)``).

    Tensors are contiguous and live on the device of the data being reduced; a backend takes the
    device from the tensors it is given and never assumes CUDA or CPU.
    """

    #: short name used in logs and statistics
    name: str = "custom"

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in the data-parallel group, ``0 <= rank < world_size``."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the data-parallel group."""

    @abc.abstractmethod
    def all_reduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` (floating point) by its element-wise mean over ranks; return it."""

    @abc.abstractmethod
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """Row ``j`` of ``input`` (shape ``(n, ...)``) goes to rank ``j``; row ``i`` of ``output``
        is what rank ``i`` sent here. Returns ``output``."""

    @abc.abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """``output`` (shape ``(n, *input.shape)``) receives ``input`` of every rank, rank order."""

    def start_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """Begin :meth:`all_to_all` and return its handle; ``output`` holds the result after the
        handle's ``wait()``, and neither tensor may be touched before. Every rank starts its
        collectives in the same order. Transports that can overlap the transfer with computation
        override this; the default runs the collective now."""
        self.all_to_all(output, input)
        return COMPLETED

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """Begin :meth:`all_gather`; as :meth:`start_all_to_all`."""
        self.all_gather(output, input)
        return COMPLETED

    def start_all_reduce_mean_(self, tensor: torch.Tensor) -> Pending:
        """Begin :meth:`all_reduce_mean_`; ``tensor`` holds the mean after the handle's ``wait()``
        (the same values as :meth:`all_reduce_mean_`), as :meth:`start_all_to_all`."""
        self.all_reduce_mean_(tensor)
        return COMPLETED

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, world_size={self.world_size})"
