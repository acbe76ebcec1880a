"""What 1-bit Adam and 1-bit LAMB share: ``freeze_step`` warmup steps that average gradients in
full precision, then a frozen variance and a momentum averaged with the 1-bit all-reduce."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from . import functional as F
from . import autofreeze
from .autofreeze import AutoFreeze
from .buckets import Bucket
from .engine import OnebitOptimizer, StepPlan
from .validation import check_compression_space, check_int, check_update_bound, is_int

logger = logging.getLogger(__name__)

__all__ = ["FrozenVarianceOptimizer", "WARMUP", "COMPRESSION"]

#: ``update_bound="auto"``: this bound in the preconditioned space, none in the momentum space
#: (measured in ``examples/bert/README.md``: the bound made 1-bit LAMB end 0.03-0.06 closer to LAMB,
#: kept DeepSpeed's defaults from a 92,799 lr step, and left the demo within the runs' noise).
AUTO_UPDATE_BOUND = 1.0

_FLOAT32_MAX = torch.finfo(torch.float32).max

WARMUP = StepPlan("warmup", average_gradients=True)
COMPRESSION = StepPlan("compression", compress=True)


class FrozenVarianceOptimizer(OnebitOptimizer):
    """Steps ``1..freeze_step`` are :data:`WARMUP` (full-precision gradient average), every later
    step is :data:`COMPRESSION`: each rank updates its momentum ``exp_avg`` with its local gradient
    and the momenta are averaged with the compressed all-reduce; the variance ``exp_avg_sq`` is
    frozen. Coordinates whose frozen variance is exactly 0 keep a zero momentum (their update
    ``m / (sqrt(v) + eps)`` would be ``+-scale / eps``: 1 bit cannot encode 0)."""

    PLAN_NAMES: ClassVar[tuple[str, ...]] = (WARMUP.name, COMPRESSION.name)
    _STAGED_PLANS: ClassVar[frozenset[str]] = frozenset({COMPRESSION.name})
    _BUFFERS: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    _NONNEGATIVE: ClassVar[tuple[str, ...]] = ("exp_avg_sq",)

    def __init__(self, params: Any, defaults: dict[str, Any], freeze_step: int | str, compression_space: str = "preconditioned",
                 freeze_bounds: tuple[int, int | None] | None = None, update_bound: float | str | None = "auto",
                 **options: Any) -> None:
        self._auto: AutoFreeze | None = None
        if freeze_step == "auto":
            low, high = (autofreeze.MIN_STEPS, None) if freeze_bounds is None else _pair(freeze_bounds)
            autofreeze.check_bounds(low, high)
            self._auto = AutoFreeze(low, high)
            freeze_step = None
        else:
            if isinstance(freeze_step, str):
                raise ValueError(f"invalid freeze_step {freeze_step!r}: give an int >= 1 or 'auto'")
            check_int("freeze_step", freeze_step, 1, ", because the variance is frozen after freeze_step steps of "
                      "full-precision warmup and a zero variance would make the update m / eps")
            if freeze_bounds is not None:
                raise ValueError(f"freeze_bounds={freeze_bounds!r} applies only to freeze_step='auto' (got "
                                 f"freeze_step={freeze_step}); drop it or pass freeze_step='auto'")
        check_compression_space(compression_space)
        # "auto": the bound where it applies, and quietly none for a group whose betas leave Adam's
        # step unbounded (an explicit bound there is refused)
        if isinstance(update_bound, str) and update_bound != "auto":
            raise ValueError(f"invalid update_bound {update_bound!r}: give 'auto' (the default), a number > 0 "
                             "(1: Adam's own largest step) or None for no bound")
        self._bound_given = update_bound != "auto"
        if self._bound_given:
            check_update_bound(update_bound)
            if update_bound is not None and compression_space != "preconditioned":
                raise ValueError(f"update_bound={update_bound!r} clamps m / d, which only compression_space='preconditioned' "
                                 f"compresses (got {compression_space!r}); pass that space or update_bound=None")
        self.freeze_step: int | None = freeze_step  # None: 'auto', not decided yet
        self.compression_space = compression_space
        # "auto" or the bound given; resolved against the space in force (a checkpoint may restore another)
        self._bound_setting: float | str | None = update_bound
        self._unbounded: set[int] = set()  # the groups whose betas left update_bound nothing to clamp (said once)
        super().__init__(params, defaults, **options)
        if update_bound is not None and self._bound_given:
            for group in self.param_groups:
                if F.adam_largest_ratio(*group["betas"]) is None:
                    raise ValueError(f"update_bound needs beta1**2 < beta2 (Adam's largest step is unbounded "
                                     f"otherwise), got betas {group['betas']}; pass update_bound=None")

    @property
    def update_bound(self) -> float | None:
        """The clamp of ``m / d`` in force: ``"auto"`` is :data:`AUTO_UPDATE_BOUND` in the
        preconditioned space; in the momentum space (given, or restored from a checkpoint) nothing
        is clamped."""
        if self.compression_space != "preconditioned":
            return None
        return AUTO_UPDATE_BOUND if self._bound_setting == "auto" else self._bound_setting

    def plan_for(self, step: int) -> StepPlan:
        if self.freeze_step is None:  # 'auto', undecided: warmup until it decides, at the latest bound at most
            latest = self._auto.max_steps
            return COMPRESSION if latest is not None and step > latest else WARMUP
        return WARMUP if step <= self.freeze_step else COMPRESSION

    def _in_warmup(self, t: int) -> bool:
        return self.freeze_step is None or t <= self.freeze_step

    def _schedule_step(self, t: int) -> None:
        """With ``freeze_step='auto'``, undecided: whether step ``t`` is the last warmup step, from
        the variance after the steps before it (so that the last warmup step runs as it does with a
        fixed ``freeze_step``)."""
        if self._auto is None or self.freeze_step is not None:
            return
        done = self._step
        reason = self._auto.check(t, done, lambda: autofreeze.measure(self._buckets, self.param_groups, done))
        if reason is not None:
            self.freeze_step = t
            if self._speaks:
                logger.info("onebit: step %d: freeze_step='auto' makes this the last warmup step (%s)", t, reason)

    def _dead(self, bucket: Bucket) -> torch.Tensor:
        return bucket.buffers["exp_avg_sq"] == 0

    def _on_compression(self, buckets: list[Bucket], keeps: list[torch.Tensor], t: int, dead: int) -> None:
        for bucket in buckets:
            bucket.release_scratch()  # compression reads p.grad directly (re-allocated if it cannot)
        if self._speaks:
            what = "variance frozen, switching to" if t == self.freeze_step + 1 else "resuming with"
            logger.info(
                "onebit: step %d: %s 1-bit compressed momentum%s", t, what,
                f"; {dead} coordinates with zero variance keep a zero momentum" if dead else "",
            )

    def _compress_input(self, bucket: Bucket, grads: list[torch.Tensor | None], group: dict[str, Any], t: int) -> torch.Tensor:
        """The momentum, updated with the local gradients (the variance stays frozen); its
        average is decoded into ``exp_avg``. Staged (``overlap_backward``): the new momentum is a
        copy, ``exp_avg`` stays as it is until the average is decoded into it. (With
        ``compression_space="preconditioned"`` the codec averages it times ``1 / d``: see
        :meth:`_codec_multipliers`.)"""
        if self._staging:
            momentum = bucket.scratch("staged")
            F.momentum_into_(bucket.view(momentum), bucket.views["exp_avg"], grads, group["betas"][0])
            return momentum
        F.momentum_(bucket.views["exp_avg"], grads, group["betas"][0])
        return bucket.buffers["exp_avg"]

    def _decode_target(self, bucket: Bucket) -> torch.Tensor:
        return bucket.buffers["exp_avg"]  # the average is the new momentum itself

    def _codec_multipliers(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With ``compression_space="preconditioned"``: ``u = m / d`` is averaged (``1 / d`` is 0
        where the momentum is kept 0) and the momentum is ``u d`` of the average, in the codec's
        own passes where the kernels can."""
        if self.compression_space == "momentum":
            return None
        return self._preconditioner(bucket, self.param_groups[bucket.group_index])

    def _codec_bound(self, bucket: Bucket, t: int) -> float | None:
        """With ``update_bound``: ``u = m / d`` is clamped to ``+-update_bound B bc1`` (``B``:
        :func:`onebit.functional.adam_largest_ratio` of the group's betas), so that no coordinate's
        ``(m / bc1) / d`` exceeds ``update_bound`` times Adam's own largest."""
        if self.update_bound is None:
            return None
        group = self.param_groups[bucket.group_index]
        beta1, beta2 = group["betas"]
        largest = F.adam_largest_ratio(beta1, beta2)
        if largest is None:  # betas changed since the constructor checked them (or "auto"): no bound to give
            if self._speaks and self._bound_given and bucket.group_index not in self._unbounded:
                logger.warning("onebit: param group %d's betas %s make Adam's largest step unbounded "
                               "(beta1**2 >= beta2): its update_bound=%g clamps nothing", bucket.group_index,
                               group["betas"], self.update_bound)
            self._unbounded.add(bucket.group_index)
            return None
        bc1 = F.bias_corrections(t, t, beta1, beta2, group.get("bias_correction", False))[0]
        bound = self.update_bound * largest * bc1
        return bound if bound < _FLOAT32_MAX else None  # one float32 cannot hold clamps nothing

    def _preconditioner(self, bucket: Bucket, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(1 / d, d)`` over the padded buffer for the frozen ``d = sqrt(v / bc2) + eps``, ``1 / d``
        0 where the momentum is kept 0 (zero variance, masks, padding): derived once per
        ``(eps, bc2)`` (and again after an invalidation)."""
        bc2 = F.bias_corrections(self.freeze_step, self.freeze_step, *group["betas"],
                                 group.get("bias_correction", False))[1]
        self._frozen_denominator(bucket, group["eps"], bc2)
        derived = bucket.derived
        if derived.preconditioner is None or derived.preconditioner_key != derived.denominator_key:
            still = bucket.buffers["exp_avg_sq"] == 0
            if bucket.mask is not None:
                still |= bucket.mask == 0
            derived.preconditioner = torch.reciprocal(derived.denominator).masked_fill_(still, 0.0)
            derived.preconditioner_key = derived.denominator_key
        return derived.preconditioner, derived.denominator

    @staticmethod
    def _frozen_denominator(bucket: Bucket, eps: float, bc2: float = 1.0) -> list[torch.Tensor]:
        """Per-parameter views of ``sqrt(v / bc2) + eps`` of the frozen variance, computed once per
        ``(eps, bc2)`` (and again after a load)."""
        key = (eps, bc2)
        if bucket.derived.denominator is None or bucket.derived.denominator_key != key:
            v = bucket.buffers["exp_avg_sq"]
            bucket.derived.denominator = F.adam_denominator_(torch.empty_like(v), v, eps, bc2)
            bucket.derived.denominators = bucket.view(bucket.derived.denominator)
            bucket.derived.denominator_key = key
        return bucket.derived.denominators

    def _schedule_state(self) -> dict[str, Any]:
        # (a checkpoint without compression_space is of the momentum space, the default before 2026-11-26)
        space = {"compression_space": self.compression_space}
        # 'auto': the step it chose (or "auto" while undecided) and what the decision compares with
        auto = {} if self._auto is None else {"auto_freeze": self._auto.state()}
        return {"freeze_step": "auto" if self.freeze_step is None else self.freeze_step, **space, **auto}

    def _check_schedule(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        freeze_step = meta.get("freeze_step")
        auto = AutoFreeze.from_state(meta["auto_freeze"]) if "auto_freeze" in meta else None
        if freeze_step == "auto" and auto is not None:
            freeze_step = None
        elif not is_int(freeze_step, 1):
            raise ValueError(f"freeze_step must be an int >= 1 (or 'auto' with its auto_freeze state), got {freeze_step!r}")
        space = meta.get("compression_space", "momentum")
        check_compression_space(space, saved=True)
        return {"freeze_step": freeze_step, "compression_space": space, "_auto": auto}

    def _apply_schedule(self, schedule: dict[str, Any]) -> None:
        self._auto = schedule["_auto"]
        # The checkpoint's settings win: its compression errors (exact resume) are of its space.
        for key in ("freeze_step", "compression_space"):
            if schedule[key] != getattr(self, key):
                logger.info("onebit: %s %r restored from the checkpoint (was %r)", key, schedule[key],
                            getattr(self, key))
            setattr(self, key, schedule[key])
        if (self._speaks and self._bound_given and self._bound_setting is not None
                and self.compression_space != "preconditioned"):
            logger.warning("onebit: update_bound=%g clamps nothing in the momentum space restored from the checkpoint",
                           self._bound_setting)


def _pair(bounds: Any) -> tuple[Any, Any]:
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"freeze_bounds must be (earliest, latest) steps, latest None for no bound; got {bounds!r}")
    return bounds[0], bounds[1]
