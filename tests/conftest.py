"""Helpers shared by the test modules: tiny seeded models and parameters, and exact comparisons.

Test modules import them with ``from conftest import ...`` (pytest puts ``tests/`` on ``sys.path``,
as it does for ``distributed`` and ``launch``; ranks spawned by ``distributed.run_ranks`` inherit
it). Every builder seeds the global torch RNG first and draws in a fixed order, so a module that
switched to one of them builds exactly the tensors it built before.
"""

from __future__ import annotations

import logging

import pytest
import torch


def tiny_mlp(d_in: int, hidden: int, d_out: int, *, seed: int = 0) -> torch.nn.Sequential:
    """``torch.manual_seed(seed)``, then ``Linear(d_in, hidden), Tanh(), Linear(hidden, d_out)``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, d_out))


def seeded_params(*shapes: int | tuple[int, ...], seed: int = 0) -> list[torch.nn.Parameter]:
    """``torch.manual_seed(seed)``, then one ``Parameter(torch.randn(shape))`` per shape, in order."""
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]


def clone_params(params) -> list[torch.Tensor]:
    """Detached copies of ``params`` (a list or ``model.parameters()``)."""
    return [p.detach().clone() for p in params]


def all_equal(a, b) -> bool:
    """``torch.equal`` pairwise over two sequences of tensors (``zip``: extra items are ignored)."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


def max_abs_diff(a, b) -> float:
    """The largest ``|x - y|`` over two sequences paired element by element (``zip(strict=True)``)
    of tensors, of floats, or of such sequences nested alike (a trajectory: per step, the tensors)."""
    if isinstance(a, torch.Tensor):
        return (a - b).abs().max().item()
    if isinstance(a, (int, float)):
        return abs(a - b)
    return max(max_abs_diff(x, y) for x, y in zip(a, b, strict=True))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns of ``t`` as int32."""
    return t.contiguous().view(torch.int32)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (``-0.0`` is not ``+0.0``), shapes included."""
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


class LogMessages(logging.Handler):
    """Collects the messages of the records it handles (at ``level`` and above) in ``messages``;
    for ranks that count what the library logged (attach it to ``logging.getLogger('onebit')``)."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def short_schedules() -> dict:
    """The table of the optimizer family: per optimizer class, a schedule that runs every plan
    within 12 steps. 1-bit Adam and 1-bit LAMB freeze after step 3; 0/1 Adam has variance steps 1
    and 3, compressed-gradient steps 2, 4 and 5, syncs at 6 and 7, then a local step and a sync in
    turn; OnebitDiLoCo takes an outer step every 3rd step. The suites that check every optimizer
    iterate over it; ``test_contract`` fails when a registered class is missing from it."""
    from onebit import OnebitAdam, OnebitDiLoCo, OnebitLamb, ZeroOneAdam

    return {
        OnebitAdam: dict(freeze_step=3),
        OnebitLamb: dict(freeze_step=3),
        ZeroOneAdam: dict(var_freeze_step=5, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2),
        OnebitDiLoCo: dict(sync_every=3),
    }


@pytest.fixture
def fresh_optimizer_registry(monkeypatch):
    """``OnebitOptimizer``'s registry of config types as it is, given back after the test: a class
    that the test defines with a ``CONFIG_TYPE`` registers itself in a copy, forgotten afterwards."""
    from onebit.engine import OnebitOptimizer

    monkeypatch.setattr(OnebitOptimizer, "_REGISTRY", dict(OnebitOptimizer._REGISTRY))


def released_buffers(opt, p) -> frozenset[str]:
    """The state buffers of ``p`` that ``opt`` holds in another form now (1-bit Adam's variance behind
    its bfloat16 ``1 / d``): in its state dict, not in its state."""
    index = [id(q) for group in opt.param_groups for q in group["params"]].index(id(p))
    saved = opt.state_dict()["state"].get(index, {})
    return frozenset(name for name in opt.STATE.buffers if name in saved and name not in opt.state[p])
