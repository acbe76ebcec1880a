"""Overlap with backward (``overlap_backward=True``): each bucket's communication starts as soon as
backward has produced its gradients, as DDP's does, and ``step()`` finishes it.

Gradient hooks (``register_post_accumulate_grad_hook``) count the gradients of each bucket. Buckets
start in one fixed order, the reverse of their construction (backward produces the last layers'
gradients first): a bucket starts once it and every bucket before it in that order is complete,
so that every rank starts the same collectives in the same order whatever order its gradients
arrive in. What a bucket starts is what the coming step's plan communicates for it:

- a full-precision average (warmup, 0/1 Adam's variance steps, ``compress=False`` groups): its
  gradients are copied into its wire buffer and an asynchronous all-reduce starts;
- a compressed plan the algorithm can stage (``_STAGED_PLANS``: 1-bit Adam's and 1-bit LAMB's
  compression steps, 0/1 Adam's compressed-gradient steps): the compressed input is built
  **without writing the optimizer's state** (the new momentum goes to a buffer of its own) and
  the worker stage (compression, all-to-all) starts, its new error written to a buffer of its
  own (:meth:`CompressionState.commit_` adopts it). Starting a compressed bucket first runs the
  server stage (average, recompression, all-gather) of the compressed bucket started before it,
  staged the same way: every rank then starts the same collectives in the same order, and only
  the last bucket's server stage is left to ``step()``.

``step()`` starts whatever backward did not (a parameter without a gradient, the first step,
which checks the layout first), then all ranks agree whether any rank's gradients changed since
their bucket started (gradient clipping, accumulation outside :meth:`OnebitOptimizer.no_sync`,
``zero_grad()`` and another backward): one more number in the finiteness flag of a compressed
step, a 4-byte all-reduce on a full-precision one. If so, every rank waits for the work in flight,
drops it and runs the step as without overlap. Non-finite gradients skip the step as without
overlap: the staged errors are dropped, nothing else was written. So the parameters are
bit-identical with and without overlap, step for step.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from .backends.base import Pending
from .buckets import Bucket, grads_of
from .collectives import start_server_
from .plan import StepPlan
from .shards import local

if TYPE_CHECKING:
    from .engine import OnebitOptimizer

logger = logging.getLogger(__name__)

__all__ = ["Overlap", "Round"]


def _hook_of(overlap: weakref.ref[Overlap]) -> Callable[[torch.Tensor], None]:
    """A gradient hook that does not keep the optimizer alive (the parameters outlive it)."""
    def hook(param: torch.Tensor) -> None:
        owner = overlap()
        if owner is not None:
            owner._hook(param)
    return hook


def _fingerprint(bucket: Bucket) -> list[tuple[int, int]]:
    """Which gradient tensors a bucket's parameters hold and their in-place version counters: they
    change when a gradient is accumulated into, clipped, zeroed or replaced."""
    out = []
    for p in bucket.owners:
        g = p.grad
        out.append((0, 0) if g is None else (id(g), local(g)._version))
    return out


class Round:
    """The work started for one step: per bucket (by position in the start order), the gradients
    it read, their fingerprint, and what is in flight."""

    def __init__(self, plan: StepPlan, t: int, check_double: bool) -> None:
        self.plan, self.t = plan, t
        self.check_double = check_double  # copy the gradients before the average (double-average check)
        self.ready: Counter[int] = Counter()
        self.seen: set[int] = set()
        self.started = 0  # buckets started, a prefix of the start order
        self.repeated = False  # a gradient arrived twice: a second backward before step()
        self.changed: bool | None = None  # step(): whether this rank's gradients changed since they were read
        self.grads: dict[int, list[torch.Tensor | None]] = {}
        self.fingerprints: dict[int, list[tuple[int, int]]] = {}
        self.pending: dict[int, Pending] = {}  # full-precision all-reduces
        self.local: dict[int, torch.Tensor] = {}  # the gradients before their average
        self.staged: list[int] = []  # compressed buckets whose worker stage started, in order
        self.committed: dict[int, set[str]] = {}  # after commit(): which staged errors each adopted


class Overlap:
    """The gradient hooks and the rounds of an optimizer with ``overlap_backward=True``."""

    def __init__(self, optimizer: OnebitOptimizer) -> None:
        self.optimizer = optimizer
        self.order: list[Bucket] = []
        self.round: Round | None = None
        self.paused = 0
        # A framework's accumulation boundary (the DeepSpeed engine's): backward starts work only when it says so.
        self.boundary: Callable[[], bool] | None = None
        self._handles: list[Any] = []
        self._where: dict[int, int] = {}
        self.position: dict[int, int] = {}
        self._expected: list[int] = []
        self._told = False

    def attach(self, buckets: list[Bucket]) -> None:
        """(Re)register the hooks for ``buckets``, started in reverse order."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._where = [], {}
        self.order = list(reversed(buckets))
        self.position = {id(b): i for i, b in enumerate(self.order)}
        self._expected = [len(b.owners) for b in self.order]
        for position, bucket in enumerate(self.order):
            for p in bucket.owners:
                self._where[id(p)] = position
                self._handles.append(p.register_post_accumulate_grad_hook(_hook_of(weakref.ref(self))))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # ------------------------------------------------------------------ during backward

    def _hook(self, param: torch.Tensor) -> None:
        opt = self.optimizer
        if self.paused or not opt._layout_checked or (self.boundary is not None and not self.boundary()):
            return
        r = self.round
        if r is None:
            plan = opt.plan_for(opt._step + 1)
            if not opt._starts_early(plan):
                return
            r = self.round = self._new_round(plan, opt._step + 1, begin=True)
        if r.repeated:
            return
        key = id(param)
        if key in r.seen:
            r.repeated = True
            return
        r.seen.add(key)
        position = self._where.get(key)
        if position is None:
            return
        r.ready[position] += 1
        while r.started < len(self.order) and r.ready[r.started] >= self._expected[r.started]:
            self._start(r, r.started)

    def began(self, t: int) -> bool:
        """Whether a round of step ``t`` is under way (it began the step's statistics)."""
        return self.round is not None and self.round.t == t

    def _new_round(self, plan: StepPlan, t: int, begin: bool = False) -> Round:
        opt = self.optimizer
        if begin:  # during backward: what it sends counts for step t (step() begins it otherwise)
            opt._backend.begin_step(plan.name)
        compressed, _, reduced = opt._classify(plan)
        check_double = bool(reduced) and opt._backend.world_size > 1 and opt._double_checks < opt._DOUBLE_CHECKS
        if compressed:  # the keep masks (first compression step) read the state only; the staging needs them
            opt._prepare_compression(compressed, t)
        return Round(plan, t, check_double)

    def _start(self, r: Round, position: int) -> None:
        """Start bucket ``position`` of the order for the round's plan (every rank, in order)."""
        opt = self.optimizer
        bucket = self.order[position]
        r.started = position + 1
        compressed, averaged, reduced = opt._classify(r.plan, [bucket])
        if reduced:
            with opt._timed("gather_grads"):
                grads = grads_of(bucket, True, None)
            if r.check_double:
                r.local[position] = bucket.wire()[:bucket.numel].clone()
            r.pending[position] = opt._backend.start_all_reduce_mean_(bucket.wire_to_send(opt._wire_dtype()))
        elif compressed:
            grads = grads_of(bucket, False, None)
            if r.staged:  # the server stage of the bucket started before (its all-to-all is through by now)
                start_server_(self.order[r.staged[-1]].compression, opt._backend,
                              opt._kernels_for(self.order[r.staged[-1]]), staged=True)
            opt._stage(bucket, grads, r.t)
            r.staged.append(position)
        else:
            return  # nothing to send early: step() reads this bucket's gradients itself
        r.grads[position] = grads
        r.fingerprints[position] = _fingerprint(bucket)

    # ------------------------------------------------------------------ in step()

    def start_rest(self, plan: StepPlan, t: int) -> Round:
        """Start every bucket backward did not (in order), so that all ranks have started all."""
        r = self.round
        if r is None or r.t != t or r.plan != plan:
            if r is not None:
                self.drain()
            r = self.round = self._new_round(plan, t)
        while r.started < len(self.order):
            self._start(r, r.started)
        return r

    def changed(self, r: Round) -> bool:
        """Whether this rank's gradients changed since their buckets started."""
        return r.repeated or any(_fingerprint(self.order[i]) != f for i, f in r.fingerprints.items())

    def tell_changed(self) -> None:
        opt = self.optimizer
        if not self._told and opt._speaks:
            logger.warning(
                "onebit: step %d: gradients changed between backward and step() on some rank (accumulation outside "
                "optimizer.no_sync(), gradient clipping, or zero_grad() and another backward): the communication "
                "started during backward was redone in step(). Run the micro-batches before the last under "
                "optimizer.no_sync() (the adapters do it for you), and use overlap_backward=False when you clip or "
                "change gradients after backward", opt._step + 1)
        self._told = True

    def discard(self, r: Round) -> None:
        """Wait for the round's collectives and drop what its staged stages computed."""
        for handle in r.pending.values():
            handle.wait()
        for position in r.staged:
            self.order[position].compression.discard_()

    def commit(self, r: Round) -> None:
        """The ranks agreed to apply the round: its staged buckets adopt their new errors."""
        for position in r.staged:
            state = self.order[position].compression
            r.committed[position] = set(state.staged)
            state.commit_()

    def drain(self) -> None:
        """Finish the round in flight without applying it (every rank: it starts what it had not,
        so that the collectives match): the optimizer's state is as before the round."""
        r, self.round = self.round, None
        if r is None:
            return
        while r.started < len(self.order):
            self._start(r, r.started)
        self.discard(r)

    def restore_errors(self, r: Round, bucket: Bucket, indices: list[int]) -> None:
        """After :meth:`commit`: put back the errors of the parameters ``indices`` of a staged
        bucket (they are left alone this step; :meth:`Bucket.hold` then keeps these values)."""
        adopted = r.committed.get(self.position[id(bucket)], set())
        state = bucket.compression
        n = state.world_size
        for i in indices:
            start = bucket.layout.starts[i]
            end = bucket.layout.starts[i + 1] if i + 1 < len(bucket.params) else bucket.padded
            if "worker" in adopted:
                state.worker_error[start:end].copy_(state.next_worker_error[start:end])
            if "server" in adopted:
                state.server_error[start // n:end // n].copy_(state.next_server_error[start // n:end // n])
