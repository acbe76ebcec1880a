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

This module holds the hooks only: the fixed order, the readiness counts and ``no_sync``. It calls
one callable, ``start(position)``, when a bucket may start; the step decides what starting means
and keeps the work in a :class:`onebit.rounds.Round` (:mod:`onebit.steps`).

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

import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .buckets import Bucket

__all__ = ["Overlap"]


def _hook_of(overlap: weakref.ref[Overlap]) -> Callable[[torch.Tensor], None]:
    """A gradient hook that does not keep the optimizer alive (the parameters outlive it)."""
    def hook(param: torch.Tensor) -> None:
        owner = overlap()
        if owner is not None:
            owner._hook(param)
    return hook


class Overlap:
    """The gradient hooks of an optimizer with ``overlap_backward=True``.

    ``start(position)`` is called for each bucket of :attr:`order` (the buckets in reverse) once it
    and every bucket before it in the order has all its gradients; it returns False when nothing
    starts during this backward (the step's plan sends nothing early, or the layout is not checked
    yet), True when the bucket started. ``boundary``, when set, says whether this backward ends an
    accumulation (a framework's, e.g. the DeepSpeed engine's); ``no_sync()`` pauses the hooks.
    The readiness counts last until :meth:`reset`, which the step calls when it takes the round."""

    def __init__(self, start: Callable[[int], bool]) -> None:
        self._start = start
        self.order: list[Bucket] = []
        self.paused = 0
        self.boundary: Callable[[], bool] | None = None
        self._handles: list[Any] = []
        self._where: dict[int, int] = {}
        self._expected: list[int] = []
        self.reset()

    def attach(self, buckets: list[Bucket]) -> None:
        """(Re)register the hooks for ``buckets``, started in reverse order."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._where = [], {}
        self.order = list(reversed(buckets))
        self._expected = [len(b.owners) for b in self.order]
        for position, bucket in enumerate(self.order):
            for p in bucket.owners:
                self._where[id(p)] = position
                self._handles.append(p.register_post_accumulate_grad_hook(_hook_of(weakref.ref(self))))
        self.reset()

    def reset(self) -> None:
        """Forget the gradients counted so far (a new backward starts from nothing)."""
        self.ready: Counter[int] = Counter()
        self.seen: set[int] = set()
        self.started = 0  # buckets started, a prefix of the order
        self.repeated = False  # a gradient arrived twice: a second backward before step()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def _hook(self, param: torch.Tensor) -> None:
        if self.paused or self.repeated or (self.boundary is not None and not self.boundary()):
            return
        key = id(param)
        if key in self.seen:
            self.repeated = True
            return
        self.seen.add(key)
        position = self._where.get(key)
        if position is None:
            return
        self.ready[position] += 1
        while self.started < len(self.order) and self.ready[self.started] >= self._expected[self.started]:
            if not self._start(self.started):
                return
            self.started += 1
