"""CUDA kernels: ``kernels/onebit_kernels.cu`` compiled at run time with CuPy and launched on
torch's current stream.

The ``.cu`` source ships inside the package as ``onebit._cuda_src`` (the top-level ``kernels/``
folder of the repository, mapped in ``pyproject.toml``) and is read with :mod:`importlib.resources`.
CuPy is optional and imported only when these kernels are first wanted
(``pip install "onebit[cuda12]"`` or ``"onebit[cuda13]"``).

One worker call is ``2 + ceil(log32(n / 32))`` launches: the lane sums of the blocked sum of squares
(see :mod:`onebit.kernels.blocked`), trees of 32 until one value is left (the last launch also
writes the float32 scale into device memory), then the pack and error update, which reads the
scale from device memory. Nothing waits for the device: no synchronize, no ``.item()``; the scale
is returned as a 0-d CUDA tensor. The server call has the same shape; decode is one launch.

The launch sequence below is written against a ``launch(name, nthreads, *args)`` function, so the
tests run it on the CPU over the same kernel bodies compiled for the host (see the ``.cu`` file).
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch

from . import KernelSet, register
from ._layout import byte_rows, check_decode, check_server, check_worker, flat_float
from .blocked import BLOCK, LANES

logger = logging.getLogger(__name__)

__all__ = ["kernel_source", "CudaCodec", "load", "SOURCE_PACKAGE", "SOURCE_NAME", "KERNEL_NAMES", "NVRTC_OPTIONS"]

SOURCE_PACKAGE = "onebit._cuda_src"
SOURCE_NAME = "onebit_kernels.cu"
KERNEL_NAMES = (
    "onebit_worker_sumsq",
    "onebit_server_sumsq",
    "onebit_tree_sum",
    "onebit_worker_pack",
    "onebit_server_pack",
    "onebit_decode",
)
TREE_GROUP = 32
THREADS_PER_BLOCK = 256
# -fmad=false: no contraction anywhere (the kernels also use explicit _rn intrinsics); division and
# square root stay IEEE (NVRTC's defaults -prec-div=true, -prec-sqrt=true), no flush to zero.
NVRTC_OPTIONS = ("--std=c++14", "-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false")
INSTALL_HINT = 'pip install "onebit[cuda12]" (CUDA 12) or pip install "onebit[cuda13]" (CUDA 13)'

Launch = Callable[..., None]


def kernel_source() -> str:
    """The text of ``onebit_kernels.cu`` from the installed package.

    Falls back to the ``kernels/`` folder of a source checkout, for an editable install made
    before the folder was mapped into the package.
    """
    try:
        return resources.files(SOURCE_PACKAGE).joinpath(SOURCE_NAME).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        checkout = Path(__file__).resolve().parents[2] / "kernels" / SOURCE_NAME
        if checkout.is_file():
            return checkout.read_text(encoding="utf-8")
        raise RuntimeError(f"the CUDA source {SOURCE_NAME} is missing from the installed onebit package") from exc


class CudaCodec:
    """The codec's three operations as launch sequences over a ``launch`` function.

    ``launch(name, nthreads, *args)`` runs kernel ``name`` over ``nthreads`` threads; ``args`` are
    tensors (passed as pointers), ``None`` (a null pointer) or ints (``long long``).
    """

    def __init__(self, launch: Launch, device_type: str = "cuda") -> None:
        self.launch = launch
        self.device_type = device_type

    def _sumsq_to_scale(self, lanes: torch.Tensor, count: int, scale: torch.Tensor) -> None:
        values, n = lanes, lanes.numel()
        while True:
            nout = -(-n // TREE_GROUP)
            out = torch.empty(nout, dtype=torch.float64, device=lanes.device)
            self.launch("onebit_tree_sum", nout, values, n, out, nout, count, scale if nout == 1 else None)
            if nout == 1:
                return
            values, n = out, nout

    @staticmethod
    def _lane_count(n: int) -> int:
        return max(1, -(-n // BLOCK)) * LANES

    def worker_compress_(self, x: torch.Tensor, error: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        n = check_worker(x, error, packed, self.device_type)
        xs, es = flat_float(x), flat_float(error)
        out = byte_rows(packed, output=True)
        scale = torch.empty((), dtype=torch.float32, device=x.device)
        nlanes = self._lane_count(n)
        lanes = torch.empty(nlanes, dtype=torch.float64, device=x.device)
        self.launch("onebit_worker_sumsq", nlanes, xs, es, n, lanes, nlanes)
        self._sumsq_to_scale(lanes, n, scale)
        self.launch("onebit_worker_pack", n // 8, xs, es, n // 8, scale, out.tensor, out.row_len, out.row_stride)
        out.finish_()
        if es.data_ptr() != error.data_ptr():
            error.copy_(es.view(error.shape))
        return scale

    def server_compress_(self, signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor,
                         packed: torch.Tensor) -> torch.Tensor:
        n = check_server(signs, scales, error, packed, self.device_type)
        rows = byte_rows(signs, output=False)
        sc, es = flat_float(scales), flat_float(error)
        nrows = signs.shape[0]
        out = byte_rows(packed, output=True)
        scale = torch.empty((), dtype=torch.float32, device=error.device)
        nlanes = self._lane_count(n)
        lanes = torch.empty(nlanes, dtype=torch.float64, device=error.device)
        self.launch("onebit_server_sumsq", nlanes, rows.tensor, rows.row_stride, sc, nrows, es, n, lanes, nlanes)
        self._sumsq_to_scale(lanes, n, scale)
        self.launch("onebit_server_pack", n // 8, rows.tensor, rows.row_stride, sc, nrows, es, n // 8, scale,
                    out.tensor, out.row_len, out.row_stride)
        out.finish_()
        if es.data_ptr() != error.data_ptr():
            error.copy_(es.view(error.shape))
        return scale

    def decode_(self, signs: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        check_decode(signs, scales, out, self.device_type, keep)
        rows = byte_rows(signs, output=False)
        sc, dst = flat_float(scales), flat_float(out)
        nbytes = signs.shape[0] * signs.shape[1]
        self.launch("onebit_decode", nbytes, rows.tensor, rows.row_stride, signs.shape[1], sc, keep, nbytes, dst)
        if dst.data_ptr() != out.data_ptr():
            out.copy_(dst.view(out.shape))
        return out

    def kernel_set(self, name: str = "cuda") -> KernelSet:
        return KernelSet(name=name, worker_compress_=self.worker_compress_,
                         server_compress_=self.server_compress_, decode_=self.decode_)


def _cupy_stream(cupy: Any, torch_stream: torch.cuda.Stream) -> Any:
    """torch's stream as a CuPy stream (no copy, no synchronization)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy >= 14 (ExternalStream deprecated)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream)


