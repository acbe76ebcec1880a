"""The layout of an optimizer's buckets: a digest of it (saved in checkpoints, compared by copies
and loads) and the check, at the first step, that every rank of the group holds the same one."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .buckets import Bucket
from .shards import shard_signature

__all__ = ["layout_digest", "check_layout", "ranks_differing", "ranks_holding_other"]


def layout_digest(buckets: list[Bucket]) -> str:
    """16 hex digits that differ when the layout (groups, shapes, dtypes, buckets, segments, and a
    two-level all-reduce's nodes, ranks per node and variant, whose errors have other shapes) does."""
    description = repr([(b.group_index, b.device.type, b.padded, b.compression is not None,
                         None if b.layout is None else b.layout.edges,
                         [(tuple(p.shape), str(p.dtype)) for p in b.params], *_topology(b), *_shards(b)) for b in buckets])
    return hashlib.sha256(description.encode()).hexdigest()[:16]


def _shards(bucket: Bucket) -> list[list[tuple[Any, ...]]]:
    """``[signatures]`` of a bucket of DTensor shards (:func:`onebit.shards.shard_signature`), else
    ``[]`` (digests of plain parameters stay what they were)."""
    return [[shard_signature(p) for p in bucket.owners]] if bucket.sharded else []


def _topology(bucket: Bucket) -> list[tuple[Any, ...]]:
    """What the topology of the bucket's compressed all-reduce adds (:meth:`AllreduceState.layout_key`:
    ``[(nodes, local, variant)]`` for a two-level one; ``[]`` for a flat one or none, so that the
    digests of flat layouts, saved in checkpoints, stay what they were)."""
    return [] if bucket.compression is None else bucket.compression.layout_key()


def check_layout(buckets: list[Bucket], backend: Any) -> None:
    """One all-gather of the layout digest, so that ranks holding different models fail with the
    same clear error instead of deadlocking or mixing buffers."""
    if not buckets:
        return
    differ = ranks_differing(backend, bytes.fromhex(layout_digest(buckets)), buckets[0].device)
    if differ and any(b.sharded for b in buckets):
        raise ValueError(
            f"the parameter layout differs between the ranks of this optimizer's group: ranks {differ} hold "
            "other shards of the DTensor parameters than rank 0 (or other shapes, dtypes, param groups or "
            "bucket_size); onebit averages local shards over its group, which must be the data-parallel "
            "dimension whose ranks hold the same shards: pass group=mesh['replicate'] (HSDP) or "
            "group=mesh['dp'] (tensor parallel), the mesh dimension FSDP and parallelize_module do not use"
        )
    if differ:
        raise ValueError(
            f"the parameter layout differs between ranks: ranks {differ} do not match rank 0 (their "
            "parameter shapes, dtypes, param groups or bucket_size differ); every rank must build the "
            "same model and the same param groups in the same order"
        )


def ranks_differing(backend: Any, digest: bytes, device: torch.device) -> list[int]:
    """One all-gather of this rank's 8-byte ``digest``: the ranks whose digest is not rank 0's."""
    mine = torch.tensor(list(digest[:8]), dtype=torch.uint8, device=device)
    everyone = torch.empty(backend.world_size, 8, dtype=torch.uint8, device=device)
    backend.all_gather(everyone, mine)
    return [r for r in range(everyone.shape[0]) if not torch.equal(everyone[r], everyone[0])]


def ranks_holding_other(backend: Any, tensors: Any, device: torch.device) -> list[int]:
    """The ranks whose ``tensors`` (an iterable, in the same order on every rank) are not bit for
    bit rank 0's: a digest of their bytes, one all-gather of 8 bytes."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return ranks_differing(backend, digest.digest(), device)
