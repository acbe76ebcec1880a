"""Checks of user input shared by every onebit optimizer: numbers, parameters, param groups.

Each raises ``TypeError`` or ``ValueError`` naming the value and what it must be.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["is_int", "is_real", "check_number", "check_int", "check_flag", "check_choice", "check_params", "check_common_group",
           "check_engine_options", "refuse", "refuse_unknown", "TORCH_FLAGS", "DEEPSPEED_COMMON_REFUSED",
           "COMPRESSION_SPACES", "check_compression_space", "REDUCE_DTYPES", "reduce_dtype_of", "error_dtype_of",
           "preconditioner_dtype_of",
           "check_update_bound", "with_tuple_betas", "TORCH_NEUTRAL", "torch_flag_problem", "torch_flags_given",
           "as_group", "check_lr", "claim_params", "check_step_order"]


def check_number(name: str, value: Any, *, low: float = 0.0, high: float | None = None, high_open: bool = False) -> None:
    """A finite real number in ``[low, high]`` (``[low, high)`` with ``high_open``)."""
    if not is_real(value):
        raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
    if not math.isfinite(value) or value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = f"in [{low}, {high}{')' if high_open else ']'}" if high is not None else f">= {low}"
        raise ValueError(f"invalid {name}: {value!r}; it must be finite and {bound}")


def is_int(value: Any, low: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool), and ``>= low`` if given: the one definition every
    integer check of onebit uses (with its own message)."""
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (int or float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int, why: str = "") -> int:
    """An int (not a bool) ``>= low``; returned."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if value < low:
        raise ValueError(f"invalid {name}: {value}; it must be >= {low}{why}")
    return value


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_params(params: list[Any], owner: str) -> None:
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{owner} expects tensors (or param-group dicts), got {type(p).__name__}")
        if p.is_complex():
            raise ValueError(
                f"complex parameter of shape {tuple(p.shape)}: {owner} handles real tensors only; "
                "view it with torch.view_as_real before building the model"
            )
        if not p.is_floating_point():
            raise ValueError(f"parameter of dtype {p.dtype} is not floating point; only float parameters can be optimized")
        if p.is_sparse:
            raise ValueError("sparse parameters are not supported; use dense tensors")


# Which onebit optimizers hold each parameter (weakly), and when each last stepped: two optimizers
# may hold one parameter (a second one built to load a checkpoint into, or to compare), but not
# take turns updating it (see check_step_order).
_HOLDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> WeakSet of optimizers
_LAST_STEP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> tick of its last step
_SHARING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (claims seen, [(other, name)])
_TICKS = itertools.count(1)
_claims = [0]  # parameters claimed so far: a change makes each optimizer look for sharers again


def claim_params(optimizer: Any, params: list[torch.Tensor]) -> None:
    """Record that ``optimizer`` holds ``params`` (see :func:`check_step_order`)."""
    for p in params:
        _HOLDERS.setdefault(p, weakref.WeakSet()).add(optimizer)
    _claims[0] += 1


def _sharers(optimizer: Any) -> list[tuple[weakref.ref, str]]:
    """The other live optimizers holding a parameter of ``optimizer``, each with that parameter's name."""
    found: dict[int, tuple[weakref.ref, str]] = {}
    for group in optimizer.param_groups:
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            for other in list(_HOLDERS.get(p, ())):
                if other is not optimizer and id(other) not in found:
                    name = repr(names[i]) if names else f"of shape {tuple(p.shape)}"
                    found[id(other)] = (weakref.ref(other), name)
    return list(found.values())


def check_step_order(optimizer: Any) -> None:
    """At the start of a step of ``optimizer``: raise ValueError if another live onebit optimizer
    holding one of its parameters stepped since this one's previous step (the two would take
    turns updating it, each with its own state and collectives); nothing is changed then. Else
    record the step. A second optimizer that takes over (a checkpoint loaded into it) is free
    to step; the first one is refused if it steps again."""
    seen, shared = _SHARING.get(optimizer, (None, []))
    if seen != _claims[0]:
        shared = _sharers(optimizer)
        _SHARING[optimizer] = (_claims[0], shared)
    mine = _LAST_STEP.get(optimizer)
    for ref, name in shared:
        other = ref()
        if other is not None and mine is not None and _LAST_STEP.get(other, 0) > mine:
            owner = type(optimizer).__name__
            raise ValueError(
                f"{owner}.step(): another optimizer, {type(other).__name__}, holds the same parameter {name} "
                f"and stepped it since this {owner}'s last step: two optimizers would take turns updating it, "
                "each with its own state and collectives. Give each parameter to one optimizer (param groups "
                "give parameters their own settings), or stop stepping (and del) the other one")
    _LAST_STEP[optimizer] = next(_TICKS)


