"""Train a tiny regression model with OnebitAdam built from a DeepSpeed-style config.

The config alone picks the transport; the same script runs under either launcher::

    torchrun --nproc-per-node 2 examples/train_from_config.py --config examples/configs/onebit_gloo.json
    mpiexec -n 2 python -m mpi4py examples/train_from_config.py --config examples/configs/onebit_mpi.json

* ``comm_backend_name`` ``gloo`` / ``nccl`` / ``hccl``: the script initializes torch.distributed
  from torchrun's environment (run without torchrun, it starts a one-process group).
* ``mpi``: nothing to initialize: the optimizer's MPI backend starts MPI (mpi4py); torch.distributed
  is never used. ``python -m mpi4py`` aborts the whole job if one rank raises.

Every rank starts from the same weights and draws its own batches; ``train_batch_size`` is split
between the ranks and ``steps_per_print`` sets the logging interval (both read by this script,
not by onebit). At the end the script checks that the parameters are identical on every rank.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed

import onebit
from onebit.config import load_config

logger = logging.getLogger("train_from_config")

TORCH_DIST_BACKENDS = ("gloo", "nccl", "hccl")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="DeepSpeed-style .json/.yaml config with an 'optimizer' section")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda for nccl, npu for hccl, else cpu)")
    parser.add_argument("--save", default=None, help="save this rank's final parameters to SAVE.rank<r>.pt")
    return parser.parse_args()


def local_rank() -> int:
    for var in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def start_transport(name: str | None, device: str | None) -> torch.device:
    """Initialize what ``comm_backend_name`` needs and return the device to train on."""
    if name == "hccl":
        import torch_npu  # noqa: F401  (Ascend: registers the npu device and the hccl process-group backend)
    if device is None:
        device = {"nccl": "cuda", "hccl": "npu"}.get(name, "cpu")
    if device in ("cuda", "npu"):
        device = f"{device}:{local_rank()}"
        getattr(torch, device.split(":")[0]).set_device(device)
    if name in TORCH_DIST_BACKENDS:
        if "RANK" not in os.environ:  # not under torchrun: a one-process group
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
        torch.distributed.init_process_group(backend=name)  # rank, world size and address from the environment
    return torch.device(device)


def stop_transport(name: str | None) -> None:
    if name in TORCH_DIST_BACKENDS:
        # Every rank done with its collectives before any rank tears the group down: gloo can
        # abort a rank ("terminate called without an active exception") whose peer closed first.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = load_config(args.config)
    name = config.get("optimizer", {}).get("params", {}).get("comm_backend_name")
    device = start_transport(name, args.device)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    ).to(device)
    optimizer = onebit.from_config(model.parameters(), config)
    backend = optimizer.backend
    rank, world = backend.rank, backend.world_size
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    logger.info("backend %s, %d rank(s), device %s, freeze_step %d, torch.distributed in use: %s",
                backend.name, world, device, optimizer.freeze_step, torch.distributed.is_initialized())

    batch = max(1, int(config.get("train_batch_size", 64)) // world)
    print_every = int(config.get("steps_per_print", 10))
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(1234)).to(device)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    for step in range(1, args.steps + 1):
        x = torch.randn(batch, 16, generator=data).to(device)
        y = torch.sin(x @ teacher)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        phase = optimizer.phase  # the phase this step runs in
        optimizer.step()
        if step % print_every == 0 or step == args.steps:
            mean_loss = backend.all_reduce_mean_(loss.detach().reshape(1).float().clone()).item()
            logger.info("step %3d  %-11s  loss %.5f", step, phase, mean_loss)

    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    gathered = torch.empty(world, flat.numel(), device=flat.device)
    backend.all_gather(gathered, flat)
    if not all(torch.equal(gathered[r], flat) for r in range(world)):
        raise RuntimeError(f"rank {rank}: parameters differ between ranks")
    stats = optimizer.comm_stats()
    for phase in ("warmup", "compression"):
        steps = max(1, stats[phase]["steps"])
        logger.info("%-11s %3d steps, %8.0f bytes sent per step", phase, stats[phase]["steps"],
                    stats[phase]["bytes_sent"] / steps)
    logger.info("parameters identical on all %d rank(s)", world)
    if args.save:
        torch.save([p.detach().cpu() for p in model.parameters()], f"{args.save}.rank{rank}.pt")
    stop_transport(name)


if __name__ == "__main__":
    main()
