"""The distributed compressed all-reduce against the single-process oracle, on real gloo ranks.

A bucket holds several tensors, each a segment (or, with ``scale_block_size``, several) with its
own scales: the gloo ranks run ``compressed_allreduce_`` with the segment table of
:class:`onebit.compression.SegmentLayout` and must equal ``simulate_compressed_allreduce(...,
numels=...)`` bit for bit, in two collective calls whatever the number of segments.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from conftest import bit_equal
from distributed import run_ranks
from onebit.backends.torch_dist import TorchDistBackend
from onebit.backends.base import COMPLETED
from onebit.collectives import AllreduceState, CompressionState, compressed_allreduce_
from onebit.compression import SegmentLayout, padded_length, row_bytes
from onebit.kernels import REFERENCE, get_kernels
from onebit.testing import simulate_compressed_allreduce

NUMEL = 1000  # not a multiple of 8 n: exercises padding
ROUNDS = 6
# name -> (numels, scale_block_size). Sizes 1 and 48 (a multiple of 8 n for n = 2 and 3, so no
# padding), the others not multiples of 8 n; "blocks" cuts 300 and 1000 into blocks of 112 or
# 120 (100 rounded up to a multiple of 8 n); "many" is 80 segments.
LAYOUTS = {
    "one tensor": ([NUMEL], None),
    "tensors": ([1, 7, 48, 100, 333, 511], None),
    "blocks": ([300, 5, 1000, 1, 48], 100),
    "many": ([1, 2, 3, 5, 8] * 16, None),
}
KERNELS = ["reference", "cpu"]  # "cpu": the native CPU kernels (or the reference where they do not load)


def _inputs(world_size: int, rounds: int, numels: list[int]) -> list[list[torch.Tensor]]:
    """inputs[t][i]: rank i's flat buffer (the tensors end to end) in round t: a common drift plus
    per-rank noise, each tensor at its own magnitude (1e-2, 1, 1e2, ...) so the scales differ."""
    gen = torch.Generator().manual_seed(1234)
    magnitude = torch.cat([torch.full((numel,), 10.0 ** (t % 3 - 1)) for t, numel in enumerate(numels)])
    drift = torch.randn(sum(numels), generator=gen)
    return [[(drift + torch.randn(sum(numels), generator=gen)) * magnitude for _ in range(world_size)]
            for _ in range(rounds)]


class CountingBackend(TorchDistBackend):
    """The gloo transport, recording every collective call with the bytes it sends."""

    def __init__(self) -> None:
        super().__init__(expected="gloo")
        self.calls: list[tuple[str, int]] = []

    def _count(name):
        def method(self, output, *args):
            tensor = args[0] if args else output
            self.calls.append((name, tensor.numel() * tensor.element_size()))
            return getattr(TorchDistBackend, name)(self, output, *args)
        return method

    all_reduce_mean_ = _count("all_reduce_mean_")
    all_to_all = _count("all_to_all")
    all_gather = _count("all_gather")
    start_all_to_all = _count("start_all_to_all")
    start_all_gather = _count("start_all_gather")
    del _count


def _rank_rounds(rank: int, world_size: int, rounds: int) -> dict:
    """Every layout and kernel set in one process group: ``ROUNDS`` compressed all-reduces each."""
    results = {}
    for name, (numels, block) in LAYOUTS.items():
        layout = SegmentLayout.build(numels, world_size, block)
        for kernels_name in KERNELS:
            kernels = REFERENCE if kernels_name == "reference" else get_kernels("cpu")
            backend = CountingBackend()
            # One segment: the default table (no edges), as for a bucket of one tensor.
            edges = None if layout.segments == 1 else layout.edges
            state = CompressionState(layout.padded, world_size, "cpu", edges)
            out = {"buffers": [], "outputs": [], "worker_errors": [], "server_errors": [], "calls": []}
            for inputs in _inputs(world_size, rounds, numels):
                buffer, offset = torch.zeros(layout.padded), 0
                for place in layout.slices():
                    buffer[place] = inputs[rank][offset:offset + place.stop - place.start]
                    offset += place.stop - place.start
                before = len(backend.calls)
                compressed_allreduce_(buffer, state, backend, kernels)
                out["calls"].append(backend.calls[before:])
                out["buffers"].append(buffer.clone())
                out["outputs"].append(torch.cat([buffer[place] for place in layout.slices()]))
                out["worker_errors"].append(state.worker_error.clone())
                out["server_errors"].append(state.server_error.clone())
            results[name, kernels_name] = out
    return results


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """``gloo_results(n)``: the results of :func:`_rank_rounds` on ``n`` gloo ranks (one launch per
    world size for every layout and kernel set)."""
    cache = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_ranks(_rank_rounds, world_size, tmp_path_factory.mktemp(f"gloo{world_size}"), ROUNDS)
        return cache[world_size]
    return get


@functools.lru_cache(maxsize=None)
def _oracle(world_size: int, layout_name: str) -> list:
    """The oracle's ``ROUNDS`` results for a layout (shared by the kernel sets)."""
    numels, block = LAYOUTS[layout_name]
    sims, worker_errors, server_errors = [], None, None
    for inputs in _inputs(world_size, ROUNDS, numels):
        sim = simulate_compressed_allreduce(inputs, worker_errors, server_errors, numels=numels, scale_block_size=block)
        worker_errors, server_errors = sim.worker_errors, sim.server_errors
        sims.append(sim)
    return sims


