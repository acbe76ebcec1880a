"""A round: the communication one step starts for its buckets, and what became of it.

Every ``step()`` reads its buckets through a :class:`Round`. A bucket is *started* when what the
step's plan sends for it is under way: its gradients copied into its wire buffer and an
asynchronous full-precision all-reduce begun, or its compressed input built and the worker stage
of the 1-bit all-reduce begun. Without ``overlap_backward`` the step starts every bucket itself,
at once (the full-precision ones after the ranks agreed on the gradients' finiteness, the
compressed ones once they agreed to apply the step, so that nothing irreversible comes first);
with it, gradient hooks started some or all of them during backward, *staged* (the new momentum
and errors in buffers of their own), and the round remembers which gradients each read, so that
the step can tell whether they changed since.

A round is a plain record of that work over the buckets; it holds no optimizer. Which buckets a
plan starts, and how, is the step's business (:mod:`onebit.steps`); when backward starts them is
:mod:`onebit.overlap`'s.
"""

from __future__ import annotations

import torch

from .backends.base import Pending
from .buckets import Bucket
from .plan import StepPlan
from .shards import local

__all__ = ["Round", "fingerprint"]


def fingerprint(bucket: Bucket) -> list[tuple[int, int]]:
    """Which gradient tensors a bucket's parameters hold and their in-place version counters: they
    change when a gradient is accumulated into, clipped, zeroed or replaced."""
    out = []
    for p in bucket.owners:
        g = p.grad
        out.append((0, 0) if g is None else (id(g), local(g)._version))
    return out


class Round:
    """The work started for step ``t`` of ``plan``, per bucket (keyed by ``id(bucket)``).

    ``grads``: the gradients a started bucket read; ``fingerprints``: theirs, when read during
    backward; ``pending``: full-precision all-reduces in flight; ``local``: a bucket's gradients
    before their average (the double-average check, when ``check_double``); ``staged``: the
    compressed buckets whose worker stage started staged, in the order they started;
    ``committed``: after :meth:`commit`, which staged errors each adopted; ``changed``: whether
    this rank's gradients changed since backward read them, and ``absent``: per bucket, the
    parameters without a gradient on every rank (both set by the step)."""

    def __init__(self, plan: StepPlan, t: int, check_double: bool) -> None:
        self.plan, self.t = plan, t
        self.check_double = check_double
        self.changed: bool | None = None
        self.grads: dict[int, list[torch.Tensor | None]] = {}
        self.fingerprints: dict[int, tuple[Bucket, list[tuple[int, int]]]] = {}
        self.pending: dict[int, Pending] = {}
        self.local: dict[int, torch.Tensor] = {}
        self.staged: list[Bucket] = []
        self.committed: dict[int, set[str]] = {}
        self.absent: list[list[int]] = []  # per bucket, the parameters the step leaves alone (set by the step)

    def started(self, bucket: Bucket) -> bool:
        return id(bucket) in self.grads

    def is_staged(self, bucket: Bucket) -> bool:
        return any(b is bucket for b in self.staged)

    def gradients_changed(self, repeated: bool) -> bool:
        """Whether this rank's gradients changed since backward read them (``repeated``: a gradient
        arrived twice, a second backward before ``step()``)."""
        return repeated or any(fingerprint(b) != f for b, f in self.fingerprints.values())

    def wait(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s full-precision all-reduce."""
        self.pending.pop(id(bucket)).wait()

    def discard(self) -> None:
        """Wait for the collectives in flight and drop what the staged stages computed: the
        optimizer's state is as before the round."""
        for handle in self.pending.values():
            handle.wait()
        self.pending.clear()
        for bucket in self.staged:
            bucket.compression.discard_()

    def commit(self) -> None:
        """The ranks agreed to apply the round: its staged buckets adopt their new errors."""
        for bucket in self.staged:
            state = bucket.compression
            self.committed[id(bucket)] = set(state.staged)
            state.commit_()

    def restore_errors(self, bucket: Bucket, indices: list[int]) -> None:
        """After :meth:`commit`: put back the errors of the parameters ``indices`` of a staged
        bucket (they are left alone this step; :meth:`Bucket.hold` then keeps these values)."""
        adopted = self.committed.get(id(bucket), set())
        state = bucket.compression
        n = state.world_size
        for i in indices:
            start = bucket.layout.starts[i]
            end = bucket.layout.starts[i + 1] if i + 1 < len(bucket.params) else bucket.padded
            if "worker" in adopted:
                state.worker_error[start:end].copy_(state.next_worker_error[start:end])
            if "server" in adopted:
                state.server_error[start // n:end // n].copy_(state.next_server_error[start // n:end // n])
