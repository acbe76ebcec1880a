"""``freeze_step="auto"``: freeze the variance once the denominator it gives has settled.

The compressed phase divides every momentum by the denominator frozen at ``freeze_step``
(``sqrt(v / bc2) + eps``; ``bc2 = 1 - beta2**t`` with ``bias_correction``, else 1). Freezing is
safe when that denominator no longer moves:

* **the gradients not growing**: gradients still growing would leave a frozen denominator smaller
  than it is about to be, so every later step would be larger than Adam's; shrinking ones
  (getting smaller as the loss falls) err on the safe side. This is judged on the bias-corrected
  denominator ``sqrt(v / (1 - beta2**t))`` whatever ``bias_correction`` says: without bias
  correction ``sqrt(v)`` also grows by ``sqrt(bc2(t) / bc2(t - WINDOW))`` per window only because
  its average is still filling up from 0 (``+5%`` per 10 steps at step 100 with ``beta2`` 0.999),
  for about ``1 / (1 - beta2)`` steps, and it keeps growing like that after a freeze at any of
  these steps: waiting for that growth to stop would take most of those steps (measured on BERT
  with DeepSpeed's defaults: 141 warmup steps instead of 91, and 1.0019x Adam's loss against
  1.0009x; ``examples/bert/README.md``);
* **settled**: the total of the denominator actually frozen (that growth included) changes by
  little over a window either way;
* **no coordinate still waking up**: coordinates whose variance is still exactly 0 keep a zero
  momentum once frozen (1 bit cannot send a 0), so a rare token row that has not had a gradient
  yet would never train; the count of zero-variance coordinates must have stopped falling.

Every ``WINDOW`` steps (at the start of steps 11, 21, ...), the optimizer sums the denominator (and
its bias-corrected value) and counts the zero-variance coordinates over its compressed buckets (one
pass over the variance, no communication: during warmup the variance is the same on every rank of
the group, because the gradients are averaged, so every rank takes the same decision at the same
step) and compares with the previous check. The first check at or after ``min_steps`` that meets the
three conditions makes the step it runs in the last warmup step (so the run is exactly the run with
that fixed ``freeze_step``); ``max_steps``, if given, is the last warmup step at the latest. What it
compared with is saved in the state dict, so that a resume (on any world size) takes the same
decision. With DTensor parameters each onebit group decides from its own shards.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .validation import is_int

logger = logging.getLogger(__name__)

__all__ = ["AutoFreeze", "WINDOW", "MIN_STEPS", "GROWTH_TO_FREEZE", "CHANGE_TO_FREEZE", "WOKEN_TO_FREEZE"]

WINDOW = 10  # steps between checks
MIN_STEPS = 20  # default earliest freeze
GROWTH_TO_FREEZE = 0.01  # the bias-corrected denominator's total may have grown by at most 1 % over the last window
CHANGE_TO_FREEZE = 0.02  # ... and the frozen denominator's total changed by at most 2 % either way
WOKEN_TO_FREEZE = 1e-5  # at most this share of the coordinates left a zero variance over the window


@dataclass
class AutoFreeze:
    """The decision's settings and what it compares with (``previous``: the denominator's total,
    the zero-variance count and the bias-corrected denominator's total at the last check; the
    last is None for a state saved before it was kept)."""

    min_steps: int = MIN_STEPS
    max_steps: int | None = None
    previous: tuple[float, float, float | None] | None = None
    # the steps done at the last check (a step skipped for non-finite gradients is not checked twice)
    checked: int = 0
    # what the last check measured and why it waited (for the logs; not saved)
    last_wait: str | None = field(default=None, compare=False)

    def check(self, t: int, done: int, measure, speaks: Callable[[], bool] = lambda: False) -> str | None:
        """At the start of step ``t``, ``done`` steps applied: why ``t`` is to be the last warmup
        step, or None. ``measure()`` gives ``(denominator total, zero-variance count,
        coordinates, bias-corrected denominator total)`` after the ``done`` steps; it is called
        every ``WINDOW`` steps only. Where ``speaks()`` (rank 0), each check that waits says in an
        INFO line what it measured and why it waits, and reaching the latest bound is a WARNING."""
        if self.max_steps is not None and t >= self.max_steps:
            if speaks():
                logger.warning("onebit: step %d: the automatic freeze reached its latest bound (%d) before the variance "
                               "settled (%s): compression starts after this step. If the loss jumps after the switch, "
                               "raise the bound (freeze_bounds) or give freeze_step as a number of steps",
                               t, self.max_steps, self.last_wait or "no check had run yet")
            return f"the latest bound, {self.max_steps}"
        if done == 0 or done % WINDOW or done == self.checked:
            return None
        total, zeros, count, corrected = measure()
        previous, self.previous, self.checked = self.previous, (total, zeros, corrected), done
        measured, reasons = self._compare(t, done, previous, (total, zeros, count, corrected))
        if not reasons:
            return measured
        self.last_wait = f"{measured}; waiting because {' and '.join(reasons)}" if measured else reasons[0]
        if speaks():
            latest = "none" if self.max_steps is None else f"step {self.max_steps}"
            logger.info("onebit: step %d: the automatic freeze waits: %s (next check at step %d; latest bound: %s)",
                        t, self.last_wait, t + WINDOW, latest)
        return None

    def _compare(self, t: int, done: int, previous: tuple[float, float, float | None] | None,
                 now: tuple[float, float, int, float]) -> tuple[str, list[str]]:
        """What the check at step ``t`` measured (``now`` against ``previous``), and why it waits
        (an empty list: ``t`` is to be the last warmup step)."""
        total, zeros, count, corrected = now
        if previous is None:
            return "", ["it is the first check, with nothing to compare with yet"]
        if total <= 0 or corrected <= 0:
            return "", ["the variance is still 0 everywhere"]
        change = (total - previous[0]) / total
        # (a state saved without the corrected total: the frozen one's growth, the stricter test)
        growth = change if previous[2] is None else (corrected - previous[2]) / corrected
        woken = (previous[1] - zeros) / max(count, 1)
        measured = (f"over steps {done - WINDOW + 1}-{done} the frozen denominator changed by {100 * change:+.2f}% "
                    f"(bias-corrected: {100 * growth:+.2f}%) and {previous[1] - zeros:.0f} coordinates left a zero "
                    "variance")
        return measured, [why for why, waiting in (
            (f"step {t} is before the earliest bound, step {self.min_steps}", t < self.min_steps),
            (f"the bias-corrected denominator grew more than {100 * GROWTH_TO_FREEZE:g}%", growth > GROWTH_TO_FREEZE),
            (f"the denominator changed more than {100 * CHANGE_TO_FREEZE:g}%", abs(change) > CHANGE_TO_FREEZE),
            (f"more than {WOKEN_TO_FREEZE:g} of the coordinates left a zero variance", woken > WOKEN_TO_FREEZE),
        ) if waiting]

    def state(self) -> dict[str, Any]:
        return {"min_steps": self.min_steps, "max_steps": self.max_steps, "checked": self.checked,
                "previous": None if self.previous is None else [x for x in self.previous if x is not None]}

    @classmethod
    def from_state(cls, saved: Any) -> AutoFreeze:
        """Validate a saved :meth:`state` (raise ValueError)."""
        if not isinstance(saved, Mapping):
            raise ValueError(f"auto_freeze must be a dict, got {type(saved).__name__}")
        auto = cls(saved.get("min_steps"), saved.get("max_steps"))
        check_bounds(auto.min_steps, auto.max_steps)
        checked = saved.get("checked", 0)
        if not is_int(checked, 0):
            raise ValueError(f"auto_freeze.checked must be an int >= 0, got {checked!r}")
        auto.checked = checked
        previous = saved.get("previous")
        if previous is not None:
            if (not isinstance(previous, (list, tuple)) or len(previous) not in (2, 3)
                    or not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in previous)):
                raise ValueError(f"auto_freeze.previous must be two or three finite numbers >= 0, got {previous!r}")
            auto.previous = (float(previous[0]), float(previous[1]), float(previous[2]) if len(previous) == 3 else None)
        return auto


def check_bounds(min_steps: Any, max_steps: Any) -> None:
    """``1 <= min_steps`` (int), ``max_steps`` None or an int ``>= min_steps``."""
    if not is_int(min_steps, 1):
        raise ValueError(f"the earliest automatic freeze must be an int >= 1, got {min_steps!r}")
    if max_steps is not None and not is_int(max_steps, min_steps):
        raise ValueError(f"the latest automatic freeze must be None or an int >= the earliest ({min_steps}), "
                         f"got {max_steps!r}")


def measure(buckets: list, groups: list[dict[str, Any]], t: int) -> tuple[float, float, int, float]:
    """The frozen denominator's total ``sum(sqrt(v / bc2))``, the count of coordinates
    with zero variance, the coordinates, and the bias-corrected denominator's total
    ``sum(sqrt(v / (1 - beta2**t)))`` (the same total with ``bias_correction``), over the
    compressed buckets at step ``t``."""
    total, zeros, count, corrected = 0.0, 0.0, 0, 0.0
    for bucket in buckets:
        if bucket.compression is None:
            continue
        group = groups[bucket.group_index]
        beta2 = group["betas"][1]
        bc2 = 1.0 - beta2 ** t
        v = bucket.buffers["exp_avg_sq"]
        # torch's float32 sum is blocked (relative error ~1e-7 at 25M elements, far below the 1 %
        # the decision compares with); summing in float64 would cast every element, 2.6x the time
        root = float(torch.sqrt(v).sum())
        root_corrected = root / math.sqrt(bc2)
        corrected += root_corrected
        total += root_corrected if group.get("bias_correction", False) else root
        zeros += bucket.numel - float(torch.count_nonzero(v))  # (the padding is always 0: not counted)
        count += bucket.numel
    return total, zeros, count, corrected
