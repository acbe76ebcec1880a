"""The codec: padding rule, wire layout and byte accounting of the 1-bit compressed all-reduce.

The element-wise maths (sign convention, bit order, scale, error update) is defined by
:mod:`onebit.kernels.reference`; this module says how a bucket is cut and laid out on the wire.

**Padding rule.** A bucket of ``N`` elements on ``n`` ranks is padded with zeros to
``M = padded_length(N, n)``, the smallest multiple of ``8 * n`` that is ``>= N``, so that every
rank's chunk (``M / n`` elements) is a whole number of bytes. Padded slots hold zero input, take
part in the scale like any other element, and are never written back to the caller.

**Wire layout.** A packed chunk travels as one uint8 row of ``chunk_bytes(M, n) + 4`` bytes: the
``M / (8 n)`` sign bytes followed by the sender's float32 scale (native byte order). The
all-to-all sends ``n`` such rows (one per destination, all with the same worker scale); the
all-gather sends one row (the server chunk and its server scale). So one compressed all-reduce is
two collective calls, whatever the number of parameter tensors in the bucket.
"""

from __future__ import annotations

import torch

__all__ = [
    "SCALE_BYTES",
    "padded_length",
    "chunk_bytes",
    "row_bytes",
    "write_scale_",
    "read_scales",
    "compressed_wire_bytes",
    "allreduce_wire_bytes",
]

SCALE_BYTES = 4  # one float32 per row


def padded_length(numel: int, world_size: int) -> int:
    """Smallest multiple of ``8 * world_size`` that is at least ``numel`` (and at least one unit)."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"padded_length needs numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    unit = 8 * world_size
    return max(unit, -(-numel // unit) * unit)


def chunk_bytes(padded: int, world_size: int) -> int:
    """Sign bytes in one rank's chunk of a padded buffer."""
    return padded // (8 * world_size)


def row_bytes(padded: int, world_size: int) -> int:
    """Bytes of one wire row: the chunk's sign bytes plus its float32 scale."""
    return chunk_bytes(padded, world_size) + SCALE_BYTES


def write_scale_(rows: torch.Tensor, scale: torch.Tensor) -> None:
    """Write a 0-d float32 ``scale`` into the last 4 bytes of every row of ``rows`` (uint8, 2-d)."""
    scale_bytes = scale.reshape(1).to(torch.float32).view(torch.uint8)
    rows[:, -SCALE_BYTES:].copy_(scale_bytes.expand(rows.shape[0], SCALE_BYTES))


def read_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales stored in the last 4 bytes of each row (a new ``(n,)`` tensor)."""
    return rows[:, -SCALE_BYTES:].clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(-1)


def compressed_wire_bytes(padded: int, world_size: int) -> int:
    """Bytes one rank sends in one compressed all-reduce of ``padded`` elements.

    All-to-all: ``n - 1`` rows leave the rank; all-gather: its row goes to ``n - 1`` peers. In
    total ``2 (n-1) / n * M / 8`` sign bytes plus ``8 (n-1)`` scale bytes.
    """
    n = world_size
    return 2 * (n - 1) * row_bytes(padded, n)


def allreduce_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) all-reduce of ``nbytes``: ``2(n-1)/n``."""
    n = world_size
    return (2 * (n - 1) * nbytes) // n
