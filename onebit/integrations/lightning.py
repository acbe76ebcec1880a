"""PyTorch Lightning: give the DDP model Lightning builds the onebit communication hook, and
optionally make a resume from a Lightning checkpoint continue the run bit for bit.

With ``strategy="ddp"`` Lightning wraps the LightningModule in ``DistributedDataParallel`` inside
``trainer.fit()``, in ``strategy.setup()``, and then calls ``configure_optimizers``; the first
callback hook that runs after both, and before the first forward, is ``on_fit_start``. There
:class:`OnebitCallback` calls :func:`onebit.integrations.attach_ddp` on that DDP model with the
onebit optimizer, so DDP averages the gradients (once, overlapped with backward) only before the
steps whose plan averages them, and sends nothing before the others. Lightning's gradient
accumulation keeps working: its ``no_sync()`` on the micro-batches before a step restores the
flag ``attach_ddp`` sets. On one process (no DDP) the callback does nothing: the optimizer
averages what it needs by itself.

Checkpoints. ``trainer.save_checkpoint`` (which ``ModelCheckpoint`` calls) builds the checkpoint
dict on every rank, calling each callback's ``on_save_checkpoint`` there, and only rank 0 writes
it (``Strategy.save_checkpoint``); so the file holds rank 0's optimizer state, and the compression
errors, which are rank-local and not in ``state_dict()``, of no rank. ``fit(ckpt_path=...)``
reads the file on every rank and, for DDP, calls the callbacks' ``on_load_checkpoint`` before
``strategy.setup()`` (the optimizer does not exist yet), then ``on_fit_start``, then loads the
optimizer state (``load_state_dict``: the errors are reset, and ``attach_ddp`` sets DDP's flag
again for the restored step), and only after the whole restore ``on_train_start``. By default
that is all: the resumed run continues with reset errors, from rank 0's state on every rank.

With ``OnebitCallback(exact_resume=True)``, ``on_save_checkpoint`` gathers every rank's
compression errors to rank 0 (one ``torch.distributed.gather_object``) into
``checkpoint["onebit"]``, with the world size, the step and the optimizer's layout digest; while
the ranks' replicas differ (between the syncs of ``ZeroOneAdam``, ``replicas_identical`` is
False) every rank's own optimizer ``state_dict()`` and model ``state_dict()`` too. On resume,
``on_load_checkpoint`` keeps that entry and ``on_train_start`` (after Lightning's restore) gives
every rank its own errors, and its own state where it was saved, through ``optimizer.restore``,
when the world size, the layout digest and the step match; otherwise the errors stay reset, and
rank 0 logs why. This is the Lightning counterpart of ``save_checkpoint`` / ``load_checkpoint(...,
exact_resume=True)`` of :mod:`onebit.checkpoint`.

``lightning`` is imported only here (``onebit.integrations`` imports this module on first use).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..engine import OnebitOptimizer, optimizer_names
from .ddp import attach_ddp

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import SingleDeviceStrategy
except ImportError as exc:
    raise ImportError('onebit.integrations.lightning needs PyTorch Lightning: pip install "onebit[lightning]"') from exc

logger = logging.getLogger(__name__)

__all__ = ["OnebitCallback"]


def _onebit_optimizer(optimizers: list[Any]) -> OnebitOptimizer:
    """The one onebit optimizer of ``trainer.optimizers``, or a ValueError saying what to return instead."""
    unwrapped = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers]
    if len(unwrapped) != 1:
        names = ", ".join(type(o).__name__ for o in unwrapped) or "none"
        raise ValueError(
            f"OnebitCallback needs exactly one optimizer from configure_optimizers, got {len(unwrapped)} ({names}); "
            f"return a single {optimizer_names()} over all the parameters"
        )
    optimizer = unwrapped[0]
    if not isinstance(optimizer, OnebitOptimizer):
        raise ValueError(
            f"OnebitCallback needs a onebit optimizer, but configure_optimizers returned {type(optimizer).__name__}; "
            f"return OnebitAdam(self.parameters(), ...) (or another of {optimizer_names()}), or drop the callback"
        )
    return optimizer


def _cpu(obj: Any) -> Any:
    """A copy of ``obj`` (tensors in dicts, lists, tuples) with every tensor on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {key: _cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(value) for value in obj)
    return obj


