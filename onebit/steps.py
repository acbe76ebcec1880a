"""How a step runs: the part of :class:`onebit.engine.OnebitOptimizer` between ``step()`` and the
algorithm's update rules (a mixin, as :mod:`onebit.lifecycle` and :mod:`onebit.state` are).

Which buckets a plan compresses, averages or updates locally (``_classify``); the agreement of every
rank on non-finite gradients and on parameters without a gradient (``_agree``); the check for
gradients a framework averaged already; the pipelined compressed all-reduce and the updates
(``_update``); and, with ``overlap_backward``, the round of work backward started
(:mod:`onebit.overlap`): finished, or dropped and run again without it.
"""

from __future__ import annotations

import torch

from .buckets import Bucket, all_finite, build_keep_mask, grads_of
from .collectives import finish_, start_server_, start_worker_
from .health import HEALTH_CHECK_INTERVAL, error_ratio
from .overlap import Round
from .plan import StepPlan

__all__ = ["Steps"]


class Steps:
    """The step machinery of :class:`onebit.engine.OnebitOptimizer` (which provides the state it
    reads: buckets, backend, health, timers and the algorithm's hooks)."""

    def _classify(self, plan: StepPlan, buckets: list[Bucket] | None = None) -> tuple[list[Bucket], ...]:
        """``(compressed, averaged, reduced)``: the buckets (of ``buckets``, default all) whose
        buffer goes through the compressed all-reduce in step of ``plan``, those updated from
        their averaged gradients, and of those the ones this optimizer all-reduces."""
        buckets = self._buckets if buckets is None else buckets
        compressed = [b for b in buckets if plan.compress and b.compression is not None]
        # Buckets that are not compressed all-reduce their gradients in full precision on every
        # step that communicates (a compress=False group; on every step at all with
        # _AVERAGE_UNCOMPRESSED_ALWAYS), unless the caller averaged them.
        communicates = plan.average_gradients or plan.compress
        averaged = [b for b in buckets if b not in compressed
                    and (communicates or (self._AVERAGE_UNCOMPRESSED_ALWAYS and b.compression is None))]
        reduced = [] if self._gradients_averaged and plan.average_gradients else averaged
        return compressed, averaged, reduced

    def _wire_dtype(self) -> torch.dtype | None:
        """The type the full-precision all-reduce sends in: ``reduce_dtype``, on several ranks (one
        rank sends nothing, so nothing is rounded)."""
        return self.reduce_dtype if self._backend.world_size > 1 else None

    def _starts_early(self, plan: StepPlan) -> bool:
        """Whether ``overlap_backward`` starts work for step of ``plan`` during backward."""
        if plan.compress and plan.name not in self._STAGED_PLANS:
            return False
        compressed, _, reduced = self._classify(plan)
        return bool(compressed or reduced)

    def _prepare_compression(self, compressed: list[Bucket], t: int) -> None:
        """The keep masks of the compressed buckets, at the first compressed step (or the first
        after a load): they read the state only."""
        if compressed and not all(b.derived.frozen_mask_ready for b in compressed):
            kept = [build_keep_mask(b, self._dead(b)) for b in compressed]
            self._on_compression(compressed, [keep for keep, _ in kept], t, sum(dead for _, dead in kept))

    def _stage(self, bucket: Bucket, grads: list[torch.Tensor | None], t: int) -> None:
        """Compress ``bucket``'s input for step ``t`` without changing the state, and start its
        worker stage (``overlap_backward``; the caller kept the worker error)."""
        self._staging = True
        try:
            with self._timed("compress_input"):
                bucket.compressed = self._compress_input(bucket, grads, self.param_groups[bucket.group_index], t)
        finally:
            self._staging = False
        start_worker_(bucket.compressed, bucket.compression, self._backend, self._kernels_for(bucket), staged=True,
                      multiplier=_into(self._codec_multipliers(bucket)), bound=self._codec_bound(bucket, t))
        bucket.compressed = self._decode_target(bucket)

    def _overlapped(self, plan: StepPlan, t: int) -> Round | None:
        """With ``overlap_backward``: the round of step ``t`` with every bucket started, once all
        ranks agreed that no gradient changed since its bucket started; else None (the step then
        runs as without overlap, nothing in flight)."""
        overlap = self._overlap
        if overlap is None:
            return None
        if not self._starts_early(plan):
            overlap.drain()
            return None
        if getattr(self, "grad_scale", None) is not None:
            overlap.drain()
            raise ValueError(
                f"{type(self).__name__}(overlap_backward=True) cannot be used with torch.amp.GradScaler: the "
                "gradients are sent during backward, before the scaler's scale is known. Pass "
                "overlap_backward=False, or train in bfloat16 (autocast without a scaler)")
        r = overlap.start_rest(plan, t)
        overlap.round = None
        r.changed = overlap.changed(r)
        if self._classify(plan)[0]:
            return r  # the finiteness flag of the compressed step carries it (_agree)
        flag = torch.tensor([float(r.changed)], device=self._device())
        self._backend.all_reduce_mean_(flag)
        if flag.item() > 0:
            overlap.discard(r)
            overlap.tell_changed()
            return None
        return r

    def _run(self, plan: StepPlan, t: int, overlap: bool = True) -> bool:
        """Run step ``t`` over all buckets; return False when it was skipped for non-finite grads."""
        compressed, averaged, reduced = self._classify(plan)
        r = self._overlapped(plan, t) if overlap else None
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        at = self._overlap.position if r is not None else {}
        with self._timed("gather_grads"):
            grads = [r.grads[at[id(b)]] if r is not None and at[id(b)] in r.grads else grads_of(b, b in averaged, inv_scale)
                     for b in self._buckets]
        try:
            verdict, absent = self._agree(plan, t, grads, compressed, averaged, reduced, r)
        except _Redo:  # some rank's gradients changed after backward started their buckets
            self._overlap.discard(r)
            self._overlap.tell_changed()
            return self._run(plan, t, overlap=False)
        if verdict is not None:
            return verdict
        if r is not None:
            self._overlap.commit(r)
        self._prepare_compression(compressed, t)
        # Parameters without a gradient on any rank are left as they are, with their state (as in
        # torch.optim): their values are put back after the bucket's update (see _present).
        held = []
        for bucket, indices in zip(self._buckets, absent):
            if indices:
                if r is not None:
                    self._overlap.restore_errors(r, bucket, indices)
                self._before_update(bucket, t)
                held.append(bucket.hold(indices, self.STATE.shared_scalars))
        self._update(t, grads, compressed, averaged, set() if r is None else {id(self._overlap.order[i]) for i in r.staged})
        for kept_still in held:
            kept_still.restore_()
        self._step = t
        return True

    def _agree(self, plan: StepPlan, t: int, grads: list[list[torch.Tensor | None]], compressed: list[Bucket],
               averaged: list[Bucket], reduced: list[Bucket], r: Round | None = None) -> tuple[bool | None, list[list[int]]]:
        """Before anything changes, let the ranks agree whether every gradient is finite and which
        parameters have a gradient on no rank, and all-reduce the ``reduced`` buckets' gradients
        (with a round of ``overlap_backward``, ``r``: wait for the all-reduces it started; a skipped
        step puts back the worker errors of its staged buckets).

        Returns ``(verdict, absent)``: ``verdict`` None to go on, else what :meth:`_run` returns
        without updating; ``absent``, per bucket, the indices of its parameters to leave alone."""
        # Full-precision all-reduces carry a NaN or inf, and the presence flags, to every rank by
        # themselves. A compressed step needs one small all-reduce: the finiteness flag, the last
        # health check's error ratio, and the count of gradients missing on each rank. A
        # step that communicates nothing needs none: a rank whose gradients are not finite leaves
        # its own parameters and state as they are and the step still counts, so that every rank
        # keeps the same plans (presence is then the rank's own); only nonfinite_grads='raise'
        # (every rank raises) or gradients averaged on a local step make the ranks agree with it.
        found_inf = getattr(self, "found_inf", None)
        local_bad = found_inf is not None and bool(found_inf.item() > 0)
        communicates = plan.average_gradients or plan.compress
        several = self._backend.world_size > 1
        alone = not communicates and not averaged and self._health.nonfinite_grads == "skip"
        counted = bool(compressed) or (not communicates and several and not alone)
        present = {id(b): self._present(b, plan) for b in self._buckets}
        if counted:
            with self._timed("finite_check"):
                local_bad = local_bad or not all_finite(grads)
            # The error ratio travels too, so that every rank agrees on it (and raises together).
            ratio = self._health.error_ratio
            moved = self._health.update_ratio  # pending on every rank alike (the same schedule)
            # The flag counts the parameters without a gradient on this rank (on a step that
            # communicates nothing for them, a rank leaves alone what it has no gradient for: no
            # count). Only when some rank lacks one do the ranks exchange which, in a second small
            # all-reduce: a step where every rank has every gradient sends 4 bytes more, no more.
            flagged = [b for b in self._buckets if b not in reduced] if communicates else []
            here = [float(has) for b in flagged for has in present[id(b)]]
            # (with overlap_backward, last: whether this rank's gradients changed since backward used them)
            changed = [] if r is None or r.changed is None else [float(r.changed)]
            flag = torch.tensor([float(local_bad), 0.0 if ratio is None else ratio,
                                 *([] if moved is None else [moved[0]]),
                                 *([float(len(here) - sum(here))] if flagged else []), *changed], device=self._device())
            self._backend.all_reduce_mean_(flag)
            if changed and flag[-1].item() > 0:
                raise _Redo
            bad_ranks = round(flag[0].item() * self._backend.world_size)
            if ratio is not None:
                self._health.judge(float(flag[1].item()), t, self._backend.rank)
            if moved is not None:
                self._health.judge_updates(float(flag[2].item()), t, self._backend.rank)
            if flagged and flag[-1 - len(changed)].item() > 0:
                anywhere = torch.tensor(here, device=self._device())
                self._backend.all_reduce_mean_(anywhere)
                agreed = (anywhere > 0).tolist()
                for b in flagged:
                    present[id(b)], agreed = agreed[:len(b.params)], agreed[len(b.params):]
        at = self._overlap.position if r is not None else {}
        if r is None:
            local = self._before_double_check(reduced)
        else:
            local = [r.local[at[id(b)]] for b in reduced] if r.check_double else None
            self._double_checks += int(r.check_double)
        for bucket in reduced:
            if r is None:
                self._backend.all_reduce_mean_(bucket.wire_to_send(self._wire_dtype()))
            else:
                r.pending[at[id(bucket)]].wait()
            bucket.wire_received(self._wire_dtype())
            present[id(bucket)] = (bucket.presence() > 0).tolist()
        if local is not None:
            self._double_check(local, reduced, t)
        if not counted:
            with self._timed("finite_check"):
                bad_ranks = int(local_bad or not all_finite(grads))
        absent = [[i for i, here in enumerate(present[id(b)]) if not here] for b in self._buckets]
        if bad_ranks and alone and several:
            self._health.skip_alone(t, plan.name, self._backend.rank)
            for bucket in self._buckets:
                self._skipped_alone(bucket, self.param_groups[bucket.group_index], t)
            self._step = t
            return True, absent
        if bad_ranks and r is not None:
            self._overlap.discard(r)
        if bad_ranks:
            where = (f"on {bad_ranks} of {self._backend.world_size} ranks" if counted
                     else "in the averaged gradients" if communicates else "in the gradients")
            return self._health.nonfinite(t, where, self._backend.rank), absent
        return None, absent

    def _before_double_check(self, reduced: list[Bucket]) -> list[torch.Tensor] | None:
        """On the first DOUBLE_AVERAGE_CHECKS steps whose gradients this optimizer all-reduces on
        several ranks: a copy of this rank's gradients before the all-reduce."""
        if not reduced or self._backend.world_size == 1 or self._double_checks >= self._DOUBLE_CHECKS:
            return None
        self._double_checks += 1
        return [bucket.wire()[:bucket.numel].clone() for bucket in reduced]

    def _double_check(self, local: list[torch.Tensor], reduced: list[Bucket], t: int) -> None:
        """A framework that averages gradients itself (DDP, Lightning, Accelerate, the DeepSpeed
        engine) hands every rank the same gradients: this optimizer's average of them is then what
        each rank had already. Said (or raised, with ``divergence='raise'``) once. The condition is
        the same on every rank: the averages are, and each rank's own gradients equal them only
        when every rank's do."""
        averaged = [bucket.wire()[:bucket.numel] for bucket in reduced]
        if not any(bool(a.any()) for a in averaged):
            return  # no gradient at all: nothing to tell
        if self._wire_dtype() is None:
            same = all(torch.allclose(x, a, rtol=1e-6, atol=0.0) for x, a in zip(local, averaged))
        else:
            same = self._same_on_every_rank(local)
        self._health.flag(
            "double", same,
            lambda: f"step {t}: the gradients were the same on all {self._backend.world_size} ranks before "
            f"{type(self).__name__} averaged them: a framework averages them already (DDP, Lightning, Accelerate, "
            "the DeepSpeed engine), so every warmup step averages them twice, and the compression steps still send "
            "them in full precision. Call its onebit adapter after building the optimizer: "
            "onebit.integrations.attach_ddp(ddp_model, optimizer), Trainer(callbacks=[OnebitCallback()]), "
            "attach_accelerate(model, optimizer), attach_deepspeed(engine) or attach_trainer(trainer). (If every "
            "rank really trains on the same data, ignore this: data parallelism then gains nothing.)",
            self._backend.rank)

    def _same_on_every_rank(self, local: list[torch.Tensor]) -> bool:
        """Whether every rank had the same gradients, for :meth:`_double_check` with
        ``reduce_dtype``: its averages come back rounded (by more as ranks are added), so they
        cannot be compared with a rank's own. Instead each rank's sum and sum of squares, and their
        squares, are averaged in float64 (one 32-byte all-reduce, on these few steps only): zero
        variance across ranks, decided from the same numbers on every rank."""
        s1 = sum(float(x.sum(dtype=torch.float64)) for x in local)
        s2 = sum(float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2 for x in local)
        digest = torch.tensor([s1, s2, s1 * s1, s2 * s2], dtype=torch.float64, device=self._device())
        m1, m2, q1, q2 = self._backend.all_reduce_mean_(digest).tolist()
        return all(q - m * m <= 1e-12 * q for m, q in ((m1, q1), (m2, q2)))

    def _update(self, t: int, grads: list[list[torch.Tensor | None]], compressed: list[Bucket],
                averaged: list[Bucket], staged: set[int] = frozenset()) -> None:
        """Update every bucket. Compressed buckets are pipelined: each bucket's all-to-all and
        all-gather are in flight while the other buckets are compressed, recompressed and updated
        (same results as one bucket after the other; every rank starts the collectives in the same
        order). The buckets in ``staged`` (ids) started their worker stage during backward."""
        for bucket, bucket_grads in zip(self._buckets, grads):
            if bucket in compressed and id(bucket) not in staged:
                group = self.param_groups[bucket.group_index]
                with self._timed("compress_input"):
                    bucket.compressed = self._compress_input(bucket, bucket_grads, group, t)
                start_worker_(bucket.compressed, bucket.compression, self._backend, self._kernels_for(bucket),
                              multiplier=_into(self._codec_multipliers(bucket)), bound=self._codec_bound(bucket, t))
        for bucket, bucket_grads in zip(self._buckets, grads):
            if bucket not in compressed:
                with self._timed("update"):
                    if bucket in averaged:
                        self._update_averaged(bucket, self.param_groups[bucket.group_index], t)
                    else:
                        self._update_local(bucket, bucket_grads, self.param_groups[bucket.group_index], t)
        # (in the order the worker stages started: overlap_backward started them in reverse, and
        # the server stages of all but the last with them)
        for bucket in [b for b in self._overlap.order if b in compressed] if staged else compressed:
            if bucket.compression.stage == 1:
                start_server_(bucket.compression, self._backend, self._kernels_for(bucket))
        # Every HEALTH_CHECK_INTERVAL-th compressed step measures the compression errors against
        # what was compressed, before the update may reuse the buffer.
        measure = bool(compressed) and (self._compressed_steps + 1) % HEALTH_CHECK_INTERVAL == 0
        ratios, moves = [], []
        for bucket in compressed:
            multipliers = self._codec_multipliers(bucket)
            finish_(bucket.compressed, bucket.compression, self._kernels_for(bucket), bucket.derived.frozen_keep,
                    None if multipliers is None else multipliers[1])
            if bucket.derived.frozen_keep is None and bucket.derived.frozen_zeros is not None:
                bucket.compressed.index_fill_(0, bucket.derived.frozen_zeros, 0.0)
            if measure:
                ratios.append(_error_ratio(bucket, _into(multipliers), self._codec_bound(bucket, t)))
                before = [p.detach().clone() for p in bucket.params]
            with self._timed("update"):
                self._update_compressed(bucket, self.param_groups[bucket.group_index], t)
            if measure:
                moves.extend(self._moves(bucket, before))
        if measure:
            self._health.error_ratio = max((r for r in ratios if r is not None), default=None)
            self._health.update_ratio = max(moves, default=None)

    def _moves(self, bucket: Bucket, before: list[torch.Tensor]) -> list[tuple[float, str]]:
        """Per parameter of ``bucket``: its largest |step| in units of its group's learning rate,
        and its name (from ``named_parameters()``, else its place and shape)."""
        group = self.param_groups[bucket.group_index]
        if group["lr"] == 0 or not bucket.params:
            return []
        steps = torch.stack([torch.sub(p.detach(), b).abs().max() if p.numel() else p.new_zeros(())
                             for p, b in zip(bucket.params, before)]).float() / group["lr"]
        names = group.get("param_names")
        index = {id(p): i for i, p in enumerate(group["params"])}
        return [(value, names[index[id(p)]] if names else f"parameter {index[id(p)]} of group {bucket.group_index} "
                 f"(shape {tuple(p.shape)})") for value, p in zip(steps.tolist(), bucket.owners)]


def _into(multipliers: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    return None if multipliers is None else multipliers[0]


def _error_ratio(bucket: Bucket, into: torch.Tensor | None = None, bound: float | None = None) -> float | None:
    """The health check's ratio for the buffer this rank's worker stage compressed: the bucket's
    (times ``into``, clamped to ``bound``: the errors are of that), or with a two-level
    ``"node_mean"`` all-reduce the node mean of its shard (segments ``1/L``)."""
    edges = bucket.layout.edges
    sizes = [b - a for a, b in zip(edges[:-1], edges[1:])]
    state = bucket.compression
    node_mean = getattr(state, "compressed_input", None)
    if node_mean is None:
        compressed = bucket.compressed if into is None else bucket.compressed * into
        return error_ratio(state.worker_error, compressed if bound is None else compressed.clamp(-bound, bound), sizes)
    return error_ratio(state.worker_error, node_mean, [size // state.topology.local for size in sizes])


class _Redo(Exception):
    """Raised by ``_agree`` when the ranks agreed that the work ``overlap_backward`` started is
    stale: the step runs again without it."""
