"""A run going wrong, said out loud: non-finite gradients, skipped steps in a row, and compression
errors that outgrow what they compress (the ``nonfinite_grads`` and ``divergence`` options of every
onebit optimizer)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger("onebit.engine")

__all__ = ["Health", "SKIPS_TO_WARN", "ERROR_RATIO_TO_WARN", "UPDATE_RATIO_TO_WARN", "HEALTH_CHECK_INTERVAL",
           "error_ratio", "chunk_digests", "digests_match", "digest_of", "DIGEST_CHUNK"]

# This many skipped steps in a row, or a tensor whose worker compression error is above this many
# times the norm of what it compresses, checked every so many compression steps (two extra passes
# over the buffers then). A healthy run keeps the ratio near 1 (1-bit quantization of Gaussian-like
# values leaves an error of about 0.6 of the input's norm; a tensor whose gradient stops decays
# with a ratio near 1.3); a tensor that shares a scale with much larger ones, as in one scale per
# bucket, gets errors of the size of the others' momenta.
SKIPS_TO_WARN = 3
ERROR_RATIO_TO_WARN = 10.0
HEALTH_CHECK_INTERVAL = 16
# The largest step of a coordinate, in units of its group's learning rate, measured on the same
# schedule. Measured on the BERT example (600 steps, 2 ranks): compressing in the preconditioned
# space, at most 3 lr; in the momentum space (DeepSpeed's), 260-740 lr in runs that trained, and
# 3,144 lr at step 140 in the run that diverged (loss 31.5 at step 350; scale blocks of 1,024),
# 723,390 lr at step 540 in one that ended just in time. A step of lr * scale / (sqrt(v) + eps)
# on a coordinate with a tiny frozen variance is what these are.
UPDATE_RATIO_TO_WARN = 1000.0


class Health:
    """The bookkeeping of one optimizer. Every decision here is taken on values that are the same
    on every rank (agreed through the step's finiteness all-reduce), so that ranks raise together."""

    def __init__(self, nonfinite_grads: str, divergence: str) -> None:
        self.nonfinite_grads = nonfinite_grads
        self.divergence = divergence
        self.skipped_in_a_row = 0
        self.error_ratio: float | None = None  # worker error / compressed norm at the last check (local)
        self.error_ratio_agreed: float | None = None  # its mean over ranks, agreed at the next step
        # The largest |step| / lr of a coordinate at the last check, and its tensor (local; agreed
        # as a mean over ranks at the next step that exchanges the flag, as the error ratio is)
        self.update_ratio: tuple[float, str] | None = None
        self.update_ratio_agreed: float | None = None
        self._warned: set[str] = set()  # the kinds of divergence warned about in the current episode
        self._alone_at: int | None = None  # the last step this rank skipped alone

    def reset(self) -> None:
        """After a load: the measurements were of the state before it."""
        self.error_ratio = self.error_ratio_agreed = None
        self.update_ratio = self.update_ratio_agreed = None

    def nonfinite(self, t: int, where: str, rank: int) -> bool:
        """Non-finite gradients ``where`` at step ``t``: raise, or say the step is skipped (False)."""
        if self.nonfinite_grads == "raise":
            raise FloatingPointError(
                f"non-finite gradients {where} at step {t}; nothing was changed. Pass nonfinite_grads='skip' "
                "to skip such steps on every rank (as AMP's GradScaler expects)"
            )
        if rank == 0:
            logger.debug("onebit: step %d skipped on every rank: non-finite gradients %s", t, where)
        return False

    def skip_alone(self, t: int, plan: str, rank: int) -> None:
        """This rank's gradients are not finite on a step that communicates nothing: it skips its
        own update and the step counts (no other rank is asked). Warned once per episode, here."""
        self._alone_at = t
        if "alone" not in self._warned:
            self._warned.add("alone")
            logger.warning("onebit: rank %d: non-finite gradients at step %d (a %s step, which communicates "
                           "nothing): this rank leaves its parameters and state as they are; the step counts on "
                           "every rank so that their plans stay the same", rank, t, plan)

    def count_skips(self, applied: bool, t: int, plan: str, rank: int) -> None:
        """Count skipped steps in a row; warn (or raise) once when they reach SKIPS_TO_WARN."""
        if applied:
            if self._alone_at != t:
                self._warned.discard("alone")
            if self.skipped_in_a_row >= SKIPS_TO_WARN and rank == 0:
                logger.warning("onebit: step %d applied after %d skipped steps in a row", t, self.skipped_in_a_row)
            self.skipped_in_a_row = 0
            self.flag("skips", False, "", rank)
            return
        self.skipped_in_a_row += 1
        self.flag("skips", self.skipped_in_a_row >= SKIPS_TO_WARN,
                  f"{self.skipped_in_a_row} step() calls in a row were skipped for non-finite gradients (at step "
                  f"{t}, a {plan} step); the run may be diverging: lower the learning rate, or in compression "
                  "raise freeze_step", rank)

    def judge(self, agreed: float, t: int, rank: int) -> None:
        """The mean over ranks of the last measurement, agreed before step ``t``."""
        self.error_ratio, self.error_ratio_agreed = None, agreed
        self.flag("errors", agreed > ERROR_RATIO_TO_WARN,
                  f"before step {t} the worker compression error norm of a tensor is {agreed:.3g} times its "
                  f"momentum's norm (worst tensor, mean over ranks; above {ERROR_RATIO_TO_WARN:g}): 1-bit compression "
                  "is no longer tracking the momentum; the run may be diverging: lower the learning rate, raise "
                  "freeze_step, or try scale_block_size", rank)

    def judge_updates(self, agreed: float, t: int, rank: int) -> None:
        """The mean over ranks of the last largest |step| / lr, agreed before step ``t``."""
        _, name = self.update_ratio
        self.update_ratio, self.update_ratio_agreed = None, agreed
        self.flag("updates", agreed > UPDATE_RATIO_TO_WARN,
                  lambda: f"before step {t} a coordinate of {name} moved by {agreed:.4g} times its learning rate in one "
                  f"step (mean over ranks; above {UPDATE_RATIO_TO_WARN:g}; Adam's own steps stay within a few): 1-bit "
                  "noise divided by a tiny frozen variance; the run may be about to diverge: try "
                  "compression_space='preconditioned', raise freeze_step, or lower the learning rate", rank)

    def flag(self, kind: str, active: bool, message: str | Callable[[], str], rank: int) -> None:
        """A sign of a run going wrong (the engine's, or an algorithm's own): warn (or raise) once
        per episode of ``active`` (a condition that is the same on every rank). ``message`` may be
        a function that builds it, called only then (the hot path formats nothing)."""
        if not active:
            self._warned.discard(kind)
        elif kind not in self._warned:
            self._warned.add(kind)
            self._diverging(message if isinstance(message, str) else message(), rank)

    def _diverging(self, message: str, rank: int) -> None:
        """Warn on rank 0, or raise on every rank (the caller's condition is the same on all)."""
        if self.divergence == "raise":
            raise FloatingPointError(f"onebit: {message} (divergence='raise')")
        if rank == 0:
            logger.warning("onebit: %s", message)


def error_ratio(error: torch.Tensor, buffer: torch.Tensor, sizes: Sequence[int]) -> float | None:
    """The largest ratio, over a bucket's segments (tensors, or blocks of them), of the worker
    compression error's norm to the compressed buffer's; segments whose buffer is 0 (masked) are
    left out (None when all are)."""
    errors = torch.stack(torch._foreach_norm(list(error.split(sizes))))
    values = torch.stack(torch._foreach_norm(list(buffer.split(sizes))))
    live = values > 0
    return float((errors[live] / values[live]).max()) if bool(live.any()) else None


# ----------------------------------------------------------------------------- gradient digests
# What the first steps' look for a framework averaging the gradients (onebit.steps) keeps of them
# instead of a copy.

#: Elements per chunk of a digest
DIGEST_CHUNK = 1 << 18

_SIGNS: dict[torch.device, torch.Tensor] = {}


def _signs(device: torch.device) -> torch.Tensor:
    """A fixed pattern of ``DIGEST_CHUNK`` random signs (float32 +-1) on ``device``."""
    signs = _SIGNS.get(device)
    if signs is None:
        gen = torch.Generator().manual_seed(0)
        signs = _SIGNS[device] = (torch.randint(0, 2, (DIGEST_CHUNK,), generator=gen) * 2 - 1).float().to(device)
    return signs


def chunk_digests(x: torch.Tensor) -> torch.Tensor:
    """Per chunk of ``DIGEST_CHUNK`` elements of flat ``x``, in float64: its sum, its sum of squares and
    its sum with the fixed random signs of :func:`_signs` (``(k, 3)``, on the CPU; one transfer)."""
    signs = _signs(x.device)
    rows = [torch.stack([p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64) ** 2,
                         torch.mul(p, signs[:p.numel()]).sum(dtype=torch.float64)]) for p in x.split(DIGEST_CHUNK)]
    return torch.stack(rows).cpu() if rows else torch.zeros(0, 3, dtype=torch.float64)


def digests_match(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the tensors of :func:`chunk_digests` ``a`` and ``b`` are equal to about 1e-6 of
    their size, chunk by chunk: their signed sums differ by at most ``4e-6`` of the chunk's L2 norm
    (a difference ``d`` moves the signed sum by about ``|d|``, not cancelling as in plain sums; the
    average of equal gradients differs from them in the last bits), as do their norms."""
    norms = b[:, 1].sqrt()
    return bool(((a[:, 2] - b[:, 2]).abs() <= 4e-6 * norms).all() and ((a[:, 1].sqrt() - norms).abs() <= 4e-6 * norms).all())


def digest_of(tensors: list[torch.Tensor]) -> tuple[float, float]:
    """The float64 sum and sum of squares of ``tensors``, a chunk at a time (float64 copies of
    a chunk only)."""
    parts = [part for x in tensors for part in x.split(DIGEST_CHUNK)]
    return (sum(float(part.sum(dtype=torch.float64)) for part in parts),
            sum(float(torch.linalg.vector_norm(part, dtype=torch.float64)) ** 2 for part in parts))
