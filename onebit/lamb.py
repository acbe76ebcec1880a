"""OnebitLamb: LAMB with a full-precision warmup, then the variance frozen and the momentum averaged in 1 bit."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from . import functional as F
from .buckets import Bucket
from .shards import reduce_over_shards_
from .adam import add_to_params_, as_float
from .frozen import FrozenVarianceOptimizer
from .spec import Setting, StateSpec
from .validation import DEEPSPEED_COMMON_REFUSED, TORCH_FLAGS, check_choice, check_number

__all__ = ["OnebitLamb", "TRUST_RATIOS"]

logger = logging.getLogger(__name__)

# How 1-bit LAMB scales each tensor's step once compressing (see OnebitLamb)
TRUST_RATIOS = ("live", "frozen")

# The live trust ratio reads the norm of u averaged over steps with this weight on the past. The
# error feedback makes the 1-bit noise in the decoded u alternate from step to step (it is u plus
# the last step's error minus this step's), so a short average keeps the signal's norm where one
# step's norm counts the noise in it (examples/bert/README.md: weights 0, 0.5 and 0.9 measured).
SMOOTHING = 0.5


def _saved_trust_ratio(rule: Any) -> str:
    check_choice("in the checkpoint", rule, TRUST_RATIOS, prefix="trust_ratio")
    return rule


class OnebitLamb(FrozenVarianceOptimizer):
    r"""1-bit LAMB (Li et al., 2021, arXiv 2104.06069) as a plain ``torch.optim.Optimizer``.

    **Warmup** (steps ``1..freeze_step``): gradients are averaged in full precision and each
    tensor takes a LAMB step without bias correction, ``u = m / (sqrt(v) + eps) + wd p``,
    ``p -= lr c u`` with the trust ratio ``c = clamp(||p|| / ||u||, min_coeff, max_coeff)``.

    **Compression**: the variance ``v`` is frozen; each rank updates its momentum with its local
    gradient and the momenta are averaged with the error-compensated 1-bit all-reduce (per-tensor
    scales). Each tensor then steps as in warmup, from the averaged momentum and the frozen
    variance, with a trust ratio of this step (``trust_ratio="live"``, the default): ``u = m /
    (sqrt(v) + eps)``, ``u_s = SMOOTHING u_s + (1 - SMOOTHING) u`` (``SMOOTHING`` 0.5, from the
    warmup's last ``u``), ``c = clamp(||p|| / ||u_s + wd p||, min_coeff, max_coeff)``, ``p -= lr
    c (u + wd p)``. Every rank holds the same ``m`` and ``p`` after the average, so ``c`` costs no
    communication. The ratio reads the norm of ``u`` averaged over steps: the error feedback makes
    the 1-bit noise alternate from step to step, and a ratio from one step's norm, noise included,
    made every step shorter (on the BERT example 1-bit LAMB ended about 1% further from LAMB).

    ``trust_ratio="frozen"`` is DeepSpeed's rule instead: the warmup ratios are averaged,
    ``c_frozen = coeff_beta c_frozen + (1 - coeff_beta) c`` (from 0, as in DeepSpeed: keep ``1 /
    (1 - coeff_beta)`` well below ``freeze_step``), and at step ``freeze_step`` the variance is
    copied into ``exp_avg_sq_fresh``. From the averaged momentum the gradient is reconstructed,
    ``g = (m - beta1 m_prev) / (1 - beta1)``, and feeds the fresh variance ``v_fresh``. Each tensor
    steps by ``p -= lr c_frozen f u`` with ``f`` the largest ``(sqrt(v) + eps) / (sqrt(v_fresh) +
    eps)`` over its coordinates, pulled towards 1 by weight decay, clamped to ``[factor_min,
    factor_max]`` and to within ``factor_threshold`` of the previous step's ``f`` (which starts
    at 1). ``min_coeff``/``max_coeff`` apply to warmup only. On the BERT example this rule left
    1-bit LAMB on the loss plateau at 2 seeds of 3, with betas (0.9, 0.999) as with (0.9, 0.98)
    (1.067-1.094x LAMB's loss), and it did so with exact averages too: the ratio frozen at
    ``freeze_step`` is the cause, not the 1 bit (``examples/bert/README.md``); ``f`` is a maximum
    over every coordinate, so a fast-moving fresh variance drives it up by ``factor_threshold`` a
    step (watch ``last_factor``).

    With ``trust_ratio="frozen"`` (and ``compression_space="momentum"``, ``update_bound=None``)
    these are DeepSpeed 0.19.6's numerics. What differs, on purpose:

    * no hidden first step: every ``step()`` uses its gradient;
    * a tensor whose norm (or update's) is 0, e.g. a zero-initialised bias, gets the trust ratio
      1 *clamped* to ``[min_coeff, max_coeff]``, and every warmup step enters the average
      (DeepSpeed skipped both, so such tensors could stop moving for good after a short warmup);
    * the fresh variance is copied at step ``freeze_step`` whatever it is (DeepSpeed missed the
      copy with ``freeze_step <= 1``, and ``f`` then ramped up by 10% a step);
    * ``f`` is taken over live coordinates: masked ones and those whose frozen variance is 0
      (kept at zero momentum) do not pin it (DeepSpeed's ratio there, up to ``sqrt(v) / eps``,
      pinned ``f`` to ``factor_max`` or at least 1 for the whole tensor);
    * every tensor has its own compression scales (``bucket_size`` changes the collectives, not
      the numerics), so DeepSpeed's ``scaling_coeff`` (one shared scale for the whole model,
      equalised by a per-tensor factor fixed at the first compression step, which crashed on a
      zero momentum) is not needed; on a single tensor the two are the same;
    * a checkpoint restores the averaged ratios and factors (DeepSpeed reset them in warmup,
      and in compression its next step updated the variance from a local gradient);
    * ``bias_correction``, ``max_grad_norm``, ``eps_inside_sqrt`` and ``amsgrad``, which DeepSpeed
      accepted and ignored, are refused.

    Args:
        params: parameters or param groups. A group may set its own ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``max_coeff``, ``min_coeff``, and ``compress=False`` (full-precision
            gradient average and LAMB in both phases).
        lr: the learning rate, as in LAMB.
        betas: ``(beta1, beta2)``, as in LAMB.
        eps: added to the denominator, as in LAMB.
        weight_decay: decoupled weight decay, inside ``u`` as in LAMB.
        freeze_step: number of warmup steps (>= 1); the paper's BERT runs use about 15-25% of
            training.
            ``"auto"`` (and ``freeze_bounds``): as for :class:`onebit.OnebitAdam`.
        max_coeff: upper bound of the warmup trust ratio.
        min_coeff: lower bound of the warmup trust ratio.
        coeff_beta: the averaging factor of the warmup trust ratios (``trust_ratio="frozen"``
            only; default 0.9).
        factor_max: upper bound of ``f`` (``"frozen"`` only; default 4.0).
        factor_min: lower bound of ``f`` (``"frozen"`` only; default 0.5).
        factor_threshold: the largest relative change of ``f`` per step (``"frozen"`` only;
            default 0.1). With ``trust_ratio="live"`` these four are refused if given.
        trust_ratio: ``"live"`` (default): each compression step's own ratio, from ``u`` averaged
            over steps (the buffer ``smoothed_update``, from the first compression step on); or
            ``"frozen"``: DeepSpeed's averaged warmup ratio times ``f``. A checkpoint's rule wins
            over the constructor's (one without it was saved under ``"frozen"``). ``"live"`` reads
            the frozen variance through ``d`` and ``1 / d`` alone, which stand for it after the
            switch: it is released as 1-bit Adam's is (in the preconditioned space, or with a
            bfloat16 preconditioner).
        compression_space: ``"preconditioned"`` (default) or ``"momentum"`` (DeepSpeed's
            numerics): as for :class:`onebit.OnebitAdam`.
        update_bound: ``"auto"`` (default), ``None`` or ``c > 0``: as for :class:`onebit.OnebitAdam`.
        preconditioner_dtype: ``torch.float32`` (default) or ``torch.bfloat16``: as for
            :class:`onebit.OnebitAdam` (with ``"frozen"``, ``d`` is derived for each step's factor).
        **options: the keyword-only options of every onebit optimizer (transport, masks, buckets,
            scale blocks, non-finite gradients, divergence, kernels): see
            :class:`onebit.engine.OnebitOptimizer`.
    """

    # Lazy: trust_ratio="frozen"'s fresh variance, from step freeze_step on, and "live"'s smoothed
    # update, from the first compression step on; the scalars are "frozen"'s (with "live" they stay 0
    # and 1). The rule is saved with the schedule (a checkpoint without it was saved under "frozen",
    # the only rule before 2026-11-26); the checkpoint's wins: its scalars and fresh variance are its rule's.
    STATE: ClassVar[StateSpec] = dataclasses.replace(
        FrozenVarianceOptimizer.STATE, buffers=("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "smoothed_update"),
        nonnegative=("exp_avg_sq", "exp_avg_sq_fresh"), lazy=("exp_avg_sq_fresh", "smoothed_update"),
        scalars={"lamb_coeff_freeze": 0.0, "last_factor": 1.0},
        group_keys=("lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff"),
        schedule=FrozenVarianceOptimizer.STATE.schedule.extend(Setting("trust_ratio", _saved_trust_ratio, absent="frozen")))
    # trust_ratio="frozen"'s arguments and their defaults (DeepSpeed's)
    FROZEN_DEFAULTS: ClassVar[dict[str, float]] = {"coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
                                                   "factor_threshold": 0.1}
    CONFIG_TYPE: ClassVar[str] = "OneBitLamb"
    DEEPSPEED_REFUSED: ClassVar[Mapping[str, str]] = {
        "bias_correction": "DeepSpeed's OnebitLamb read it and never used it: there is no bias correction in 1-bit LAMB",
        **DEEPSPEED_COMMON_REFUSED,
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int | str = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float | None = None,
        factor_max: float | None = None,
        factor_min: float | None = None,
        factor_threshold: float | None = None,
        *,
        trust_ratio: str = "live",
        compression_space: str = "preconditioned",
        freeze_bounds: tuple[int, int | None] | None = None,
        update_bound: float | str | None = "auto",
        preconditioner_dtype: Any = None,
        **options: Any,
    ) -> None:
        check_choice("trust_ratio", trust_ratio, TRUST_RATIOS)
        given = {"coeff_beta": coeff_beta, "factor_max": factor_max, "factor_min": factor_min,
                 "factor_threshold": factor_threshold}
        given = {key: value for key, value in given.items() if value is not None}
        if trust_ratio == "live" and given:
            listed = ", ".join(f"{key}={value!r}" for key, value in given.items())
            raise ValueError(f"{listed}: read only by trust_ratio='frozen' (DeepSpeed's rule: the warmup ratios "
                             "averaged, times a factor from the fresh variance); the default trust_ratio='live' takes "
                             "each step's own ratio. Remove them, or pass trust_ratio='frozen'")
        hp = {**self.FROZEN_DEFAULTS, **given}  # (also what a checkpoint's "frozen" runs with)
        check_number("coeff_beta", hp["coeff_beta"], high=1.0, high_open=True)
        check_number("factor_min", hp["factor_min"])
        check_number("factor_max", hp["factor_max"])
        if hp["factor_min"] > hp["factor_max"]:
            raise ValueError(f"factor_min ({hp['factor_min']}) must not exceed factor_max ({hp['factor_max']})")
        check_number("factor_threshold", hp["factor_threshold"])
        self.coeff_beta, self.factor_max, self.factor_min = hp["coeff_beta"], hp["factor_max"], hp["factor_min"]
        self.factor_threshold = hp["factor_threshold"]
        self.trust_ratio = trust_ratio
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults, freeze_step, compression_space, freeze_bounds, update_bound,
                         preconditioner_dtype, **options)

    @classmethod
    def _check_group(cls, group: Mapping[str, Any]) -> None:
        super()._check_group(group)
        for key, why in cls.DEEPSPEED_REFUSED.items():
            if key in group and key not in TORCH_FLAGS:  # (torch.optim's flags: checked above, by their value)
                raise ValueError(f"param group key {key!r} is not read by OnebitLamb ({why}); remove it")
        check_number("max_coeff", group["max_coeff"])
        check_number("min_coeff", group["min_coeff"])
        if group["min_coeff"] > group["max_coeff"]:
            raise ValueError(f"min_coeff ({group['min_coeff']}) must not exceed max_coeff ({group['max_coeff']})")

    def _update_averaged(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """LAMB on the bucket's averaged gradient: warmup, and ``compress=False`` groups."""
        beta1, beta2 = group["betas"]
        m, v = bucket.buffers["exp_avg"], bucket.buffers["exp_avg_sq"]
        F.adam_moments_(m, v, bucket.averaged_grad(), beta1, beta2)
        if bucket.mask is not None:
            m.mul_(bucket.mask)
        if t == self.freeze_step and self.trust_ratio == "frozen":
            bucket.buffers["exp_avg_sq_fresh"].copy_(v)
        updates = bucket.view(F.adam_direction_(bucket.scratch("update"), m, v, group["eps"]))
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, as_float(bucket.params), alpha=group["weight_decay"])
        coeff = F.lamb_trust_ratio(self._norms(bucket, bucket.params), self._norms(bucket, updates), group["min_coeff"],
                                   group["max_coeff"])
        if self._in_warmup(t) and self.trust_ratio == "frozen":
            frozen = bucket.scalars["lamb_coeff_freeze"]
            frozen.mul_(self.coeff_beta).add_(coeff, alpha=1 - self.coeff_beta)
        self._apply(bucket, updates, coeff, group["lr"])

    def _schedule_step(self, t: int) -> None:
        # (the lazy buffers are allocated before the step, so that a tensor without a gradient keeps
        # them as they are, as its other state)
        super()._schedule_step(t)
        if t == self.freeze_step and self.trust_ratio == "frozen":
            for bucket in self._buckets:
                self._allocate(bucket, "exp_avg_sq_fresh")
        if self.trust_ratio == "live" and self.plan_for(t).compress:
            for bucket in self._buckets:
                if bucket.compression is not None and "smoothed_update" not in bucket.buffers:
                    # from the warmup's last m / d (or, after a load without it, the momentum's)
                    self._allocate(bucket, "smoothed_update")
                    eps = self.param_groups[bucket.group_index]["eps"]
                    self._direction(bucket, eps, bucket.buffers["smoothed_update"])

    def _compress_input(self, bucket: Bucket, grads: list[torch.Tensor | None], group: dict[str, Any], t: int,
                        staged: bool = False) -> torch.Tensor:
        if self.trust_ratio == "frozen":
            bucket.scratch("prev").copy_(bucket.buffers["exp_avg"])
        return super()._compress_input(bucket, grads, group, t, staged)

    def _on_compression(self, buckets: list[Bucket], keeps: list[torch.Tensor], t: int, dead: int) -> None:
        super()._on_compression(buckets, keeps, t, dead)
        if self.trust_ratio == "frozen":
            for bucket, keep in zip(buckets, keeps):  # 1 where the momentum is live: where f is measured
                bucket.scratch("live").copy_(keep)

    def _update_compressed(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """After the 1-bit average of the momentum: ``p -= lr c (m / d + wd p)``, ``c`` this step's
        trust ratio (``"live"``) or the frozen one times the factor ``f`` (``"frozen"``)."""
        if self.trust_ratio == "frozen":
            self._update_frozen(bucket, group, t)
            return
        weight_decay = group["weight_decay"]
        flat = self._direction(bucket, group["eps"], bucket.scratch("update"))
        smoothed = bucket.buffers["smoothed_update"].mul_(SMOOTHING).add_(flat, alpha=1 - SMOOTHING)
        params = as_float(bucket.params)
        if weight_decay != 0:  # ||smoothed + wd p|| in the update's buffer, then the update itself in it
            torch._foreach_add_(bucket.view(flat.copy_(smoothed)), params, alpha=weight_decay)
            denominators = self._norms(bucket, bucket.view(flat))
            self._direction(bucket, group["eps"], flat)
            torch._foreach_add_(bucket.view(flat), params, alpha=weight_decay)
        else:
            denominators = self._norms(bucket, bucket.view(smoothed))
        updates = bucket.view(flat)
        coeff = F.lamb_trust_ratio(self._norms(bucket, bucket.params), denominators, group["min_coeff"],
                                   group["max_coeff"])
        self._apply(bucket, updates, coeff, group["lr"])
        self._release_variance(bucket)

    def _reads_only_denominator(self) -> bool:
        return self.trust_ratio == "live"  # ("frozen" reads the variance for its factor)

    def _direction(self, bucket: Bucket, eps: float, out: torch.Tensor) -> torch.Tensor:
        """``m / d`` into ``out`` (with a bfloat16 preconditioner: ``m * (1 / d)``)."""
        if self.preconditioner_dtype != torch.float32:
            return F.mul_widened(bucket.buffers["exp_avg"], self._frozen_denominator.inverse(bucket, eps).inverse, out)
        return torch.div(bucket.buffers["exp_avg"], self._frozen_denominator.get(bucket, eps).flat, out=out)

    def _denominator(self, bucket: Bucket, eps: float) -> torch.Tensor:
        """``d``, flat: the cached one, or with a bfloat16 preconditioner (which holds ``1 / d``
        alone) one derived for this step."""
        if self.preconditioner_dtype != torch.float32:
            return F.adam_denominator_(torch.empty_like(bucket.buffers["exp_avg_sq"]), bucket.buffers["exp_avg_sq"], eps)
        return self._frozen_denominator.get(bucket, eps).flat

    def _update_frozen(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """DeepSpeed's rule: the fresh variance from the reconstructed gradient, the factor, and
        ``p -= lr c_frozen f (m / d + wd p)``."""
        beta1, beta2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        m = bucket.buffers["exp_avg"]
        fresh = bucket.buffers["exp_avg_sq_fresh"]
        work = F.reconstructed_grad_(bucket.scratch("prev"), m, beta1)
        fresh.mul_(beta2).addcmul_(work, work, value=1 - beta2)
        denominator = self._denominator(bucket, eps)
        ratio = F.adam_denominator_(work, fresh, eps)
        torch.div(denominator, ratio, out=ratio).mul_(bucket.scratch("live"))
        max_ratio = _maxima(bucket, bucket.view(ratio))
        updates = bucket.view(torch.div(m, denominator, out=bucket.scratch("update")))
        prelim_norms = update_norms = None
        if weight_decay != 0:
            prelim_norms = self._norms(bucket, updates)
            torch._foreach_add_(updates, as_float(bucket.params), alpha=weight_decay)
            update_norms = self._norms(bucket, updates)
        last = bucket.scalars["last_factor"]
        last.copy_(F.lamb_factor(max_ratio, prelim_norms, update_norms, last, self.factor_min, self.factor_max,
                                 self.factor_threshold))
        self._apply(bucket, updates, bucket.scalars["lamb_coeff_freeze"] * last, group["lr"])
        # f at its ceiling: the fresh variance has fallen far below the frozen one somewhere (the
        # BERT example's divergence with beta2 0.98 started so). Same value on every rank.
        ceiling = last >= self.factor_max
        self._health.flag(f"factor{id(bucket)}", bool(ceiling.any()),
                          lambda: f"step {t}: 1-bit LAMB's factor reached factor_max={self.factor_max:g} for "
                          f"{int(ceiling.sum())} tensor(s) of param group {bucket.group_index}; the fresh variance is "
                          "far below the frozen one and the run may be diverging: raise beta2 (e.g. 0.999), "
                          "lower factor_max or the learning rate", self._backend.rank)

    def comm_stats(self) -> dict[str, Any]:
        """:meth:`OnebitOptimizer.comm_stats`, plus ``max_factor``: the largest per-tensor factor
        ``f`` of the last compression step (1.0 before, and always with ``trust_ratio="live"``),
        the first sign of a diverging run under ``"frozen"``."""
        stats = super().comm_stats()
        factors = [float(b.scalars["last_factor"].max()) for b in self._buckets if len(b.params)]
        stats["max_factor"] = max(factors, default=1.0)
        return stats

    def _norms(self, bucket: Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Each tensor's L2 norm; of the whole tensor for a DTensor shard (its shards' squares summed)."""
        norms = torch.stack(torch._foreach_norm(as_float(tensors)))
        if not bucket.sharded:
            return norms
        return reduce_over_shards_(norms.square(), bucket.owners, torch.distributed.ReduceOp.SUM).sqrt_()

    @staticmethod
    def _apply(bucket: Bucket, updates: list[torch.Tensor], coeff: torch.Tensor, lr: float) -> None:
        """``p -= lr * coeff_i * u_i`` per tensor (one host read of the coefficients)."""
        torch._foreach_mul_(updates, [-lr * c for c in coeff.tolist()])
        add_to_params_(bucket, updates)


def _maxima(bucket: Bucket, views: list[torch.Tensor]) -> torch.Tensor:
    """The maximum of each view (1 for an empty tensor, whose factor is then neutral); of the whole
    tensor for a DTensor shard (the views are >= 0: an empty shard counts 0)."""
    if not bucket.sharded:
        if all(v.numel() for v in views):
            return torch.stack(torch._foreach_max(views))
        return torch.stack([v.max() if v.numel() else v.new_ones(()) for v in views])
    local = torch.stack([v.max() if v.numel() else v.new_zeros(()) for v in views])
    whole = reduce_over_shards_(local, bucket.owners, torch.distributed.ReduceOp.MAX)
    empty = torch.tensor([p.numel() == 0 for p in bucket.owners], device=whole.device)
    return whole.masked_fill_(empty, 1.0)
