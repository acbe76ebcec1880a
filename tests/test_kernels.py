"""Native sign-pack kernels equal the pure-torch reference bit for bit; dispatch; packaging.

Implementations under test (each skips with its reason where it cannot run here):

* ``cpu``: the compiled C++ library (AVX2 where the CPU has it). Must build wherever a C++
  compiler is present.
* ``cpu-scalar``: the same library forced onto its portable scalar paths.
* ``cuda-host``: the CUDA launch sequence of :mod:`onebit.kernels.cuda` run over the kernel bodies
  of ``kernels/onebit_kernels.cu`` compiled for the host with g++ (no GPU needed).
* ``cuda``: the real CUDA kernels through CuPy, on a GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import onebit.kernels as kernels
import onebit.kernels.registry as registry
from onebit.kernels import REFERENCE, KernelSet, get_kernels, reference
from onebit.kernels import cpu as cpu_kernels
from onebit.kernels import cuda as cuda_kernels
from onebit.kernels.blocked import BLOCK, blocked_rms_scale, blocked_sumsq, pairwise_tree_sum

ROOT = Path(__file__).resolve().parents[1]
CU_FILE = ROOT / "kernels" / "onebit_kernels.cu"
HAVE_CXX = cpu_kernels.compiler_command() is not None
GXX = shutil.which("g++") or shutil.which("c++")
NVCC = shutil.which("nvcc")

# Element counts (multiples of 8): one byte; odd byte counts; a whole block (1024) and one byte
# past it; several blocks plus odd bytes; past the 2**18 per-thread minimum, so two threads split.
SIZES = [8, 40, 1016, 1024, 1032, 8 * 1031, 3 * BLOCK * 8 + 24, 2 * 2**18 + 8 * 37]


# ------------------------------------------------------------------------------------------------
# Implementations


def _host_harness(tmp_dir: Path) -> ctypes.CDLL:
    lib_path = tmp_dir / "onebit_kernels_host.so"
    cmd = [GXX, "-x", "c++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off",
           "-shared", "-fPIC", str(CU_FILE), "-o", str(lib_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"host build of {CU_FILE.name} failed:\n{proc.stderr}"
    return ctypes.CDLL(str(lib_path))


def _host_launcher(lib: ctypes.CDLL):
    def arg(value):
        if isinstance(value, torch.Tensor):
            return ctypes.c_void_p(value.data_ptr())
        if value is None:
            return ctypes.c_void_p(0)
        return ctypes.c_longlong(value)

    def launch(name: str, nthreads: int, *args) -> None:
        getattr(lib, f"host_{name}")(ctypes.c_longlong(nthreads), *(arg(a) for a in args))

    return launch


class _Implementations:
    def __init__(self, tmp_dir: Path) -> None:
        self.tmp_dir = tmp_dir
        self.cache: dict[str, KernelSet] = {}

    def get(self, name: str) -> KernelSet:
        if name in self.cache:
            return self.cache[name]
        if name in ("cpu", "cpu-scalar"):
            if not HAVE_CXX:
                pytest.skip("no C++ compiler: the cpu kernels cannot be built here")
            native = cpu_kernels.load()  # with a compiler present this must work
            if name == "cpu":
                impl = native.kernel_set()
            else:
                impl = _scalar_kernel_set(native)
        elif name == "cuda-host":
            if GXX is None:
                pytest.skip("no g++: cannot build the host harness of the CUDA kernels")
            impl = cuda_kernels.CudaCodec(_host_launcher(_host_harness(self.tmp_dir)), "cpu").kernel_set("cuda-host")
        elif name == "cuda":
            if not torch.cuda.is_available():
                pytest.skip("no CUDA device: the real CUDA kernels run only on a GPU")
            try:
                impl = get_kernels("cuda", "cuda")
            except ImportError as exc:
                pytest.skip(f"CuPy is not installed: {exc}")
            impl = _on_device(impl, "cuda")
        else:
            raise AssertionError(name)
        self.cache[name] = impl
        return impl


def _scalar_kernel_set(native) -> KernelSet:
    def scalar(fn):
        def run(*args, **kwargs):
            native.force_scalar(True)
            try:
                return fn(*args, **kwargs)
            finally:
                native.force_scalar(False)
        return run

    return dataclasses.replace(native.kernel_set(), name="cpu-scalar", worker_compress_=scalar(native.worker_compress_),
                               server_compress_=scalar(native.server_compress_), decode_=scalar(native.decode_))


def _on_device(impl: KernelSet, device: str) -> KernelSet:
    """Run a device implementation on CPU test tensors: copy in, run, copy results back (segment
    tables, keyword ``bounds``, stay on the host; the other tensor keywords, ``error_out=`` and
    ``multiplier=``, travel like the positional tensors)."""

    def wrap(fn):
        def run(*args, **kwargs):
            moved = [None if a is None else a.to(device) for a in args]
            keywords = {k: v.to(device) if isinstance(v, torch.Tensor) and k != "bounds" else v
                        for k, v in kwargs.items()}
            result = fn(*moved, **keywords)
            torch.cuda.synchronize()
            pairs = [*zip(args, moved), *((kwargs[k], keywords[k]) for k in kwargs if k != "bounds")]
            for original, dev in pairs:
                if isinstance(original, torch.Tensor):
                    original.copy_(dev.cpu())
            for original, dev in zip(args, moved):
                if result is dev:
                    return original
            return result.cpu()

        return run

    return dataclasses.replace(impl, worker_compress_=wrap(impl.worker_compress_),
                               server_compress_=wrap(impl.server_compress_), decode_=wrap(impl.decode_))


@pytest.fixture(scope="module")
def implementations(tmp_path_factory) -> _Implementations:
    return _Implementations(tmp_path_factory.mktemp("kernels"))


IMPLEMENTATIONS = ["cpu", "cpu-scalar", "cuda-host", "cuda"]


# ------------------------------------------------------------------------------------------------
# Inputs and comparison


def _values(n: int, seed: int) -> torch.Tensor:
    """Normal values of mixed magnitude with zeros, -0.0, subnormals and large values sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e30, -3e30, 1e-20, -0.0])
    idx = torch.randint(0, n, (max(1, n // 16),), generator=g)
    v[idx] = special[torch.randint(0, len(special), idx.shape, generator=g)]
    return v


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.dtype == torch.float32:
        equal = torch.equal(_bits(actual.contiguous()), _bits(expected.contiguous()))
    else:
        equal = torch.equal(actual, expected)
    if not equal:
        diff = (actual.reshape(-1) != expected.reshape(-1)).nonzero()[:5].reshape(-1).tolist()
        raise AssertionError(f"{what} differs from the reference at {diff}")


def _wire(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, cols + 4), dtype=torch.uint8, generator=g)


# ------------------------------------------------------------------------------------------------
# Bit-exactness


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_worker_matches_reference(implementations, name, n, ranks):
    impl = implementations.get(name)
    if n % (8 * ranks):
        n += 8 * ranks - n % (8 * ranks)
    x, error = _values(n, 1), _values(n, 2) * 0.1
    cols = n // 8 // ranks
    exp_error, exp_wire = error.clone(), _wire(ranks, cols, 3)
    got_error, got_wire = error.clone(), exp_wire.clone()
    exp_scale = reference.worker_compress_(x, exp_error, exp_wire[:, :cols])
    got_scale = impl.worker_compress_(x, got_error, got_wire[:, :cols])  # strided rows of the wire
    assert_bitwise_equal(got_scale, exp_scale, "scale")
    assert_bitwise_equal(got_wire, exp_wire, "packed signs (and the bytes around them)")
    assert_bitwise_equal(got_error, exp_error, "worker error")


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_server_matches_reference(implementations, name, n, ranks):
    impl = implementations.get(name)
    cols = n // 8
    recv = _wire(ranks, cols, 4)
    g = torch.Generator().manual_seed(5)
    scales = torch.rand(ranks, generator=g) * 3
    if ranks > 1:
        scales[1] = 0.0  # a zero scale gives +-0.0 terms: the signs of zeros must match too
    error = _values(n, 6) * 0.1
    exp_error, got_error = error.clone(), error.clone()
    exp_out, got_out = _wire(1, cols, 7)[0], _wire(1, cols, 7)[0]
    exp_scale = reference.server_compress_(recv[:, :cols], scales, exp_error, exp_out[:cols])
    got_scale = impl.server_compress_(recv[:, :cols], scales, got_error, got_out[:cols])
    assert_bitwise_equal(got_scale, exp_scale, "server scale")
    assert_bitwise_equal(got_out, exp_out, "server packed signs")
    assert_bitwise_equal(got_error, exp_error, "server error")


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_decode_matches_reference(implementations, name, n, ranks):
    impl = implementations.get(name)
    cols = n // 8
    gathered = _wire(ranks, cols, 8)
    scales = torch.tensor([0.75, 0.0, 2.5e-39][:ranks])  # includes zero and a subnormal scale
    expected = torch.full((ranks * n,), 7.0)
    got = expected.clone()
    reference.decode_(gathered[:, :cols], scales, expected)
    impl.decode_(gathered[:, :cols], scales, got)
    assert_bitwise_equal(got, expected, "decoded output")
    # With a packed keep mask: +0.0 where its bit is clear, the same values elsewhere.
    keep = torch.randint(0, 256, (ranks * cols,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    masked_expected, masked_got = torch.full_like(expected, 7.0), torch.full_like(got, 7.0)
    reference.decode_(gathered[:, :cols], scales, masked_expected, keep)
    impl.decode_(gathered[:, :cols], scales, masked_got, keep)
    assert_bitwise_equal(masked_got, masked_expected, "decoded output with a keep mask")
    cleared = reference.unpack_signs(keep) < 0
    assert torch.equal(masked_expected[~cleared], expected[~cleared])
    assert torch.all(masked_expected[cleared].view(torch.int32) == 0)  # +0.0, not -0.0


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_compressed_allreduce_matches_reference_over_steps(implementations, name):
    """Three ranks, several steps with error feedback: the whole pipeline stays bit-identical."""
    impl = implementations.get(name)
    from onebit.collectives import CompressionState
    from onebit.compression import chunk_bytes, read_scales, write_scale_

    ranks, padded = 3, 8 * 3 * 700
    states = {k: [CompressionState(padded, ranks, "cpu") for _ in range(ranks)] for k in ("ref", "impl")}
    for step in range(4):
        inputs = [_values(padded, 100 * step + r) for r in range(ranks)]
        results = {}
        for key, ks in (("ref", REFERENCE), ("impl", impl)):
            st = states[key]
            signs = chunk_bytes(padded, ranks)
            for r in range(ranks):  # worker phase; the all-to-all moves rows between ranks
                write_scale_(st[r].send, ks.worker_compress_(inputs[r], st[r].worker_error, st[r].send[:, :signs]))
            for j in range(ranks):
                for r in range(ranks):
                    st[j].recv[r].copy_(st[r].send[j])
            for j in range(ranks):  # server phase; the all-gather
                scale = ks.server_compress_(st[j].recv[:, :signs], read_scales(st[j].recv), st[j].server_error,
                                            st[j].gather_in[:signs])
                write_scale_(st[j].gather_in.view(1, -1), scale)
            out = torch.empty(padded)
            gathered = torch.stack([st[j].gather_in for j in range(ranks)])
            ks.decode_(gathered[:, :signs], read_scales(gathered), out)
            results[key] = out
        assert_bitwise_equal(results["impl"], results["ref"], f"step {step} output")
        for r in range(ranks):
            assert_bitwise_equal(states["impl"][r].worker_error, states["ref"][r].worker_error, "worker error")
            assert_bitwise_equal(states["impl"][r].server_error, states["ref"][r].server_error, "server error")


@pytest.mark.parametrize("name", ["cpu", "cpu-scalar", "cuda-host"])
def test_other_layouts_go_through_temporaries(implementations, name):
    """Column-strided or non-contiguous tensors are handled (through copies), not mis-addressed."""
    impl = implementations.get(name)
    n = 8 * 130
    x_store, e_store = _values(2 * n, 9), _values(2 * n, 10)
    x, error = x_store[::2], e_store[::2]  # non-contiguous views
    exp_error, exp_packed = error.clone(), torch.zeros(n // 8, dtype=torch.uint8)
    packed_store = torch.zeros(2 * (n // 8), dtype=torch.uint8)
    exp_scale = reference.worker_compress_(x, exp_error, exp_packed)
    got_scale = impl.worker_compress_(x, error, packed_store[::2])
    assert_bitwise_equal(got_scale, exp_scale, "scale")
    assert_bitwise_equal(error, exp_error, "error written back into the strided view")
    assert torch.equal(packed_store[::2], exp_packed) and not packed_store[1::2].any()
    # (n, C) rows with a column stride, and a segment table: chunk j of each segment still lands in row j.
    bounds = _bounds([24, 24 * 5, BLOCK * 3, 24 * 3])
    total, cols = int(bounds[-1]), int(bounds[-1]) // 24
    x, error = _values(total, 13), _values(total, 14)
    exp_error, exp_packed = error.clone(), torch.zeros(3, cols, dtype=torch.uint8)
    packed_store = torch.zeros(3, 2 * cols, dtype=torch.uint8)
    exp_scales = reference.worker_compress_(x, exp_error, exp_packed, bounds=bounds)
    got_scales = impl.worker_compress_(x, error, packed_store[:, ::2], bounds=bounds)
    assert_bitwise_equal(got_scales, exp_scales, "segment scales")
    assert_bitwise_equal(error, exp_error, "error")
    assert torch.equal(packed_store[:, ::2], exp_packed) and not packed_store[:, 1::2].any()


# ------------------------------------------------------------------------------------------------
# Segment tables: one scale per segment, chunk j of every segment in wire row j


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _segment_lengths(kind: str, ranks: int) -> list[int]:
    """Segment lengths in elements (multiples of ``8 ranks``) of a named segment table."""
    unit = 8 * ranks
    if kind == "one":  # one segment of 8 blocks and a partial one (on the worker)
        return [unit * 1031]
    if kind == "mixed":  # smaller than a block; exactly a block on the worker, on the server; spanning blocks
        # with a partial last one; one past the per-thread minimum, so that threads split inside it
        return [unit, _round_up(BLOCK, unit), BLOCK * ranks, unit * 5, 3 * BLOCK * ranks + unit * 7, unit * 3,
                _round_up(2 * 2**18 + unit * 37, unit), unit, 2 * BLOCK * ranks]
    if kind == "many":  # 1,000 small segments of mixed sizes, most of them a partial block
        return [unit * (1 + (i * 37) % 151) for i in range(1000)]
    raise AssertionError(kind)


def _bounds(lengths: list[int]) -> torch.Tensor:
    edges = [0]
    for length in lengths:
        edges.append(edges[-1] + length)
    return torch.tensor(edges, dtype=torch.int64)


def _scale_bytes_(rows: torch.Tensor, scales: torch.Tensor) -> None:
    """Write ``k`` float32 scales into the last ``4 k`` bytes of every row (as on the wire)."""
    raw = scales.reshape(-1).contiguous().view(torch.uint8)
    rows[:, -raw.numel():].copy_(raw.expand(rows.shape[0], raw.numel()))


def _read_scale_bytes(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The ``(n, k)`` float32 scales in the last ``4 k`` bytes of each row."""
    return rows[:, -4 * k:].contiguous().view(torch.float32).reshape(rows.shape[0], k)


TABLES = ["one", "mixed", "many"]


@dataclass(frozen=True)
class _Case:
    """Inputs of one operation over a segment table and the reference's results (never modified)."""

    bounds: torch.Tensor
    cols: int
    inputs: tuple
    expected: tuple


@functools.lru_cache(maxsize=None)
def _worker_case(table: str, ranks: int) -> _Case:
    """x, error and an (n, C + 4k) wire buffer; expected scales, wire and error."""
    lengths = _segment_lengths(table, ranks)
    bounds, total, k = _bounds(lengths), sum(lengths), len(lengths)
    cols = total // 8 // ranks
    x, error, wire = _values(total, 21), _values(total, 22) * 0.1, _wire(ranks, cols + 4 * k - 4, 23)
    exp_error, exp_wire = error.clone(), wire.clone()
    exp_scales = reference.worker_compress_(x, exp_error, exp_wire[:, :cols], bounds=bounds)
    return _Case(bounds, cols, (x, error, wire), (exp_scales, exp_wire, exp_error))


@functools.lru_cache(maxsize=None)
def _server_case(table: str, ranks: int) -> _Case:
    """Received rows, (n, k) scales with zeros, the server error and an output row with room for the
    scales; expected scales, output row and error."""
    lengths = _segment_lengths(table, ranks)
    bounds, total, k = _bounds(lengths), sum(lengths), len(lengths)
    cols = total // 8 // ranks
    recv = _wire(ranks, cols + 4 * k - 4, 24)
    scales = torch.rand(ranks, k, generator=torch.Generator().manual_seed(25)) * 3
    scales[-1, ::3] = 0.0  # zero scales give +-0.0 terms: the signs of zeros must match too
    error, out = _values(total // ranks, 26) * 0.1, _wire(1, cols + 4 * k - 4, 27)[0]
    exp_error, exp_out = error.clone(), out.clone()
    exp_scales = reference.server_compress_(recv[:, :cols], scales, exp_error, exp_out[:cols], bounds=bounds)
    return _Case(bounds, cols, (recv, scales, error, out), (exp_scales, exp_out, exp_error))


@functools.lru_cache(maxsize=None)
def _decode_case(table: str, ranks: int) -> _Case:
    """Gathered rows, (n, k) scales with zeros and subnormals, a keep mask; expected outputs without
    and with the mask."""
    lengths = _segment_lengths(table, ranks)
    bounds, total, k = _bounds(lengths), sum(lengths), len(lengths)
    cols = total // 8 // ranks
    gathered = _wire(ranks, cols + 4 * k - 4, 28)
    g = torch.Generator().manual_seed(29)
    scales = torch.rand(ranks, k, generator=g) * 2
    scales[0, ::5] = 0.0
    scales[-1, 1::7] = 2.5e-39  # subnormal
    keep = torch.randint(0, 256, (total // 8,), dtype=torch.uint8, generator=g)
    expected = reference.decode_(gathered[:, :cols], scales, torch.full((total,), 7.0), bounds=bounds)
    masked = reference.decode_(gathered[:, :cols], scales, torch.full((total,), 7.0), keep, bounds=bounds)
    return _Case(bounds, cols, (gathered, scales, keep), (expected, masked))


def _check_worker(impl: KernelSet, case: _Case, what: str = "") -> None:
    (x, error, wire), (exp_scales, exp_wire, exp_error) = case.inputs, case.expected
    got_error, got_wire = error.clone(), wire.clone()
    got_scales = impl.worker_compress_(x, got_error, got_wire[:, :case.cols], bounds=case.bounds)  # strided rows
    assert exp_scales.shape == (case.bounds.numel() - 1,)
    assert_bitwise_equal(got_scales, exp_scales, "segment scales" + what)
    assert_bitwise_equal(got_wire, exp_wire, "packed signs (and the bytes around them)" + what)
    assert_bitwise_equal(got_error, exp_error, "worker error" + what)


def _check_server(impl: KernelSet, case: _Case, what: str = "") -> None:
    (recv, scales, error, out), (exp_scales, exp_out, exp_error) = case.inputs, case.expected
    got_error, got_out = error.clone(), out.clone()
    got_scales = impl.server_compress_(recv[:, :case.cols], scales, got_error, got_out[:case.cols], bounds=case.bounds)
    assert exp_scales.shape == (case.bounds.numel() - 1,)
    assert_bitwise_equal(got_scales, exp_scales, "server segment scales" + what)
    assert_bitwise_equal(got_out, exp_out, "server packed signs (and the bytes after them)" + what)
    assert_bitwise_equal(got_error, exp_error, "server error" + what)


def _check_decode(impl: KernelSet, case: _Case, what: str = "") -> None:
    (gathered, scales, keep), (expected, masked) = case.inputs, case.expected
    got = impl.decode_(gathered[:, :case.cols], scales, torch.full_like(expected, 7.0), bounds=case.bounds)
    assert_bitwise_equal(got, expected, "decoded output" + what)
    got = impl.decode_(gathered[:, :case.cols], scales, torch.full_like(expected, 7.0), keep, bounds=case.bounds)
    assert_bitwise_equal(got, masked, "decoded output with a keep mask" + what)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_worker_with_segments_matches_reference(implementations, name, table, ranks):
    _check_worker(implementations.get(name), _worker_case(table, ranks))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_server_with_segments_matches_reference(implementations, name, table, ranks):
    impl = implementations.get(name)
    case = _server_case(table, ranks)
    _check_server(impl, case)
    # The scales may also come flat, (n * k,), as read off the wire.
    recv, scales, error, out = case.inputs
    flat = _Case(case.bounds, case.cols, (recv, scales.reshape(-1), error, out), case.expected)
    _check_server(impl, flat, " (flat input scales)")


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_decode_with_segments_matches_reference(implementations, name, table, ranks):
    _check_decode(implementations.get(name), _decode_case(table, ranks))
    expected, masked = _decode_case(table, ranks).expected
    cleared = reference.unpack_signs(_decode_case(table, ranks).inputs[2]) < 0
    assert torch.equal(masked[~cleared], expected[~cleared])
    assert torch.all(masked[cleared].view(torch.int32) == 0)  # +0.0, not -0.0


def test_segment_order_on_the_wire_is_the_defined_one():
    """The reference's layout, spelled out: chunk j of segment i in row j at byte o_i / (8 n), with
    the segment's own scale; decode puts it back at o_i + j L_i."""
    ranks, lengths = 2, [16, 48]
    bounds = _bounds(lengths)
    x = torch.cat([torch.full((16,), 2.0), -torch.ones(48)])
    x[3] = -2.0  # segment 0, chunk 0, byte 0, bit 3
    x[16 + 24 + 9] = 1.0  # segment 1, chunk 1, its byte 1, bit 1
    packed = torch.zeros(ranks, 4, dtype=torch.uint8)
    scales = reference.worker_compress_(x, torch.zeros(64), packed, bounds=bounds)
    assert scales.tolist() == [2.0, 1.0]
    assert packed.tolist() == [[0b11101111, 0, 0, 0], [0xff, 0, 0b01000000, 0]]
    out = torch.empty(64)
    reference.decode_(packed, torch.tensor([[1.0, 3.0], [5.0, 7.0]]), out, bounds=bounds)
    assert out[:8].tolist() == [1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0] and out[8:16].tolist() == [5.0] * 8
    assert out[16:40].tolist() == [-3.0] * 24 and out[40 + 9].item() == 7.0 and out[40 + 8].item() == -7.0


@pytest.mark.parametrize("name", ["cpu", "cpu-scalar"])
@pytest.mark.parametrize("table", ["mixed", "many"])
def test_cpu_segments_do_not_depend_on_the_thread_count(implementations, name, table):
    """Threads split the list of all segments' blocks and bytes anywhere, also inside segments."""
    impl = implementations.get(name)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            _check_worker(impl, _worker_case(table, 2), f" ({threads} threads)")
            _check_server(impl, _server_case(table, 2), f" ({threads} threads)")
            _check_decode(impl, _decode_case(table, 2), f" ({threads} threads)")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["cpu", "cpu-scalar"])
def test_cpu_streaming_decode_with_segments(implementations, name):
    """Outputs from 64 MiB on are written with streaming stores (AVX2), segment by segment."""
    impl = implementations.get(name)
    ranks, pieces = 2, 1000
    lengths = [_round_up(2**24 // pieces, 16) + 16 * (i % 3) for i in range(pieces)]
    bounds, total = _bounds(lengths), sum(lengths)
    assert total * 4 >= 64 << 20
    gathered = _wire(ranks, total // 16, 34)[:, :total // 16]
    scales = torch.rand(ranks, pieces, generator=torch.Generator().manual_seed(35))
    keep = torch.randint(0, 256, (total // 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(36))
    for mask in (None, keep):
        expected = reference.decode_(gathered, scales, torch.empty(total), mask, bounds=bounds)
        got = impl.decode_(gathered, scales, torch.full((total,), 7.0), mask, bounds=bounds)
        assert_bitwise_equal(got, expected, "streamed output" + (" with a keep mask" if mask is not None else ""))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_compressed_allreduce_with_segments_matches_reference_over_steps(implementations, name):
    """Three ranks, several steps with error feedback, a bucket of mixed segments with one scale each
    on the wire: the whole pipeline stays bit-identical."""
    impl = implementations.get(name)
    ranks = 3
    lengths = [24, 24 * 43, 24 * 130, BLOCK * 3, 24 * 3, 24 * 700]
    bounds, total, k = _bounds(lengths), sum(lengths), len(lengths)
    cols = total // 8 // ranks
    state = {}
    for key in ("ref", "impl"):
        state[key] = [dict(worker=torch.zeros(total), server=torch.zeros(total // ranks),
                           send=torch.zeros(ranks, cols + 4 * k, dtype=torch.uint8),
                           recv=torch.zeros(ranks, cols + 4 * k, dtype=torch.uint8),
                           gather=torch.zeros(cols + 4 * k, dtype=torch.uint8)) for _ in range(ranks)]
    for step in range(4):
        inputs = [_values(total, 200 * step + r) for r in range(ranks)]
        results = {}
        for key, ks in (("ref", REFERENCE), ("impl", impl)):
            st = state[key]
            for r in range(ranks):  # worker phase; the all-to-all moves rows between ranks
                scales = ks.worker_compress_(inputs[r], st[r]["worker"], st[r]["send"][:, :cols], bounds=bounds)
                _scale_bytes_(st[r]["send"], scales)
            for j in range(ranks):
                for r in range(ranks):
                    st[j]["recv"][r].copy_(st[r]["send"][j])
            for j in range(ranks):  # server phase; the all-gather
                recv = st[j]["recv"]
                scales = ks.server_compress_(recv[:, :cols], _read_scale_bytes(recv, k), st[j]["server"],
                                             st[j]["gather"][:cols], bounds=bounds)
                _scale_bytes_(st[j]["gather"].view(1, -1), scales)
            gathered = torch.stack([st[j]["gather"] for j in range(ranks)])
            out = torch.empty(total)
            ks.decode_(gathered[:, :cols], _read_scale_bytes(gathered, k), out, bounds=bounds)
            results[key] = out
        assert_bitwise_equal(results["impl"], results["ref"], f"step {step} output")
        for r in range(ranks):
            assert_bitwise_equal(state["impl"][r]["worker"], state["ref"][r]["worker"], "worker error")
            assert_bitwise_equal(state["impl"][r]["server"], state["ref"][r]["server"], "server error")
            assert_bitwise_equal(state["impl"][r]["send"], state["ref"][r]["send"], "wire rows with their scales")


BAD_TABLES = [
    ([8, 48], r"bounds must run from 0 to 48, got 8 \.\. 48"),
    ([0, 16, 32], r"bounds must run from 0 to 48, got 0 \.\. 32"),
    ([0, 24, 48], r"every segment must be a positive multiple of 16 elements, got \[\(0, 24\), \(24, 48\)\]"),
    ([0, 16, 16, 48], r"every segment must be a positive multiple of 16 elements, got \[\(16, 16\)\]"),
]


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["worker", "server", "decode"])
@pytest.mark.parametrize("edges, message", BAD_TABLES)
def test_bad_segment_tables_are_refused(implementations, name, op, edges, message):
    """48 elements over 2 ranks: segments must be multiples of 16 and cover 0 .. 48."""
    impl = implementations.get(name)
    bounds = torch.tensor(edges, dtype=torch.int64)
    k = max(len(edges) - 1, 1)
    signs = torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        if op == "worker":
            impl.worker_compress_(torch.zeros(48), torch.zeros(48), signs, bounds=bounds)
        elif op == "server":
            impl.server_compress_(signs, torch.ones(2, k), torch.zeros(24), torch.zeros(3, dtype=torch.uint8),
                                  bounds=bounds)
        else:
            impl.decode_(signs, torch.ones(2, k), torch.zeros(48), bounds=bounds)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_segment_table_and_scales_of_the_wrong_kind_are_refused(implementations, name):
    impl = implementations.get(name)
    signs = torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bounds must be a 1-d int64 CPU tensor"):
        impl.worker_compress_(torch.zeros(48), torch.zeros(48), signs, bounds=torch.tensor([0.0, 48.0]))
    with pytest.raises(ValueError, match=r"scales must be float32 with 4 elements \(2 ranks x 2 segments\)"):
        impl.server_compress_(signs, torch.ones(2), torch.zeros(24), torch.zeros(3, dtype=torch.uint8),
                              bounds=torch.tensor([0, 16, 48]))
    with pytest.raises(ValueError, match=r"scales must be float32 with 4 elements \(2 ranks x 2 segments\)"):
        impl.decode_(signs, torch.ones(2, 3), torch.zeros(48), bounds=torch.tensor([0, 16, 48]))


# ------------------------------------------------------------------------------------------------
# The blocked sum of squares (the scale's definition in the native kernels)


def test_blocked_sum_is_the_defined_order():
    b = _values(BLOCK * 3 + 40, 11)
    sq = b.double().square().tolist() + [0.0] * (BLOCK - 40)
    lanes = []
    for k in range(4):
        for lane in range(32):
            acc = 0.0
            for j in range(32):
                acc += sq[k * BLOCK + 32 * j + lane]
            lanes.append(acc)
    while len(lanes) > 1:
        lanes = [lanes[i] + lanes[i + 1] if i + 1 < len(lanes) else lanes[i] for i in range(0, len(lanes), 2)]
    assert blocked_sumsq(b).item() == lanes[0]
    assert pairwise_tree_sum(torch.tensor([1.0, 2.0, 4.0])).item() == 7.0


@pytest.mark.parametrize("n", [1, 31, 1024, 1025, 5000, 2**19 + 3])
def test_cpu_sum_of_squares_equals_blocked_definition_for_any_thread_count(n):
    if not HAVE_CXX:
        pytest.skip("no C++ compiler")
    native = cpu_kernels.load()
    b = _values(n, 12)
    expected = blocked_sumsq(b).item()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for scalar in (False, True):
                native.force_scalar(scalar)
                assert native.sumsq(b) == expected, (threads, scalar)
    finally:
        native.force_scalar(False)
        torch.set_num_threads(before)


def test_blocked_scale_agrees_with_torch_sum_on_random_inputs():
    """torch's own float64 sum has no fixed order; rounded to float32 the two scales agree."""
    for seed in range(20):
        b = _values(4096 + 8 * seed, 100 + seed)
        assert_bitwise_equal(blocked_rms_scale(b), reference.rms_scale(b), f"scale (seed {seed})")


# ------------------------------------------------------------------------------------------------
# Dispatch


@pytest.fixture
def fresh_registry(monkeypatch):
    """Isolate the dispatch caches so that a test can register failing implementations."""
    monkeypatch.setattr(registry, "_LOADERS", dict(registry._LOADERS))
    monkeypatch.setattr(registry, "_NATIVE_FOR_DEVICE", dict(registry._NATIVE_FOR_DEVICE))
    monkeypatch.setattr(registry, "_LOADED", {})
    monkeypatch.setattr(registry, "_FAILED", {})
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)


def test_native_implementations_are_registered():
    assert {"reference", "cpu", "cuda"} <= set(kernels.available_implementations())
    assert registry._NATIVE_FOR_DEVICE["cpu"] == "cpu"
    assert registry._NATIVE_FOR_DEVICE["cuda"] == "cuda"


def test_auto_falls_back_to_reference_with_one_log_line(fresh_registry, caplog):
    cause = RuntimeError("no C++ compiler found (test)")

    def failing():
        raise cause

    kernels.register("cpu", failing, native_for="cpu")
    with caplog.at_level(logging.INFO, logger="onebit.kernels"):
        assert get_kernels("cpu") is REFERENCE
        assert get_kernels("cpu", "auto") is REFERENCE
    lines = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(lines) == 1 and "no C++ compiler found (test)" in lines[0].getMessage()


def test_explicit_unavailable_implementation_raises_the_original_cause(fresh_registry):
    cause = RuntimeError("compiling the onebit CPU kernels failed (test)")

    def failing():
        raise cause

    kernels.register("cpu", failing, native_for="cpu")
    with pytest.raises(RuntimeError) as info:
        get_kernels("cpu", "cpu")
    assert info.value is cause
    with pytest.raises(RuntimeError) as again:  # the failure is remembered, not retried
        get_kernels("cpu", "cpu")
    assert again.value is cause


def test_unknown_implementation_lists_the_valid_names(fresh_registry):
    with pytest.raises(ValueError, match=r"unknown kernel implementation 'avx'; expected one of 'auto', 'cpu', "
                                         r"'cuda', 'reference'"):
        get_kernels("cpu", "avx")


def test_environment_variable_selects_the_implementation(fresh_registry, monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert get_kernels("cpu") is REFERENCE
    monkeypatch.setenv(kernels.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="unknown kernel implementation 'nope'"):
        get_kernels("cpu")


def test_auto_picks_the_cpu_kernels_when_a_compiler_is_present(fresh_registry):
    if not HAVE_CXX:
        pytest.skip("no C++ compiler")
    assert get_kernels("cpu").name == "cpu"


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        cpu_kernels.build()


def test_compile_errors_carry_the_compiler_output(monkeypatch, tmp_path):
    if GXX is None:
        pytest.skip("no g++")
    monkeypatch.setattr(cpu_kernels, "_source", lambda: b"this is not C++;\n")
    with pytest.raises(RuntimeError, match="compiling the onebit CPU kernels failed") as info:
        cpu_kernels.build(tmp_path)
    assert "error" in str(info.value)


def test_cuda_kernels_without_cupy_name_the_extra(fresh_registry):
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r'pip install "onebit\[cuda12\]".*"onebit\[cuda13\]"'):
            get_kernels("cuda", "cuda")
    else:
        if torch.cuda.is_available():
            pytest.skip("CuPy and a GPU are present: the CUDA kernels load")
        with pytest.raises(RuntimeError, match="CUDA device"):
            get_kernels("cuda", "cuda")


def test_cpu_kernels_refuse_tensors_of_another_device(implementations):
    impl = implementations.get("cpu")
    x = torch.zeros(16, device="meta")
    with pytest.raises(ValueError, match="run on 'cpu' tensors"):
        impl.worker_compress_(x, x.clone(), torch.zeros(2, dtype=torch.uint8))
    signs = torch.zeros(2, 1, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="run on 'cpu' tensors"):
        impl.server_compress_(signs, torch.ones(2), torch.zeros(8), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="run on 'cpu' tensors"):
        impl.decode_(signs, torch.ones(2), torch.zeros(16))


def test_native_kernels_refuse_tensors_of_another_device(implementations):
    impl = implementations.get("cuda-host")  # a CUDA codec that believes it runs on "cpu"
    codec = cuda_kernels.CudaCodec(lambda *a: None, "cuda")
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="run on 'cuda' tensors"):
        codec.worker_compress_(x, x.clone(), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 8"):
        impl.worker_compress_(torch.zeros(12), torch.zeros(12), torch.zeros(1, dtype=torch.uint8))


def test_cupy_launcher_uses_torchs_current_stream_and_typed_arguments(monkeypatch):
    """The CuPy glue, with CuPy and the GPU replaced by recorders: grid, block, argument types, the
    stream context (torch's current stream) and no synchronization."""
    import types

    import numpy as np

    events = []

    class Context:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            events.append(("enter", self.name))

        def __exit__(self, *exc):
            events.append(("exit", self.name))

    class Function:
        def __call__(self, grid, block, args, **kwargs):
            events.append(("launch", grid, block, args))

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda index: Context(f"device{index}"),
        Stream=types.SimpleNamespace(),  # no from_external: the ExternalStream path
        ExternalStream=lambda ptr: Context(f"stream{ptr}"),
        runtime=types.SimpleNamespace(deviceSynchronize=lambda: events.append("synchronize")),
    ))
    module = types.SimpleNamespace(get_function=lambda name: Function())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=77))
    launch = cuda_kernels._CupyLauncher(fake_cupy, module)

    class FakeDevice:
        index = 0

    tensor = torch.zeros(4)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: FakeDevice()), raising=False)
    launch("onebit_decode", 1000, tensor, 5, None)
    monkeypatch.undo()
    assert events[:2] == [("enter", "device0"), ("enter", "stream77")]
    kind, grid, block, args = events[2]
    assert (kind, grid, block) == ("launch", (4,), (256,))
    assert [type(a) for a in args] == [np.uint64, np.int64, np.uint64]
    assert int(args[0]) == tensor.data_ptr() and int(args[1]) == 5 and int(args[2]) == 0
    assert events[3:] == [("exit", "stream77"), ("exit", "device0")] and "synchronize" not in events


def test_importing_onebit_compiles_nothing_and_imports_no_cupy():
    code = (
        "import sys, onebit, onebit.kernels.cpu as c, onebit.kernels.cuda as g; "
        "assert c._KERNELS is None and g._CODEC is None; "
        "assert 'cupy' not in sys.modules; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ------------------------------------------------------------------------------------------------
# CUDA sources: nvcc, and the package data


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles_the_kernels_without_warnings(arch, tmp_path):
    cmd = [NVCC, f"-arch={arch}", "-ptx", "--Werror", "all-warnings", str(CU_FILE), "-o", str(tmp_path / "k.ptx")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for name in cuda_kernels.KERNEL_NAMES:
        assert f".entry {name}(" in ptx


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_device_code_never_flushes_subnormals_even_under_ftz(tmp_path):
    """CuPy compiles every module with -ftz=true appended after onebit's options (seen on an H200 with
    CuPy 14.2: negative subnormals packed as +1, negated subnormal scales decoded as -0.0). Built the
    same way, the PTX must hold no flushing instruction: every float32 operation is inline PTX."""
    cmd = [NVCC, "-arch=sm_90", "-ptx", *cuda_kernels.NVRTC_OPTIONS[1:], "-ftz=true", str(CU_FILE),
           "-o", str(tmp_path / "k.ptx")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    flushing = [line.strip() for line in ptx.splitlines() if ".ftz" in line]
    assert flushing == []
    for op in ("add.rn.f32", "sub.rn.f32", "mul.rn.f32", "div.rn.f32", "cvt.f64.f32", "cvt.rn.f32.f64"):
        assert op in ptx, op


def test_subnormal_check_passes_the_kernel_bodies_and_catches_a_flush(implementations, monkeypatch):
    """The load-time check of the CUDA kernels, run over the host build of the same bodies: it passes
    them, and it refuses a codec that flushes subnormals to zero as -ftz=true code does."""
    if GXX is None:
        pytest.skip("no g++: cannot build the host harness of the CUDA kernels")
    codec = cuda_kernels.CudaCodec(_host_launcher(_host_harness(implementations.tmp_dir)), "cpu")
    cuda_kernels._check_subnormals(codec, torch.device("cpu"))

    def flush(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t.abs() < torch.finfo(torch.float32).tiny, t * 0.0, t)

    worker = codec.worker_compress_
    monkeypatch.setattr(codec, "worker_compress_", lambda x, error, packed, **kw: worker(flush(x), error, packed, **kw))
    with pytest.raises(RuntimeError, match="flush to zero.*ONEBIT_KERNELS=reference"):
        cuda_kernels._check_subnormals(codec, torch.device("cpu"))


def test_pyproject_lists_every_subpackage():
    """Packages are listed by hand in pyproject.toml (to map kernels/); none may be forgotten."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "onebit").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert config["package-dir"]["onebit._cuda_src"] == "kernels"


def _can_build_without_isolation() -> bool:
    """setuptools >= 70.1 builds wheels by itself; older ones need the wheel package."""
    try:
        import setuptools
    except ImportError:
        return False
    version = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
    if version >= (70, 1):
        return True
    try:
        import wheel  # noqa: F401
    except ImportError:
        return False
    return version >= (68, 0)


@pytest.mark.slow
def test_installed_wheel_ships_the_kernel_sources(tmp_path):
    """Build a wheel from a copy of the tree, install it into a target folder and find the
    sources through importlib.resources from another working directory."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.cfg"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for folder in ("onebit", "kernels"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip"]
    build = [*pip, "wheel", str(src), "--no-deps", "-q", "-w", str(wheels)]
    if _can_build_without_isolation():
        build.append("--no-build-isolation")
    else:  # e.g. a fresh Python 3.11 venv (setuptools 65, no wheel): pip fetches the build requirements
        env.pop("PIP_NO_INDEX")
    proc = subprocess.run(build, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = wheels.glob("onebit-*.whl")
    install = [*pip, "install", "--no-deps", "-q", "--target", str(target), str(wheel)]
    proc = subprocess.run(install, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import importlib.resources as r, onebit, onebit.kernels.cuda as g; "
        "assert onebit.__file__.startswith(sys.argv[1]), onebit.__file__; "
        "cu = r.files('onebit._cuda_src').joinpath('onebit_kernels.cu'); "
        "cpp = r.files('onebit.kernels').joinpath('cpu_kernels.cpp'); "
        "assert cu.is_file() and cpp.is_file(); "
        "assert g.kernel_source() == cu.read_text(); "
        "print(len(cu.read_text()))"
    )
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    proc = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120,
                          cwd=run_dir)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == len(CU_FILE.read_text())


FUSING = ["reference", "cpu", "cpu-scalar", "cuda-host", "cuda"]  # the implementations that take the keywords


@pytest.mark.parametrize("name", FUSING)
@pytest.mark.parametrize("ranks", [1, 3])
def test_error_out_writes_the_new_error_there_and_leaves_the_error(implementations, name, ranks):
    """The staged stages of ``overlap_backward``: ``error_out=`` gives the in-place results
    bit for bit, in another buffer, and ``error`` is untouched."""
    impl = REFERENCE if name == "reference" else implementations.get(name)
    assert impl.separate_errors
    n = 8 * ranks * 37
    bounds = torch.tensor([0, 8 * ranks * 5, n], dtype=torch.int64)
    x, error = _values(n, 11), _values(n, 12) * 0.1
    in_place, kept, out = error.clone(), error.clone(), torch.full_like(error, 7.0)
    wire_a, wire_b = _wire(ranks, n // 8 // ranks, 13), _wire(ranks, n // 8 // ranks, 13)
    cols = n // 8 // ranks
    scale_a = impl.worker_compress_(x, in_place, wire_a[:, :cols], bounds=bounds)
    scale_b = impl.worker_compress_(x, kept, wire_b[:, :cols], bounds=bounds, error_out=out)
    assert_bitwise_equal(scale_b, scale_a, "worker scales")
    assert_bitwise_equal(wire_b, wire_a, "worker signs")
    assert_bitwise_equal(out, in_place, "new worker error")
    assert_bitwise_equal(kept, error, "worker error left as it was")

    chunk = n // ranks
    recv = _wire(ranks, chunk // 8, 14)
    scales = torch.rand(ranks * 2, generator=torch.Generator().manual_seed(15))
    server_error = _values(chunk, 16) * 0.1
    in_place, kept, out = server_error.clone(), server_error.clone(), torch.full_like(server_error, 7.0)
    packed_a, packed_b = _wire(1, chunk // 8, 17)[0], _wire(1, chunk // 8, 17)[0]
    scale_a = impl.server_compress_(recv[:, :chunk // 8], scales, in_place, packed_a[:chunk // 8], bounds=bounds)
    scale_b = impl.server_compress_(recv[:, :chunk // 8], scales, kept, packed_b[:chunk // 8], bounds=bounds,
                                    error_out=out)
    assert_bitwise_equal(scale_b, scale_a, "server scales")
    assert_bitwise_equal(packed_b, packed_a, "server signs")
    assert_bitwise_equal(out, in_place, "new server error")
    assert_bitwise_equal(kept, server_error, "server error left as it was")


@pytest.mark.parametrize("name", FUSING)
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_multiplier_equals_multiplying_in_a_pass_of_its_own(implementations, name, ranks, masked):
    """``compression_space="preconditioned"``'s fused passes: ``multiplier=`` on the worker gives
    what compressing ``x * multiplier`` gives, and on the decode what decoding and then
    multiplying gives, bit for bit (scales, signs, errors, output), with and without a keep mask."""
    impl = REFERENCE if name == "reference" else implementations.get(name)
    reference_impl = REFERENCE
    n = 8 * ranks * 41
    bounds = torch.tensor([0, 8 * ranks * 7, n], dtype=torch.int64)
    x, error = _values(n, 21), _values(n, 22) * 0.1
    multiplier = _values(n, 23).abs()
    multiplier[::13] = 0.0  # 1 / d is 0 where the momentum is kept 0
    multiplier[1::11] *= -1  # (not from an optimizer) a cleared keep bit gives +0.0, where q s m would be -0.0
    cols = n // 8 // ranks
    exp_error, exp_wire = error.clone(), _wire(ranks, cols, 24)
    got_error, got_wire = error.clone(), exp_wire.clone()
    exp_scales = reference_impl.worker_compress_(x * multiplier, exp_error, exp_wire[:, :cols], bounds=bounds)
    got_scales = impl.worker_compress_(x, got_error, got_wire[:, :cols], bounds=bounds, multiplier=multiplier)
    assert_bitwise_equal(got_scales, exp_scales, "worker scales")
    assert_bitwise_equal(got_wire, exp_wire, "worker signs")
    assert_bitwise_equal(got_error, exp_error, "worker error")

    signs = _wire(ranks, cols, 25)
    scales = torch.rand(ranks * 2, generator=torch.Generator().manual_seed(26))
    keep = _wire(1, n // 8, 27)[0, :n // 8].contiguous() if masked else None
    expected = reference_impl.decode_(signs[:, :cols], scales, torch.empty(n), bounds=bounds).mul_(multiplier)
    if keep is not None:  # decoded, multiplied, then +0.0 where a keep bit is clear
        expected.masked_fill_(reference.unpack_signs(keep) < 0, 0.0)
    got = impl.decode_(signs[:, :cols], scales, torch.full((n,), 7.0), keep, bounds=bounds, multiplier=multiplier)
    assert_bitwise_equal(got, expected, "decoded times the multiplier")


@pytest.mark.parametrize("name", FUSING)
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("limit", [0.1, 0.7, 1e30, 1e-39])
def test_limit_equals_clamping_in_a_pass_of_its_own(implementations, name, ranks, limit):
    """``update_bound``'s fused clamp: ``limit=`` with ``multiplier=`` gives what compressing
    ``(x * multiplier).clamp(-limit, limit)`` gives, bit for bit (0.1 is not a float32: the clamp
    rounds it to float32 as torch's does); 1e30 clamps nothing, 1e-39 (a subnormal) nearly everything."""
    impl = REFERENCE if name == "reference" else implementations.get(name)
    n = 8 * ranks * 41
    bounds = torch.tensor([0, 8 * ranks * 7, n], dtype=torch.int64)
    x, error = _values(n, 31) * 3, _values(n, 32) * 0.1
    multiplier = _values(n, 33).abs()
    multiplier[::13] = 0.0
    x[5] = -0.0
    x[6], x[7] = float("inf"), float("-inf")  # clamped to +-limit (their multipliers are not 0)
    multiplier[6:8] = 1.0
    cols = n // 8 // ranks
    product = x * multiplier
    clamped = product.clamp(-limit, limit)
    assert not torch.equal(clamped, product)  # the clamp has work to do (the infinities, at least)
    exp_error, exp_wire = error.clone(), _wire(ranks, cols, 34)
    got_error, got_wire = error.clone(), exp_wire.clone()
    exp_scales = REFERENCE.worker_compress_(clamped, exp_error, exp_wire[:, :cols], bounds=bounds)
    got_scales = impl.worker_compress_(x, got_error, got_wire[:, :cols], bounds=bounds, multiplier=multiplier,
                                       limit=limit)
    assert_bitwise_equal(got_scales, exp_scales, "worker scales")
    assert_bitwise_equal(got_wire, exp_wire, "worker signs")
    assert_bitwise_equal(got_error, exp_error, "worker error")


@pytest.mark.parametrize("name", FUSING)
@pytest.mark.parametrize("limit, match", [(0.0, "limit must be a number > 0"), (-1.0, "limit must be a number > 0"),
                                          (1e39, "that float32 holds"), (float("nan"), "limit must be a number > 0"),
                                          (True, "limit must be a number > 0"), (1.0, "give a multiplier with it")])
def test_a_bad_limit_is_refused(implementations, name, limit, match):
    impl = REFERENCE if name == "reference" else implementations.get(name)
    n = 64
    multiplier = None if match.startswith("give") else torch.ones(n)
    with pytest.raises(ValueError, match=match):
        impl.worker_compress_(torch.zeros(n), torch.zeros(n), torch.zeros(1, n // 8, dtype=torch.uint8),
                              multiplier=multiplier, limit=limit)


@pytest.mark.parametrize("name", ["cpu", "cuda-host", "cuda"])
def test_multiplier_and_error_out_of_the_wrong_kind_are_refused(implementations, name):
    impl = implementations.get(name)
    n = 64
    match = "multiplier must be a float32 (or bfloat16 )?(CPU|CUDA) tensor of 64 elements"
    with pytest.raises(ValueError, match=match):
        impl.worker_compress_(torch.zeros(n), torch.zeros(n), torch.zeros(1, n // 8, dtype=torch.uint8),
                              multiplier=torch.ones(n - 8))
    with pytest.raises(ValueError, match=match):
        impl.decode_(torch.zeros(1, n // 8, dtype=torch.uint8), torch.ones(1), torch.empty(n),
                     multiplier=torch.ones(n, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"error_out must be a float32 .*tensor of shape \(64,\)"):
        impl.worker_compress_(torch.zeros(n), torch.zeros(n), torch.zeros(1, n // 8, dtype=torch.uint8),
                              error_out=torch.zeros(n - 8))
    with pytest.raises(ValueError, match=r"error_out must be a float32 .*tensor of shape \(8,\)"):
        impl.server_compress_(torch.zeros(1, 1, dtype=torch.uint8), torch.ones(1), torch.zeros(8),
                              torch.zeros(1, dtype=torch.uint8), error_out=torch.zeros(8, dtype=torch.float64))


@pytest.mark.parametrize("name", FUSING)
def test_a_nan_product_is_not_clamped(implementations, name):
    """torch's clamp keeps a NaN: the fused clamp must not turn it into +-limit. A NaN product
    makes its segment's scale and errors NaN and codes as +1; the other segment is untouched.
    (Compared NaN for NaN: the bits of a NaN differ between CPUs and GPUs.)"""
    impl = REFERENCE if name == "reference" else implementations.get(name)
    n = 64
    bounds = torch.tensor([0, 32, n], dtype=torch.int64)
    x, error, multiplier = _values(n, 41), _values(n, 42) * 0.1, _values(n, 43).abs() + 0.5
    x[3], x[40] = float("nan"), float("-inf")
    multiplier[40] = 0.0  # -inf * 0 is NaN too
    exp_error, exp_wire = error.clone(), torch.zeros(1, n // 8, dtype=torch.uint8)
    exp_scales = REFERENCE.worker_compress_((x * multiplier).clamp(-0.5, 0.5), exp_error, exp_wire, bounds=bounds)
    got_error, got_wire = error.clone(), torch.zeros(1, n // 8, dtype=torch.uint8)
    got_scales = impl.worker_compress_(x, got_error, got_wire, bounds=bounds, multiplier=multiplier, limit=0.5)
    assert exp_scales.isnan().all() and exp_error.isnan().all()  # (the oracle: both segments hold a NaN)
    assert got_scales.isnan().all() and got_error.isnan().all()
    assert_bitwise_equal(got_wire, exp_wire, "worker signs")
    x[40], multiplier[40] = 1.0, 1.0  # the second segment without its NaN: as the reference, bit for bit
    exp_error, got_error = error.clone(), error.clone()
    exp_scales = REFERENCE.worker_compress_((x * multiplier).clamp(-0.5, 0.5), exp_error, exp_wire, bounds=bounds)
    got_scales = impl.worker_compress_(x, got_error, got_wire, bounds=bounds, multiplier=multiplier, limit=0.5)
    assert got_scales[0].isnan() and got_error[:32].isnan().all() and exp_scales[0].isnan()
    assert_bitwise_equal(got_scales[1:], exp_scales[1:], "scale of the segment without a NaN")
    assert_bitwise_equal(got_error[32:], exp_error[32:], "errors of the segment without a NaN")
    assert_bitwise_equal(got_wire, exp_wire, "worker signs")


def test_the_collectives_hand_the_cuda_kernels_their_keywords(implementations):
    """With the CUDA kernel set (here its launch sequence over the host build of the kernel bodies),
    the compressed all-reduce passes ``error_out=``, ``multiplier=`` and ``limit=`` to the kernels
    instead of doing a copy, a multiply and a clamp in passes of its own, and its staged stages give
    the reference's in-place results bit for bit."""
    from onebit.backends.local import LocalBackend
    from onebit.collectives import CompressionState, finish_, start_server_, start_worker_

    impl = implementations.get("cuda-host")
    assert impl.separate_errors and impl.multipliers and impl.limits
    calls = []

    def record(op, fn):
        def run(*args, **kwargs):
            calls.append((op, sorted(k for k, v in kwargs.items() if v is not None and k != "bounds")))
            return fn(*args, **kwargs)
        return run

    kernels = dataclasses.replace(impl, worker_compress_=record("worker", impl.worker_compress_),
                                  server_compress_=record("server", impl.server_compress_),
                                  decode_=record("decode", impl.decode_))
    edges = [0, 8 * 5, 8 * 5 + 1024, 8 * 5 + 1024 + 8 * 777]
    backend = LocalBackend()
    staged, in_place = (CompressionState(edges[-1], 1, "cpu", edges) for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        x, multiplier = torch.randn(edges[-1], generator=gen), torch.rand(edges[-1], generator=gen)
        expected, got = x.clone(), x.clone()
        start_worker_(expected, in_place, backend, REFERENCE, multiplier=multiplier, bound=0.5)
        start_server_(in_place, backend, REFERENCE)
        finish_(expected, in_place, REFERENCE, multiplier=multiplier)
        start_worker_(got, staged, backend, kernels, staged=True, multiplier=multiplier, bound=0.5)
        start_server_(staged, backend, kernels, staged=True)
        finish_(got, staged, kernels, multiplier=multiplier)
        staged.commit_()
        assert_bitwise_equal(got, expected, f"step {step}: output")
        assert_bitwise_equal(staged.worker_error, in_place.worker_error, f"step {step}: worker error")
        assert_bitwise_equal(staged.server_error, in_place.server_error, f"step {step}: server error")
    assert calls == [("worker", ["error_out", "limit", "multiplier"]), ("server", ["error_out"]),
                     ("decode", ["multiplier"])] * 2
