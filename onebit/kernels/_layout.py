"""Argument checks and memory layouts shared by the native kernel wrappers (CPU and CUDA).

Native kernels read and write raw memory, so their wrappers check what the reference would only
fail on later (dtype, device, lengths) and describe each byte tensor as *rows*: byte ``i`` lives at
``base + (i // row_len) * row_stride + i % row_len``. That covers a contiguous buffer (one row) and
the ``(n, C)`` views of a ``(n, C + 4)`` wire buffer that :mod:`onebit.collectives` passes; any
other layout goes through a contiguous temporary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ByteRows:
    """A uint8 tensor as rows of bytes; ``tensor`` is what the kernel reads or writes."""

    tensor: torch.Tensor
    row_len: int
    row_stride: int
    original: torch.Tensor | None = None  # set when ``tensor`` is a temporary to copy back

    def finish_(self) -> None:
        """Copy a temporary output back into the caller's tensor."""
        if self.original is not None:
            self.original.copy_(self.tensor.view(self.original.shape))


def byte_rows(t: torch.Tensor, *, output: bool) -> ByteRows:
    """Describe ``t`` (uint8) as rows; a layout the kernels cannot address becomes a temporary."""
    if t.dim() == 1 and t.stride(0) == 1:
        return ByteRows(t, max(t.numel(), 1), max(t.numel(), 1))
    if t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1) and t.shape[1] > 0:
        return ByteRows(t, t.shape[1], t.stride(0) if t.shape[0] > 1 else t.shape[1])
    if output:
        return ByteRows(torch.empty(t.numel(), dtype=torch.uint8, device=t.device), max(t.numel(), 1),
                        max(t.numel(), 1), original=t)
    rows = t.reshape(-1, t.shape[-1] if t.dim() == 2 else max(t.numel(), 1)).contiguous()
    return ByteRows(rows, max(rows.shape[1], 1), max(rows.shape[1], 1))


def flat_float(t: torch.Tensor) -> torch.Tensor:
    """A contiguous flat view of ``t`` (or a contiguous copy when ``t`` has gaps)."""
    return t.reshape(-1) if t.is_contiguous() else t.reshape(-1).contiguous()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_bounds(bounds: torch.Tensor | None, total: int, unit: int, what: str) -> tuple[torch.Tensor, list[int]]:
    """Validate a segment table (``None``: one segment) over ``total`` elements whose segments are
    multiples of ``unit`` (``8 n``). Return it as a contiguous int64 CPU tensor and as a list.

    A segment table is host metadata (the kernels index memory with it): it must be a CPU tensor,
    also for CUDA buffers (the CUDA kernels keep their own device copy of each table they see)."""
    if bounds is None:
        return torch.tensor([0, total], dtype=torch.int64), [0, total]
    _require(isinstance(bounds, torch.Tensor) and bounds.dtype == torch.int64 and bounds.dim() == 1
             and bounds.numel() >= 2 and bounds.device.type == "cpu",
             f"{what}: bounds must be a 1-d int64 CPU tensor [0, ..., {total}] of at least 2 entries, got "
             f"{getattr(bounds, 'dtype', type(bounds).__name__)} {tuple(getattr(bounds, 'shape', ()))} on "
             f"{getattr(bounds, 'device', '?')}")
    edges = bounds.tolist()
    _require(edges[0] == 0 and edges[-1] == total,
             f"{what}: bounds must run from 0 to {total}, got {edges[0]} .. {edges[-1]}")
    bad = [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b <= a or (b - a) % unit]
    _require(not bad, f"{what}: every segment must be a positive multiple of {unit} elements, got {bad[:3]}")
    return bounds.contiguous(), edges


def claimed_segments(bounds: torch.Tensor | None) -> int:
    """The number of segments a table claims, for checking ``scales`` before the table itself is
    checked (:func:`check_bounds`)."""
    return bounds.numel() - 1 if isinstance(bounds, torch.Tensor) and bounds.numel() > 1 else 1


def check_limit(limit: float | None, multiplier: torch.Tensor | None) -> None:
    """``worker_compress_``'s ``limit``: None, or a number > 0 (NaN refused) given with a ``multiplier``."""
    if limit is None:
        return
    _require(isinstance(limit, (int, float)) and not isinstance(limit, bool)
             and 0 < limit <= torch.finfo(torch.float32).max,
             f"worker_compress_: limit must be a number > 0 that float32 holds (the clamp of x * multiplier), "
             f"got {limit!r}")
    _require(multiplier is not None, "worker_compress_: limit clamps x * multiplier; give a multiplier with it")