class _CupyLauncher:
    """Launches the RawModule's kernels on torch's current stream of the arguments' device."""

    def __init__(self, cupy: Any, module: Any) -> None:
        import numpy

        self._cupy = cupy
        self._numpy = numpy
        self._module = module
        self._functions: dict[tuple[str, int], Any] = {}

    def _argument(self, value: Any) -> Any:
        np = self._numpy
        if isinstance(value, torch.Tensor):
            return np.uint64(value.data_ptr())
        if value is None:
            return np.uint64(0)
        return np.int64(value)

    def __call__(self, name: str, nthreads: int, *args: Any) -> None:
        if nthreads <= 0:
            return
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        cupy = self._cupy
        with cupy.cuda.Device(device.index):
            function = self._functions.get((name, device.index))
            if function is None:
                function = self._functions[(name, device.index)] = self._module.get_function(name)
            stream = _cupy_stream(cupy, torch.cuda.current_stream(device))
            blocks = -(-nthreads // THREADS_PER_BLOCK)
            with stream:
                function((blocks,), (THREADS_PER_BLOCK,), tuple(self._argument(a) for a in args))


_CODEC: CudaCodec | None = None


def load() -> CudaCodec:
    """Import CuPy, compile the module for the current device, return the codec.

    Raises ImportError (no CuPy, with the install line) or RuntimeError (no GPU, compile error).
    """
    global _CODEC
    if _CODEC is not None:
        return _CODEC
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"the onebit CUDA kernels need CuPy: {INSTALL_HINT} ({exc})") from exc
    if not torch.cuda.is_available():
        raise RuntimeError("the onebit CUDA kernels need a CUDA device; torch.cuda.is_available() is False")
    module = cupy.RawModule(code=kernel_source(), options=NVRTC_OPTIONS)
    try:
        with cupy.cuda.Device(torch.cuda.current_device()):
            for name in KERNEL_NAMES:  # compiles once (cached on disk by CuPy) and checks every entry
                module.get_function(name)
    except Exception as exc:  # CuPy's compile and driver errors do not share a base class
        raise RuntimeError(f"compiling {SOURCE_NAME} with CuPy failed: {exc}") from exc
    _CODEC = CudaCodec(_CupyLauncher(cupy, module))
    logger.debug("onebit: CUDA kernels compiled")
    return _CODEC


register("cuda", lambda: load().kernel_set(), native_for="cuda")
