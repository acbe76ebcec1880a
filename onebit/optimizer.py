"""OnebitAdam: Adam with a full-precision warmup, then a frozen variance and 1-bit momentum averaging."""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import checkpoint
from . import functional as F
from .backends import CommBackend, resolve_backend
from .collectives import CompressionState, finish_, start_server_, start_worker_
from .compression import SegmentLayout
from .kernels import get_kernels
from .kernels.reference import pack_signs
from .stats import PHASES, InstrumentedBackend, PhaseStats

logger = logging.getLogger(__name__)

__all__ = ["OnebitAdam"]

DEFAULT_BUCKET_SIZE = 2**24  # elements (64 MiB of float32 momentum)
# A run going wrong (see the ``divergence`` argument): this many skipped steps in a row, or a tensor
# whose worker compression error is above this many times its momentum's norm, checked every so many
# compression steps (two extra passes over the buffers then). A healthy run keeps the ratio near 1
# (1-bit quantization of Gaussian-like values leaves an error of about 0.6 of the input's norm; a
# tensor whose gradient stops decays with a ratio near 1.3); a tensor that shares a scale with much
# larger ones, as in one scale per bucket, gets errors of the size of the others' momenta.
SKIPS_TO_WARN = 3
ERROR_RATIO_TO_WARN = 10.0
HEALTH_CHECK_INTERVAL = 16
# Up to this many gradient tensors the finiteness check sums each (the fastest pass over a large
# tensor); above it, one foreach norm call avoids a Python call per tensor.
_FEW_TENSORS = 64
# Zeroing k scattered coordinates (index_fill_: 6.5 ns each) costs about what the decode's extra
# read of a packed mask over 1000 k coordinates does (0.14 ms per 25M; one CPU core): a bucket
# whose momentum mask has more zeros than 1/RATIO of its length hands the mask to the decode.
_DENSE_MASK_RATIO = 1024


class _Bucket:
    """Flat, padded buffers for a run of parameters of one group on one device.

    Compressed buckets lay their tensors out as segments (:class:`onebit.compression.SegmentLayout`):
    each tensor padded on its own, so that every segment gets its own scales. ``slices`` say
    where each tensor lies; the padding between them (``real`` is False there) holds zeros in the
    moments and never reaches a parameter.
    """

    def __init__(self, group_index: int, params: list[torch.Tensor], world_size: int, compress: bool,
                 scale_block_size: int | None = None) -> None:
        self.group_index = group_index
        self.params = params
        self.device = params[0].device
        self.numel = sum(p.numel() for p in params)
        numels = [p.numel() for p in params]
        if compress:
            self.layout = SegmentLayout.build(numels, world_size, scale_block_size)
            self.slices = self.layout.slices()
            self.padded = self.layout.padded
        else:
            self.layout = None
            starts = [0, *itertools.accumulate(numels)]
            self.slices = [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]
            self.padded = self.numel
        kwargs = {"dtype": torch.float32, "device": self.device}
        self.exp_avg = torch.zeros(self.padded, **kwargs)
        self.exp_avg_sq = torch.zeros(self.padded, **kwargs)
        # Flat scratch buffers of the full-precision path (the gathered, all-reduced gradient and
        # the update direction, in the bucket's layout), allocated on first use; a compressed
        # bucket releases them when compression starts, since it reads p.grad and updates p in
        # place (see scratch()).
        self._scratch: dict[str, torch.Tensor] = {}
        self.mask: torch.Tensor | None = None  # the user's momentum mask (1 keep, 0 zero)
        # In compression: where the momentum is kept 0 (the user's mask, where the frozen
        # variance is 0, and the padding), or None: the indices when they are few (applying them
        # costs what they hold), else packed bits over the padded buffer (set = keep) that the
        # decode applies in its own pass. Derived from exp_avg_sq when compression starts or
        # state is loaded.
        self.frozen_zeros: torch.Tensor | None = None
        self.frozen_keep: torch.Tensor | None = None
        self.frozen_mask_ready = False
        # In compression: sqrt(v / bc2) + eps of the frozen variance, for the key (eps, bc2).
        self.denominator: torch.Tensor | None = None
        self.denominator_key: tuple[float, float] | None = None
        self.same_dtype = all(p.dtype == torch.float32 for p in params)
        self.compression = (CompressionState(self.padded, world_size, self.device, self.layout.edges)
                            if compress else None)
        self.momenta = self.views(self.exp_avg)  # made once: a view costs ~8 us, per tensor per step
        self.denominators: list[torch.Tensor] = []  # views of ``denominator``

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[s].view(p.shape) for s, p in zip(self.slices, self.params)]

    def real(self) -> torch.Tensor:
        """A bool tensor over the padded buffer: True where a parameter element lies."""
        real = torch.zeros(self.padded, dtype=torch.bool, device=self.device)
        for s in self.slices:
            real[s] = True
        return real

    def scratch(self, name: str, length: int | None = None) -> torch.Tensor:
        """The flat float32 buffer ``name`` (``'grad'`` or ``'update'``: ``padded`` elements, zero
        in the padding; ``'wire'``: the gradients end to end), allocated on first use."""
        buffer = self._scratch.get(name)
        if buffer is None:
            size = self.padded if length is None else length
            buffer = self._scratch[name] = torch.zeros(size, dtype=torch.float32, device=self.device)
        return buffer

    def dense_grads(self) -> list[torch.Tensor] | None:
        """Views of the ``'wire'`` buffer, one per parameter: the gradients end to end, which a
        full-precision all-reduce sends instead of the padded layout; None when nothing is padded."""
        if self.padded == self.numel:
            return None
        return list(self.scratch("wire", self.numel).split([p.numel() for p in self.params]))

    def release_scratch(self) -> None:
        self._scratch.clear()


