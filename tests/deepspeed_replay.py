"""Shared by the DeepSpeed parity tests: replaying a file of ``scripts/deepspeed_reference.py``.

That script records what DeepSpeed's own optimizer did on gloo ranks (its models, each rank's
data, rank 0's parameters after every step); these helpers rebuild the model with the recorded
initial weights, give a rank's gradient of a step, train a rank on the recorded data, and
measure how far a trajectory is from the recorded one.
"""

from __future__ import annotations

import copy
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


# How the same gradient can be rounded: torch's matrix products and reductions sum in an order set by
# the CPU (vector width, BLAS kernel, threads), so another machine's gradient differs in its last
# bits, and so does the recording machine's. "float64" (computed in float64, rounded once) and
# "reversed" (the batch summed in the opposite order) are two such roundings that any machine can
# reproduce; each parity file's tolerance is tested to cover them with a margin.
ROUNDINGS = ("native", "float64", "reversed")


def backward(model: torch.nn.Module, run: dict, step: int, rank: int, rounding: str = "native") -> None:
    """Rank ``rank``'s gradient of onebit-step ``step`` (1-based) at the model's parameters, rounded
    as this machine does (``"native"``) or as one of the other ``ROUNDINGS``."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {ROUNDINGS}")
    inputs = [run[key][step - 1, rank] for key in ("inputs", "extra_inputs") if key in run]
    target = run["targets"][step - 1, rank]
    if rounding == "reversed":
        inputs, target = [x.flip(0) for x in inputs], target.flip(0)
    network = copy.deepcopy(model).double() if rounding == "float64" else model
    network.zero_grad(set_to_none=False)
    dtype = next(network.parameters()).dtype
    torch.nn.functional.mse_loss(network(*(x.to(dtype) for x in inputs)), target.to(dtype)).backward()
    if network is not model:
        for p, q in zip(model.parameters(), network.parameters()):
            p.grad = q.grad.float()


def replay_trajectory(model: torch.nn.Module, optimizer, run: dict, steps: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank`` trains ``model`` on the run's data for ``steps`` steps (the gradient of
    :func:`backward`, then ``optimizer.step()``); per parameter name, its values after every step,
    stacked (as the file's ``trajectory``)."""
    snapshots = []
    for t in range(1, steps + 1):
        backward(model, run, t, rank)
        optimizer.step()
        snapshots.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return {name: torch.stack([s[name] for s in snapshots]) for name in run["names"]}


def relative_differences(trajectory: dict, reference: dict) -> list[float]:
    """Per step: the largest, over tensors, of ``max |p - p_ds| / max |p_ds|``."""
    steps = next(iter(reference.values())).shape[0]
    return [max(float((trajectory[k][t] - reference[k][t]).abs().max() / reference[k][t].abs().max())
                for k in reference) for t in range(steps)]


def by_phase(differences: list[float], freeze_step: int) -> str:
    f = freeze_step
    return (f"warmup (steps 1..{f}) max {max(differences[:f]):.3g}, compression (steps {f + 1}..{len(differences)}) "
            f"max {max(differences[f:]):.3g}; per step {[f'{d:.2g}' for d in differences]}")
