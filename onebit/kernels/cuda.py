"""CUDA kernels: ``kernels/onebit_kernels.cu`` compiled at run time with CuPy and launched on
torch's current stream.

The ``.cu`` source ships inside the package as ``onebit._cuda_src`` (the top-level ``kernels/``
folder of the repository, mapped in ``pyproject.toml``) and is read with :mod:`importlib.resources`.
CuPy is optional and imported only when these kernels are first wanted
(``pip install "onebit[cuda12]"`` or ``"onebit[cuda13]"``).

Every operation takes a segment table (``bounds``, as in :mod:`onebit.kernels.reference`) and
covers all its segments in the same launches, so the launch count does not grow with the number
of segments. One worker call is ``2 + T`` launches: the lane sums of the blocked sum of squares of
every 1024-element block of every segment (see :mod:`onebit.kernels.blocked`), ``T`` levels of
trees of 32 within each segment (``T = 1 + ceil(log32(B))`` for ``B`` blocks in the largest segment:
1 up to 1,024 elements, 2 up to 32,768, 3 up to 2**20, 4 up to 2**25), the last of which writes
the ``k`` float32 scales into device memory, then the pack and error update, which reads them
there. The server call has the same shape over its chunk; decode is one launch.

The kernels find their way through the segments with small int64 tables (the bounds, a table of
blocks, a table of tree groups per level, see the ``.cu`` file), built on the host once per
distinct segment table and device, copied to the device once and kept in the codec: after the
first call with a table nothing is copied to the device and nothing waits for it (no synchronize,
no ``.item()``); the scales are returned as a ``(k,)`` tensor on the device.

The launch sequence below is written against a ``launch(name, nthreads, *args)`` function, so the
tests run it on the CPU over the same kernel bodies compiled for the host (see the ``.cu`` file).
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch

from .registry import KernelSet, register
from ._layout import (byte_rows, check_bounds, check_decode, check_limit, check_server, check_worker, claimed_segments,
                      flat_float)
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
# -fmad=false: no contraction anywhere; division and square root stay IEEE (NVRTC's defaults
# -prec-div=true, -prec-sqrt=true). CuPy appends -ftz=true to every module's options after these, so
# -ftz=false does not hold: the kernels write their float32 operations as inline PTX without .ftz (see
# the .cu file), and load() checks on the device that subnormals survive.
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


@dataclass(frozen=True)
class _Plan:
    """The device tables of one segment table ``[0, o_1, ..., M]`` over a flat buffer (views into
    one int64 device tensor, copied from the host once)."""

    segments: int  # k
    bounds: torch.Tensor  # (k + 1,) element offsets
    counts: torch.Tensor  # (k,) elements per segment (the scale's divisor)
    blocks: torch.Tensor  # (3 B,) first element, segment end, segment of every 1024-element block
    nblocks: int  # B
    levels: tuple[tuple[torch.Tensor, int], ...]  # per tree level: (2 G,) input ranges [lo, hi), G


def _build_plan(edges: list[int], device: torch.device) -> _Plan:
    """The tables the kernels read for the segment table ``edges`` (see the ``.cu`` file).

    Blocks: segment ``i`` (``n_i`` elements) has ``ceil(n_i / 1024)`` blocks starting at its first
    element, listed segment by segment. Tree levels: level 0 reads the ``32`` lane sums of every
    block (segment ``i``'s ``32 ceil(n_i / 1024)`` values, contiguous); each level cuts every
    segment's values into aligned groups of at most 32 (one group per thread, output ``g`` for group
    ``g``, so the outputs stay grouped by segment) until every segment has a single value: then the
    level has ``k`` groups, group ``i`` being segment ``i``, and writes the scales."""
    e = torch.tensor(edges, dtype=torch.int64)
    k = e.numel() - 1
    seg_ids = torch.arange(k, dtype=torch.int64)
    lens = e[1:] - e[:-1]
    per_seg = (lens + BLOCK - 1) // BLOCK
    block_seg = torch.repeat_interleave(seg_ids, per_seg)
    first_block = torch.cumsum(per_seg, 0) - per_seg
    index = torch.arange(block_seg.numel(), dtype=torch.int64)
    starts = e[:-1][block_seg] + (index - first_block[block_seg]) * BLOCK
    blocks = torch.stack([starts, e[1:][block_seg], block_seg], dim=1).reshape(-1)
    parts, levels = [e, lens, blocks], []
    values = per_seg * LANES  # values per segment at the input of the level
    while True:
        # max(1, ...): an empty segment (only a zero-length buffer has one) still gets its group.
        groups = torch.clamp((values + TREE_GROUP - 1) // TREE_GROUP, min=1)
        offsets = torch.cumsum(values, 0) - values
        group_seg = torch.repeat_interleave(seg_ids, groups)
        first_group = torch.cumsum(groups, 0) - groups
        within = torch.arange(group_seg.numel(), dtype=torch.int64) - first_group[group_seg]
        lo = offsets[group_seg] + within * TREE_GROUP
        hi = offsets[group_seg] + values[group_seg]
        parts.append(torch.stack([lo, hi], dim=1).reshape(-1))
        levels.append(group_seg.numel())
        if group_seg.numel() == k:  # every segment had at most 32 values: one left each
            break
        values = groups
    table = torch.cat(parts).to(device)
    views, at = [], 0
    for part in parts:
        views.append(table[at:at + part.numel()])
        at += part.numel()
    return _Plan(segments=k, bounds=views[0], counts=views[1], blocks=views[2], nblocks=block_seg.numel(),
                 levels=tuple(zip(views[3:], levels)))


class CudaCodec:
    """The codec's three operations as launch sequences over a ``launch`` function.

    ``launch(name, nthreads, *args)`` runs kernel ``name`` over ``nthreads`` threads; ``args`` are
    tensors (passed as pointers), ``None`` (a null pointer) or ints (``long long``).

    The device tables of every segment table seen are kept, keyed by the table's values and the
    device (one entry per distinct table: a training run has one per bucket and buffer size);
    they are never freed, so no kernel still in flight on any stream can read a freed table.
    """

    def __init__(self, launch: Launch, device_type: str = "cuda") -> None:
        self.launch = launch
        self.device_type = device_type
        self._plans: dict[tuple[torch.device, int, tuple[int, ...]], _Plan] = {}

    def _plan(self, edges: list[int], device: torch.device, divisor: int = 1) -> _Plan:
        """The device tables of the segment table ``edges / divisor`` (the server's chunk: ``n``)."""
        key = (device, divisor, tuple(edges))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _build_plan([e // divisor for e in edges], device)
        return plan

    def _scales(self, lanes: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Reduce the lane sums level by level; the last level writes the ``(k,)`` scales."""
        scales = torch.empty(plan.segments, dtype=torch.float32, device=lanes.device)
        values = lanes
        last = len(plan.levels) - 1
        for level, (groups, ngroups) in enumerate(plan.levels):
            out = torch.empty(ngroups, dtype=torch.float64, device=lanes.device)
            self.launch("onebit_tree_sum", ngroups, values, groups, ngroups, out, plan.counts,
                        scales if level == last else None)
            values = out
        return scales

    def worker_compress_(self, x: torch.Tensor, error: torch.Tensor, packed: torch.Tensor, *,
                         bounds: torch.Tensor | None = None, error_out: torch.Tensor | None = None,
                         multiplier: torch.Tensor | None = None, limit: float | None = None) -> torch.Tensor:
        """:func:`onebit.kernels.reference.worker_compress_`: returns the ``(k,)`` scales (on the device)."""
        n = check_worker(x, error, packed, self.device_type)
        check_limit(limit, multiplier)
        target = _error_target(error, error_out, self.device_type)
        ms = _multiplier(multiplier, x, self.device_type, "worker_compress_")
        nrows = packed.shape[0] if packed.dim() == 2 else 1
        _, edges = check_bounds(bounds, n, 8 * nrows, "worker_compress_")
        plan = self._plan(edges, x.device)
        xs, es = flat_float(x), flat_float(error)
        eo = None if target is error else flat_float(target)
        out = byte_rows(packed, output=True)
        lanes = torch.empty(plan.nblocks * LANES, dtype=torch.float64, device=x.device)
        bits = _limit_bits(limit)
        self.launch("onebit_worker_sumsq", plan.nblocks * LANES, xs, ms, bits, es, plan.blocks, plan.nblocks, lanes)
        scales = self._scales(lanes, plan)
        self.launch("onebit_worker_pack", n // 8, xs, ms, bits, es, eo, n // 8, plan.bounds, plan.segments, nrows,
                    scales, out.tensor, out.row_len, out.row_stride)
        out.finish_()
        _copy_back(target, es if eo is None else eo)
        return scales

    def server_compress_(self, signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor,
                         packed: torch.Tensor, *, bounds: torch.Tensor | None = None,
                         error_out: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`onebit.kernels.reference.server_compress_`: returns the ``(k,)`` server scales."""
        n = check_server(signs, scales, error, packed, self.device_type, claimed_segments(bounds))
        target = _error_target(error, error_out, self.device_type)
        nrows = signs.shape[0]
        # The table spans the whole buffer (nrows chunks of n elements); this chunk is cut by bounds / nrows.
        _, edges = check_bounds(bounds, n * nrows, 8 * nrows, "server_compress_")
        plan = self._plan(edges, error.device, nrows)
        rows = byte_rows(signs, output=False)
        sc, es = flat_float(scales), flat_float(error)
        eo = None if target is error else flat_float(target)
        out = byte_rows(packed, output=True)
        lanes = torch.empty(plan.nblocks * LANES, dtype=torch.float64, device=error.device)
        self.launch("onebit_server_sumsq", plan.nblocks * LANES, rows.tensor, rows.row_stride, sc, nrows,
                    plan.segments, es, plan.blocks, plan.nblocks, lanes)
        result = self._scales(lanes, plan)
        self.launch("onebit_server_pack", n // 8, rows.tensor, rows.row_stride, sc, nrows, es, eo, n // 8,
                    plan.bounds, plan.segments, result, out.tensor, out.row_len, out.row_stride)
        out.finish_()
        _copy_back(target, es if eo is None else eo)
        return result

    def decode_(self, signs: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                keep: torch.Tensor | None = None, *, bounds: torch.Tensor | None = None,
                multiplier: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`onebit.kernels.reference.decode_`."""
        check_decode(signs, scales, out, self.device_type, keep, claimed_segments(bounds))
        ms = _multiplier(multiplier, out, self.device_type, "decode_")
        nrows = signs.shape[0]
        _, edges = check_bounds(bounds, out.numel(), 8 * nrows, "decode_")
        plan = self._plan(edges, out.device)
        rows = byte_rows(signs, output=False)
        sc, dst = flat_float(scales), flat_float(out)
        nbytes = signs.shape[0] * signs.shape[1]
        self.launch("onebit_decode", nbytes, rows.tensor, rows.row_stride, sc, nrows, plan.bounds, plan.segments,
                    keep, ms, nbytes, dst)
        _copy_back(out, dst)
        return out

    def kernel_set(self, name: str = "cuda") -> KernelSet:
        return KernelSet(name=name, worker_compress_=self.worker_compress_,
                         server_compress_=self.server_compress_, decode_=self.decode_, separate_errors=True,
                         multipliers=True, limits=True)


def _copy_back(original: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy a kernel's flat output into the caller's tensor where it went through a contiguous copy."""
    if flat.data_ptr() != original.data_ptr():
        original.copy_(flat.view(original.shape))


def _error_target(error: torch.Tensor, error_out: torch.Tensor | None, device_type: str) -> torch.Tensor:
    """Where the new error goes: ``error`` itself, or ``error_out`` (float32, ``error``'s shape and
    device, not overlapping ``error``: the kernel reads one while it writes the other)."""
    if error_out is None or error_out is error:
        return error
    if error_out.shape != error.shape or error_out.dtype != torch.float32 or error_out.device != error.device:
        raise ValueError(f"error_out must be a float32 tensor of shape {tuple(error.shape)} on {error.device} "
                         f"({device_type}), got {error_out.dtype} {tuple(error_out.shape)} on {error_out.device}")
    return error_out


def _multiplier(multiplier: torch.Tensor | None, like: torch.Tensor, device_type: str, what: str) -> torch.Tensor | None:
    """The contiguous float32 tensor to pass for ``multiplier=`` (``like``'s length and device)."""
    if multiplier is None:
        return None
    if multiplier.dtype != torch.float32 or multiplier.device != like.device or multiplier.numel() != like.numel():
        raise ValueError(f"{what}: multiplier must be a float32 {device_type.upper()} tensor of {like.numel()} elements "
                         f"on {like.device}, got {multiplier.dtype} of {multiplier.numel()} elements on "
                         f"{multiplier.device}")
    return flat_float(multiplier)


def _limit_bits(limit: float | None) -> int:
    """The bits of ``limit`` rounded to float32 (as torch's clamp of a float32 tensor rounds it), as the
    kernels take it; no limit is +inf, which clamps nothing."""
    value = torch.tensor(math.inf if limit is None else limit, dtype=torch.float32)
    return int(value.view(torch.int32).item())


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
    codec = CudaCodec(_CupyLauncher(cupy, module))
    _check_subnormals(codec, torch.device("cuda", torch.cuda.current_device()))
    _CODEC = codec
    logger.debug("onebit: CUDA kernels compiled")
    return _CODEC


def _check_subnormals(codec: CudaCodec, device: torch.device) -> None:
    """Run the worker and the decode on values a flush to zero would change, against the reference.

    A compiler flag that flushes subnormals (CuPy adds -ftz=true) turns the sign of a negative
    subnormal into +1 and a negated subnormal scale into -0.0: the kernels would no longer equal the
    reference, silently. A few launches at load time say so instead: the plain worker and decode, then
    both with a multiplier (subnormal products) and the worker with a subnormal limit."""
    x = torch.tensor([-1e-40, 1e-40, -0.0, 0.0, -3e-39, 2.0, -1.0, 1e-45] * 2, dtype=torch.float32)
    error = torch.tensor([0.0, -2e-40, 0.0, -0.0, 1e-39, 0.0, 0.0, -2e-45] * 2, dtype=torch.float32)
    multiplier = torch.tensor([1.0, 0.5, 1.0, 3.0, 1.0, 1.0, 0.75, 1.0] * 2, dtype=torch.float32)
    for fused in (False, True):
        worker = {"multiplier": multiplier, "limit": 2e-39} if fused else {}
        decode = {"multiplier": multiplier} if fused else {}
        if not _equals_reference(codec, device, x, error, worker, decode):
            raise RuntimeError(
                f"the onebit CUDA kernels compiled by CuPy {getattr(sys.modules.get('cupy'), '__version__', '?')} "
                "do not keep subnormal floats (flush to zero): they would differ from the reference; "
                "set ONEBIT_KERNELS=reference (or kernels='reference') and report this")


def _equals_reference(codec: CudaCodec, device: torch.device, x: torch.Tensor, error: torch.Tensor,
                      worker: dict[str, Any], decode: dict[str, Any]) -> bool:
    """Whether a worker and a decode call of ``codec`` (keywords ``worker``, ``decode``: tensors on
    the CPU) give the reference's bits."""
    from . import reference

    def to(kw: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}

    scales = torch.tensor([2.5e-39], dtype=torch.float32)
    exp_error, exp_packed = error.clone(), torch.zeros(1, 2, dtype=torch.uint8)
    exp_scale = reference.worker_compress_(x, exp_error, exp_packed, **worker)
    exp_out = reference.decode_(exp_packed, scales, torch.empty(16), **decode)
    got_error, got_packed = error.to(device), torch.zeros(1, 2, dtype=torch.uint8, device=device)
    got_scale = codec.worker_compress_(x.to(device), got_error, got_packed, **to(worker))
    got_out = codec.decode_(got_packed, scales.to(device), torch.empty(16, device=device), **to(decode))
    got = [t.cpu().view(torch.int32) if t.dtype == torch.float32 else t.cpu()
           for t in (got_scale, got_error, got_packed, got_out)]
    expected = [t.view(torch.int32) if t.dtype == torch.float32 else t
                for t in (exp_scale, exp_error, exp_packed, exp_out)]
    return all(torch.equal(a, b) for a, b in zip(got, expected))


register("cuda", lambda: load().kernel_set(), native_for="cuda")
