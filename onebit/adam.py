"""OnebitAdam: Adam with a full-precision warmup, then a frozen variance and 1-bit momentum averaging."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from . import functional as F
from .buckets import Bucket
from .frozen import FrozenVarianceOptimizer
from .spec import StateSpec
from .state import TORCH_ADAM, from_torch_adam, to_torch_adam, torch_adam_step
from .validation import DEEPSPEED_COMMON_REFUSED, check_flag

__all__ = ["OnebitAdam", "adam_step_", "descend_", "step_by_", "decayed_step_", "add_to_params_", "copy_to_params_",
           "as_float", "by_pieces", "pieces", "flat_params"]


class OnebitAdam(FrozenVarianceOptimizer):
    r"""1-bit Adam (Tang et al., 2021, arXiv 2102.02888) as a plain ``torch.optim.Optimizer``.

    For the first ``freeze_step`` steps (**warmup**) every step all-reduces the gradients in full
    precision and runs Adam. After that (**compression**) the variance ``exp_avg_sq`` is frozen;
    each rank updates its momentum with its local gradient, and the momenta are averaged with an
    error-compensated 1-bit all-reduce (about 32x fewer bytes than float32). Gradients are *not*
    all-reduced in the compression phase: do not also average them (e.g. with DDP) then.

    Default numerics are DeepSpeed's ``OnebitAdam``: no bias correction, ``eps`` outside the
    square root, decoupled weight decay: ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``.

    Args:
        params: parameters or param groups. A group may set its own ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``bias_correction``, and ``compress=False`` to keep its momentum
            out of compression (full-precision gradient all-reduce and plain Adam in both phases).
        lr: the learning rate, as in Adam.
        betas: ``(beta1, beta2)``, as in Adam.
        eps: added to the denominator, as in Adam.
        weight_decay: decoupled weight decay, as in AdamW.
        freeze_step: number of warmup steps (>= 1). The paper uses 15-25% of training. ``"auto"``:
            freeze once the frozen denominator has settled (:mod:`onebit.autofreeze`), checked every
            10 steps from the data, without communication; the step it chose is logged and saved.
        freeze_bounds: with ``freeze_step="auto"``: ``(earliest, latest)`` step of the freeze
            (``latest`` None: no bound); default ``(20, None)``.
        bias_correction: divide the moments by ``1 - beta**t`` (with ``t = freeze_step`` for the
            frozen variance). Off by default, as in DeepSpeed.
        compression_space: what the 1-bit all-reduce averages: ``"preconditioned"`` (default):
            ``u = m / (sqrt(v) + eps)``, so that the 1-bit error of a coordinate is in units of
            Adam's step there (a coordinate with a tiny frozen variance cannot take a step of
            ``lr * scale / eps``); or ``"momentum"``: ``m``, DeepSpeed's numerics. The same
            bytes; measured in ``examples/bert/README.md``.
        update_bound: ``"auto"`` (default: 1 in the preconditioned space, None in the momentum
            space), ``None`` (no bound) or ``c > 0`` (with the preconditioned space): each
            coordinate's ``u = m / d`` is clamped to ``+-c B bc1`` before the 1-bit all-reduce,
            ``B = (1 - beta1) / sqrt((1 - beta2) (1 - beta1**2 / beta2))``, the largest
            ``|m / sqrt(v)|`` Adam reaches (1.70 for betas (0.9, 0.98), 7.27 for (0.9, 0.999)), so
            that a coordinate whose gradient outgrows its frozen variance cannot inflate its
            tensor's scale (and step) by orders of magnitude (measured: ``examples/bert/README.md``;
            the default because it costs nothing measurable there). The clamp runs in the codec's
            pass that multiplies by ``1 / d`` (the CPU kernels'; a pass of its own with kernels
            that do not multiply as they read, e.g. CUDA's). Not saved in state dicts.
        preconditioner_dtype: ``"auto"`` (default): ``torch.bfloat16`` in the preconditioned
            space, ``torch.float32`` in the momentum space (DeepSpeed's numerics exactly); with it
            ``error_dtype="auto"`` holds the compression errors in bfloat16 too (not with
            ``hierarchy``: float32). Measured on BERT (3 seeds, 2 settings): within 0.0011 of
            float32 state; 9.4 bytes per parameter after the freeze instead of 18.4 (2 ranks, no
            masks). ``torch.float32``: the frozen ``d`` and ``1 / d`` held in
            float32 (8 bytes per parameter; in the preconditioned space they stand for the
            variance, released as with bfloat16). ``torch.bfloat16`` (``"bfloat16"`` in config files):
            ``1 / d`` alone, rounded once to bfloat16 (2 bytes): the codec multiplies by it, the
            decoded average is divided by it, and the update is ``m * (1 / d)``. After a bucket's
            first compressed update, ``1 / d`` is its state (buckets without a momentum mask, in
            compressed groups): the frozen variance is released
            (4 bytes per parameter) and derived again from ``1 / d`` where it is needed (the state
            dict holds ``exp_avg_sq`` as usual, which loads back into the same ``1 / d``, bit for
            bit; it is the variance to bfloat16's precision). See ``docs/guides/tuning.md``.
        **options: the keyword-only options of every onebit optimizer (transport, masks, buckets,
            scale blocks, non-finite gradients, divergence, kernels): see
            :class:`onebit.engine.OnebitOptimizer`.
    """

    STATE: ClassVar[StateSpec] = dataclasses.replace(
        FrozenVarianceOptimizer.STATE, group_keys=("lr", "betas", "eps", "weight_decay", "bias_correction"))
    _VARIANCE_RELEASED: ClassVar[bool] = True
    _COMPACT_BY_DEFAULT: ClassVar[bool] = True
    CONFIG_TYPE: ClassVar[str] = "OneBitAdam"
    DEEPSPEED_REFUSED: ClassVar[Mapping[str, str]] = DEEPSPEED_COMMON_REFUSED

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int | str = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = False,
        compression_space: str = "preconditioned",
        freeze_bounds: tuple[int, int | None] | None = None,
        update_bound: float | str | None = "auto",
        preconditioner_dtype: Any = "auto",
        **options: Any,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, freeze_step, compression_space, freeze_bounds, update_bound,
                         preconditioner_dtype, **options)

    @classmethod
    def _check_group(cls, group: Mapping[str, Any]) -> None:
        super()._check_group(group)
        check_flag("bias_correction", group["bias_correction"])

    def _from_torch_adam(self, state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """torch's Adam/AdamW state: its moments, step and groups, with ``bias_correction=True``
        (torch's Adam corrects). A ``freeze_step`` below the loaded step becomes that step: the
        variance is frozen as loaded (and bias-corrected for the steps it saw), the next step
        compresses."""
        step = torch_adam_step(state_dict, type(self).__name__)
        schedule = self.STATE.schedule.save(self)
        notes = [f"a {TORCH_ADAM} state dict"]
        if any(not group["bias_correction"] for group in self.param_groups):
            notes.append("bias_correction=True from now on, as in torch's Adam")
        if self.freeze_step is not None and self.freeze_step < step:
            notes.append(f"freeze_step {step} (was {self.freeze_step}): the variance is frozen as loaded")
            schedule["freeze_step"] = step
        meta = {"algorithm": type(self).__name__, "step": step, **schedule}
        return from_torch_adam(state_dict, self.param_groups, self.state, meta), notes

    def torch_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as ``torch.optim.AdamW.state_dict()`` gives it, to leave onebit:
        ``torch.optim.AdamW(model.parameters()).load_state_dict(opt.torch_state_dict())`` continues
        with the same moments, step, learning rates and (decoupled) weight decay. Needs
        ``bias_correction=True`` in every group (torch's Adam always corrects its moments); a frozen
        variance is updated again from the next step on. Hooks of :meth:`state_dict` do not run."""
        for index, group in enumerate(self.param_groups):
            if not group["bias_correction"]:
                beta1, beta2 = group["betas"]
                t = max(self._step, 1)
                factor = (1 - beta2 ** t) ** 0.5 / (1 - beta1 ** t)
                raise ValueError(
                    f"param group {index} has bias_correction=False; torch's Adam always corrects its moments, so at "
                    f"step {self._step} its steps would be {factor:.4g}x this optimizer's. Set "
                    f"optimizer.param_groups[{index}]['bias_correction'] = True first to accept that")
        return to_torch_adam(self._build_state_dict())

    def _update_averaged(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """Adam on the bucket's averaged gradient: warmup, and ``compress=False`` groups."""
        beta1, beta2 = group["betas"]
        adam_step_(bucket, group, *F.bias_corrections(t, t, beta1, beta2, group["bias_correction"]))

    def _update_compressed(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """After the 1-bit average of the momentum, the update with the frozen variance."""
        beta1, beta2 = group["betas"]
        bc1, bc2 = F.bias_corrections(t, self.freeze_step, beta1, beta2, group["bias_correction"])
        if self.preconditioner_dtype != torch.float32:  # (1 / d alone: m times it)
            inverses = self._frozen_denominator.inverse(bucket, group["eps"], bc2).views
            descend_(bucket, bucket.views["exp_avg"], inverses, group["lr"], group["weight_decay"], bc1, times=True)
            self._release_variance(bucket)
            return
        denominators = self._frozen_denominator.get(bucket, group["eps"], bc2).views
        descend_(bucket, bucket.views["exp_avg"], denominators, group["lr"], group["weight_decay"], bc1)
        self._release_variance(bucket)


def adam_step_(bucket: Bucket, group: dict[str, Any], bc1: float = 1.0, bc2: float = 1.0,
               denominator: torch.Tensor | None = None) -> None:
    """Adam on the bucket's averaged gradient: both moments (the momentum masked), then
    ``p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p)``; the denominator is left
    in ``denominator`` if given."""
    beta1, beta2 = group["betas"]
    m, v = bucket.buffers["exp_avg"], bucket.buffers["exp_avg_sq"]  # the padding stays 0: its gradient is 0
    F.adam_moments_(m, v, bucket.averaged_grad(), beta1, beta2)
    if bucket.mask is not None:
        m.mul_(bucket.mask)
    if denominator is not None:
        F.adam_denominator_(denominator, v, group["eps"], bc2)
    if _in_pieces(bucket):
        _adam_update_in_pieces_(bucket, group, bc1, bc2, denominator)
        return
    if denominator is None:
        direction = F.adam_direction_(bucket.scratch("update"), m, v, group["eps"], bc1, bc2)
    else:  # the same operations, the denominator kept
        direction = torch.div(m, denominator, out=bucket.scratch("update"))
        if bc1 != 1.0:
            direction.div_(bc1)
    decayed_step_(bucket, bucket.view(direction), group["lr"], group["weight_decay"])


def _in_pieces(bucket: Bucket) -> bool:
    """Whether :func:`adam_step_` updates ``bucket`` in pieces: unpadded (else the padded gradient's
    buffer takes the direction anyway) and :func:`by_pieces`'s parameters."""
    return bucket.padded == bucket.numel and by_pieces(bucket)


def by_pieces(bucket: Bucket) -> bool:
    """Whether an update of ``bucket``'s parameters may run a piece of the flat buffers at a time
    (:func:`pieces`) with the same bits as over the whole buffer: contiguous float32 parameters
    (a piece boundary inside a bfloat16 parameter would round its tail elsewhere than the
    vectorized body)."""
    return bucket.same_dtype and all(p.is_contiguous() for p in bucket.params)


def pieces(bucket: Bucket, count: int = 1, chunk: int | None = None
           ) -> Iterator[tuple[slice, list[torch.Tensor], list[tuple[int, slice, slice]]]]:
    """The bucket's flat (padded) buffers ``chunk`` elements at a time (default
    :data:`onebit.functional.WIDEN_CHUNK`), per piece ``(where, scratch, parts)``: its slice of the
    flat buffers, ``count`` float32 scratch buffers of its length (the same ones for every piece),
    and per parameter it covers ``(index, within, of_param)``: the parameter's index in the bucket,
    where its part lies within the piece and within the parameter's flat view
    (:func:`flat_params`, for :func:`by_pieces` buckets)."""
    chunk = F.WIDEN_CHUNK if chunk is None else chunk
    length = min(chunk, bucket.padded)
    scratch = [torch.empty(length, dtype=torch.float32, device=bucket.device) for _ in range(count)]
    for start in range(0, bucket.padded, chunk):
        stop = min(start + chunk, bucket.padded)
        parts = []
        for index, s in enumerate(bucket.slices):
            low, high = max(start, s.start), min(stop, s.stop)
            if low < high:
                parts.append((index, slice(low - start, high - start), slice(low - s.start, high - s.start)))
        yield slice(start, stop), [buffer[:stop - start] for buffer in scratch], parts


def flat_params(bucket: Bucket) -> list[torch.Tensor]:
    """The bucket's parameters as flat views (contiguous ones: :func:`by_pieces`)."""
    return [p.view(-1) for p in bucket.params]


def _adam_update_in_pieces_(bucket: Bucket, group: dict[str, Any], bc1: float, bc2: float,
                            denominator: torch.Tensor | None = None) -> None:
    """:func:`adam_step_`'s update after its moments (and its ``denominator``), a piece of the flat
    buffers at a time (:func:`pieces`): the same operations on each element as with the whole
    direction in a buffer (``adam_direction_``, or ``m / denominator``, then :func:`decayed_step_`),
    in one buffer of a piece's size instead of the bucket's (4 B/param of warmup's memory)."""
    lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
    m, v = bucket.buffers["exp_avg"], bucket.buffers["exp_avg_sq"]
    flats = flat_params(bucket)
    for where, (piece,), parts in pieces(bucket):
        if denominator is None:
            direction = F.adam_direction_(piece, m[where], v[where], eps, bc1, bc2)
        else:
            direction = torch.div(m[where], denominator[where], out=piece)
            if bc1 != 1.0:
                direction.div_(bc1)
        updates = [direction[within] for _, within, _ in parts]
        params = [flats[index][of_param] for index, _, of_param in parts]
        if weight_decay != 0:
            torch._foreach_add_(updates, params, alpha=weight_decay)
        torch._foreach_add_(params, updates, alpha=-lr)


def descend_(bucket: Bucket, momenta: list[torch.Tensor], denominators: list[torch.Tensor], lr: float,
             weight_decay: float, bc1: float = 1.0, times: bool = False) -> None:
    """``p <- p * (1 - lr * weight_decay) - (lr / bc1) * m / denominator`` for each of the bucket's
    parameters, one fused pass each (float32 parameters; others: :func:`decayed_step_` of
    ``(m / denominator) / bc1``). ``times``: the denominators are inverses, ``m * inverse`` instead."""
    if not bucket.same_dtype:
        updates = [torch.mul(mom, d.float()) if times else torch.div(mom, d) for mom, d in zip(momenta, denominators)]
        decayed_step_(bucket, updates if bc1 == 1.0 else [u.div_(bc1) for u in updates], lr, weight_decay)
        return
    if weight_decay != 0:
        torch._foreach_mul_(bucket.params, 1.0 - lr * weight_decay)
    if times:  # (bfloat16 inverses, widened a million elements at a time)
        F.addcmul_widened_(bucket.params, momenta, denominators, -lr / bc1)
    else:
        torch._foreach_addcdiv_(bucket.params, momenta, denominators, value=-lr / bc1)


def step_by_(bucket: Bucket, updates: list[torch.Tensor], lr: float, weight_decay: float, scale: float = 1.0) -> None:
    """``p <- p * (1 - lr * weight_decay) - lr * scale * u`` for each of the bucket's parameters
    and its update ``u`` (float32, the parameter's shape): :func:`descend_` for a ready update."""
    if not bucket.same_dtype:
        decayed_step_(bucket, [u * scale for u in updates], lr, weight_decay)
        return
    if weight_decay != 0:
        torch._foreach_mul_(bucket.params, 1.0 - lr * weight_decay)
    torch._foreach_add_(bucket.params, updates, alpha=-lr * scale)


def decayed_step_(bucket: Bucket, updates: list[torch.Tensor], lr: float, weight_decay: float) -> None:
    """``u <- u + weight_decay * p``, then ``p <- p - lr * u`` for each of the bucket's parameters
    and its update ``u`` (float32, the parameter's shape; changed in place)."""
    if weight_decay != 0:  # (parameters of other dtypes: foreach adds tensor by tensor, in float32)
        torch._foreach_add_(updates, bucket.params, alpha=weight_decay)
    add_to_params_(bucket, updates, -lr)


def add_to_params_(bucket: Bucket, updates: list[torch.Tensor], alpha: float = 1.0) -> None:
    """``p <- p + alpha * u`` for each of the bucket's parameters and its float32 update ``u``: one
    foreach pass when they are float32, else per parameter, ``u`` rounded to its dtype first."""
    if bucket.same_dtype:
        torch._foreach_add_(bucket.params, updates, alpha=alpha)
        return
    for p, u in zip(bucket.params, updates):
        p.add_(u.to(p.dtype), alpha=alpha)


def copy_to_params_(bucket: Bucket, values: list[torch.Tensor]) -> None:
    """``p <- v`` for each of the bucket's parameters and its float32 value ``v`` (rounded to its dtype)."""
    if bucket.same_dtype:
        torch._foreach_copy_(bucket.params, values)
        return
    for p, v in zip(bucket.params, values):
        p.copy_(v)


def as_float(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` in float32: the float32 ones themselves, copies of the others."""
    return [t.float() for t in tensors]
