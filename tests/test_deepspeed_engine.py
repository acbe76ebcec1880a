"""onebit optimizers inside DeepSpeed's engine (ZeRO stage 0, fp32, CPU accelerator, gloo) with
:func:`onebit.integrations.deepspeed.attach_deepspeed`, against the same optimizer in a plain loop
on the same per-rank batches (the oracle, run by the same processes).

Every collective of the rank processes is counted by wrapping ``torch.distributed``'s functions
(DeepSpeed's ``deepspeed.comm`` and onebit's transport both call them), separately for what runs
inside ``engine.backward`` (the engine's gradient all-reduce) and inside ``engine.step`` (the
optimizer), per optimizer step.
"""

from __future__ import annotations

import contextlib

import logging
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from conftest import max_abs_diff, tiny_mlp
from distributed import run_ranks

MICRO_BATCH = 4
# (optimizer, its arguments, gradient_accumulation_steps, optimizer steps, engine config); each case
# shows every plan of its optimizer: warmup then compression; 0/1 Adam: variance,
# compressed_gradient, variance, sync, sync, local. "gradient_clipping": 0 because DeepSpeed
# 0.19.8 clips at 1.0 by default; "adam_clipped" keeps that default. With
# managed_gradient_accumulation false, the caller calls engine.step() once per optimizer step and
# the engine all-reduces the gradients there instead of in the last backward.
NO_CLIPPING = {"gradient_clipping": 0.0}
CASES = {
    "adam": ("OnebitAdam", dict(freeze_step=2), 2, 5, NO_CLIPPING),
    "lamb": ("OnebitLamb", dict(freeze_step=2, max_coeff=0.3, min_coeff=0.01), 1, 4, NO_CLIPPING),
    "zoadam": ("ZeroOneAdam", dict(var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2),
               2, 6, NO_CLIPPING),
    "adam_clipped": ("OnebitAdam", dict(freeze_step=2), 1, 4, {}),
    "adam_unmanaged": ("OnebitAdam", dict(freeze_step=2), 2, 4, {**NO_CLIPPING, "managed_gradient_accumulation": False}),
    # mixed precision the way a onebit optimizer supports it: float32 parameters under torch.autocast
    # (the engine's "bf16"/"fp16" sections are refused); float16 adds the engine's GradScaler
    "adam_autocast_bf16": ("OnebitAdam", dict(freeze_step=2), 2, 4,
                           {**NO_CLIPPING, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}),
    "adam_autocast_fp16": ("OnebitAdam", dict(freeze_step=2), 1, 4,
                           {**NO_CLIPPING, "torch_autocast": {"enabled": True, "dtype": "float16"}}),
    # overlap_backward: the compressed steps start during the backward of the accumulation boundary
    "adam_overlap": ("OnebitAdam", dict(freeze_step=2, overlap_backward=True), 2, 5, NO_CLIPPING),
    "zoadam_overlap": ("ZeroOneAdam", dict(var_freeze_step=3, var_update_scaler=1, local_step_scaler=1,
                                           local_step_clipper=2, overlap_backward=True), 2, 6, NO_CLIPPING),
}
AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}
CLIP_NORM = ("all_reduce", 4)  # the engine's clipping averages each rank's gradient norm, every step
COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor", "broadcast",
               "reduce_scatter_tensor", "reduce", "barrier")


@pytest.fixture(scope="module")
def deepspeed():
    return pytest.importorskip("deepspeed")


def _model() -> torch.nn.Module:
    return tiny_mlp(6, 16, 3)


def _batch(rank: int, step: int, micro: int):
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(MICRO_BATCH, 6, generator=gen), torch.randn(MICRO_BATCH, 3, generator=gen)


def _optimizer(model, name: str, kwargs: dict):
    import onebit

    return getattr(onebit, name)(model.parameters(), lr=1e-2, comm_backend_name="gloo", **kwargs)


class _Counter:
    """Wraps torch.distributed's collectives; ``calls[label]`` lists (name, bytes) in call order."""

    def __init__(self) -> None:
        import torch.distributed as dist
        import onebit.backends.torch_dist as transport

        self.label = "other"
        self.calls: dict[str, list] = defaultdict(list)
        self.logged: list[str] = []  # onebit.integrations.deepspeed's warnings
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: self.logged.append(record.getMessage())
        logging.getLogger("onebit.integrations.deepspeed").addHandler(handler)
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))
        # onebit's transport binds its all-gather at import (all_gather_single or all_gather_into_tensor)
        transport._all_gather_single = self._wrap("all_gather_into_tensor", transport._all_gather_single)

    def _wrap(self, name, function):
        def counted(*args, **kwargs):
            tensor = args[0] if args else next(iter(kwargs.values()), None)
            nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            self.calls[self.label].append((name, nbytes))
            return function(*args, **kwargs)
        return counted

    def take(self, label: str) -> list:
        return self.calls.pop(label, [])


