"""Checkpoint files that are all or nothing.

A checkpoint at ``path`` is a small **manifest** (``path`` itself) naming its **parts**: rank 0's
state part (the optimizer's ``state_dict``, the model's, and plain extras) and, with
``exact_resume``, one part per rank holding that rank's compression errors. Every part has a name
of its own (``<path>.state-<id>``, ``<path>.rank<r>-<id>``, a fresh random ``id`` per save) and
its SHA-256 in the manifest; each file is written atomically (temporary file, fsync, rename).

Saving: every rank writes its part, the ranks exchange the parts' ids and digests (one
all-gather, the only collective), and rank 0 commits by replacing the manifest. A process killed
at any moment leaves the previous manifest, whose parts are all still there (a rank deletes its
older parts only once they cannot be named by the manifest on disk), or the new one. Loading
reads the manifest, checks every part it needs against its digest, and, with ``exact_resume``,
lets the ranks agree (one all-reduce) to restore the errors on every rank or reset them on every
rank. Stale temporary files of killed writers are removed at the next save.

The functions that communicate are collective: every rank of the optimizer's group calls them
(``save_checkpoint`` with ``exact_resume``, ``load_checkpoint`` with ``exact_resume``,
``load_compression_errors``). Over a torch.distributed group the ranks first meet in a handshake
through the group's store, bounded by ``timeout_s``: a call made on some ranks only (under
``if rank == 0:``) raises a ``RuntimeError`` naming the ranks that did not come, instead of waiting
in a collective forever. ``save_checkpoint`` without ``exact_resume`` communicates nothing and
may be called on rank 0 alone.

Uses only the optimizers' public methods (``state_dict``, ``restore``, ``compression_errors``,
``layout_digest``, ``step_count``, ``backend``, ``param_groups``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .engine import OnebitOptimizer
from .shards import is_dtensor, local
from .state import saved_step

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "save_compression_errors", "load_compression_errors"]

#: How long the ranks of a collective checkpoint call wait for each other (seconds) by default.
HANDSHAKE_TIMEOUT_S = 300.0
# The handshakes made so far in this process, per group (every rank makes the same sequence).
_HANDSHAKES: dict[str, int] = {}

_FILE_MARKER = "onebit-checkpoint"
_MANIFEST_VERSION = 2
_ID_BYTES = 8


def _fail(message: str) -> None:
    raise ValueError(f"cannot load checkpoint: {message}")


# ----------------------------------------------------------------------------- files


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(data: bytes, path: Path) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _read(path: Path, digest: str | None = None) -> Any:
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    data = path.read_bytes()
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"checkpoint file {path} does not match the digest its manifest records (damaged or replaced)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged zip or pickle
        raise ValueError(f"checkpoint file {path} is truncated or corrupt ({type(exc).__name__}: {exc})") from exc


def _part_path(path: Path, kind: str, part_id: str) -> Path:
    return path.with_name(f"{path.name}.{kind}-{part_id}")


def _device(optimizer: OnebitOptimizer) -> torch.device:
    errors = optimizer.compression_errors()
    if errors:
        return errors[0][0].device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return params[0].device if params else torch.device("cpu")


def _store_of(optimizer: OnebitOptimizer) -> tuple[Any, str] | None:
    """The torch.distributed store and a name of the optimizer's process group; None when the
    transport is not a torch.distributed group (MPI, a custom backend) or has no store to reach."""
    import torch.distributed as dist

    from .backends.torch_dist import TorchDistBackend

    backend = optimizer.backend
    if not isinstance(backend, TorchDistBackend) or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(backend.group or dist.group.WORLD)
    except (AttributeError, RuntimeError, ValueError):  # (a torch without them, a group without a store)
        return None
    return store, hashlib.sha256(str(ranks).encode()).hexdigest()[:16]


def _handshake(optimizer: OnebitOptimizer, call: str, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until every rank of the optimizer's group has made this call;
    raise ``RuntimeError`` naming the ranks that did not (see the module docstring)."""
    import datetime

    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    backend = optimizer.backend
    found = _store_of(optimizer) if backend.world_size > 1 else None
    if found is None:
        return
    store, group = found
    count = _HANDSHAKES[group] = _HANDSHAKES.get(group, 0) + 1
    keys = [f"onebit/checkpoint/{group}/{count}/{r}" for r in range(backend.world_size)]
    store.set(keys[backend.rank], call)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # (torch's DistStoreError is one)
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:  # (they came as the wait ended)
            return
        # taken back, so that a later call made on every rank meets again
        store.delete_key(keys[backend.rank])
        _HANDSHAKES[group] -= 1
        raise RuntimeError(
            f"onebit.{call}: rank {backend.rank} waited {timeout_s:g} s for ranks {missing} of the optimizer's group of "
            f"{backend.world_size}, which did not call it. It is collective: call it on every rank, with the same "
            f"arguments, not under `if rank == 0:` (save_checkpoint without exact_resume communicates nothing and may be "
            f"called on rank 0 alone). Pass timeout_s= to wait longer when ranks reach it far apart") from exc


