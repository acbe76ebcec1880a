"""HSDP with 1-bit Adam across the replicas: FSDP2 shards inside a node, onebit across nodes.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/fsdp/train_hsdp.py --steps 30

The recipe (the ZeRO + 1-bit that DeepSpeed never had):

* a 2-D mesh ``(replicate, shard)``: ``shard`` inside a node (fast links), ``replicate`` across
  nodes (the slow link);
* ``fully_shard`` over ``mesh["shard"]`` only: FSDP2 gathers the parameters and reduce-scatters
  the gradients inside the node, so each rank's ``p.grad`` is its shard of the node's mean;
* ``OnebitAdam(model.parameters(), group=mesh["replicate"])``: onebit averages each gradient shard
  across the replicas in full precision during the warmup, then the momentum shards with the
  1-bit compressed all-reduce. Its state (momentum, variance, compression errors) is the shard's:
  divided by the shard count, as ZeRO divides Adam's.

Native HSDP (``fully_shard(model, mesh=mesh)``) all-reduces the gradients across the replicas in
full precision every step; its switch to turn that off (``set_requires_all_reduce(False)``) leaves
``p.grad`` empty in torch 2.13, so the replicate all-reduce is handed to onebit this way.

Also shown: gradient accumulation (``set_requires_gradient_sync(False)`` on all but the last
micro-batch), mixed precision (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``:
the sharded parameters, their gradients and onebit's state stay float32), and a universal
checkpoint with ``torch.distributed.checkpoint`` (``--save`` / ``--load``), which loads into any
other layout (FSDP over all ranks, plain data parallel, another mesh shape).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from onebit import OnebitAdam


def build_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.GELU(), torch.nn.Linear(width, 1))


def batch(t: int, micro: int, replica: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank its own data: the data-parallel degree is replicas x shards."""
    gen = torch.Generator().manual_seed(((t * 16 + micro) * 16 + replica) * 16 + shard)
    x = torch.randn(16, 32, generator=gen)
    return x, x[:, :4].sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="size of the replicate dimension (nodes)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--freeze-step", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 gradients and state")
    parser.add_argument("--save", help="directory for a torch.distributed.checkpoint at the end")
    parser.add_argument("--load", help="a torch.distributed.checkpoint directory to resume from")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide the {world} ranks")
    mesh = init_device_mesh("cpu", (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))

    model = build_model(args.width)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"], mp_policy=policy)
    fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
    optimizer = OnebitAdam(model.named_parameters(), lr=3e-3, freeze_step=args.freeze_step, group=mesh["replicate"])

    if args.load:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=args.load)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])  # compression errors reset, logged once

    replica, shard = mesh.get_coordinate()
    first = optimizer.step_count + 1
    for t in range(first, first + args.steps):
        total = 0.0
        for micro in range(args.accumulate):
            model.set_requires_gradient_sync(micro == args.accumulate - 1)  # reduce-scatter on the last only
            x, y = batch(t, micro, replica, shard)
            loss = torch.nn.functional.mse_loss(model(x).float(), y) / args.accumulate
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (t % 10 == 0 or t == first):
            logging.info("step %d (%s): loss %.4f", t, optimizer.plan_for(t).name, total)

    optimizer.synchronize()  # a check here: the replicas' shards are identical (raises if not)
    stats = optimizer.comm_stats()
    state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    if rank == 0:
        logging.info("replicas identical after step %d; onebit state on this rank: %d bytes for %d of %d parameters",
                     optimizer.step_count, state_bytes, sum(p.to_local().numel() for p in model.parameters()),
                     sum(p.numel() for p in model.parameters()))
        logging.info("bytes sent per step by this rank across the replicas: %s",
                     {name: stats[name]["bytes_sent"] // max(stats[name]["steps"], 1) for name in optimizer.PLAN_NAMES})
    if args.save:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=args.save)
        if rank == 0:
            logging.info("saved a torch.distributed.checkpoint to %s", args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # FSDP2 keeps the device mesh alive (torch 2.13: after `fully_shard` alone, with the model deleted
    # and garbage collected, its FSDPParam objects and the mesh remain), and with it gloo threads
    # that outlive destroy_process_group and now and then abort a finished rank at exit.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: teardown.py
    from teardown import exit_skipping_teardown

    exit_skipping_teardown()
