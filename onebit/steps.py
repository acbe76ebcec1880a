"""How a step runs: the part of :class:`onebit.engine.OnebitOptimizer` between ``step()`` and the
algorithm's update rules (a mixin, as :mod:`onebit.lifecycle` and :mod:`onebit.state` are).

One path for every step: which buckets a plan compresses, averages or updates locally
(``_classify``); the step's :class:`onebit.rounds.Round`, the work started for its buckets (by
backward's hooks with ``overlap_backward``, see :mod:`onebit.overlap`, else by the step itself, at
once) and what the step reads back from it; the agreement of every rank on non-finite gradients
and on parameters without a gradient (``_agree``, ``_exchange_flags``); the full-precision
average with its check for gradients a framework averaged already (``_average``); and the
pipelined compressed all-reduce and the updates (``_update``).
"""

from __future__ import annotations

import logging

import torch

from .buckets import Bucket, all_finite, build_keep_mask, grads_of
from .collectives import finish_, start_server_, start_worker_
from .health import HEALTH_CHECK_INTERVAL, chunk_digests, digest_of, digests_match, error_ratio
from .plan import StepPlan
from .rounds import Round, fingerprint

logger = logging.getLogger(__name__)

__all__ = ["Steps"]

# Elements a check over the gradients reads at a time: its temporaries stay a few MiB.
_CHUNK = 1 << 18


