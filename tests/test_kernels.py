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
import logging
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import onebit.kernels as kernels
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
        def run(*args):
            native.force_scalar(True)
            try:
                return fn(*args)
            finally:
                native.force_scalar(False)
        return run

    return KernelSet("cpu-scalar", scalar(native.worker_compress_), scalar(native.server_compress_),
                     scalar(native.decode_))


def _on_device(impl: KernelSet, device: str) -> KernelSet:
    """Run a device implementation on CPU test tensors: copy in, run, copy results back."""

    def wrap(fn):
        def run(*args):
            moved = [a.to(device) for a in args]
            result = fn(*moved)
            torch.cuda.synchronize()
            for original, dev in zip(args, moved):
                original.copy_(dev.cpu())
            return result.cpu() if result.dim() == 0 else result

        return run

    return KernelSet(impl.name, wrap(impl.worker_compress_), wrap(impl.server_compress_), wrap(impl.decode_))


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
    monkeypatch.setattr(kernels, "_LOADERS", dict(kernels._LOADERS))
    monkeypatch.setattr(kernels, "_NATIVE_FOR_DEVICE", dict(kernels._NATIVE_FOR_DEVICE))
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_FAILED", {})
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)


def test_native_implementations_are_registered():
    assert {"reference", "cpu", "cuda"} <= set(kernels.available_implementations())
    assert kernels._NATIVE_FOR_DEVICE["cpu"] == "cpu"
    assert kernels._NATIVE_FOR_DEVICE["cuda"] == "cuda"


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


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles_the_kernels_without_warnings(arch, tmp_path):
    cmd = [NVCC, f"-arch={arch}", "-ptx", "--Werror", "all-warnings", str(CU_FILE), "-o", str(tmp_path / "k.ptx")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for name in cuda_kernels.KERNEL_NAMES:
        assert f".entry {name}(" in ptx


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