@pytest.mark.slow
@pytest.mark.parametrize("kernels_name", KERNELS)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_matches_oracle_and_is_identical_on_every_rank(gloo_results, world_size, layout_name, kernels_name):
    numels, block = LAYOUTS[layout_name]
    layout = SegmentLayout.build(numels, world_size, block)
    if layout_name == "one tensor":
        assert layout.padded == padded_length(NUMEL, world_size) and layout.segments == 1
    else:
        assert layout.segments > len(numels) if block else layout.segments == len(numels)
    results = [result[layout_name, kernels_name] for result in gloo_results(world_size)]
    n, k = world_size, layout.segments
    for t, sim in enumerate(_oracle(world_size, layout_name)):
        # The whole padded result the oracle implies: chunk j of segment i is server j's signs
        # times its scale of segment i.
        expected = torch.zeros(layout.padded)
        for i, (lo, hi) in enumerate(zip(layout.edges[:-1], layout.edges[1:])):
            chunk = (hi - lo) // n
            for j in range(n):
                part = slice(lo + j * chunk, lo + (j + 1) * chunk)
                expected[part] = sim.server_scales[j, i] * sim.server_signs[part]
        for rank, result in enumerate(results):
            # Every rank holds exactly the same bytes, padding slots included.
            assert bit_equal(result["buffers"][t], results[0]["buffers"][t])
            # Worker and server errors determine the signs and scales sent: they match exactly.
            assert bit_equal(result["worker_errors"][t], sim.worker_errors[rank])
            assert bit_equal(result["server_errors"][t], sim.server_errors[rank])
            # Two collectives, one row of signs and k scales per rank, whatever k.
            row = row_bytes(layout.padded, n, k)
            assert row == layout.padded // (8 * n) + 4 * k
            assert result["calls"][t] == [("start_all_to_all", n * row), ("start_all_gather", row)]
        assert bit_equal(results[0]["outputs"][t], sim.output)
        assert bit_equal(results[0]["buffers"][t], expected)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_segments_have_scales_of_their_own_on_the_wire(gloo_results, world_size):
    """The tensors of a bucket (inputs at magnitudes 1e-2, 1, 1e2) come back at their own
    magnitudes: one shared scale would flatten them."""
    numels, block = LAYOUTS["tensors"]
    out = gloo_results(world_size)[0]["tensors", "reference"]["outputs"][0]
    offsets = torch.tensor([0, *numels]).cumsum(0).tolist()
    for t, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        size = out[lo:hi].abs().max().item()
        assert 0.1 * 10.0 ** (t % 3 - 1) < size < 10 * 10.0 ** (t % 3 - 1), (t, size)


