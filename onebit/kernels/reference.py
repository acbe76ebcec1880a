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

All functions take flat float32 tensors on any device; ``packed`` tensors are uint8 with one eighth
of the elements, written in row-major order (they may be strided views, e.g. rows of a send buffer).
"""

from __future__ import annotations

import torch

from .blocked import blocked_rms_scale

__all__ = ["pack_signs", "unpack_signs", "rms_scale", "worker_compress_", "server_compress_", "decode_"]

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


def worker_compress_(x: torch.Tensor, error: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Worker side: ``b = x + error``; pack ``sign(b)``; ``error <- b - s*sign(b)``; return ``s``.

    ``x`` is left unchanged; ``error`` is updated in place; ``packed`` is overwritten.
    """
    b = x + error
    scale = rms_scale(b)
    packed.copy_(pack_signs(b).reshape(packed.shape))
    torch.sub(b, _sign_values(b) * scale, out=error)
    return scale


def server_compress_(
    signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor, packed: torch.Tensor
) -> torch.Tensor:
    """Server side for one chunk.

    ``signs`` is ``(n, L/8)`` uint8 (row ``i`` from rank ``i``), ``scales`` is ``(n,)`` float32,
    ``error`` is the ``(L,)`` server error, updated in place. Computes
    ``c = (sum_i s_i q_i) / n + error``, packs ``sign(c)`` into ``packed``, sets
    ``error <- c - s*sign(c)`` and returns the server scale ``s``.
    """
    n = signs.shape[0]
    acc = unpack_signs(signs[0]) * scales[0]
    for i in range(1, n):
        acc += unpack_signs(signs[i]) * scales[i]
    # Divide by a tensor: with a Python scalar, torch's CUDA kernel multiplies by 1/n instead.
    c = acc.div_(torch.tensor(float(n), device=acc.device)).add_(error)
    scale = rms_scale(c)
    packed.copy_(pack_signs(c).reshape(packed.shape))
    torch.sub(c, _sign_values(c) * scale, out=error)
    return scale


def decode_(signs: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``out[j*L:(j+1)*L] = scales[j] * q_j`` for the ``(n, L/8)`` packed ``signs``.

    ``keep`` (optional): ``out.numel() / 8`` bytes of packed bits in the same order as ``out``
    (MSB first); where a bit is clear the output is ``+0.0`` (a momentum mask, applied in the
    same pass)."""
    n = signs.shape[0]
    values = unpack_signs(signs).view(n, -1)
    torch.mul(values, scales.view(n, 1), out=out.view(n, -1))
    if keep is not None:
        out.view(-1).masked_fill_(unpack_signs(keep.reshape(-1)) < 0, 0.0)
    return out
