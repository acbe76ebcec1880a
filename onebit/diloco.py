"""OnebitDiLoCo: local AdamW steps, and every ``sync_every`` steps an outer step on the 1-bit average
of the pseudo-gradient ``global_params - params``."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from . import functional as F
from . import fragments as fragmenting
from . import inner as inner_optimizer
from .buckets import Bucket
from .collectives import compressed_allreduce_
from .engine import OnebitOptimizer
from .layout import ranks_holding_other
from .plan import StepPlan
from .spec import StateSpec
from .exact import ExactAverage
from .streaming import DelayedSync
from .diloco_settings import (COMPRESSIONS, OUTER_BUFFERS, OUTER_STATE, SCHEDULE, _check_delay_fits,
                              _check_error_feedback, _check_fragments, _check_fragments_fit, _check_outer,
                              _check_outer_bits, _check_sync_delay, _check_sync_mix, _streaming_defaults)
from .shards import local
from .validation import DEEPSPEED_COMMON_REFUSED, TORCH_FLAGS, check_choice, check_flag

logger = logging.getLogger(__name__)

__all__ = ["OnebitDiLoCo", "INNER", "OUTER"]

INNER = StepPlan("inner")  # an AdamW step on the local gradient (and an outer step's exchange in flight, finished)
OUTER = StepPlan("outer", compress=True)  # the inner step, then the 1-bit average of the pseudo-gradient
#: the state with ``inner=``: the inner optimizer keeps its own (saved as "inner:<name>" entries)
INNER_STATE = StateSpec(buffers=("global_params", "outer_momentum_buffer", "sync_input"),
                        lazy=("outer_momentum_buffer", "sync_input"),
                        group_keys=("lr",), schedule=SCHEDULE)


class OnebitDiLoCo(DelayedSync, OnebitOptimizer):
    r"""DiLoCo (Douillard et al., 2023, arXiv 2311.08105) with an error-compensated 1-bit outer
    all-reduce, as a plain ``torch.optim.Optimizer``.

    Every rank (a *worker*) takes **inner** steps of AdamW on its own gradient and sends nothing.
    Every ``sync_every``-th step (``H``) is an **outer** step: after its inner step, the
    pseudo-gradient ``delta = global_params - params`` is averaged over the ranks with
    ``outer_bits`` passes of the 1-bit compressed all-reduce (the codec, scales, error feedback and
    transports of the other onebit optimizers; each pass sends what the last left, and the
    residual carries over to the next outer step), and Nesterov momentum SGD moves the global
    parameters with it::

        b = outer_momentum * b + mean(delta)
        global_params -= outer_lr * (mean(delta) + outer_momentum * b)   (on every rank, bit for bit)
        params = global_params - residual          (error_feedback="model", the default: this rank's own)
        params = global_params                     (error_feedback="buffer": on every rank, bit for bit)

    ``global_params`` start as the parameters at construction: every rank must start from the same
    parameters (the first outer step checks it and names the fix). With ``outer_lr=1`` and
    ``outer_momentum=0`` the outer step is the plain average of the workers' parameters.

    The inner step is ``torch.optim.AdamW``'s: ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v +
    (1 - beta2) g^2``, ``p = p (1 - lr weight_decay) - lr (m / bc1) / (sqrt(v / bc2) + eps)``
    (``bc`` the bias corrections, with ``bias_correction``, from the step number); parameters
    without a gradient are left alone, as in torch. Learning-rate schedulers, ``zero_grad`` and
    frozen layers work as with AdamW; the schedule of outer steps comes from the step number alone
    (:attr:`next_plan`, ``comm_stats()`` counts ``"inner"`` and ``"outer"`` steps).

    Bytes: ``outer_bits`` 1-bit all-reduces of the parameters every ``H`` steps, about
    ``outer_bits / H`` bit per parameter per step: 0.0625 at the defaults (1-bit Adam sends about
    1 per step after its warmup). The defaults (H 32, two passes, the residual in the model, the
    plain average; 4 fragments, each exchange landing 2 steps after its outer step) were chosen on
    the BERT example over three seeds and on a 100 Mbit/s link (``docs/guides/tuning.md``).

    Args:
        params: parameters or param groups (a group may set its own ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``bias_correction``).
        lr, betas, eps, weight_decay: the inner AdamW's (decoupled weight decay).
        sync_every: ``H``, the steps between outer steps (an int >= 1); default 32.
        outer_lr: the outer learning rate (> 0); default 1.
        outer_momentum: the outer Nesterov momentum, in ``[0, 1)``; default 0: the outer step is
            then the plain average of the workers' parameters. DiLoCo's published outer step
            (``outer_lr=0.7, outer_momentum=0.9``, for H in the hundreds) ended 7.5% behind Adam
            on the BERT example (600 steps, H 16), the plain average 2.2% (see
            ``docs/guides/tuning.md``).
        compression: ``"onebit"`` (default): the error-compensated 1-bit all-reduce; ``"none"``:
            the exact float32 mean (:class:`onebit.exact.ExactAverage`, 32x the bytes), the twin
            to measure the bit against.
        error_feedback: where the residual (what one bit did not carry of ``delta`` plus the
            last residual) waits for the next outer step (default ``"model"``; with
            ``compression="none"`` there is none): ``"buffer"`` (the classic error feedback:
            in the worker error, added to the next outer step's input; every rank continues from
            the global parameters) or ``"model"`` (in the worker's own parameters: every rank
            continues from ``global_params - residual``, so its inner steps compute their
            gradients where the uncompressed average would have put it, and the next ``delta``
            holds the residual; the worker error is 0 between outer steps). The bytes and the
            global parameters' update are the same; the parameters then differ between ranks by
            their residuals after an outer step too (:meth:`synchronize` averages them).
        outer_bits: the 1-bit passes of each outer step (an int from 1 to 8; default 2; with
            ``compression="none"``, which sends float32, none): pass
            ``k + 1`` sends the residuals that pass ``k`` left (each worker's worker error, each
            server's server error), and the last pass's residuals wait for the next outer step:
            ``k`` passes send ``k`` times the bytes and leave less behind (see
            ``docs/guides/tuning.md``).
        fragments: ``P``, the parts of the parameters that take their outer steps in turn
            (Streaming DiLoCo's fragments, arXiv 2501.18512; its overlap: ``sync_delay``); default
            None: from ``sync_every >= 16`` (the default 32), ``min(4, sync_every // 8)`` fragments
            (as many as the buckets allow, without a refusal); below, 1: every parameter at every
            ``H``-th step. The buckets (of at most ``ceil(total / P)`` elements,
            ``bucket_size`` if smaller) are cut into ``P`` runs of about equal size, in their order
            (a tensor is never split); fragment ``k``'s outer step is at the steps ``t`` with
            ``t % H == k * H // P``, where the other fragments take an inner step. So one fragment
            is averaged at a time: the bytes of a round are the same, the largest step sends about
            ``1 / P`` of them. An int in ``[1, H]``; :meth:`fragment_of` says a parameter's fragment,
            and ``comm_stats()["outer"]["fragments"]`` the elements, outer steps and bytes of each.
        sync_delay: ``tau``, the inner steps an outer step's exchange runs beside before it lands
            (Streaming DiLoCo's overlap; :mod:`onebit.streaming`); default None: 2 from
            ``sync_every >= 16``, else 0 (the outer step waits for its exchange). With ``tau > 0``
            the outer step starts the 1-bit passes, the next step their server stages, and step
            ``t0 + tau`` (after its inner step) lands them:
            ``params = global_params [- residual] + sync_mix * progress``, ``progress`` this rank's
            inner steps since ``t0``. An int in ``[0, sync_every // fragments)``; it holds
            ``sync_input`` (4 bytes per parameter): the pseudo-gradient an exchange in flight
            started from, which an exact resume starts again from.
        sync_mix: the share (in ``[0, 1]``) of the local progress made while an exchange was in
            flight that its landing keeps; default 1 (all of it; 0: every rank restarts from the
            global parameters).
        outer_state: where the global parameters and the outer momentum live: ``"device"``
            (default: with the parameters) or ``"host"`` (in host memory, pinned when the
            parameters are on a GPU, as torchft's DiLoCo keeps them): the GPU then holds 4 bytes
            per parameter less (8 with ``outer_momentum > 0``), and each outer step copies the
            global parameters to the device and the averaged pseudo-gradient to the host (the
            outer update runs on the CPU). The same numbers either way (bit for bit at the default
            ``outer_momentum=0``). Not with sharded (DTensor) parameters, whose state must be
            DTensors on their mesh.
        inner: the inner optimizer: None (default) for the built-in fused AdamW above, or a
            ``torch.optim.Optimizer`` class or a callable that builds one from the param groups it
            is given (e.g. ``functools.partial(torch.optim.SGD, momentum=0.9)``). It is built over
            this optimizer's own param groups (the same dicts: schedulers, ``zero_grad`` and
            ``add_param_group`` reach it), so the hyperparameters both have (``lr``,
            ``weight_decay``, ``betas``, ``eps``) are this optimizer's; one given to the factory at
            another value, or one the inner optimizer lacks at a value other than the default, is
            refused, as are ``bias_correction=False``, momentum masks and onebit's own optimizers
            (they communicate). Its state stays its own (:attr:`inner_optimizer`), saved in the
            state dict as ``"inner:<name>"`` entries beside each parameter's global parameters;
            ``torch.optim.AdamW`` gives the built-in's numbers bit for bit.
        bias_correction: the inner AdamW's bias correction (on by default, as in torch).
        **options: the keyword-only options of every onebit optimizer (transport, group, masks,
            buckets, scale blocks, non-finite gradients, divergence, kernels): see
            :class:`onebit.engine.OnebitOptimizer`; not ``overlap_backward`` (an inner step
            sends nothing to overlap) nor ``hierarchy``. A momentum mask keeps the inner momentum,
            the averaged pseudo-gradient and the outer momentum exactly 0 where it is 0.

    A parameter without a gradient on every rank is left alone, parameter and state, as in
    torch.optim; at an outer step so is a group whose learning rate is 0. What such a parameter
    moved since the last outer step waits for the next outer step that updates it
    (:meth:`synchronize` aligns everything).

    After an outer step the parameters are bit-identical on every rank, but each rank keeps its
    own inner moments: :attr:`replicas_identical` is True only before the first step and right
    after :meth:`synchronize`, so ``save_checkpoint(..., exact_resume=True)`` saves every rank's
    state. Inner steps send nothing, except that ``nonfinite_grads="raise"`` agrees on an 8-byte
    flag every step (so that every rank raises together); the default ``"skip"`` sends nothing.
    """

    PLAN_NAMES: ClassVar[tuple[str, ...]] = (INNER.name, OUTER.name)
    STATE: ClassVar[StateSpec] = StateSpec(
        buffers=("exp_avg", "exp_avg_sq", "global_params", "outer_momentum_buffer", "sync_input"),
        nonnegative=("exp_avg_sq",), lazy=("outer_momentum_buffer", "sync_input"),
        scalars={"inner_step": 0.0}, masked="exp_avg",
        group_keys=("lr", "betas", "eps", "weight_decay", "bias_correction"), schedule=SCHEDULE)
    _CHECK_UNAVERAGED: ClassVar[bool] = True  # (a forgotten adapter is said in the first steps)
    CONFIG_TYPE: ClassVar[str] = "OneBitDiLoCo"
    DEEPSPEED_REFUSED: ClassVar[Mapping[str, str]] = DEEPSPEED_COMMON_REFUSED
    NOT_SETTINGS: ClassVar[Mapping[str, str]] = {
        "freeze_step": "OnebitDiLoCo has no full-precision warmup; sync_every sets how often it communicates"}

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        sync_every: int = 32,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        compression: str = "onebit",
        error_feedback: str | None = None,
        outer_bits: int | None = None,
        fragments: int | None = None,
        sync_delay: int | None = None,
        sync_mix: float = 1.0,
        outer_state: str = "device",
        inner: Any = None,
        bias_correction: bool = True,
        **options: Any,
    ) -> None:
        _check_outer(sync_every, outer_lr, outer_momentum)
        chosen = fragments is None  # (the buckets may then leave fewer, without a refusal)
        fragments, sync_delay = _streaming_defaults(sync_every, fragments, sync_delay)
        _check_fragments_fit(_check_fragments(fragments), sync_every)
        _check_delay_fits(_check_sync_delay(sync_delay), fragments, sync_every)
        if _check_sync_mix(sync_mix) != 1 and sync_delay == 0:
            raise ValueError(f"OnebitDiLoCo(sync_mix={sync_mix!r}) weighs the progress made while an exchange is in "
                             "flight, and with sync_delay=0 none is: pass sync_delay > 0 too, or leave sync_mix out")
        check_choice("compression", compression, COMPRESSIONS)
        if compression == "none" and (error_feedback, outer_bits) != (None, None):
            raise ValueError(f"OnebitDiLoCo(compression='none') averages exactly: it has no residual, so "
                             f"error_feedback={error_feedback!r} and outer_bits={outer_bits!r} would change nothing; "
                             "leave them out")
        exact = compression == "none"
        self.compression = compression
        self.error_feedback = _check_error_feedback(("buffer" if exact else "model") if error_feedback is None
                                                    else error_feedback)
        self.outer_bits = _check_outer_bits((1 if exact else 2) if outer_bits is None else outer_bits)
        for name in ("overlap_backward", "hierarchy"):
            if options.get(name) not in (None, False):
                raise ValueError(f"OnebitDiLoCo({name}={options[name]!r}) is not supported: its inner steps send "
                                 f"nothing, and its outer step is one compressed all-reduce; leave {name} unset")
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, float(outer_lr), float(outer_momentum)
        self.fragments = fragments
        self.sync_delay, self.sync_mix = sync_delay, float(sync_mix)
        self._sync_pending: dict[str, Any] | None = None  # the exchange in flight, as a checkpoint saves it
        self._flight = None
        self._before_errors = {}
        check_choice("outer_state", outer_state, OUTER_STATE)
        self.outer_state = outer_state
        self._inner: torch.optim.Optimizer | None = None
        self._inner_factory = inner
        if inner is not None:
            self.STATE = INNER_STATE  # (the inner optimizer's state is its own)
            if options.get("momentum_masks"):
                raise ValueError("OnebitDiLoCo(inner=...) takes no momentum_masks: a mask keeps onebit's own momentum "
                                 "at 0, and the inner optimizer's state is its own; leave inner out to use masks")
        self._fragment_of: dict[int, int] | None = None  # id(bucket) -> its fragment (see _fragment_map)
        self._fragment_counts: dict[int, list[int]] = {}  # fragment -> [outer steps, bytes sent] (comm_stats)
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
                        weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, **options)
        if inner is not None:
            self._inner = inner_optimizer.build(inner, self.param_groups)
            inner_optimizer.check_hyperparameters(self._inner, self.param_groups, self._builtin_defaults())
            inner_optimizer.check_shared(self._inner, self.param_groups, inner)
        if chosen and len(self._buckets) < fragments:
            self.fragments = max(1, len(self._buckets))
        elif fragments > 1 and len(self._buckets) < fragments:
            numels = [local(p).numel() for b in self._buckets for p in b.owners]
            raise ValueError(
                f"OnebitDiLoCo(fragments={fragments}): the trainable parameters make {len(self._buckets)} buckets, one "
                f"fewer than a fragment each needs (a tensor is never split: the largest has {max(numels, default=0)} "
                f"of the {sum(numels)} elements); pass fragments <= {max(1, len(self._buckets))}")

    def _build_group_buckets(self, index: int) -> None:
        """The group's buckets, their global parameters the parameters now (at construction, or
        when ``add_param_group`` adds the group: the next outer step checks that every rank
        started them from the same values), and with ``outer_momentum > 0`` the outer momentum
        (at 0 it never exists, unless a load brings one)."""
        self._fragment_of = None
        super()._build_group_buckets(index)
        self._start_checked = False
        for bucket in self._buckets:
            if bucket.group_index != index:
                continue
            if bucket.sharded and self.outer_state == "host":
                raise ValueError("OnebitDiLoCo(outer_state='host') does not take sharded (DTensor) parameters: their "
                                 "state must be DTensors on the parameters' mesh; pass outer_state='device' (sharding "
                                 "already divides the global parameters' memory by the shard count)")
            for view, p in zip(bucket.views["global_params"], bucket.params):
                view.copy_(p.detach())
            for name in self._lazy_at_build():  # (so that a DCP load's template holds them)
                if name not in bucket.buffers:
                    self._allocate(bucket, name)
            if self.compression == "none" and not isinstance(bucket.compression, ExactAverage):
                bucket.compression = ExactAverage(bucket.padded, self._backend.world_size, bucket.device,
                                                  bucket.layout.edges)

    def _check_group(self, group: Mapping[str, Any]) -> None:
        if getattr(self, "_inner_factory", None) is not None:  # (torch.optim's flags are then the inner optimizer's)
            group = {key: value for key, value in group.items() if key not in TORCH_FLAGS}
        super()._check_group(group)
        check_flag("bias_correction", group["bias_correction"])
        if group.get("compress") is False:
            raise ValueError("OnebitDiLoCo: compress=False in a param group is not supported: every parameter "
                             "takes part in the outer step; remove the key")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """:meth:`onebit.engine.OnebitOptimizer.add_param_group`; with ``inner=``, the inner optimizer
        takes the same group."""
        inner = getattr(self, "_inner", None)
        if inner is not None and isinstance(param_group, Mapping):  # (checked before anything changes)
            candidate = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
            inner_optimizer.check_hyperparameters(inner, [candidate], self._builtin_defaults())
            inner_optimizer.check_shared(inner, [{**inner.defaults, **candidate}], self._inner_factory)
        super().add_param_group(param_group)
        if inner is not None:
            inner.add_param_group(self.param_groups[-1])

    @classmethod
    def _builtin_defaults(cls) -> dict[str, Any]:
        """The built-in AdamW's hyperparameters at their defaults (from the signature)."""
        signature = inspect.signature(cls.__init__).parameters
        return {name: signature[name].default for name in ("betas", "eps", "weight_decay", "bias_correction")}

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer ``inner=`` built (None: the built-in fused AdamW)."""
        return self._inner

    def _lazy_at_build(self) -> tuple[str, ...]:
        """The outer momentum with ``outer_momentum > 0`` (at 0 it never exists, unless a load brings
        one); ``sync_input`` with ``sync_delay > 0`` (kept from then on: a parameter left alone by an
        exchange keeps its entry)."""
        return (("outer_momentum_buffer",) if self.outer_momentum > 0 else ()) + (("sync_input",) if self.sync_delay else ())

    def _homes(self) -> dict[str, str]:
        return {name: "host" for name in OUTER_BUFFERS} if self.outer_state == "host" else {}

    def _bucket_cap(self) -> int:
        """With ``fragments=P > 1``, buckets of at most ``ceil(total / P)`` elements (``total``: the
        trainable elements of every group), so that they can be cut into ``P`` fragments of about
        equal size."""
        if self.fragments == 1:
            return self.bucket_size
        total = sum(local(p).numel() for group in self.param_groups for p in group["params"] if p.requires_grad)
        return max(1, min(self.bucket_size, -(-total // self.fragments)))

    def _forget(self) -> None:
        self._fragment_of = None  # (a load may bring another fragments)
        self._drop_flight()

    # ----------------------------------------------------------------- the schedule

    def plan_for(self, step: int) -> StepPlan:
        return INNER if self._fragment_at(step) is None else OUTER

    def _fragment_at(self, step: int) -> int | None:
        """The fragment whose outer step step ``step`` is (:func:`onebit.fragments.fragment_at`),
        or None: an inner step of every bucket (so is the step of a fragment without buckets)."""
        k = fragmenting.fragment_at(step, self.sync_every, self.fragments)
        if k is None or self.fragments == 1:
            return k
        return k if k in self._fragment_map().values() else None

    def _fragment_map(self) -> dict[int, int]:
        """``id(bucket) -> fragment`` (:func:`onebit.fragments.assign` over the buckets' sizes, in
        their order), derived again when next needed after the buckets or ``fragments`` changed.
        Fewer buckets than fragments (after a load that brought another ``fragments``, or once
        fewer parameters train) leaves the last fragments empty: said once, on rank 0."""
        if self._fragment_of is None:
            kinds = fragmenting.assign([b.numel for b in self._buckets], self.fragments)
            self._fragment_of = {id(b): k for b, k in zip(self._buckets, kinds)}
            if self.fragments > 1 and len(set(kinds)) < self.fragments and self._speaks:
                logger.warning(
                    "onebit: OnebitDiLoCo fragments=%d, but its %d buckets (laid out when it was built, for the "
                    "parameters training then) fill %d of them: the steps of the others are inner steps. Build the "
                    "optimizer with fragments=%d to cut the parameters into that many", self.fragments,
                    len(self._buckets), len(set(kinds)), self.fragments)
        return self._fragment_of

    def _compresses(self, bucket: Bucket, plan: StepPlan, t: int) -> bool:
        """At the outer step of fragment ``k``, only its buckets go through the 1-bit all-reduce;
        the others take an inner step."""
        return self.fragments == 1 or self._fragment_map()[id(bucket)] == self._fragment_at(t)

    def fragment_of(self, param: torch.Tensor) -> int:
        """The fragment of the trainable parameter ``param`` (0 with ``fragments=1``): its outer
        steps are the steps ``t`` with ``t % sync_every == k * sync_every // fragments``."""
        for bucket in self._buckets:
            if any(p is param for p in bucket.owners):
                return self._fragment_map()[id(bucket)]
        raise ValueError(f"fragment_of: the tensor of shape {tuple(param.shape)} is not a trainable parameter of this "
                         "optimizer; pass one of its param_groups' parameters that requires a gradient")

    @property
    def replicas_identical(self) -> bool:
        """True only before the first step and after :meth:`synchronize`: an outer step makes the
        parameters (and global parameters) the same on every rank, but each rank keeps its own
        inner moments, so a checkpoint must still hold every rank's state."""
        return self._step == 0 or self._synced_at == self._step

    # ----------------------------------------------------------------- statistics

    def step(self, closure=None):
        """:meth:`onebit.engine.OnebitOptimizer.step`; an outer step also counts for its fragment."""
        t = self._step + 1
        loss = super().step(closure)
        start = self._sync_start(t) if self.sync_delay else None  # (the bytes of the steps in between: its fragment's)
        k = self._fragment_at(t if start is None else start)
        if k is not None:  # (the outer steps of each fragment, for comm_stats())
            last = self._backend.stats_dict(None)
            counts = self._fragment_counts.setdefault(k, [0, 0])
            counts[0] += last["steps"] if start is None else 0
            counts[1] += last["bytes_sent"]
        return loss

    def comm_stats(self) -> dict[str, Any]:
        """:meth:`onebit.engine.OnebitOptimizer.comm_stats`, whose ``"outer"`` entry also holds
        ``"fragments"``: per fragment, its trainable elements (``numel``), its outer steps taken
        (``steps``) and the bytes this rank sent in them (``bytes_sent``)."""
        stats = super().comm_stats()
        numels = [0] * self.fragments
        for bucket in self._buckets:
            numels[self._fragment_map()[id(bucket)]] += bucket.numel
        stats["outer"]["fragments"] = [{"numel": numel, "steps": self._fragment_counts.get(k, [0, 0])[0],
                                        "bytes_sent": self._fragment_counts.get(k, [0, 0])[1]}
                                       for k, numel in enumerate(numels)]
        return stats

    def reset_comm_stats(self) -> None:
        super().reset_comm_stats()
        self._fragment_counts = {}

    # ----------------------------------------------------------------- the steps

    def _present(self, bucket: Bucket, plan: StepPlan) -> list[bool]:
        # As in torch.optim, a parameter without a gradient is left alone, state and all; at an
        # outer step so is one whose learning rate is 0: its local moves since the last outer step
        # wait for the next outer step that updates it (synchronize() aligns everything at once).
        present = super()._present(bucket, plan)
        if (plan is OUTER and self.param_groups[bucket.group_index]["lr"] == 0
                and self._compresses(bucket, plan, self._step + 1)):  # (the step being taken)
            return [False] * len(present)
        return present

    def _update(self, r: Any, grads: list[list[torch.Tensor | None]], compressed: list[Bucket],
                averaged: list[Bucket]) -> None:
        """With ``inner=``, the inner optimizer's step over every parameter first; then each bucket's
        update (an outer step computes its pseudo-gradient from the parameters it left)."""
        if self._inner is not None:
            plan = self.plan_for(r.t)
            inner_optimizer.step(self._inner, [b.owners for b in self._buckets], grads,
                                 [self._present(b, plan) for b in self._buckets],
                                 scaled=getattr(self, "grad_scale", None) is not None)
        super()._update(r, grads, compressed, averaged)

    def _update_local(self, bucket: Bucket, grads: list[torch.Tensor | None], group: dict[str, Any], t: int) -> None:
        """The inner AdamW step of the parameters that have a gradient (each counts its own steps
        for the bias corrections, as in torch); with ``inner=``, nothing: :meth:`_update` ran it."""
        here = [i for i, g in enumerate(grads) if g is not None]
        if not here or self._inner is not None:
            return
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        steps = bucket.scalars["inner_step"]
        steps[here] += 1
        corrections = [F.bias_corrections(int(k), int(k), beta1, beta2, group["bias_correction"])
                       for k in steps[here].tolist()]
        m = [bucket.views["exp_avg"][i] for i in here]
        v = [bucket.views["exp_avg_sq"][i] for i in here]
        g = [grads[i] for i in here]
        params = [bucket.params[i] for i in here]
        if weight_decay != 0:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        torch._foreach_lerp_(m, g, 1 - beta1)
        if bucket.mask is not None:  # the masks' promise: the momentum is 0 there
            masks = bucket.view(bucket.mask)
            torch._foreach_mul_(m, [masks[i] for i in here])
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denominators = torch._foreach_sqrt(v)
        torch._foreach_div_(denominators, [bc2 ** 0.5 for _, bc2 in corrections])
        torch._foreach_add_(denominators, eps)
        step_sizes = [-lr / bc1 for bc1, _ in corrections]
        if bucket.same_dtype:
            torch._foreach_addcdiv_(params, m, denominators, step_sizes)
            return
        for p, mi, d, size in zip(params, m, denominators, step_sizes):
            p.add_(torch.div(mi, d).mul_(size).to(p.dtype))

    def _compress_input(self, bucket: Bucket, grads: list[torch.Tensor | None], group: dict[str, Any], t: int,
                        staged: bool = False) -> torch.Tensor:
        """The outer step's input: the inner step, then ``delta = global_params - params`` (0 in
        the padding)."""
        if not self._start_checked:
            self._check_same_start()
        self._update_local(bucket, grads, group, t)
        delta = bucket.scratch("delta")
        for view, theta, p in zip(bucket.view(delta), bucket.views["global_params"], bucket.params):
            if self.outer_state == "host":  # (the global parameters to the device, then one subtraction there)
                view.copy_(theta).sub_(p)
            else:
                torch.sub(theta, p, out=view)
        if self.sync_delay:
            self._keep_before(bucket, delta)
        return delta

    def _update_compressed(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """The outer Nesterov step on the averaged pseudo-gradient; every rank continues from the
        new global parameters."""
        delta = bucket.compressed
        if self.compression == "onebit":
            self._more_passes(bucket, delta)
        self._outer_update(bucket, delta)
        # (the pseudo-gradient's buffer: needed again only at the next outer step)
        bucket.compressed = None
        bucket.release_scratch()

    def _outer_update(self, bucket: Bucket, delta: torch.Tensor) -> None:
        """The outer Nesterov step of the global parameters on the averaged pseudo-gradient
        ``delta``, and the parameters set to them (less this rank's residual, with
        ``error_feedback="model"``)."""
        theta = bucket.buffers["global_params"]
        if self.outer_state == "host":  # (the outer update runs where the global parameters live)
            delta = delta.to(theta.device)
        mu = self.outer_momentum
        if mu > 0:
            if "outer_momentum_buffer" not in bucket.buffers:
                self._allocate(bucket, "outer_momentum_buffer")
            b = bucket.buffers["outer_momentum_buffer"]
            b.mul_(mu).add_(delta)
            delta.add_(b, alpha=mu)
        theta.sub_(delta, alpha=self.outer_lr)  # (masked coordinates: their average is 0, so theta and b stay)
        if self.error_feedback == "model" and self.compression == "onebit":
            self._keep_residual(bucket)
        else:
            for p, view in zip(bucket.params, bucket.views["global_params"]):
                p.copy_(view)

    def _before_update(self, bucket: Bucket, t: int) -> None:
        # The outer momentum exists whenever outer_momentum > 0 (a load of a state without one
        # leaves it out: allocated before a step that holds some parameters' state, so that they
        # keep theirs).
        if self.outer_momentum > 0 and self.plan_for(t) is OUTER and "outer_momentum_buffer" not in bucket.buffers:
            self._allocate(bucket, "outer_momentum_buffer")

    def _more_passes(self, bucket: Bucket, delta: torch.Tensor) -> None:
        """``outer_bits > 1``: each further pass sends the residuals the previous one left, this
        rank's worker error, as its input, and adds its average to ``delta``. It runs on the first
        pass's state: its worker error starts at 0 and its server error is the previous pass's,
        and the last pass's residuals are the first pass's errors again (no second state: 6
        B/param at 2 ranks off the outer step's peak)."""
        first = bucket.compression
        for _ in range(self.outer_bits - 1):
            residual = bucket.scratch("residual")  # (its padding stays 0, as the first pass's input's)
            for view, error in zip(bucket.view(residual), bucket.view(first.worker_error)):
                view.copy_(error)
            first.worker_error.zero_()
            compressed_allreduce_(residual, first, self._backend, self._kernels_for(bucket))
            if bucket.mask is not None:  # (what a mask pins to 0 stays 0, as the first pass's decode keeps it)
                residual.mul_(bucket.mask)
            delta.add_(residual)

    def _keep_residual(self, bucket: Bucket) -> None:
        """``error_feedback="model"``: the parameters are the global ones minus this rank's worker
        error (none where a momentum mask is 0), and the worker error is 0 again: the residual
        travels in the parameters to the next outer step's ``delta``."""
        residual = bucket.compression.worker_error
        if bucket.mask is not None:
            residual.mul_(bucket.mask)
        for p, theta, r in zip(bucket.params, bucket.views["global_params"], bucket.view(residual)):
            if p.dtype == torch.float32:  # (in place: the same bits, no temporary of the parameter's size)
                p.copy_(theta).sub_(r)
            else:  # (one rounding to the parameter's type; host: theta to the device first)
                p.copy_(torch.sub(theta.to(r.device, non_blocking=True), r))
        residual.zero_()

    def _adopt(self, bucket: Bucket, index: int, newcomers: list[int]) -> None:
        super()._adopt(bucket, index, newcomers)
        bucket.views["global_params"][index].copy_(bucket.params[index].detach())

    def _synchronize(self) -> None:
        """Between outer steps: the exact float32 mean over ranks of the parameters and the inner
        moments (the global parameters and outer momentum are the same on every rank already)."""
        if self._flight is None and self._sync_pending is not None:
            self._resume_flight(self._step + 1)
        if self._flight is not None:  # (the exchange in flight lands now, with the progress made so far)
            if not self._flight.served:
                self._serve(self._flight)
            self._land(self._flight, {})
        if self.replicas_identical:
            return
        for bucket in self._buckets:
            flat = bucket.scratch("delta")
            for view, p in zip(bucket.view(flat), bucket.params):
                view.copy_(p)
            self._backend.inner.all_reduce_mean_(flat)  # (outside any step: not in comm_stats())
            for p, view in zip(bucket.params, bucket.view(flat)):
                p.copy_(view)
            if self._inner is None:
                self._backend.inner.all_reduce_mean_(bucket.buffers["exp_avg"])
                self._backend.inner.all_reduce_mean_(bucket.buffers["exp_avg_sq"])
        if self._inner is not None:
            inner_optimizer.check_same_entries(self._inner, self._backend.inner, self._device())
            inner_optimizer.average(self._inner, self._backend.inner.all_reduce_mean_)
        self._synced_at = self._step
        if self._speaks:
            logger.info("onebit: synchronize() after step %d: parameters and inner moments averaged over %d ranks",
                        self._step, self._backend.world_size)

    def _build_state_dict(self) -> dict[str, Any]:
        """With ``inner=``, each parameter's entry also holds the inner optimizer's state (copies),
        its names prefixed ``"inner:"``, and each group says which inner optimizer saved it and how
        many of its parameters have inner state (``"inner_optimizer"``, ``"inner_states"``)."""
        state_dict = super()._build_state_dict()
        if self._inner is not None:
            inner_optimizer.save_into(state_dict, self._inner, self.param_groups)
        return state_dict

    def restore(self, state_dict: dict[str, Any],
                compression_errors: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """:meth:`onebit.engine.OnebitOptimizer.restore`; with ``inner=``, the inner optimizer's state
        too. A state dict of the built-in AdamW (``inner`` left out) and one of an inner optimizer,
        or of another inner optimizer, do not load into each other."""
        if self._inner is None:
            if inner_optimizer.saved_by(state_dict):
                raise ValueError(f"cannot load optimizer state: it was saved by OnebitDiLoCo(inner="
                                 f"{inner_optimizer.saved_by(state_dict)}); build this OnebitDiLoCo with the same inner=")
            super().restore(state_dict, compression_errors)
            return
        stripped, saved = inner_optimizer.check_saved(state_dict, type(self._inner).__name__)
        super().restore(stripped, compression_errors)
        inner_optimizer.apply(self._inner, self.param_groups, saved)

    def _check_same_start(self) -> None:
        """The first outer step: every rank must have started from the same global parameters."""
        differ = ranks_holding_other(self._backend.inner, (b.buffers["global_params"] for b in self._buckets),
                                     self._device())
        if differ:
            raise RuntimeError(
                f"OnebitDiLoCo: ranks {differ} started from other parameters than rank 0 (the global parameters "
                "are the parameters at construction): build the model with the same seed on every rank, or "
                "broadcast rank 0's parameters (e.g. wrap the model in DDP) before building the optimizer")
        self._start_checked = True