def check_common_group(group: Mapping[str, Any], owner: str) -> None:
    """The hyperparameters every algorithm of the family reads: lr, eps, weight_decay, betas,
    compress (and no DeepSpeed ``exp_avg_mask``, which onebit takes as ``momentum_masks``)."""
    check_lr(group["lr"])
    check_number("eps", group["eps"])
    if group["eps"] == 0:
        raise ValueError(
            "invalid eps: 0; it must be > 0: a coordinate whose gradient has been 0 has m = v = 0, and "
            "its update m / (sqrt(v) + eps) would be 0 / 0 = NaN (use e.g. eps=1e-8)"
        )
    check_number("weight_decay", group["weight_decay"])
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_number("betas[0]", betas[0], high=1.0, high_open=True)
    check_number("betas[1]", betas[1], high=1.0, high_open=True)
    check_flag("compress", group["compress"])
    if "exp_avg_mask" in group:
        raise ValueError(
            "param group key 'exp_avg_mask' (DeepSpeed) is not read by onebit; pass "
            f"momentum_masks={{param: mask}} to {owner} instead"
        )
    for key in TORCH_FLAGS:
        if key in group:
            why = torch_flag_problem(key, group[key], group["weight_decay"])
            if why is not None:
                raise ValueError(f"{owner} does not take torch.optim's {key}={group[key]!r} in a param group: {why}; "
                                 f"remove it (or set {_neutral_of(key)})")


def check_lr(lr: Any) -> None:
    """``lr``: a finite real number >= 0 (a 0-d tensor is read as its value by :func:`as_group`)."""
    if isinstance(lr, torch.Tensor):
        raise TypeError(f"lr must be a real number or a 0-d real tensor, got a tensor of shape {tuple(lr.shape)} "
                        f"and dtype {lr.dtype}")
    check_number("lr", lr)


