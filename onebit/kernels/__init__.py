"""Sign-pack kernels and their dispatch.

Every implementation provides the same three operations with the same signatures as
:mod:`onebit.kernels.reference` (``worker_compress_``, ``server_compress_``, ``decode_``) and must
equal the reference bit for bit. Kernels never communicate.

Selection: the ``kernels`` argument of :class:`onebit.OnebitAdam`, else the environment variable
``ONEBIT_KERNELS``, else ``"auto"``.
"""

from __future__ import annotations

from . import reference
from .registry import ENV_VAR, REFERENCE, KernelSet, available_implementations, get_kernels, register

__all__ = ["KernelSet", "REFERENCE", "get_kernels", "available_implementations", "register", "reference", "ENV_VAR"]

# Native implementations register themselves; importing them compiles nothing (that happens on the
# first get_kernels that wants them) and never imports optional packages such as CuPy.
from . import cpu as _cpu  # noqa: E402,F401
from . import cuda as _cuda  # noqa: E402,F401
