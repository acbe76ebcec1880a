"""Fused CPU kernels: a small C++ library compiled at first use and called through ctypes.

Why it exists. The reference makes about ten full passes over the data (add, cast, square, sum,
compare, shift, sum, sub, ...) per segment and runs at 0.1-0.4 GB/s; numpy's ``packbits`` alone
reaches ~11 GB/s but is only one of the passes. ``cpu_kernels.cpp`` does the worker in two passes
(b = x + e with the sums of squares; then signs, bytes and the error update given the scales), the
server in two passes over its chunk (unpack n rows, weighted sum in rank order, /n, +e, sums of
squares; then pack and error update) and decode in one, with AVX2 when the CPU has it (a portable
scalar path otherwise, with the same results). Each is one native call whatever the number of
segments in the segment table: the passes run over the blocks and bytes of all segments at once,
so 1,000 small segments cost about what one segment of the same total length does. It needs no
torch headers, so it compiles in a few seconds instead of the minute a torch C++ extension takes,
and the library is cached.

Build. The first :func:`onebit.kernels.get_kernels` that wants these kernels compiles
``cpu_kernels.cpp`` with ``$CXX`` (else ``c++``, ``g++`` or ``clang++``) into the cache folder
``$ONEBIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/onebit`` or ``~/.cache/onebit``), named by a hash of
the source, the flags and the compiler's version, so concurrent ranks and later runs reuse it. The
library is portable: AVX2 code is chosen at run time, so a cache shared by different CPUs is safe.
Importing onebit never compiles anything. Without a compiler, ``'auto'`` falls back to the
reference (one log line) and ``ONEBIT_KERNELS=cpu`` raises with the cause;
``ONEBIT_KERNELS=reference`` skips the build entirely.

Results equal :mod:`onebit.kernels.reference` bit for bit, with the scale's sum of squares in the
fixed blocked order of :mod:`onebit.kernels.blocked`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from .registry import KernelSet, register
from ._layout import (byte_rows, check_bounds, check_decode, check_divisor, check_limit, check_server, check_worker,
                      claimed_segments, flat_float)

logger = logging.getLogger(__name__)

__all__ = ["load", "build", "compiler_command", "cache_dir", "CACHE_ENV_VAR"]

CACHE_ENV_VAR = "ONEBIT_CACHE_DIR"
#: The compression errors these kernels read and write: float32, and bfloat16 as its 16 bits.
ERROR_DTYPES = (torch.float32, torch.bfloat16)
#: The types of the worker's multiplier and of decode's divisor (decode's multiplier: float32).
MULTIPLIER_DTYPES = (torch.float32, torch.bfloat16)
SOURCE_NAME = "cpu_kernels.cpp"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fvisibility=hidden")
ABI = 7

_c_ptr = ctypes.c_void_p
_c_i64 = ctypes.c_int64
_c_int = ctypes.c_int


def compiler_command() -> list[str] | None:
    """The C++ compiler to use: ``$CXX`` (may hold arguments), else the first of c++, g++, clang++."""
    cxx = os.environ.get("CXX")
    if cxx:
        parts = shlex.split(cxx)
        return parts if parts and shutil.which(parts[0]) else None
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def cache_dir() -> Path:
    """Where compiled libraries are kept (``$ONEBIT_CACHE_DIR``, else the user's cache folder)."""
    explicit = os.environ.get(CACHE_ENV_VAR)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "onebit"


def _source() -> bytes:
    return resources.files(__package__).joinpath(SOURCE_NAME).read_bytes()


def build(directory: Path | None = None) -> Path:
    """Compile the library if no cached copy exists; return its path. Raises RuntimeError."""
    cxx = compiler_command()
    if cxx is None:
        raise RuntimeError(
            "no C++ compiler found (looked for $CXX, c++, g++, clang++); install one (e.g. apt-get install g++) "
            "or set ONEBIT_KERNELS=reference"
        )
    source = _source()
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"C++ compiler {cxx[0]!r} does not run: {exc}") from exc
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), " ".join(cxx).encode(), version.encode(),
                    sys.platform.encode(), str(ABI).encode()])
    ).hexdigest()[:16]
    directory = cache_dir() if directory is None else directory
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, delete=True)
        probe.close()
    except OSError:
        directory = Path(tempfile.gettempdir()) / f"onebit-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"onebit_cpu-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src_path = Path(tmp) / SOURCE_NAME
        src_path.write_bytes(source)
        out_path = Path(tmp) / target.name
        cmd = [*cxx, *FLAGS, str(src_path), "-o", str(out_path)]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"compiling the onebit CPU kernels failed: {' '.join(cmd)}: {exc}") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-2000:]
            raise RuntimeError(f"compiling the onebit CPU kernels failed ({' '.join(cmd)}):\n{tail}")
        os.replace(out_path, target)  # atomic: concurrent ranks each build, one copy wins
    logger.info("onebit: compiled the CPU kernels in %.1f s into %s", time.perf_counter() - started, target)
    return target


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    try:
        abi = lib.onebit_cpu_abi()
    except AttributeError as exc:
        raise RuntimeError(f"{path} is not a onebit CPU kernel library ({exc}); delete it to rebuild") from exc
    if abi != ABI:
        raise RuntimeError(f"{path} has ABI {abi}, expected {ABI}; delete it to rebuild")
    lib.onebit_cpu_vector_path.restype = _c_int
    lib.onebit_cpu_force_scalar.argtypes = [_c_int]
    lib.onebit_cpu_valid_bounds.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64]
    lib.onebit_cpu_valid_bounds.restype = _c_int
    lib.onebit_cpu_sumsq.argtypes = [_c_ptr, _c_i64, _c_int]
    lib.onebit_cpu_sumsq.restype = ctypes.c_double
    lib.onebit_cpu_worker.argtypes = [_c_ptr, _c_ptr, ctypes.c_float, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_i64, _c_i64,
                                      _c_ptr, _c_i64, _c_i64, _c_ptr, _c_int, _c_int, _c_int]
    lib.onebit_cpu_worker.restype = None
    lib.onebit_cpu_server.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_i64,
                                      _c_ptr, _c_i64, _c_i64, _c_ptr, _c_int, _c_int]
    lib.onebit_cpu_server.restype = None
    lib.onebit_cpu_decode.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_ptr,
                                      _c_ptr, _c_int, _c_ptr, _c_int]
    lib.onebit_cpu_decode.restype = None
    return lib


