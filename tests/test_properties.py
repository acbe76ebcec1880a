"""Property tests (hypothesis) of the codec and of the compressed all-reduce against the oracle.

The all-reduce runs the real ``compressed_allreduce_`` for ``n`` ranks as ``n`` threads of this
process (a small in-memory transport), so world sizes 1-17 and many sizes are cheap to explore.

Buffers hold several tensors (a *segment table*, :class:`onebit.compression.SegmentLayout`):
random tensor sizes, including 0, 1 and sizes that are not multiples of ``8 n``, with and
without ``scale_block_size``. The segment properties: each segment is compressed exactly as if it
were alone (so changing one tensor changes nothing else), padding is nothing but zeros, the
error-feedback identity holds segment by segment, and a segment's output magnitudes are its
own server scales.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from conftest import bit_equal
from onebit.backends.base import CommBackend
from onebit.collectives import CompressionState, compressed_allreduce_
from onebit.compression import SegmentLayout, padded_length
from onebit.kernels import get_kernels, reference
from onebit.testing import simulate_compressed_allreduce

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Values that stress the codec: signed zeros, subnormals, large (but with n * |x| < FLT_MAX: the
# server sums n scaled signs before dividing by n), and ordinary numbers.
SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-38, -3e-39, 1e30, -1e30, 1.0, -1.0]
floats = st.one_of(st.sampled_from(SPECIAL), st.floats(-1e6, 1e6, width=32))


def _tensor(values) -> torch.Tensor:
    return torch.tensor(np.array(values, dtype=np.float32))


class ThreadGroup:
    """``n`` in-process ranks; collectives meet at a barrier and exchange through shared slots."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list = [None] * n

    def backend(self, rank: int) -> CommBackend:
        return _ThreadBackend(self, rank)


class _ThreadBackend(CommBackend):
    name = "threads"

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self._rank = group, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.group.n

    def _exchange(self, value):
        self.group.slots[self._rank] = value.clone()
        self.group.barrier.wait()
        values = list(self.group.slots)
        self.group.barrier.wait()
        return values

    def all_reduce_mean_(self, tensor):
        values = self._exchange(tensor)
        total = values[0].clone()
        for v in values[1:]:
            total += v
        return tensor.copy_(total / self.group.n)

    def all_to_all(self, output, input):
        values = self._exchange(input)
        for i, v in enumerate(values):
            output[i].copy_(v[self._rank])
        return output

    def all_gather(self, output, input):
        values = self._exchange(input)
        for i, v in enumerate(values):
            output[i].copy_(v.reshape(output[i].shape))
        return output

    def barrier(self):
        self.group.barrier.wait()


def _threaded_allreduce(inputs, rounds, kernels, numels=None, scale_block_size=None):
    """Run ``compressed_allreduce_`` on ``n`` thread ranks; ``numels`` (default: one tensor) and
    ``scale_block_size`` give the segment table. Returns ``outputs[t][rank]`` (unpadded)."""
    n, numel = len(inputs[0]), inputs[0][0].numel()
    if numels is None:
        padded, edges, slices = padded_length(numel, n), None, [slice(0, numel)]
    else:
        layout = SegmentLayout.build(numels, n, scale_block_size)
        padded, edges, slices = layout.padded, layout.edges, layout.slices()
    group = ThreadGroup(n)
    outputs = [[None] * n for _ in range(rounds)]
    errors = []

    def run(rank):
        try:
            state = CompressionState(padded, n, "cpu", edges)
            backend = group.backend(rank)
            for t in range(rounds):
                buffer = torch.zeros(padded)
                _place(buffer, slices, inputs[t][rank])
                compressed_allreduce_(buffer, state, backend, kernels)
                outputs[t][rank] = torch.cat([buffer[place] for place in slices])
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if errors:
        raise errors[0]
    return outputs


def _place(buffer: torch.Tensor, slices: list[slice], flat: torch.Tensor) -> torch.Tensor:
    """Write the tensors laid end to end in ``flat`` at their places in the padded ``buffer``."""
    offset = 0
    for place in slices:
        count = place.stop - place.start
        buffer[place] = flat[offset:offset + count]
        offset += count
    return buffer


