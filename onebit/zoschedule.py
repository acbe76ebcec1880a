"""0/1 Adam's schedule, from the step number alone: the four kinds of step and when each comes
(DeepSpeed's counters, replayed call by call in ``tests/test_zoadam.py``)."""

from __future__ import annotations

from .plan import StepPlan

__all__ = ["VARIANCE", "COMPRESSED_GRADIENT", "LOCAL", "SYNC", "is_variance_step", "variance_updates", "sync_interval"]

VARIANCE = StepPlan("variance", average_gradients=True)
COMPRESSED_GRADIENT = StepPlan("compressed_gradient", compress=True)
LOCAL = StepPlan("local")
SYNC = StepPlan("sync", compress=True)


def is_variance_step(step: int, var_update_scaler: int) -> bool:
    """Whether step ``step`` (1-based, of the first phase) updates the variance with a gradient
    averaged in full precision. In DeepSpeed's call numbering ``t = step + 1`` (it counted a dry
    run), the variance interval ``I`` starts at 1 and doubles after every ``var_update_scaler``
    updates, and call ``t`` updates iff ``t % I == 0``: the first ``var_update_scaler`` steps, then
    every other step for as many updates, then every 4th, and so on."""
    t, last, interval = step + 1, 1, 1
    while True:
        first = (last // interval + 1) * interval  # the first multiple of the interval after the last update
        end = first + (var_update_scaler - 1) * interval  # this interval's last update
        if t <= end:
            return t >= first and t % interval == 0
        last, interval = end, 2 * interval


def variance_updates(step: int, var_update_scaler: int) -> int:
    """How many of steps ``1..step`` are variance steps (see :func:`is_variance_step`)."""
    t, last, interval, count = step + 1, 1, 1, 0
    while True:
        first = (last // interval + 1) * interval
        end = first + (var_update_scaler - 1) * interval
        if t < first:
            return count
        if t <= end:
            return count + (t - first) // interval + 1
        last, interval, count = end, 2 * interval, count + var_update_scaler


def sync_interval(step: int, var_freeze_step: int, local_step_scaler: int, local_step_clipper: int) -> int:
    """The sync interval ``H`` at step ``step`` of the second phase: 1 for its first
    ``local_step_scaler`` steps, then doubled every ``local_step_scaler`` steps, at most
    ``local_step_clipper``. Step ``step`` syncs iff ``(step + 1) % H == 0`` (DeepSpeed's call numbers)."""
    doublings = (step - var_freeze_step - 1) // local_step_scaler
    return local_step_clipper if doublings >= local_step_clipper.bit_length() else min(local_step_clipper, 1 << doublings)