@pytest.mark.parametrize("world_size, padded, edges", [
    (2, 48, [16, 48]),  # does not start at 0
    (2, 48, [0, 16, 32]),  # does not end at padded
    (2, 48, [0, 16, 32, 64]),  # runs past padded
    (2, 48, [0, 8, 48]),  # a segment of 8 elements: not a multiple of 8 n = 16
    (3, 96, [0, 32, 96]),  # 32: a multiple of 8 n for n = 2, not for n = 3
    (2, 48, [0, 16, 16, 48]),  # an empty segment
    (2, 48, [0, 32, 16, 48]),  # edges going back
    (2, 48, [48]),  # one edge: no segment
    (2, 48, []),
])
def test_compression_state_rejects_bad_edges(world_size, padded, edges):
    message = (f"segment edges must run from 0 to {padded} in steps that are positive multiples of {8 * world_size} "
               "(use onebit.compression.SegmentLayout)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        CompressionState(padded, world_size, "cpu", edges)


def test_compression_state_takes_a_layout_and_sizes_its_wire_rows():
    layout = SegmentLayout.build([1, 7, 48, 100], 3, None)
    assert layout.edges == (0, 24, 48, 96, 216)
    state = CompressionState(layout.padded, 3, "cpu", layout.edges)
    assert state.segments == 4 and state.bounds.tolist() == list(layout.edges)
    assert state.send.shape == state.recv.shape == state.gather_out.shape == (3, 216 // 24 + 4 * 4)
    assert state.worker_error.shape == (216,) and state.server_error.shape == (72,)
    # Without edges: one segment, and the length must follow the padding rule.
    assert CompressionState(216, 3, "cpu").segments == 1
    message = "buffer length 200 is not padded for world size 3; use onebit.compression.padded_length (here 216)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        CompressionState(200, 3, "cpu")


def test_oracle_output_is_a_scaled_sign_per_server_chunk():
    inputs = [torch.randn(64) for _ in range(2)]
    sim = simulate_compressed_allreduce(inputs)
    assert set(sim.output[:32].abs().unique().tolist()) == {sim.server_scales[0].item()}
    assert set(sim.output[32:].abs().unique().tolist()) == {sim.server_scales[1].item()}


def test_error_feedback_keeps_the_running_sum_honest():
    """sum_t out_t = sum_t mean_i x_i^t - mean_i e_w,i^T - e_s^T exactly (errors start at zero), and
    the errors stay bounded, so the running mean of outputs converges to the true running mean.
    Without error feedback the bias of the running sum grows linearly."""
    world_size, numel, rounds = 3, 240, 300
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(numel, generator=gen) * (1 + i) for i in range(world_size)]
    worker_errors = server_errors = None
    total_out = torch.zeros(numel, dtype=torch.float64)
    total_true = torch.zeros(numel, dtype=torch.float64)
    total_no_feedback = torch.zeros(numel, dtype=torch.float64)
    max_error = 0.0
    for _ in range(rounds):
        inputs = [b + 0.3 * torch.randn(numel, generator=gen) for b in base]
        sim = simulate_compressed_allreduce(inputs, worker_errors, server_errors)
        worker_errors, server_errors = sim.worker_errors, sim.server_errors
        total_out += sim.output.double()
        total_true += torch.stack(inputs).double().mean(0)
        total_no_feedback += simulate_compressed_allreduce(inputs).output.double()
        max_error = max(max_error, max(e.norm().item() for e in worker_errors + server_errors))
    mean_worker = torch.stack(worker_errors).double().mean(0)[:numel]
    server = torch.cat(server_errors).double()[:numel]
    identity_gap = (total_out - (total_true - mean_worker - server)).norm().item()
    assert identity_gap < 1e-6 * total_true.norm().item() * rounds ** 0.5 + 1e-3
    deviation = (total_out - total_true).norm().item()
    input_norm = max(b.norm().item() for b in base)
    # Errors stay below a few input norms after 300 rounds: bounded, not growing.
    assert max_error < 4 * input_norm
    # Relative deviation of the running sum: below 2 % with feedback; without it the bias is large.
    assert deviation / total_true.norm().item() < 0.02
    assert (total_no_feedback - total_true).norm().item() > 10 * deviation


def test_pipeline_stages_out_of_order_raise_and_leave_the_errors_alone():
    from onebit.backends import LocalBackend
    from onebit.collectives import finish_, start_server_, start_worker_
    from onebit.kernels import REFERENCE

    backend, state = LocalBackend(), CompressionState(8, 1, "cpu")
    buffer = torch.arange(8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="last stage was no stage .*; call start_worker_ first"):
        start_server_(state, backend, REFERENCE)
    with pytest.raises(RuntimeError, match="call start_server_ first"):
        finish_(buffer, state, REFERENCE)
    assert torch.equal(state.worker_error, torch.zeros(8)) and torch.equal(state.server_error, torch.zeros(8))
    start_worker_(buffer, state, backend, REFERENCE)
    with pytest.raises(RuntimeError, match="last stage was start_worker_; call start_server_ first"):
        finish_(buffer, state, REFERENCE)
    start_server_(state, backend, REFERENCE)
    finish_(buffer, state, REFERENCE)
    expected = torch.arange(8, dtype=torch.float32)
    compressed_allreduce_(expected, CompressionState(8, 1, "cpu"), backend)
    assert torch.equal(buffer, expected)


class _Exact(AllreduceState):
    """A third topology in a few lines: one rank, full precision (its mean is its input)."""

    def __init__(self, padded: int) -> None:
        super().__init__(padded, 1, [0, padded])
        self.worker_error, self.server_error = torch.zeros(padded), torch.zeros(padded)
        self.sent = torch.zeros(padded)

    def start_worker(self, buffer, backend, kernels, staged, codec):
        self.sent.copy_(buffer)
        return COMPLETED

    def start_server(self, backend, kernels, staged):
        return COMPLETED

    def finish(self, buffer, kernels, keep, codec):
        buffer.copy_(self.sent)

    def error_slices(self, start, end):
        return [self.worker_error[start:end]]


class _ExactTopology:
    def new_state(self, padded, edges, device):
        return _Exact(padded)


def test_a_topology_is_a_state_of_the_protocol_that_the_stages_drive():
    from onebit.backends import LocalBackend
    from onebit.collectives import finish_, new_state, start_server_, start_worker_

    backend = LocalBackend()
    state = new_state(16, 1, "cpu", [0, 16], _ExactTopology())
    assert isinstance(state, _Exact) and state.sizes() == [16] and state.layout_key() == []
    assert isinstance(new_state(16, 1, "cpu", [0, 16]), CompressionState)
    buffer = torch.arange(16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="last stage was no stage .*; call start_worker_ first"):
        start_server_(state, backend, REFERENCE)
    with pytest.raises(ValueError, match="^buffer must be a flat float32 tensor of 16 elements, got torch.float64"):
        start_worker_(buffer.double(), state, backend, REFERENCE)
    assert state.stage == 0
    assert torch.equal(compressed_allreduce_(buffer.clone(), state, backend), buffer)
    # A state that does not fuse multipliers gets them in passes of their own, on both sides.
    multiplier = torch.full((16,), 2.0)
    start_worker_(buffer.clone(), state, backend, REFERENCE, multiplier=multiplier, bound=10.0)
    assert torch.equal(state.sent, (buffer * 2).clamp(-10, 10))
    start_server_(state, backend, REFERENCE)
    out = finish_(torch.empty(16), state, REFERENCE, multiplier=multiplier)
    assert torch.equal(out, (buffer * 2).clamp(-10, 10) * 2) and state.stage == 0
    error, compressed, sizes = state.health_input(buffer, multiplier, 10.0)
    assert error is state.worker_error and torch.equal(compressed, (buffer * 2).clamp(-10, 10)) and sizes == [16]
    with pytest.raises(TypeError, match="abstract"):
        type("Incomplete", (AllreduceState,), {})(16, 1, [0, 16])