def _segment_table(layout: SegmentLayout) -> list[tuple[int, int, int, int, int]]:
    """``(lo, hi, tensor, offset, count)`` per segment: its place ``[lo, hi)`` in the padded
    buffer, its tensor, and where its ``count`` real elements lie in the unpadded flat input (the
    rest of the segment is padding: only a tensor's last segment has any)."""
    flat_starts = np.cumsum([0, *layout.numels]).tolist()
    ends = [*layout.starts[1:], layout.padded]
    table = []
    for lo, hi in zip(layout.edges[:-1], layout.edges[1:]):
        t = max(i for i, start in enumerate(layout.starts) if start <= lo)
        assert hi <= ends[t]  # no segment straddles two tensors
        count = max(0, min(hi, layout.starts[t] + layout.numels[t]) - lo)
        table.append((lo, hi, t, flat_starts[t] + lo - layout.starts[t], count))
    return table


@st.composite
def segment_tables(draw, max_world: int = 4, max_numel: int = 600, max_tensors: int = 6):
    """``(world_size, numels, scale_block_size)``: tensor sizes around the multiples of ``8 n``
    (0, 1, 8n - 1, 8n, 8n + 1, 16n) or anywhere up to ``max_numel``; block sizes (when drawn)
    keep the table to a few dozen segments."""
    n = draw(st.integers(1, max_world))
    unit = 8 * n
    size = st.one_of(st.sampled_from([0, 1, unit - 1, unit, unit + 1, 2 * unit]), st.integers(1, max_numel))
    numels = draw(st.lists(size, min_size=1, max_size=max_tensors))
    total = sum(numels)
    block = draw(st.one_of(st.none(), st.integers(max(1, total // 32), total + 8 * unit)))
    return n, numels, block


def _segment_inputs(gen: torch.Generator, n: int, numels: list[int]) -> list[torch.Tensor]:
    """One flat input per rank; each tensor with its own magnitude (1e-3 ... 1e3)."""
    magnitudes = [10.0 ** torch.randint(-3, 4, (1,), generator=gen).item() for _ in numels]
    return [torch.cat([torch.randn(numel, generator=gen) * m for numel, m in zip(numels, magnitudes)]) for _ in range(n)]


def _random_errors(gen: torch.Generator, n: int, padded: int):
    """Starting errors in the padded layout (padding slots too: they carry error in real runs)."""
    return ([torch.randn(padded, generator=gen) for _ in range(n)],
            [torch.randn(padded // n, generator=gen) for _ in range(n)])


@settings(max_examples=40, deadline=None)
@given(st.lists(floats, min_size=0, max_size=300).map(lambda v: v[: len(v) // 8 * 8]))
def test_pack_then_unpack_gives_the_sign_convention(values):
    b = _tensor(values)
    expected = torch.where(b < 0, -1.0, 1.0)  # +0.0, -0.0 and subnormals follow b < 0
    assert torch.equal(reference.unpack_signs(reference.pack_signs(b)), expected)


def test_bits_are_msb_first_and_set_for_non_negative():
    b = torch.tensor([1.0, -1.0, -0.0, -2.0, 0.0, -3.0, -4.0, 5.0])
    assert reference.pack_signs(b).tolist() == [0b10101001]


def test_nan_is_coded_as_plus_one():
    b = torch.tensor([float("nan")] + [-1.0] * 7)
    assert reference.pack_signs(b).tolist() == [0b10000000]


@st.composite
def allreduce_tables(draw):
    """``(world_size, numel, numels, scale_block_size)`` for the threaded all-reduce on 1-17
    ranks: one tensor of up to 100,000 elements with the default table (``numels`` None), or a
    segment table of ``numel`` elements in all."""
    n = draw(st.integers(1, 17))
    if draw(st.booleans()):
        return n, draw(st.one_of(st.integers(0, 300), st.integers(300, 100_000))), None, None
    numels = draw(st.lists(st.one_of(st.integers(0, 300), st.integers(300, 20_000)), min_size=1, max_size=6))
    total = sum(numels)
    block = draw(st.one_of(st.none(), st.integers(max(1, total // 32), total + 8 * n)))
    return n, total, numels, block


@settings(max_examples=40, deadline=None)
@given(
    table=allreduce_tables(),
    rounds=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    special=st.lists(st.sampled_from(SPECIAL), max_size=8),
)
def test_threaded_allreduce_equals_the_oracle(table, rounds, seed, special):
    world_size, numel, numels, block = table
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(rounds):
        per_rank = []
        for _ in range(world_size):
            x = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-3, 4, (1,), generator=gen).item()
            if numel and special:
                idx = torch.randint(0, numel, (len(special),), generator=gen)
                x[idx] = _tensor(special)
            per_rank.append(x)
        inputs.append(per_rank)
    outputs = _threaded_allreduce(inputs, rounds, get_kernels("cpu"), numels, block)
    worker_errors = server_errors = None
    for t in range(rounds):
        sim = simulate_compressed_allreduce(inputs[t], worker_errors, server_errors, numels=numels,
                                            scale_block_size=block)
        worker_errors, server_errors = sim.worker_errors, sim.server_errors
        for rank in range(world_size):
            assert bit_equal(outputs[t][rank], outputs[t][0])
        assert bit_equal(outputs[t][0], sim.output)
        assert torch.isfinite(outputs[t][0]).all()


@settings(max_examples=40, deadline=None)
@given(table=segment_tables(), seed=st.integers(0, 2**31 - 1))
def test_each_segment_is_compressed_as_if_it_were_alone(table, seed):
    """The oracle on a segment table equals, segment by segment, the oracle run on that segment's
    elements alone (one tensor, padded on its own), with that segment's slice of the errors."""
    n, numels, block = table
    gen = torch.Generator().manual_seed(seed)
    layout = SegmentLayout.build(numels, n, block)
    inputs = _segment_inputs(gen, n, numels)
    worker_errors, server_errors = _random_errors(gen, n, layout.padded)
    sim = simulate_compressed_allreduce(inputs, worker_errors, server_errors, numels=numels, scale_block_size=block)
    assert sim.worker_scales.shape == sim.server_scales.shape == (n, layout.segments)
    for seg, (lo, hi, _, offset, count) in enumerate(_segment_table(layout)):
        assert padded_length(count, n) == hi - lo  # each segment is padded on its own
        alone = simulate_compressed_allreduce(
            [x[offset:offset + count] for x in inputs],
            [e[lo:hi] for e in worker_errors],
            [e[lo // n:hi // n] for e in server_errors],
        )
        assert bit_equal(sim.output[offset:offset + count], alone.output)
        assert bit_equal(sim.worker_scales[:, seg], alone.worker_scales[:, 0])
        assert bit_equal(sim.server_scales[:, seg], alone.server_scales[:, 0])
        assert bit_equal(sim.server_signs[lo:hi], alone.server_signs)
        for r in range(n):
            assert bit_equal(sim.worker_errors[r][lo:hi], alone.worker_errors[r])
            assert bit_equal(sim.worker_signs[r][lo:hi], alone.worker_signs[r])
            assert bit_equal(sim.server_errors[r][lo // n:hi // n], alone.server_errors[r])


@settings(max_examples=40, deadline=None)
@given(table=segment_tables(), seed=st.integers(0, 2**31 - 1), which=st.integers(0, 5))
def test_changing_one_tensor_changes_no_other_tensor(table, seed, which):
    """New values for one tensor (on every rank, at another magnitude) leave every other tensor's
    output, errors and scales exactly as they were."""
    n, numels, block = table
    gen = torch.Generator().manual_seed(seed)
    layout = SegmentLayout.build(numels, n, block)
    inputs = _segment_inputs(gen, n, numels)
    worker_errors, server_errors = _random_errors(gen, n, layout.padded)
    changed = which % len(numels)
    place = slice(sum(numels[:changed]), sum(numels[:changed + 1]))
    other_inputs = [x.clone() for x in inputs]
    for x in other_inputs:
        x[place] = torch.randn(numels[changed], generator=gen) * 1e4
    a, b = (simulate_compressed_allreduce(xs, worker_errors, server_errors, numels=numels, scale_block_size=block)
            for xs in (inputs, other_inputs))
    for seg, (lo, hi, tensor, offset, count) in enumerate(_segment_table(layout)):
        if tensor == changed:
            continue
        assert bit_equal(a.output[offset:offset + count], b.output[offset:offset + count])
        assert bit_equal(a.worker_scales[:, seg], b.worker_scales[:, seg])
        assert bit_equal(a.server_scales[:, seg], b.server_scales[:, seg])
        for r in range(n):
            assert bit_equal(a.worker_errors[r][lo:hi], b.worker_errors[r][lo:hi])
            assert bit_equal(a.server_errors[r][lo // n:hi // n], b.server_errors[r][lo // n:hi // n])


@settings(max_examples=30, deadline=None)
@given(table=segment_tables(), seed=st.integers(0, 2**31 - 1))
def test_padding_is_only_zeros(table, seed):
    """Each tensor given already zero-padded to its place in the buffer needs no padding (the
    layout is the identity: the same segments, no slot added) and gives the same result."""
    n, numels, block = table
    gen = torch.Generator().manual_seed(seed)
    layout = SegmentLayout.build(numels, n, block)
    inputs = _segment_inputs(gen, n, numels)
    worker_errors, server_errors = _random_errors(gen, n, layout.padded)
    extents = [end - start for start, end in zip(layout.starts, [*layout.starts[1:], layout.padded])]
    explicit = SegmentLayout.build(extents, n, block)
    assert explicit.padded == sum(extents)
    assert explicit.starts == layout.starts and explicit.edges == layout.edges
    padded_inputs = [_place(torch.zeros(layout.padded), layout.slices(), x) for x in inputs]
    sim = simulate_compressed_allreduce(inputs, worker_errors, server_errors, numels=numels, scale_block_size=block)
    ref = simulate_compressed_allreduce(padded_inputs, worker_errors, server_errors, numels=extents,
                                        scale_block_size=block)
    assert bit_equal(torch.cat([ref.output[place] for place in layout.slices()]), sim.output)
    assert bit_equal(ref.worker_scales, sim.worker_scales) and bit_equal(ref.server_scales, sim.server_scales)
    assert bit_equal(ref.server_signs, sim.server_signs)
    for r in range(n):
        assert bit_equal(ref.worker_errors[r], sim.worker_errors[r])
        assert bit_equal(ref.server_errors[r], sim.server_errors[r])


def _server_error_in_place(layout: SegmentLayout, server_errors: list[torch.Tensor]) -> torch.Tensor:
    """The server errors in the padded layout: chunk ``j`` of a segment is held by server ``j``."""
    n, full = layout.world_size, torch.zeros(layout.padded, dtype=torch.float64)
    for lo, hi in zip(layout.edges[:-1], layout.edges[1:]):
        chunk = (hi - lo) // n
        for j in range(n):
            full[lo + j * chunk:lo + (j + 1) * chunk] = server_errors[j][lo // n:hi // n].double()
    return full


def _output_in_place(layout: SegmentLayout, sim) -> torch.Tensor:
    """The whole padded result: chunk ``j`` of segment ``i`` is ``server_scales[j, i]`` times
    server ``j``'s signs."""
    n, full = layout.world_size, torch.zeros(layout.padded)
    for seg, (lo, hi) in enumerate(zip(layout.edges[:-1], layout.edges[1:])):
        chunk = (hi - lo) // n
        for j in range(n):
            part = slice(lo + j * chunk, lo + (j + 1) * chunk)
            full[part] = sim.server_scales[j, seg] * sim.server_signs[part]
    return full


@settings(max_examples=30, deadline=None)
@given(table=segment_tables(), seed=st.integers(0, 2**31 - 1))
def test_output_magnitudes_are_the_segments_server_scales(table, seed):
    """In chunk ``j`` of segment ``i``, every output element is ``+-server_scales[j, i]``: no other
    segment's scale, and the signs are server ``j``'s."""
    n, numels, block = table
    gen = torch.Generator().manual_seed(seed)
    layout = SegmentLayout.build(numels, n, block)
    inputs = _segment_inputs(gen, n, numels)
    sim = simulate_compressed_allreduce(inputs, *_random_errors(gen, n, layout.padded), numels=numels,
                                        scale_block_size=block)
    assert bit_equal(torch.cat([_output_in_place(layout, sim)[place] for place in layout.slices()]), sim.output)
    assert (sim.server_signs.abs() == 1).all()
    for seg, (lo, hi, _, offset, count) in enumerate(_segment_table(layout)):
        chunk = (hi - lo) // n
        for j in range(n):
            out = sim.output[offset + min(j * chunk, count):offset + min((j + 1) * chunk, count)]
            assert (out.abs() == sim.server_scales[j, seg]).all()


@settings(max_examples=30, deadline=None)
@given(table=segment_tables(), rounds=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_error_feedback_identity_holds_per_segment(table, rounds, seed):
    """From zero errors, ``sum_t out_t = sum_t mean_i x_i^t - mean_i e_w,i - e_s`` in every
    segment (padding slots included: their input is zero), up to float32 rounding relative to that
    segment's own magnitude, however different its neighbours' magnitudes are."""
    n, numels, block = table
    gen = torch.Generator().manual_seed(seed)
    layout = SegmentLayout.build(numels, n, block)
    magnitudes = [10.0 ** torch.randint(-3, 4, (1,), generator=gen).item() for _ in numels]
    total_out = torch.zeros(layout.padded, dtype=torch.float64)
    total_true = torch.zeros(layout.padded, dtype=torch.float64)
    size = torch.zeros(layout.padded, dtype=torch.float64)  # largest magnitude seen at each element
    worker_errors = server_errors = None
    for _ in range(rounds):
        inputs = [torch.cat([torch.randn(numel, generator=gen) * m for numel, m in zip(numels, magnitudes)])
                  for _ in range(n)]
        sim = simulate_compressed_allreduce(inputs, worker_errors, server_errors, numels=numels,
                                            scale_block_size=block)
        worker_errors, server_errors = sim.worker_errors, sim.server_errors
        placed = torch.stack([_place(torch.zeros(layout.padded), layout.slices(), x) for x in inputs]).double()
        out = _output_in_place(layout, sim).double()
        total_out += out
        total_true += placed.mean(0)
        size = torch.stack([size, placed.abs().amax(0), out.abs(), torch.stack(worker_errors).double().abs().amax(0),
                            _server_error_in_place(layout, server_errors).abs()]).amax(0)
    mean_worker = torch.stack(worker_errors).double().mean(0)
    gap = (total_out - (total_true - mean_worker - _server_error_in_place(layout, server_errors))).abs()
    for lo, hi in zip(layout.edges[:-1], layout.edges[1:]):
        assert gap[lo:hi].max().item() <= 1e-5 * rounds * size[lo:hi].max().item()


@settings(max_examples=30, deadline=None)
@given(world_size=st.integers(1, 17), numel=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1))
def test_one_call_conserves_the_mean_up_to_the_new_errors(world_size, numel, seed):
    """mean_i x_i = out + mean_i e_w,i + e_s for zero starting errors (up to float32 rounding)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(numel, generator=gen) for _ in range(world_size)]
    sim = simulate_compressed_allreduce(inputs)
    mean = torch.stack(inputs).double().mean(0)
    errors = torch.stack(sim.worker_errors).double().mean(0)[:numel] + torch.cat(sim.server_errors).double()[:numel]
    residual = (mean - sim.output.double() - errors).abs().max().item()
    assert residual < 1e-5 * (1 + mean.abs().max().item())


@pytest.mark.parametrize("numel, world_size, padded", [(0, 1, 8), (1, 1, 8), (8, 1, 8), (9, 2, 16), (1000, 3, 1008),
                                                       (1008, 3, 1008), (5, 17, 136)])
def test_padding_rule_is_the_next_multiple_of_8n(numel, world_size, padded):
    assert padded_length(numel, world_size) == padded
