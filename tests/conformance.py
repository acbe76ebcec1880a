"""Backend conformance: the same test bodies for every :class:`onebit.backends.CommBackend`.

Each ``check_*`` function takes a backend (plus a directory that every rank sees, and the world
size the launcher started) and raises ``AssertionError`` when the backend breaks the protocol.
Every rank must call the same checks in the same order. Inputs of all ranks are computed from
seeds on every rank, so each rank can evaluate the oracle locally.

Runners: ``tests/test_backend_conformance.py`` (LocalBackend, gloo ranks) and
``tests/test_mpi.py`` (MPIBackend under ``mpiexec -n 2`` / ``-n 3``).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from onebit import OnebitAdam
from onebit.collectives import CompressionState, compressed_allreduce_, finish_, start_server_, start_worker_
from onebit.compression import padded_length
from onebit.kernels import REFERENCE
from onebit.testing import simulate_compressed_allreduce

SEED = 20210202
NUMEL = 1000  # not a multiple of 8 n for n = 2, 3: exercises padding
ROUNDS = 4


def _generator(*keys: int) -> torch.Generator:
    seed = SEED
    for key in keys:
        seed = seed * 1_000_003 + key
    return torch.Generator().manual_seed(seed % 2**63)


def assert_identical_on_every_rank(backend, tensors: list[torch.Tensor]) -> None:
    """Gather the bytes of ``tensors`` from every rank and require them to be equal."""
    mine = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors]).view(torch.uint8)
    gathered = torch.empty(backend.world_size, mine.numel(), dtype=torch.uint8)
    backend.all_gather(gathered, mine)
    differing = [r for r in range(backend.world_size) if not torch.equal(gathered[r], mine)]
    assert not differing, f"rank {backend.rank}: values differ from those of ranks {differing}"


def check_rank_and_world_size_are_consistent(backend, directory: Path, world_size: int) -> None:
    n = backend.world_size
    assert n == world_size, f"backend reports world_size {n}, the launcher started {world_size}"
    assert 0 <= backend.rank < n
    ranks = torch.empty(n, 1, dtype=torch.uint8)
    backend.all_gather(ranks, torch.tensor([backend.rank], dtype=torch.uint8))
    assert ranks.reshape(-1).tolist() == list(range(n)), f"ranks seen by all_gather: {ranks.reshape(-1).tolist()}"


def check_all_reduce_mean_is_the_exact_mean(backend, directory: Path, world_size: int) -> None:
    n, rank = backend.world_size, backend.rank
    for dtype in (torch.float32, torch.float64):
        # Integer-valued inputs: the sum is exact in any order, so the mean is determined exactly.
        inputs = [torch.randint(-1000, 1000, (1000,), generator=_generator(1, r)).to(dtype) for r in range(n)]
        tensor = inputs[rank].clone()
        out = backend.all_reduce_mean_(tensor)
        assert out is tensor, "all_reduce_mean_ must return the tensor it was given"
        expected = torch.stack(inputs).sum(0) / n
        assert torch.equal(tensor, expected), f"{dtype}: max error {(tensor - expected).abs().max().item()}"
    # A fractional mean: identical on every rank.
    x = torch.randn(257, generator=_generator(2, rank))
    backend.all_reduce_mean_(x)
    assert_identical_on_every_rank(backend, [x])


def check_all_to_all_sends_row_j_to_rank_j(backend, directory: Path, world_size: int) -> None:
    n, rank = backend.world_size, backend.rank
    length = 37  # odd: rows are not word-aligned
    offsets = torch.arange(length, dtype=torch.int64)

    def row(sender: int, receiver: int) -> torch.Tensor:
        return ((sender * 31 + receiver * 7 + offsets * 3) % 256).to(torch.uint8)

    send = torch.stack([row(rank, j) for j in range(n)])
    before = send.clone()
    recv = torch.zeros(n, length, dtype=torch.uint8)
    out = backend.all_to_all(recv, send)
    assert out is recv, "all_to_all must return its output tensor"
    expected = torch.stack([row(i, rank) for i in range(n)])
    assert torch.equal(recv, expected), f"rank {rank} received {recv.tolist()}, expected {expected.tolist()}"
    assert torch.equal(send, before), "all_to_all modified its input"


def check_all_gather_stacks_inputs_in_rank_order(backend, directory: Path, world_size: int) -> None:
    n, rank = backend.world_size, backend.rank

    def data(r: int, shape: tuple[int, ...]) -> torch.Tensor:
        count = 1
        for s in shape:
            count *= s
        return ((r * 13 + torch.arange(count) * 5) % 256).to(torch.uint8).reshape(shape)

    for shape in ((29,), (2, 5)):
        output = torch.zeros(n, *shape, dtype=torch.uint8)
        out = backend.all_gather(output, data(rank, shape))
        assert out is output, "all_gather must return its output tensor"
        expected = torch.stack([data(r, shape) for r in range(n)])
        assert torch.equal(output, expected), f"shape {shape}: gathered {output.tolist()}"


def check_barrier_waits_for_every_rank(backend, directory: Path, world_size: int) -> None:
    n, rank = backend.world_size, backend.rank
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for round_ in range(2):
        if rank == 0:
            time.sleep(0.15)  # rank 0 arrives late: a barrier that does not wait lets the others see too little
        (directory / f"barrier{round_}_rank{rank}").touch()
        assert backend.barrier() is None
        missing = [r for r in range(n) if not (directory / f"barrier{round_}_rank{r}").exists()]
        assert not missing, f"rank {rank} left barrier {round_} before ranks {missing} reached it"


def compressed_inputs(world_size: int, rounds: int = ROUNDS, numel: int = NUMEL) -> list[list[torch.Tensor]]:
    """``inputs[t][i]``: rank ``i``'s buffer in round ``t`` (a common drift plus per-rank noise)."""
    drift = torch.randn(numel, generator=_generator(3, world_size))
    return [
        [drift + torch.randn(numel, generator=_generator(4, world_size, t, i)) for i in range(world_size)]
        for t in range(rounds)
    ]