def check_divisor(multiplier: torch.Tensor | None, divisor: torch.Tensor | None) -> None:
    """decode_ takes a ``multiplier`` or a ``divisor``, not both."""
    _require(multiplier is None or divisor is None, "decode_ takes a multiplier or a divisor, not both")


def check_worker(x: torch.Tensor, error: torch.Tensor, packed: torch.Tensor, device_type: str,
                 error_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    """Validate worker arguments (``error`` of one of ``error_dtypes``); return the element count."""
    n = x.numel()
    _require(x.dtype == torch.float32 and error.dtype in error_dtypes,
             f"worker_compress_ needs float32 x and an error of {' or '.join(map(str, error_dtypes))}, got {x.dtype} "
             f"and {error.dtype}")
    _require(error.numel() == n, f"worker_compress_: error has {error.numel()} elements, x has {n}")
    _require(n % 8 == 0, f"worker_compress_ needs a length that is a multiple of 8, got {n}")
    _require(packed.dtype == torch.uint8 and packed.numel() * 8 == n,
             f"worker_compress_: packed must be uint8 with {n // 8} bytes, got {packed.dtype} with {packed.numel()}")
    _require(x.device.type == error.device.type == packed.device.type == device_type,
             f"these kernels run on {device_type!r} tensors, got x on {x.device}, error on {error.device}, "
             f"packed on {packed.device}")
    return n


def check_server(signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor, packed: torch.Tensor,
                 device_type: str, segments: int = 1, error_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    """Validate server arguments (``scales``: ``(n, segments)`` values; ``error`` of one of
    ``error_dtypes``); return the chunk length in elements."""
    _require(signs.dim() == 2 and signs.dtype == torch.uint8,
             f"server_compress_: signs must be a 2-d uint8 tensor (n, L/8), got {signs.dtype} {tuple(signs.shape)}")
    nrows, cols = signs.shape
    n = error.numel()
    _require(nrows >= 1, "server_compress_: signs needs at least one row")
    _require(cols * 8 == n, f"server_compress_: signs rows hold {cols * 8} elements, error has {n}")
    _require(scales.dtype == torch.float32 and scales.numel() == nrows * segments,
             f"server_compress_: scales must be float32 with {nrows * segments} elements ({nrows} ranks x "
             f"{segments} segments), got {scales.dtype} with {scales.numel()}")
    _require(error.dtype in error_dtypes,
             f"server_compress_: error must be {' or '.join(map(str, error_dtypes))}, got {error.dtype}")
    _require(packed.dtype == torch.uint8 and packed.numel() == cols,
             f"server_compress_: packed must be uint8 with {cols} bytes, got {packed.dtype} with {packed.numel()}")
    _require(signs.device.type == scales.device.type == error.device.type == packed.device.type == device_type,
             f"these kernels run on {device_type!r} tensors")
    return n


def check_decode(signs: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, device_type: str,
                 keep: torch.Tensor | None = None, segments: int = 1) -> None:
    """Validate decode arguments (``scales``: ``(n, segments)`` values)."""
    if keep is not None:
        _require(keep.dtype == torch.uint8 and keep.is_contiguous() and keep.numel() * 8 == out.numel()
                 and keep.device == out.device,
                 f"decode_: keep must be contiguous packed uint8 bits, {out.numel() // 8} bytes on {out.device}, got "
                 f"{keep.dtype} with {keep.numel()} elements on {keep.device}")
    _require(signs.dim() == 2 and signs.dtype == torch.uint8,
             f"decode_: signs must be a 2-d uint8 tensor (n, L/8), got {signs.dtype} {tuple(signs.shape)}")
    nrows, cols = signs.shape
    _require(scales.dtype == torch.float32 and scales.numel() == nrows * segments,
             f"decode_: scales must be float32 with {nrows * segments} elements ({nrows} ranks x {segments} "
             f"segments), got {scales.dtype} with {scales.numel()}")
    _require(out.dtype == torch.float32 and out.numel() == nrows * cols * 8,
             f"decode_: out must be float32 with {nrows * cols * 8} elements, got {out.dtype} with {out.numel()}")
    _require(signs.device.type == scales.device.type == out.device.type == device_type,
             f"these kernels run on {device_type!r} tensors")
