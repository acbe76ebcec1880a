"""The CUDA path on a GPU: the optimizers on CUDA tensors against the CPU path, and the codec on
torch's streams. Skipped without a CUDA device; ``scripts/gpu_check.sh`` runs it (with the
``cuda`` cases of ``tests/test_kernels.py``, which hold the kernels to the reference bit for bit).

* Each optimizer, with the options that route the codec differently (``overlap_backward``: the
  staged errors, which the CUDA kernels write to ``error_out=``; ``scale_block_size`` with
  momentum masks: many segments and the decode's keep mask; ``compression_space='momentum'``: no
  multiplier), takes the same steps on CUDA
  tensors with the CUDA kernels as with the reference kernels, bit for bit, and as on the CPU
  within float tolerance (torch's CUDA and CPU arithmetic may round differently), through a
  single-rank gloo group here and through 2 gloo ranks sharing the one GPU. (NCCL needs a GPU
  per rank: 2 NCCL ranks on one GPU are not allowed, so the 2-rank run uses gloo.)
* The stages of the compressed all-reduce, staged (new errors aside until ``commit_``) with the
  CUDA kernels, which take ``error_out=``, ``multiplier=`` and ``limit=``, and with those flags
  off (the caller copies, multiplies and clamps in passes of its own), equal the reference's fused
  calls bit for bit.
* The codec launches on torch's current stream and, once it has seen a segment table, never waits
  for the device (``onebit/kernels/cuda.py`` says so): its calls return while the stream is still
  busy, with nothing torch would flag as a synchronization, and give the reference's results.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import pytest
import torch
import torch.distributed as dist

from conftest import short_schedules
from distributed import run_ranks
from onebit import OnebitAdam, OnebitDiLoCo, OnebitLamb, ZeroOneAdam
from onebit.kernels import REFERENCE, get_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: this file runs on a GPU")

SCHEDULES = short_schedules()
STEPS = 10
SHAPES = [(37, 19), (1001,), (8,), (3, 5, 7), (64, 65)]  # odd sizes: every tensor padded on its own
OPTIONS = {
    "default": {},
    "overlap_backward": {"overlap_backward": True},
    "blocks_and_masks": {"scale_block_size": 64, "masks": True},
    "momentum_space": {"compression_space": "momentum"},
}
CLASSES = [OnebitAdam, OnebitLamb, ZeroOneAdam, OnebitDiLoCo]
# CPU and CUDA round some float32 operations differently (fused multiply-adds, the order of
# reductions): a few ulps of drift per step, well inside these over STEPS steps (to be confirmed on
# the first GPU run; the bit-for-bit comparison with the reference kernels is the strict one).
RTOL, ATOL = 1e-5, 1e-6


def _options(cls, name: str) -> dict:
    options = dict(OPTIONS[name])
    if cls is OnebitLamb and "compression_space" in options:
        pytest.skip("OnebitLamb has no compression_space option")
    if cls.__name__ == "OnebitDiLoCo" and ("compression_space" in options or "overlap_backward" in options):
        pytest.skip("OnebitDiLoCo has no compression_space and refuses overlap_backward")
    return options


def _gradients(rank: int, t: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + t)
    return [torch.randn(shape, generator=gen) * (1 + i) for i, shape in enumerate(SHAPES)]


def _train(cls, option_name: str, device: str, kernels: str, rank: int = 0) -> dict:
    """STEPS steps on ``device``; each gradient comes from a backward (so ``overlap_backward``'s
    hooks fire) whose result is exactly the CPU-drawn tensor ``G`` (``d/dp sum(p * G) = G``)."""
    options = _options(cls, option_name)
    masked = options.pop("masks", False)
    torch.manual_seed(0)
    initial = [torch.randn(shape) for shape in SHAPES]
    params = [torch.nn.Parameter(p.clone().to(device)) for p in initial]
    if masked:  # every third element's momentum kept at 0, in each tensor
        options["momentum_masks"] = {
            p: (torch.arange(p.numel()) % 3 != 0).reshape(p.shape).float().to(device) for p in params}
    opt = cls(params, lr=1e-2, kernels=kernels, **SCHEDULES[cls], **options)
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        loss = sum((p * g.to(device)).sum() for p, g in zip(params, _gradients(rank, t)))
        loss.backward()
        opt.step()
    if device != "cpu":
        torch.cuda.synchronize()
    state = {f"{i}.{k}": v.detach().cpu() for i, p in enumerate(params)
             for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    return {"params": [p.detach().cpu() for p in params], "state": state, "initial": initial,
            "identical": opt.replicas_identical}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def _assert_same_bits(a: dict, b: dict, what: str) -> None:
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(_bits(x), _bits(y)), f"{what}: parameter {i} differs"
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        assert torch.equal(_bits(a["state"][key]), _bits(b["state"][key])), f"{what}: state {key} differs"


def _assert_close(cuda: dict, cpu: dict, what: str) -> None:
    for i, (x, y) in enumerate(zip(cuda["params"], cpu["params"])):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: parameter {i}: {m}")
    assert not any(torch.equal(x, x0) for x, x0 in zip(cpu["params"], cpu["initial"])), "a parameter never moved"


@pytest.fixture(scope="module")
def cuda_kernels():
    """The CUDA kernels must load here (CuPy present, NVRTC compiles the module)."""
    pytest.importorskip("cupy", reason="CuPy is not installed: pip install 'onebit[cuda13]'")
    return get_kernels("cuda", "cuda")


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A single-rank gloo group in this process (the optimizers take it as their default group)."""
    store = tmp_path_factory.mktemp("gloo1") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("option_name", list(OPTIONS))
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_cuda_steps_equal_reference_kernels_and_cpu_on_one_rank(cuda_kernels, one_rank_group, cls, option_name):
    assert cuda_kernels.name == "cuda"
    on_cuda = _train(cls, option_name, "cuda", "cuda")
    _assert_same_bits(on_cuda, _train(cls, option_name, "cuda", "reference"), "CUDA kernels vs reference on CUDA")
    _assert_close(on_cuda, _train(cls, option_name, "cpu", "auto"), "CUDA vs CPU")


