"""The engine every onebit optimizer shares.

:class:`OnebitOptimizer` owns everything that is not an update rule: parameters in buckets (each
tensor its own segment of the compressed layout), momentum masks, the transport, the agreement of
every rank on non-finite gradients, the layout check, the pipelined compressed all-reduce,
statistics, divergence warnings and the ``state_dict`` contract. An algorithm is a subclass that
names its state, plans each step from the step number and updates (``OnebitAdam``, ``OnebitLamb``),
over pure functions of the maths in :mod:`onebit.functional`.

What a step communicates is its :class:`StepPlan`, derived from the step number alone (so the same
on every rank and after any resume): integrations ask ``optimizer.next_plan`` whether the next
step averages gradients in full precision; ``comm_stats()`` counts steps and bytes per plan name.

What an algorithm (a subclass) declares and defines, by purpose:

=====================  ========================================================================
must declare           ``PLAN_NAMES`` (its plans' names); ``STATE`` (a :class:`onebit.spec.StateSpec`:
                       buffers, scalars, masked buffer, group keys, the schedule's settings)
must define            ``plan_for(step)``: the :class:`StepPlan` of a step, from its number;
                       ``_update_averaged``: the update from an averaged gradient;
                       ``_compress_input``: the buffer the 1-bit all-reduce averages;
                       ``_update_compressed``: the update from its average;
                       ``_update_local``: the update of a step that sends nothing (only with such plans)
codec (optional)       ``_codec_multipliers``, ``_codec_bound``: what the codec averages (times
                       ``into``, clamped) and decodes (times ``out_of``); ``_STAGED_PLANS`` and
                       ``_decode_target``: plans whose input ``overlap_backward`` may start during
                       backward; ``_dead``, ``_on_compression``: coordinates kept 0 besides the masks
                       (``_entering_compression``: before them)
lifecycle (optional)   ``_check_group`` (hyperparameters of its own); ``_schedule_step`` (a schedule
                       decided from the state); ``_present``, ``_before_update``, ``_skipped_alone``
                       (parameters without a gradient, rank-local skips); ``_forget`` (drop its
                       caches, see :meth:`OnebitOptimizer._invalidate`); ``_bring_back`` and
                       ``_released_state`` (buffers held in another form in a phase); ``_adopt`` (a parameter that
                       starts training, :mod:`onebit.lifecycle`); ``_synchronize`` and
                       ``replicas_identical`` (algorithms whose replicas differ between syncs)
=====================  ========================================================================

Two declarations and four methods make an algorithm (five with local steps); ``tests/test_engine.py``'s
``CompressedSGD`` is one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch

from .backends import CommBackend, resolve_backend
from .buckets import Bucket, check_grads, set_masks, split_into_buckets
from .overlap import Overlap
from .rounds import Round
from .health import Health
from .plan import StepPlan
from .kernels import KernelSet, get_kernels
from .lifecycle import Lifecycle
from .spec import StateSpec
from .state import StateDictContract, allocate_lazy, release_lazy
from .steps import Steps
from .hierarchy import Topology, build_topology, check_hierarchy
from .layout import check_layout, ranks_holding_other
from .shards import first_shard
from .stats import InstrumentedBackend, StepTimers, l2_norm, timed_kernels
from .validation import (as_group, check_common_group, check_engine_options, check_flag, check_params,
                         check_step_order, claim_params, error_dtype_of, reduce_dtype_of, refuse_unknown)

logger = logging.getLogger(__name__)

__all__ = ["OnebitOptimizer", "StepPlan", "DEFAULT_BUCKET_SIZE", "optimizer_names"]

DEFAULT_BUCKET_SIZE = 2**24  # elements (64 MiB of float32 momentum)
# The first this many steps whose gradients the optimizer all-reduces itself look for gradients
# that a framework averaged already (a forgotten adapter): a copy of the gradients each.
DOUBLE_AVERAGE_CHECKS = 2


class OnebitOptimizer(Steps, Lifecycle, StateDictContract, torch.optim.Optimizer):
    """Base class of the onebit optimizers; not used on its own.

    Keyword-only options of every onebit optimizer:

    Args:
        comm_backend_name: ``'gloo'``, ``'nccl'``, ``'hccl'`` (the initialized torch.distributed
            process group), ``'mpi'`` (mpi4py), ``'local'`` (one process), or ``None`` to use
            the default process group when there is one.
        backend: a :class:`onebit.backends.CommBackend` object instead of a name.
        cuda_aware: with ``'mpi'``: hand device buffers straight to a CUDA-aware MPI.
        group: the process group (torch.distributed) or communicator (mpi4py) of the data-parallel
            ranks, or a 1-D ``DeviceMesh`` (e.g. ``mesh['replicate']``); default the whole job. With
            DTensor parameters (FSDP2, tensor parallel) the optimizer updates each rank's local
            shard and keeps state for it only; ``group`` must then be the mesh dimension whose
            ranks hold the same shards (HSDP's replicate dimension, the "dp" dimension of tensor
            parallelism): the first step checks it.
        momentum_masks: ``{param: mask}``; where ``mask`` is 0 the momentum is kept exactly 0
            (e.g. position-embedding rows beyond the sequence length in use). Same shape and
            device as the parameter; bool or 0/1 floats. Not saved in checkpoints.
        bucket_size: number of elements per compression bucket; each bucket costs 2 collective
            calls per compressed step and 1 per full-precision step, however many tensors it
            holds. Inside a bucket every tensor has its own scales (as if compressed alone, as
            DeepSpeed did), so the bucket size changes the number of collectives, not the numerics.
        scale_block_size: ``None`` (default): one scale per tensor (per rank and chunk). An int
            ``k``: one scale per block of ``k`` elements of each tensor (rounded up to a multiple
            of ``8 * world_size``), for finer quantization at ``4 / k`` more bytes per element on
            the wire.
        nonfinite_grads: ``'skip'`` (default): when any rank's gradients contain NaN or inf (or
            ``torch.amp.GradScaler`` found an overflow), every rank skips the step, leaving
            parameters, state, compression errors and the step count untouched; ``'raise'``:
            every rank raises ``FloatingPointError``. A NaN never enters error feedback. With
            GradScaler, ``scaler.step(optimizer)`` hands the scale to this optimizer, which
            unscales and lets every rank agree on skipping.
        divergence: ``'warn'`` (default) logs a warning on rank 0, once per episode, when
            ``onebit.health.SKIPS_TO_WARN`` steps in a row were skipped for non-finite gradients,
            or when the worker compression error has grown above ``ERROR_RATIO_TO_WARN`` times
            the norm of what it compresses, or a coordinate moved by more than
            ``UPDATE_RATIO_TO_WARN`` times its learning rate in one step (both checked every
            ``HEALTH_CHECK_INTERVAL`` compressed steps; the warning names the tensor, by its name
            when the parameters were given with ``named_parameters()``); ``'raise'``: every rank
            raises ``FloatingPointError`` instead.
        kernels: codec implementation (``'auto'``, ``'reference'``, or a native one); default
            from the ``ONEBIT_KERNELS`` environment variable, else ``'auto'``.
        hierarchy: ``None`` (default): the flat compressed all-reduce. ``'host'`` (ranks grouped
            into nodes by host name) or an int ``L`` (consecutive groups of ``L`` ranks, for
            launchers and emulations where host names do not tell nodes apart): the two-level one
            of :mod:`onebit.hierarchy`, whose traffic between nodes is about ``2 (P-1)/P * M/8``
            bytes per node (``P`` nodes) instead of ``L (P-1)/P * M/8 + M/8``. One node, one rank
            per node, or nodes of different sizes fall back to flat, with one log line. Needs a
            torch.distributed transport. Parameters stay bit-identical on every rank. Not with
            ``overlap_backward``.
        hierarchy_variant: ``'compressed'`` (default: 1-bit inside nodes too, three error
            feedbacks) or ``'node_mean'`` (an exact float32 mean inside each node, 1-bit between
            nodes only); see :mod:`onebit.hierarchy` and ``docs/guides/hierarchy.md`` for when each wins.
        overlap_backward: ``False`` (default): every step communicates inside ``step()``.
            ``True``: each bucket's communication starts during backward, as soon as its
            gradients are there (gradient hooks, buckets started in reverse order, as DDP does):
            the full-precision average of warmup (and of 0/1 Adam's variance steps) and the
            compression, all-to-all and all-gather of a compressed step; ``step()`` finishes it.
            Same numbers as without it, step for step (see :mod:`onebit.overlap`); costs a second
            set of compression-error buffers and a buffer for the staged momentum. Run the
            micro-batches of gradient accumulation but the last under :meth:`no_sync`; gradients
            changed after backward (clipping) make ``step()`` redo the communication (said once).
            Not with ``torch.amp.GradScaler`` (its scale is known only at ``step()``) nor
            ``hierarchy``. On 2 CPU cores it sped up warmup steps only (``benchmarks/README.md``).
        reduce_dtype: ``None`` (default): the full-precision all-reduce of warmup steps (and of
            0/1 Adam's variance steps, and of ``compress=False`` groups) sends float32.
            ``torch.bfloat16`` (``"bfloat16"`` in config files): it sends the gradients rounded
            to bfloat16 and sums them in bfloat16, half the bytes, as DDP's
            ``bf16_compress_hook`` and FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)`` do;
            the compressed steps are unchanged; on one rank nothing is sent, nor rounded.
            ``attach_ddp``'s hook follows it. Not with ``comm_backend_name='mpi'`` (MPI has no
            bfloat16 sum: it would send float32). See ``docs/guides/tuning.md``.
        error_dtype: the type the compression errors (error feedback: a worker error of the
            whole buffer and a server error of ``1/n`` of it) are held in: ``torch.float32`` or
            ``torch.bfloat16`` (``"bfloat16"`` in config files): ``2 + 2/n`` bytes per parameter on
            ``n`` ranks instead of ``4 + 4/n``. Each new error is rounded once to bfloat16 (to
            nearest even); it is read back exactly. The bytes sent are the same. Not with
            ``hierarchy``. ``"auto"`` (default): bfloat16 for OnebitAdam in the preconditioned
            space (measured on BERT: ``docs/guides/tuning.md``), float32 otherwise.

    torch.optim's flags (``maximize``, ``foreach``, ``fused``, ``capturable``, ``differentiable``,
    ``amsgrad``, ``decoupled_weight_decay``) are taken, as keywords or in param groups, at the values
    that change nothing (:data:`onebit.validation.TORCH_NEUTRAL`) and kept in the groups; other
    values are refused with the reason. A 0-d tensor ``lr`` is read as its value. Param groups are
    checked again at each ``step()`` (before it changes anything), as is that no other onebit
    optimizer stepped this one's parameters since its last step.
    """

    #: What the algorithm keeps per parameter and saves (buffers, scalars, the masked buffer, the
    #: group keys a checkpoint holds, the schedule): see :class:`onebit.spec.StateSpec`.
    STATE: ClassVar[StateSpec] = StateSpec()
    # Whether compress=False buckets average their gradients in full precision on local steps too
    # (else they take local steps with the compressed ones).
    _AVERAGE_UNCOMPRESSED_ALWAYS: ClassVar[bool] = False
    #: The names of the algorithm's plans, in ``comm_stats()`` order.
    PLAN_NAMES: ClassVar[tuple[str, ...]] = ()
    #: The optimizer's type name in DeepSpeed-style config files (``"optimizer": {"type": ...}``,
    #: matched case-insensitively); a subclass that sets it can be built by :func:`onebit.from_config`.
    CONFIG_TYPE: ClassVar[str | None] = None
    #: Keyword arguments DeepSpeed's optimizer of this type accepted and ignored: refused (by the
    #: constructor and in config files) with the reason.
    DEEPSPEED_REFUSED: ClassVar[Mapping[str, str]] = {}
    #: Settings of other optimizers that are not this one's, refused with the reason.
    NOT_SETTINGS: ClassVar[Mapping[str, str]] = {}
    _REGISTRY: ClassVar[dict[str, type[OnebitOptimizer]]] = {}
    # Compressed plans whose _compress_input(..., staged=True) leaves the state untouched (writing
    # what it computes to buffers of its own): overlap_backward starts them during backward.
    _STAGED_PLANS: ClassVar[frozenset[str]] = frozenset()
    _DOUBLE_CHECKS: ClassVar[int] = DOUBLE_AVERAGE_CHECKS
    # Plans that never average gradients: the first steps look for a framework averaging them anyway.
    _CHECK_UNAVERAGED: ClassVar[bool] = False

    # torch.amp.GradScaler: set ``grad_scale``/``found_inf`` on the optimizer and always call step().
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        comm_backend_name: str | None = None,
        backend: CommBackend | None = None,
        cuda_aware: bool = False,
        group: Any = None,
        momentum_masks: Mapping[torch.Tensor, torch.Tensor] | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        kernels: str | None = None,
        nonfinite_grads: str = "skip",
        scale_block_size: int | None = None,
        divergence: str = "warn",
        hierarchy: Any = None,
        hierarchy_variant: str = "compressed",
        overlap_backward: bool = False,
        reduce_dtype: Any = None,
        error_dtype: Any = "auto",
        **unknown: Any,
    ) -> None:
        self.reduce_dtype, torch_flags = self._check_options(
            unknown, comm_backend_name, backend, bucket_size, nonfinite_grads, divergence, scale_block_size, cuda_aware,
            hierarchy, hierarchy_variant, overlap_backward, reduce_dtype)
        self.error_dtype = error_dtype_of(error_dtype, hierarchy, self._auto_error_dtype())
        # torch.optim's flags at values that change nothing stay in the groups, as torch keeps them
        defaults = as_group({**defaults, **torch_flags, "compress": True})
        self._check_group(defaults)
        self.bucket_size = bucket_size
        self.scale_block_size = scale_block_size
        self._kernel_choice = kernels
        self._buckets: list[Bucket] = []
        self._step = 0
        self._steps_taken = 0  # step() calls on this object since it was built or last loaded
        self._double_checks = 0  # the steps that looked for gradients the framework averaged already
        self._synced_at: int | None = None  # the step after which synchronize() aligned the replicas
        self._load_note: tuple[Any, ...] | None = None  # what the last load did, logged at the next step
        self._health = Health(nonfinite_grads, divergence)
        self._layout_checked = False
        self._gradients_averaged = False
        self._compressed_steps = 0  # counts the health checks' interval
        self._timed = StepTimers()
        self._backend: InstrumentedBackend | None = None
        self._overlap: Overlap | None = None
        self._round: Round | None = None  # the round backward began for the coming step (overlap_backward)
        self._told_changed = False  # the warning that a round was redone, said once
        super().__init__(params, defaults)
        # Everything above validates without side effects; only now is a backend touched.
        self._backend = InstrumentedBackend(
            resolve_backend(comm_backend_name, backend, cuda_aware=cuda_aware, group=group), self.PLAN_NAMES)
        self._topology = None if hierarchy is None else self._two_levels(hierarchy, hierarchy_variant)
        self._kernels: dict[torch.device, KernelSet] = {}
        for index in range(len(self.param_groups)):
            self._build_group_buckets(index)
        set_masks(self._buckets, momentum_masks or {}, self.STATE.masked)
        self._momentum_masks = dict(momentum_masks or {})
        self._trainable_at_build = self._trainable()
        if overlap_backward:
            self._overlap = Overlap(self._start_early)
            self._overlap.attach(self._buckets)

    @classmethod
    def _check_options(cls, unknown: Mapping[str, Any], comm_backend_name: str | None, backend: CommBackend | None,
                       bucket_size: Any, nonfinite_grads: Any, divergence: Any, scale_block_size: Any, cuda_aware: Any,
                       hierarchy: Any, hierarchy_variant: Any, overlap_backward: Any, reduce_dtype: Any
                       ) -> tuple[torch.dtype | None, dict[str, Any]]:
        """Validate the constructor's options (no side effects); return ``reduce_dtype`` as the engine
        keeps it, and torch.optim's flags given at values that change nothing."""
        torch_flags = refuse_unknown(cls.__name__, unknown, {**cls.DEEPSPEED_REFUSED, **cls.NOT_SETTINGS})
        check_engine_options(bucket_size, nonfinite_grads, divergence, scale_block_size, cuda_aware)
        check_hierarchy(hierarchy, hierarchy_variant)
        check_flag("overlap_backward", overlap_backward)
        if overlap_backward and hierarchy is not None:
            raise ValueError(f"overlap_backward=True does not work with hierarchy={hierarchy!r} yet; pass one of them")
        dtype = reduce_dtype_of(reduce_dtype)
        if dtype is not None and "mpi" in (comm_backend_name, getattr(backend, "name", None)):
            raise ValueError(f"reduce_dtype={reduce_dtype!r} saves nothing on the MPI transport: MPI has no bfloat16 "
                             "sum, so it sends float32; leave reduce_dtype at None with comm_backend_name='mpi'")
        return dtype, torch_flags

    def _two_levels(self, hierarchy: Any, variant: str) -> Topology | None:
        """The two-level topology of ``hierarchy=`` over the transport (None: it falls back to flat)."""
        topology = build_topology(self._backend.inner, hierarchy, variant)
        if topology is None:
            return None
        intra, cross = self._backend.add_levels(topology.intra, topology.cross)
        return dataclasses.replace(topology, intra=intra, cross=cross)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("CONFIG_TYPE"):
            OnebitOptimizer._REGISTRY[cls.CONFIG_TYPE] = cls

    @staticmethod
    def registered() -> dict[str, type[OnebitOptimizer]]:
        """The optimizer classes by their ``CONFIG_TYPE`` (those defined so far)."""
        return dict(OnebitOptimizer._REGISTRY)

    # ----------------------------------------------------------------- hooks a new algorithm must define
    # (see the module docstring's table; the defaults below raise NotImplementedError)

    def plan_for(self, step: int) -> StepPlan:
        """The plan of step ``step`` (1-based), from the step number alone."""
        raise NotImplementedError

    def _update_averaged(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """Update from the bucket's averaged gradient (``bucket.averaged_grad()``)."""
        raise NotImplementedError

    def _compress_input(self, bucket: Bucket, grads: list[torch.Tensor | None], group: dict[str, Any], t: int,
                        staged: bool = False) -> torch.Tensor:
        """Prepare and return the flat buffer (``bucket.padded`` elements) whose 1-bit average this
        step needs; it is replaced by that average in place. ``grads``: local, None for zero.
        ``staged`` (only for the plans in ``_STAGED_PLANS``): leave the state as it is, writing
        what it computes to buffers of its own (``overlap_backward`` starts it during backward)."""
        raise NotImplementedError

    def _update_compressed(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """Update once the buffer of :meth:`_compress_input` holds its compressed average."""
        raise NotImplementedError

    def _update_local(self, bucket: Bucket, grads: list[torch.Tensor | None], group: dict[str, Any], t: int) -> None:
        """Update a bucket on a step that communicates nothing for it (needed only by an algorithm
        with such plans)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- codec hooks (optional)

    def _codec_multipliers(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(into, out_of)``: the compressed all-reduce of ``bucket`` averages its buffer times
        ``into`` and decodes the average times ``out_of`` (in the codec's passes where the kernels
        can: see :attr:`onebit.kernels.KernelSet.multipliers`; ``out_of`` None: as it is, or divided
        by :meth:`_codec_divisor`); None: the buffer as it is."""
        return None

    def _codec_divisor(self, bucket: Bucket) -> torch.Tensor | None:
        """What the decoded average is divided by (``+0.0`` where it is 0), in the decode's pass
        where the kernels can (:attr:`onebit.kernels.KernelSet.divisors`); None: nothing."""
        return None

    def _codec_bound(self, bucket: Bucket, t: int) -> float | None:
        """With :meth:`_codec_multipliers`: the bound ``b`` that step ``t``'s compressed all-reduce
        clamps its input (the buffer times ``into``) to, ``[-b, b]``; None: no clamp."""
        return None

    def _decode_target(self, bucket: Bucket) -> torch.Tensor:
        """Where the compressed average of a staged bucket's input is decoded (see
        ``_STAGED_PLANS``): by default the input buffer itself."""
        return bucket.compressed

    def _dead(self, bucket: Bucket) -> torch.Tensor | None:
        """Coordinates (bool over the padded buffer) whose compressed value is forced to 0 from the
        first compressed step on, besides the masks and the padding; None for none."""
        return None

    def _entering_compression(self, buckets: list[Bucket]) -> None:
        """Called before the keep masks of ``buckets`` are derived (see :meth:`_on_compression`):
        what the earlier phase held and this one does not need can go first."""

    def _on_compression(self, buckets: list[Bucket], keeps: list[torch.Tensor], t: int, dead: int) -> None:
        """Called when the keep masks of ``buckets`` were derived (first compressed step, or the
        first after a load): ``keeps`` (bool, True where the compressed value is not forced to 0);
        ``dead``: how many coordinates :meth:`_dead` gave."""

    # ----------------------------------------------------------------- lifecycle hooks (optional)

    @classmethod
    def _check_group(cls, group: Mapping[str, Any]) -> None:
        """Validate one param group's hyperparameters (raise TypeError/ValueError); a subclass with
        hyperparameters of its own extends it."""
        check_common_group(group, cls.__name__)

    def _schedule_step(self, t: int) -> None:
        """Called at the start of step ``t``, before its plan is read: a schedule decided from the
        state (``freeze_step='auto'``) may fix it here; it must not change the plan of ``t``."""

    def _present(self, bucket: Bucket, plan: StepPlan) -> list[bool]:
        """Per parameter of ``bucket``, whether step of ``plan`` has work for it on this rank: it
        has a gradient. Parameters with work on no rank are left alone, with their state, as in
        torch.optim."""
        return [p.grad is not None for p in bucket.owners]

    def _before_update(self, bucket: Bucket, t: int) -> None:
        """Allocate what step ``t`` would allocate for ``bucket`` (called before some of its
        parameters' values are held through the step, see :meth:`Bucket.hold`)."""

    def _skipped_alone(self, bucket: Bucket, group: dict[str, Any], t: int) -> None:
        """This rank skipped its update of a step that communicates nothing (non-finite local
        gradients) while the step counts: advance what must stay the same on every rank."""

    def _auto_error_dtype(self) -> torch.dtype:
        """What ``error_dtype="auto"`` holds the compression errors in (asked by the constructor,
        before the buckets exist; float32 with ``hierarchy`` whatever it says)."""
        return torch.float32

    def _forget(self) -> None:
        """Drop what the algorithm derived from the state (its caches; see :meth:`_invalidate`)."""

    def _bring_back(self) -> None:
        """Put back in the buckets and the state every buffer the algorithm released and holds in
        another form (before the state is read from outside a step: a new layout)."""

    def _released_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """The released buffers as the state dict holds them: ``{param: {name: tensor}}`` (fresh
        tensors shaped like each parameter's local shard)."""
        return {}

    # ----------------------------------------------------------------- construction

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"a param group must be a dict, got {type(param_group).__name__}")
        param_group = as_group(param_group)
        hyper = {k: v for k, v in param_group.items() if k != "params"}
        self._check_group({**self.defaults, **hyper})
        params = param_group.get("params", [])
        params = [params] if isinstance(params, torch.Tensor) else params
        if not isinstance(params, (set, frozenset)):
            params = list(params)
            named = [p for p in params if isinstance(p, tuple)]
            if named:  # model.named_parameters(): the names are kept in the group (and its state dict), as torch does
                if len(named) != len(params) or any(len(p) != 2 or not isinstance(p[0], str) for p in named):
                    raise ValueError(
                        "all parameters of a group must be given with names, as (name, tensor) pairs from "
                        "model.named_parameters(), or all without")
                param_group = {**param_group, "param_names": [name for name, _ in named]}
                params = [p for _, p in named]
            check_params(params, type(self).__name__)
            param_group = {**param_group, "params": params}
        if self._overlap is not None:
            self._overlap.drain()
        super().add_param_group(param_group)
        claim_params(self, self.param_groups[-1]["params"])
        if self._backend is not None:
            self._build_group_buckets(len(self.param_groups) - 1)
        if self._overlap is not None:
            self._overlap.attach(self._buckets)

    def _check_before_step(self) -> None:
        """At each step, before anything changes: every param group's hyperparameters are still
        valid (they may be changed in ``param_groups`` after construction; an ``lr`` set as a 0-d
        tensor is read as its value), and no other optimizer took turns updating its parameters
        (:func:`onebit.validation.check_step_order`). Else a ValueError/TypeError; the step is not
        taken and work that backward started for it is dropped, so that the state stays as it was."""
        try:
            for index, group in enumerate(self.param_groups):
                try:
                    if isinstance(group["lr"], torch.Tensor):
                        group["lr"] = as_group(group)["lr"]
                    self._check_group(group)
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"param group {index} of {type(self).__name__}: {exc}. The step was not taken and "
                                    f"nothing changed: fix optimizer.param_groups[{index}]") from None
            check_step_order(self)
        except (TypeError, ValueError):
            self._drain()
            raise

    def _build_group_buckets(self, index: int) -> None:
        group = self.param_groups[index]
        for params in split_into_buckets(group["params"], self._bucket_cap()):
            bucket = Bucket(index, params, self._backend.world_size, group["compress"], self.scale_block_size,
                            self.STATE.eager, self.STATE.scalars, topology=self._topology, homes=self._homes(),
                            error_dtype=self.error_dtype)
            for i, p in enumerate(bucket.owners):
                self.state[p] = {**{name: views[i] for name, views in bucket.views.items()},
                                 **{name: values[i] for name, values in bucket.scalars.items()}}
            if bucket.device not in self._kernels:
                self._kernels[bucket.device] = get_kernels(bucket.device, self._kernel_choice)
            self._buckets.append(bucket)

    def _lazy_at_build(self) -> tuple[str, ...]:
        """The lazy buffers (``STATE.lazy``) that this configuration needs from the first step and so
        holds from construction on, e.g. OnebitDiLoCo's outer momentum with ``outer_momentum > 0``
        (a ``torch.distributed.checkpoint`` load fills only what the fresh optimizer holds)."""
        return ()

    def _homes(self) -> dict[str, str]:
        """State buffers an algorithm keeps in host memory (``{name: "host"}``); the others live on
        their parameters' device."""
        return {}

    def _bucket_cap(self) -> int:
        """The most elements a new bucket holds: ``bucket_size`` (an algorithm may bucket more finely)."""
        return self.bucket_size

    def _invalidate(self) -> None:
        """The one path by which the state changes from outside a step (a load, a copy): every
        value derived from it, the buckets' and the algorithm's, is dropped and rebuilt when
        next needed."""
        for bucket in self._buckets:
            bucket.invalidate()
        self._forget()

    def _allocate(self, bucket: Bucket, name: str) -> None:
        """Allocate the lazy buffer ``name`` of ``bucket`` (zeros) and enter it in the state."""
        allocate_lazy(self.state, bucket, name)

    def _release(self, bucket: Bucket, name: str) -> None:
        """Free the lazy buffer ``name`` of ``bucket``."""
        release_lazy(self.state, bucket, name)

    # ----------------------------------------------------------------- public state

    @property
    def next_plan(self) -> StepPlan:
        """The plan of the next ``step()``."""
        return self.plan_for(self._step + 1)

    @property
    def phase(self) -> str:
        """The name of the next step's plan (e.g. ``'warmup'`` or ``'compression'``)."""
        return self.next_plan.name

    @property
    def replicas_identical(self) -> bool:
        """Whether every rank holds the same parameters and state now (False between the syncs of
        an algorithm with local steps); ``save_checkpoint(..., exact_resume=True)`` then saves
        every rank's own."""
        return True

    @property
    def _speaks(self) -> bool:
        """Whether this rank logs the optimizer's info lines (phase switches, loads): rank 0 of its
        group, and, with DTensor shards, only the first shard's group (warnings are said by rank 0
        of every group: they concern that group's shards)."""
        return self._backend.rank == 0 and first_shard([p for b in self._buckets if b.sharded for p in b.owners])

    @property
    def step_count(self) -> int:
        """Number of ``step()`` calls applied (restored by ``load_state_dict``)."""
        return self._step

    @property
    def steps_taken(self) -> int:
        """``step()`` calls on this object since it was built or last loaded (adapters must be
        attached before the first)."""
        return self._steps_taken

    @torch.no_grad()
    def synchronize(self) -> None:
        """Make every rank hold the same parameters and optimizer state now, and check that they do
        (one all-gather of a digest of the parameters; a ``RuntimeError`` names the ranks that
        differ). Needed by algorithms whose ranks differ between syncs (0/1 Adam: an exact float32
        average of parameters and momenta now); for the others a check. Call it on every rank, e.g.
        at the end of training, before rank 0 saves the model; the adapters call it at the end of
        ``fit``/``train``."""
        for bucket in self._buckets:
            bucket.refresh()
        self._synchronize()
        if self._backend.world_size == 1:
            return
        # (outside any step: not in comm_stats())
        differ = ranks_holding_other(self._backend.inner, (p for b in self._buckets for p in b.params), self._device())
        if differ:
            raise RuntimeError(
                f"synchronize(): the parameters of ranks {differ} differ from rank 0's after step {self._step}; "
                "something changed them outside the optimizer on some ranks (or the ranks built different models)")

    def _synchronize(self) -> None:
        """Align the replicas where the algorithm lets them differ (nothing to do by default)."""

    def no_sync(self) -> AbstractContextManager[None]:
        """A context manager for the backward passes of gradient accumulation's micro-batches but
        the last, as DDP's: with ``overlap_backward=True`` nothing starts during them (the last
        backward, outside, starts each bucket's communication with the summed gradients). Without
        overlap it does nothing. The adapters enter it from the framework's accumulation boundary."""
        return self._overlap.no_sync() if self._overlap is not None else nullcontext()

    @property
    def overlap_backward(self) -> bool:
        return self._overlap is not None

    @property
    def overlap_redone(self) -> bool:
        """Whether some step redid the communication that backward had started, because the
        gradients changed between backward and ``step()`` (``overlap_backward``; said once in a
        warning, see :mod:`onebit.overlap`)."""
        return self._told_changed

    def set_accumulation_boundary(self, boundary: Callable[[], bool] | None) -> None:
        """With ``overlap_backward=True``: ``boundary()`` says whether the backward running now ends a
        gradient accumulation (e.g. the DeepSpeed engine's ``is_gradient_accumulation_boundary``);
        the backward passes before it start nothing, as under :meth:`no_sync`. None: every backward
        may start the coming step's communication. Without overlap it does nothing."""
        if boundary is not None and not callable(boundary):
            raise TypeError(f"set_accumulation_boundary expects a callable returning a bool or None, got {boundary!r}")
        if self._overlap is not None:
            self._overlap.boundary = boundary

    @property
    def backend(self) -> CommBackend:
        """The transport in use."""
        return self._backend.inner

    @property
    def topology(self) -> Topology | None:
        """The two-level topology of the compressed all-reduce (``hierarchy=``), or ``None`` (flat)."""
        return self._topology

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def nonfinite_grads(self) -> str:
        return self._health.nonfinite_grads

    @property
    def divergence(self) -> str:
        return self._health.divergence

    def comm_stats(self) -> dict[str, Any]:
        """Communication statistics of this rank, per plan name, in total and for the last step.

        The keys are the same for every optimizer: every plan name of every onebit optimizer
        (:meth:`stats_plan_names`; zeros for the plans this one never runs), ``total`` (all plans)
        and ``last_step``. ``bytes_sent`` counts what this rank sends under a bandwidth-optimal algorithm for each
        collective (see :mod:`onebit.stats`). ``worker_error_norm`` / ``server_error_norm`` are
        the current L2 norms of the compression errors (computed on request).
        ``skipped_in_a_row``: the current run of steps skipped for non-finite gradients;
        ``error_to_momentum``: the worker error's norm over the compressed buffer's at the last
        health check (mean over ranks; None before the first), see ``divergence``;
        ``update_to_lr``: the largest step of a coordinate in units of its learning rate at the last
        health check (mean over ranks; None before the first).
        """
        errors = [b.compression.held_errors() for b in self._buckets if b.compression is not None]  # (none allocated)

        return {
            "backend": self._backend.name,
            "world_size": self._backend.world_size,
            "phase": self.phase,
            "step": self._step,
            "buckets": len(self._buckets),
            **{name: self._backend.stats_dict(name) for name in self.stats_plan_names()},
            "total": self._backend.total_dict(),
            "last_step": self._backend.stats_dict(None),
            "worker_error_norm": l2_norm(w for w, _ in errors),
            "server_error_norm": l2_norm(s for _, s in errors),
            "skipped_in_a_row": self._health.skipped_in_a_row,
            "error_to_momentum": self._health.error_ratio_agreed,
            "update_to_lr": self._health.update_ratio_agreed,
        }

    def reset_comm_stats(self) -> None:
        self._backend.reset()

    def stats_plan_names(self) -> tuple[str, ...]:
        """The plan names :meth:`comm_stats` has a key for: this optimizer's, then every other
        registered optimizer's (``"warmup"``, ``"compression"``, ``"variance"``, ...)."""
        names = dict.fromkeys(self.PLAN_NAMES)
        for cls in OnebitOptimizer.registered().values():
            names.update(dict.fromkeys(cls.PLAN_NAMES))
        return tuple(names)

    def record_framework_bytes(self, nbytes: int) -> None:
        """Count, in :meth:`comm_stats`, one collective of ``nbytes`` (what this rank sends, as
        :mod:`onebit.stats` counts) that a framework runs for the coming step, e.g. DDP's gradient
        all-reduce of a bucket under :func:`onebit.integrations.attach_ddp` (its hook reports it)."""
        self._backend.record_framework(self.next_plan.name, nbytes)

    def set_gradients_averaged(self, averaged: bool) -> None:
        """Declare that on steps whose plan averages gradients they arrive already averaged over
        ranks (e.g. by DDP with :func:`onebit.integrations.attach_ddp`), so ``step()`` does not
        all-reduce them again. On other steps gradients must be local, whatever this says."""
        check_flag("averaged", averaged)
        self._gradients_averaged = averaged

    def register_timer(self, timer: Callable[[str, float], None]) -> None:
        """Call ``timer(label, seconds)`` after each labelled part of ``step()`` with its host wall
        time: ``gather_grads``, ``finite_check``, ``compress_input``, ``codec_worker``,
        ``codec_server``, ``codec_decode``, ``update`` (communication is in ``comm_stats()``).
        Each part is also a ``torch.profiler.record_function`` range named ``onebit.<label>``."""
        self._timed.add(timer)

    # ----------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step. Every call updates the parameters (no hidden first-step dry run),
        unless the gradients are not finite on some rank: then, by ``nonfinite_grads``, every rank
        skips the step together (parameters, state, errors and step count untouched) or raises."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _run_eagerly(self._check_before_step)
        if self._trainable() != self._trainable_at_build:
            self._drain()
            self._rebuild_buckets()
            if self._overlap is not None:
                self._overlap.attach(self._buckets)
        for bucket in self._buckets:
            bucket.refresh()
        check_grads(self._buckets, type(self).__name__)
        start = time.perf_counter()
        t = self._step + 1
        self._schedule_step(t)
        plan = self.plan_for(t)
        if not self._began(t):  # (a round begun during backward began the step's statistics)
            self._backend.begin_step(plan.name)
        if not self._layout_checked:  # first step: ranks holding different models fail clearly
            check_layout(self._buckets, self._backend)
            self._layout_checked = True
        self._steps_taken += 1
        if self._load_note is not None:
            if self._speaks:
                logger.info(*self._load_note)
            self._load_note = None
        applied = self._run(plan, t)
        rank = self._backend.rank
        self._health.count_skips(applied, t, plan.name, rank)
        if applied and plan.compress:
            self._compressed_steps += 1
        self._backend.end_step(applied, time.perf_counter() - start)
        return loss

    def _device(self) -> torch.device:
        return self._buckets[0].device if self._buckets else torch.device("cpu")

    def _kernels_for(self, bucket: Bucket) -> KernelSet:
        kernels = self._kernels[bucket.device]
        return timed_kernels(kernels, self._timed) if self._timed.callbacks else kernels


def _run_eagerly(check: Callable[[], None]) -> None:
    """Run ``check`` outside ``torch.compile``'s tracing: it reads and writes Python state (the
    groups, the step order's registry). Traced inside a compiled ``step`` with ``overlap_backward``,
    the round backward had begun was lost (the step's server stage found no worker stage)."""
    torch.compiler.disable(check)()


def optimizer_names() -> str:
    """The onebit optimizers' class names, for messages: "OnebitAdam, OnebitLamb or ZeroOneAdam"."""
    *first, last = [cls.__name__ for cls in OnebitOptimizer.registered().values()] or ["a onebit optimizer"]
    return f"{', '.join(first)} or {last}" if first else last
