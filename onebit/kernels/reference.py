"""Pure-torch reference kernels: the definition every native kernel must equal bit for bit.

Conventions (fixed; changing any of them changes the wire format):

* **Sign.** ``q = -1`` where ``b < 0``, else ``q = +1``. Zero, ``-0.0`` and NaN give ``+1``
  (NaN never reaches the codec in normal use: the optimizer refuses or skips non-finite steps).
* **Bits.** A set bit means ``+1``, a clear bit ``-1``. Eight consecutive elements form one byte,
  the first element in the most significant bit (numpy ``packbits`` order, as DeepSpeed used).
* **Scale.** ``s = sqrt(sum(b_i ** 2) / len(b))`` with the squares summed in float64 in a fixed
  blocked order (:mod:`onebit.kernels.blocked`) and the result rounded once to float32: the RMS of
  the buffer, so that ``s * q`` has the norm of ``b``.
* **Error update.** ``e <- b - s * q``, in float32 (``s * q`` is exactly ``+s`` or ``-s``).
* **Server sum.** ``c = (s_0 q_0 + s_1 q_1 + ... + s_{n-1} q_{n-1}) / n + e``, accumulated in rank
  order, divided by ``n`` in float32 (a true division, not a multiplication by ``1/n``), then the
  server error added.

* **Segments.** A buffer of ``M`` elements is cut into ``k`` segments by its *segment table*
  ``bounds = [0, o_1, ..., o_{k-1}, M]`` (int64; ``None`` means one segment), each segment a
  multiple of ``8 n`` elements for ``n`` ranks: a parameter tensor (or a block of one) padded on
  its own. Every segment has its own scale, on the worker and on the server, exactly as if it
  were compressed alone; chunk ``j`` of segment ``i`` (``L_i = (o_{i+1} - o_i) / n`` elements)
  travels in wire row ``j`` at element offset ``o_i / n``, so row ``j`` holds chunk ``j`` of every
  segment in segment order (``M / (8 n)`` bytes) and the server's chunk has the segment table
  ``bounds / n``.

All functions take flat float32 tensors on any device; ``packed`` tensors are uint8 with one eighth
of the elements, written in row-major order (they may be strided views, e.g. rows of a send buffer).
Scales are returned as a ``(k,)`` float32 tensor and read as ``(n, k)`` (row ``r``: rank ``r``'s
scale of each segment).
"""

from __future__ import annotations

import torch

from ._layout import check_divisor, check_limit
from .blocked import blocked_rms_scale

__all__ = ["pack_signs", "unpack_signs", "rms_scale", "segment_bounds", "worker_compress_", "server_compress_", "decode_"]

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS_CACHE.get(device)
    if shifts is None:
        shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
        _SHIFTS_CACHE[device] = shifts
    return shifts


