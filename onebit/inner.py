"""OnebitDiLoCo's ``inner=``: any ``torch.optim.Optimizer`` takes the inner steps.

The inner optimizer is built over OnebitDiLoCo's own param groups (the same dicts), so a learning
rate scheduler, ``zero_grad`` and frozen layers reach it as they reach OnebitDiLoCo; its per-parameter
state stays its own (``inner.state``) and travels in OnebitDiLoCo's state dict as entries named
``"inner:<name>"`` beside each parameter's global parameters. Each inner step runs it once, on the
gradients the engine read (unscaled under ``torch.amp.GradScaler``, none where a parameter has none).
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .state import is_torch_adam_state_dict

__all__ = ["PREFIX", "NAME_KEY", "COUNT_KEY", "save_into", "check_same_entries", "saved_by", "check_saved",
           "build", "check_hyperparameters", "check_shared", "entries", "split", "apply", "step", "average"]

#: the prefix of the inner optimizer's entries in a parameter's saved state
PREFIX = "inner:"
#: the keys of a saved param group that name the inner optimizer and count its parameters with state
NAME_KEY, COUNT_KEY = "inner_optimizer", "inner_states"


def build(factory: Any, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``factory(groups)``, checked: a ``torch.optim.Optimizer`` over exactly these group dicts."""
    from .engine import OnebitOptimizer  # (a onebit optimizer would communicate at every inner step)

    if inspect.isclass(factory) and issubclass(factory, OnebitOptimizer):
        raise ValueError(f"OnebitDiLoCo(inner={factory.__name__}): a onebit optimizer communicates at its steps; the "
                         "inner steps send nothing. Leave inner out for onebit's own fused AdamW, or pass a "
                         "torch.optim optimizer (e.g. inner=torch.optim.AdamW)")
    if not callable(factory):
        raise TypeError(f"OnebitDiLoCo(inner=...) takes a torch.optim.Optimizer class or a callable that builds one "
                        f"from param groups (e.g. functools.partial(torch.optim.SGD, momentum=0.9)), got "
                        f"{type(factory).__name__}")
    inner = factory(groups)
    if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, OnebitOptimizer):
        raise TypeError(f"OnebitDiLoCo(inner=...): the callable returned a {type(inner).__name__}, not a "
                        "torch.optim.Optimizer (onebit's optimizers communicate; they cannot be an inner one)")
    if len(inner.param_groups) != len(groups) or any(a is not b for a, b in zip(inner.param_groups, groups)):
        raise ValueError(f"OnebitDiLoCo(inner=...): the {type(inner).__name__} it built holds other param groups than "
                         "the ones it was given (it must own exactly OnebitDiLoCo's parameters, in its groups, so "
                         "that schedulers and zero_grad reach it): build it from its argument, e.g. "
                         "inner=lambda groups: torch.optim.SGD(groups, momentum=0.9)")
    if "lr" not in inner.defaults:
        raise ValueError(f"OnebitDiLoCo(inner=...): {type(inner).__name__} has no lr; OnebitDiLoCo's lr and "
                         "learning-rate schedulers set the inner optimizer's")
    return inner


def check_hyperparameters(inner: torch.optim.Optimizer, groups: Iterable[Mapping[str, Any]],
                          defaults: Mapping[str, Any]) -> None:
    """A hyperparameter of OnebitDiLoCo's built-in AdamW that ``inner`` does not have must keep its
    default (it would be ignored); ``bias_correction=False`` is not the inner optimizer's to take."""
    for group in groups:
        for key, default in defaults.items():
            if key in ("lr", "params") or key in inner.defaults:
                continue
            value = group.get(key, default)
            value = tuple(value) if isinstance(value, list) else value
            if key == "bias_correction" and value is not True:
                raise ValueError(f"OnebitDiLoCo(inner={type(inner).__name__}): bias_correction={value!r} is an "
                                 "option of the built-in AdamW; the inner optimizer corrects as it does. Leave it out")
            if key != "bias_correction" and value != default:
                raise ValueError(f"OnebitDiLoCo(inner={type(inner).__name__}): {key}={value!r} would be ignored: "
                                 f"{type(inner).__name__} has no {key}. Leave it out, or give the inner optimizer "
                                 "its own settings (e.g. functools.partial(torch.optim.SGD, momentum=0.9))")


