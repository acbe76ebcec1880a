"""Checkpoint files: the optimizer's ``state_dict`` (:mod:`onebit.state`), the model's, and
plain extras, written atomically on rank 0; with ``exact_resume``, each rank's compression errors
beside them, restored when the world size, the layout and the step match.

Uses only the optimizers' public methods (``state_dict``, ``restore``, ``compression_errors``,
``layout_digest``, ``step_count``, ``backend``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .engine import OnebitOptimizer

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint"]


def _fail(message: str) -> None:
    raise ValueError(f"cannot load checkpoint: {message}")


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


def save_checkpoint(path: str | os.PathLike, optimizer: OnebitOptimizer, *, model: torch.nn.Module | None = None,
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
        errors = [(w.cpu().clone(), s.cpu().clone()) for w, s in optimizer.compression_errors()]
        _atomic_save({"format": _FILE_MARKER + "-rank", "world_size": backend.world_size, "rank": backend.rank,
                      "step": optimizer.step_count, "layout": optimizer.layout_digest(), "errors": errors},
                     _rank_path(path, backend.rank))
    backend.barrier()


def load_checkpoint(path: str | os.PathLike, optimizer: OnebitOptimizer, *, model: torch.nn.Module | None = None,
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
    sd = payload.get("optimizer")
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
    if exact_resume:
        rank_file = _rank_path(path, backend.rank)
        try:
            mine = _read(rank_file)
        except (FileNotFoundError, ValueError) as exc:
            mine, reason = None, str(exc)
        if mine is not None:
            saved_step = sd.get("onebit", {}).get("step") if isinstance(sd, Mapping) else None
            if mine.get("world_size") != backend.world_size:
                reason = f"it was saved on {mine.get('world_size')} ranks, this run has {backend.world_size}"
            elif mine.get("layout") != optimizer.layout_digest() or mine.get("step") != saved_step:
                reason = f"{rank_file} does not match this optimizer's layout or step"
            else:
                errors = mine["errors"]
        if errors is None and backend.rank == 0:
            logger.info("onebit: exact resume not possible for %s (%s)", path, reason)
    # The optimizer validates everything before it changes anything; the model was checked above.
    optimizer.restore(sd, compression_errors=errors)
    if model is not None:
        model.load_state_dict(payload["model"])
    return payload.get("extra")
