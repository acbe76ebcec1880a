"""OnebitAdam, OnebitLamb or ZeroOneAdam in a PyTorch Lightning Trainer, on N ranks with torchrun.

    torchrun --nproc-per-node 2 examples/lightning/train.py --steps 40 --freeze-step 10

A tiny regression network learns a fixed linear map from synthetic data (fixed seed). Lightning
wraps the model in DDP (``strategy="ddp"``, gloo on CPU) and shards the data with its
DistributedSampler; ``OnebitCallback`` gives that DDP the onebit hook, so gradients are averaged
once, by DDP, before the full-precision steps and not at all before the 1-bit ones.
``--checkpoint-dir`` saves a Lightning checkpoint every ``--save-every`` steps, ``--resume``
continues from one (at an epoch boundary, 5 steps here, it sees the same batches as without the
interruption). ``--exact-resume`` (give it to the run that saves and to the one that resumes)
passes ``OnebitCallback(exact_resume=True)``: the checkpoint then holds every rank's compression
errors (and, between the syncs of 0/1 Adam, every rank's own state), and the resumed run
continues bit for bit; without it a resume resets the errors. ``--result R`` writes
``R.rank<r>.json`` per rank: final parameters, ``comm_stats()``, and per optimizer step the
all-reduces that carried gradients and DDP's sync flag at each backward.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections import defaultdict
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from onebit.integrations.lightning import OnebitCallback

ROWS = 80  # over all ranks
BATCH = 8  # rows per rank and optimizer step (split into --accumulate micro-batches)


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def synthetic_data(rows: int = ROWS, seed: int = 0) -> TensorDataset:
    """``y = x W + noise`` with a fixed seed: the same rows on every rank (the sampler shards them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=gen)
    y = x @ torch.randn(8, 4, generator=gen) + 0.1 * torch.randn(rows, 4, generator=gen)
    return TensorDataset(x, y)


def build_optimizer(name: str, params, lr: float, freeze_step: int) -> torch.optim.Optimizer:
    """``freeze_step`` is 1-bit Adam's / LAMB's warmup length and 0/1 Adam's ``var_freeze_step``."""
    if name == "adam":
        return OnebitAdam(params, lr=lr, freeze_step=freeze_step)
    if name == "lamb":
        return OnebitLamb(params, lr=lr, freeze_step=freeze_step)
    if name == "zoadam":  # short intervals, so that a short run sees every kind of step
        return ZeroOneAdam(params, lr=lr, var_freeze_step=freeze_step, var_update_scaler=2,
                           local_step_scaler=2, local_step_clipper=2)
    raise ValueError(f"unknown optimizer {name!r}; expected 'adam', 'lamb' or 'zoadam'")


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x).float(), y)


class Regressor(L.LightningModule):
    def __init__(self, optimizer: str = "adam", lr: float = 1e-2, freeze_step: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_of(self.net, x, y)

    def configure_optimizers(self):
        return build_optimizer(self.hparams.optimizer, self.parameters(), self.hparams.lr, self.hparams.freeze_step)


class CountCollectives(Callback):
    """Per optimizer step (the step a backward feeds): the floating-point all-reduces of more than
    2 elements, i.e. those that carry gradients (the optimizer's own finiteness flag has 2), and
    DDP's ``require_backward_grad_sync`` at each backward. It wraps ``torch.distributed.all_reduce``
    during ``fit``: the onebit DDP hook and the onebit transport call it (DDP's built-in C++
    all-reduce, used when no hook is registered, would not be seen: ``ddp_comm_hook`` says which)."""

    def __init__(self) -> None:
        self.ddp_comm_hook: str | None = None  # what DDP says it reduces gradients with
        self.grad_allreduces: dict[int, list[int]] = defaultdict(list)
        self.sync_flags: dict[int, list[bool]] = defaultdict(list)
        self._original = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.optimizer = trainer.optimizers[0]
        self._original = original = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            if tensor.is_floating_point() and tensor.numel() > 3:  # (the optimizer's flag: 3 floats)
                self.grad_allreduces[self.optimizer.step_count + 1].append(tensor.numel())
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counted

    def on_train_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.ddp_comm_hook = model._get_ddp_logging_data().get("comm_hook")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        model = trainer.strategy.model
        # whether DDP's forward prepared a synchronized backward (attach_ddp leaves the user's flag as it was)
        self.sync_flags[self.optimizer.step_count + 1].append(bool(getattr(model, "require_forward_param_sync", False)))

    def teardown(self, trainer, pl_module, stage) -> None:
        if self._original is not None:
            dist.all_reduce, self._original = self._original, None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in all (max_steps)")
    parser.add_argument("--freeze-step", type=int, default=10)
    parser.add_argument("--optimizer", choices=["adam", "lamb", "zoadam"], default="adam")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--accumulate", type=int, default=1, choices=[1, 2, 4, 8], help="micro-batches per step")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--checkpoint-dir", default=None, help="save Lightning checkpoints there (ModelCheckpoint)")
    parser.add_argument("--save-every", type=int, default=5, help="optimizer steps between checkpoints")
    parser.add_argument("--resume", default=None, help="a checkpoint to continue from (trainer.fit(ckpt_path=...))")
    parser.add_argument("--exact-resume", action="store_true",
                        help="OnebitCallback(exact_resume=True): checkpoints hold every rank's compression errors")
    parser.add_argument("--result", default=None, help="write each rank's summary to RESULT.rank<r>.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's; Lightning reads the rest itself
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // devices
    counter = CountCollectives()
    callbacks = [OnebitCallback(exact_resume=args.exact_resume), counter]
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, save_top_k=-1, every_n_train_steps=args.save_every))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy="ddp" if devices * nodes > 1 else "auto",
        max_steps=args.steps, accumulate_grad_batches=args.accumulate, precision=args.precision,
        callbacks=callbacks, enable_checkpointing=bool(args.checkpoint_dir), logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.checkpoint_dir or ".",
    )
    module = Regressor(args.optimizer, args.lr, args.freeze_step)
    loader = DataLoader(synthetic_data(), batch_size=BATCH // args.accumulate, shuffle=False)
    trainer.fit(module, loader, ckpt_path=args.resume)

    optimizer = trainer.optimizers[0]
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    result = {
        "rank": trainer.global_rank, "world_size": trainer.world_size, "optimizer": args.optimizer,
        "global_step": trainer.global_step, "step_count": optimizer.step_count,
        "replicas_identical": optimizer.replicas_identical, "params": flat.tolist(),
        "param_sum": float(flat.double().sum()), "stats": optimizer.comm_stats(),
        "plans": {t: optimizer.plan_for(t).name for t in range(1, optimizer.step_count + 1)},
        "ddp_comm_hook": counter.ddp_comm_hook, "grad_allreduces": dict(counter.grad_allreduces),
        "sync_flags": dict(counter.sync_flags),
    }
    if args.result:
        with open(f"{args.result}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while another still uses them
        dist.destroy_process_group()
