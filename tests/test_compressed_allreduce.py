"""The distributed compressed all-reduce against the single-process oracle, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from onebit.backends import resolve_backend
from onebit.collectives import CompressionState, compressed_allreduce_
from onebit.compression import padded_length
from onebit.testing import simulate_compressed_allreduce

NUMEL = 1000  # not a multiple of 8 n: exercises padding
ROUNDS = 6


def _inputs(world_size: int, rounds: int, numel: int) -> list[list[torch.Tensor]]:
    """inputs[t][i]: rank i's buffer in round t (a common drift plus per-rank noise)."""
    gen = torch.Generator().manual_seed(1234)
    drift = torch.randn(numel, generator=gen)
    return [[drift + torch.randn(numel, generator=gen) for _ in range(world_size)] for _ in range(rounds)]


def _rank_rounds(rank: int, world_size: int, rounds: int, numel: int) -> dict:
    backend = resolve_backend("gloo")
    padded = padded_length(numel, world_size)
    state = CompressionState(padded, world_size, "cpu")
    outputs, worker_errors, server_errors = [], [], []
    for inputs in _inputs(world_size, rounds, numel):
        buffer = torch.zeros(padded)
        buffer[:numel] = inputs[rank]
        compressed_allreduce_(buffer, state, backend)
        outputs.append(buffer[:numel].clone())
        worker_errors.append(state.worker_error.clone())
        server_errors.append(state.server_error.clone())
    return {"outputs": outputs, "worker_errors": worker_errors, "server_errors": server_errors}


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_matches_oracle_and_is_identical_on_every_rank(tmp_path, world_size):
    results = run_ranks(_rank_rounds, world_size, tmp_path, ROUNDS, NUMEL)
    worker_errors = server_errors = None
    for t, inputs in enumerate(_inputs(world_size, ROUNDS, NUMEL)):
        sim = simulate_compressed_allreduce(inputs, worker_errors, server_errors)
        worker_errors, server_errors = sim.worker_errors, sim.server_errors
        for rank, result in enumerate(results):
            # Every rank holds exactly the same bytes.
            assert torch.equal(result["outputs"][t], results[0]["outputs"][t])
            # Worker and server errors determine the signs and scales sent: they match exactly.
            assert torch.equal(result["worker_errors"][t], sim.worker_errors[rank])
            assert torch.equal(result["server_errors"][t], sim.server_errors[rank])
        # Outputs: the same signs, scaled by the same server scales.
        out = results[0]["outputs"][t]
        assert torch.equal(torch.sign(out), torch.sign(sim.output))
        chunk = padded_length(NUMEL, world_size) // world_size
        for j in range(world_size):
            part = out[j * chunk:(j + 1) * chunk]
            assert torch.all(part.abs() == sim.server_scales[j])
        torch.testing.assert_close(out, sim.output, rtol=0, atol=0)


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
