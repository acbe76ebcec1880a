"""Adapters for training loops that communicate on their own (DDP, and through it HF Trainer)."""

from .accelerate import attach_accelerate
from .ddp import attach_ddp, onebit_ddp_hook
from .hf import attach_trainer

__all__ = ["attach_accelerate", "attach_ddp", "attach_trainer", "onebit_ddp_hook"]
