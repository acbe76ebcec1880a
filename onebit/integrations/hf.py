"""Hugging Face ``transformers.Trainer``: attach the onebit DDP hook to the model Trainer wraps.

Trainer wraps the model in ``DistributedDataParallel`` itself, inside ``train()``, after the
``on_train_begin`` callbacks. :func:`attach_trainer` adds a callback that, at the first
``on_step_begin`` (before the first backward), finds the DDP wrapper and calls
:func:`onebit.integrations.attach_ddp` on it; without DDP (one process) it does nothing.
``transformers`` is imported only here.
"""

from __future__ import annotations

from typing import Any

import torch

from .ddp import attach_ddp, unwrap_optimizer

__all__ = ["attach_trainer"]


def attach_trainer(trainer: Any) -> None:
    """Make ``trainer`` (a ``transformers.Trainer`` built with
    ``optimizers=(OnebitAdam(...), scheduler)``, or any onebit optimizer) use the onebit DDP hook
    when it trains on several ranks, so that gradients are averaged once in warmup and not at all
    afterwards."""
    try:
        from transformers import TrainerCallback
    except ImportError as exc:
        raise ImportError('attach_trainer needs transformers: pip install "onebit[examples]"') from exc
    if not hasattr(trainer, "add_callback") or not hasattr(trainer, "model_wrapped"):
        raise TypeError(f"attach_trainer needs a transformers.Trainer, got {type(trainer).__name__}")
    if unwrap_optimizer(trainer.optimizer) is None:
        raise ValueError(
            "the Trainer has no onebit optimizer: build it with optimizers=(OnebitAdam(model.parameters(), ...), scheduler)"
        )

    class OnebitDDPCallback(TrainerCallback):
        def __init__(self) -> None:
            self.attached = False

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.attached:
                model = trainer.model_wrapped
                if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                    attach_ddp(model, unwrap_optimizer(trainer.optimizer))
                self.attached = True
            return control

        def on_train_end(self, args, state, control, **kwargs):
            # The ranks of an algorithm with local steps may differ now; the Trainer saves rank 0's weights.
            unwrap_optimizer(trainer.optimizer).synchronize()
            return control

    trainer.add_callback(OnebitDDPCallback())