def _config(gas: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": 0}, "steps_per_print": 10**9, **extra}


def _engine_run(counter, rank, name, kwargs, gas, steps, config, checkpoints=None):
    import deepspeed
    from onebit.integrations.deepspeed import attach_deepspeed

    model = _model()
    opt = _optimizer(model, name, kwargs)
    managed = config.get("managed_gradient_accumulation", True)
    counter.label = "init"
    engine, engine_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_config(gas, **config))
    logged = len(counter.logged)
    attach_deepspeed(engine)
    counter.take("init")
    record = {"warnings": counter.logged[logged:], "wrapped": engine_opt is opt, "plans": [], "flags": [],
              "scaler": engine.torch_autocast_z0_gradscaler is not None,
              "backward": [], "step": [], "onebit": [], "params": [], "identical": []}
    for step in range(1, steps + 1):
        record["plans"].append(opt.next_plan)
        record["flags"].append(engine.enable_backward_allreduce)
        for micro in range(gas):
            x, y = _batch(rank, step, micro)
            counter.label = "backward"
            engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
            if managed or micro == gas - 1:
                counter.label = "step"
                engine.step()
        record["backward"].append(counter.take("backward"))
        record["step"].append(counter.take("step"))
        record["onebit"].append(opt.comm_stats()["last_step"])
        record["params"].append([p.detach().clone() for p in model.parameters()])
        record["identical"].append(opt.replicas_identical)
        if checkpoints is not None and step == 1:
            counter.label = "checkpoint"
            engine.save_checkpoint(checkpoints, tag="step1")
    record["stats"] = opt.comm_stats()
    # overlap_backward: whether step() had to redo what a backward started (it must not: the
    # micro-batches before the boundary start nothing)
    record["redone"] = opt.overlap_redone
    if checkpoints is not None:  # back to warmup through DeepSpeed's own checkpoint: the flag follows
        flag_before = engine.enable_backward_allreduce
        engine.load_checkpoint(checkpoints, tag="step1")
        counter.take("checkpoint")
        record["reloaded"] = {"flags": [flag_before, engine.enable_backward_allreduce], "step": opt.step_count,
                              "params": [p.detach().clone() for p in model.parameters()]}
    return record


def _plain_run(counter, rank, name, kwargs, gas, steps, config):
    """The oracle: the same optimizer on the same batches in a plain loop (no engine, no DDP)."""
    model = _model()
    opt = _optimizer(model, name, kwargs)
    dtype = AUTOCAST.get(config.get("torch_autocast", {}).get("dtype"))
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    record = {"step": [], "params": []}
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        for micro in range(gas):
            x, y = _batch(rank, step, micro)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y) / gas
            with opt.no_sync() if micro < gas - 1 else contextlib.nullcontext():  # (overlap_backward)
                (loss if scaler is None else scaler.scale(loss)).backward()
        counter.label = "plain"
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        record["step"].append(counter.take("plain"))
        record["params"].append([p.detach().clone() for p in model.parameters()])
    record["stats"] = opt.comm_stats()
    return record


def _refusals(deepspeed, attach_deepspeed) -> dict[str, str]:
    """The message (or 'accepted') of attach_deepspeed on engines it must refuse."""
    configs = {
        "zero1": _config(1, zero_optimization={"stage": 1}, zero_allow_untested_optimizer=True),
        "bf16": _config(1, bf16={"enabled": True}),
        "sum": _config(1, gradient_allreduce_op="sum"),
        "bf16_communication": _config(1, communication_data_type="bf16"),
        # the optimizer's reduce_dtype and the engine's communication_data_type must agree
        "bf16_both": _config(1, communication_data_type="bf16"),
        "bf16_optimizer_only": _config(1),
        "torch_adam": _config(1),
    }
    messages = {}
    for case, config in configs.items():
        model = _model()
        reduce = {"reduce_dtype": torch.bfloat16} if case in ("bf16_both", "bf16_optimizer_only") else {}
        opt = (torch.optim.Adam(model.parameters()) if case == "torch_adam"
               else _optimizer(model, "OnebitAdam", dict(freeze_step=2, **reduce)))
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        try:
            attach_deepspeed(engine)
            messages[case] = "accepted"
        except (TypeError, ValueError) as exc:
            messages[case] = f"{type(exc).__name__}: {exc}"
    return messages


