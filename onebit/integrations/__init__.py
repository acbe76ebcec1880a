"""Adapters for training loops that communicate on their own: DDP (and through it the HF Trainer,
Accelerate and Lightning) and DeepSpeed's engine. None imports its framework before it is used."""

from .accelerate import attach_accelerate
from .ddp import attach_ddp, onebit_ddp_hook
from .deepspeed import attach_deepspeed
from .hf import attach_trainer

# OnebitCallback is left out of __all__: a star import would then need Lightning.
__all__ = ["attach_accelerate", "attach_ddp", "attach_deepspeed", "attach_trainer", "onebit_ddp_hook"]


def __getattr__(name: str):
    # Lightning's Callback base class is needed to define OnebitCallback, so Lightning is imported
    # on first use of the name, never by ``import onebit``.
    if name == "OnebitCallback":
        from .lightning import OnebitCallback
        return OnebitCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
