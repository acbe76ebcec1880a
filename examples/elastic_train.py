"""Elastic training with onebit: restart from the last checkpoint after any crash.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/elastic_train.py --out runs/elastic

``torchrun --max-restarts`` restarts every rank when one dies (a SIGKILL, an OOM kill, a lost
node); this script then loads the last committed checkpoint and carries on. Checkpoints are all or
nothing (``onebit.save_checkpoint``): whatever moment a rank dies, the restart finds the new
checkpoint or the previous one, complete, on every rank. With ``--exact-resume`` (the default)
each rank's compression errors are part of the checkpoint, and the run ends bit for bit where an
uninterrupted run ends; without, the errors are reset at the restart (the paper's default).
``--optimizer zoadam`` trains with 0/1 Adam, whose ranks differ between syncs: exact resume then
keeps every rank's own parameters and state, any other load gives every rank rank 0's.

Everything a step reads comes from the step number (batches are drawn from a generator seeded
by the step and the rank), so the steps after the checkpoint are replayed exactly. The script
may restart on another world size (``--nproc-per-node 3`` after a run on 2): the checkpoint
loads, the errors are reset. At the end every rank writes its parameters to
``<out>/final.rank<r>.pt`` and checks that they are identical on every rank (unless the last step
of 0/1 Adam was a local one).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from onebit import OnebitAdam, OnebitOptimizer, ZeroOneAdam, load_checkpoint, save_checkpoint

logger = logging.getLogger("elastic_train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory: checkpoint.pt (+ parts) and final.rank<r>.pt")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--freeze-step", type=int, default=6,
                   help="OnebitAdam's freeze_step; ZeroOneAdam's var_freeze_step")
    p.add_argument("--optimizer", choices=("adam", "zoadam"), default="adam",
                   help="adam: OnebitAdam; zoadam: ZeroOneAdam (0/1 Adam), with short schedules so that "
                        "checkpoints fall between syncs too")
    p.add_argument("--no-exact-resume", dest="exact_resume", action="store_false")
    return p.parse_args(argv)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> OnebitOptimizer:
    if args.optimizer == "zoadam":
        return ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=args.freeze_step, var_update_scaler=2,
                           local_step_scaler=2, local_step_clipper=4, comm_backend_name="gloo")
    return OnebitAdam(model.parameters(), lr=1e-2, freeze_step=args.freeze_step, comm_backend_name="gloo")


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(16, 12, generator=gen), torch.randn(16, 4, generator=gen)


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group(backend)`` from the launcher's environment, with the store's keys
    under a prefix of their own for each restart (``TORCHELASTIC_RESTART_COUNT``).

    torchrun's workers share its agent's store across restarts, and the process group's keys (each
    rank's gloo address, the barrier counters) are the same in every attempt: a restarted rank
    could read the address of a rank killed in the previous attempt and fail in gloo's connection
    set-up, or wait on a stale counter. A prefix per attempt gives every attempt fresh keys."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}/", store), rank=rank,
                            world_size=world_size, timeout=timeout)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # A bounded timeout: a rank blocked on a dead peer fails within a minute (gloo's default is 30)
    # and torchrun restarts the group; a restart whose gloo connection fails does the same.
    init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    out = Path(args.out)
    checkpoint = out / "checkpoint.pt"
    model = build_model()
    opt = build_optimizer(args, model)
    if checkpoint.exists():  # a restart: rank 0 committed at least one checkpoint
        load_checkpoint(checkpoint, opt, model=model, exact_resume=args.exact_resume)
        logger.info("rank %d: restart %s resumes after step %d", rank,
                    os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"), opt.step_count)
    for step in range(opt.step_count + 1, args.steps + 1):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step % args.save_every == 0:
            save_checkpoint(checkpoint, opt, model=model, exact_resume=args.exact_resume)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(params, out / f"final.rank{rank}.pt")
    everyone = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, params)
    if opt.replicas_identical and not all(torch.equal(p, params) for p in everyone):  # not between syncs
        raise RuntimeError("parameters differ between ranks at the end of the run")
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