class CpuKernels:
    """The three codec operations over the compiled library (plus test hooks)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    @property
    def vector_path(self) -> bool:
        """True when the AVX2 paths run (False: the portable scalar paths)."""
        return bool(self.lib.onebit_cpu_vector_path())

    def force_scalar(self, on: bool) -> None:
        """Testing hook: run the portable scalar paths even where AVX2 is available."""
        self.lib.onebit_cpu_force_scalar(1 if on else 0)

    def sumsq(self, b: torch.Tensor) -> float:
        """The blocked float64 sum of squares of a float32 CPU tensor."""
        flat = flat_float(b)
        return self.lib.onebit_cpu_sumsq(flat.data_ptr(), flat.numel(), torch.get_num_threads())

    def _table(self, bounds: torch.Tensor | None, total: int, unit: int, what: str) -> tuple[torch.Tensor, int]:
        """The segment table to pass (a contiguous int64 CPU tensor) and its segment count.

        A valid table is checked natively (a Python loop over 1,000 segments would cost a good part
        of a small call); anything else goes through :func:`check_bounds`, which names the problem."""
        if (isinstance(bounds, torch.Tensor) and bounds.dtype == torch.int64 and bounds.dim() == 1
                and bounds.device.type == "cpu" and bounds.numel() >= 2 and bounds.is_contiguous()
                and self.lib.onebit_cpu_valid_bounds(bounds.data_ptr(), bounds.numel() - 1, total, unit)):
            return bounds, bounds.numel() - 1
        table, edges = check_bounds(bounds, total, unit, what)
        return table, len(edges) - 1

    def worker_compress_(self, x: torch.Tensor, error: torch.Tensor, packed: torch.Tensor, *,
                         bounds: torch.Tensor | None = None, error_out: torch.Tensor | None = None,
                         multiplier: torch.Tensor | None = None, limit: float | None = None) -> torch.Tensor:
        """:func:`onebit.kernels.reference.worker_compress_`: returns the ``(k,)`` scales."""
        total = check_worker(x, error, packed, "cpu", ERROR_DTYPES)
        check_limit(limit, multiplier)
        target = _error_target(error, error_out)
        ms = _multiplier(multiplier, total, "worker_compress_")
        nrows = packed.shape[0] if packed.dim() == 2 else 1
        table, k = self._table(bounds, total, 8 * nrows, "worker_compress_")
        xs, es = flat_float(x), flat_float(error)
        eo = es if target is error else flat_float(target)
        out = byte_rows(packed, output=True)
        scales = torch.empty(k, dtype=torch.float32)
        # (ctypes rounds the limit to float32, as torch's clamp of a float32 tensor does)
        self.lib.onebit_cpu_worker(xs.data_ptr(), None if ms is None else ms.data_ptr(),
                                   math.inf if limit is None else limit, es.data_ptr(), eo.data_ptr(), total,
                                   table.data_ptr(), k, nrows, out.tensor.data_ptr(), out.row_len, out.row_stride,
                                   scales.data_ptr(), torch.get_num_threads(), int(error.dtype == torch.bfloat16),
                                   int(ms is not None and ms.dtype == torch.bfloat16))
        out.finish_()
        if eo.data_ptr() != target.data_ptr():
            target.copy_(eo.view(target.shape))
        return scales

    def server_compress_(self, signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor,
                         packed: torch.Tensor, *, bounds: torch.Tensor | None = None,
                         error_out: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`onebit.kernels.reference.server_compress_`: returns the ``(k,)`` server scales."""
        n = check_server(signs, scales, error, packed, "cpu", claimed_segments(bounds), ERROR_DTYPES)
        target = _error_target(error, error_out)
        nrows = signs.shape[0]
        table, k = self._table(bounds, n * nrows, 8 * nrows, "server_compress_")
        rows = byte_rows(signs, output=False)
        sc, es = flat_float(scales), flat_float(error)
        eo = es if target is error else flat_float(target)
        out = byte_rows(packed, output=True)
        result = torch.empty(k, dtype=torch.float32)
        self.lib.onebit_cpu_server(rows.tensor.data_ptr(), nrows, rows.row_stride, sc.data_ptr(), es.data_ptr(),
                                   eo.data_ptr(), n, table.data_ptr(), k, out.tensor.data_ptr(), out.row_len,
                                   out.row_stride, result.data_ptr(), torch.get_num_threads(),
                                   int(error.dtype == torch.bfloat16))
        out.finish_()
        if eo.data_ptr() != target.data_ptr():
            target.copy_(eo.view(target.shape))
        return result

    def decode_(self, signs: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                keep: torch.Tensor | None = None, *, bounds: torch.Tensor | None = None,
                multiplier: torch.Tensor | None = None, divisor: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`onebit.kernels.reference.decode_`."""
        check_decode(signs, scales, out, "cpu", keep, claimed_segments(bounds))
        check_divisor(multiplier, divisor)
        ms = _multiplier(multiplier, out.numel(), "decode_", (torch.float32,))
        ds = _multiplier(divisor, out.numel(), "decode_", MULTIPLIER_DTYPES, "divisor")
        nrows, cols = signs.shape
        table, k = self._table(bounds, out.numel(), 8 * nrows, "decode_")
        rows = byte_rows(signs, output=False)
        sc = flat_float(scales)
        dst = flat_float(out)
        self.lib.onebit_cpu_decode(rows.tensor.data_ptr(), nrows, rows.row_stride, cols, sc.data_ptr(),
                                   table.data_ptr(), k, None if keep is None else keep.data_ptr(),
                                   None if ms is None else ms.data_ptr(), None if ds is None else ds.data_ptr(),
                                   int(ds is not None and ds.dtype == torch.bfloat16), dst.data_ptr(),
                                   torch.get_num_threads())
        if dst.data_ptr() != out.data_ptr():
            out.copy_(dst.view(out.shape))
        return out

    def kernel_set(self) -> KernelSet:
        return KernelSet(name="cpu", worker_compress_=self.worker_compress_,
                         server_compress_=self.server_compress_, decode_=self.decode_, separate_errors=True,
                         multipliers=True, limits=True, error_dtypes=ERROR_DTYPES,
                         multiplier_dtypes=MULTIPLIER_DTYPES, divisors=True)


_KERNELS: CpuKernels | None = None


def load() -> CpuKernels:
    """Build (or find in the cache) and open the library. Raises RuntimeError or OSError."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = CpuKernels(_open(build()))
    return _KERNELS


register("cpu", lambda: load().kernel_set(), native_for="cpu")


def _error_target(error: torch.Tensor, error_out: torch.Tensor | None) -> torch.Tensor:
    """Where the new error goes: ``error`` itself, or ``error_out`` (``error``'s shape and type,
    CPU, not overlapping ``error``: the kernel reads one while it writes the other)."""
    if error_out is None or error_out is error:
        return error
    if error_out.shape != error.shape or error_out.dtype != error.dtype or error_out.device.type != "cpu":
        kind = str(error.dtype).replace("torch.", "")
        raise ValueError(f"error_out must be a {kind} CPU tensor of shape {tuple(error.shape)} (the error's), got "
                         f"{error_out.dtype} {tuple(error_out.shape)} on {error_out.device}")
    return error_out


def _multiplier(multiplier: torch.Tensor | None, total: int, what: str,
                dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), name: str = "multiplier"
                ) -> torch.Tensor | None:
    """The contiguous CPU tensor of ``total`` elements (of ``dtypes``) to pass for ``multiplier=``
    (or ``divisor=``)."""
    if multiplier is None:
        return None
    if multiplier.dtype not in dtypes or multiplier.device.type != "cpu" or multiplier.numel() != total:
        kinds = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{what}: {name} must be a {kinds} CPU tensor of {total} elements, got "
                         f"{multiplier.dtype} of {multiplier.numel()} elements on {multiplier.device}")
    return flat_float(multiplier)