def _exchange(optimizer: OnebitOptimizer, part_id: str, digest: str) -> list[tuple[str, str]]:
    """Every rank's (part id, digest): one all-gather."""
    backend = optimizer.backend
    mine = torch.tensor(list(bytes.fromhex(part_id) + bytes.fromhex(digest)), dtype=torch.uint8,
                        device=_device(optimizer))
    everyone = torch.empty(backend.world_size, mine.numel(), dtype=torch.uint8, device=mine.device)
    backend.all_gather(everyone, mine)
    rows = [bytes(row.cpu().tolist()) for row in everyone]
    return [(row[:_ID_BYTES].hex(), row[_ID_BYTES:].hex()) for row in rows]


def _manifest(path: Path) -> Mapping[str, Any] | None:
    """The committed manifest at ``path``, or None when there is none (or it is not one)."""
    try:
        manifest = _read(path)
    except (FileNotFoundError, ValueError):
        return None
    if isinstance(manifest, Mapping) and manifest.get("format") == _FILE_MARKER and "parts" in manifest:
        return manifest
    return None


def _clean(path: Path, kind: str, keep: set[str]) -> None:
    """Remove this writer's parts of ``kind`` whose id is not in ``keep``, and stale temporary files."""
    prefix = f"{path.name}.{kind}-"
    for entry in path.parent.glob(f"*{prefix}*"):
        name = entry.name
        stale_tmp = name.startswith(f".{prefix}") and ".tmp-" in name
        old_part = name.startswith(prefix) and name[len(prefix):] not in keep
        if stale_tmp or old_part:
            try:
                entry.unlink()
            except FileNotFoundError:
                pass


def _write_rank_part(path: Path, optimizer: OnebitOptimizer, model: torch.nn.Module | None, part_id: str) -> str:
    """This rank's part of an exact-resume save (its compression errors; with ``model``, its own
    optimizer and model state too); returns its digest."""
    backend = optimizer.backend
    errors = [(w.cpu().clone(), s.cpu().clone()) for w, s in optimizer.compression_errors()]
    part = {"format": _FILE_MARKER + "-rank", "world_size": backend.world_size, "rank": backend.rank,
            "step": optimizer.step_count, "layout": optimizer.layout_digest(), "errors": errors}
    if model is not None:
        part["optimizer"] = optimizer.state_dict()
        part["model"] = _model_state(model)
    data = _serialize(part)
    _atomic_write(data, _part_path(path, f"rank{backend.rank}", part_id))
    return hashlib.sha256(data).hexdigest()


def _refuse_dtensors(optimizer: OnebitOptimizer) -> None:
    if any(is_dtensor(p) for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "save_checkpoint writes rank 0's state, and this optimizer's parameters are DTensors (FSDP2 or tensor "
            "parallel) whose shards live on other ranks too; save sharded state with torch.distributed.checkpoint: "
            "dcp.save({'model': get_model_state_dict(model), 'optim': get_optimizer_state_dict(model, optimizer)}, "
            "checkpoint_id=...) (see examples/fsdp)")