def as_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the param group ``group`` as onebit keeps it: ``betas`` a tuple (see
    :func:`with_tuple_betas`) and an ``lr`` given as a 0-d real tensor (as torch.optim accepts it)
    read as its value, a float (what schedulers then set; onebit's step reads numbers)."""
    group = with_tuple_betas(group)
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and lr.dim() == 0 and not lr.is_complex() and lr.dtype != torch.bool:
        if lr.requires_grad:
            raise TypeError("a tensor lr that requires grad is not supported: onebit's step cannot be differentiated; "
                            "pass a float or lr.detach()")
        group["lr"] = float(lr.item())
    return group


def with_tuple_betas(group: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the param group ``group`` whose ``betas``, a list or tuple (config files and JSON
    give lists), is a tuple: how groups keep them, and state dicts save them."""
    betas = group.get("betas")
    return {**group, "betas": tuple(betas)} if isinstance(betas, (list, tuple)) else dict(group)


def check_engine_options(bucket_size: Any, nonfinite_grads: Any, divergence: Any, scale_block_size: Any,
                         cuda_aware: Any) -> None:
    """The keyword-only options of :class:`onebit.engine.OnebitOptimizer` that are plain values."""
    if not is_int(bucket_size, 1):
        raise ValueError(f"invalid bucket_size: {bucket_size!r}; it must be a positive int (elements)")
    check_choice("nonfinite_grads", nonfinite_grads, ("skip", "raise"))
    check_choice("divergence", divergence, ("warn", "raise"))
    if scale_block_size is not None and not is_int(scale_block_size, 1):
        raise ValueError(
            f"invalid scale_block_size: {scale_block_size!r}; it must be a positive int (elements per scale), "
            "or None for one scale per tensor"
        )
    check_flag("cuda_aware", cuda_aware)


def check_update_bound(value: Any) -> None:
    """``update_bound``: None or a finite number > 0."""
    if value is not None:
        check_number("update_bound", value, low=0.0)
        if value == 0:
            raise ValueError("invalid update_bound: 0 would keep every parameter still; give a number > 0 "
                             "(1: Adam's own largest step) or None for no bound")


#: The values ``reduce_dtype`` takes, by the names config files give them.
REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def reduce_dtype_of(value: Any) -> torch.dtype | None:
    """``reduce_dtype`` as the engine keeps it: ``None`` (the float32 of the buckets) or
    ``torch.bfloat16``; a config file's ``"float32"`` / ``"bfloat16"`` name them."""
    dtype = REDUCE_DTYPES.get(value, value) if isinstance(value, str) else value
    if value is None or dtype is torch.float32:
        return None
    if dtype is torch.bfloat16:
        return dtype
    raise ValueError(
        f"invalid reduce_dtype: {value!r}; it must be None or torch.float32 (the default: full precision) or "
        "torch.bfloat16 (half the bytes; float16 is not offered: gradients above 65504 would overflow)")


def error_dtype_of(value: Any, hierarchy: Any = None, auto: torch.dtype = torch.float32) -> torch.dtype:
    """``error_dtype``: ``"auto"`` (the default: ``auto``, the algorithm's choice; float32 with
    ``hierarchy``), ``None`` or ``torch.float32``, or ``torch.bfloat16``; a config file's
    ``"float32"`` / ``"bfloat16"`` name them. Not bfloat16 with ``hierarchy``."""
    if isinstance(value, str) and value == "auto":
        return torch.float32 if hierarchy is not None else auto
    dtype = REDUCE_DTYPES.get(value, value) if isinstance(value, str) else value
    if value is None or dtype is torch.float32:
        return torch.float32
    if dtype is not torch.bfloat16:
        raise ValueError(
            f"invalid error_dtype: {value!r}; it must be 'auto' (the default), torch.float32 or torch.bfloat16 "
            "(compression errors in half the memory; float16 is not offered: its range is too small for errors of "
            "large values)")
    if hierarchy is not None:
        raise ValueError(f"error_dtype={value!r} does not work with hierarchy={hierarchy!r} yet (its error feedbacks "
                         "are float32); pass one of them")
    return dtype


def preconditioner_dtype_of(value: Any, auto: torch.dtype = torch.float32) -> torch.dtype:
    """``preconditioner_dtype``: ``"auto"`` (``auto``, the algorithm's choice), ``None`` or
    ``torch.float32``, or ``torch.bfloat16``; a config file's ``"float32"`` / ``"bfloat16"`` name them."""
    if isinstance(value, str) and value == "auto":
        return auto
    dtype = REDUCE_DTYPES.get(value, value) if isinstance(value, str) else value
    if value is None or dtype is torch.float32:
        return torch.float32
    if dtype is not torch.bfloat16:
        raise ValueError(f"invalid preconditioner_dtype: {value!r}; it must be 'auto', torch.float32 (d and 1 / d "
                         "held in float32) or torch.bfloat16 (1 / d alone, in bfloat16: a quarter of the memory)")
    return dtype


def refuse(owner: str, options: Mapping[str, Any], refused: Mapping[str, str]) -> None:
    """Raise TypeError for the first key of ``options`` in ``refused`` (keys a DeepSpeed optimizer
    accepted and ignored), naming its value and ``refused[key]``, the reason."""
    for key, why in refused.items():
        if key in options:
            raise TypeError(f"{owner} does not take {key}={options[key]!r}: {why}; remove it")


# torch.optim flags that onebit's optimizers take only at the values that change nothing for them
# (TORCH_NEUTRAL), as keyword arguments and in param groups, and why the other values are refused.
TORCH_FLAGS = {
    "maximize": "onebit minimizes; negate the loss to maximize it",
    "foreach": "onebit always updates its flat buckets with multi-tensor (foreach) operations",
    "fused": "onebit's update is already fused over flat buckets (choose the codec with kernels=)",
    "differentiable": "a step through 1-bit compression and collectives cannot be differentiated",
    "capturable": "CUDA graph capture is not supported: every rank agrees on finite gradients through "
                  "the host before a step changes anything",
    "amsgrad": "AMSGrad is not implemented",
    "decoupled_weight_decay": "onebit's weight decay is decoupled, AdamW's (p -= lr * weight_decay * p); Adam's "
                              "L2 penalty added to the gradient (decoupled_weight_decay=False with a weight_decay) "
                              "is not implemented",
}

#: The values of :data:`TORCH_FLAGS` that change nothing in onebit (torch.optim's defaults, and
#: ``decoupled_weight_decay=True``: onebit's weight decay is AdamW's); ``decoupled_weight_decay=False``
#: changes nothing either where ``weight_decay`` is 0 (see :func:`torch_flag_problem`).
TORCH_NEUTRAL = {
    "maximize": (False,),
    "foreach": (None,),
    "fused": (None, False),
    "differentiable": (False,),
    "capturable": (False,),
    "amsgrad": (False,),
    "decoupled_weight_decay": (True,),
}


def torch_flag_problem(key: str, value: Any, weight_decay: Any = 0.0) -> str | None:
    """Why torch.optim's flag ``key`` at ``value`` (in a group with ``weight_decay``) would change
    what onebit does, or None where it changes nothing."""
    if any(value is neutral for neutral in TORCH_NEUTRAL[key]):
        return None
    if key == "decoupled_weight_decay" and value is False and weight_decay == 0:
        return None  # (torch.optim.Adam's default: no weight decay to couple)
    return TORCH_FLAGS[key]


def _neutral_of(key: str) -> str:
    return " or ".join(f"{key}={value!r}" for value in TORCH_NEUTRAL[key])


def torch_flags_given(owner: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The torch.optim flags among the keyword arguments ``options``, checked: a TypeError names the
    first at a value that would change something (``decoupled_weight_decay=False`` is checked
    against each param group's ``weight_decay`` by :func:`check_common_group`)."""
    flags = {key: value for key, value in options.items() if key in TORCH_FLAGS}
    for key, value in flags.items():
        if key == "decoupled_weight_decay" and value is False:
            continue
        why = torch_flag_problem(key, value)
        if why is not None:
            raise TypeError(f"{owner} does not take torch.optim's {key}={value!r}: {why}; remove it "
                            f"(or pass {_neutral_of(key)})")
    return flags


# Keys every DeepSpeed 1-bit optimizer accepted and ignored; onebit refuses them, with the reason
# (each optimizer class lists its own in DEEPSPEED_REFUSED).
DEEPSPEED_COMMON_REFUSED = {
    "max_grad_norm": "clip gradients in the training loop (torch.nn.utils.clip_grad_norm_) before step()",
    "eps_inside_sqrt": "eps is always added outside the square root (DeepSpeed's behaviour)",
    "amsgrad": "AMSGrad is not implemented",
}


def refuse_unknown(owner: str, options: Mapping[str, Any], refused: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Raise TypeError for keyword arguments the optimizer does not take: those in ``refused``
    (DeepSpeed's accepted-and-ignored keys, other optimizers' settings) and torch.optim's flags
    with the reason, anything else as unexpected; return torch.optim's flags given at values that
    change nothing (:func:`torch_flags_given`), which the optimizer keeps in its param groups."""
    refused = refused or {}
    # (a flag DeepSpeed also accepted and ignored, amsgrad, is refused in its words unless it changes nothing)
    flags = torch_flags_given(owner, {key: value for key, value in options.items() if key in TORCH_FLAGS and (
        key not in refused or torch_flag_problem(key, value) is None)})
    others = {key: value for key, value in options.items() if key not in flags}
    refuse(owner, others, refused)
    for key in others:
        raise TypeError(f"{owner} got an unexpected keyword argument {key!r}")
    return flags


def check_choice(name: str, value: Any, choices: tuple[Any, ...], prefix: str = "invalid") -> None:
    """``value`` is one of ``choices`` (ValueError naming them otherwise)."""
    if value not in choices:
        raise ValueError(f"{prefix} {name}: {value!r}; expected one of {', '.join(map(repr, choices))}")


# What the 1-bit all-reduce averages: DeepSpeed's quantities ("momentum": the momentum, 0/1 Adam's
# gradients and u (sqrt(v) + eps)), or the same divided by the frozen preconditioner
# sqrt(v) + eps ("preconditioned"), whose 1-bit error is then in units of Adam's own step.
COMPRESSION_SPACES = ("momentum", "preconditioned")


def check_compression_space(value: Any, saved: bool = False) -> str:
    """One of :data:`COMPRESSION_SPACES` (given, or ``saved`` in a checkpoint); returned."""
    if saved:
        check_choice("in the checkpoint", value, COMPRESSION_SPACES, prefix="compression_space")
    else:
        check_choice("compression_space", value, COMPRESSION_SPACES)
    return value
