"""Property tests (hypothesis) of the codec and of the compressed all-reduce against the oracle.

The all-reduce runs the real ``compressed_allreduce_`` for ``n`` ranks as ``n`` threads of this
process (a small in-memory transport), so world sizes 1-17 and many sizes are cheap to explore.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from onebit.backends.base import CommBackend
from onebit.collectives import CompressionState, compressed_allreduce_
from onebit.compression import padded_length
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


def _threaded_allreduce(inputs, rounds, kernels):
    n, numel = len(inputs[0]), inputs[0][0].numel()
    padded = padded_length(numel, n)
    group = ThreadGroup(n)
    outputs = [[None] * n for _ in range(rounds)]
    errors = []

    def run(rank):
        try:
            state = CompressionState(padded, n, "cpu")
            backend = group.backend(rank)
            for t in range(rounds):
                buffer = torch.zeros(padded)
                buffer[:numel] = inputs[t][rank]
                compressed_allreduce_(buffer, state, backend, kernels)
                outputs[t][rank] = buffer[:numel].clone()
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


@settings(max_examples=40, deadline=None)
@given(
    world_size=st.integers(1, 17),
    numel=st.one_of(st.integers(0, 300), st.integers(300, 100_000)),
    rounds=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    special=st.lists(st.sampled_from(SPECIAL), max_size=8),
)
def test_threaded_allreduce_equals_the_oracle(world_size, numel, rounds, seed, special):
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
    outputs = _threaded_allreduce(inputs, rounds, get_kernels("cpu"))
    worker_errors = server_errors = None
    for t in range(rounds):
        sim = simulate_compressed_allreduce(inputs[t], worker_errors, server_errors)
        worker_errors, server_errors = sim.worker_errors, sim.server_errors
        for rank in range(world_size):
            assert torch.equal(outputs[t][rank], outputs[t][0])
        assert torch.equal(outputs[t][0], sim.output)
        assert torch.isfinite(outputs[t][0]).all()


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
