"""DeepSpeed's engine: let it average gradients on the steps whose plan asks for it, and on no others.

``deepspeed.initialize(model=..., optimizer=OnebitAdam(...), config=...)`` takes a onebit optimizer
as a client optimizer (ZeRO stage 0, fp32 parameters). The engine then all-reduces every gradient
in ``engine.backward`` at each gradient accumulation boundary, while the flag
``engine.enable_backward_allreduce`` is true (with ``managed_gradient_accumulation: false``, in
``engine.step()`` instead, under the same flag). :func:`attach_deepspeed` keeps that flag equal to
``optimizer.next_plan.average_gradients``: the engine averages the gradients, in float32 and once,
on the steps whose plan averages them (1-bit Adam's and 1-bit LAMB's warmup, 0/1 Adam's variance
steps), and the optimizer is told so (``set_gradients_averaged(True)``); on every other step the
gradients stay local and the optimizer communicates what its plan says. It is the flag DeepSpeed's
own 1-bit optimizers (removed in 0.19.7) flipped from inside the optimizer; here the adapter owns it.

``deepspeed`` is imported only when :func:`attach_deepspeed` is called.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..engine import OnebitOptimizer
from .ddp import follow_plan

logger = logging.getLogger(__name__)

__all__ = ["attach_deepspeed"]

_INSTALL = 'pip install "onebit[deepspeed]"'


def _engine_classes() -> tuple[type, type]:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError as exc:
        raise ImportError(f"attach_deepspeed needs DeepSpeed: {_INSTALL}") from exc
    return DeepSpeedEngine, PipelineEngine


def _check_engine(engine: Any) -> OnebitOptimizer:
    """Validate what the adapter relies on; return the engine's onebit optimizer."""
    engine_class, pipeline_class = _engine_classes()
    if not isinstance(engine, engine_class):
        raise TypeError(
            f"attach_deepspeed needs the engine returned by deepspeed.initialize, got {type(engine).__name__}")
    if isinstance(engine, pipeline_class):
        raise TypeError(
            f"attach_deepspeed does not support {type(engine).__name__} (pipeline parallelism reduces gradients "
            "under its own flag); train the model without a PipelineModule")
    stage = int(engine.zero_optimization_stage())
    if stage > 0:
        raise ValueError(
            f"zero_optimization.stage is {stage}: ZeRO partitions the optimizer state across ranks, and a onebit "
            "optimizer needs all of it on every rank; set \"zero_optimization\": {\"stage\": 0}")
    optimizer = engine.optimizer
    if not isinstance(optimizer, OnebitOptimizer):
        if isinstance(getattr(engine, "basic_optimizer", None), OnebitOptimizer):
            raise ValueError(
                f"the engine wrapped the onebit optimizer in {type(optimizer).__name__} (\"fp16\" or \"bf16\" "
                "enabled in its config): that wrapper swaps the optimizer's parameters for float32 copies, which a "
                "onebit optimizer never updates, so the model would not train; remove \"fp16\"/\"bf16\" from the "
                "config and use \"torch_autocast\": {\"enabled\": true, \"dtype\": \"bfloat16\"} (or \"float16\"), "
                "which keeps float32 parameters")
        raise TypeError(
            f"the engine's optimizer is {type(optimizer).__name__}, not a onebit optimizer: pass "
            "optimizer=onebit.from_config(model.parameters(), config) or OnebitAdam(model.parameters(), ...) "
            "(OnebitLamb, ZeroOneAdam) to deepspeed.initialize")
    if not engine.gradient_average:
        raise ValueError(
            "the engine sums gradients over ranks (\"gradient_allreduce_op\": \"sum\"), a onebit optimizer "
            "needs their mean; remove gradient_allreduce_op from the config")
    dtype = engine.communication_data_type
    wanted = optimizer.reduce_dtype or torch.float32
    if dtype != wanted and engine.dp_world_size > 1:
        fix = ("pass reduce_dtype=torch.bfloat16 to the optimizer, or remove communication_data_type from the config"
               if wanted == torch.float32 else "set \"communication_data_type\": \"bf16\" in the config, or pass "
               "reduce_dtype=None to the optimizer")
        raise ValueError(
            f"communication_data_type is {dtype}: the engine would average the full-precision steps' gradients "
            f"in that type, but the optimizer's reduce_dtype is {optimizer.reduce_dtype}; {fix}")
    if engine.dp_world_size != optimizer.backend.world_size:
        raise ValueError(
            f"the engine's data-parallel group spans {engine.dp_world_size} ranks but the optimizer's backend has "
            f"{optimizer.backend.world_size}; give the optimizer the engine's data-parallel group (group=...)")
    return optimizer


