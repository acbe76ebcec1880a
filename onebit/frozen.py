"""What 1-bit Adam and 1-bit LAMB share: ``freeze_step`` warmup steps that average gradients in
full precision, then a frozen variance and a momentum averaged with the 1-bit all-reduce."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch

from . import functional as F
from . import autofreeze
from .autofreeze import AutoFreeze
from .buckets import Bucket
from .engine import OnebitOptimizer, StepPlan
from .spec import Schedule, Setting, StateSpec
from .validation import check_compression_space, check_int, check_update_bound, is_int, preconditioner_dtype_of

logger = logging.getLogger(__name__)

__all__ = ["FrozenVarianceOptimizer", "WARMUP", "COMPRESSION"]

#: ``update_bound="auto"``: this bound in the preconditioned space, none in the momentum space
#: (measured in ``examples/bert/README.md``: the bound made 1-bit LAMB end 0.03-0.06 closer to LAMB,
#: kept DeepSpeed's defaults from a 92,799 lr step, and left the demo within the runs' noise).
AUTO_UPDATE_BOUND = 1.0

_FLOAT32_MAX = torch.finfo(torch.float32).max

WARMUP = StepPlan("warmup", average_gradients=True)
COMPRESSION = StepPlan("compression", compress=True)


def _saved_freeze_step(value: Any, auto: bool = True) -> int | None:
    """A saved ``freeze_step``: an int, or ``"auto"`` (None: undecided) where ``auto`` (its
    ``auto_freeze`` state was saved too)."""
    if auto and isinstance(value, str) and value == "auto":
        return None
    if not is_int(value, 1):
        raise ValueError(f"freeze_step must be an int >= 1 (or 'auto' with its auto_freeze state), got {value!r}")
    return value


def _auto_has_its_state(values: dict[str, Any]) -> None:
    if values["freeze_step"] is None and values["_auto"] is None:
        _saved_freeze_step("auto", auto=False)


def _note_unused_bound(opt: FrozenVarianceOptimizer) -> None:
    """After a load: an ``update_bound`` given to the constructor clamps nothing in a restored
    momentum space; the bfloat16 state that ``"auto"`` chose for the preconditioned space stays in
    it (DeepSpeed's numerics need float32 state)."""
    if opt._speaks and opt._bound_given and opt._bound_setting is not None and opt.compression_space != "preconditioned":
        logger.warning("onebit: update_bound=%g clamps nothing in the momentum space restored from the checkpoint",
                       opt._bound_setting)
    wide = opt.preconditioner_dtype == opt.error_dtype == torch.float32
    if opt._speaks and opt.compression_space == "momentum" and opt._built_compact and not wide:
        logger.warning("onebit: the checkpoint restores compression_space='momentum' into a %s built for the "
                       "preconditioned space, whose bfloat16 state ('auto') stays: DeepSpeed's numerics need float32 "
                       "state; build it with compression_space='momentum' (or preconditioner_dtype=torch.float32, "
                       "error_dtype=torch.float32) for them", type(opt).__name__)


@dataclass
class _Frozen:
    key: tuple[float, float]  # (eps, bc2)
    version: int  # the bucket's version it was derived at
    flat: torch.Tensor | None  # d = sqrt(v / bc2) + eps over the padded buffer (float32; None in bfloat16)
    views: list[torch.Tensor]  # its per-parameter views (of the inverse in bfloat16)
    inverse: torch.Tensor | None = None  # 1 / d, 0 where the momentum is kept 0
    held: bool = False  # the state itself, the variance released (bfloat16 1 / d: FrozenDenominator.hold)


#: Elements of ``d`` derived at a time for a bfloat16 preconditioner (its float32 temporaries)
_CHUNK = 1 << 20

#: The variance a bfloat16 ``1 / d`` stands for is at least float32's smallest subnormal where
#: ``1 / d`` is not 0 (below ``eps``'s resolution a smaller one would read as a zero variance)
_SMALLEST = 2.0**-149


class FrozenDenominator:
    """What 1-bit Adam and 1-bit LAMB derive from a bucket's frozen variance ``v``, for one
    ``(eps, bc2)`` at a time: the denominator ``d = sqrt(v / bc2) + eps`` (:meth:`get`: flat, and
    per-parameter views) and the preconditioner ``1 / d``, 0 where the momentum is kept 0 (zero
    variance, masks, padding; :meth:`preconditioner`). Derived when first asked for, and again for
    another ``(eps, bc2)`` or once the bucket's state changed from outside a step
    (:meth:`onebit.buckets.Bucket.invalidate`); :meth:`forget` drops everything.

    ``dtype=torch.bfloat16`` (``preconditioner_dtype``): only ``1 / d`` is held, computed in float32
    (a million elements at a time) and rounded once to bfloat16 (:meth:`inverse`); what needs ``d``
    divides by it, or multiplies by ``1 / d``, instead."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self._entries: weakref.WeakKeyDictionary[Bucket, _Frozen] = weakref.WeakKeyDictionary()

    def _current(self, bucket: Bucket, eps: float, bc2: float) -> _Frozen | None:
        entry = self._entries.get(bucket)
        if entry is None or entry.key != (eps, bc2):
            return None
        return entry if entry.held or entry.version == bucket.version else None  # (a held one is the state)

    def get(self, bucket: Bucket, eps: float, bc2: float = 1.0) -> _Frozen:
        """``d`` (float32 only)."""
        if self.dtype != torch.float32:
            raise RuntimeError("a bfloat16 preconditioner holds 1 / d only: use inverse()")
        entry = self._current(bucket, eps, bc2)
        if entry is None:
            held = self.held(bucket)  # (another eps: derived again from the variance the held d stands for)
            v = self.variance(bucket) if held else bucket.buffers["exp_avg_sq"]
            flat = F.adam_denominator_(torch.empty_like(v), v, eps, bc2)
            entry = _Frozen((eps, bc2), bucket.version, flat, bucket.view(flat))
            if held:  # (what the held entry stands for: 1 / d with it)
                entry.inverse, entry.held = self._inverse_of(entry.flat, v, bucket.mask), True
            self._entries[bucket] = entry
        return entry

    @staticmethod
    def _inverse_of(flat: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return torch.reciprocal(flat).masked_fill_(F.kept_still(v, mask), 0.0)

    def preconditioner(self, bucket: Bucket, eps: float, bc2: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(1 / d, d)``, flat (``d`` None in bfloat16)."""
        if self.dtype != torch.float32:
            return self.inverse(bucket, eps, bc2).inverse, None
        entry = self.get(bucket, eps, bc2)
        if entry.inverse is None:  # (a held entry has it)
            entry.inverse = self._inverse_of(entry.flat, bucket.buffers["exp_avg_sq"], bucket.mask)
        return entry.inverse, entry.flat

    def inverse(self, bucket: Bucket, eps: float, bc2: float = 1.0) -> _Frozen:
        """``1 / d`` in bfloat16 (flat, and per-parameter views), 0 where the momentum is kept 0:
        each value the float32 one rounded once (a float32 cache: :meth:`preconditioner`)."""
        if self.dtype == torch.float32:
            raise RuntimeError("a float32 preconditioner holds d and 1 / d: use preconditioner() or get()")
        entry = self._current(bucket, eps, bc2)
        if entry is None:
            held = self.held(bucket)  # (another eps: derived again from the variance the held 1 / d stands for)
            v, mask = self.variance(bucket) if held else bucket.buffers["exp_avg_sq"], bucket.mask
            inverse = torch.empty_like(v, dtype=self.dtype)
            for start in range(0, v.numel(), _CHUNK):
                part = slice(start, start + _CHUNK)
                d = F.adam_denominator_(torch.empty_like(v[part]), v[part], eps, bc2)
                still = F.kept_still(v[part], None if mask is None else mask[part])
                inverse[part].copy_(torch.reciprocal(d).masked_fill_(still, 0.0))
            entry = self._entries[bucket] = _Frozen((eps, bc2), bucket.version, None, bucket.view(inverse), inverse,
                                                    held)
        return entry

    def hold(self, bucket: Bucket, eps: float, bc2: float) -> None:
        """Make the bfloat16 ``1 / d`` of ``bucket`` (float32: ``d`` and ``1 / d``) the state
        itself: the caller releases the variance, which :meth:`variance` gives back when needed (a
        state dict, a new layout)."""
        if self.dtype == torch.float32:
            self.preconditioner(bucket, eps, bc2)
            self._entries[bucket].held = True
        else:
            self.inverse(bucket, eps, bc2).held = True

    def held(self, bucket: Bucket) -> bool:
        entry = self._entries.get(bucket)
        return entry is not None and entry.held

    def held_inverse(self, bucket: Bucket) -> torch.Tensor:
        """The held ``1 / d`` (flat; 0 where the variance is)."""
        return self._entries[bucket].inverse

    def variance(self, bucket: Bucket, out: torch.Tensor | None = None, where: slice = slice(None)) -> torch.Tensor:
        """The frozen variance that the held ``1 / d`` of ``bucket`` stands for (flat, float32, over
        ``where`` of the padded buffer, into ``out`` if given): ``v = (1 / inv - eps)**2 * bc2`` in
        float64, at least :data:`_SMALLEST` and at most float32's largest; 0 where ``1 / d`` is 0
        (a variance of 0, the padding; buckets with a momentum mask are not held). Derived again
        (:meth:`inverse`), it gives the same ``1 / d``, bit for bit: the state dict of a held
        bucket resumes exactly (``tests/test_released_variance.py`` checks every float32 exponent
        for several ``eps`` and ``bc2``). Of a held float32 ``d``: a variance that gives it, bit
        for bit (:func:`onebit.functional.variance_of_denominator`)."""
        entry = self._entries[bucket]
        eps, bc2 = entry.key
        if self.dtype == torch.float32:
            return F.variance_of_denominator(entry.flat[where], eps, bc2, entry.inverse[where] != 0, out)
        inverse = entry.inverse[where]
        v = torch.empty(inverse.shape, dtype=torch.float32, device=inverse.device) if out is None else out
        for start in range(0, inverse.numel(), _CHUNK):
            part = inverse[start:start + _CHUNK]
            root = torch.reciprocal(part.double()).sub_(eps).clamp_(min=0.0)
            wide = root.mul_(root).mul_(bc2).clamp_(min=_SMALLEST, max=_FLOAT32_MAX)
            v[start:start + _CHUNK].copy_(wide.masked_fill_(part == 0, 0.0))
        return v

    def forget(self) -> None:
        self._entries.clear()


#: The schedule of 1-bit Adam and 1-bit LAMB in state dicts: ``freeze_step`` (``"auto"`` while
#: undecided), the compression space (a checkpoint without it is of the momentum space, the
#: default before 2026-11-26) and, with ``freeze_step="auto"``, what the decision compares with.
#: The checkpoint's settings win: its compression errors (exact resume) are of its space.
SCHEDULE = Schedule(
    (Setting("freeze_step", _saved_freeze_step, save=lambda step: "auto" if step is None else step),
     Setting("compression_space", partial(check_compression_space, saved=True), absent="momentum"),
     Setting("auto_freeze", AutoFreeze.from_state, attribute="_auto", absent=None, omit=None, save=AutoFreeze.state,
             logged=False)),
    check_all=_auto_has_its_state, after_load=_note_unused_bound)


class FrozenVarianceOptimizer(OnebitOptimizer):
    """Steps ``1..freeze_step`` are :data:`WARMUP` (full-precision gradient average), every later
    step is :data:`COMPRESSION`: each rank updates its momentum ``exp_avg`` with its local gradient
    and the momenta are averaged with the compressed all-reduce; the variance ``exp_avg_sq`` is
    frozen. Coordinates whose frozen variance is exactly 0 keep a zero momentum (their update
    ``m / (sqrt(v) + eps)`` would be ``+-scale / eps``: 1 bit cannot encode 0)."""

    PLAN_NAMES: ClassVar[tuple[str, ...]] = (WARMUP.name, COMPRESSION.name)
    _STAGED_PLANS: ClassVar[frozenset[str]] = frozenset({COMPRESSION.name})
    STATE: ClassVar[StateSpec] = StateSpec(buffers=("exp_avg", "exp_avg_sq"), nonnegative=("exp_avg_sq",),
                                           masked="exp_avg", schedule=SCHEDULE)
    #: Whether nothing but ``d`` and ``1 / d`` are read from the frozen variance in compression (see
    #: :meth:`_releases_variance`)
    _VARIANCE_RELEASED: ClassVar[bool] = False
    #: Whether ``"auto"`` holds the state in bfloat16 in the preconditioned space (see :meth:`_auto_dtype`)
    _COMPACT_BY_DEFAULT: ClassVar[bool] = False

    def __init__(self, params: Any, defaults: dict[str, Any], freeze_step: int | str, compression_space: str = "preconditioned",
                 freeze_bounds: tuple[int, int | None] | None = None, update_bound: float | str | None = "auto",
                 preconditioner_dtype: Any = None, **options: Any) -> None:
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
        # ("auto" chose bfloat16 for this space: said if a load restores the other one)
        self._built_compact = self._auto_dtype() != torch.float32
        self.preconditioner_dtype = preconditioner_dtype_of(preconditioner_dtype, self._auto_dtype())
        self._frozen_denominator = FrozenDenominator(self.preconditioner_dtype)
        super().__init__(params, defaults, **options)
        if update_bound is not None and self._bound_given:
            for group in self.param_groups:
                if F.adam_largest_ratio(*group["betas"]) is None:
                    raise ValueError(f"update_bound needs beta1**2 < beta2 (Adam's largest step is unbounded "
                                     f"otherwise), got betas {group['betas']}; pass update_bound=None")

    def _auto_dtype(self) -> torch.dtype:
        """``"auto"``'s ``preconditioner_dtype`` and ``error_dtype``: bfloat16 in the preconditioned
        space where the numbers chose it (``_COMPACT_BY_DEFAULT``: 1-bit Adam, whose BERT runs
        ended within 0.0011 of float32 state), float32 in the momentum space (DeepSpeed's numerics,
        exactly). Decided at construction: a checkpoint that restores another space keeps it."""
        compact = self._COMPACT_BY_DEFAULT and self.compression_space == "preconditioned"
        return torch.bfloat16 if compact else torch.float32

    def _auto_error_dtype(self) -> torch.dtype:
        return self._auto_dtype()

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
        reason = self._auto.check(t, done, lambda: autofreeze.measure(self._buckets, self.param_groups, done),
                                  speaks=lambda: self._speaks)
        if reason is not None:
            self.freeze_step = t
            if self._speaks:
                logger.info("onebit: step %d: freeze_step='auto' makes this the last warmup step (%s)", t, reason)

    def _dead(self, bucket: Bucket) -> torch.Tensor:
        if "exp_avg_sq" in bucket.buffers:
            return bucket.buffers["exp_avg_sq"] == 0
        return self._frozen_denominator.held_inverse(bucket) == 0  # (released, unmasked: 1 / d is 0 there)

    def _releases_variance(self, bucket: Bucket) -> bool:
        """Whether the compressed ``bucket``'s frozen variance (4 B/param) is released once
        compression starts, the ``1 / d`` that the update reads held instead of it: bfloat16 (2
        B/param) with a bfloat16 preconditioner; float32 ``1 / d`` and ``d`` (held anyway) in the
        preconditioned space (in the momentum space nothing holds ``1 / d``, which tells where the
        variance is 0). Only in an algorithm that needs nothing else from the frozen variance
        (:meth:`_reads_only_denominator`), and with no momentum mask (``1 / d`` is 0 where it is,
        which cannot stand for the variance there: a checkpoint loaded without the mask needs it)."""
        held_anyway = self.preconditioner_dtype != torch.float32 or self.compression_space == "preconditioned"
        return self._reads_only_denominator() and held_anyway and bucket.mask is None

    def _reads_only_denominator(self) -> bool:
        return self._VARIANCE_RELEASED

    def _entering_compression(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:  # (before the keep masks: the warmup's scratch is not the peak's too)
            bucket.release_scratch()  # compression reads p.grad directly (re-allocated if it cannot)

    def _on_compression(self, buckets: list[Bucket], keeps: list[torch.Tensor], t: int, dead: int) -> None:
        if self._speaks:
            what = "variance frozen, switching to" if t == self.freeze_step + 1 else "resuming with"
            logger.info(
                "onebit: step %d: %s 1-bit compressed momentum%s", t, what,
                f"; {dead} coordinates with zero variance keep a zero momentum" if dead else "",
            )

    def _compress_input(self, bucket: Bucket, grads: list[torch.Tensor | None], group: dict[str, Any], t: int,
                        staged: bool = False) -> torch.Tensor:
        """The momentum, updated with the local gradients (the variance stays frozen); its
        average is decoded into ``exp_avg``. Staged (``overlap_backward``): the new momentum is a
        copy, ``exp_avg`` stays as it is until the average is decoded into it. (With
        ``compression_space="preconditioned"`` the codec averages it times ``1 / d``: see
        :meth:`_codec_multipliers`.)"""
        if staged:
            momentum = bucket.scratch("staged")
            F.momentum_into_(bucket.view(momentum), bucket.views["exp_avg"], grads, group["betas"][0])
            return momentum
        F.momentum_(bucket.views["exp_avg"], grads, group["betas"][0])
        return bucket.buffers["exp_avg"]

    def _decode_target(self, bucket: Bucket) -> torch.Tensor:
        return bucket.buffers["exp_avg"]  # the average is the new momentum itself

    def _codec_multipliers(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """With ``compression_space="preconditioned"``: ``u = m / d`` is averaged (``1 / d`` is 0
        where the momentum is kept 0) and the momentum is ``u d`` of the average (with a bfloat16
        preconditioner ``u / (1 / d)``: :meth:`_codec_divisor`), in the codec's own passes where the
        kernels can."""
        if self.compression_space == "momentum":
            return None
        return self._preconditioner(bucket, self.param_groups[bucket.group_index])

    def _codec_divisor(self, bucket: Bucket) -> torch.Tensor | None:
        """With a bfloat16 preconditioner in the preconditioned space: ``1 / d``, which the decoded
        average is divided by (0 where it is 0)."""
        if self.compression_space == "momentum" or self.preconditioner_dtype == torch.float32:
            return None
        return self._preconditioner(bucket, self.param_groups[bucket.group_index])[0]

    def _codec_bound(self, bucket: Bucket, t: int) -> float | None:
        """With ``update_bound``: ``u = m / d`` is clamped to ``+-update_bound B bc1`` (``B``:
        :func:`onebit.functional.adam_largest_ratio` of the group's betas), so that no coordinate's
        ``(m / bc1) / d`` exceeds ``update_bound`` times Adam's own largest."""
        if self.update_bound is None:
            return None
        group = self.param_groups[bucket.group_index]
        beta1, beta2 = group["betas"]
        bound = F.update_bound(self.update_bound, beta1, beta2)
        if bound is None:  # betas changed since the constructor checked them (or "auto"): no bound to give
            if self._speaks and self._bound_given and bucket.group_index not in self._unbounded:
                logger.warning("onebit: param group %d's betas %s make Adam's largest step unbounded "
                               "(beta1**2 >= beta2): its update_bound=%g clamps nothing", bucket.group_index,
                               group["betas"], self.update_bound)
            self._unbounded.add(bucket.group_index)
            return None
        bound *= F.bias_corrections(t, t, beta1, beta2, group.get("bias_correction", False))[0]
        return bound if bound < _FLOAT32_MAX else None  # one float32 cannot hold clamps nothing

    def _preconditioner(self, bucket: Bucket, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(1 / d, d)`` over the padded buffer for the frozen ``d = sqrt(v / bc2) + eps`` (see
        :class:`FrozenDenominator`; ``d`` None with a bfloat16 preconditioner)."""
        return self._frozen_denominator.preconditioner(bucket, group["eps"], self._frozen_bc2(group))

    def _frozen_bc2(self, group: dict[str, Any]) -> float:
        return F.bias_corrections(self.freeze_step, self.freeze_step, *group["betas"],
                                  group.get("bias_correction", False))[1]

    def _release_variance(self, bucket: Bucket) -> None:
        """With :meth:`_releases_variance`: hold the compressed ``bucket``'s ``1 / d`` instead of its
        variance (after its first compressed update: a step skipped everywhere releases nothing,
        whether ``overlap_backward`` began it or not; and after a load or a new layout past it)."""
        if self._releases_variance(bucket) and "exp_avg_sq" in bucket.buffers:
            group = self.param_groups[bucket.group_index]
            self._frozen_denominator.hold(bucket, group["eps"], self._frozen_bc2(group))
            self._release(bucket, "exp_avg_sq")

    def _bring_back(self) -> None:
        """The variance of every bucket that released it, derived again from its held ``1 / d``,
        back in the bucket and the state (:meth:`FrozenDenominator.variance`)."""
        for bucket in self._buckets:
            if self._frozen_denominator.held(bucket) and "exp_avg_sq" not in bucket.buffers:
                self._allocate(bucket, "exp_avg_sq")
                self._frozen_denominator.variance(bucket, out=bucket.buffers["exp_avg_sq"])

    def _released_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """A released variance as the state dict holds it: derived again from the held ``1 / d``."""
        saved: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for bucket in self._buckets:
            if self._frozen_denominator.held(bucket) and "exp_avg_sq" not in bucket.buffers:
                saved.update({p: {"exp_avg_sq": self._frozen_denominator.variance(bucket, where=s).view(q.shape)}
                              for p, q, s in zip(bucket.owners, bucket.params, bucket.slices)})
        return saved

    def _forget(self) -> None:
        self._bring_back()  # (a load has put it back already: what it loaded stays)
        self._frozen_denominator.forget()
        if self.freeze_step is not None and self._step > self.freeze_step:  # past the switch: released again now
            for bucket in self._buckets:
                if bucket.compression is not None:
                    self._release_variance(bucket)


def _pair(bounds: Any) -> tuple[Any, Any]:
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"freeze_bounds must be (earliest, latest) steps, latest None for no bound; got {bounds!r}")
    return bounds[0], bounds[1]