def _ranks(rank, world_size, checkpoints):
    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher would set; deepspeed.initialize requires it
    os.environ["DS_ACCELERATOR"] = "cpu"
    counter = _Counter()
    import importlib

    import deepspeed
    from onebit.integrations.deepspeed import attach_deepspeed

    # DeepSpeed's CPU transport JIT-compiles a shared-memory op when it starts (~45 s on a fresh
    # machine); the op serves only inference_all_reduce (deepspeed/comm/torch.py, 0.19.8), never
    # the training all-reduce counted here, so these ranks skip building it.
    # (deepspeed.comm's attribute "torch" is the torch package, hence importlib.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    out = {case: {"engine": _engine_run(counter, rank, *spec, checkpoints=checkpoints if case == "adam" else None),
                  "plain": _plain_run(counter, rank, *spec)}
           for case, spec in CASES.items()}
    out["refusals"] = _refusals(deepspeed, attach_deepspeed)
    out["accelerator"] = deepspeed.get_accelerator().device_name()
    return out


@pytest.fixture(scope="module")
def ranks(deepspeed, tmp_path_factory):
    # 240 s: the first run on a machine also JIT-builds DeepSpeed's CPU shared-memory op (~50 s here).
    tmp = tmp_path_factory.mktemp("deepspeed")
    return run_ranks(_ranks, 2, tmp, str(tmp / "checkpoints"), timeout=240)


def _grad_bytes() -> int:
    return sum(p.numel() for p in _model().parameters()) * 4


def _clipped(case: str) -> bool:
    return "gradient_clipping" not in CASES[case][4]


def _managed(case: str) -> bool:
    return CASES[case][4].get("managed_gradient_accumulation", True)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_engine_averages_gradients_once_exactly_on_full_precision_steps(ranks, case):
    gradient = ("all_reduce", _grad_bytes())
    # in a plain loop the optimizer's own all-reduce carries the gradients and a presence flag per tensor
    wire = ("all_reduce", _grad_bytes() + 4 * len(list(_model().parameters())))
    for rank in ranks:
        run, plain = rank[case]["engine"], rank[case]["plain"]
        assert run["wrapped"]  # fp32 parameters, ZeRO 0: the engine steps the onebit optimizer itself
        assert run["scaler"] == (case == "adam_autocast_fp16")
        plans = run["plans"]
        assert run["flags"] == [plan.average_gradients for plan in plans]
        for plan, backward, step, plain_step, onebit in zip(plans, run["backward"], run["step"], plain["step"],
                                                            run["onebit"]):
            if CASES[case][1].get("overlap_backward"):
                # the optimizer's collectives start during the boundary's backward (its bytes: below)
                sent = backward + step
                assert sent.count(gradient) == int(plan.average_gradients) and wire not in sent, plan
                continue
            engine_sent = backward
            if not _managed(case):  # the engine reduces in step() then, before the optimizer steps
                assert backward == [], plan
                engine_sent, step = (step[:1], step[1:]) if step[:1] == [gradient] else ([], step)
            if _clipped(case):  # the engine's own scalar all-reduce of the gradient norm, before the step
                assert step[0] == CLIP_NORM, plan
                step = step[1:]
            # everything else inside engine.step is the optimizer's, as its own statistics count it
            assert onebit["collectives"] == len(step), plan
            assert gradient not in step, plan
            if plan.average_gradients:
                # one float32 all-reduce of every gradient, by the engine, at the accumulation
                # boundary; the optimizer sends what it sends in a plain loop minus that all-reduce
                assert engine_sent == [gradient], plan
                assert step + [wire] == plain_step, plan
            else:
                # the engine sends nothing; the optimizer sends exactly what it sends in a plain loop
                assert engine_sent == [] and step == plain_step, plan
            if plan.name == "local":
                assert step == [], plan
        stats, plain_stats = run["stats"], plain["stats"]
        for name in {plan.name for plan in plans}:
            if any(plan.average_gradients for plan in plans if plan.name == name):
                assert 0 <= stats[name]["bytes_sent"] < plain_stats[name]["bytes_sent"]
            else:
                timing = {key: stats[name][key] for key in ("comm_time_s", "step_time_s")}
                assert stats[name] == {**plain_stats[name], **timing}


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if not _clipped(case)])
def test_engine_follows_the_plain_loop_bit_for_bit(ranks, case):
    # 2 ranks: the engine sums and multiplies by 1/2, onebit sums and divides by 2: both exact, so
    # the trajectories are equal bit for bit, in every phase and with gradient accumulation.
    for rank in ranks:
        assert max_abs_diff(rank[case]["engine"]["params"], rank[case]["plain"]["params"]) == 0.0
        assert not rank[case]["engine"]["redone"]