TWO_RANK_CASES = [(cls, name) for cls in CLASSES for name in ("default", "overlap_backward")
                  if not (cls is OnebitDiLoCo and name == "overlap_backward")]


def _two_ranks(rank: int, world_size: int) -> dict:
    """Each rank, for every case: the same steps on the shared GPU (CUDA kernels, reference kernels)
    and on the CPU. One launch for every case: starting the ranks is most of the time."""
    torch.cuda.set_device(0)
    return {(cls.__name__, name): {kind: _train(cls, name, device, kernels, rank)
                                   for kind, device, kernels in (("cuda", "cuda", "cuda"),
                                                                 ("reference", "cuda", "reference"),
                                                                 ("cpu", "cpu", "auto"))}
            for cls, name in TWO_RANK_CASES}


@pytest.mark.slow
def test_two_gloo_ranks_sharing_the_gpu_equal_reference_kernels_and_cpu(cuda_kernels, tmp_path):
    results = run_ranks(_two_ranks, 2, tmp_path, timeout=240.0)
    for cls, name in TWO_RANK_CASES:
        case = f"{cls.__name__}, {name}"
        for rank, result in enumerate(results):
            got = result[(cls.__name__, name)]
            _assert_same_bits(got["cuda"], got["reference"], f"{case}, rank {rank}: CUDA kernels vs reference")
            _assert_close(got["cuda"], got["cpu"], f"{case}, rank {rank}: CUDA vs CPU")
        first, second = (r[(cls.__name__, name)]["cuda"] for r in results)
        if first["identical"]:  # (0/1 Adam's replicas differ between its syncs)
            for a, b in zip(first["params"], second["params"]):
                assert torch.equal(_bits(a), _bits(b)), f"{case}: the ranks' parameters differ"


def _staged_against_in_place(kernels, reference, device: str, scaled: bool) -> None:
    """Three compressed all-reduces of one buffer over a segment table on one rank: ``kernels``
    staged (new errors aside until ``commit_``), ``reference`` in place; equal bit for bit."""
    from onebit.backends.local import LocalBackend
    from onebit.collectives import CompressionState, finish_, start_server_, start_worker_

    edges = [0, 8 * 5, 8 * 5 + 1024, 8 * 5 + 1024 + 8 * 777]
    backend = LocalBackend()
    staged, in_place = (CompressionState(edges[-1], 1, device, edges) for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randn(edges[-1], generator=gen).to(device)
        multiplier = torch.rand(edges[-1], generator=gen).to(device) if scaled else None
        bound = 0.5 if scaled else None
        expected = x.clone()
        start_worker_(expected, in_place, backend, reference, multiplier=multiplier, bound=bound)
        start_server_(in_place, backend, reference)
        finish_(expected, in_place, reference, multiplier=multiplier)
        errors = staged.worker_error.clone(), staged.server_error.clone()
        got = x.clone()
        start_worker_(got, staged, backend, kernels, staged=True, multiplier=multiplier, bound=bound)
        start_server_(staged, backend, kernels, staged=True)
        finish_(got, staged, kernels, multiplier=multiplier)
        assert torch.equal(_bits(got), _bits(expected)), f"step {step}: output"
        assert torch.equal(_bits(staged.worker_error), _bits(errors[0])), f"step {step}: worker error changed"
        assert torch.equal(_bits(staged.server_error), _bits(errors[1])), f"step {step}: server error changed"
        staged.commit_()
        assert torch.equal(_bits(staged.worker_error), _bits(in_place.worker_error)), f"step {step}: worker error"
        assert torch.equal(_bits(staged.server_error), _bits(in_place.server_error)), f"step {step}: server error"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "caller_passes"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "multiplier_and_bound"])
