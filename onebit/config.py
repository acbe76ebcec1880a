"""Build a onebit optimizer from a DeepSpeed-style config (dict, JSON file or YAML file).

A whole DeepSpeed config is accepted as it is; only its optimizer section is read::

    {
      "train_batch_size": 4096,                      # other sections: not read (one log line;
                                                     # a WARNING for fp16, clipping, ...: LOOP_SECTIONS)
      "optimizer": {
        "type": "OneBitAdam",                        # or "OneBitLamb", "ZeroOneAdam"; case-insensitive
        "params": {"lr": 4e-4, "weight_decay": 0.01, "freeze_step": 23000,
                   "cuda_aware": false, "comm_backend_name": "nccl"}
      }
    }

The types are the optimizer classes' ``CONFIG_TYPE`` (``OneBitAdam``: :class:`OnebitAdam`,
``OneBitLamb``: :class:`OnebitLamb`, ``ZeroOneAdam``: :class:`ZeroOneAdam`; any subclass of
:class:`onebit.engine.OnebitOptimizer` that sets one). ``params`` takes the keyword arguments of
that class that are plain values (:func:`config_keys`: DeepSpeed's keys for the type and the
others, ``bucket_size``, ``kernels``, ...). Only the keys present are passed on: every default is
the optimizer's. The keys the class refuses, ``DEEPSPEED_REFUSED`` (DeepSpeed accepted and ignored
them: ``max_grad_norm``, ``eps_inside_sqrt``, ``amsgrad``, OneBitLamb's ``bias_correction``) and
``NOT_SETTINGS`` (ZeroOneAdam's ``freeze_step``), raise with the reason, whatever their value.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from . import adam, lamb, zoadam  # noqa: F401  (they register their CONFIG_TYPE)
from .backends import CommBackend
from .engine import OnebitOptimizer
from .validation import REDUCE_DTYPES, is_int, is_real

logger = logging.getLogger(__name__)

__all__ = ["ConfigError", "from_config", "load_config", "optimizer_kwargs", "config_keys", "LOOP_SECTIONS"]

OPTIMIZER_TYPE = "OneBitAdam"  # the one named in hints
_SECTION = "optimizer"
_YAML_SUFFIXES = (".yaml", ".yml")


_real, _integer = is_real, is_int


def _pair(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(_real(v) for v in value)


def _optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


# key -> (type check, what it must be), for the value types a file can hold. Ranges, and keys
# without an entry here, are checked by the optimizer itself.
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": (_real, "a number"),
    "betas": (_pair, "a list of two numbers [beta1, beta2]"),
    "eps": (_real, "a number"),
    "weight_decay": (_real, "a number"),
    "freeze_step": (lambda v: v == "auto" or _integer(v), "an integer (a number of steps) or \"auto\""),
    "freeze_bounds": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and _integer(v[0])
                      and (v[1] is None or _integer(v[1])), "a list [earliest, latest] of steps (latest may be null)"),
    "var_freeze_step": (_integer, "an integer (a number of steps)"),
    "var_update_scaler": (_integer, "an integer (variance updates per interval)"),
    "local_step_scaler": (_integer, "an integer (a number of steps)"),
    "local_step_clipper": (_integer, "an integer (the largest sync interval, in steps)"),
    "bias_correction": (lambda v: isinstance(v, bool), "true or false"),
    "cuda_aware": (lambda v: isinstance(v, bool), "true or false"),
    "overlap_backward": (lambda v: isinstance(v, bool), "true or false"),
    "reduce_dtype": (lambda v: v is None or v in REDUCE_DTYPES or v in REDUCE_DTYPES.values(),
                     " or ".join(f"\"{name}\"" for name in REDUCE_DTYPES) + " or null"),
    "error_dtype": (lambda v: v is None or v == "auto" or v in REDUCE_DTYPES or v in REDUCE_DTYPES.values(),
                    "\"auto\" or " + " or ".join(f"\"{name}\"" for name in REDUCE_DTYPES) + " or null"),
    "preconditioner_dtype": (lambda v: v is None or v == "auto" or v in REDUCE_DTYPES or v in REDUCE_DTYPES.values(),
                             "\"auto\" or " + " or ".join(f"\"{name}\"" for name in REDUCE_DTYPES) + " or null"),
    "comm_backend_name": (_optional_str, "a string such as \"gloo\", \"nccl\", \"hccl\" or \"mpi\", or null"),
    "bucket_size": (_integer, "an integer (elements per bucket)"),
    "kernels": (_optional_str, "a string such as \"auto\" or \"reference\", or null"),
    "nonfinite_grads": (lambda v: isinstance(v, str), "a string such as \"skip\" or \"raise\""),
    "divergence": (lambda v: isinstance(v, str), "a string such as \"warn\" or \"raise\""),
    "scale_block_size": (lambda v: v is None or _integer(v), "an integer (elements per scale) or null"),
    "hierarchy": (lambda v: v is None or v == "host" or _integer(v),
                  "null (flat), \"host\" or an integer (ranks per node)"),
    "hierarchy_variant": (lambda v: isinstance(v, str), "a string: \"compressed\" or \"node_mean\""),
    "compression_space": (lambda v: isinstance(v, str), "a string: \"momentum\" or \"preconditioned\""),
    "trust_ratio": (lambda v: isinstance(v, str), "a string: \"live\" or \"frozen\""),
    "update_bound": (lambda v: v is None or v == "auto" or _real(v),
                     "\"auto\", a number (1: Adam's own largest step) or null"),
    **{key: (_real, "a number")
       for key in ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min", "factor_threshold")},
}

# Sections of a DeepSpeed config that the DeepSpeed engine applies and a plain training loop must
# apply itself: section -> what to do instead. from_config names those present in a WARNING.
LOOP_SECTIONS: dict[str, str] = {
    "fp16": "fp16 loss scaling: use torch.autocast(device_type, dtype=torch.float16) and "
            "torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update())",
    "bf16": "bfloat16: use torch.autocast(device_type, dtype=torch.bfloat16) around the forward",
    "amp": "mixed precision: use torch.autocast (and torch.amp.GradScaler for float16)",
    "gradient_clipping": "clipping: call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) between "
                         "backward and step() (after the switch each rank clips its own gradient; see the "
                         "training-loop guide)",
    "scheduler": "the learning-rate schedule: use a torch.optim.lr_scheduler on the optimizer",
    "gradient_accumulation_steps": "gradient accumulation: run that many backward passes per step() yourself",
    "zero_optimization": "ZeRO: onebit does not shard optimizer state; shard with FSDP2 and pass group=",
}

# Optimizer arguments that take Python objects: arguments of from_config instead.
_NOT_IN_FILES = ("params", "backend", "group", "momentum_masks", "inner")


class ConfigError(ValueError, TypeError):
    """Several problems of one config, listed in one message (a ``ValueError`` and a ``TypeError``,
    whatever the problems' own types; a single problem raises its own exception)."""


def config_keys(cls: type[OnebitOptimizer]) -> tuple[str, ...]:
    """The keys ``optimizer.params`` takes for optimizer class ``cls``: its keyword arguments (and
    the engine's) that are plain values."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = set()
    for function in (cls.__init__, OnebitOptimizer.__init__):
        names |= {p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds}
    return tuple(sorted(names - {"self", "defaults", *_NOT_IN_FILES}))


def load_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """Return the config as a new dict: a mapping is copied (shallowly), a path is read.

    ``.json`` files are read with :mod:`json`, ``.yaml``/``.yml`` files with PyYAML (optional).
    """
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"config must be a dict or the path of a .json/.yaml file, got {type(config).__name__}"
        )
    path = Path(config)
    suffix = path.suffix.lower()
    if suffix != ".json" and suffix not in _YAML_SUFFIXES:
        raise ValueError(
            f"cannot tell the format of config file {str(path)!r} from its suffix {path.suffix!r}; "
            "name it *.json, *.yaml or *.yml, or load it yourself and pass the dict"
        )
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
    else:
        try:
            import yaml
        except ImportError as exc:
            raise ImportError(
                f"reading the YAML config {str(path)!r} needs PyYAML: pip install pyyaml "
                "(or use a .json file, or pass a dict)"
            ) from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise TypeError(
            f"config file {str(path)!r} must hold a mapping at the top level "
            f"(e.g. {{\"optimizer\": {{...}}}}), got {type(data).__name__}"
        )
    return dict(data)


def _type_error(key: str, value: Any, expected: str) -> TypeError:
    hint = ""
    if isinstance(value, str) and _real_string(value):
        hint = "; write the number without quotes"
        if "e" in value.lower() and "." not in value:
            # PyYAML reads YAML 1.1, where 1e-3 (no dot) is a string, not a float.
            hint += f" (in YAML, {value} without a dot is read as a string: write e.g. 1.0e-3)"
    return TypeError(
        f"optimizer.params.{key} must be {expected}, got {value!r} of type {type(value).__name__}{hint}"
    )


def _real_string(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _optimizer_type(kind: Any) -> tuple[str, type[OnebitOptimizer]]:
    """The registered name (case-insensitive) and class of the config's ``optimizer.type``."""
    if not isinstance(kind, str):
        raise TypeError(f"optimizer.type must be a string, got {kind!r} of type {type(kind).__name__}")
    types = OnebitOptimizer.registered()
    matches = [name for name in types if name.lower() == kind.lower()]
    if not matches:
        *first, last = [repr(name) for name in types]
        names = f"{', '.join(first)} or {last}"
        raise ValueError(
            f"unsupported optimizer type {kind!r}; onebit builds {names} (case-insensitive): "
            f"set \"type\": \"{OPTIMIZER_TYPE}\", for example, or build {kind!r} another way"
        )
    return matches[0], types[matches[0]]


def optimizer_kwargs(config: Mapping[str, Any]) -> tuple[type[OnebitOptimizer], dict[str, Any], list[str]]:
    """Validate a (whole) config; return the optimizer class its optimizer section names, the
    keyword arguments found there, and the names of the other top-level sections (not read by
    onebit)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping, got {type(config).__name__}")
    if _SECTION not in config:
        found = ", ".join(repr(k) for k in config) or "none"
        raise ValueError(
            f"config has no 'optimizer' section (top-level keys: {found}); add "
            f"{{\"optimizer\": {{\"type\": \"{OPTIMIZER_TYPE}\", \"params\": {{\"lr\": ..., \"freeze_step\": ...}}}}}}"
        )
    others = sorted(str(k) for k in config if k != _SECTION)
    section = config[_SECTION]
    if not isinstance(section, Mapping):
        raise TypeError(
            f"config 'optimizer' must be a mapping {{\"type\": ..., \"params\": {{...}}}}, got {type(section).__name__}"
        )
    extra = sorted(str(k) for k in section if k not in ("type", "params"))
    if extra:
        raise ValueError(f"unknown keys {extra} in the 'optimizer' section; it takes only 'type' and 'params'")
    if "type" not in section:
        raise ValueError(f"the 'optimizer' section has no 'type'; set \"type\": \"{OPTIMIZER_TYPE}\"")
    kind, cls = _optimizer_type(section["type"])
    params = section.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise TypeError(f"optimizer.params must be a mapping of keyword arguments, got {type(params).__name__}")
    kwargs: dict[str, Any] = {}
    problems = [problem for key, value in params.items()
                if (problem := _param_problem(kind, cls, key, value)) is not None]
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigError(f"{len(problems)} problems in optimizer.params of {kind}:\n"
                          + "\n".join(f"  {i}. {problem}" for i, problem in enumerate(problems, 1)))
    for key, value in params.items():
        kwargs[key] = tuple(value) if key == "betas" else value
    return cls, kwargs, others


def _param_problem(kind: str, cls: type[OnebitOptimizer], key: Any, value: Any) -> Exception | None:
    """What is wrong with ``optimizer.params.<key> = value`` for ``cls``, as the exception to raise;
    None when nothing is (ranges are the optimizer's to check)."""
    ignored, foreign, keys = cls.DEEPSPEED_REFUSED, cls.NOT_SETTINGS, config_keys(cls)
    if key in ignored:
        return ValueError(
            f"optimizer.params.{key} is not supported by {kind} ({ignored[key]}); DeepSpeed accepted "
            f"and ignored it, onebit does not: remove {key!r} from the config"
        )
    if key in foreign:
        return ValueError(f"optimizer.params.{key} is not a setting of {kind} ({foreign[key]}): "
                          f"remove {key!r} from the config")
    if key == "inner" and "inner" in inspect.signature(cls.__init__).parameters:
        return ValueError("optimizer.params.inner cannot be written in a file (it is a torch.optim optimizer class "
                          "or factory): remove it and pass from_config(params, config, inner=...) instead")
    if key not in keys:
        valid = ", ".join(repr(k) for k in keys)
        return ValueError(f"unknown key {key!r} in optimizer.params of {kind}; expected some of {valid}")
    check, expected = _CHECKS.get(key, (lambda v: True, ""))
    return None if check(value) else _type_error(key, value, expected)


def from_config(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    config: Mapping[str, Any] | str | os.PathLike,
    *,
    backend: CommBackend | None = None,
    group: Any = None,
    momentum_masks: Mapping[torch.Tensor, torch.Tensor] | None = None,
    inner: Any = None,
) -> OnebitOptimizer:
    """Build a ready :class:`OnebitAdam`, :class:`OnebitLamb` or :class:`ZeroOneAdam` (with its
    backend) from a DeepSpeed-style config.

    Args:
        params: the model's parameters or param groups, as for any optimizer.
        config: a dict, or the path of a ``.json`` or ``.yaml``/``.yml`` file (YAML needs PyYAML).
            A whole DeepSpeed config is fine: only ``"optimizer"`` is read; the other top-level
            sections are named in one log line and otherwise ignored.
        backend: a :class:`onebit.backends.CommBackend` object (then the config must not set
            ``comm_backend_name``).
        group: the torch.distributed process group or mpi4py communicator of the data-parallel
            ranks (default: the whole job).
        momentum_masks: ``{param: mask}``, as for the optimizer (not expressible in a file).
        inner: OnebitDiLoCo's inner optimizer (a ``torch.optim`` class or factory; not expressible
            in a file); only with a ``"OneBitDiLoCo"`` config.

    Raises:
        ValueError / TypeError: a missing optimizer section, another optimizer type, an unknown
            key in ``params`` (the message lists the valid ones), or a value of the wrong type.
    """
    config = load_config(config)
    cls, kwargs, others = optimizer_kwargs(config)
    if backend is not None and "comm_backend_name" in kwargs:
        raise ValueError(
            f"the config sets comm_backend_name={kwargs['comm_backend_name']!r} and backend= was passed too; "
            "remove comm_backend_name from the config or do not pass backend="
        )
    if inner is not None:
        if "inner" not in inspect.signature(cls.__init__).parameters:
            raise ValueError(f"from_config(inner=...) applies to OneBitDiLoCo configs; this config's optimizer is "
                             f"{config['optimizer'].get('type')!r}: leave inner out")
        kwargs["inner"] = inner
    optimizer = cls(params, backend=backend, group=group, momentum_masks=momentum_masks, **kwargs)
    if others and optimizer.backend.rank == 0:
        _tell_sections(config, others)
    return optimizer


def _enabled(value: Any) -> bool:
    """Whether a config section asks for something (``{"enabled": false}``, ``0``, ``null`` do not;
    ``"auto"``, a value another tool fills in, does)."""
    if isinstance(value, Mapping):
        value = value.get("enabled", True)
    return value is not None and value is not False and value != 0


def _tell_sections(config: Mapping[str, Any], others: list[str]) -> None:
    """One log line naming the sections onebit does not read: a WARNING, saying what to do, when
    some are ones a plain loop must apply itself (:data:`LOOP_SECTIONS`), else INFO."""
    loop = [name for name in others if name in LOOP_SECTIONS and _enabled(config[name])]
    rest = ", ".join(name for name in others if name not in loop)
    if not loop:
        logger.info("onebit: config sections not read by onebit (apply them yourself if needed): %s", rest)
        return
    todo = "; ".join(f"{name!r}: {LOOP_SECTIONS[name]}" for name in loop)
    logger.warning("onebit: from_config builds the optimizer only; outside the DeepSpeed engine your loop must apply "
                   "these sections itself: %s%s", todo, f" (not read either: {rest})" if rest else "")