def _check_number(name: str, value: Any, *, low: float = 0.0, high: float | None = None, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
    if not math.isfinite(value) or value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"invalid {name}: {value!r}; it must be finite and {bound}")


def _check_group_hyperparameters(group: Mapping[str, Any]) -> None:
    _check_number("lr", group["lr"])
    _check_number("eps", group["eps"])
    if group["eps"] == 0:
        raise ValueError(
            "invalid eps: 0; it must be > 0: a coordinate whose gradient has been 0 has m = v = 0, and "
            "its update m / (sqrt(v) + eps) would be 0 / 0 = NaN (use e.g. eps=1e-8)"
        )
    _check_number("weight_decay", group["weight_decay"])
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    _check_number("betas[0]", betas[0], high=1.0, high_open=True)
    _check_number("betas[1]", betas[1], high=1.0, high_open=True)
    if not isinstance(group["compress"], bool):
        raise TypeError(f"compress must be True or False, got {group['compress']!r}")
    if not isinstance(group["bias_correction"], bool):
        raise TypeError(f"bias_correction must be True or False, got {group['bias_correction']!r}")
    if "exp_avg_mask" in group:
        raise ValueError(
            "param group key 'exp_avg_mask' (DeepSpeed) is not read by onebit; pass "
            "momentum_masks={param: mask} to OnebitAdam instead"
        )


def _check_params(params: list[Any]) -> None:
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"OnebitAdam expects tensors (or param-group dicts), got {type(p).__name__}")
        if p.is_complex():
            raise ValueError(
                f"complex parameter of shape {tuple(p.shape)}: OnebitAdam handles real tensors only; "
                "view it with torch.view_as_real before building the model"
            )
        if not p.is_floating_point():
            raise ValueError(f"parameter of dtype {p.dtype} is not floating point; only float parameters can be optimized")
        if p.is_sparse:
            raise ValueError("sparse parameters are not supported; use dense tensors")


