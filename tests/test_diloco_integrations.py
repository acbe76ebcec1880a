"""OnebitDiLoCo under the training frameworks, FSDP2/HSDP with DCP, and torch.amp.GradScaler (issue 41).

Three launches, each running several checks:

* Adapters, 2 gloo ranks: Lightning (``OnebitCallback``), Accelerate (``attach_accelerate``), the
  HF Trainer (``attach_trainer``) and the DeepSpeed engine (``attach_deepspeed``), whichever are
  installed, each against the plain loop (no framework, the same per-rank batches): the
  framework's gradient all-reduce is off on every step and it starts no collective at all
  (every ``torch.distributed`` call counted per step), the ranks' parameters differ between
  outer steps (each rank trained alone) and agree bit for bit after each, and the trajectory is
  the plain loop's bit for bit.
* HSDP, 4 gloo ranks as 2 x 2: ``fully_shard`` over ``mesh["shard"]``, OnebitDiLoCo over
  ``mesh["replicate"]`` (each replica group is one worker, both of its ranks fed the worker's
  batch). Oracles: with ``compression="none"`` the unsharded 2-worker run bit for bit; with the
  1-bit average the same optimizer over plain tensors holding the local shards bit for bit, and
  the unsharded run within a measured tolerance (the scales are per shard, not per tensor). DCP
  checkpoints (with onebit's compression-error files): saved after ``synchronize()``, a resume
  is bit for bit; saved right after an outer step or mid-round without it too (DCP keeps one
  replica's copy; onebit's per-rank file beside it holds each rank's own state and shards).
* GradScaler, 2 gloo ranks: an overflow on one rank at an inner step skips that rank's inner step
  alone (the step counts on every rank); at an outer step every rank skips the whole step and
  the next call is the outer step again; against a single-process simulator of both rules.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from conftest import LogMessages, tiny_mlp
from distributed import dcp_load, dcp_save, run_ranks
from onebit import OnebitDiLoCo
from onebit.testing import simulate_compressed_allreduce

pytestmark = pytest.mark.slow  # every test spawns gloo ranks

H = 3
STEPS = 7  # outer steps at 3 and 6, an inner step after the last
LR = 1e-2
OUTER = dict(outer_lr=0.7, outer_momentum=0.9)  # the Nesterov path (the plain average is outer_lr 1, momentum 0)
# One 1-bit pass with the classic error feedback: the scheme the simulations below write out, and the
# one whose parameters are bit-identical on every rank after an outer step (the defaults keep each
# rank's residual in its parameters; the DCP tests run the defaults).
CLASSIC = dict(error_feedback="buffer", outer_bits=1)


def _classic(compression: str = "onebit") -> dict:
    return CLASSIC if compression == "onebit" else {}


FRAMEWORKS = {"lightning": "lightning", "accelerate": "accelerate", "hf_trainer": "transformers",
              "deepspeed": "deepspeed"}


def _model() -> torch.nn.Module:
    return tiny_mlp(6, 16, 3)


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _optimizer(params, **kwargs) -> OnebitDiLoCo:
    return OnebitDiLoCo(params, lr=LR, sync_every=H, comm_backend_name="gloo", **{**OUTER, **CLASSIC, **kwargs})


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# ----------------------------------------------------------------- adapters (rank side)

COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast", "broadcast_object_list", "reduce", "reduce_scatter_tensor", "gather_object", "barrier")


class _Collectives:
    """Every collective this process starts through ``torch.distributed`` (the frameworks' and
    onebit's; DDP starts its gradient all-reduce through onebit's hook, in Python), as
    ``(name, bytes)`` in order; :meth:`take` returns and forgets what was started since the last."""

    def __init__(self) -> None:
        import onebit.backends.torch_dist as transport

        self.calls: list[tuple[str, int]] = []
        for name in COLLECTIVES:
            setattr(dist, name, self._counted(name, getattr(dist, name)))
        # (onebit's transport bound its all-gather at import)
        transport._all_gather_single = self._counted("all_gather_into_tensor", transport._all_gather_single)

    def _counted(self, name: str, function):
        def counted(*args, **kwargs):
            tensor = args[0] if args else next(iter(kwargs.values()), None)
            size = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            self.calls.append((name, size))
            return function(*args, **kwargs)
        return counted

    def take(self) -> list[tuple[str, int]]:
        calls, self.calls = self.calls, []
        return calls


def _plain(rank: int, counter: _Collectives) -> dict:
    model = _model()
    opt = _optimizer(model.parameters())
    record: dict = {"params": [], "collectives": []}
    counter.take()
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(rank, t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        record["params"].append(_flat(model))
        record["collectives"].append(counter.take())
    record["stats"] = opt.comm_stats()
    return record


def _lightning(rank: int, counter: _Collectives) -> dict:
    import lightning.pytorch as pl

    from onebit.integrations import OnebitCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return _optimizer(self.parameters())

        def train_dataloader(self):
            return torch.utils.data.DataLoader([_batch(rank, t) for t in range(1, STEPS + 1)], batch_size=None)

    record: dict = {"params": [], "flags": [], "collectives": []}

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            counter.take()  # (set-up: DDP's broadcast of the parameters, ...)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            record["flags"].append(trainer.strategy.model.require_forward_param_sync)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record["params"].append(_flat(pl_module.net))
            record["collectives"].append(counter.take())

    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, max_epochs=1,
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[OnebitCallback(), Record()])
    trainer.fit(module)
    record["stats"] = trainer.optimizers[0].comm_stats()
    return record


def _accelerate(rank: int, counter: _Collectives) -> dict:
    from accelerate import Accelerator

    from onebit.integrations import attach_accelerate

    accelerator = Accelerator(cpu=True)
    model = _model()
    net, opt = accelerator.prepare(model, _optimizer(model.parameters()))
    attach_accelerate(net, opt)
    record: dict = {"params": [], "flags": [], "collectives": [], "wrapped": type(net).__name__}
    counter.take()
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(rank, t)
        accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
        record["flags"].append(net.require_forward_param_sync)
        opt.step()
        record["params"].append(_flat(model))
        record["collectives"].append(counter.take())
    record["stats"] = opt.optimizer.comm_stats()
    return record


def _hf_trainer(rank: int, counter: _Collectives, out_dir: str) -> dict:
    import transformers

    from onebit.integrations import attach_trainer

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    batches = [dict(zip(("x", "labels"), _batch(rank, t))) for t in range(1, STEPS + 1)]

    class Trainer(transformers.Trainer):
        def get_train_dataloader(self):  # this rank's own batches, in order (no sampler, no sharding)
            return torch.utils.data.DataLoader(batches, batch_size=None)

    record: dict = {"params": [], "flags": [], "collectives": []}

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counter.take()  # (set-up: DDP's broadcast of the parameters, ...)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            record["flags"].append(trainer.model_wrapped.require_forward_param_sync)

        def on_step_end(self, args, state, control, **kwargs):
            record["params"].append(_flat(net.net))
            record["collectives"].append(counter.take())

    net = Net()
    opt = _optimizer(net.parameters())
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=8, max_grad_norm=0.0, use_cpu=True,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    constant = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    trainer = Trainer(model=net, args=args, train_dataset=batches, optimizers=(opt, constant),
                      callbacks=[Record()])
    attach_trainer(trainer)
    trainer.train()
    record["wrapped"] = type(trainer.model_wrapped).__name__
    record["stats"] = opt.comm_stats()
    return record


def _deepspeed(rank: int, counter: _Collectives) -> dict:
    import importlib

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from onebit.integrations import attach_deepspeed

    # (as tests/test_deepspeed_engine.py: the CPU shared-memory op serves inference only; not built)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    model = _model()
    opt = _optimizer(model.parameters())
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    attach_deepspeed(engine)
    record: dict = {"params": [], "flags": [], "collectives": []}
    counter.take()
    for t in range(1, STEPS + 1):
        x, y = _batch(rank, t)
        record["flags"].append(engine.enable_backward_allreduce)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        record["params"].append(_flat(model))
        record["collectives"].append(counter.take())
    record["stats"] = opt.comm_stats()
    return record


def _adapter_ranks(rank: int, world_size: int, out_dir: str) -> dict:
    # what a launcher (torchrun) sets: the frameworks read it; the process group exists already
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0",
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    warnings = LogMessages(logging.WARNING)
    logging.getLogger("onebit").addHandler(warnings)
    counter = _Collectives()
    out: dict = {"plain": _plain(rank, counter)}
    runs = {"accelerate": lambda: _accelerate(rank, counter),
            "hf_trainer": lambda: _hf_trainer(rank, counter, out_dir),
            "deepspeed": lambda: _deepspeed(rank, counter), "lightning": lambda: _lightning(rank, counter)}
    for name, run in runs.items():  # (Lightning last: its teardown is the last thing it does to the process)
        if importlib.util.find_spec(FRAMEWORKS[name]) is None:
            continue
        before = len(warnings.messages)
        try:
            out[name] = run()
        except Exception:  # noqa: BLE001 (one framework's failure is its own test's; the others still run)
            out[name] = {"error": traceback.format_exc()}
        out[name]["warnings"] = warnings.messages[before:]
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("diloco_adapters")
    return run_ranks(_adapter_ranks, 2, tmp, str(tmp / "hf"), timeout=300)


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_never_averages_and_equals_the_plain_loop(adapters, framework):
    """Under the framework every rank trains alone between outer steps: its gradient all-reduce is
    off on every step and it starts no collective of its own, the ranks' parameters differ after
    every inner step and are bit-identical after every outer step, and each rank's trajectory is
    the plain loop's bit for bit (the frameworks only forward, backward and call step())."""
    if importlib.util.find_spec(FRAMEWORKS[framework]) is None:  # (find_spec: importing it here costs seconds)
        pytest.skip(f"{FRAMEWORKS[framework]} is not installed")
    for rank, r in enumerate(adapters):
        run = r[framework]
        if "error" in run:
            pytest.fail(f"rank {rank}, {framework}:\n{run['error']}", pytrace=False)
        assert run["flags"] == [False] * STEPS, run["flags"]
        # Not one collective of the framework's: each step starts the plain loop's (the layout
        # check on step 1, the outer steps' 1-bit all-reduce), nothing on the other inner steps;
        # less the 32-byte digests with which the plain loop's steps 1 and 2 look for a forgotten
        # adapter (attached, the adapter has told the optimizer who averages what).
        expected = [[c for c in calls if not (t <= 2 and c == ("all_reduce", 32))]
                    for t, calls in enumerate(r["plain"]["collectives"], start=1)]
        assert expected[1] == [] and expected[0] != r["plain"]["collectives"][0]
        assert run["collectives"] == expected, (rank, run["collectives"])
        assert len(run["params"]) == STEPS
        for t, (mine, plain) in enumerate(zip(run["params"], r["plain"]["params"]), start=1):
            assert torch.equal(mine, plain), (rank, t, float((mine - plain).abs().max()))
        assert run["stats"]["outer"]["steps"] == STEPS // H and run["stats"]["inner"]["steps"] == STEPS - STEPS // H
        assert run["stats"]["outer"]["bytes_sent"] == r["plain"]["stats"]["outer"]["bytes_sent"]
        # no warning from onebit (e.g. its check that gradients arrive unaveraged on the first steps)
        assert run["warnings"] == [], run["warnings"]
        if framework in ("accelerate", "hf_trainer"):
            assert run["wrapped"] == "DistributedDataParallel"
    first, second = (r[framework]["params"] for r in adapters)
    for t, (a, b) in enumerate(zip(first, second), start=1):
        assert torch.equal(a, b) == (t % H == 0), t  # apart between outer steps, together after each