def test_staged_stages_with_cuda_kernels_equal_the_reference_in_place(cuda_kernels, scaled, fused):
    """The CUDA kernels take ``error_out=`` (overlap_backward's staged errors), ``multiplier=`` and
    ``limit=`` in their own passes; with those flags off the caller does the work (a copy of the
    error updated in place, a multiply and a clamp in passes of their own). Both give the
    reference's fused results, bit for bit."""
    assert cuda_kernels.separate_errors and cuda_kernels.multipliers and cuda_kernels.limits
    kernels = cuda_kernels if fused else dataclasses.replace(cuda_kernels, separate_errors=False, multipliers=False,
                                                             limits=False)
    _staged_against_in_place(kernels, REFERENCE, "cuda", scaled)


# ------------------------------------------------------------------------------------------------
# The codec on torch's streams


def _codec_inputs(n: int, ranks: int, device: str) -> dict:
    """A worker, server and decode call's inputs on ``device``, over a table of three segments."""
    gen = torch.Generator().manual_seed(n)
    unit = 8 * ranks
    bounds = torch.tensor([0, unit * 5, unit * 5 + 1024 * ranks, n], dtype=torch.int64)
    k = bounds.numel() - 1
    return {
        "bounds": bounds,
        "x": torch.randn(n, generator=gen).to(device), "error": (torch.randn(n, generator=gen) * 0.1).to(device),
        "packed": torch.zeros(ranks, n // unit, dtype=torch.uint8, device=device),
        "recv": torch.randint(0, 256, (ranks, n // unit), dtype=torch.uint8, generator=gen).to(device),
        "scales": torch.rand(ranks, k, generator=gen).to(device),
        "server_error": (torch.randn(n // ranks, generator=gen) * 0.1).to(device),
        "server_packed": torch.zeros(n // unit, dtype=torch.uint8, device=device),
        "decoded": torch.zeros(n, device=device),
    }


def _codec_calls(kernels, inputs: dict) -> list[torch.Tensor]:
    """The three operations in a row; returns every output (scales, signs, errors, decoded)."""
    b = inputs["bounds"]
    worker = kernels.worker_compress_(inputs["x"], inputs["error"], inputs["packed"], bounds=b)
    server = kernels.server_compress_(inputs["recv"], inputs["scales"], inputs["server_error"],
                                      inputs["server_packed"], bounds=b)
    kernels.decode_(inputs["recv"], inputs["scales"], inputs["decoded"], bounds=b)
    return [worker, inputs["packed"], inputs["error"], server, inputs["server_packed"], inputs["server_error"],
            inputs["decoded"]]


def _sleep_cycles_for(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds``."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1000.0))


@pytest.mark.parametrize("ranks", [1, 3])
def test_codec_runs_on_the_current_stream_without_waiting(cuda_kernels, ranks):
    """On a side stream that is busy for ~0.5 s before it writes the inputs, the codec's calls return
    at once (no synchronization, none that torch's sync debug mode would flag), and once the stream
    is done the results are the reference's: launched on another stream they would have read the
    inputs before they were written."""
    n = 8 * ranks * 40_000
    expected = _codec_calls(REFERENCE, _codec_inputs(n, ranks, "cuda"))
    inputs = _codec_inputs(n, ranks, "cuda")
    _codec_calls(cuda_kernels, _codec_inputs(n, ranks, "cuda"))  # the first call with a table copies it
    staged = {k: v.clone() for k, v in inputs.items() if k != "bounds"}
    for key, value in inputs.items():  # garbage until the side stream writes the inputs
        if key != "bounds":
            value.fill_(7)
    cycles = _sleep_cycles_for(0.5)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    previous = torch.cuda.get_sync_debug_mode()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        for key, value in staged.items():
            inputs[key].copy_(value)
        torch.cuda.set_sync_debug_mode("error")
        try:
            start = time.perf_counter()
            got = _codec_calls(cuda_kernels, inputs)
            elapsed = time.perf_counter() - start
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        busy = not side.query()
    side.synchronize()
    assert busy and elapsed < 0.25, f"the codec's calls took {elapsed:.3f} s: they waited for the device"
    names = ["worker scales", "worker signs", "worker error", "server scales", "server signs", "server error",
             "decoded"]
    for name, a, b in zip(names, got, expected):
        assert torch.equal(_bits(a), _bits(b)), f"{name} differ from the reference's"


def _diloco_on_cuda(outer_state: str, outer_momentum: float, error_feedback: str, inner=None) -> dict:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device="cuda")) for shape in SHAPES]
    opt = OnebitDiLoCo(params, lr=1e-2, sync_every=3, outer_momentum=outer_momentum, error_feedback=error_feedback,
                       outer_state=outer_state, kernels="cuda", inner=inner)
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        sum((p * g.to("cuda")).sum() for p, g in zip(params, _gradients(0, t))).backward()
        opt.step()
    torch.cuda.synchronize()
    state = {f"{i}.{k}": v.detach().cpu() for i, p in enumerate(params)
             for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    homes = {k: (v.device.type, v.is_pinned()) for k, v in opt.state[params[0]].items() if isinstance(v, torch.Tensor)}
    return {"params": [p.detach().cpu() for p in params], "state": state, "homes": homes}


@pytest.mark.parametrize("error_feedback", ["model", "buffer"])
@pytest.mark.parametrize("outer_momentum", [0.0, 0.9])
def test_diloco_outer_state_on_the_host(cuda_kernels, one_rank_group, outer_momentum, error_feedback):
    """outer_state='host': the global parameters and the outer momentum in pinned host memory, the
    rest on the GPU; the same steps as outer_state='device' (bit for bit without outer momentum,
    whose update then is one subtraction; within float tolerance with it, where the CPU and the GPU
    may round the Nesterov step differently)."""
    host = _diloco_on_cuda("host", outer_momentum, error_feedback)
    device = _diloco_on_cuda("device", outer_momentum, error_feedback)
    outer = {"global_params"} | ({"outer_momentum_buffer"} if outer_momentum > 0 else set())
    assert {k for k, (where, _) in host["homes"].items() if where == "cpu"} == outer
    assert all(pinned for k, (_, pinned) in host["homes"].items() if k in outer)
    assert {where for where, _ in device["homes"].values()} == {"cuda"}
    if outer_momentum == 0:
        _assert_same_bits(host, device, "outer_state host vs device")
    else:
        for i, (x, y) in enumerate(zip(host["params"], device["params"])):
            torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, msg=lambda m: f"parameter {i}: {m}")


@pytest.mark.parametrize("outer_momentum", [0.0, 0.9])
def test_diloco_outer_state_on_the_host_frees_gpu_memory(one_rank_group, outer_momentum):
    """The GPU memory the optimizer's state takes, measured after the first outer step: 4 bytes per
    parameter less with outer_state='host' (8 with outer momentum)."""
    numel = 1 << 22

    def state_bytes(outer_state: str) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        p = torch.nn.Parameter(torch.zeros(numel, device="cuda"))
        before = torch.cuda.memory_allocated()
        opt = OnebitDiLoCo([p], sync_every=1, outer_momentum=outer_momentum, outer_state=outer_state,
                           kernels="reference")
        p.grad = torch.ones_like(p)
        opt.step()
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated() - before
        del opt, p
        return used

    saved = (state_bytes("device") - state_bytes("host")) / numel
    assert saved == pytest.approx(8.0 if outer_momentum > 0 else 4.0, abs=0.05)


def test_diloco_with_an_inner_torch_adamw_on_cuda(cuda_kernels, one_rank_group):
    """inner=torch.optim.AdamW on CUDA tensors takes the built-in fused AdamW's steps (bit for bit
    on the CPU, tests/test_diloco.py; here within float tolerance), its state on the GPU."""
    inner = _diloco_on_cuda("device", 0.9, "model", inner=torch.optim.AdamW)
    built_in = _diloco_on_cuda("device", 0.9, "model")
    for i, (x, y) in enumerate(zip(inner["params"], built_in["params"])):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, msg=lambda m: f"parameter {i}: {m}")
    assert {where for where, _ in inner["homes"].values()} == {"cuda"}
