"""A onebit optimizer in a Hugging Face Accelerate loop, on N processes (gloo on CPU, nccl on GPUs).

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate/train.py --steps 12 --freeze-step 4
    torchrun --nproc-per-node 2 examples/accelerate/train.py --steps 12 --freeze-step 4   # the same

(On a machine without GPUs ``--multi_gpu`` still starts 2 processes, through torchrun, and the
script's ``Accelerator(cpu=True)`` makes them train data-parallel on the CPU with gloo;
``accelerate launch --cpu`` would start only one.)

A small MLP fits a fixed random teacher on synthetic batches (different on every rank).
``accelerator.prepare`` wraps the model in DDP; ``attach_accelerate`` gives that DDP the onebit hook,
so gradients are averaged once, by DDP during backward, on the steps whose plan averages them, and
not at all on the others, where the optimizer sends 1-bit momentum (or, for 0/1 Adam, sometimes
nothing). ``--accumulate K`` runs K micro-batches per step under ``accelerator.accumulate``.

With ``--reference`` each rank also runs the same optimizer in a plain loop (no accelerate, no DDP)
on the same batches, and ``--result`` writes, per rank, both trajectories and the gradient
collectives DDP made in each step, for tests/test_accelerate.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator

from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from onebit.integrations import attach_accelerate

IN, HIDDEN, OUT, BATCH = 8, 32, 4, 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def make_optimizer(name: str, model: torch.nn.Module, freeze_step: int, overlap: bool = False):
    if name == "adam":
        return OnebitAdam(model.parameters(), lr=1e-2, freeze_step=freeze_step, overlap_backward=overlap)
    if name == "lamb":
        return OnebitLamb(model.parameters(), lr=1e-2, freeze_step=freeze_step, overlap_backward=overlap)
    # 0/1 Adam: variance refreshed on steps 0, 1, 3, then 1-bit gradients, local steps and syncs.
    return ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=freeze_step, var_update_scaler=1,
                       local_step_scaler=2, local_step_clipper=2, overlap_backward=overlap)


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(IN, OUT, generator=teacher)
    x = torch.randn(BATCH, IN, generator=gen)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(BATCH, OUT, generator=gen)


class GradientCollectives:
    """Counts the all-reduces DDP's onebit hook makes (they all go through ``dist.all_reduce``)."""

    def __init__(self) -> None:
        self.calls = self.numel = 0
        self._all_reduce = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            self.calls += 1
            self.numel += tensor.numel()
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counted

    def take(self) -> tuple[int, int]:
        counts, self.calls, self.numel = (self.calls, self.numel), 0, 0
        return counts


def train_accelerate(args, rank: int, counter: GradientCollectives) -> dict:
    # On CPU accelerate wraps the model in DDP only when told it runs on CPU (or ACCELERATE_USE_CPU=1).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.accumulate,
                              mixed_precision=args.mixed_precision)
    model = make_model()
    optimizer = make_optimizer(args.optimizer, model, args.freeze_step, args.overlap)
    model, optimizer = accelerator.prepare(model, optimizer)
    attach_accelerate(model, optimizer)
    plans, collectives, trajectory = [], [], []
    for step in range(1, args.steps + 1):
        plans.append(optimizer.optimizer.next_plan.name)
        per_micro_batch = []
        for micro in range(args.accumulate):
            with accelerator.accumulate(model):
                x, y = batch(rank, step, micro)
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                counter.take()
                accelerator.backward(loss)
                per_micro_batch.append(counter.take())  # (calls, floats) DDP sent in this backward
                optimizer.step()
                optimizer.zero_grad()
        collectives.append(per_micro_batch)
        trajectory.append([p.detach().clone() for p in accelerator.unwrap_model(model).parameters()])
    onebit_optimizer = optimizer.optimizer
    return {"plans": plans, "collectives": collectives, "trajectory": trajectory, "stats": onebit_optimizer.comm_stats(),
            # overlap: whether a step had to redo what a backward started (accelerate's no_sync should prevent it)
            "redone": onebit_optimizer.overlap_redone}


def train_plain(args, rank: int) -> list:
    """The oracle: the same optimizer on the same batches, without accelerate or DDP."""
    model = make_model()
    optimizer = make_optimizer(args.optimizer, model, args.freeze_step, args.overlap)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16")
    trajectory = []
    for step in range(1, args.steps + 1):
        for micro in range(args.accumulate):
            x, y = batch(rank, step, micro)
            with autocast:
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            (loss / args.accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--freeze-step", type=int, default=4)
    parser.add_argument("--optimizer", choices=["adam", "lamb", "zoadam"], default="adam")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--overlap", action="store_true", help="overlap_backward=True: communicate during backward")
    parser.add_argument("--reference", action="store_true", help="also run the plain-loop optimizer (the oracle)")
    parser.add_argument("--result", default=None, help="write each rank's results to RESULT.rank<r>.pt")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    counter = GradientCollectives()
    result = train_accelerate(args, rank, counter)
    if args.reference:
        result["reference"] = train_plain(args, rank)
    final = torch.cat([p.flatten() for p in result["trajectory"][-1]])
    logging.info("plans %s; final parameter checksum %.8f; %s", "".join(p[0] for p in result["plans"]),
                 final.double().sum().item(), json.dumps({k: v for k, v in result["stats"].items()
                                                          if isinstance(v, dict) and "bytes_sent" in v}))
    if args.result:
        torch.save(result, f"{args.result}.rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: teardown.py
    from teardown import exit_skipping_teardown

    exit_skipping_teardown()  # a SIGABRT at exit failed CI once, with overlap_backward
