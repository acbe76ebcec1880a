"""Pure update maths on float32 tensors (flat buffers, or per-parameter views of them). No state,
no communication.

DeepSpeed's numerics are the default: eps outside the square root, decoupled weight decay, and
(unless ``bias_correction``) no bias correction::

    m = beta1 * m + (1 - beta1) * g              (computed as lerp(m, g, 1 - beta1))
    v = beta2 * v + (1 - beta2) * g * g          (warmup only; frozen after)
    u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p
    p = p - lr * u

with ``bc1 = bc2 = 1`` without bias correction. (In compression the optimizer applies the last two
lines as ``p = p * (1 - lr * weight_decay) - (lr / bc1) * m / (sqrt(v / bc2) + eps)`` in one fused
pass: the same maths, rounded differently.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

__all__ = ["adam_moments_", "momentum_", "adam_denominator_", "variance_of_denominator", "adam_direction_", "bias_corrections",
           "lamb_trust_ratio", "reconstructed_grad_", "lamb_factor", "adam_largest_ratio", "update_bound", "kept_still"]


def adam_moments_(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, beta1: float, beta2: float) -> None:
    """Warmup: update both moments with the (averaged) gradient. The momentum is a ``lerp``
    towards the gradient (one pass, as in ``torch.optim.Adam``), equal to ``beta1 * m + (1 - beta1) * g``
    up to rounding."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def momentum_(exp_avgs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], beta1: float) -> None:
    """Compression: update each momentum with its local gradient (``None``: a zero gradient), in
    one pass over each; the variance stays frozen. Same rounding as :func:`adam_moments_`."""
    present = [(m, g) for m, g in zip(exp_avgs, grads, strict=True) if g is not None]
    if present:
        torch._foreach_lerp_([m for m, _ in present], [g for _, g in present], 1 - beta1)
    absent = [m for m, g in zip(exp_avgs, grads) if g is None]
    if absent:
        torch._foreach_mul_(absent, beta1)


def momentum_into_(outs: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   beta1: float) -> None:
    """:func:`momentum_` written to ``outs`` (the same rounding), the momenta left as they are."""
    for out, m, g in zip(outs, exp_avgs, grads, strict=True):
        if g is None:
            torch.mul(m, beta1, out=out)
        else:
            torch.lerp(m, g, 1 - beta1, out=out)


def bias_corrections(step: int, variance_step: int, beta1: float, beta2: float, enabled: bool) -> tuple[float, float]:
    """``(1 - beta1**step, 1 - beta2**variance_step)``, or ``(1, 1)`` when disabled.

    ``variance_step`` is the step at which the variance was last updated: the current step in
    warmup, ``freeze_step`` once it is frozen.
    """
    if not enabled:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**variance_step


def adam_denominator_(out: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float, bc2: float = 1.0) -> torch.Tensor:
    """``out = sqrt(v / bc2) + eps`` (computed as ``sqrt(v) / sqrt(bc2) + eps``), written into ``out``."""
    torch.sqrt(exp_avg_sq, out=out)
    if bc2 != 1.0:
        out.div_(bc2**0.5)
    return out.add_(eps)


#: float32's smallest subnormal and largest value; the bits of the first and of +inf, as int32
_SMALLEST, _FLOAT32_MAX = 2.0**-149, torch.finfo(torch.float32).max
_SMALLEST_BITS, _INF_BITS = 1, 0x7F800000