class Steps:
    """The step machinery of :class:`onebit.engine.OnebitOptimizer` (which provides the state it
    reads: buckets, backend, health, timers and the algorithm's hooks)."""

    def _classify(self, plan: StepPlan, t: int, buckets: list[Bucket] | None = None) -> tuple[list[Bucket], ...]:
        """``(compressed, averaged, reduced)``: the buckets (of ``buckets``, default all) whose
        buffer goes through the compressed all-reduce in step ``t`` of ``plan``, those updated from
        their averaged gradients, and of those the ones this optimizer all-reduces. The others
        take a local step (``_update_local``): every bucket on a step that communicates nothing,
        and the compressed buckets that the algorithm leaves out of step ``t`` (:meth:`_compresses`)."""
        buckets = self._buckets if buckets is None else buckets
        compressible = [b for b in buckets if plan.compress and b.compression is not None]
        compressed = [b for b in compressible if self._compresses(b, plan, t)]
        # Buckets that are not compressed all-reduce their gradients in full precision on every
        # step that communicates (a compress=False group; on every step at all with
        # _AVERAGE_UNCOMPRESSED_ALWAYS), unless the caller averaged them.
        communicates = plan.average_gradients or plan.compress
        averaged = [b for b in buckets if b not in compressible
                    and (communicates or (self._AVERAGE_UNCOMPRESSED_ALWAYS and b.compression is None))]
        reduced = [] if self._gradients_averaged and plan.average_gradients else averaged
        return compressed, averaged, reduced

    def _compresses(self, bucket: Bucket, plan: StepPlan, t: int) -> bool:
        """Whether step ``t`` of ``plan`` (a plan that compresses) puts ``bucket`` through the
        compressed all-reduce; False: the bucket takes a local step instead. Every compressed
        bucket, by default; an algorithm that syncs its buckets in turn (OnebitDiLoCo's
        ``fragments``) says which, from the step number alone (the same on every rank)."""
        return True

    def _wire_dtype(self) -> torch.dtype | None:
        """The type the full-precision all-reduce sends in: ``reduce_dtype``, on several ranks (one
        rank sends nothing, so nothing is rounded)."""
        return self.reduce_dtype if self._backend.world_size > 1 else None

    def _starts_early(self, plan: StepPlan, t: int) -> bool:
        """Whether ``overlap_backward`` starts work for step ``t`` of ``plan`` during backward."""
        if plan.compress and plan.name not in self._STAGED_PLANS:
            return False
        compressed, _, reduced = self._classify(plan, t)
        return bool(compressed or reduced)

    def _prepare_compression(self, compressed: list[Bucket], t: int) -> None:
        """The keep masks of the compressed buckets, at the first compressed step (or the first
        after a load): they read the state only."""
        if compressed and not all(b.derived.frozen_mask_ready for b in compressed):
            self._entering_compression(compressed)
            kept = [build_keep_mask(b, self._dead(b)) for b in compressed]
            self._on_compression(compressed, [keep for keep, _ in kept], t, sum(dead for _, dead in kept))

    # ----------------------------------------------------------------- the round

    def _new_round(self, plan: StepPlan, t: int, staged: bool, begin: bool = False) -> Round:
        """A round for step ``t`` with nothing started. ``staged``: its compressed buckets will
        start before the ranks agree on the step (their keep masks, which read the state only,
        are derived now); ``begin``: it begins during backward, and with it the step's statistics."""
        if begin:
            self._backend.begin_step(plan.name)
        compressed, _, reduced = self._classify(plan, t)
        check_double = bool(reduced) and self._backend.world_size > 1 and self._double_checks < self._DOUBLE_CHECKS
        if staged and compressed:
            self._prepare_compression(compressed, t)
        return Round(plan, t, check_double)

    def _began(self, t: int) -> bool:
        """Whether backward began the round of step ``t`` (and with it the step's statistics)."""
        return self._round is not None and self._round.t == t

    def _start_early(self, position: int) -> bool:
        """``overlap_backward``'s callback: start bucket ``position`` of the hooks' order for the
        coming step, staged; False when nothing starts during this backward."""
        if not self._layout_checked:  # the first step checks the layout first
            return False
        if self._round is None:
            t = self._step + 1
            plan = self.plan_for(t)
            if not self._starts_early(plan, t):
                return False
            self._round = self._new_round(plan, t, staged=True, begin=True)
        self._start(self._round, self._overlap.order[position], staged=True)
        return True

    def _start(self, r: Round, bucket: Bucket, grads: list[torch.Tensor | None] | None = None,
               staged: bool = False) -> None:
        """Start what the round's plan sends for ``bucket`` (its ``grads``, read now if None): a
        full-precision all-reduce, or the compressed input and the worker stage (``staged``:
        without writing the state, after the server stage of the bucket staged before it)."""
        compressed, _, reduced = self._classify(r.plan, r.t, [bucket])
        if reduced:
            if grads is None:
                with self._timed("gather_grads"):
                    grads = grads_of(bucket, True, None)
            if r.check_double:  # (digests of this rank's gradients: the all-reduce overwrites them)
                r.local[id(bucket)] = chunk_digests(bucket.wire()[:bucket.numel])
            r.pending[id(bucket)] = self._backend.start_all_reduce_mean_(bucket.wire_to_send(self._wire_dtype()))
        elif compressed:
            grads = grads_of(bucket, False, None) if grads is None else grads
            if staged and r.staged:  # the server stage of the bucket started before (its all-to-all is through)
                start_server_(r.staged[-1].compression, self._backend, self._kernels_for(r.staged[-1]), staged=True)
            with self._timed("compress_input"):
                bucket.compressed = self._compress_input(bucket, grads, self.param_groups[bucket.group_index], r.t,
                                                         staged=staged)
            start_worker_(bucket.compressed, bucket.compression, self._backend, self._kernels_for(bucket),
                          staged=staged, multiplier=_into(self._codec_multipliers(bucket)),
                          bound=self._codec_bound(bucket, r.t))
            if staged:  # (the average is decoded where the algorithm keeps it; the input was a copy)
                bucket.compressed = self._decode_target(bucket)
                r.staged.append(bucket)
        else:
            return  # nothing to send: the step reads this bucket's gradients itself
        r.grads[id(bucket)] = grads
        if staged:
            r.fingerprints[id(bucket)] = (bucket, fingerprint(bucket))

    def _start_rest(self, r: Round) -> None:
        """Start, staged and in the hooks' order, every bucket that backward did not."""
        for bucket in self._overlap.order:
            if not r.started(bucket):
                self._start(r, bucket, staged=True)

    def _drain(self) -> None:
        """Finish the round backward began without applying it (every rank starts what it had not,
        so that the collectives match): the state is as before the round."""
        r, self._round = self._round, None
        if self._overlap is None:
            return
        self._overlap.reset()
        if r is not None:
            self._start_rest(r)
            r.discard()

    def _round_of(self, plan: StepPlan, t: int, overlap: bool = True) -> Round:
        """The round of step ``t``: with ``overlap_backward`` and a plan that starts early, the one
        backward began with every bucket started, once all ranks agreed that no gradient changed
        since its bucket started (a compressed step agrees in its finiteness flag, see
        :meth:`_exchange_flags`); else a round with nothing started yet."""
        if self._overlap is None or not overlap:
            return self._new_round(plan, t, staged=False)
        if not self._starts_early(plan, t):
            self._drain()
            return self._new_round(plan, t, staged=False)
        # (GradScaler sets found_inf at every step, and grad_scale unless unscale_() ran first: the
        # same rule either way, rather than a redone communication every step after unscale_())
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            self._drain()
            raise ValueError(
                f"{type(self).__name__}(overlap_backward=True) cannot be used with torch.amp.GradScaler: the "
                "gradients are sent during backward, before the scaler's scale is known. Pass "
                "overlap_backward=False, or train in bfloat16 (autocast without a scaler)")
        r = self._round
        if r is None or r.t != t or r.plan != plan:
            self._drain()
            r = self._new_round(plan, t, staged=True)
        self._start_rest(r)
        self._round = None
        r.changed = r.gradients_changed(self._overlap.repeated)
        self._overlap.reset()
        if self._classify(plan, t)[0]:
            return r
        flag = torch.tensor([float(r.changed)], device=self._device())
        self._backend.all_reduce_mean_(flag)
        if flag.item() > 0:
            r.discard()
            self._tell_changed()
            return self._new_round(plan, t, staged=False)
        return r

    def _tell_changed(self) -> None:
        if not self._told_changed and self._speaks:
            logger.warning(
                "onebit: step %d: gradients changed between backward and step() on some rank (accumulation outside "
                "optimizer.no_sync(), gradient clipping, or zero_grad() and another backward): the communication "
                "started during backward was redone in step(). Run the micro-batches before the last under "
                "optimizer.no_sync() (the adapters do it for you), and use overlap_backward=False when you clip or "
                "change gradients after backward", self._step + 1)
        self._told_changed = True

    # ----------------------------------------------------------------- the step

    def _run(self, plan: StepPlan, t: int, overlap: bool = True) -> bool:
        """Run step ``t`` over all buckets; return False when it was skipped for non-finite grads."""
        compressed, averaged, reduced = self._classify(plan, t)
        r = self._round_of(plan, t, overlap)
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        with self._timed("gather_grads"):
            grads = [r.grads[id(b)] if r.started(b) else grads_of(b, b in averaged, inv_scale) for b in self._buckets]
        if (self._CHECK_UNAVERAGED and self._backend.world_size > 1 and not self._gradients_averaged
                and self._double_checks < self._DOUBLE_CHECKS):
            self._check_unaveraged(grads, t)
        try:
            verdict, absent = self._agree(plan, t, r, grads, compressed, averaged, reduced)
        except _Redo:  # some rank's gradients changed after backward started their buckets
            r.discard()
            self._tell_changed()
            return self._run(plan, t, overlap=False)
        if verdict is not None:
            return verdict
        r.commit()
        r.absent = absent
        self._prepare_compression(compressed, t)
        # Parameters without a gradient on any rank are left as they are, with their state (as in
        # torch.optim): their values are put back after the bucket's update (see _present).
        held = []
        for bucket, indices in zip(self._buckets, absent):
            if indices:
                if bucket in compressed:  # (the errors, zeros before the first compressed step, are held too)
                    bucket.compression.allocate_errors_()
                r.restore_errors(bucket, indices)
                self._before_update(bucket, t)
                held.append(bucket.hold(indices, self.STATE.shared_scalars))
        self._update(r, grads, compressed, averaged)
        for kept_still in held:
            kept_still.restore_()
        self._step = t
        return True

    def _agree(self, plan: StepPlan, t: int, r: Round, grads: list[list[torch.Tensor | None]], compressed: list[Bucket],
               averaged: list[Bucket], reduced: list[Bucket]) -> tuple[bool | None, list[list[int]]]:
        """Before anything changes, let the ranks agree whether every gradient is finite and which
        parameters have a gradient on no rank, and average the ``reduced`` buckets' gradients.

        Returns ``(verdict, absent)``: ``verdict`` None to go on, else what :meth:`_run` returns
        without updating; ``absent``, per bucket, the indices of its parameters to leave alone."""
        # Full-precision all-reduces carry a NaN or inf, and the presence flags, to every rank by
        # themselves. A compressed step needs one small all-reduce (_exchange_flags). A step that
        # communicates nothing needs none: a rank whose gradients are not finite leaves its own
        # parameters and state as they are and the step still counts, so that every rank keeps
        # the same plans (presence is then the rank's own); only nonfinite_grads='raise' (every
        # rank raises) or gradients averaged on a local step make the ranks agree with it.
        found_inf = getattr(self, "found_inf", None)
        local_bad = found_inf is not None and bool(found_inf.item() > 0)
        communicates = plan.average_gradients or plan.compress
        several = self._backend.world_size > 1
        alone = not communicates and not averaged and self._health.nonfinite_grads == "skip"
        counted = bool(compressed) or (not communicates and several and not alone)
        present = {id(b): self._present(b, plan) for b in self._buckets}
        if counted:
            bad_ranks = self._exchange_flags(plan, t, r, grads, [b for b in self._buckets if b not in reduced and (
                b in compressed or b in averaged)], present, local_bad)
        self._average(r, {id(b): g for b, g in zip(self._buckets, grads)}, reduced, present, t)
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
        if bad_ranks:
            r.discard()
            where = (f"on {bad_ranks} of {self._backend.world_size} ranks" if counted
                     else "in the averaged gradients" if communicates else "in the gradients")
            return self._health.nonfinite(t, where, self._backend.rank), absent
        return None, absent

    def _exchange_flags(self, plan: StepPlan, t: int, r: Round, grads: list[list[torch.Tensor | None]],
                        sent: list[Bucket], present: dict[int, list[bool]], local_bad: bool) -> int:
        """One small all-reduce: the finiteness flag, the last health check's error ratio (so that
        every rank agrees on it, and raises together), the count of gradients missing on each
        rank and, with ``overlap_backward``, whether this rank's gradients changed since backward
        read them (then :class:`_Redo`). Returns how many ranks have non-finite gradients;
        ``present`` becomes, per bucket of ``sent`` (those the step communicates for, but not
        through a full-precision all-reduce of this optimizer's), whether each parameter has a
        gradient on some rank."""
        with self._timed("finite_check"):
            local_bad = local_bad or not all_finite(grads)
        ratio = self._health.error_ratio
        moved = self._health.update_ratio  # pending on every rank alike (the same schedule)
        # The flag counts the parameters without a gradient on this rank (on a step that
        # communicates nothing for them, a rank leaves alone what it has no gradient for: no
        # count). Only when some rank lacks one do the ranks exchange which, in a second small
        # all-reduce: a step where every rank has every gradient sends 4 bytes more, no more.
        flagged = sent if plan.average_gradients or plan.compress else []
        here = [float(has) for b in flagged for has in present[id(b)]]
        changed = [] if r.changed is None else [float(r.changed)]
        flag = torch.tensor([float(local_bad), 0.0 if ratio is None else ratio,
                             *([] if moved is None else [moved[0]]),
                             *([float(len(here) - sum(here))] if flagged else []), *changed], device=self._device())
        self._backend.all_reduce_mean_(flag)
        if changed and flag[-1].item() > 0:
            raise _Redo
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
        return round(flag[0].item() * self._backend.world_size)

    def _average(self, r: Round, grads: dict[int, list[torch.Tensor | None]], reduced: list[Bucket],
                 present: dict[int, list[bool]], t: int) -> None:
        """The full-precision average of the ``reduced`` buckets: every one that backward did not
        start starts now, at once; then each is waited for, and ``present`` records which of its
        parameters have a gradient on some rank. On the round's first steps, the double-average
        check (:meth:`_double_check`)."""
        for bucket in reduced:
            if not r.started(bucket):
                self._start(r, bucket, grads[id(bucket)])
        for bucket in reduced:
            r.wait(bucket)
            bucket.wire_received(self._wire_dtype())
            present[id(bucket)] = (bucket.presence() > 0).tolist()
        if r.check_double:
            self._double_checks += 1
            self._double_check([r.local.pop(id(b)) for b in reduced], reduced, t)  # (the copies freed after it)

    def _double_check(self, local: list[torch.Tensor], reduced: list[Bucket], t: int) -> None:
        """A framework that averages gradients itself (DDP, Lightning, Accelerate, the DeepSpeed
        engine) hands every rank the same gradients: this optimizer's average of them is then what
        each rank had already. Said (or raised, with ``divergence='raise'``) once. ``local``: each
        bucket's :func:`onebit.health.chunk_digests` of this rank's gradients, taken before the
        average overwrote them (no copy of them is kept), compared with the average's to about 1e-6
        of their norm (:func:`onebit.health.digests_match`, as the elementwise comparison before
        it). Each rank decides alone, as before: the averages are the same on every rank, and a rank's own
        gradients equal them when every rank's do (or, by chance, when its own are the mean). With
        ``reduce_dtype`` the averages come back rounded: :meth:`_same_on_every_rank` decides."""
        averaged = [bucket.wire()[:bucket.numel] for bucket in reduced]
        if not any(bool(part.any()) for a in averaged for part in a.split(_CHUNK)):
            return  # no gradient at all: nothing to tell
        if self._wire_dtype() is None:
            same = all(digests_match(chunk_digests(a), x) for x, a in zip(local, averaged))
        else:
            both = torch.cat(local).sum(0).tolist()
            same = self._same_on_every_rank(digest=(both[0], both[1]))
        self._say_double(same, t, "so every warmup step averages them twice, and the compression steps still send "
                         "them in full precision")

    def _check_unaveraged(self, grads: list[list[torch.Tensor | None]], t: int) -> None:
        """For an algorithm whose plans never average gradients (``_CHECK_UNAVERAGED``, e.g. DiLoCo),
        on the first DOUBLE_AVERAGE_CHECKS steps of several ranks without an adapter: whether a
        framework averaged them anyway (equal gradients on every rank; one 32-byte all-reduce)."""
        local = [g.reshape(-1) for bucket_grads in grads for g in bucket_grads if g is not None]
        self._double_checks += 1
        same, anywhere = self._same_on_every_rank(local, anywhere=True)
        if anywhere:  # (no gradient on any rank: nothing to tell)
            self._say_double(same, t, "so every step sends the full gradient besides what the optimizer sends, and "
                                      "every rank trains on the same average")

    def _say_double(self, same: bool, t: int, consequence: str) -> None:
        """Said (or raised, with ``divergence='raise'``) once, when the gradients were ``same``."""
        self._health.flag(
            "double", same,
            lambda: f"step {t}: the gradients were the same on all {self._backend.world_size} ranks before "
            f"{type(self).__name__} used them: a framework averages them already (DDP, Lightning, Accelerate, "
            f"the DeepSpeed engine), {consequence}. Call its onebit adapter after building the optimizer: "
            "onebit.integrations.attach_ddp(ddp_model, optimizer), Trainer(callbacks=[OnebitCallback()]), "
            "attach_accelerate(model, optimizer), attach_deepspeed(engine) or attach_trainer(trainer). (If every "
            "rank really trains on the same data, ignore this: data parallelism then gains nothing.)",
            self._backend.rank)

    def _same_on_every_rank(self, local: list[torch.Tensor] | None = None, anywhere: bool = False,
                            digest: tuple[float, float] | None = None) -> bool | tuple[bool, bool]:
        """Whether every rank had the same gradients ``local`` (or their
        :func:`onebit.health.digest_of`), for :meth:`_double_check` and :meth:`_check_unaveraged`:
        each rank's sum and sum of squares, and their squares, are averaged in float64 (one 32-byte
        all-reduce, on these few steps only): zero variance across ranks, decided from the same
        numbers on every rank (an average that ``reduce_dtype`` rounded could not be compared with
        a rank's own, nor need a copy of them be kept). ``anywhere``: also whether some rank has a gradient that is not 0."""
        s1, s2 = digest_of(local) if digest is None else digest
        digest = torch.tensor([s1, s2, s1 * s1, s2 * s2], dtype=torch.float64, device=self._device())
        m1, m2, q1, q2 = self._backend.all_reduce_mean_(digest).tolist()
        same = all(q - m * m <= 1e-12 * q for m, q in ((m1, q1), (m2, q2)))
        return (same, m2 > 0) if anywhere else same

    def _update(self, r: Round, grads: list[list[torch.Tensor | None]], compressed: list[Bucket],
                averaged: list[Bucket]) -> None:
        """Update every bucket. Compressed buckets are pipelined: each bucket's all-to-all and
        all-gather are in flight while the other buckets are compressed, recompressed and updated
        (same results as one bucket after the other; every rank starts the collectives in the same
        order). Those the round did not start (during backward) start now, at once."""
        t = r.t
        for bucket, bucket_grads in zip(self._buckets, grads):
            if bucket in compressed and not r.started(bucket):
                self._start(r, bucket, bucket_grads)
        for bucket, bucket_grads in zip(self._buckets, grads):
            if bucket not in compressed:
                with self._timed("update"):
                    if bucket in averaged:
                        self._update_averaged(bucket, self.param_groups[bucket.group_index], t)
                    else:
                        self._update_local(bucket, bucket_grads, self.param_groups[bucket.group_index], t)
        self._finish_compressed(r, compressed, t)

    def _finish_compressed(self, r: Round, compressed: list[Bucket], t: int) -> None:
        """The rest of the compressed buckets' all-reduce once every worker stage started: the
        server stages, the decodes and the updates (an algorithm may finish them at a later step
        instead: OnebitDiLoCo's ``sync_delay``)."""
        # (in the order the worker stages started: overlap_backward started them in reverse, and
        # the server stages of all but the last with them)
        for bucket in [*r.staged, *(b for b in compressed if not r.is_staged(b))]:
            if bucket.compression.stage == 1:
                start_server_(bucket.compression, self._backend, self._kernels_for(bucket))
        # Every HEALTH_CHECK_INTERVAL-th compressed step measures the compression errors against
        # what was compressed, before the update may reuse the buffer.
        measure = bool(compressed) and (self._compressed_steps + 1) % HEALTH_CHECK_INTERVAL == 0
        ratios, moves = [], []
        for bucket in compressed:
            multipliers = self._codec_multipliers(bucket)
            finish_(bucket.compressed, bucket.compression, self._kernels_for(bucket), bucket.derived.frozen_keep,
                    None if multipliers is None else multipliers[1], self._codec_divisor(bucket))
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
            self._health.error_ratio = max((x for x in ratios if x is not None), default=None)
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
    return error_ratio(*bucket.compression.health_input(bucket.compressed, into, bound))


class _Redo(Exception):
    """Raised by ``_agree`` when the ranks agreed that the work ``overlap_backward`` started is
    stale: the step runs again without it."""
