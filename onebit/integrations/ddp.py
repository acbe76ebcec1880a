"""A DDP communication hook that averages gradients in warmup and sends nothing after.

With ``DistributedDataParallel``, gradients are averaged during backward, overlapped with it. In
the warmup phase that is exactly what OnebitAdam needs; in the compression phase the gradients
must stay local (the optimizer compresses the momentum instead), so the hook returns each bucket
untouched (and :func:`attach_ddp` turns DDP's gradient synchronization off in that phase, so the
hook is not even called). The hook reads ``optimizer.phase``, the phase of the next ``step()``; it
changes nothing on the model or the optimizer except what :func:`attach_ddp` documents.
"""

# No "from __future__ import annotations": DDP checks the hook's annotations at run time.

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["attach_ddp", "onebit_ddp_hook"]


class _HookState:
    def __init__(self, optimizer: Any, process_group: dist.ProcessGroup | None) -> None:
        self.optimizer = optimizer
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)


def onebit_ddp_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Warmup: mean over ranks (like DDP's default hook). Compression: no communication."""
    buffer = bucket.buffer()
    if state.optimizer.phase == "warmup":
        buffer.div_(state.world_size)
        work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def attach_ddp(ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: Any) -> None:
    """Register :func:`onebit_ddp_hook` on ``ddp_model`` and tell ``optimizer`` that gradients
    arrive already averaged in warmup (``optimizer.set_warmup_gradients_averaged(True)``), so
    nothing is reduced twice. Call it once, before the first backward.

    In the compression phase DDP would still copy every gradient into its buckets and back for a
    hook that sends nothing; so after each ``step()`` (and ``load_state_dict``) this sets
    ``ddp_model.require_backward_grad_sync`` (the flag ``ddp_model.no_sync()`` sets) to whether the
    next step is a warmup step: DDP skips its gradient buckets in compression, as under
    ``no_sync()``. A ``no_sync()`` block of your own (gradient accumulation) still works: it
    restores the flag when it exits.

    The DDP model and the optimizer must use the same ranks: the process group of ``ddp_model``
    and the optimizer's backend must have the same world size.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"attach_ddp needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not hasattr(optimizer, "set_warmup_gradients_averaged") or not hasattr(optimizer, "phase"):
        raise TypeError(f"attach_ddp needs a onebit.OnebitAdam optimizer, got {type(optimizer).__name__}")
    group = getattr(ddp_model, "process_group", None)
    state = _HookState(optimizer, group)
    if state.world_size != optimizer.backend.world_size:
        raise ValueError(
            f"the DDP model spans {state.world_size} ranks but the optimizer's backend has "
            f"{optimizer.backend.world_size}; give both the same data-parallel group"
        )
    ddp_model.register_comm_hook(state, onebit_ddp_hook)
    optimizer.set_warmup_gradients_averaged(True)

    def sync_in_warmup_only(*_: Any) -> None:
        ddp_model.require_backward_grad_sync = optimizer.phase == "warmup"

    sync_in_warmup_only()
    optimizer.register_step_post_hook(sync_in_warmup_only)
    optimizer.register_load_state_dict_post_hook(sync_in_warmup_only)