def attach_deepspeed(engine: Any) -> None:
    """Make ``engine`` (from ``deepspeed.initialize(..., optimizer=<onebit optimizer>)``) average
    gradients exactly on the steps whose plan averages them, and tell the optimizer that they
    arrive averaged there (``optimizer.set_gradients_averaged(True)``). Call it once, after
    ``deepspeed.initialize`` and before the first ``engine.backward``.

    After each ``step()`` of the optimizer (and each ``load_state_dict``, e.g. from
    ``engine.load_checkpoint``) it sets ``engine.enable_backward_allreduce`` to
    ``optimizer.next_plan.average_gradients``. Gradient accumulation (``gradient_accumulation_steps``,
    also with ``managed_gradient_accumulation: false``) works as it does without onebit: the engine
    reduces only at the accumulation boundary, and the optimizer steps there. With
    ``overlap_backward=True``, only the backward of the boundary's micro-batch starts the
    optimizer's communication (``engine.is_gradient_accumulation_boundary()``).

    Mixed precision: ``"torch_autocast"`` in the config (float32 parameters; with float16 the
    engine's ``GradScaler``, whose overflow skips every rank's step together). The ``"fp16"`` and
    ``"bf16"`` sections make the engine wrap the optimizer and are refused.

    DeepSpeed 0.19.8 clips gradients at ``gradient_clipping: 1.0`` unless the config says
    otherwise; that clipping all-reduces the gradient norm on every step and, on the steps that do
    not average gradients, scales each rank's local gradient (a warning says so). Set
    ``"gradient_clipping": 0`` to train exactly as the optimizer does in a plain loop.

    Raises:
        ImportError: DeepSpeed is not installed.
        TypeError: ``engine`` is not a ``DeepSpeedEngine``, is a ``PipelineEngine``, or its
            optimizer is not a onebit optimizer.
        ValueError: ZeRO stage > 0, an fp16/bf16 optimizer wrapper, a summed gradient all-reduce or
            one in another type than the optimizer's ``reduce_dtype``, or a data-parallel group of
            another size than the optimizer's.
    """
    optimizer = _check_engine(engine)
    follow_plan(optimizer, lambda average: setattr(engine, "enable_backward_allreduce", average))
    # (with overlap_backward: accumulation's micro-batches before the boundary start nothing)
    optimizer.set_accumulation_boundary(engine.is_gradient_accumulation_boundary)
    if optimizer.backend.rank != 0:
        return
    clip = float(engine.gradient_clipping())
    if clip > 0:
        logger.warning(
            "onebit: the DeepSpeed engine clips gradients (gradient_clipping=%g; DeepSpeed's default is 1.0): on "
            "steps that do not average gradients it scales each rank's local gradient by a factor from the ranks' "
            "mean gradient norm, which with a frozen variance changes the size of the 1-bit steps, and it "
            "all-reduces that norm on every step, also on steps that send nothing else; set "
            "\"gradient_clipping\": 0 in the config to train as the onebit optimizer does on its own", clip)
    logger.info("onebit: DeepSpeed engine attached to %s; it averages gradients only on the steps whose plan "
                "does (next step: %s)", type(optimizer).__name__, optimizer.phase)
