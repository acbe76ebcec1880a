"""OnebitDiLoCo under the training frameworks, FSDP2/HSDP with DCP, and torch.amp.GradScaler (issue 41).

Three launches, each running several checks:

* Adapters, 2 gloo ranks: Lightning (``OnebitCallback``), Accelerate (``attach_accelerate``), the
  HF Trainer (``attach_trainer``) and the DeepSpeed engine (``attach_deepspeed``), whichever are
  installed, each against the plain loop (no framework, the same per-rank batches): the
  framework's gradient all-reduce is off on every step, the ranks' parameters differ between
  outer steps (each rank trained alone) and agree bit for bit after each, and the trajectory is
  the plain loop's bit for bit.
* HSDP, 4 gloo ranks as 2 x 2: ``fully_shard`` over ``mesh["shard"]``, OnebitDiLoCo over
  ``mesh["replicate"]`` (each replica group is one worker, both of its ranks fed the worker's
  batch). Oracles: with ``compression="none"`` the unsharded 2-worker run bit for bit; with the
  1-bit average the same optimizer over plain tensors holding the local shards bit for bit, and
  the unsharded run within a measured tolerance (the scales are per shard, not per tensor). DCP
  checkpoints: save, load into a fresh model and optimizer, continue, compare.
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
from distributed import run_ranks
from onebit import OnebitDiLoCo
from onebit.testing import simulate_compressed_allreduce

pytestmark = pytest.mark.slow  # every test spawns gloo ranks

H = 3
STEPS = 7  # outer steps at 3 and 6, an inner step after the last
LR = 1e-2
OUTER = dict(outer_lr=0.7, outer_momentum=0.9)  # the Nesterov path (the plain average is outer_lr 1, momentum 0)
FRAMEWORKS = {"lightning": "lightning", "accelerate": "accelerate", "hf_trainer": "transformers",
              "deepspeed": "deepspeed"}


def _model() -> torch.nn.Module:
    return tiny_mlp(6, 16, 3)


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _optimizer(params, **kwargs) -> OnebitDiLoCo:
    return OnebitDiLoCo(params, lr=LR, sync_every=H, comm_backend_name="gloo", **{**OUTER, **kwargs})


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# ----------------------------------------------------------------- adapters (rank side)

def _plain(rank: int) -> dict:
    model = _model()
    opt = _optimizer(model.parameters())
    params = []
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(rank, t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        params.append(_flat(model))
    return {"params": params, "stats": opt.comm_stats()}


def _lightning(rank: int) -> dict:
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

    record = {"params": [], "flags": []}

    class Record(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            record["flags"].append(trainer.strategy.model.require_backward_grad_sync)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record["params"].append(_flat(pl_module.net))

    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, max_epochs=1,
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[OnebitCallback(), Record()])
    trainer.fit(module)
    record["stats"] = trainer.optimizers[0].comm_stats()
    return record


def _accelerate(rank: int) -> dict:
    from accelerate import Accelerator

    from onebit.integrations import attach_accelerate

    accelerator = Accelerator(cpu=True)
    model = _model()
    net, opt = accelerator.prepare(model, _optimizer(model.parameters()))
    attach_accelerate(net, opt)
    record = {"params": [], "flags": [], "wrapped": type(net).__name__}
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(rank, t)
        accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
        record["flags"].append(net.require_backward_grad_sync)
        opt.step()
        record["params"].append(_flat(model))
    record["stats"] = opt.optimizer.comm_stats()
    return record


def _hf_trainer(rank: int, out_dir: str) -> dict:
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

    record = {"params": [], "flags": []}

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            record["flags"].append(trainer.model_wrapped.require_backward_grad_sync)

        def on_step_end(self, args, state, control, **kwargs):
            record["params"].append(_flat(net.net))

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


def _deepspeed(rank: int) -> dict:
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
    record = {"params": [], "flags": []}
    for t in range(1, STEPS + 1):
        x, y = _batch(rank, t)
        record["flags"].append(engine.enable_backward_allreduce)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        record["params"].append(_flat(model))
    record["stats"] = opt.comm_stats()
    return record


def _adapter_ranks(rank: int, world_size: int, out_dir: str) -> dict:
    # what a launcher (torchrun) sets: the frameworks read it; the process group exists already
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0",
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    warnings = LogMessages(logging.WARNING)
    logging.getLogger("onebit").addHandler(warnings)
    out: dict = {"plain": _plain(rank)}
    runs = {"accelerate": lambda: _accelerate(rank), "hf_trainer": lambda: _hf_trainer(rank, out_dir),
            "deepspeed": lambda: _deepspeed(rank), "lightning": lambda: _lightning(rank)}
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
    off on every step, the ranks' parameters differ after every inner step and are bit-identical
    after every outer step, and each rank's trajectory is the plain loop's bit for bit (the
    frameworks only forward, backward and call step())."""
    pytest.importorskip(FRAMEWORKS[framework])
    for rank, r in enumerate(adapters):
        run = r[framework]
        if "error" in run:
            pytest.fail(f"rank {rank}, {framework}:\n{run['error']}", pytrace=False)
        assert run["flags"] == [False] * STEPS, run["flags"]
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