class OnebitAdam(torch.optim.Optimizer):
    r"""1-bit Adam (Tang et al., 2021) as a plain ``torch.optim.Optimizer``.

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
        lr, betas, eps, weight_decay: as in Adam (``weight_decay`` is decoupled).
        freeze_step: number of warmup steps (>= 1). The paper uses 15-25% of training.
        bias_correction: divide the moments by ``1 - beta**t`` (with ``t = freeze_step`` for the
            frozen variance). Off by default, as in DeepSpeed.
        comm_backend_name: ``'gloo'``, ``'nccl'``, ``'hccl'`` (the initialized torch.distributed
            process group), ``'mpi'`` (mpi4py), ``'local'`` (one process), or ``None`` to use
            the default process group when there is one.
        backend: a :class:`onebit.backends.CommBackend` object instead of a name.
        cuda_aware: with ``'mpi'``: hand device buffers straight to a CUDA-aware MPI.
        group: the process group (torch.distributed) or communicator (mpi4py) of the data-parallel
            ranks; default the whole job.
        momentum_masks: ``{param: mask}``; where ``mask`` is 0 the momentum is kept exactly 0
            (e.g. position-embedding rows beyond the sequence length in use). Same shape and
            device as the parameter; bool or 0/1 floats. Not saved in checkpoints.
        bucket_size: number of elements per compression bucket; each bucket costs 2 collective
            calls per compression step and 1 per warmup step, however many tensors it holds.
            Inside a bucket every tensor has its own scales (as if compressed alone, as DeepSpeed
            did), so the bucket size changes the number of collectives, not the numerics.
        scale_block_size: ``None`` (default): one scale per tensor (per rank and chunk). An int
            ``k``: one scale per block of ``k`` elements of each tensor (rounded up to a multiple
            of ``8 * world_size``), for finer quantization at ``4 / k`` more bytes per element on
            the wire.
        nonfinite_grads: ``'skip'`` (default): when any rank's gradients contain NaN or inf (or
            ``torch.amp.GradScaler`` found an overflow), every rank skips the step, leaving
            parameters, moments, compression errors and the step count untouched; ``'raise'``:
            every rank raises ``FloatingPointError``. A NaN never enters error feedback. With
            GradScaler, ``scaler.step(optimizer)`` hands the scale to this optimizer, which
            unscales and lets every rank agree on skipping; the scalers' own scales may then
            differ between ranks for a step, the parameters never do.
        divergence: what a run going wrong does: ``'warn'`` (default) logs a warning on rank 0,
            once per episode, when ``SKIPS_TO_WARN`` steps in a row were skipped for non-finite
            gradients, or when the worker compression error has grown above
            ``ERROR_RATIO_TO_WARN`` times the momentum's norm (checked every
            ``HEALTH_CHECK_INTERVAL`` compression steps); ``'raise'``: every rank raises
            ``FloatingPointError`` instead (nothing is changed by the step that raises).
        kernels: codec implementation (``'auto'``, ``'reference'``, or a native one); default
            from the ``ONEBIT_KERNELS`` environment variable, else ``'auto'``.
    """

    # torch.amp.GradScaler: set ``grad_scale``/``found_inf`` on the optimizer and always call step().
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = False,
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
    ) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int):
            raise TypeError(f"freeze_step must be an int, got {freeze_step!r} of type {type(freeze_step).__name__}")
        if freeze_step < 1:
            raise ValueError(
                f"invalid freeze_step: {freeze_step}; it must be >= 1, because the variance is frozen "
                "after freeze_step steps of Adam and a zero variance would make the update m / eps"
            )
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"invalid bucket_size: {bucket_size!r}; it must be a positive int (elements)")
        if nonfinite_grads not in ("skip", "raise"):
            raise ValueError(f"invalid nonfinite_grads: {nonfinite_grads!r}; expected 'skip' or 'raise'")
        if divergence not in ("warn", "raise"):
            raise ValueError(f"invalid divergence: {divergence!r}; expected 'warn' or 'raise'")
        if scale_block_size is not None and (isinstance(scale_block_size, bool) or not isinstance(scale_block_size, int)
                                             or scale_block_size < 1):
            raise ValueError(
                f"invalid scale_block_size: {scale_block_size!r}; it must be a positive int (elements per scale), "
                "or None for one scale per tensor"
            )
        if not isinstance(cuda_aware, bool):
            raise TypeError(f"cuda_aware must be True or False, got {cuda_aware!r}")
        defaults = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, bias_correction=bias_correction, compress=True,
        )
        _check_group_hyperparameters(defaults)
        self.freeze_step = freeze_step
        self.bucket_size = bucket_size
        self._buckets: list[_Bucket] = []
        self._step = 0
        self._kernel_choice = kernels
        self.nonfinite_grads = nonfinite_grads
        self.scale_block_size = scale_block_size
        self.divergence = divergence
        self._skipped_in_a_row = 0
        self._error_ratio: float | None = None  # worker error / momentum norm at the last check (local)
        self._error_ratio_agreed: float | None = None  # its mean over ranks, agreed at the next step
        self._warned: set[str] = set()  # the kinds of divergence warned about in the current episode
        self._layout_checked = False
        self._warmup_grads_averaged = False
        super().__init__(params, defaults)
        # Everything above validates without side effects; only now is a backend touched.
        self._backend = InstrumentedBackend(
            resolve_backend(comm_backend_name, backend, cuda_aware=cuda_aware, group=group)
        )
        self._kernels = {}
        self._build_buckets()
        self._set_masks(momentum_masks or {})

    # ----------------------------------------------------------------- construction

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"a param group must be a dict, got {type(param_group).__name__}")
        hyper = {k: v for k, v in param_group.items() if k != "params"}
        _check_group_hyperparameters({**self.defaults, **hyper})
        params = param_group.get("params", [])
        params = [params] if isinstance(params, torch.Tensor) else params
        if not isinstance(params, (set, frozenset)):
            params = list(params)
            _check_params(params)
            param_group = {**param_group, "params": params}
        super().add_param_group(param_group)
        if getattr(self, "_backend", None) is not None:
            self._build_group_buckets(len(self.param_groups) - 1)

    def _build_buckets(self) -> None:
        self._buckets = []
        for index in range(len(self.param_groups)):
            self._build_group_buckets(index)

    def _build_group_buckets(self, index: int) -> None:
        group = self.param_groups[index]
        world = self._backend.world_size
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.requires_grad:
                by_device.setdefault(p.device, []).append(p)
        for params in by_device.values():
            run: list[torch.Tensor] = []
            size = 0
            for p in params:
                if run and size + p.numel() > self.bucket_size:
                    self._add_bucket(index, run, world, group["compress"])
                    run, size = [], 0
                run.append(p)
                size += p.numel()
            if run:
                self._add_bucket(index, run, world, group["compress"])

    def _add_bucket(self, index: int, params: list[torch.Tensor], world: int, compress: bool) -> None:
        bucket = _Bucket(index, params, world, compress, self.scale_block_size)
        for p, m, v in zip(params, bucket.views(bucket.exp_avg), bucket.views(bucket.exp_avg_sq)):
            self.state[p] = {"exp_avg": m, "exp_avg_sq": v}
        if bucket.device not in self._kernels:
            self._kernels[bucket.device] = get_kernels(bucket.device, self._kernel_choice)
        self._buckets.append(bucket)

    def _set_masks(self, masks: Mapping[torch.Tensor, torch.Tensor]) -> None:
        if not isinstance(masks, Mapping):
            raise TypeError(f"momentum_masks must be a mapping {{param: mask}}, got {type(masks).__name__}")
        located = {}
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                located[id(p)] = (bucket, i)
        checked = []
        for param, mask in masks.items():
            if id(param) not in located:
                raise ValueError(
                    f"momentum_masks has a key of shape {tuple(param.shape)} that is not a trainable "
                    "parameter of this optimizer; key the mapping by the parameter tensor itself"
                )
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"momentum mask must be a tensor, got {type(mask).__name__}")
            if mask.shape != param.shape:
                raise ValueError(
                    f"momentum mask of shape {tuple(mask.shape)} does not match its parameter of shape "
                    f"{tuple(param.shape)}; give a mask of the parameter's shape"
                )
            if mask.device != param.device:
                raise ValueError(
                    f"momentum mask is on {mask.device} but its parameter is on {param.device}; "
                    f"move the mask with mask.to({str(param.device)!r})"
                )
            if mask.dtype != torch.bool:
                if not mask.is_floating_point() and mask.dtype not in (torch.uint8, torch.int8, torch.int32, torch.int64):
                    raise TypeError(f"momentum mask must be bool or 0/1 numbers, got dtype {mask.dtype}")
                if not bool(((mask == 0) | (mask == 1)).all()):
                    raise ValueError("momentum mask must contain only 0 and 1 (or be a bool tensor)")
            checked.append((located[id(param)], mask))
        for (bucket, i), mask in checked:
            if bucket.mask is None:
                bucket.mask = torch.ones(bucket.padded, dtype=torch.float32, device=bucket.device)
            bucket.mask[bucket.slices[i]].copy_(mask.reshape(-1).to(torch.float32))
            bucket.exp_avg.mul_(bucket.mask)

    # ----------------------------------------------------------------- public state

    @property
    def phase(self) -> str:
        """``'warmup'`` or ``'compression'``: the phase the next ``step()`` runs in."""
        return "warmup" if self._step < self.freeze_step else "compression"

    @property
    def step_count(self) -> int:
        """Number of ``step()`` calls completed (restored by ``load_state_dict``)."""
        return self._step

    @property
    def backend(self) -> CommBackend:
        """The transport in use."""
        return self._backend.inner

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def comm_stats(self) -> dict[str, Any]:
        """Communication statistics of this rank, per phase and for the last step.

        ``bytes_sent`` counts what this rank sends under a bandwidth-optimal algorithm for each
        collective (see :mod:`onebit.stats`). ``worker_error_norm`` / ``server_error_norm`` are
        the current L2 norms of the compression errors (computed on request).
        ``skipped_in_a_row``: the current run of steps skipped for non-finite gradients;
        ``error_to_momentum``: the worker error's norm over the momentum's at the last health
        check (mean over ranks; None before the first), see ``divergence``.
        """
        worker = [b.compression.worker_error for b in self._buckets if b.compression is not None]
        server = [b.compression.server_error for b in self._buckets if b.compression is not None]
        norm = lambda ts: float(torch.sqrt(sum((t.double().square().sum() for t in ts), torch.tensor(0.0, dtype=torch.float64))))
        return {
            "backend": self._backend.name,
            "world_size": self._backend.world_size,
            "phase": self.phase,
            "step": self._step,
            "buckets": len(self._buckets),
            "warmup": self._backend.totals["warmup"].as_dict(),
            "compression": self._backend.totals["compression"].as_dict(),
            "last_step": self._backend.last_step.as_dict(),
            "worker_error_norm": norm(worker),
            "server_error_norm": norm(server),
            "skipped_in_a_row": self._skipped_in_a_row,
            "error_to_momentum": self._error_ratio_agreed,
        }

    def set_warmup_gradients_averaged(self, averaged: bool) -> None:
        """Declare that gradients arrive already averaged over ranks in the warmup phase (e.g. by
        DDP with :func:`onebit.integrations.attach_ddp`), so ``step()`` does not all-reduce them
        again. In the compression phase gradients must be local, whatever this says."""
        if not isinstance(averaged, bool):
            raise TypeError(f"averaged must be True or False, got {averaged!r}")
        self._warmup_grads_averaged = averaged

    def reset_compression_errors(self) -> None:
        """Zero the worker and server errors of every bucket (what ``load_state_dict`` does)."""
        for bucket in self._buckets:
            if bucket.compression is not None:
                bucket.compression.reset_errors_()

    def reset_comm_stats(self) -> None:
        self._backend.totals = {p: PhaseStats() for p in PHASES}
        self._backend.last_step = PhaseStats()

    # ----------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step. Every call updates the parameters (no hidden first-step dry run),
        unless the gradients are not finite on some rank: then, by ``nonfinite_grads``, every rank
        skips the step together (parameters, moments, errors and step count untouched) or raises."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads()
        start = time.perf_counter()
        phase = self.phase
        self._backend.phase = phase
        self._backend.last_step = PhaseStats()
        if not self._layout_checked:
            self._check_layout()
        applied = self._step_buckets(phase == "compression")
        self._count_skips(applied)
        if applied and phase == "compression" and (self._step - self.freeze_step) % HEALTH_CHECK_INTERVAL == 0:
            self._error_ratio = self._measure_error_ratio()
        elapsed = time.perf_counter() - start
        for stats in (self._backend.totals[phase], self._backend.last_step):
            stats.steps += int(applied)
            stats.skipped_steps += int(not applied)
            stats.step_time_s += elapsed
        return loss

    def _check_grads(self) -> None:
        for bucket in self._buckets:
            for p in bucket.params:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise ValueError("OnebitAdam does not support sparse gradients; use dense embeddings (sparse=False)")
                if g.shape != p.shape:
                    raise ValueError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
                if g.device != p.device:
                    raise ValueError(f"gradient on {g.device} for a parameter on {p.device}; keep them on one device")

    def _check_layout(self) -> None:
        """First step: one all-gather of a layout hash, so that ranks holding different models
        fail with the same clear error instead of deadlocking or mixing buffers."""
        if not self._buckets:
            self._layout_checked = True
            return
        digest = self._layout_digest()
        mine = torch.tensor(list(digest), dtype=torch.uint8, device=self._buckets[0].device)
        everyone = torch.empty(self._backend.world_size, 8, dtype=torch.uint8, device=mine.device)
        self._backend.all_gather(everyone, mine)
        differ = [r for r in range(everyone.shape[0]) if not torch.equal(everyone[r], everyone[0])]
        if differ:
            raise ValueError(
                f"the parameter layout differs between ranks: ranks {differ} do not match rank 0 (their "
                "parameter shapes, dtypes, param groups or bucket_size differ); every rank must build the "
                "same model and the same param groups in the same order"
            )
        self._layout_checked = True

    def _layout_digest(self) -> bytes:
        """8 bytes that differ when the parameter layout (groups, shapes, dtypes, buckets) does."""
        description = repr([(b.group_index, b.device.type, b.padded, b.compression is not None,
                             None if b.layout is None else b.layout.edges,
                             [(tuple(p.shape), str(p.dtype)) for p in b.params]) for b in self._buckets])
        return hashlib.sha256(description.encode()).digest()[:8]

    def _compression_errors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(worker error, server error) of every compressed bucket, in bucket order."""
        return [(b.compression.worker_error, b.compression.server_error) for b in self._buckets
                if b.compression is not None]

    def _gather_grads(self, bucket: _Bucket, inv_scale: torch.Tensor | None, dense: bool) -> list[torch.Tensor]:
        """Copy the gradients (None: zeros) into one of the bucket's flat buffers and return the
        per-parameter views of it: end to end (``dense``, see :meth:`_Bucket.dense_grads`) or in
        the bucket's padded layout (``'grad'``)."""
        views = bucket.dense_grads() if dense else None
        if views is None:
            views = [bucket.scratch("grad")[s] for s in bucket.slices]
        for view, p in zip(views, bucket.params):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        if inv_scale is not None:
            torch._foreach_mul_(views, inv_scale.to(bucket.device))
        return [view.view(p.shape) for view, p in zip(views, bucket.params)]

    def _grads_of(self, bucket: _Bucket, compressing: bool, inv_scale: torch.Tensor | None) -> list[torch.Tensor | None]:
        """The gradients this step reads, one per parameter (None: no gradient, i.e. zero).

        In compression the momentum is updated straight from the parameters' ``.grad`` tensors
        when they are float32 and need no unscaling: nothing else reads a flat copy there. Else
        they are gathered into a flat buffer and this returns views of it: for a full-precision
        all-reduce (warmup, ``compress=False``) the gradients end to end, so that exactly their
        bytes travel (:meth:`_full_precision_update` spreads them into the padded layout); else
        (GradScaler, other dtypes) the bucket's padded layout."""
        full_precision = not compressing or bucket.compression is None
        if not full_precision and inv_scale is None and all(
                p.grad is None or p.grad.dtype == torch.float32 for p in bucket.params):
            return [p.grad for p in bucket.params]
        return self._gather_grads(bucket, inv_scale, dense=full_precision)

    def _step_buckets(self, compressing: bool) -> bool:
        """Run one step over all buckets; return False when it was skipped for non-finite grads."""
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        found_inf = getattr(self, "found_inf", None)
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        grads = [self._grads_of(bucket, compressing, inv_scale) for bucket in self._buckets]
        t = self._step + 1
        # Ranks agree on finiteness before anything changes. Full-precision all-reduces carry a NaN
        # or inf to every rank by themselves; compressed buckets use one scalar all-reduce instead.
        local_bad = found_inf is not None and bool(found_inf.item() > 0)
        compressed = [b for b in self._buckets if compressing and b.compression is not None]
        if compressed:
            local_bad = local_bad or not self._all_finite(grads)
            # The same scalar all-reduce carries the last health check's error ratio, so that every
            # rank agrees on it (and raises together, if asked to).
            ratio = self._error_ratio
            flag = torch.tensor([float(local_bad), 0.0 if ratio is None else ratio], device=compressed[0].device)
            self._backend.all_reduce_mean_(flag)
            bad_ranks = round(flag[0].item() * self._backend.world_size)
            if ratio is not None:
                self._error_ratio, self._error_ratio_agreed = None, float(flag[1].item())
                self._judge_error_ratio(t)
        for bucket in self._buckets:
            if bucket not in compressed and not (self._warmup_grads_averaged and not compressing):
                self._backend.all_reduce_mean_(bucket.scratch("grad" if bucket.padded == bucket.numel else "wire"))
        if not compressed:
            averaged_bad = not self._all_finite(grads)
            bad_ranks = int(averaged_bad or local_bad)
        if bad_ranks:
            return self._nonfinite(t, bad_ranks, bool(compressed))
        if compressed and not all(b.frozen_mask_ready for b in compressed):
            self._freeze_masks(compressed, t)
        # Compressed buckets are pipelined: each bucket's all-to-all and all-gather are in flight
        # while the other buckets are compressed, recompressed and updated (same results as one
        # bucket after the other; every rank starts the collectives in the same order).
        for bucket, bucket_grads in zip(self._buckets, grads):
            if bucket in compressed:
                F.momentum_(bucket.momenta, bucket_grads, self.param_groups[bucket.group_index]["betas"][0])
                start_worker_(bucket.exp_avg, bucket.compression, self._backend, self._kernels[bucket.device])
        for bucket in self._buckets:
            if bucket not in compressed:
                self._full_precision_update(bucket, self.param_groups[bucket.group_index], t)
        for bucket in compressed:
            start_server_(bucket.compression, self._backend, self._kernels[bucket.device])
        for bucket in compressed:
            finish_(bucket.exp_avg, bucket.compression, self._kernels[bucket.device], bucket.frozen_keep)
            self._compressed_update(bucket, self.param_groups[bucket.group_index], t)
        self._step = t
        return True

    @staticmethod
    def _all_finite(grads: list[list[torch.Tensor | None]]) -> bool:
        """Whether every gradient is finite: one read-only pass. A tensor's sum (few tensors) or L2
        norm (many: one foreach call instead of a call per tensor) is NaN or inf when an element
        is; when it overflowed from finite values only, the exact element-wise check decides."""
        present = [g for bucket_grads in grads for g in bucket_grads if g is not None]
        if not present:
            return True
        if len(present) <= _FEW_TENSORS:
            totals = torch.stack([g.sum() for g in present])
        else:
            totals = torch.stack(torch._foreach_norm(present, 2))
        finite = torch.isfinite(totals)
        if bool(finite.all()):
            return True
        return all(bool(torch.isfinite(g).all()) for g, ok in zip(present, finite.tolist()) if not ok)

    def _freeze_masks(self, buckets: list[_Bucket], t: int) -> None:
        """At the switch to compression (or the first compression step after a load): where the
        frozen variance is exactly 0, the update ``m / (sqrt(v) + eps)`` would be ``+-scale / eps``
        (1 bit cannot encode 0), so those coordinates keep a zero momentum and do not move."""
        zero = 0
        for bucket in buckets:
            real = bucket.real()
            keep = bucket.exp_avg_sq != 0
            keep &= real
            dead = bucket.numel - int(keep.sum())
            if bucket.mask is not None:
                keep &= bucket.mask != 0
            zeros = bucket.padded - int(keep.sum())  # the padding included: it is zeroed too
            bucket.frozen_zeros = bucket.frozen_keep = None
            if zeros * _DENSE_MASK_RATIO > bucket.padded:
                signs = torch.full((bucket.padded,), -1.0, device=bucket.device)
                signs.masked_fill_(keep, 1.0)
                bucket.frozen_keep = pack_signs(signs)
            elif zeros:
                bucket.frozen_zeros = torch.nonzero(~keep).flatten()
            bucket.frozen_mask_ready = True
            bucket.release_scratch()  # compression reads p.grad directly (re-allocated if it cannot)
            zero += dead
        if self._backend.rank == 0:
            what = "variance frozen, switching to" if t == self.freeze_step + 1 else "resuming with"
            logger.info(
                "onebit: step %d: %s 1-bit compressed momentum%s", t, what,
                f"; {zero} coordinates with zero variance keep a zero momentum" if zero else "",
            )

    def _count_skips(self, applied: bool) -> None:
        """Count skipped steps in a row; warn (or raise) once when they reach SKIPS_TO_WARN."""
        if applied:
            if self._skipped_in_a_row >= SKIPS_TO_WARN and self._backend.rank == 0:
                logger.warning("onebit: step %d applied after %d skipped steps in a row", self._step,
                               self._skipped_in_a_row)
            self._skipped_in_a_row = 0
            self._warned.discard("skips")
            return
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= SKIPS_TO_WARN and "skips" not in self._warned:
            self._warned.add("skips")
            self._diverging(
                f"{self._skipped_in_a_row} step() calls in a row were skipped for non-finite gradients (at step "
                f"{self._step + 1}, {self.phase} phase); the run may be diverging: lower the learning rate, or "
                "in compression raise freeze_step"
            )

    def _measure_error_ratio(self) -> float | None:
        """The largest ratio, over this rank's segments (tensors, or blocks of them), of the worker
        compression error's norm to the averaged momentum's norm; segments whose momentum is 0
        (masked) are left out. None when there are none."""
        worst = None
        for bucket in self._buckets:
            if bucket.compression is None:
                continue
            sizes = [b - a for a, b in zip(bucket.layout.edges[:-1], bucket.layout.edges[1:])]
            errors = torch.stack(torch._foreach_norm(list(bucket.compression.worker_error.split(sizes))))
            momenta = torch.stack(torch._foreach_norm(list(bucket.exp_avg.split(sizes))))
            live = momenta > 0
            if bool(live.any()):
                ratio = float((errors[live] / momenta[live]).max())
                worst = ratio if worst is None else max(worst, ratio)
        return worst

    def _judge_error_ratio(self, t: int) -> None:
        ratio = self._error_ratio_agreed
        if ratio is None or ratio <= ERROR_RATIO_TO_WARN:
            self._warned.discard("errors")
            return
        if "errors" not in self._warned:
            self._warned.add("errors")
            self._diverging(
                f"before step {t} the worker compression error norm of a tensor is {ratio:.3g} times its "
                f"momentum's norm (worst tensor, mean over ranks; above {ERROR_RATIO_TO_WARN:g}): 1-bit compression "
                "is no longer tracking the momentum; the run may be diverging: lower the learning rate, raise "
                "freeze_step, or try scale_block_size"
            )

    def _diverging(self, message: str) -> None:
        """Warn on rank 0, or raise on every rank (the caller's condition is the same on all)."""
        if self.divergence == "raise":
            raise FloatingPointError(f"onebit: {message} (divergence='raise')")
        if self._backend.rank == 0:
            logger.warning("onebit: %s", message)

    def _nonfinite(self, t: int, bad_ranks: int, counted: bool) -> bool:
        where = f"on {bad_ranks} of {self._backend.world_size} ranks" if counted else "in the averaged gradients"
        if self.nonfinite_grads == "raise":
            raise FloatingPointError(
                f"non-finite gradients {where} at step {t}; nothing was changed. Pass nonfinite_grads='skip' "
                "to skip such steps on every rank (as AMP's GradScaler expects)"
            )
        if self._backend.rank == 0:
            logger.debug("onebit: step %d skipped on every rank: non-finite gradients %s", t, where)
        return False

    def _full_precision_update(self, bucket: _Bucket, group: dict[str, Any], t: int) -> None:
        """Adam on the bucket's (averaged) flat gradient: warmup, and ``compress=False`` groups."""
        beta1, beta2 = group["betas"]
        grad = bucket.scratch("grad")
        dense = bucket.dense_grads()
        if dense is not None:  # the gradients arrived end to end: into the padded layout
            torch._foreach_copy_([grad[s] for s in bucket.slices], dense)
        m, v = bucket.exp_avg, bucket.exp_avg_sq  # the padding stays 0: its gradient is 0
        F.adam_moments_(m, v, grad, beta1, beta2)
        if bucket.mask is not None:
            m.mul_(bucket.mask)
        bc1, bc2 = F.bias_corrections(t, t, beta1, beta2, group["bias_correction"])
        update = F.adam_direction_(bucket.scratch("update"), m, v, group["eps"], bc1, bc2)
        updates = bucket.views(update)
        params = bucket.params
        if bucket.same_dtype:
            if group["weight_decay"] != 0:
                torch._foreach_add_(updates, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, updates, alpha=-group["lr"])
            return
        for u, p in zip(updates, params):
            if group["weight_decay"] != 0:
                u.add_(p, alpha=group["weight_decay"])
            p.add_(u.to(p.dtype), alpha=-group["lr"])

    def _compressed_update(self, bucket: _Bucket, group: dict[str, Any], t: int) -> None:
        """After the 1-bit average of the momentum: its masks, and the update with the frozen
        variance, ``p <- p * (1 - lr * wd) - lr * (m / bc1) / denominator``."""
        beta1, beta2 = group["betas"]
        m = bucket.exp_avg
        momenta = bucket.momenta
        # The masked coordinates and the padding go back to 0 (the next step's input there must be
        # 0, as when each tensor is padded afresh); the decode did it already with frozen_keep.
        if bucket.frozen_keep is None and bucket.frozen_zeros is not None:
            m.index_fill_(0, bucket.frozen_zeros, 0.0)
        bc1, bc2 = F.bias_corrections(t, self.freeze_step, beta1, beta2, group["bias_correction"])
        # The variance is frozen, so is the denominator: computed once, then one fused pass.
        self._frozen_denominator(bucket, group["eps"], bc2)
        denominators = bucket.denominators
        lr, weight_decay = group["lr"], group["weight_decay"]
        params = bucket.params
        if bucket.same_dtype:
            if weight_decay != 0:
                torch._foreach_mul_(params, 1.0 - lr * weight_decay)
            torch._foreach_addcdiv_(params, momenta, denominators, value=-lr / bc1)
            return
        for p, mom, d in zip(params, momenta, denominators):
            u = torch.div(mom, d)
            if bc1 != 1.0:
                u.div_(bc1)
            if weight_decay != 0:
                u.add_(p, alpha=weight_decay)
            p.add_(u.to(p.dtype), alpha=-lr)

    @staticmethod
    def _frozen_denominator(bucket: _Bucket, eps: float, bc2: float) -> torch.Tensor:
        key = (eps, bc2)
        if bucket.denominator is None or bucket.denominator_key != key:
            v = bucket.exp_avg_sq
            bucket.denominator = F.adam_denominator_(torch.empty_like(v), v, eps, bc2)
            bucket.denominators = bucket.views(bucket.denominator)
            bucket.denominator_key = key
        return bucket.denominator

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """World-size independent state: step, ``exp_avg``/``exp_avg_sq`` per parameter (copies),
        hyperparameters, a format version. Compression errors and masks are not saved. Hooks
        registered with ``register_state_dict_pre_hook`` / ``_post_hook`` run as in torch."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = checkpoint.build_state_dict(self)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (from any world size). Validates everything before changing
        anything, never modifies ``state_dict``, restores the phase from the step, and resets the
        compression errors (they are rank-local; the paper shows a reset does not hurt). Hooks
        registered with ``register_load_state_dict_pre_hook`` / ``_post_hook`` run as in torch."""
        state_dict = self._run_load_pre_hooks(state_dict)
        checkpoint.load_state_dict(self, state_dict)
        self._run_load_post_hooks()

    def _run_load_pre_hooks(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _run_load_post_hooks(self) -> None:
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _restore_after_load(self, step: int, *, log: bool = True) -> None:
        self._step = step
        self._error_ratio = self._error_ratio_agreed = None
        for bucket in self._buckets:
            if bucket.mask is not None:
                bucket.exp_avg.mul_(bucket.mask)
            bucket.frozen_zeros = bucket.frozen_keep = None
            bucket.frozen_mask_ready = False
            bucket.denominator = None
        self.reset_compression_errors()
        if log and self._backend.rank == 0:
            logger.info(
                "onebit: loaded optimizer state at step %d (%s phase); compression errors reset", step, self.phase
            )
