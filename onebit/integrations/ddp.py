"""A DDP communication hook that averages gradients on the steps whose plan asks for it and
sends nothing on the others.

With ``DistributedDataParallel``, gradients are averaged during backward, overlapped with it. On a
step whose plan averages gradients in full precision (1-bit Adam's and 1-bit LAMB's warmup) that is
exactly what the optimizer needs; on the others the gradients must stay local (the optimizer
compresses the momentum instead), so the hook returns each bucket untouched (and
:func:`attach_ddp` turns DDP's gradient synchronization off for those steps, so the hook is not
even called). The hook reads ``optimizer.next_plan``, the plan of the next ``step()``; it changes
nothing on the model or the optimizer except what :func:`attach_ddp` documents. It works for every
onebit optimizer.
"""

# No "from __future__ import annotations": DDP checks the hook's annotations at run time.

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..engine import OnebitOptimizer, optimizer_names

__all__ = ["attach_ddp", "follow_plan", "onebit_ddp_hook", "unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> OnebitOptimizer | None:
    """The onebit optimizer inside ``optimizer``: itself, or the one a framework wrapped
    (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, both keep it as
    ``.optimizer``, at most a few levels deep); ``None`` when there is none."""
    for _ in range(4):
        if optimizer is None or isinstance(optimizer, OnebitOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
    return optimizer if isinstance(optimizer, OnebitOptimizer) else None


class _HookState:
    def __init__(self, optimizer: Any, process_group: dist.ProcessGroup | None) -> None:
        self.optimizer = optimizer
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)


def onebit_ddp_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Steps that average gradients: mean over ranks (like DDP's default hook; in the optimizer's
    ``reduce_dtype`` when it has one). Others: no communication."""
    buffer = bucket.buffer()
    if state.optimizer.next_plan.average_gradients:
        dtype = state.optimizer.reduce_dtype if state.world_size > 1 else None
        if dtype is None:
            buffer.div_(state.world_size)
            work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        # reduce_dtype: summed in it, then divided, as the optimizer's own all-reduce does
        low = buffer.to(dtype)
        work = dist.all_reduce(low, group=state.process_group, async_op=True)
        return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0].div_(state.world_size)))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def attach_ddp(ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: Any) -> None:
    """Register :func:`onebit_ddp_hook` on ``ddp_model`` and tell ``optimizer`` that gradients
    arrive already averaged on the steps whose plan averages them
    (``optimizer.set_gradients_averaged(True)``), so nothing is reduced twice. Call it once,
    before the first backward.

    On the other steps DDP would still copy every gradient into its buckets and back for a hook
    that sends nothing; so after each ``step()`` (and ``load_state_dict``) this sets
    ``ddp_model.require_backward_grad_sync`` (the flag ``ddp_model.no_sync()`` sets) to whether the
    next step averages gradients: DDP skips its gradient buckets otherwise, as under
    ``no_sync()``. A ``no_sync()`` block of your own (gradient accumulation) still works: it
    restores the flag when it exits. With ``overlap_backward=True`` the optimizer starts the
    compressed steps' communication during backward, and ``ddp_model.no_sync()`` enters
    ``optimizer.no_sync()`` too, so that accumulation's micro-batches start nothing.

    The DDP model and the optimizer must use the same ranks: the process group of ``ddp_model``
    and the optimizer's backend must have the same world size.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"attach_ddp needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not isinstance(optimizer, OnebitOptimizer):
        raise TypeError(f"attach_ddp needs a onebit optimizer ({optimizer_names()}), got {type(optimizer).__name__}")
    group = getattr(ddp_model, "process_group", None)
    state = _HookState(optimizer, group)
    if state.world_size != optimizer.backend.world_size:
        raise ValueError(
            f"the DDP model spans {state.world_size} ranks but the optimizer's backend has "
            f"{optimizer.backend.world_size}; give both the same data-parallel group"
        )
    ddp_model.register_comm_hook(state, onebit_ddp_hook)
    # The optimizer reaches the model weakly: DDP's C++ reducer holds the hook state and so the
    # optimizer, an edge Python's garbage collector cannot see, and a strong way back would make
    # a cycle never freed that keeps the process group (and its gloo threads) alive at exit.
    model = weakref.ref(ddp_model)

    def apply(average: bool) -> None:
        target = model()
        if target is not None:
            target.require_backward_grad_sync = average

    follow_plan(optimizer, apply)
    if optimizer.overlap_backward:
        _sync_with(ddp_model, optimizer)


def _sync_with(ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: OnebitOptimizer) -> None:
    """``ddp_model.no_sync()`` enters ``optimizer.no_sync()`` too: the micro-batches a framework
    runs under DDP's ``no_sync()`` (Lightning, Accelerate and the HF Trainer do, before the last of
    an accumulation) start nothing during their backward (``overlap_backward``)."""
    ddp_no_sync = ddp_model.no_sync

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        with ddp_no_sync(), optimizer.no_sync():
            yield

    ddp_model.no_sync = no_sync


def follow_plan(optimizer: OnebitOptimizer, apply: Any) -> None:
    """Tell ``optimizer`` that the framework averages the gradients on the steps whose plan
    averages them, and call ``apply(average)`` with whether the next step's plan does: now, after
    every ``step()`` and after every ``load_state_dict`` (the framework's switch follows the plan).
    Raises ``RuntimeError`` once the optimizer has stepped since it was built or loaded: the
    framework averaged those steps' gradients and the optimizer averaged them again."""
    if optimizer.steps_taken:
        raise RuntimeError(
            f"the onebit adapter was attached after {optimizer.steps_taken} step() call(s) of {type(optimizer).__name__}: "
            "the gradients of those steps were averaged by the framework and again by the optimizer. Attach it "
            "right after building the optimizer (or after loading its state), before the first step")
    optimizer.set_gradients_averaged(True)

    def when_planned(*_: Any) -> None:
        apply(optimizer.next_plan.average_gradients)

    when_planned()
    optimizer.register_step_post_hook(when_planned)
    optimizer.register_load_state_dict_post_hook(when_planned)
