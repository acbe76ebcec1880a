"""Shared by the DeepSpeed parity tests: replaying a file of ``scripts/deepspeed_reference.py``.

That script records what DeepSpeed's own optimizer did on gloo ranks (its models, each rank's
data, rank 0's parameters after every step); these helpers rebuild the model with the recorded
initial weights, give a rank's gradient of a step, and measure how far a trajectory is from the
recorded one.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "tests" / "data"


@functools.cache
def reference_script():
    """``scripts/deepspeed_reference.py`` as a module (its model and data builders import no DeepSpeed)."""
    spec = importlib.util.spec_from_file_location("deepspeed_reference", ROOT / "scripts" / "deepspeed_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_model(model_class: type, run: dict) -> torch.nn.Module:
    """``model_class(**run["spec"])`` with the run's initial weights."""
    model = model_class(**run["spec"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(run["initial"][name])
    assert [name for name, _ in model.named_parameters()] == run["names"]
    return model


def backward(model: torch.nn.Module, run: dict, step: int, rank: int) -> None:
    """Rank ``rank``'s gradient of onebit-step ``step`` (1-based) at the model's parameters."""
    model.zero_grad(set_to_none=False)
    inputs = [run[key][step - 1, rank] for key in ("inputs", "extra_inputs") if key in run]
    torch.nn.functional.mse_loss(model(*inputs), run["targets"][step - 1, rank]).backward()


def relative_differences(trajectory: dict, reference: dict) -> list[float]:
    """Per step: the largest, over tensors, of ``max |p - p_ds| / max |p_ds|``."""
    steps = next(iter(reference.values())).shape[0]
    return [max(float((trajectory[k][t] - reference[k][t]).abs().max() / reference[k][t].abs().max())
                for k in reference) for t in range(steps)]


def by_phase(differences: list[float], freeze_step: int) -> str:
    f = freeze_step
    return (f"warmup (steps 1..{f}) max {max(differences[:f]):.3g}, compression (steps {f + 1}..{len(differences)}) "
            f"max {max(differences[f:]):.3g}; per step {[f'{d:.2g}' for d in differences]}")