def variance_of_denominator(denominator: torch.Tensor, eps: float, bc2: float, live: torch.Tensor,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 variance ``v`` whose :func:`adam_denominator_` is ``denominator``, bit for bit,
    where ``live``, and 0 elsewhere (flat tensors), of at least float32's smallest subnormal where
    live (a smaller one would read as a zero variance). ``(d - eps)**2 * bc2`` in float64 or one of
    its float32 neighbours is one almost everywhere; elsewhere (``d`` near ``eps``, where many
    variances give one ``d``) a bisection finds the smallest: every operation of
    :func:`adam_denominator_` rounds monotonically, so the float32 values that give one
    denominator are a run of consecutive bit patterns. A denominator that no variance gives (NaN)
    gives NaN; a live coordinate's finite denominator always has one (it was derived from one)."""
    v = torch.empty(denominator.shape, dtype=torch.float32, device=denominator.device) if out is None else out
    for start in range(0, denominator.numel(), WIDEN_CHUNK):
        part = slice(start, start + WIDEN_CHUNK)
        target = denominator[part]
        root = target.double().sub_(eps).clamp_(min=0.0)
        guess = root.mul_(root).mul_(bc2).clamp_(min=_SMALLEST, max=_FLOAT32_MAX).float().view(torch.int32)
        found = guess.clone()
        trial = torch.empty(target.shape, dtype=torch.float32, device=target.device)
        missing = torch.ones(target.shape, dtype=torch.bool, device=target.device)
        for offset in (0, -1, 1, -2, 2):
            bits = (guess + offset).clamp_(min=_SMALLEST_BITS, max=_INF_BITS)
            hit = missing & (adam_denominator_(trial, bits.view(torch.float32), eps, bc2) == target)
            found = torch.where(hit, bits, found)
            missing &= ~hit
        rest = torch.nonzero(missing & ~target.isnan()).squeeze(1)
        if rest.numel():
            found[rest] = _first_variance_bits(target[rest], eps, bc2)
        value = found.view(torch.float32).masked_fill(~live[part], 0.0)
        v[part].copy_(value.masked_fill_(target.isnan(), float("nan")))
    return v


def _first_variance_bits(target: torch.Tensor, eps: float, bc2: float) -> torch.Tensor:
    """The bits of the smallest float32 ``v >= 2**-149`` whose :func:`adam_denominator_` reaches ``target``."""
    low = torch.full(target.shape, _SMALLEST_BITS, dtype=torch.int32, device=target.device)
    high = torch.full_like(low, _INF_BITS)
    trial = torch.empty(target.shape, dtype=torch.float32, device=target.device)
    for _ in range(31):  # (high - low < 2**31: each round halves it)
        middle = low + (high - low) // 2
        reached = adam_denominator_(trial, middle.view(torch.float32), eps, bc2) >= target
        high = torch.where(reached, middle, high)
        low = torch.where(reached, low, middle + 1)
    return high


def adam_direction_(
    out: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float, bc1: float = 1.0, bc2: float = 1.0
) -> torch.Tensor:
    """``out = (m / bc1) / (sqrt(v / bc2) + eps)``, written into ``out``."""
    adam_denominator_(out, exp_avg_sq, eps, bc2)
    torch.div(exp_avg, out, out=out)
    if bc1 != 1.0:
        out.div_(bc1)
    return out


# ----------------------------------------------------------------------------- 1-bit LAMB
#
# LAMB (You et al., 2019) scales each tensor's Adam direction u by a trust ratio ||p|| / ||u||.
# 1-bit LAMB (Li et al., 2021) freezes it after the warmup: an exponential average of the warmup
# ratios, times a per-tensor factor that tracks how the frozen variance compares with a fresh one,
# estimated from the compressed momentum. DeepSpeed 0.19.6's numerics, less its defects (see
# onebit.lamb).


def lamb_trust_ratio(param_norms: torch.Tensor, update_norms: torch.Tensor, min_coeff: float,
                     max_coeff: float) -> torch.Tensor:
    """Per tensor, ``clamp(||p|| / ||u||, min_coeff, max_coeff)``; where a norm is 0 the ratio is
    1, clamped too (float64)."""
    p, u = param_norms.double(), update_norms.double()
    ratio = torch.where((p > 0) & (u > 0), p / u.where(u > 0, 1.0), 1.0)
    return ratio.clamp_(min_coeff, max_coeff)


def reconstructed_grad_(prev: torch.Tensor, exp_avg: torch.Tensor, beta1: float) -> torch.Tensor:
    """``prev <- (m - beta1 * prev) / (1 - beta1)``: the gradient that would have moved the
    momentum from ``prev`` to the compressed average ``m``."""
    prev.mul_(beta1)
    torch.sub(exp_avg, prev, out=prev)
    return prev.div_(1 - beta1)


def lamb_factor(max_ratio: torch.Tensor, prelim_norms: torch.Tensor | None, update_norms: torch.Tensor | None,
                last_factor: torch.Tensor, factor_min: float, factor_max: float, threshold: float) -> torch.Tensor:
    """1-bit LAMB's per-tensor factor in compression (float64), from ``max_ratio``: the largest
    ``(sqrt(v) + eps) / (sqrt(v_fresh) + eps)`` over the tensor's live coordinates. With weight
    decay (``prelim_norms`` = ``||m / d||``, ``update_norms`` = ``||m / d + wd p||``) it is pulled
    towards 1 by ``r = min(1, prelim / update)``: ``f r + (1 - r)``; then clamped to
    ``[factor_min, factor_max]`` and to within ``threshold`` (relative) of ``last_factor``."""
    factor = max_ratio.double()
    if prelim_norms is not None and update_norms is not None:
        prelim, update = prelim_norms.double(), update_norms.double()
        r = torch.where(update > 0, prelim / update.where(update > 0, 1.0), 1.0).clamp_(max=1.0)
        factor = factor * r + (1.0 - r)
    factor = factor.clamp(factor_min, factor_max)
    return torch.minimum(torch.maximum(factor, last_factor * (1 - threshold)), last_factor * (1 + threshold))


def adam_largest_ratio(beta1: float, beta2: float) -> float | None:
    """The largest ``|m / sqrt(v)|`` Adam reaches (without bias correction, ``v`` updated on every
    step, any gradients): ``(1 - beta1) / sqrt((1 - beta2) (1 - beta1**2 / beta2))``, by
    Cauchy-Schwarz over ``m = (1 - beta1) sum beta1^k g_k`` and ``v = (1 - beta2) sum beta2^k g_k^2``
    (1.70 for betas (0.9, 0.98), 7.27 for (0.9, 0.999)); None when ``beta1**2 >= beta2`` (unbounded)."""
    if beta1 * beta1 >= beta2:
        return None
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


def update_bound(scale: float | None, beta1: float, beta2: float) -> float | None:
    """The bound of ``|m / sqrt(v)|`` that ``update_bound=scale`` sets: ``scale`` times
    :func:`adam_largest_ratio`; None where either is None (no bound)."""
    if scale is None:
        return None
    largest = adam_largest_ratio(beta1, beta2)
    return None if largest is None else scale * largest


def kept_still(exp_avg_sq: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Where the momentum is kept 0 and moves nothing (bool): the variance is 0 (1 bit cannot
    send 0), or the momentum ``mask`` is."""
    still = exp_avg_sq == 0
    if mask is not None:
        still |= mask == 0
    return still


#: Elements widened from bfloat16 at a time by :func:`addcmul_widened_` and :func:`mul_widened`
WIDEN_CHUNK = 1 << 20


def pieces(tensors: Sequence[torch.Tensor], chunk: int = WIDEN_CHUNK) -> Iterator[list[tuple[int, slice | None]]]:
    """Batches of ``(index, part)`` of at most about ``chunk`` elements: small tensors whole
    (``part`` None), a contiguous one larger than ``chunk`` in slices of its flat view."""
    batch: list[tuple[int, slice | None]] = []
    size = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if n > chunk and t.is_contiguous():
            for start in range(0, n, chunk):
                yield [(i, slice(start, min(start + chunk, n)))]
            continue
        if batch and size + n > chunk:
            yield batch
            batch, size = [], 0
        batch.append((i, None))
        size += n
    if batch:
        yield batch


def part_of(t: torch.Tensor, part: slice | None) -> torch.Tensor:
    """The ``part`` of ``t`` that :func:`pieces` named (its flat view's slice; None: all of it)."""
    return t if part is None else t.view(-1)[part]


def addcmul_widened_(outs: Sequence[torch.Tensor], a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], value: float,
                     chunk: int = WIDEN_CHUNK) -> None:
    """``out += value * a * float(b)`` for each triple (``b`` of a narrower type, e.g. bfloat16),
    widening ``chunk`` elements of ``b`` at a time (the same numbers as widening all of it first)."""
    for batch in pieces(outs, chunk):
        torch._foreach_addcmul_([part_of(outs[i], p) for i, p in batch], [part_of(a[i], p) for i, p in batch],
                                [part_of(b[i], p).float() for i, p in batch], value=value)


def mul_widened(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, chunk: int = WIDEN_CHUNK) -> torch.Tensor:
    """``out = a * float(b)`` over flat tensors, widening ``chunk`` elements of ``b`` at a time."""
    for start in range(0, a.numel(), chunk):
        part = slice(start, start + chunk)
        torch.mul(a[part], b[part].float(), out=out[part])
    return out
