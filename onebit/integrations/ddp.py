"""A DDP communication hook that averages gradients on the steps whose plan asks for it and
sends nothing on the others.

With ``DistributedDataParallel``, gradients are averaged during backward, overlapped with it. On a
step whose plan averages gradients in full precision (1-bit Adam's and 1-bit LAMB's warmup) that is
exactly what the optimizer needs; on the others the gradients must stay local (the optimizer
compresses the momentum instead), so DDP's gradient synchronization is off for the forward and
backward of those steps (and the hook, were it called, would return each bucket untouched). The
hook reads ``optimizer.next_plan``, the plan of the next ``step()``. DDP's sync flag
``require_backward_grad_sync`` stays the user's: :func:`attach_ddp` combines it with the plan for
the length of each forward only, so that code that sets the flag itself each micro-batch (nanoGPT's
gradient accumulation) or enters ``ddp_model.no_sync()`` keeps working, and the flag also tells an
optimizer with ``overlap_backward=True`` which backward ends an accumulation. It works for every
onebit optimizer.

The hook counts the bytes of DDP's all-reduces in the optimizer's ``comm_stats()``
(``framework_bytes_sent``, inside ``bytes_sent``). Not counted: DDP's broadcast of the model's
buffers at each forward (``broadcast_buffers=True``, for models with buffers such as BatchNorm's
running statistics) and its one-time broadcast of the parameters when it is built.
"""

# No "from __future__ import annotations": DDP checks the hook's annotations at run time.

from typing import Any

import torch
import torch.distributed as dist

from ..compression import allreduce_wire_bytes
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
        # DDP's sync flag as the user left it, read at the last forward with gradients enabled
        self.user_sync = True


def onebit_ddp_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Steps that average gradients: mean over ranks (like DDP's default hook; in the optimizer's
    ``reduce_dtype`` when it has one). Others: no communication."""
    buffer = bucket.buffer()
    if state.optimizer.next_plan.average_gradients:
        dtype = state.optimizer.reduce_dtype if state.world_size > 1 else None
        sent = buffer if dtype is None else buffer.to(dtype)
        state.optimizer.record_framework_bytes(allreduce_wire_bytes(sent.numel() * sent.element_size(), state.world_size))
        if dtype is None:
            buffer.div_(state.world_size)
            work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        # reduce_dtype: summed in it, then divided, as the optimizer's own all-reduce does
        work = dist.all_reduce(sent, group=state.process_group, async_op=True)
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
    that sends nothing; so during each forward with gradients enabled (when DDP reads it), DDP's
    sync flag ``ddp_model.require_backward_grad_sync`` is the user's flag *and* whether the next
    step averages gradients, and the user's value is put back when the forward returns (or
    raises). Gradient accumulation works however the flag is set: ``with ddp_model.no_sync():``
    around the micro-batches before the last, or the flag set by hand before each forward
    (``ddp_model.require_backward_grad_sync = last_micro_step``, as nanoGPT does). With
    ``overlap_backward=True`` the same flag is the optimizer's accumulation boundary: a backward
    whose forward ran with the flag False (a micro-batch before the last) starts nothing, and the
    last one starts the compressed steps' communication.

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
    follow_plan(optimizer, lambda average: None)  # (the flag is combined with the plan at each forward)
    ddp_model.register_comm_hook(state, onebit_ddp_hook)
    _follow_sync_flag(ddp_model, state)
    if optimizer.overlap_backward:
        optimizer.set_accumulation_boundary(lambda: state.user_sync)


def _follow_sync_flag(ddp_model: torch.nn.parallel.DistributedDataParallel, state: _HookState) -> None:
    """Around each forward with gradients enabled: remember the user's sync flag, give DDP the
    flag and the plan, and put the user's flag back after the forward (even when it raises)."""
    def before(module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            state.user_sync = bool(module.require_backward_grad_sync)
            module.require_backward_grad_sync = state.user_sync and state.optimizer.next_plan.average_gradients

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            module.require_backward_grad_sync = state.user_sync

    ddp_model.register_forward_pre_hook(before)
    ddp_model.register_forward_hook(after, always_call=True)


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