def pack_signs(b: torch.Tensor) -> torch.Tensor:
    """Pack the signs of a float tensor (length a multiple of 8) into bytes, MSB first."""
    bits = torch.logical_not(b.reshape(-1, 8) < 0).to(torch.uint8)
    return (bits << _shifts(b.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes into float32 ``+1``/``-1`` values, 8 per byte, MSB first (inverse of pack)."""
    bits = (packed.reshape(-1, 1) >> _shifts(packed.device)) & 1
    return bits.reshape(-1).to(torch.float32).mul_(2).sub_(1)


def rms_scale(b: torch.Tensor) -> torch.Tensor:
    """``sqrt(sum(b**2) / len(b))`` with the squares summed in float64 in the fixed blocked order
    of :mod:`onebit.kernels.blocked`, rounded once to float32 (0-d tensor). A fixed order makes
    the scale one number on every device, thread count and vector width."""
    return blocked_rms_scale(b)


def _sign_values(b: torch.Tensor) -> torch.Tensor:
    return torch.where(b < 0, -1.0, 1.0).to(torch.float32)


def segment_bounds(bounds: torch.Tensor | None, total: int) -> list[int]:
    """The segment boundaries as a list ``[0, o_1, ..., total]`` (``None``: one segment)."""
    if bounds is None:
        return [0, total]
    return [int(b) for b in bounds.tolist()]


def worker_compress_(x: torch.Tensor, error: torch.Tensor, packed: torch.Tensor, *,
                     bounds: torch.Tensor | None = None, error_out: torch.Tensor | None = None,
                     multiplier: torch.Tensor | None = None, limit: float | None = None) -> torch.Tensor:
    """Worker side: for each segment ``b = x + error``; pack ``sign(b)``; ``error <- b - s*sign(b)``.
    Given ``multiplier`` (float32 or bfloat16, read exactly; ``x``'s length), ``b = x * multiplier + error`` instead: a
    multiply and an add, each rounded to float32 (what compressing ``x * multiplier`` gives,
    without writing it). Given ``limit`` (a float32 value > 0, with ``multiplier``),
    ``b = clamp(x * multiplier, -limit, limit) + error`` (a clamp rounds nothing: what compressing
    the clamped product gives; a NaN stays NaN).

    ``x`` and ``error`` are flat, ``M`` elements, cut into segments by ``bounds`` (int64
    ``[0, o_1, ..., M]``; ``None``: one segment), each a multiple of ``8 n`` elements long, where
    ``n`` is the number of rows of ``packed`` (uint8 ``(n, M / (8 n))``; a 1-d ``packed`` is one
    row). Each segment has its own scale ``s_i`` (its RMS) and is cut into ``n`` equal chunks;
    chunk ``j`` of segment ``i`` (``L_i = (o_{i+1} - o_i) / n`` elements) is packed into row ``j``
    at bytes ``o_i / (8 n) ... (o_i / n + L_i) / 8``: row ``j`` holds chunk ``j`` of every
    segment, in segment order. Returns the ``(k,)`` float32 scales.

    ``x`` is left unchanged; ``error`` is updated in place, or, given ``error_out`` (a buffer of
    its own, of ``error``'s shape), left as it is and the new error written there; ``packed`` is
    overwritten.
    """
    rows = packed.reshape(-1, packed.shape[-1]) if packed.dim() == 2 else packed.reshape(1, -1)
    n = rows.shape[0]
    edges = segment_bounds(bounds, x.numel())
    check_limit(limit, multiplier)
    if multiplier is None:
        b = x + error
    else:
        scaled = x * multiplier.reshape(x.shape)
        if limit is not None:
            scaled = scaled.clamp(-limit, limit)
        b = scaled + error
    target = error if error_out is None else error_out
    scales = []
    out = rows.clone()
    for lo, hi in zip(edges[:-1], edges[1:]):
        seg = b[lo:hi]
        scale = rms_scale(seg)
        chunk = (hi - lo) // n
        out[:, lo // (8 * n):(lo // n + chunk) // 8] = pack_signs(seg).view(n, chunk // 8)
        target[lo:hi] = seg - _sign_values(seg) * scale
        scales.append(scale)
    packed.copy_(out.reshape(packed.shape))
    return torch.stack(scales)


def server_compress_(
    signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor, packed: torch.Tensor, *,
    bounds: torch.Tensor | None = None, error_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Server side for one chunk of every segment.

    ``signs`` is ``(n, C)`` uint8 (row ``i`` from rank ``i``, laid out by
    :func:`worker_compress_`), ``scales`` is ``(n, k)`` float32 (row ``i``: rank ``i``'s scale of
    each segment), ``error`` is the ``(8 C,)`` server error, updated in place; ``bounds`` are the
    worker's segment boundaries (``M = 8 n C`` elements; the server's are ``bounds / n``). For each
    segment ``i``: ``c = (sum_r s_ri q_r) / n + error``, packs ``sign(c)`` into ``packed`` (``C``
    bytes, the same positions), sets ``error <- c - s_i sign(c)`` and returns the ``(k,)`` server
    scales ``s_i`` (each the RMS of its segment's ``c``). ``error_out``: as in
    :func:`worker_compress_`.
    """
    n = signs.shape[0]
    edges = [e // n for e in segment_bounds(bounds, error.numel() * n)]
    k = len(edges) - 1
    scales = scales.reshape(n, k)
    values = unpack_signs(signs).view(n, -1)
    out = packed.reshape(-1).clone()
    target = error if error_out is None else error_out
    result = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        acc = values[0, lo:hi] * scales[0, i]
        for r in range(1, n):
            acc += values[r, lo:hi] * scales[r, i]
        # Divide by a tensor: with a Python scalar, torch's CUDA kernel multiplies by 1/n instead.
        c = acc.div_(torch.tensor(float(n), device=acc.device)).add_(error[lo:hi])
        scale = rms_scale(c)
        out[lo // 8:hi // 8] = pack_signs(c)
        target[lo:hi] = c - _sign_values(c) * scale
        result.append(scale)
    packed.copy_(out.reshape(packed.shape))
    return torch.stack(result)


def decode_(signs: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, keep: torch.Tensor | None = None, *,
            bounds: torch.Tensor | None = None, multiplier: torch.Tensor | None = None,
            divisor: torch.Tensor | None = None) -> torch.Tensor:
    """Decode the gathered server chunks: ``signs`` is ``(n, C)`` (row ``j`` from server ``j``),
    ``scales`` ``(n, k)``. For segment ``i`` (``bounds`` as in :func:`worker_compress_`, over
    ``out``'s ``M = 8 n C`` elements), chunk ``j`` is
    ``out[o_i + j L_i : o_i + (j + 1) L_i] = scales[j, i] * q_j[o_i / n : o_i / n + L_i]``.

    ``keep`` (optional): ``M / 8`` bytes of packed bits in the same order as ``out`` (MSB
    first); where a bit is clear the output is ``+0.0`` (a momentum mask, applied in the same
    pass). ``multiplier`` (optional, float32, ``out``'s length): each decoded value is multiplied
    by it, rounded once (what decoding and then multiplying gives, in one pass). ``divisor``
    (optional, instead of ``multiplier``; float32 or bfloat16, read exactly): each decoded value
    divided by it, rounded once, and ``+0.0`` where it is 0."""
    check_divisor(multiplier, divisor)
    n = signs.shape[0]
    edges = segment_bounds(bounds, out.numel())
    k = len(edges) - 1
    scales = scales.reshape(n, k)
    values = unpack_signs(signs).view(n, -1)
    flat = out.view(-1)
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        chunk = (hi - lo) // n
        torch.mul(values[:, lo // n:lo // n + chunk], scales[:, i:i + 1], out=flat[lo:hi].view(n, chunk))
    if multiplier is not None:
        flat.mul_(multiplier.reshape(-1))
    if divisor is not None:
        flat.div_(divisor.reshape(-1)).masked_fill_(divisor.reshape(-1) == 0, 0.0)
    if keep is not None:
        flat.masked_fill_(unpack_signs(keep.reshape(-1)) < 0, 0.0)
    return out