def check_compressed_allreduce_equals_the_oracle_exactly(backend, directory: Path, world_size: int) -> list[torch.Tensor]:
    """Several rounds with error feedback; returns this rank's outputs (for cross-backend checks)."""
    n, rank = backend.world_size, backend.rank
    padded = padded_length(NUMEL, n)
    state = CompressionState(padded, n, "cpu")
    worker_errors = server_errors = None
    outputs = []
    for t, inputs in enumerate(compressed_inputs(n)):
        buffer = torch.zeros(padded)
        buffer[:NUMEL] = inputs[rank]
        compressed_allreduce_(buffer, state, backend)
        sim = simulate_compressed_allreduce(inputs, worker_errors, server_errors)
        worker_errors, server_errors = sim.worker_errors, sim.server_errors
        assert torch.equal(buffer[:NUMEL], sim.output), (
            f"round {t}: output differs from the oracle in {(buffer[:NUMEL] != sim.output).sum().item()} places"
        )
        assert torch.equal(state.worker_error, sim.worker_errors[rank]), f"round {t}: worker error differs"
        assert torch.equal(state.server_error, sim.server_errors[rank]), f"round {t}: server error differs"
        outputs.append(buffer[:NUMEL].clone())
    return outputs


def check_pipelined_compressed_allreduces_equal_the_oracle_exactly(backend, directory: Path, world_size: int) -> None:
    """Three buffers in flight at once (every all-to-all started before any server stage, every
    all-gather before any decode), as OnebitAdam runs its buckets: each equals its own oracle."""
    n, rank = backend.world_size, backend.rank
    sizes = (NUMEL, 37, 3 * NUMEL)
    states = [CompressionState(padded_length(size, n), n, "cpu") for size in sizes]
    inputs = [compressed_inputs(n, numel=size) for size in sizes]
    errors = [(None, None)] * len(sizes)
    for t in range(ROUNDS):
        buffers = []
        for k, (size, state) in enumerate(zip(sizes, states)):
            buffers.append(torch.zeros(state.padded))
            buffers[k][:size] = inputs[k][t][rank]
            start_worker_(buffers[k], state, backend, REFERENCE)
        for state in states:
            start_server_(state, backend, REFERENCE)
        for k, (size, state) in enumerate(zip(sizes, states)):
            finish_(buffers[k], state, REFERENCE)
            sim = simulate_compressed_allreduce(inputs[k][t], *errors[k])
            errors[k] = (sim.worker_errors, sim.server_errors)
            assert torch.equal(buffers[k][:size], sim.output), f"round {t}, buffer {k}: output differs from the oracle"
            assert torch.equal(state.worker_error, sim.worker_errors[rank]), f"round {t}, buffer {k}: worker error"
            assert torch.equal(state.server_error, sim.server_errors[rank]), f"round {t}, buffer {k}: server error"