def check_shared(inner: torch.optim.Optimizer, groups: Iterable[Mapping[str, Any]], factory: Any = None) -> None:
    """The hyperparameters the groups carry for both (``lr``, ``weight_decay``, ``betas``, ``eps``)
    are OnebitDiLoCo's, as a group's values override an optimizer's defaults in torch: one given to
    the inner optimizer's factory at another value would be ignored, so it is refused. Given: the
    keywords of a ``functools.partial`` ``factory``, else a default other than the class's."""
    explicit = factory.keywords if isinstance(factory, functools.partial) else {}
    try:
        signature = inspect.signature(type(inner).__init__).parameters
    except (TypeError, ValueError):
        signature = {}
    for key in ("lr", "weight_decay", "betas", "eps"):
        if key not in inner.defaults:
            continue
        if key in explicit:
            given = explicit[key]
        elif key in signature and signature[key].default is not inspect.Parameter.empty \
                and not _same(inner.defaults[key], signature[key].default):
            given = inner.defaults[key]
        else:
            continue
        for group in groups:
            if not _same(group.get(key), given):
                raise ValueError(f"OnebitDiLoCo(inner=...): {key}={given!r} given to the {type(inner).__name__} would be "
                                 f"ignored: the param groups' {key} ({group.get(key)!r}) is OnebitDiLoCo's and "
                                 f"overrides it. Pass {key}={given!r} to OnebitDiLoCo instead")


def _same(a: Any, b: Any) -> bool:
    a = tuple(a) if isinstance(a, list) else a
    b = tuple(b) if isinstance(b, list) else b
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return a is b


def _params(groups: Iterable[Mapping[str, Any]]) -> list[torch.Tensor]:
    return [p for group in groups for p in group["params"]]