def save_checkpoint(path: str | os.PathLike, optimizer: OnebitOptimizer, *, model: torch.nn.Module | None = None,
                    extra: dict[str, Any] | None = None, exact_resume: bool = False,
                    timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Save a checkpoint, all or nothing (see the module docstring): rank 0's state part (the
    optimizer's ``state_dict()``, the model's ``state_dict()`` if given, and ``extra``: plain data,
    ints, floats, strings, tensors, lists, dicts), then the manifest ``path``. Call it on every
    rank, with the same arguments.

    ``exact_resume=True``: every rank also writes its own compression errors as a part (and,
    while the ranks' replicas differ, as between the syncs of ``ZeroOneAdam``, its own optimizer
    state and model state: ``model`` is then required), so that :func:`load_checkpoint` on the
    same world size continues the run bit for bit; the ranks then exchange their parts' digests
    (one all-gather) before rank 0 commits, and the call returns on every rank once rank 0 has
    committed (a 4-byte all-reduce; raising on every rank if it could not); it is then collective:
    the ranks first wait for each
    other at most ``timeout_s`` seconds, and a rank that waits longer raises ``RuntimeError``
    naming the ranks that did not call it. Without it rank 0 commits alone and the other ranks
    write nothing, so calling it on rank 0 alone works too (as nanoGPT saves); a load then gives
    every rank rank 0's state (between the syncs of ``ZeroOneAdam`` and ``OnebitDiLoCo`` call
    ``optimizer.synchronize()`` on every rank first, so that rank 0's replica is everyone's).
    """
    _refuse_dtensors(optimizer)
    path = Path(path)
    backend = optimizer.backend
    rank, n = backend.rank, backend.world_size
    if exact_resume:
        _handshake(optimizer, "save_checkpoint(exact_resume=True)", timeout_s)
    own = exact_resume and not optimizer.replicas_identical  # the same on every rank
    if own and model is None:
        raise ValueError(f"exact_resume at step {optimizer.step_count}: the ranks hold different parameters "
                         f"(between the syncs of {type(optimizer).__name__}), so every rank must save its own; "
                         "pass model=model to save_checkpoint")
    part_id = secrets.token_hex(_ID_BYTES)
    digest = _write_rank_part(path, optimizer, model if own else None, part_id) if exact_resume else None
    if rank == 0:
        state = _serialize({
            "format": _FILE_MARKER + "-state",
            "optimizer": optimizer.state_dict(),
            "model": None if model is None else _model_state(model),
            "extra": extra,
        })
        state_digest = hashlib.sha256(state).hexdigest()
        _atomic_write(state, _part_path(path, "state", part_id))
    parts = _exchange(optimizer, part_id, digest) if exact_resume else None
    if exact_resume:
        # Every rank's part is written; rank 0 has finished every earlier save (it committed it
        # before joining this all-gather), so the manifest on disk names this save's parts or the
        # previous save's: keep those, remove older ones.
        committed = _manifest(path)
        previous = committed["parts"]["ranks"][rank][0] if (
            committed and committed["parts"].get("ranks") and len(committed["parts"]["ranks"]) > rank) else None
        _clean(path, f"rank{rank}", {part_id, previous} - {None})
    failure = None
    if rank == 0:
        manifest = {"format": _FILE_MARKER, "version": _MANIFEST_VERSION, "world_size": n,
                    "step": optimizer.step_count, "layout": optimizer.layout_digest(),
                    "parts": {"state": (part_id, state_digest), "ranks": parts}}
        try:
            _atomic_write(_serialize(manifest), path)  # the commit
        except BaseException as exc:  # (said to the other ranks below, then raised)
            failure = exc
        else:
            _clean(path, "state", {part_id})
            for stale in path.parent.glob(f".{path.name}.tmp-*"):  # a manifest whose writer was killed
                stale.unlink(missing_ok=True)
    if exact_resume:
        _agree_committed(optimizer, path, failure)
    elif failure is not None:
        raise failure


def _agree_committed(optimizer: OnebitOptimizer, path: Path, failure: BaseException | None) -> None:
    """After an exact save: rank 0 says whether it committed (one 4-byte all-reduce), so that the
    call returns on every rank once the checkpoint is on disk (a load right after it finds it), and
    raises on every rank when rank 0 could not commit."""
    flag = torch.zeros(1, device=_device(optimizer))
    if optimizer.backend.rank == 0 and failure is not None:
        flag.fill_(1.0)
    optimizer.backend.all_reduce_mean_(flag)
    if failure is not None:
        raise failure
    if flag.item() > 0:
        raise RuntimeError(f"save_checkpoint: rank 0 could not commit the checkpoint at {path} (see rank 0's error); "
                           "nothing was saved there")


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _read_state(path: Path, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
    if "parts" not in manifest:  # a single-file checkpoint of onebit 0.1
        return manifest
    part_id, digest = manifest["parts"]["state"]
    state = _read(_part_path(path, "state", part_id), digest)
    if not isinstance(state, Mapping) or state.get("format") != _FILE_MARKER + "-state":
        _fail(f"the state part of {path} is not a onebit checkpoint part")
    return state


def _own_part(path: Path, manifest: Mapping[str, Any], optimizer: OnebitOptimizer, step: Any,
              model: torch.nn.Module | None) -> tuple[Any, str]:
    """(this rank's part, or None; the reason when None)."""
    backend = optimizer.backend
    ranks = manifest.get("parts", {}).get("ranks")
    if not ranks:
        return None, "the checkpoint was saved without exact_resume"
    if len(ranks) != backend.world_size or manifest.get("world_size") != backend.world_size:
        return None, f"it was saved on {len(ranks)} ranks, this run has {backend.world_size}"
    if manifest.get("layout") != optimizer.layout_digest():
        return None, "it was saved with another parameter layout"
    part_id, digest = ranks[backend.rank]
    try:
        mine = _read(_part_path(path, f"rank{backend.rank}", part_id), digest)
    except (FileNotFoundError, ValueError) as exc:
        return None, str(exc)
    if mine.get("step") != step or mine.get("rank") != backend.rank:
        return None, f"rank part of {path} does not match the step or rank"
    if "optimizer" in mine and model is None:
        return None, "this rank's parameters were saved with its state; pass model=model to load them"
    mismatch = _model_mismatch(mine["model"], model) if "model" in mine and model is not None else None
    return (None, mismatch) if mismatch else (mine, "")


def _everywhere_or_nowhere(optimizer: OnebitOptimizer, mine: Any, reason: str) -> tuple[Any, str]:
    """What this rank can restore (``mine``, or None and why), agreed over the optimizer's group
    (one all-reduce): every rank restores, or none does."""
    backend = optimizer.backend
    if backend.world_size > 1:
        flag = torch.tensor([0.0 if mine is None else 1.0], device=_device(optimizer))
        backend.all_reduce_mean_(flag)
        if mine is not None and float(flag.item()) < 1.0:
            return None, "another rank cannot restore its part"
    return mine, reason


def _model_mismatch(saved: Any, model: torch.nn.Module) -> str | None:
    """Why ``saved`` cannot be loaded into ``model``, or None."""
    if not isinstance(saved, Mapping):
        return "it holds no model state; save it with save_checkpoint(..., model=model)"
    live = model.state_dict()
    if set(saved) != set(live):
        missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        return f"the checkpoint is of a different model (missing {missing[:5]}, unexpected {unexpected[:5]})"
    for key, value in saved.items():
        if not isinstance(value, torch.Tensor) or value.shape != live[key].shape:
            return (f"the checkpoint is of a different model: {key} has shape "
                    f"{tuple(getattr(value, 'shape', ()))}, the model has {tuple(live[key].shape)}")
    return None


def load_checkpoint(path: str | os.PathLike, optimizer: OnebitOptimizer, *, model: torch.nn.Module | None = None,
                    exact_resume: bool = False, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> dict[str, Any] | None:
    """Load the checkpoint committed at ``path`` into ``optimizer`` (and ``model``); return
    ``extra``. Call it on every rank, with the same arguments.

    Everything is validated before anything changes: a missing, truncated or corrupt file or
    part, a checkpoint of a different model, or a newer format raise ``ValueError`` and leave model
    and optimizer as they were. Compression errors are reset, unless ``exact_resume``: then every
    rank checks its own part (world size, layout, step, digest) and the ranks agree with one
    all-reduce to restore on every rank or reset on every rank; every rank logs what it did (the
    ranks first meet as in :func:`save_checkpoint`, within ``timeout_s``). A checkpoint saved with
    ``exact_resume`` and loaded without it has its errors reset, and rank 0 says so in a WARNING.
    """
    path = Path(path)
    manifest = _read(path)
    if not isinstance(manifest, Mapping) or manifest.get("format") != _FILE_MARKER:
        _fail(f"{path} is not a onebit checkpoint file (save it with onebit.save_checkpoint)")
    if manifest.get("version", 1) > _MANIFEST_VERSION:
        _fail(f"{path} has manifest version {manifest.get('version')}, newer than this onebit reads; upgrade onebit")
    payload = _read_state(path, manifest)
    sd = payload.get("optimizer")
    model_state = None if model is None else payload.get("model")
    mismatch = None if model is None else _model_mismatch(model_state, model)
    if mismatch:
        _fail(f"{path}: {mismatch}")
    mine = None
    backend = optimizer.backend
    if not exact_resume and manifest.get("parts", {}).get("ranks") and backend.rank == 0:
        logger.warning("onebit: %s was saved with exact_resume=True and is loaded without it: the compression errors "
                       "it holds are reset. Pass exact_resume=True to load_checkpoint to continue bit for bit (on the "
                       "world size, layout and step it was saved with)", path)
    if exact_resume:
        _handshake(optimizer, "load_checkpoint(exact_resume=True)", timeout_s)
        step = saved_step(sd)
        mine, reason = _everywhere_or_nowhere(optimizer, *_own_part(path, manifest, optimizer, step, model))
        if mine is None:
            logger.info("onebit: rank %d: exact resume not possible for %s (%s); compression errors reset%s",
                        backend.rank, path, reason, ", rank 0's state loaded" if backend.world_size > 1 else "")
        elif "optimizer" in mine:  # the replicas differed when saved: this rank's own state
            sd, model_state = mine["optimizer"], mine.get("model", model_state)
    # The optimizer validates everything before it changes anything; the model was checked above.
    optimizer.restore(sd, compression_errors=None if mine is None else mine["errors"])
    if model is not None:
        model.load_state_dict(model_state)
    return payload.get("extra")


# ----------------------------------------------------------------------------- beside a DCP checkpoint


def _errors_path(directory: Path) -> Path:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return directory / f"onebit-errors-rank{rank}.pt"


def save_compression_errors(directory: str | os.PathLike, optimizer: OnebitOptimizer) -> None:
    """Write this rank's compression errors into ``directory`` (a ``torch.distributed.checkpoint``
    directory, after ``dcp.save``), one file per rank (``onebit-errors-rank<r>.pt``, written
    atomically), so that :func:`load_compression_errors` can resume bit for bit on the same layout.
    Call it on every rank. DCP itself saves no per-rank state: without these files a load resets
    the errors, which is what a load into another layout does anyway. While the ranks' replicas
    differ (``replicas_identical`` False: between the syncs of ``ZeroOneAdam``, always for
    ``OnebitDiLoCo``'s inner moments), where DCP keeps one replica's copy of what they share, the
    file also holds this rank's own optimizer state and parameter values (of its shards)."""
    backend = optimizer.backend
    part = {"format": _FILE_MARKER + "-errors", "step": optimizer.step_count, "layout": optimizer.layout_digest(),
            "world_size": backend.world_size, "rank": backend.rank,
            "replicas_identical": optimizer.replicas_identical,
            "errors": [(w.detach().cpu().clone(), s.detach().cpu().clone()) for w, s in optimizer.compression_errors()]}
    if not optimizer.replicas_identical:  # DCP keeps one replica's copy: this rank's own, beside it
        part["own"] = {"optimizer": optimizer.state_dict(),
                       "params": [local(p).detach().cpu().clone() for g in optimizer.param_groups for p in g["params"]]}
    _atomic_write(_serialize(part), _errors_path(Path(directory)))


def load_compression_errors(directory: str | os.PathLike, optimizer: OnebitOptimizer, *,
                            timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bool:
    """After ``set_optimizer_state_dict`` from the DCP checkpoint ``directory``: restore this rank's
    compression errors written there by :func:`save_compression_errors` when every rank of the
    optimizer's group can (same step, world size and layout; one all-reduce), else leave them
    reset on every rank of the group, with one log line saying why. Returns whether they were
    restored. Call it on every rank (they first meet as in :func:`save_checkpoint`, within
    ``timeout_s``)."""
    _handshake(optimizer, "load_compression_errors", timeout_s)
    path = _errors_path(Path(directory))
    backend = optimizer.backend
    mine, reason = None, ""
    try:
        part = _read(path)
    except (FileNotFoundError, ValueError) as exc:
        part, reason = None, str(exc)
    if part is not None:
        if not isinstance(part, Mapping) or part.get("format") != _FILE_MARKER + "-errors":
            reason = f"{path} is not a onebit compression-error file"
        elif part.get("world_size") != backend.world_size or part.get("rank") != backend.rank:
            reason = f"it was saved by rank {part.get('rank')} of {part.get('world_size')}"
        elif part.get("layout") != optimizer.layout_digest():
            reason = "it was saved with another parameter layout"
        elif part.get("step") != optimizer.step_count:
            reason = f"its errors are of step {part.get('step')}, the optimizer state is of step {optimizer.step_count}"
        elif not part.get("replicas_identical", True) and "own" not in part:
            reason = "it was saved between the syncs of ZeroOneAdam, when DCP kept one replica's state"
        else:
            mine = part
    mine, reason = _everywhere_or_nowhere(optimizer, mine, reason)
    if mine is None:
        logger.info("onebit: rank %d: compression errors not restored from %s (%s); they stay reset",
                    backend.rank, directory, reason)
        return False
    device = _device(optimizer)
    errors = [(w.to(device), s.to(device)) for w, s in mine["errors"]]
    if "own" in mine:  # this rank's own replica, where DCP loaded one replica's
        with torch.no_grad():
            for p, value in zip([p for g in optimizer.param_groups for p in g["params"]], mine["own"]["params"]):
                local(p).copy_(value)
        optimizer.restore(mine["own"]["optimizer"], errors)
    else:
        optimizer.restore_compression_errors(errors)
    return True
