"""OnebitDiLoCo's ``sync_delay``: a fragment's outer-step exchange runs while the next inner steps
compute, and is applied ``tau`` steps after it started (Streaming DiLoCo's overlap, arXiv
2501.18512), as a mixin of :class:`onebit.OnebitDiLoCo`.

At the outer step ``t0`` of a fragment its buckets take their inner step, form the
pseudo-gradient ``delta_i = global_params - params`` (kept, as ``sync_input``, until the exchange
lands) and start the worker stage of every 1-bit pass at once: pass ``k + 1`` sends the worker
error pass ``k`` left, which the worker stage writes before it sends. Nothing waits. At step
``t0 + 1`` the server stages start (pass ``k + 1`` with the server error that pass ``k``'s left); at
step ``t0 + tau``, after that step's inner step, every pass is decoded and the exchange lands::

    progress = params - (global_params - delta_i)        (the inner steps since t0, on this rank)
    global_params, outer momentum: the outer step on mean(delta), as with tau = 0
    params = global_params [- residual] + sync_mix * progress

``sync_mix = 0`` drops the local progress made while the exchange was in flight (every rank
continues from the outer result, as with ``tau = 0``, but ``tau`` steps late); ``1`` keeps it
whole. Streaming DiLoCo mixes whole parameters instead, ``alpha * local + (1 - alpha) *
global``; the rule here keeps the outer result exact and weighs only what is new. The numbers
are the same as ``tau = 0``'s wherever no inner step ran in between (the passes, their errors
and the outer step are computed from the same values in the same order). The steps in between
are ``"inner"`` steps in ``comm_stats()``, which then count the bytes of the collectives they
complete (a collective counts where it is waited for); ``comm_stats()["outer"]["fragments"]``
counts them for their fragment.

A checkpoint taken while an exchange is in flight holds ``sync_input``, the schedule entry
``sync_pending`` (the step it started at and the parameters it leaves alone) and, as the
compression errors, those from before the exchange started: the first step after a load starts
the exchange's stages again from them, so that an exact resume continues bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .buckets import Bucket
from .collectives import AllreduceState, finish_, new_state, start_server_, start_worker_
from .health import HEALTH_CHECK_INTERVAL, error_ratio
from .plan import StepPlan
from .rounds import Round

__all__ = ["DelayedSync"]

logger = logging.getLogger(__name__)


@dataclass
class Flight:
    """The exchange in flight: started at step ``start`` for ``buckets``; per bucket (by id), the
    parameters it leaves alone (``absent``), the further passes' states and buffers (``passes``)
    and the errors from before it started (``before``: what a checkpoint saves)."""

    start: int
    buckets: list[Bucket] = field(default_factory=list)
    absent: dict[int, list[int]] = field(default_factory=dict)
    passes: dict[int, list[tuple[AllreduceState, torch.Tensor]]] = field(default_factory=dict)
    before: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    served: bool = False

    def wait(self) -> None:
        """Wait for the collectives in flight (every rank started them), without finishing them."""
        for bucket in self.buckets:
            for state in [bucket.compression, *(s for s, _ in self.passes.get(id(bucket), []))]:
                state.pending.wait()


class DelayedSync:
    """The ``sync_delay`` machinery of :class:`onebit.OnebitDiLoCo` (which provides
    ``sync_delay``, ``sync_mix``, ``_sync_pending``, the buckets, backend, kernels and the outer
    update, ``_outer_update``)."""

    _flight: Flight | None
    _before_errors: dict[int, tuple[torch.Tensor, torch.Tensor]]

    # ----------------------------------------------------------------- the schedule

    def _sync_start(self, t: int) -> int | None:
        """The outer step whose exchange is still in flight at step ``t``, or None."""
        for d in range(1, self.sync_delay + 1):
            if t - d >= 1 and self._fragment_at(t - d) is not None:
                return t - d
        return None

    # ----------------------------------------------------------------- starting

    def _keep_before(self, bucket: Bucket, delta: torch.Tensor) -> None:
        """At a delayed outer step, before the worker stage: keep ``delta_i`` (``sync_input``) and
        the errors as they are (a checkpoint taken in flight saves them)."""
        bucket.compression.allocate_errors_()
        self._before_errors[id(bucket)] = (bucket.compression.worker_error.clone(),
                                           bucket.compression.server_error.clone())
        if "sync_input" not in bucket.buffers:
            self._allocate(bucket, "sync_input")
        bucket.buffers["sync_input"].copy_(delta)

    def _finish_compressed(self, r: Round, compressed: list[Bucket], t: int) -> None:
        """With ``sync_delay > 0``: start the further passes' worker stages and leave the exchange
        in flight; else finish it now (:meth:`onebit.steps.Steps._finish_compressed`)."""
        if self.sync_delay == 0 or not compressed:
            super()._finish_compressed(r, compressed, t)
            return
        absent = {id(b): indices for b, indices in zip(self._buckets, r.absent) if indices}
        flight = Flight(t, list(compressed), {id(b): absent[id(b)] for b in compressed if id(b) in absent},
                        before={id(b): self._before_errors.pop(id(b)) for b in compressed})
        for bucket in compressed:
            self._start_passes(flight, bucket)
        self._flight = flight
        self._sync_pending = self._pending_entry(flight)

    def _start_passes(self, flight: Flight, bucket: Bucket) -> None:
        """The worker stages of passes 2..``outer_bits``, each sending what the one before left."""
        passes = flight.passes.setdefault(id(bucket), [])
        previous = bucket.compression
        for _ in range(self.outer_bits - 1 if self.compression == "onebit" else 0):
            state = new_state(bucket.padded, self._backend.world_size, bucket.device, bucket.layout.edges,
                              error_dtype=bucket.compression.error_dtype)
            residual = torch.zeros(bucket.padded, dtype=torch.float32, device=bucket.device)
            for view, error in zip(bucket.view(residual), bucket.view(previous.worker_error)):
                view.copy_(error)  # (its padding stays 0, as the first pass's input's)
            start_worker_(residual, state, self._backend, self._kernels_for(bucket))
            passes.append((state, residual))
            previous = state

    # ----------------------------------------------------------------- the steps in between

    def _run(self, plan: StepPlan, t: int, overlap: bool = True) -> bool:
        """:meth:`onebit.steps.Steps._run`; then, on a step after an outer step that counted, the exchange's
        server stages (at ``t0 + 1``) and its landing (at ``t0 + sync_delay``). After a load that
        brought an exchange in flight, its stages start again first."""
        if self._flight is None and self._sync_pending is not None:
            self._resume_flight(t)
        applied = super()._run(plan, t, overlap)
        flight = self._flight
        if flight is not None and self._step == t and t > flight.start:
            if not flight.served:
                self._serve(flight)
            if t >= flight.start + self.sync_delay:
                self._land(flight, self._absent_now(flight))
        return applied

    def _absent_now(self, flight: Flight) -> dict[int, list[int]]:
        """Per bucket of ``flight``, the parameters that have no gradient (or no longer train) on
        any rank now: the landing leaves them alone too (a step without gradients moves nothing).
        The ranks agree in one small all-reduce."""
        here = torch.tensor([float(p.requires_grad and p.grad is not None) for b in flight.buckets for p in b.owners],
                            device=self._device())
        if self._backend.world_size > 1:
            self._backend.all_reduce_mean_(here)
        flags, absent = (here > 0).tolist(), {}
        for bucket in flight.buckets:
            mine, flags = flags[:len(bucket.owners)], flags[len(bucket.owners):]
            if not all(mine):
                absent[id(bucket)] = [i for i, present in enumerate(mine) if not present]
        return absent

    def _held(self, flight: Flight) -> list[Any]:
        """Copies of what the exchange must leave as it is for the parameters it leaves alone."""
        return [b.hold(flight.absent[id(b)], self.STATE.shared_scalars) for b in flight.buckets if id(b) in flight.absent]

    def _serve(self, flight: Flight) -> None:
        held = self._held(flight)
        for bucket in flight.buckets:
            kernels = self._kernels_for(bucket)
            start_server_(bucket.compression, self._backend, kernels)
            previous = bucket.compression
            for state, _ in flight.passes.get(id(bucket), []):
                state.server_error.copy_(previous.server_error)
                start_server_(state, self._backend, kernels)
                previous = state
        for kept in held:
            kept.restore_()
        flight.served = True

    def _land(self, flight: Flight, absent_now: dict[int, list[int]]) -> None:
        """Decode every pass, keep the last pass's residuals as the errors, and apply the outer
        step with the local progress made since the exchange started. The parameters it leaves
        alone (without a gradient on every rank at its start, or now: ``absent_now``) keep their
        values, global parameters, outer momentum and the errors from before it started."""
        alone = {id(b): sorted(set(flight.absent.get(id(b), [])) | set(absent_now.get(id(b), [])))
                 for b in flight.buckets}
        held = [b.hold(alone[id(b)], self.STATE.shared_scalars) for b in flight.buckets if alone[id(b)]]
        # (the health check of every HEALTH_CHECK_INTERVAL-th compressed step, as at sync_delay 0: the
        # first pass's error against its decoded average, and the largest step of a coordinate)
        measure = self._compressed_steps % HEALTH_CHECK_INTERVAL == 0
        ratios, moves = [], []
        for bucket in flight.buckets:
            kernels = self._kernels_for(bucket)
            first = bucket.compression
            average = bucket.compressed
            finish_(average, first, kernels, bucket.derived.frozen_keep)
            if bucket.derived.frozen_keep is None and bucket.derived.frozen_zeros is not None:
                average.index_fill_(0, bucket.derived.frozen_zeros, 0.0)
            if measure:
                ratios.append(error_ratio(*first.health_input(average)))
                before = [p.detach().clone() for p in bucket.params]
            passes = flight.passes.get(id(bucket), [])
            for state, residual in passes:
                finish_(residual, state, kernels)
                if bucket.mask is not None:
                    residual.mul_(bucket.mask)
                average.add_(residual)
            if passes:
                first.worker_error.copy_(passes[-1][0].worker_error)
                first.server_error.copy_(passes[-1][0].server_error)
            progress = bucket.scratch("progress")
            theta = bucket.views["global_params"]
            for view, p, old, d in zip(bucket.view(progress), bucket.params, theta, bucket.views["sync_input"]):
                torch.sub(p, old.to(view.device), out=view).add_(d.to(view.device))
            with self._timed("update"):
                self._outer_update(bucket, average)
                if self.sync_mix != 0:
                    for p, view in zip(bucket.params, bucket.view(progress)):
                        p.add_(view.to(p.dtype) if self.sync_mix == 1 else view.mul(self.sync_mix).to(p.dtype))
            if measure:
                moves.extend(self._moves(bucket, before))
        if measure:
            self._health.error_ratio = max((x for x in ratios if x is not None), default=None)
            self._health.update_ratio = max(moves, default=None)
        for kept in held:
            kept.restore_()
        for bucket in flight.buckets:
            _put_back_errors(bucket, flight.before[id(bucket)], alone[id(bucket)])
            bucket.compressed = None
            bucket.release_scratch()
        self._flight = None
        self._sync_pending = None

    # ----------------------------------------------------------------- checkpoints

    def _places(self) -> dict[int, int]:
        """``id(parameter) -> its place in the param groups`` (in order, every group)."""
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _pending_entry(self, flight: Flight) -> dict[str, Any]:
        """What the schedule saves of the exchange in flight: its step and, by their place in the
        param groups, the parameters it sends and those it leaves alone."""
        place = self._places()
        sent = sorted(place[id(p)] for b in flight.buckets for p in b.owners)
        absent = sorted(place[id(b.owners[i])] for b in flight.buckets for i in flight.absent.get(id(b), []))
        return {"step": flight.start, "params": sent, "absent": absent}

    def _resume_flight(self, t: int) -> None:
        """The first step after a load that brought an exchange in flight: its stages again, from
        the saved ``sync_input`` and the errors loaded (those from before it started)."""
        pending, self._sync_pending = self._sync_pending, None
        start, sent = pending["step"], set(pending["params"])
        place = self._places()
        buckets = [b for b in self._buckets if b.compression is not None and "sync_input" in b.buffers
                   and any(place[id(p)] in sent for p in b.owners)]
        if (not buckets or not start < t <= start + self.sync_delay
                or {place[id(p)] for b in buckets for p in b.owners} != sent):
            if self._speaks:  # (an exchange this optimizer cannot continue: said, and dropped)
                logger.warning("onebit: the checkpoint held the exchange of the outer step %d in flight, which this "
                               "OnebitDiLoCo (sync_delay=%d, at step %d, its buckets laid out for fragments=%d) cannot "
                               "continue: it was dropped, and the next outer step of those parameters sends what it "
                               "carried", start, self.sync_delay, t - 1, self.fragments)
            return
        wanted = set(pending["absent"])
        absent = {id(b): [i for i, p in enumerate(b.owners) if place[id(p)] in wanted] for b in buckets}
        flight = Flight(start, buckets, {k: v for k, v in absent.items() if v})
        self._prepare_compression(buckets, start)
        held = self._held(flight)
        for bucket in buckets:
            bucket.compression.allocate_errors_()
            flight.before[id(bucket)] = (bucket.compression.worker_error.clone(),
                                         bucket.compression.server_error.clone())
            delta = bucket.scratch("delta")
            delta.copy_(bucket.buffers["sync_input"])
            bucket.compressed = delta
            start_worker_(delta, bucket.compression, self._backend, self._kernels_for(bucket))
            self._start_passes(flight, bucket)
        for kept in held:
            kept.restore_()
        self._flight = flight
        self._sync_pending = self._pending_entry(flight)
        if t - 1 > start and self.sync_delay > 1:  # (the server stages had started before the checkpoint)
            self._serve(flight)

    def _rebuild_buckets(self) -> None:
        """Parameters started or stopped training (every rank alike, at the same step): the exchange
        in flight lands first, with the progress made so far, then the buckets are laid out again."""
        if self._flight is None and self._sync_pending is not None:
            self._resume_flight(self._step + 1)
        if self._flight is not None:
            if not self._flight.served:
                self._serve(self._flight)
            self._land(self._flight, self._absent_now(self._flight))
        super()._rebuild_buckets()

    def _drop_flight(self) -> None:
        """A load or a copy replaces the state: the exchange in flight is waited for and dropped."""
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.wait()
            for bucket in flight.buckets:
                bucket.compressed = None
                bucket.release_scratch()
        self._before_errors = {}

    def compression_errors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`onebit.engine.OnebitOptimizer.compression_errors`; while an exchange is in flight,
        its buckets' errors from before it started (the first step after a load starts it again)."""
        errors = super().compression_errors()
        if self._flight is None:
            return errors
        compressed = [b for b in self._buckets if b.compression is not None]
        return [self._flight.before.get(id(b), e) for b, e in zip(compressed, errors)]


def _put_back_errors(bucket: Bucket, before: tuple[torch.Tensor, torch.Tensor], indices: list[int]) -> None:
    """The errors of the parameters ``indices`` of ``bucket`` as they were in ``before`` (copies
    of its state's worker and server errors): the slices :meth:`AllreduceState.error_slices` names,
    found in whichever of the two errors each views."""
    state = bucket.compression
    bases = (state.worker_error, state.server_error)
    for i in indices:
        start = bucket.layout.starts[i]
        end = bucket.layout.starts[i + 1] if i + 1 < len(bucket.params) else bucket.padded
        for view in state.error_slices(start, end):
            for base, saved in zip(bases, before):
                if base.numel() and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
                    offset = view.storage_offset() - base.storage_offset()
                    view.copy_(saved[offset:offset + view.numel()])
                    break
