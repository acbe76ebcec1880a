"""What a step communicates: the plan an algorithm derives from the step number."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepPlan"]


@dataclass(frozen=True)
class StepPlan:
    """What one step communicates. ``name`` is the kind of step (``comm_stats()`` counts by it);
    ``average_gradients``: the gradients are averaged over ranks in full precision before the
    update (DDP may do it, see :func:`onebit.integrations.attach_ddp`); ``compress``: a buffer
    of each compressed bucket goes through the 1-bit compressed all-reduce. Neither: a local step."""

    name: str
    average_gradients: bool = False
    compress: bool = False