def onebit_adam_trajectory(backend, steps: int = 8, freeze_step: int = 3) -> dict:
    """A short OnebitAdam run (warmup, then compression) on rank-specific data; returns the final
    parameters and losses of this rank. Same initial parameters on every rank; the parameter
    ``extra`` gets a gradient on rank 0 only (``None`` elsewhere); two buckets."""
    n, rank = backend.world_size, backend.rank
    init = _generator(5)
    w1 = torch.nn.Parameter(torch.randn(13, 7, generator=init) * 0.3)
    b1 = torch.nn.Parameter(torch.zeros(7))
    w2 = torch.nn.Parameter(torch.randn(7, 3, generator=init) * 0.3)
    extra = torch.nn.Parameter(torch.randn(3, generator=init))
    params = [w1, b1, w2, extra]
    opt = OnebitAdam(params, lr=0.02, freeze_step=freeze_step, weight_decay=0.01, backend=backend, bucket_size=100)
    data = _generator(6, n, rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 13, generator=data)
        y = torch.randn(16, 3, generator=data)
        pred = torch.tanh(x @ w1 + b1) @ w2  # tanh: no exactly-zero variance (see check below)
        if rank == 0:
            pred = pred + extra
        loss = torch.nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    stats = opt.comm_stats()
    assert opt.phase == "compression" and stats["compression"]["steps"] == steps - freeze_step
    assert stats["compression"]["collectives"] > 0 and opt.num_buckets == 2
    return {"params": [p.detach().clone() for p in params], "losses": losses}


def check_onebit_adam_keeps_parameters_identical_on_every_rank(backend, directory: Path, world_size: int) -> dict:
    result = onebit_adam_trajectory(backend)
    init = _generator(5)
    start = torch.randn(13, 7, generator=init) * 0.3
    assert not torch.equal(result["params"][0], start), "the parameters did not move"
    assert all(bool(torch.isfinite(p).all()) for p in result["params"]), "the parameters are not finite"
    assert_identical_on_every_rank(backend, result["params"])
    return result


#: every check, in the order runners call them
CHECKS = {
    f.__name__[len("check_"):]: f
    for f in (
        check_rank_and_world_size_are_consistent,
        check_all_reduce_mean_is_the_exact_mean,
        check_all_to_all_sends_row_j_to_rank_j,
        check_all_gather_stacks_inputs_in_rank_order,
        check_barrier_waits_for_every_rank,
        check_compressed_allreduce_equals_the_oracle_exactly,
        check_pipelined_compressed_allreduces_equal_the_oracle_exactly,
        check_onebit_adam_keeps_parameters_identical_on_every_rank,
    )
}
CHECK_NAMES = list(CHECKS)


def run_all(backend, directory: Path, world_size: int) -> dict[str, tuple[str, object]]:
    """Run every check in order; ``{name: ("ok", result) | ("failed", traceback) | ("not run", why)}``.

    Stops at the first failure: after one, the ranks may no longer issue the same collectives.
    """
    outcomes: dict[str, tuple[str, object]] = {}
    failed = None
    for name, check in CHECKS.items():
        if failed is not None:
            outcomes[name] = ("not run", f"check {failed!r} failed before it")
            continue
        try:
            outcomes[name] = ("ok", check(backend, Path(directory) / name, world_size))
        except Exception:
            outcomes[name] = ("failed", traceback.format_exc())
            failed = name
    return outcomes


def _gloo_suite(rank: int, world_size: int, directory: str) -> dict:
    from onebit.backends import resolve_backend

    backend = resolve_backend("gloo")
    assert backend.name == "gloo"
    return run_all(backend, directory, world_size)


_GLOO_RUNS: dict[int, list] = {}


def gloo_suite(world_size: int, directory: Path) -> list[dict[str, tuple[str, object]]]:
    """:func:`run_all` on ``world_size`` spawned gloo ranks, once per test session (the gloo
    conformance tests and the MPI-vs-gloo comparison share it); one outcome dict per rank."""
    if world_size not in _GLOO_RUNS:
        from distributed import run_ranks

        _GLOO_RUNS[world_size] = run_ranks(_gloo_suite, world_size, directory, str(Path(directory) / "shared"))
    return _GLOO_RUNS[world_size]
