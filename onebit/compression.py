"""The codec: padding rule, wire layout and byte accounting of the 1-bit compressed all-reduce.

The element-wise maths (sign convention, bit order, scale, error update) is defined by
:mod:`onebit.kernels.reference`; this module says how a bucket is cut and laid out on the wire.

**Padding rule.** A bucket of ``N`` elements on ``n`` ranks is padded with zeros to
``M = padded_length(N, n)``, the smallest multiple of ``8 * n`` that is ``>= N``, so that every
rank's chunk (``M / n`` elements) is a whole number of bytes. Padded slots hold zero input, take
part in the scale like any other element, and are never written back to the caller.

**Segments.** A bucket holds several parameter tensors. Each is a *segment*, padded on its own to
``padded_length(numel, n)``, so that every rank's chunk of it is whole bytes; with
``scale_block_size`` a tensor is further cut into blocks of that many elements (rounded up to a
multiple of ``8 n``), each a segment. Every segment has its own scales, worker and server: the
result is what compressing each segment alone would give (DeepSpeed compressed tensor by
tensor). :class:`SegmentLayout` places the segments one after the other in the flat buffer and
gives the *segment table* ``bounds = [0, o_1, ..., M]`` the kernels take.

**Wire layout.** Row ``j`` of the all-to-all carries chunk ``j`` of every segment, in segment
order (``M / (8 n)`` sign bytes), followed by the sender's ``k`` float32 scales (native byte
order), one per segment: ``chunk_bytes(M, n) + 4 k`` bytes. The all-to-all sends ``n`` such rows
(all with the same worker scales); the all-gather sends one row (the server chunks and their
server scales). So one compressed all-reduce is two collective calls, whatever the number of
parameter tensors in the bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "SCALE_BYTES",
    "SegmentLayout",
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


def row_bytes(padded: int, world_size: int, segments: int = 1) -> int:
    """Bytes of one wire row: the chunk's sign bytes plus one float32 scale per segment."""
    return chunk_bytes(padded, world_size) + SCALE_BYTES * segments


def write_scale_(rows: torch.Tensor, scales: torch.Tensor) -> None:
    """Write the ``k`` float32 ``scales`` (a ``(k,)`` or 0-d tensor) into the last ``4 k`` bytes of
    every row of ``rows`` (uint8, 2-d)."""
    scale_bytes = scales.reshape(-1).to(torch.float32).view(torch.uint8)
    width = scale_bytes.numel()
    rows[:, -width:].copy_(scale_bytes.expand(rows.shape[0], width))


def read_scales(rows: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """The float32 scales stored in the last ``4 k`` bytes of each row (a new ``(n, k)`` tensor)."""
    width = SCALE_BYTES * segments
    tail = rows[:, -width:].clone(memory_format=torch.contiguous_format)
    return tail.view(torch.float32).reshape(rows.shape[0], segments)


def compressed_wire_bytes(padded: int, world_size: int, segments: int = 1) -> int:
    """Bytes one rank sends in one compressed all-reduce of ``padded`` elements in ``segments``.

    All-to-all: ``n - 1`` rows leave the rank; all-gather: its row goes to ``n - 1`` peers. In
    total ``2 (n-1) / n * M / 8`` sign bytes plus ``8 (n-1) k`` scale bytes.
    """
    n = world_size
    return 2 * (n - 1) * row_bytes(padded, n, segments)


@dataclass(frozen=True)
class SegmentLayout:
    """Where the tensors of a bucket, and their segments, lie in its flat padded buffer.

    ``starts[t]`` is where tensor ``t`` begins; its ``numels[t]`` elements are contiguous there,
    followed by the padding of its last segment. ``edges`` are the segment boundaries
    ``[0, o_1, ..., M]`` (the kernels' segment table, which :class:`onebit.collectives.CompressionState`
    holds as a tensor); ``padded`` the buffer's length.
    """

    numels: tuple[int, ...]
    world_size: int
    scale_block_size: int | None
    starts: tuple[int, ...]
    edges: tuple[int, ...]

    @classmethod
    def build(cls, numels: Sequence[int], world_size: int, scale_block_size: int | None = None) -> SegmentLayout:
        """Lay out tensors of ``numels`` elements: one segment per tensor, or with
        ``scale_block_size`` one per block of that many elements (rounded up to a multiple of
        ``8 n``, so that only a tensor's last block is padded and the tensor stays contiguous)."""
        n = world_size
        unit = 8 * n
        block = None if scale_block_size is None else -(-scale_block_size // unit) * unit
        starts, edges, offset = [], [0], 0
        for numel in numels:
            starts.append(offset)
            rest = numel
            while True:
                piece = rest if block is None else min(rest, block)
                offset += padded_length(piece, n)
                edges.append(offset)
                rest -= piece
                if rest <= 0:
                    break
        return cls(tuple(numels), n, scale_block_size, tuple(starts), tuple(edges))

    @property
    def padded(self) -> int:
        return self.edges[-1]

    @property
    def segments(self) -> int:
        return len(self.edges) - 1

    def slices(self) -> list[slice]:
        """Each tensor's place in the flat buffer."""
        return [slice(s, s + numel) for s, numel in zip(self.starts, self.numels)]


def allreduce_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) all-reduce of ``nbytes``: ``2(n-1)/n``."""
    n = world_size
    return (2 * (n - 1) * nbytes) // n