# ----------------------------------------------------------------- FSDP2 / HSDP and DCP (rank side)

def _mlp() -> torch.nn.Module:
    # 33 hidden units: uneven shards (17 and 16 rows); Linear(33, 1): an empty shard on the second rank
    return tiny_mlp(16, 33, 1)


def _hsdp_batch(worker: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + worker)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)


def _shard_model(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _locals(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _same_over(group, tensors: list[torch.Tensor]) -> bool:
    """Whether every rank of ``group`` holds exactly these tensors."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _train_step(model, opt, worker: int, t: int) -> None:
    x, y = _hsdp_batch(worker, t)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _hsdp_against_unsharded(mesh, compression: str) -> dict:
    """FSDP2 over "shard", DiLoCo over "replicate", beside the unsharded model with DiLoCo over the
    same "replicate" group (ranks 0 and 2 one 2-worker run, ranks 1 and 3 the same again): both
    workers' ranks fed the worker's batch, so FSDP's gradient (the mean over the replica group's
    two ranks of one gradient) is the unsharded worker's."""
    worker = mesh["replicate"].get_local_rank()
    model = _shard_model(mesh["shard"])
    start = _locals(model)
    opt = OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, group=mesh["replicate"], compression=compression,
                       **OUTER, **_classic(compression))
    whole = _mlp()
    out: dict = {"start": _flat(whole)}
    whole_opt = OnebitDiLoCo(whole.parameters(), lr=LR, sync_every=H, group=mesh["replicate"],
                             compression=compression, **OUTER, **_classic(compression))
    out.update(identical=[], sharded=[], whole=[])
    grads = []
    for t in range(1, STEPS + 1):
        x, y = _hsdp_batch(worker, t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        _train_step(whole, whole_opt, worker, t)
        full = [p.detach().full_tensor() for p in model.parameters()]  # (a collective over "shard")
        out["identical"].append(_same_over(mesh["replicate"].get_group(), _locals(model)))
        out["sharded"].append(torch.cat([p.reshape(-1) for p in full]))
        out["whole"].append(_flat(whole))
    # the oracle of the shards: the same optimizer over plain tensors holding this rank's initial
    # shards, over the same group, stepped with the shards' gradients
    plain = [torch.nn.Parameter(s.clone()) for s in start]
    oracle = OnebitDiLoCo(plain, lr=LR, sync_every=H, group=mesh["replicate"], compression=compression, **OUTER,
                          **_classic(compression))
    for step_grads in grads:
        for p, g in zip(plain, step_grads):
            p.grad = g
        oracle.step()
    out["equals_plain_tensors"] = all(torch.equal(a, b.detach()) for a, b in zip(_locals(model), plain))
    out["local_shapes"] = [tuple(s.shape) for s in start]
    out["state_shapes"] = [tuple(opt.state[p]["global_params"].shape) for p in model.parameters()]
    out["stats"] = opt.comm_stats()
    return out


def _dcp_save(model, opt, path: str) -> None:
    from onebit import save_compression_errors

    dcp_save(model, opt, path)
    save_compression_errors(path, opt)


def _dcp_load(model, opt, path: str) -> bool:
    from onebit import load_compression_errors

    dcp_load(model, opt, path)
    return load_compression_errors(path, opt)


def _local_state(opt, model) -> dict[str, list[torch.Tensor | None]]:
    """The state's buffers (the outer momentum exists from the first outer step on: None before)."""
    keys = ("exp_avg", "exp_avg_sq", "global_params", "outer_momentum_buffer")
    return {key: [opt.state[p][key].clone() if key in opt.state[p] else None for p in model.parameters()]
            for key in keys}


def _dcp_resume(mesh, directory: str, at: int, synchronize: bool) -> dict:
    """Train ``at`` steps (then ``synchronize()`` if asked), save with DCP and the compression
    errors, load into a fresh model and optimizer, and continue both to step ``STEPS + 2`` (an
    outer step on the way)."""
    worker = mesh["replicate"].get_local_rank()

    def make():
        model = _shard_model(mesh["shard"])
        return model, OnebitDiLoCo(model.parameters(), lr=LR, sync_every=H, group=mesh["replicate"], **OUTER)

    model, opt = make()
    for t in range(1, at + 1):
        _train_step(model, opt, worker, t)
    if synchronize:
        opt.synchronize()
    path = f"{directory}/dcp-{at}-{int(synchronize)}"
    _dcp_save(model, opt, path)
    dist.barrier()
    again, again_opt = make()
    out = {"restored": _dcp_load(again, again_opt, path), "step": again_opt.step_count}
    mine, loaded = _local_state(opt, model), _local_state(again_opt, again)
    out["state_equal"] = {key: all(a is b is None or (a is not None and b is not None and torch.equal(a, b))
                                   for a, b in zip(mine[key], loaded[key])) for key in mine}
    out["params_equal"] = all(torch.equal(a, b) for a, b in zip(_locals(model), _locals(again)))
    for t in range(at + 1, STEPS + 3):
        _train_step(model, opt, worker, t)
        _train_step(again, again_opt, worker, t)
    out["bit_for_bit"] = all(torch.equal(a, b) for a, b in zip(_locals(model), _locals(again)))
    return out


def _hsdp_ranks(rank: int, world_size: int, directory: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {"onebit": _hsdp_against_unsharded(mesh, "onebit"), "none": _hsdp_against_unsharded(mesh, "none"),
            "dcp_outer": _dcp_resume(mesh, directory, H, synchronize=False),
            "dcp_mid_round": _dcp_resume(mesh, directory, H + 1, synchronize=False),
            "dcp_synchronized": _dcp_resume(mesh, directory, H + 1, synchronize=True)}


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("diloco_hsdp")
    return run_ranks(_hsdp_ranks, 4, tmp, str(tmp), timeout=240)


def test_hsdp_replica_groups_are_the_workers(hsdp):
    """Each replica group is one worker: its replicas' shards apart between outer steps, together
    after each; the state is the shard's; the run equals the same optimizer over plain tensors
    holding the shards bit for bit; with the exact average it is the unsharded 2-worker run bit
    for bit. With the 1-bit average it is not (each shard has its own scales where the whole
    tensor has one): measured, the sharded run is 0.038 (first outer step) and 0.149 (second) of
    the 1-bit run's own distance from the exact one away from the unsharded 1-bit run (3.1% and
    7.2% of how far the parameters moved); the check allows 0.25."""
    for rank, r in enumerate(hsdp):
        exact, onebit = r["none"], r["onebit"]
        for run in (exact, onebit):
            assert run["equals_plain_tensors"], rank
            assert run["identical"] == [t % H == 0 for t in range(1, STEPS + 1)], (rank, run["identical"])
            assert run["state_shapes"] == run["local_shapes"]
            assert run["stats"]["outer"]["steps"] == STEPS // H
        assert all(torch.equal(a, b) for a, b in zip(exact["sharded"], exact["whole"])), rank
        for t in range(1, STEPS + 1):
            sharded, whole, exact_whole = onebit["sharded"][t - 1], onebit["whole"][t - 1], exact["whole"][t - 1]
            if t < H:  # inner steps only: no scale has been used yet
                assert torch.equal(sharded, whole), (rank, t)
                continue
            apart, bit = float((sharded - whole).norm()), float((whole - exact_whole).norm())
            assert 0 < apart <= 0.25 * bit, (rank, t, apart, bit)
    # shard coordinates: ranks 0 and 2 hold the first shards (17 rows; the 1-row output layer), 1 and 3 the rest
    assert hsdp[0]["onebit"]["local_shapes"] == [(17, 16), (17,), (1, 33), (1,)]
    assert hsdp[1]["onebit"]["local_shapes"] == [(16, 16), (16,), (0, 33), (0,)]


def test_dcp_resume_after_synchronize_is_bit_identical(hsdp):
    """A DCP save mid-round after ``synchronize()`` (replicas and inner moments averaged, so DCP's
    one copy of each replicated shard is every replica's), with onebit's compression-error files:
    the loaded run continues bit for bit through the next outer step."""
    for rank, r in enumerate(hsdp):
        run = r["dcp_synchronized"]
        assert run["restored"] and run["step"] == H + 1, (rank, run)
        assert run["params_equal"] and all(run["state_equal"].values()), (rank, run)
        assert run["bit_for_bit"], rank


def test_dcp_resume_without_synchronize_is_bit_identical(hsdp):
    """A DCP save right after an outer step (parameters, global parameters and outer momentum the
    same on every replica; the inner moments each worker's own) or mid-round (the parameters each
    worker's own too): DCP keeps one replica's copy, and onebit's per-rank file beside it
    (save_compression_errors) holds this rank's own state and shards, which
    load_compression_errors puts back: the run continues bit for bit."""
    for rank, r in enumerate(hsdp):
        for name, step in (("dcp_outer", H), ("dcp_mid_round", H + 1)):
            run = r[name]
            assert run["restored"] and run["step"] == step, (rank, name, run)
            assert run["params_equal"] and all(run["state_equal"].values()), (rank, name, run)
            assert run["bit_for_bit"], (rank, name)


# ----------------------------------------------------------------- GradScaler

CALLS = 8
# call -> the rank whose loss overflows: call 2 is an inner step (rank 0 skips it alone, the step
# counts everywhere); call 6 would be the outer step 6 (every rank skips it; call 7 is outer step 6)
OVERFLOW = {2: 0, 6: 1}


def _scaler_ranks(rank: int, world_size: int) -> dict:
    warnings = LogMessages(logging.WARNING)
    logging.getLogger("onebit").addHandler(warnings)
    model = _model()
    opt = _optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    record: dict = {"params": [], "steps": [], "scales": []}
    for call in range(1, CALLS + 1):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(rank, call)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if OVERFLOW.get(call) == rank:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        record["params"].append(_flat(model))
        record["steps"].append(opt.step_count)
        record["scales"].append(scaler.get_scale())
    record["stats"] = opt.comm_stats()
    record["warnings"] = warnings.messages
    return record


def _simulate_scaler(world_size: int) -> list[list[torch.Tensor]]:
    """Every rank's parameters after every call, from the maths: per rank a torch AdamW, which an
    overflowing rank does not step on an inner step; an outer step with an overflow on any rank is
    not taken by any rank (nor their inner steps), and the next call is that outer step again; an
    outer step averages ``global - params`` with the 1-bit simulator, then Nesterov SGD."""
    models = [_model() for _ in range(world_size)]
    inners = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    glob = _model()
    outer = torch.optim.SGD(glob.parameters(), lr=OUTER["outer_lr"], momentum=OUTER["outer_momentum"], nesterov=True)
    numels = [p.numel() for p in glob.parameters()]
    errors, t, out = (None, None), 0, []
    for call in range(1, CALLS + 1):
        overflow = [OVERFLOW.get(call) == rank for rank in range(world_size)]
        is_outer = (t + 1) % H == 0
        if not (is_outer and any(overflow)):
            t += 1
            for rank, (m, inner) in enumerate(zip(models, inners)):
                if not overflow[rank]:
                    m.zero_grad(set_to_none=True)
                    x, y = _batch(rank, call)
                    torch.nn.functional.mse_loss(m(x), y).backward()
                    inner.step()
            if is_outer:
                deltas = [torch.cat([(g - p).detach().reshape(-1) for g, p in zip(glob.parameters(), m.parameters())])
                          for m in models]
                sim = simulate_compressed_allreduce(deltas, *errors, numels=numels)
                errors = (sim.worker_errors, sim.server_errors)
                for g, piece in zip(glob.parameters(), sim.output.split(numels)):
                    g.grad = piece.view_as(g).clone()
                outer.step()
                with torch.no_grad():
                    for m in models:
                        for p, g in zip(m.parameters(), glob.parameters()):
                            p.copy_(g)
        out.append([_flat(m) for m in models])
    return out


def test_grad_scaler_overflows_skip_alone_inside_a_round_and_together_at_an_outer_step(tmp_path):
    """``torch.amp.GradScaler`` (CPU, float32 model, a loss made infinite on one rank): an
    overflow at an inner step skips that rank's inner step only, and the step counts on every
    rank (the outer steps stay aligned); an overflow at an outer step skips it on every rank,
    inner steps included, and the next call is that outer step. Each rank's parameters follow the
    simulator of both rules; the ranks agree bit for bit after each outer step. The scalers'
    scales are each rank's own (each backs off on its own overflows), which is harmless: every
    rank unscales its own gradients before anything is averaged."""
    results = run_ranks(_scaler_ranks, 2, tmp_path)
    expected = _simulate_scaler(2)
    for rank, r in enumerate(results):
        assert r["steps"] == [1, 2, 3, 4, 5, 5, 6, 7], r["steps"]
        for call, (mine, theirs) in enumerate(zip(r["params"], expected), start=1):
            # float32 rounding only (torch's AdamW and SGD against the engine's fused passes)
            torch.testing.assert_close(mine, theirs[rank], rtol=0, atol=1e-6, msg=f"rank {rank} call {call}")
        assert r["stats"]["outer"]["steps"] == 2 and r["stats"]["outer"]["skipped_steps"] == 1, r["stats"]["outer"]
    # the overflowing calls changed nothing on the rank that overflowed (call 2) or on any rank (call 6)
    assert torch.equal(results[0]["params"][0], results[0]["params"][1])
    assert all(torch.equal(r["params"][4], r["params"][5]) for r in results)
    assert not torch.equal(results[1]["params"][0], results[1]["params"][1])  # rank 1 stepped at call 2
    for call in range(1, CALLS + 1):
        together = torch.equal(results[0]["params"][call - 1], results[1]["params"][call - 1])
        assert together == (call in (3, 7)), call  # after outer steps 3 and 6 (calls 3 and 7), apart otherwise
    assert results[0]["scales"][1] == 2.0**9 and results[1]["scales"][1] == 2.0**10
    assert results[1]["scales"][5] == 2.0**9 and results[0]["scales"][5] == 2.0**9
    assert any("rank 0: non-finite gradients at step 2" in line for line in results[0]["warnings"])
    assert results[1]["warnings"] == []