def entries(inner: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The inner optimizer's state per parameter index (copies of its tensors), names prefixed."""
    out = {}
    for index, p in enumerate(_params(groups)):
        state = inner.state.get(p)
        if state:
            out[index] = {PREFIX + name: value.clone() if isinstance(value, torch.Tensor) else value
                          for name, value in state.items()}
    return out


def save_into(state_dict: dict[str, Any], inner: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Add the inner optimizer's state to OnebitDiLoCo's ``state_dict`` (built from ``groups``):
    its entries beside each parameter's, and in each saved group its name and how many of the
    group's parameters have inner state (what :func:`check_saved` reads back)."""
    saved = entries(inner, groups)
    for index, entry in saved.items():
        state_dict["state"][index] = {**state_dict["state"].get(index, {}), **entry}
    for group in state_dict["param_groups"]:
        group[NAME_KEY] = type(inner).__name__
        group[COUNT_KEY] = sum(index in saved for index in group["params"])


def check_same_entries(inner: torch.optim.Optimizer, backend: Any, device: torch.device) -> None:
    """Before averaging the inner optimizer's state over ``backend``'s ranks: every rank must hold
    the same entries (a parameter that had a gradient on some ranks only has state there), else
    the averages would not pair up."""
    from .layout import ranks_holding_other

    names = [(i, name, tuple(v.shape)) for i, p in enumerate(p for g in inner.param_groups for p in g["params"])
             for name, v in inner.state.get(p, {}).items() if isinstance(v, torch.Tensor)]
    digest = torch.tensor(list(repr(names).encode()), dtype=torch.uint8)
    differ = ranks_holding_other(backend, [digest], device)
    if differ:
        raise RuntimeError(f"OnebitDiLoCo.synchronize(): the inner optimizer's state on ranks {differ} has other "
                           "entries than on rank 0 (a parameter had a gradient on some ranks only); nothing was "
                           "averaged. Give every parameter a gradient on every rank before synchronize()")


def split(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[Any, dict[str, Any]]]:
    """``state_dict`` without the inner optimizer's entries, and those entries (names unprefixed)
    per parameter index; ``state_dict`` is not modified."""
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(state, Mapping):
        return dict(state_dict) if isinstance(state_dict, Mapping) else state_dict, {}
    kept, inner = {}, {}
    for key, entry in state.items():
        if not isinstance(entry, Mapping):
            kept[key] = entry
            continue
        kept[key] = {name: value for name, value in entry.items() if not str(name).startswith(PREFIX)}
        mine = {str(name)[len(PREFIX):]: value for name, value in entry.items() if str(name).startswith(PREFIX)}
        if mine:
            inner[key] = mine
    return {**state_dict, "state": kept}, inner


def saved_by(state_dict: Any) -> str | None:
    """The inner optimizer a state dict was saved with (None: none, or not a state dict)."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    names = {g.get(NAME_KEY) for g in groups if isinstance(g, Mapping)} if isinstance(groups, (list, tuple)) else set()
    names.discard(None)
    return ", ".join(sorted(map(str, names))) or None


def check_saved(state_dict: Any, name: str) -> tuple[Any, dict[Any, dict[str, Any]]]:
    """For an optimizer whose inner optimizer is a ``name``: ``state_dict`` without the inner
    optimizer's entries and its groups' inner keys, and those entries (per saved parameter key);
    ValueError where it was saved by another optimizer or lost the entries on the way."""
    if is_torch_adam_state_dict(state_dict):
        raise ValueError("cannot load optimizer state: this is a torch.optim state dict; OnebitDiLoCo(inner=...) loads "
                         "the state dicts of an OnebitDiLoCo with the same inner optimizer")
    stripped, saved = split(state_dict)
    groups = stripped.get("param_groups") if isinstance(stripped, Mapping) else None
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        return stripped, saved  # (the engine's checks say what is wrong with it)
    by = saved_by(stripped)
    if by is None:
        raise ValueError(f"cannot load optimizer state: it was saved by OnebitDiLoCo without inner= (its built-in "
                         f"AdamW), not with an inner {name}; load it into an OnebitDiLoCo built without inner=")
    if by != name:
        raise ValueError(f"cannot load optimizer state: it was saved with inner={by}, this OnebitDiLoCo's inner "
                         f"optimizer is a {name}; build it with the same inner=")
    for g, group in enumerate(groups):
        found = sum(key in saved for key in group.get("params", ()))
        if found < group.get(COUNT_KEY, 0):
            raise ValueError(f"cannot load optimizer state: param group {g} had {group.get(COUNT_KEY)} parameters with "
                             f"inner optimizer state when saved, the state dict holds {found} (torch.distributed."
                             "checkpoint loads only the entries a fresh optimizer's state_dict() has, and a fresh "
                             "inner optimizer has none): save and load with onebit.save_checkpoint / load_checkpoint, "
                             "or optimizer.state_dict() and torch.save")
    kept = [{k: v for k, v in group.items() if k not in (NAME_KEY, COUNT_KEY)} for group in groups]
    return {**stripped, "param_groups": kept}, saved


def apply(inner: torch.optim.Optimizer, groups: list[dict[str, Any]], saved: Mapping[Any, Mapping[str, Any]]) -> None:
    """Replace the inner optimizer's state by ``saved`` (per parameter index): tensors copied to
    their parameter's device, floating ones but ``step`` in its dtype, as torch.optim loads."""
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for index, p in enumerate(_params(groups)):
        for name, value in saved.get(index, {}).items():
            if isinstance(value, torch.Tensor):
                if name == "step":
                    value = value.clone()
                elif value.is_floating_point():
                    value = value.to(device=p.device, dtype=p.dtype, copy=True)
                else:
                    value = value.to(device=p.device, copy=True)
            state[p][name] = value
    inner.state = state


def step(inner: torch.optim.Optimizer, owners: list[list[torch.Tensor]], grads: list[list[torch.Tensor | None]],
         present: list[list[bool]], scaled: bool) -> None:
    """One step of ``inner`` over exactly the parameters the engine steps: those of its buckets
    (``owners``, per bucket) that are ``present``. Every other parameter's ``.grad`` is hidden for
    the step (a frozen parameter's stale gradient, a group left alone at an outer step with lr 0),
    and under GradScaler (``scaled``) the engine's unscaled ``grads`` stand in for the parameters'
    own; everything is put back afterwards."""
    stepped = {id(p): (g, here) for bucket_owners, bucket_grads, bucket_present in zip(owners, grads, present)
               for p, g, here in zip(bucket_owners, bucket_grads, bucket_present)}
    swapped: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    try:
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, here = stepped.get(id(p), (None, False))
                if not here:
                    swapped.append((p, p.grad))
                    p.grad = None
                elif scaled and g is not None and g is not p.grad:
                    if type(p.grad) is not torch.Tensor:
                        raise ValueError("OnebitDiLoCo(inner=...) with torch.amp.GradScaler and sharded (DTensor) "
                                         "parameters: call scaler.unscale_(optimizer) before scaler.step(optimizer)")
                    swapped.append((p, p.grad))
                    p.grad = g
        inner.step()
    finally:
        for p, own in swapped:
            p.grad = own


def average(inner: torch.optim.Optimizer, mean_: Callable[[torch.Tensor], None]) -> None:
    """Average the inner optimizer's floating-point state tensors over the ranks (``mean_`` in
    place), in the order of its parameters (the same on every rank); scalars such as ``step``
    advance alike everywhere and stay."""
    for group in inner.param_groups:
        for p in group["params"]:
            for value in inner.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                    flat = value.view(-1) if value.is_contiguous() else value.reshape(-1).contiguous()
                    mean_(flat)
                    if flat.data_ptr() != value.data_ptr():
                        value.copy_(flat.view_as(value))