def _gather_to_rank0(mine: dict[str, Any], world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's ``mine`` on rank 0 (one ``gather_object``), None on the others."""
    if world_size == 1:
        return [mine]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        have = dist.get_world_size() if dist.is_available() and dist.is_initialized() else "no process group"
        raise RuntimeError(
            f"OnebitCallback(exact_resume=True) gathers the compression errors of the optimizer's {world_size} ranks "
            f"through torch.distributed, whose default group has {have}; use a DDP strategy on the optimizer's ranks, "
            "or exact_resume=False"
        )
    gathered: list[Any] | None = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered


def _why_not_exact(saved: Any, optimizer: OnebitOptimizer) -> str | None:
    """Why ``saved`` (a checkpoint's ``"onebit"`` entry) cannot give every rank its own errors, or None."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("ranks"), list):
        return "the checkpoint was saved without OnebitCallback(exact_resume=True)"
    n = optimizer.backend.world_size
    if saved.get("world_size") != n or len(saved["ranks"]) != n:
        return f"it was saved on {saved.get('world_size')} ranks, this run has {n}"
    if saved.get("layout") != optimizer.layout_digest():
        return (f"it was saved with another parameter layout (layout digest {saved.get('layout')}, "
                f"this optimizer's {optimizer.layout_digest()})")
    if saved.get("step") != optimizer.step_count:
        return f"its compression errors are of step {saved.get('step')}, the optimizer state is of step {optimizer.step_count}"
    if sorted(entry.get("rank") for entry in saved["ranks"]) != list(range(n)):
        return "its per-rank entries do not name every rank once"
    return None


class OnebitCallback(Callback):
    """Make a ``lightning.pytorch.Trainer`` average gradients the onebit way.

    Use it with a LightningModule whose ``configure_optimizers`` returns one onebit optimizer
    (optionally with an LR scheduler), and ``strategy="ddp"`` (any ``DDPStrategy``) on several
    ranks, or any single-device strategy::

        trainer = L.Trainer(strategy="ddp", callbacks=[OnebitCallback()], ...)

    At ``on_fit_start`` it attaches the onebit DDP hook (:func:`onebit.integrations.attach_ddp`)
    to the DDP model Lightning built. Raises ``ValueError`` at ``on_fit_start`` when
    ``configure_optimizers`` returned no onebit optimizer or several optimizers, and when the
    strategy shards or wraps the model some other way (FSDP, DeepSpeed, XLA, model parallel):
    the onebit optimizers need every rank to hold the whole model.

    ``exact_resume`` (keyword-only, default False): a resume with ``fit(ckpt_path=...)``
    continues the run bit for bit on the same world size and layout (see the module docstring).
    Every checkpoint then costs one ``gather_object`` of every rank's compression errors to
    rank 0, and rank 0's checkpoint holds them: about ``world_size`` times the model's size more
    (a worker error of the padded model size per rank, and its share of server error), plus,
    saved between the syncs of ``ZeroOneAdam``, every rank's optimizer and model state (about
    ``world_size`` times three times the model's size). All ranks must save together, as
    ``trainer.save_checkpoint`` requires anyway. A checkpoint from another world size or
    layout, or saved without it, resumes with the errors reset, every rank from rank 0's state,
    and rank 0 logs one line saying why. Without it nothing is gathered, and a resume resets the
    compression errors, as ``load_state_dict`` does.
    """

    def __init__(self, *, exact_resume: bool = False) -> None:
        super().__init__()
        self.exact_resume = exact_resume
        self._loaded: tuple[Any] | None = None  # (checkpoint["onebit"] or None,) from on_load_checkpoint

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizer = _onebit_optimizer(trainer.optimizers)
        strategy = trainer.strategy
        model = strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            attach_ddp(model, optimizer)
            if trainer.global_rank == 0:
                logger.info("onebit: DDP hook attached on %d ranks (%s): DDP averages gradients only before the "
                            "steps whose plan averages them", trainer.world_size, type(optimizer).__name__)
        elif isinstance(strategy, SingleDeviceStrategy):
            if trainer.global_rank == 0:
                logger.info("onebit: %s on one device, no DDP: nothing to attach (%s communicates through its own "
                            "backend, world size %d)",
                            type(strategy).__name__, type(optimizer).__name__, optimizer.backend.world_size)
        else:
            raise ValueError(
                f"OnebitCallback cannot work with strategy {type(strategy).__name__} (its model is a "
                f"{type(model).__name__}, not DistributedDataParallel): onebit optimizers need the whole model on "
                'every rank; use Trainer(strategy="ddp")'
            )

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if not self.exact_resume:
            return
        optimizer = _onebit_optimizer(trainer.optimizers)
        backend = optimizer.backend
        mine: dict[str, Any] = {"rank": backend.rank, "errors": _cpu(optimizer.compression_errors())}
        if not optimizer.replicas_identical:  # the same on every rank: between the syncs, each rank saves its own
            mine["optimizer"] = _cpu(optimizer.state_dict())
            mine["model"] = _cpu(pl_module.state_dict())
        ranks = _gather_to_rank0(mine, backend.world_size)
        if ranks is not None:  # rank 0, the one that writes the file
            checkpoint["onebit"] = {"world_size": backend.world_size, "layout": optimizer.layout_digest(),
                                    "step": optimizer.step_count, "ranks": ranks}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # For DDP this runs before configure_optimizers: keep the entry for on_train_start.
        if self.exact_resume:
            self._loaded = (checkpoint.get("onebit"),)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._loaded is None:  # no checkpoint loaded, or exact_resume is off
            return
        (saved,), self._loaded = self._loaded, None
        optimizer = _onebit_optimizer(trainer.optimizers)
        reason = _why_not_exact(saved, optimizer)
        if reason is not None:
            if trainer.global_rank == 0:
                logger.info("onebit: exact resume not possible (%s); compression errors reset, every rank continues "
                            "from rank 0's state", reason)
            return
        mine = next(entry for entry in saved["ranks"] if entry["rank"] == optimizer.backend.rank)
        # Lightning has loaded rank 0's optimizer state (resetting the errors): load it again, or
        # this rank's own where it was saved, with this rank's errors (restore validates them first).
        state = mine["optimizer"] if "optimizer" in mine else optimizer.state_dict()
        optimizer.restore(state, compression_errors=mine["errors"])
        if "model" in mine:  # after DDP's setup, which broadcast rank 0's parameters
            pl_module.load_state_dict(mine["model"])
        if trainer.global_rank == 0:
            logger.info("onebit: exact resume at step %d: every rank restored its own compression errors%s",
                        optimizer.step_count,
                        " and its own parameters and optimizer state (saved between syncs)" if "model" in mine else "")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # The ranks of an algorithm with local steps may differ now; Lightning saves rank 0's weights.
        _onebit_optimizer(trainer.optimizers).synchronize()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._loaded = None  # loaded by validate/test(ckpt_path=...), or a fit that ended before training: unused
