"""Hugging Face Accelerate: one call after ``accelerator.prepare``.

On several processes ``accelerator.prepare(model, optimizer)`` wraps the model in
``DistributedDataParallel`` and the optimizer in an ``AcceleratedOptimizer``; DDP would then average
every gradient on top of onebit's own communication. :func:`attach_accelerate` gives that DDP the
onebit hook (:func:`onebit.integrations.attach_ddp`): gradients are averaged during backward only
on the steps whose plan averages them, and nothing is sent for them otherwise.

``accelerator.accumulate(model)`` keeps working: on the micro-batches that do not end an
accumulation it runs backward under ``model.no_sync()``, which restores the hook's setting on exit,
and ``AcceleratedOptimizer.step`` calls the onebit ``step()`` only at the boundary.
``accelerate`` itself is never imported: the adapter only looks at what ``prepare`` returned.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..engine import optimizer_names
from .ddp import attach_ddp, unwrap_optimizer

__all__ = ["attach_accelerate"]

logger = logging.getLogger(__name__)


def attach_accelerate(model: Any, optimizer: Any) -> None:
    """Attach onebit's communication to the ``model`` and ``optimizer`` that
    ``accelerator.prepare`` returned (``optimizer`` built as a onebit optimizer). Call it once,
    after ``prepare`` and before the first backward::

        model, optimizer, loader = accelerator.prepare(model, OnebitAdam(model.parameters()), loader)
        attach_accelerate(model, optimizer)

    On one process ``prepare`` does not wrap the model and there is nothing to attach (logged once).
    A model wrapped by something other than DDP (FSDP, DeepSpeed) is refused: those shard or
    average gradients themselves.
    """
    onebit_optimizer = unwrap_optimizer(optimizer)
    if onebit_optimizer is None:
        raise TypeError(
            f"attach_accelerate needs the optimizer accelerator.prepare returned for a onebit optimizer "
            f"({optimizer_names()}), got {type(optimizer).__name__}"
        )
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        attach_ddp(model, onebit_optimizer)
        return
    wrapper = type(model).__name__
    if hasattr(model, "module") or "FullyShardedDataParallel" in wrapper or "FSDP" in wrapper:
        raise TypeError(
            f"attach_accelerate supports the DDP wrapper that accelerate uses for multi-GPU and multi-CPU "
            f"training, got {wrapper}; with FSDP or DeepSpeed gradients are averaged or sharded by them: "
            f"launch without those plugins (accelerate launch --multi_gpu, or --num_processes N on CPU)"
        )
    if onebit_optimizer.backend.world_size > 1:
        raise ValueError(
            f"the optimizer spans {onebit_optimizer.backend.world_size} ranks but accelerate did not wrap the "
            f"model in DDP ({wrapper}); pass the model that accelerator.prepare returned (on CPU, accelerate "
            f"runs several processes only with Accelerator(cpu=True) or accelerate launch --cpu)"
        )
    logger.info("attach_accelerate: one process, the model is not wrapped in DDP; nothing to attach")
