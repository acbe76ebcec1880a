"""The blocked float64 sum of squares that every native kernel computes for the scale.

Why it exists. :func:`onebit.kernels.reference.rms_scale` sums the squares with
``torch.Tensor.sum`` in float64. That result is *not* one fixed number: torch's CPU reduction
splits the work by ``torch.get_num_threads()`` and by vector width, and CUDA reduces in yet another
order, so the float64 sum can differ in its last bits from one setting to the next (on these
machines, 1 thread against 2 threads gave a different float64 sum for 38% of 1M-element inputs).
Rounded once to float32 the scale almost always agrees, but not always: a float64 sum that falls
within a few ulps of a float32 rounding boundary rounds either way. No native kernel can promise to
reproduce a sum whose order is not defined, so the native kernels compute this one instead:

* cut ``b`` into blocks of ``BLOCK = 1024`` elements (the last one zero-padded), each seen as
  ``STEPS = 32`` rows of ``LANES = 32``;
* lane ``l`` of block ``k`` sums ``float64(b[1024k + 32j + l]) ** 2`` for ``j = 0, 1, ..., 31`` in
  that order, starting from ``0.0``;
* the lane sums, block-major (``k * 32 + l``), are reduced by the adjacent pairwise tree: level by
  level ``v[i] = v[2i] + v[2i+1]``, a lone last element carried up unchanged (the same as padding
  with ``+0.0`` to a power of two);
* ``scale = float32(sqrt(S / len(b)))``, the division and the square root in float64.

Squares of float32 values are exact in float64, and every addition above has a fixed pair of
operands, so the result is one number on every device, thread count and vector width: the AVX2
CPU kernels (8 registers of 4 lanes), the portable scalar path and the CUDA kernels (a warp per
block, then trees of 32) all reproduce it bit for bit, and so does :func:`blocked_sumsq` below
in plain torch on any device. Adopting :func:`blocked_rms_scale` as ``reference.rms_scale`` makes
"equal to the reference bit for bit" a guarantee rather than a near certainty.
"""

from __future__ import annotations

import torch

__all__ = ["LANES", "STEPS", "BLOCK", "blocked_sumsq", "blocked_rms_scale", "pairwise_tree_sum"]

LANES = 32
STEPS = 32
BLOCK = LANES * STEPS


def pairwise_tree_sum(values: torch.Tensor) -> torch.Tensor:
    """Adjacent pairwise sum of a flat tensor, level by level (0-d result, same dtype)."""
    v = values.reshape(-1)
    if v.numel() == 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    while v.numel() > 1:
        if v.numel() % 2:
            v = torch.cat([v, v.new_zeros(1)])  # x + 0.0 == x for the non-negative sums here
        v = v[0::2] + v[1::2]
    return v[0]


def blocked_sumsq(b: torch.Tensor) -> torch.Tensor:
    """The blocked float64 sum of ``b ** 2`` defined above (0-d float64 tensor)."""
    flat = b.reshape(-1)
    n = flat.numel()
    nblocks = -(-n // BLOCK)
    squares = torch.zeros(nblocks * BLOCK, dtype=torch.float64, device=b.device)
    squares[:n] = flat.to(torch.float64).square()
    rows = squares.view(nblocks, STEPS, LANES)
    lanes = torch.zeros(nblocks, LANES, dtype=torch.float64, device=b.device)
    for j in range(STEPS):  # each lane in increasing j: element-wise adds, one rounding each
        lanes += rows[:, j, :]
    return pairwise_tree_sum(lanes)


def blocked_rms_scale(b: torch.Tensor) -> torch.Tensor:
    """``float32(sqrt(blocked_sumsq(b) / len(b)))`` (0-d float32 tensor): the kernels' scale."""
    return torch.sqrt(blocked_sumsq(b) / b.numel()).to(torch.float32)
