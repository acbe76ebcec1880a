"""onebit: 1-bit Adam for any PyTorch training loop.

``OnebitAdam`` runs Adam with a full-precision gradient all-reduce for ``freeze_step`` warmup
steps, then freezes the variance and averages the momentum with an error-compensated 1-bit
compressed all-reduce (Tang et al., 2021, arXiv 2102.02888).
"""

from .backends import BACKEND_NAMES, CommBackend, LocalBackend
from .checkpoint import load_checkpoint, save_checkpoint
from .collectives import CompressionState, compressed_allreduce_
from .config import from_config
from .estimate import estimate_speedup
from .optimizer import OnebitAdam

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAMES",
    "CommBackend",
    "CompressionState",
    "LocalBackend",
    "OnebitAdam",
    "compressed_allreduce_",
    "estimate_speedup",
    "from_config",
    "load_checkpoint",
    "save_checkpoint",
    "__version__",
]
