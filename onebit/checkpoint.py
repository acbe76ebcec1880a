"""The ``state_dict`` contract of :class:`onebit.OnebitAdam`.

Format (version 1)::

    {
      "state": {index: {"exp_avg": Tensor, "exp_avg_sq": Tensor}, ...},   # shaped like each param
      "param_groups": [{"lr", "betas", "eps", "weight_decay", "bias_correction", "compress",
                        "params": [index, ...]}, ...],
      "onebit": {"format_version": 1, "step": int, "freeze_step": int},
    }

Parameters are numbered in param-group order, as ``torch.optim`` does. Nothing depends on the
world size: compression errors are rank-local and are reset on load; masks belong to the model
code and are given to the constructor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .optimizer import OnebitAdam

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "bias_correction")

__all__ = ["FORMAT_VERSION", "build_state_dict", "load_state_dict", "save_checkpoint", "load_checkpoint"]


def build_state_dict(opt: OnebitAdam) -> dict[str, Any]:
    index_of: dict[int, int] = {}
    groups = []
    for group in opt.param_groups:
        ids = []
        for p in group["params"]:
            index_of[id(p)] = len(index_of)
            ids.append(index_of[id(p)])
        saved = {k: (tuple(v) if k == "betas" else v) for k, v in group.items() if k != "params"}
        saved["params"] = ids
        groups.append(saved)
    state = {
        index_of[id(p)]: {"exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone()}
        for p, s in opt.state.items()
    }
    meta = {"format_version": FORMAT_VERSION, "step": opt.step_count, "freeze_step": opt.freeze_step}
    return {"state": state, "param_groups": groups, "onebit": meta}


def _fail(message: str) -> None:
    raise ValueError(f"cannot load optimizer state: {message}")


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _validate(opt: OnebitAdam, sd: Any) -> tuple[int, int, list[dict[str, Any]], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Check everything; return (step, freeze_step, hyperparameters per group, state by index)."""
    from .optimizer import _check_group_hyperparameters

    if not isinstance(sd, Mapping):
        _fail(f"expected a dict from OnebitAdam.state_dict(), got {type(sd).__name__}")
    missing = [k for k in ("state", "param_groups", "onebit") if k not in sd]
    if missing:
        hint = " (this looks like a torch.optim state dict, not OnebitAdam's)" if "onebit" in missing else ""
        _fail(f"missing keys {missing}{hint}")
    meta = sd["onebit"]
    if not isinstance(meta, Mapping):
        _fail(f"'onebit' must be a dict, got {type(meta).__name__}")
    version = _check_int("format_version", meta.get("format_version"), 1)
    if version > FORMAT_VERSION:
        _fail(f"format_version {version} is newer than this onebit supports ({FORMAT_VERSION}); upgrade onebit")
    step = _check_int("step", meta.get("step"), 0)
    freeze_step = _check_int("freeze_step", meta.get("freeze_step"), 1)

    groups = sd["param_groups"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(opt.param_groups):
        count = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
        _fail(f"the checkpoint has {count} param groups, this optimizer has {len(opt.param_groups)}")
    hypers = []
    params_by_index: dict[int, torch.Tensor] = {}
    for g, (saved, live) in enumerate(zip(groups, opt.param_groups)):
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
            _fail(f"param group {g} is not a dict with a 'params' list")
        if len(saved["params"]) != len(live["params"]):
            _fail(f"param group {g} has {len(saved['params'])} parameters in the checkpoint, "
                  f"{len(live['params'])} here; was it saved from a different model?")
        absent = [k for k in _HYPERPARAMETERS if k not in saved]
        if absent:
            _fail(f"param group {g} lacks hyperparameters {absent}")
        if saved.get("compress", True) != live["compress"]:
            _fail(f"param group {g} has compress={saved.get('compress')!r} in the checkpoint and "
                  f"compress={live['compress']!r} here; build the optimizer with the same groups")
        hyper = {k: saved[k] for k in _HYPERPARAMETERS}
        hyper["betas"] = tuple(hyper["betas"]) if isinstance(hyper["betas"], (list, tuple)) else hyper["betas"]
        try:
            _check_group_hyperparameters({**hyper, "compress": live["compress"]})
        except (TypeError, ValueError) as exc:
            _fail(f"param group {g}: {exc}")
        hypers.append(hyper)
        for index, p in zip(saved["params"], live["params"]):
            params_by_index[_check_int(f"param index in group {g}", index, 0)] = p

    state = sd["state"]
    if not isinstance(state, Mapping):
        _fail(f"'state' must be a dict, got {type(state).__name__}")
    loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for index, p in params_by_index.items():
        if p not in opt.state:
            continue  # not trainable here (requires_grad=False): nothing to restore
        entry = state.get(index)
        if not isinstance(entry, Mapping) or "exp_avg" not in entry or "exp_avg_sq" not in entry:
            _fail(f"no exp_avg/exp_avg_sq for parameter {index} of shape {tuple(p.shape)}; "
                  "was it saved from a different model?")
        pair = (entry["exp_avg"], entry["exp_avg_sq"])
        for name, t in zip(("exp_avg", "exp_avg_sq"), pair):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                _fail(f"{name} of parameter {index} must be a float tensor, got {type(t).__name__}")
            if t.shape != p.shape:
                _fail(f"{name} of parameter {index} has shape {tuple(t.shape)}, the parameter has "
                      f"{tuple(p.shape)}; was it saved from a different model?")
            if not bool(torch.isfinite(t).all()):
                _fail(f"{name} of parameter {index} contains NaN or inf; the checkpoint is corrupt")
        if bool((pair[1] < 0).any()):
            _fail(f"exp_avg_sq of parameter {index} has negative entries; the checkpoint is corrupt")
        loaded[index] = pair
    return step, freeze_step, hypers, loaded


def load_state_dict(opt: OnebitAdam, sd: Any, *, log: bool = True) -> None:
    step, freeze_step, hypers, loaded = _validate(opt, sd)
    # Validation is complete: from here on nothing can fail half-way on the user's input.
    index = 0
    for group, hyper in zip(opt.param_groups, hypers):
        for p in group["params"]:
            if index in loaded:
                exp_avg, exp_avg_sq = loaded[index]
                opt.state[p]["exp_avg"].copy_(exp_avg)
                opt.state[p]["exp_avg_sq"].copy_(exp_avg_sq)
            index += 1
        group.update(hyper)
    if freeze_step != opt.freeze_step:
        logger.info("onebit: freeze_step %d restored from the checkpoint (was %d)", freeze_step, opt.freeze_step)
    opt.freeze_step = freeze_step
    opt._restore_after_load(step, log=log)


# ----------------------------------------------------------------------------- files

_FILE_MARKER = "onebit-checkpoint"


def _atomic_save(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` so that a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read(path: Path) -> Any:
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged zip or pickle
        raise ValueError(f"checkpoint file {path} is truncated or corrupt ({type(exc).__name__}: {exc})") from exc


def _rank_path(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.name}.rank{rank}")


def save_checkpoint(path: str | os.PathLike, optimizer: OnebitAdam, *, model: torch.nn.Module | None = None,
                    extra: dict[str, Any] | None = None, exact_resume: bool = False) -> None:
    """Save atomically (temporary file, fsync, rename) on rank 0: the optimizer's ``state_dict()``,
    the model's ``state_dict()`` if given, and ``extra`` (plain data: ints, floats, strings,
    tensors, lists, dicts). Call it on every rank.

    ``exact_resume=True``: every rank also writes its own compression errors to
    ``<path>.rank<r>``, so that :func:`load_checkpoint` on the same world size continues the run
    bit for bit. All ranks wait for each other at the end (a barrier).
    """
    path = Path(path)
    backend = optimizer.backend
    if backend.rank == 0:
        payload = {
            "format": _FILE_MARKER,
            "optimizer": optimizer.state_dict(),
            "model": None if model is None else {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "extra": extra,
            "world_size": backend.world_size,
        }
        _atomic_save(payload, path)
    if exact_resume:
        errors = [(w.cpu().clone(), s.cpu().clone()) for w, s in optimizer._compression_errors()]
        _atomic_save({"format": _FILE_MARKER + "-rank", "world_size": backend.world_size, "rank": backend.rank,
                      "step": optimizer.step_count, "layout": optimizer._layout_digest().hex(), "errors": errors},
                     _rank_path(path, backend.rank))
    backend.barrier()


def load_checkpoint(path: str | os.PathLike, optimizer: OnebitAdam, *, model: torch.nn.Module | None = None,
                    exact_resume: bool = False) -> dict[str, Any] | None:
    """Load a :func:`save_checkpoint` file into ``optimizer`` (and ``model``); return ``extra``.

    Everything is validated before anything changes: a truncated or corrupt file, a checkpoint of
    a different model, or a newer format raise ``ValueError`` and leave model and optimizer as
    they were. Compression errors are reset, unless ``exact_resume`` and this rank's
    ``<path>.rank<r>`` file matches the world size, the layout and the step; otherwise the reset
    is logged once on rank 0.
    """
    path = Path(path)
    payload = _read(path)
    if not isinstance(payload, Mapping) or payload.get("format") != _FILE_MARKER:
        _fail(f"{path} is not a onebit checkpoint file (save it with onebit.save_checkpoint)")
    sd = optimizer._run_load_pre_hooks(payload["optimizer"])
    _validate(optimizer, sd)
    if model is not None:
        saved = payload.get("model")
        if not isinstance(saved, Mapping):
            _fail(f"{path} holds no model state; save it with save_checkpoint(..., model=model)")
        live = model.state_dict()
        if set(saved) != set(live):
            missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
            _fail(f"the checkpoint is of a different model (missing {missing[:5]}, unexpected {unexpected[:5]})")
        for key, value in saved.items():
            if not isinstance(value, torch.Tensor) or value.shape != live[key].shape:
                _fail(f"the checkpoint is of a different model: {key} has shape "
                      f"{tuple(getattr(value, 'shape', ()))}, the model has {tuple(live[key].shape)}")
    errors = None
    backend = optimizer.backend
    reason = "exact_resume was not requested"
    if exact_resume:
        rank_file = _rank_path(path, backend.rank)
        try:
            mine = _read(rank_file)
        except (FileNotFoundError, ValueError) as exc:
            mine, reason = None, str(exc)
        if mine is not None:
            if mine.get("world_size") != backend.world_size:
                reason = f"it was saved on {mine.get('world_size')} ranks, this run has {backend.world_size}"
            elif mine.get("layout") != optimizer._layout_digest().hex() or mine.get("step") != sd["onebit"]["step"]:
                reason = f"{rank_file} does not match this optimizer's layout or step"
            else:
                errors = mine["errors"]
    # Everything is checked: apply.
    if model is not None:
        model.load_state_dict(payload["model"])
    load_state_dict(optimizer, sd, log=False)
    if errors is not None:
        for (worker, server), (w, s) in zip(optimizer._compression_errors(), errors):
            worker.copy_(w)
            server.copy_(s)
    optimizer._run_load_post_hooks()
    if backend.rank == 0:
        step = sd["onebit"]["step"]
        if errors is not None:
            logger.info("onebit: loaded %s at step %d; compression errors restored (exact resume)", path, step)
        elif exact_resume:
            logger.info("onebit: loaded %s at step %d; exact resume not possible (%s); compression errors reset",
                        path, step, reason)
        else:
            logger.info("onebit: loaded %s at step %d; compression errors reset", path, step)
    return payload.get("extra")