@pytest.mark.slow
def test_the_engine_autocast_is_in_effect(ranks):
    # the same batches as "adam" (accumulation 2): bfloat16 autocast moves the trajectory away from
    # float32, so the bit-for-bit match above is the engine's autocast meeting the plain loop's
    fp32, bf16 = ranks[0]["adam"]["engine"]["params"], ranks[0]["adam_autocast_bf16"]["engine"]["params"]
    assert max_abs_diff(fp32[:4], bf16) > 1e-4


@pytest.mark.slow
def test_loading_a_deepspeed_checkpoint_sets_the_engine_flag_from_the_restored_step(ranks):
    for rank in ranks:
        run = rank["adam"]["engine"]
        assert run["reloaded"]["flags"] == [False, True]  # compression, then warmup again after step 1
        assert run["reloaded"]["step"] == 1
        assert max_abs_diff([run["reloaded"]["params"]], run["params"][:1]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_parameters_are_identical_on_every_rank_when_the_algorithm_says_so(ranks, case):
    run0, run1 = ranks[0][case]["engine"], ranks[1][case]["engine"]
    for identical, p0, p1 in zip(run0["identical"], run0["params"], run1["params"]):
        assert identical == all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert run0["identical"] == [plan.name != "local" for plan in run0["plans"]]


@pytest.mark.slow
def test_deepspeed_default_clipping_is_announced_and_changes_the_trajectory(ranks):
    # DeepSpeed 0.19.8 clips at gradient_clipping=1.0 unless the config says otherwise: rank 0
    # warns once at attach, and the run differs from a plain onebit loop (which does not clip),
    # most after the switch, where the clipped momentum meets the frozen variance.
    for case in CASES:
        warnings = ranks[0][case]["engine"]["warnings"]
        if _clipped(case):
            assert len(warnings) == 1 and "gradient_clipping=1" in warnings[0]
        else:
            assert warnings == []
        assert ranks[1][case]["engine"]["warnings"] == []
    run, plain = ranks[0]["adam_clipped"]["engine"], ranks[0]["adam_clipped"]["plain"]
    assert max_abs_diff(run["params"], plain["params"]) > 0.1  # measured 1.1 after 2 + 2 steps


@pytest.mark.slow
def test_engine_setups_that_break_onebit_are_refused(ranks):
    messages = ranks[0]["refusals"]
    assert messages == ranks[1]["refusals"]
    assert messages["zero1"].startswith("ValueError: zero_optimization.stage is 1")
    assert "set \"zero_optimization\": {\"stage\": 0}" in messages["zero1"]
    assert messages["bf16"].startswith("ValueError: the engine wrapped the onebit optimizer in FP16_UnfusedOptimizer")
    assert "torch_autocast" in messages["bf16"]
    assert messages["sum"].startswith("ValueError: the engine sums gradients")
    assert messages["bf16_communication"].startswith("ValueError: communication_data_type is torch.bfloat16")
    assert messages["bf16_both"] == "accepted"
    assert messages["bf16_optimizer_only"].startswith("ValueError: communication_data_type is torch.float32")
    assert "reduce_dtype is torch.bfloat16" in messages["bf16_optimizer_only"]
    assert messages["torch_adam"].startswith("TypeError: the engine's optimizer is Adam, not a onebit optimizer")
    assert ranks[0]["accelerator"] == "cpu"


def test_attach_deepspeed_refuses_what_is_not_an_engine(deepspeed):
    from onebit.integrations.deepspeed import attach_deepspeed

    with pytest.raises(TypeError, match="needs the engine returned by deepspeed.initialize, got Linear"):
        attach_deepspeed(torch.nn.Linear(2, 2))


def test_missing_deepspeed_names_the_extra(monkeypatch):
    from onebit.integrations.deepspeed import attach_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed.runtime.engine", None)
    with pytest.raises(ImportError, match=r'pip install "onebit\[deepspeed\]"'):
        attach_deepspeed(object())


def test_importing_onebit_does_not_import_deepspeed():
    code = ("import sys, onebit, onebit.integrations, onebit.integrations.deepspeed; "
            "sys.exit('deepspeed' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
