"""DTensor parameters: the optimizers work on each rank's local shard.

FSDP2 (``fully_shard``) and tensor parallelism (``parallelize_module``) make parameters and
gradients ``torch.distributed.tensor.DTensor``. A onebit optimizer given such parameters keeps its
state for the local shard only (``p.to_local()``: a view into the shard's storage, taken afresh at
every step because FSDP may re-point it before the first forward) and communicates over its own
``group`` only: the data-parallel (replicate) dimension, whose ranks hold the same shards.

What must agree over the group, besides the local shapes, is *which* shard each rank holds: the
layout digest includes, per parameter, its global shape, its placements and this rank's coordinates
on the mesh dimensions it is sharded over (:func:`shard_signature`), so that a group that mixes
different shards of a parameter fails the layout check instead of averaging them.

``torch.distributed.tensor`` is imported on first use.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_dtensor", "local", "shard_signature", "like_param", "local_value", "mesh_group", "reduce_over_shards_",
           "first_shard"]


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (without importing the DTensor module for plain tensors)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not isinstance(t, torch.Tensor):
        return False
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage, without autograd), else ``t``."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def shard_signature(p: torch.Tensor) -> tuple[Any, ...]:
    """What ranks that average ``p``'s local shards must agree on: ``()`` for a plain tensor; for a
    DTensor its global shape, placements and this rank's coordinates on the mesh dimensions it is
    sharded over (replicated dimensions may differ: that is where onebit averages)."""
    if not is_dtensor(p):
        return ()
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate() or []
    sharded = [dim for dim, placement in enumerate(p.placements) if not placement.is_replicate()]
    return (tuple(p.shape), tuple(str(placement) for placement in p.placements),
            tuple(coordinate[dim] for dim in sharded))


def like_param(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value`` (shaped like ``p``'s local shard) as a DTensor laid out like ``p``, for a state
    dict that ``torch.distributed.checkpoint`` can reshard; ``value`` itself for a plain ``p``."""
    if not is_dtensor(p):
        return value
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def local_value(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A saved per-element state tensor for ``p``, as ``p``'s local shard: a DTensor laid out like
    ``p`` gives its local shard; a full tensor (a checkpoint of an unsharded run) is cut to ``p``'s
    shard on this rank without communication. Raises ``ValueError`` for a DTensor laid out otherwise."""
    if not is_dtensor(p):
        if is_dtensor(value):
            from torch.distributed.tensor import Replicate
            return value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim).to_local()
        return value
    if is_dtensor(value):
        if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
            raise ValueError(
                f"a state tensor laid out as {tuple(value.placements)} on {value.device_mesh} for a parameter laid "
                f"out as {tuple(p.placements)} on {p.device_mesh}; load it with "
                "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, which reshards")
        return value.to_local()
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()


def mesh_group(group: Any) -> Any:
    """``group`` itself, or the process group of a 1-D ``DeviceMesh`` (e.g. ``mesh['replicate']``)."""
    if type(group).__name__ != "DeviceMesh":
        return group
    if group.ndim != 1:
        raise ValueError(
            f"group= got a {group.ndim}-D DeviceMesh {tuple(group.mesh_dim_names or ())}; give the 1-D mesh of the "
            "data-parallel dimension, e.g. group=mesh['replicate'] (or mesh['dp'])")
    return group.get_group()


def reduce_over_shards_(values: torch.Tensor, owners: list[torch.Tensor], op: Any) -> torch.Tensor:
    """``values[i]`` (one number per parameter of ``owners``) reduced with ``op`` over the mesh
    dimensions that parameter ``i`` is sharded on: a shard's sum of squares or maximum becomes its
    whole tensor's (LAMB's norms). One all-reduce per mesh dimension per layout, in parameter
    order, so every rank of a shard group calls the same ones."""
    import torch.distributed as dist

    layouts: dict[tuple[int, tuple[int, ...]], tuple[Any, tuple[int, ...], list[int]]] = {}
    for i, p in enumerate(owners):
        if is_dtensor(p):
            dims = tuple(d for d, placement in enumerate(p.placements) if not placement.is_replicate())
            if dims:
                layouts.setdefault((id(p.device_mesh), dims), (p.device_mesh, dims, []))[2].append(i)
    for mesh, dims, indices in layouts.values():
        index = torch.tensor(indices, device=values.device)
        part = values.index_select(0, index)
        for dim in dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        values.index_copy_(0, index, part)
    return values


def first_shard(params: list[torch.Tensor]) -> bool:
    """Whether this rank holds the first shard of every sharded DTensor in ``params`` (coordinate 0
    on each sharded mesh dimension); True without DTensors. Rank 0 of each shard's optimizer group
    would say the same info line once per shard: only the first shard's says it."""
    for p in params:
        if is_dtensor(p):
            coordinate = p.device_mesh.get_coordinate() or []
            if any(coordinate[d] != 0 for d, placement in enumerate(p.placements) if not placement.is_replicate()):
                return False
    return True
