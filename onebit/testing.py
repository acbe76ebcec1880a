"""A single-process oracle of the compressed all-reduce, for tests and for studying the algorithm.

:func:`simulate_compressed_allreduce` runs the whole two-phase algorithm for ``n`` simulated ranks
in one process, written directly from the maths (no packing, no wire buffers, no backend), so
that the distributed implementation can be checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compression import padded_length
from .kernels.blocked import blocked_rms_scale

__all__ = ["SimulationResult", "simulate_compressed_allreduce"]


@dataclass
class SimulationResult:
    output: torch.Tensor  # the (unpadded) result every rank receives
    worker_errors: list[torch.Tensor]  # new worker error of each rank (padded length)
    server_errors: list[torch.Tensor]  # new server error of each rank (padded length / n)
    worker_scales: torch.Tensor  # (n,) float32
    worker_signs: list[torch.Tensor]  # +1/-1 float32 per rank (padded length)
    server_scales: torch.Tensor  # (n,) float32
    server_signs: torch.Tensor  # +1/-1 float32 (padded length), server j's chunk at position j


def _rms(v: torch.Tensor) -> torch.Tensor:
    # The scale's definition includes its float64 summation order (onebit.kernels.blocked).
    return blocked_rms_scale(v)


def _sign(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v < 0, torch.tensor(-1.0), torch.tensor(1.0))


def simulate_compressed_allreduce(
    inputs: list[torch.Tensor],
    worker_errors: list[torch.Tensor] | None = None,
    server_errors: list[torch.Tensor] | None = None,
) -> SimulationResult:
    """Compressed mean of ``inputs`` (one flat float32 tensor per simulated rank).

    Errors default to zeros; they are not modified (new ones are returned). Inputs are padded
    with zeros to :func:`onebit.compression.padded_length`.
    """
    n = len(inputs)
    numel = inputs[0].numel()
    padded = padded_length(numel, n)
    chunk = padded // n
    if worker_errors is None:
        worker_errors = [torch.zeros(padded) for _ in range(n)]
    if server_errors is None:
        server_errors = [torch.zeros(chunk) for _ in range(n)]

    new_worker_errors, worker_signs, worker_scales = [], [], []
    for i in range(n):
        x = torch.zeros(padded)
        x[:numel] = inputs[i].detach().float().cpu().reshape(-1)
        b = x + worker_errors[i].cpu()
        s = _rms(b)
        q = _sign(b)
        worker_scales.append(s)
        worker_signs.append(q)
        new_worker_errors.append(b - s * q)

    new_server_errors, server_scales, server_signs = [], [], []
    for j in range(n):
        part = slice(j * chunk, (j + 1) * chunk)
        total = worker_scales[0] * worker_signs[0][part]
        for i in range(1, n):
            total = total + worker_scales[i] * worker_signs[i][part]
        c = total / n + server_errors[j].cpu()
        s = _rms(c)
        r = _sign(c)
        server_scales.append(s)
        server_signs.append(r)
        new_server_errors.append(c - s * r)

    full = torch.cat([server_scales[j] * server_signs[j] for j in range(n)])
    return SimulationResult(
        output=full[:numel],
        worker_errors=new_worker_errors,
        server_errors=new_server_errors,
        worker_scales=torch.stack(worker_scales),
        worker_signs=worker_signs,
        server_scales=torch.stack(server_scales),
        server_signs=torch.cat(server_signs),
    )
