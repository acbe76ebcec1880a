"""The registry of kernel implementations: :class:`KernelSet`, :func:`register` (used by the native
kernel modules) and :func:`get_kernels` (the dispatch)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import reference

logger = logging.getLogger("onebit.kernels")

__all__ = ["KernelSet", "REFERENCE", "register", "get_kernels", "available_implementations", "ENV_VAR"]

ENV_VAR = "ONEBIT_KERNELS"


@dataclass(frozen=True)
class KernelSet:
    """One implementation of the codec's three operations. ``separate_errors``: its compress
    functions take ``error_out=`` (the new error written there, ``error`` left as it is); else
    the caller copies the error there first and compresses in place. ``multipliers``: its
    ``worker_compress_`` and ``decode_`` take ``multiplier=`` (the input multiplied by it as it
    is read, the output as it is written); else the caller multiplies in passes of its own.
    ``limits`` (with ``multipliers``): its ``worker_compress_`` also takes ``limit=`` (the product
    clamped as it is read); else the caller multiplies and clamps in a pass of its own.
    ``error_dtypes``: the types of compression error its compress functions read and write
    (always float32); the caller runs an error of another type (``error_dtype=torch.bfloat16``)
    through a float32 copy, which gives the same bits (see
    :func:`onebit.kernels.reference.worker_compress_`). ``multiplier_dtypes``: the types of the
    worker's ``multiplier=`` it takes (else the caller passes a float32 copy: the same bits).
    ``divisors``: its ``decode_`` takes ``divisor=`` (each decoded value divided by it, ``+0.0``
    where it is 0; float32 or bfloat16); else the caller divides in a pass of its own."""

    name: str
    worker_compress_: Callable[..., torch.Tensor]
    server_compress_: Callable[..., torch.Tensor]
    decode_: Callable[..., torch.Tensor]
    separate_errors: bool = False
    multipliers: bool = False
    limits: bool = False
    error_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    multiplier_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    divisors: bool = False


REFERENCE = KernelSet(
    name="reference",
    worker_compress_=reference.worker_compress_,
    server_compress_=reference.server_compress_,
    decode_=reference.decode_,
    separate_errors=True,
    multipliers=True,
    limits=True,
    error_dtypes=(torch.float32, torch.bfloat16),
    multiplier_dtypes=(torch.float32, torch.bfloat16),
    divisors=True,
)

# name -> loader returning a KernelSet or raising ImportError/RuntimeError with the cause.
_LOADERS: dict[str, Callable[[], KernelSet]] = {"reference": lambda: REFERENCE}
# device type -> native implementation tried first by "auto".
_NATIVE_FOR_DEVICE: dict[str, str] = {}
_LOADED: dict[str, KernelSet] = {}
_FAILED: dict[str, BaseException] = {}


def register(name: str, loader: Callable[[], KernelSet], *, native_for: str | None = None) -> None:
    """Register an implementation (used by the native kernel modules)."""
    _LOADERS[name] = loader
    if native_for is not None:
        _NATIVE_FOR_DEVICE[native_for] = name


def available_implementations() -> list[str]:
    return sorted(_LOADERS)


def _load(name: str) -> KernelSet:
    if name in _LOADED:
        return _LOADED[name]
    if name in _FAILED:
        raise _FAILED[name]
    try:
        kernel_set = _LOADERS[name]()
    except (ImportError, RuntimeError, OSError) as exc:
        _FAILED[name] = exc
        raise
    _LOADED[name] = kernel_set
    return kernel_set


def get_kernels(device: torch.device | str, implementation: str | None = None) -> KernelSet:
    """Return the kernel set for ``device``.

    ``implementation`` is ``"auto"`` (the native kernels of the device when they load, else the
    reference, with one log line), or the name of one implementation, which must load.
    """
    device = torch.device(device)
    name = implementation if implementation is not None else os.environ.get(ENV_VAR, "auto")
    if name != "auto" and name not in _LOADERS:
        valid = ", ".join(repr(n) for n in ["auto", *available_implementations()])
        raise ValueError(f"unknown kernel implementation {name!r}; expected one of {valid}")
    if name != "auto":
        return _load(name)
    native = _NATIVE_FOR_DEVICE.get(device.type)
    if native is None:
        return REFERENCE
    try:
        return _load(native)
    except (ImportError, RuntimeError, OSError) as exc:
        if native not in _LOADED and not getattr(exc, "_onebit_logged", False):
            logger.info("onebit: %s kernels unavailable (%s); using the reference kernels", native, exc)
            try:
                exc._onebit_logged = True  # type: ignore[attr-defined]
            except AttributeError:
                pass
        return REFERENCE
