"""onebit: 1-bit optimizers for any PyTorch training loop.

``OnebitAdam`` (Tang et al., 2021, arXiv 2102.02888) and ``OnebitLamb`` (Li et al., 2021, arXiv
2104.06069) run their full-precision algorithm with a gradient all-reduce for ``freeze_step``
warmup steps, then freeze the variance and average the momentum with an error-compensated 1-bit
compressed all-reduce. ``ZeroOneAdam`` (0/1 Adam; Lu et al., 2023, arXiv 2202.06009) refreshes the
variance on a doubling schedule with every other step a 1-bit gradient average, then freezes it and
takes local steps with 1-bit syncs on a doubling schedule. All three are thin subclasses of
:class:`onebit.engine.OnebitOptimizer`.
"""

from .backends import BACKEND_NAMES, CommBackend, LocalBackend
from .checkpoint import load_checkpoint, load_compression_errors, save_checkpoint, save_compression_errors
from .collectives import CompressionState, compressed_allreduce_
from .config import from_config
from .adam import OnebitAdam
from .diloco import OnebitDiLoCo
from .engine import OnebitOptimizer, StepPlan
from .lamb import OnebitLamb
from .zoadam import ZeroOneAdam

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAMES",
    "CommBackend",
    "CompressionState",
    "LocalBackend",
    "OnebitAdam",
    "OnebitDiLoCo",
    "OnebitLamb",
    "OnebitOptimizer",
    "StepPlan",
    "ZeroOneAdam",
    "compressed_allreduce_",
    "estimate_speedup",
    "from_config",
    "load_checkpoint",
    "save_checkpoint",
    "save_compression_errors",
    "load_compression_errors",
    "__version__",
]


def __getattr__(name: str):
    # Imported on first use: ``python -m onebit.estimate`` then runs a module that is not yet
    # imported (runpy warns otherwise), and ``import onebit`` stays light.
    if name == "estimate_speedup":
        from .estimate import estimate_speedup

        return estimate_speedup
    raise AttributeError(f"module 'onebit' has no attribute {name!r}")
