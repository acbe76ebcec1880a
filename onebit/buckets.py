"""Buckets: the flat buffers an optimizer's state lives in, and the momentum masks over them.

A bucket is a run of parameters of one param group on one device. Its per-element state (one flat
buffer per name, e.g. ``exp_avg``) is laid out for the compressed all-reduce when the group is
compressed (:class:`onebit.compression.SegmentLayout`: each tensor padded on its own, so that every
tensor gets its own scales), else end to end. ``slices`` say where each tensor lies; the padding
between them (``real()`` is False there) holds zeros and never reaches a parameter.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .collectives import AllreduceState, new_state
from .compression import SegmentLayout
from .hierarchy import Topology
from .kernels.reference import pack_signs
from .shards import is_dtensor, local, local_value

__all__ = ["Bucket", "Derived", "split_into_buckets", "set_masks", "check_grads", "grads_of", "all_finite", "build_keep_mask"]

# Up to this many gradient tensors the finiteness check sums each (the fastest pass over a large
# tensor); above it, one foreach norm call avoids a Python call per tensor.
_FEW_TENSORS = 64
# Zeroing k scattered coordinates (index_fill_: 6.5 ns each) costs about what the decode's extra
# read of a packed mask over 1000 k coordinates does (0.14 ms per 25M; one CPU core): a bucket
# whose keep mask has more zeros than 1/RATIO of its length hands the mask to the decode.
_DENSE_MASK_RATIO = 1024


@dataclass
class Derived:
    """The keep masks the engine derives from a bucket's state, kept between steps, never saved:
    where the compressed buffer is kept 0 (the user's mask, the algorithm's dead coordinates, the
    padding). ``frozen_zeros`` / ``frozen_keep``: the indices when they are few (applying them costs
    what they hold), else packed bits over the padded buffer (set = keep) that the decode applies in
    its own pass, or None; ``frozen_mask_ready`` once derived (first compression step, or the first
    after an invalidation). What an algorithm derives (its denominators) it keeps itself, keyed by
    :attr:`Bucket.version`."""

    frozen_zeros: torch.Tensor | None = None
    frozen_keep: torch.Tensor | None = None
    frozen_mask_ready: bool = False


class Bucket:
    """Flat, padded buffers for a run of parameters of one group on one device.

    ``buffers[name]``: one float32 buffer per per-element state name, zeros at first, and
    ``views[name]``: its per-parameter views (made once: a view costs ~8 us, per tensor per step).
    ``scalars[name]``: one float64 value per parameter (a tensor of ``len(params)``).

    ``owners``: the parameters as the user gave them (the keys of the optimizer's state, the
    holders of ``.grad``); ``params``: the tensors the maths updates, the same objects except for
    DTensors (FSDP2, tensor parallel), whose local shards they are (see :mod:`onebit.shards`;
    :meth:`refresh` takes them afresh). Shapes and sizes here are the local ones.
    """

    def __init__(self, group_index: int, params: list[torch.Tensor], world_size: int, compress: bool,
                 scale_block_size: int | None, buffers: Sequence[str], scalars: Mapping[str, float],
                 topology: Topology | None = None, homes: Mapping[str, str] | None = None,
                 error_dtype: torch.dtype = torch.float32) -> None:
        self.group_index = group_index
        self.homes = dict(homes or {})  # buffer name -> "host" for one kept in host memory (see add_buffer)
        self.owners = params
        self.sharded = any(is_dtensor(p) for p in params)
        self.params = [local(p) for p in params] if self.sharded else params
        self.device = self.params[0].device
        numels = [p.numel() for p in self.params]
        self.numel = sum(numels)
        if compress:
            self.layout: SegmentLayout | None = SegmentLayout.build(numels, world_size, scale_block_size)
            self.slices = self.layout.slices()
            self.padded = self.layout.padded
        else:
            self.layout = None
            starts = [0, *itertools.accumulate(numels)]
            self.slices = [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]
            self.padded = self.numel
        self.buffers: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        for name in buffers:
            self.add_buffer(name)
        self.scalars = {name: torch.full((len(self.params),), value, dtype=torch.float64, device=self.device)
                        for name, value in scalars.items()}
        # Flat scratch buffers (e.g. the gathered, all-reduced gradient and the update direction),
        # allocated on first use; see scratch().
        self._scratch: dict[str, torch.Tensor] = {}
        self.mask: torch.Tensor | None = None  # the user's momentum mask (1 keep, 0 zero), padded layout
        # The keep masks derived from the state (see Derived): one object, replaced by invalidate()
        # whenever the state changes from outside a step. ``version`` counts those changes: an
        # algorithm's cache of values derived from the state is out of date once it differs.
        self.derived = Derived()
        self.version = 0
        self.compressed: torch.Tensor | None = None  # the buffer of the last compressed step
        self.same_dtype = all(p.dtype == torch.float32 for p in self.params)
        self.compression: AllreduceState | None = None
        if compress:
            self.compression = new_state(self.padded, world_size, self.device, self.layout.edges, topology,
                                         error_dtype)

    def refresh(self) -> None:
        """Take the local shards of DTensor parameters afresh (FSDP re-points a shard's storage when
        a state dict was loaded into the model before its first forward)."""
        if self.sharded:
            self.params = [local(p) for p in self.owners]

    def grads(self) -> list[torch.Tensor | None]:
        """The gradients of the parameters (local shards of DTensor gradients), None where absent."""
        if not self.sharded:
            return [p.grad for p in self.owners]
        return [None if p.grad is None else local(p.grad) for p in self.owners]

    def invalidate(self, everything: bool = True) -> None:
        """The state changed from outside a step: what was derived from it is out of date (the
        algorithm's, by :attr:`version`), and rebuilt from the buffers when next needed. After a
        load or a copy (``everything``) the keep masks too; not after some parameters' state was put
        back as it was before a step, which cannot change where the variance is 0."""
        self.version += 1
        if everything:
            self.derived = Derived()

    def forget_keep_mask(self) -> None:
        """The algorithm's dead coordinates changed (see ``OnebitOptimizer._dead``): the keep mask is
        derived again at the next compressed step."""
        self.derived.frozen_mask_ready = False

    def hold(self, indices: Sequence[int], shared: Sequence[str] = ()) -> Held:
        """Copies of everything a step may change for the parameters ``indices``: the parameters,
        their state (buffers, and scalars other than ``shared``, which advance with the step on
        every rank) and their segments' compression errors (:meth:`AllreduceState.error_slices`);
        :meth:`Held.restore_` puts them back after the step."""
        targets = []
        for i in indices:
            targets.append(self.params[i])
            targets.extend(views[i] for views in self.views.values())
            targets.extend(values[i:i + 1] for name, values in self.scalars.items() if name not in shared)
            if self.compression is not None:
                start = self.layout.starts[i]
                end = self.layout.starts[i + 1] if i + 1 < len(self.params) else self.padded
                targets += self.compression.error_slices(start, end)
        return Held(self, [(target, target.clone()) for target in targets])

    def add_buffer(self, name: str) -> None:
        """Allocate the per-element state buffer ``name`` (zeros) and its views, if absent: on the
        bucket's device, or where :attr:`homes` says ``"host"``, in host memory (pinned when the
        bucket is on a GPU, so that copies to and from it are DMA transfers)."""
        if name not in self.buffers:
            if self.homes.get(name) == "host":
                pin = self.device.type == "cuda"
                buffer = torch.zeros(self.padded, dtype=torch.float32, device="cpu", pin_memory=pin)
            else:
                buffer = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
            self.buffers[name] = buffer
            self.views[name] = self.view(buffer)

    def drop_buffer(self, name: str) -> None:
        """Free the state buffer ``name``, if present."""
        self.buffers.pop(name, None)
        self.views.pop(name, None)

    def view(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat buffer in this bucket's layout."""
        return [flat[s].view(p.shape) for s, p in zip(self.slices, self.params)]

    def real(self) -> torch.Tensor:
        """A bool tensor over the padded buffer: True where a parameter element lies."""
        real = torch.zeros(self.padded, dtype=torch.bool, device=self.device)
        for s in self.slices:
            real[s] = True
        return real

    def scratch(self, name: str, length: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The flat buffer ``name`` (``padded`` elements, or ``length``; float32 unless ``dtype``),
        zeros when first allocated; the padding of a padded one is never written by the engine."""
        buffer = self._scratch.get(name)
        if buffer is None:
            size = self.padded if length is None else length
            buffer = self._scratch[name] = torch.zeros(size, dtype=dtype, device=self.device)
        return buffer

    def wire(self) -> torch.Tensor:
        """What a full-precision all-reduce of this bucket sends: the gradients end to end (not
        in the padded layout, so that exactly their bytes travel), then one presence flag per
        parameter (1.0 where this rank has a gradient; after the mean, 0 where no rank has one)."""
        return self.scratch("wire", self.numel + len(self.params))

    def wire_to_send(self, dtype: torch.dtype | None) -> torch.Tensor:
        """The tensor whose all-reduce averages :meth:`wire`: the wire itself, or with ``dtype``
        (the optimizer's ``reduce_dtype``) a copy of it in ``dtype``, which :meth:`wire_received`
        copies back once the all-reduce is through."""
        if dtype is None:
            return self.wire()
        low = self.scratch("wire_low", self.numel + len(self.params), dtype)
        return low.copy_(self.wire())

    def wire_received(self, dtype: torch.dtype | None) -> None:
        """After the all-reduce of :meth:`wire_to_send`: the averages into :meth:`wire`."""
        if dtype is not None:
            self.wire().copy_(self._scratch["wire_low"])

    def dense_grads(self) -> list[torch.Tensor]:
        """Views of :meth:`wire`'s gradients, one per parameter."""
        return list(self.wire()[:self.numel].split([p.numel() for p in self.params]))

    def presence(self) -> torch.Tensor:
        """The presence flags at the end of :meth:`wire`."""
        return self.wire()[self.numel:]

    def averaged_grad(self) -> torch.Tensor:
        """The (averaged) gradient of :meth:`wire` in the padded layout: the wire itself when
        nothing is padded, else spread into the scratch buffer ``'update'``, where the algorithm
        writes its update direction once it has read the gradient (one buffer for the two)."""
        if self.padded == self.numel:
            return self.wire()[:self.numel]
        grad = self.scratch("update")
        torch._foreach_copy_([grad[s] for s in self.slices], self.dense_grads())
        return grad

    def release_scratch(self, *names: str) -> None:
        """Free the scratch buffers ``names`` (those held), or all of them (and :attr:`compressed`
        where it is one of them or a view of one)."""
        released = [self._scratch.pop(name) for name in (names or list(self._scratch)) if name in self._scratch]
        if self.compressed is not None and any(_same_storage(self.compressed, buffer) for buffer in released):
            self.compressed = None  # (a view of a released buffer would keep all of it)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Held:
    """Values of a bucket kept through a step (see :meth:`Bucket.hold`)."""

    def __init__(self, bucket: Bucket, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.bucket = bucket
        self.saved = saved

    def restore_(self) -> None:
        """Put the values back; the denominator derived from the state is then out of date."""
        for target, value in self.saved:
            target.copy_(value)
        self.bucket.invalidate(everything=False)


def split_into_buckets(params: list[torch.Tensor], bucket_size: int) -> list[list[torch.Tensor]]:
    """The trainable ``params`` by device, in runs of at most ``bucket_size`` elements (a larger
    tensor is a run of its own; a DTensor counts its local shard)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        if p.requires_grad:
            by_device.setdefault(local(p).device, []).append(p)
    runs = []
    for tensors in by_device.values():
        run: list[torch.Tensor] = []
        size = 0
        for p in tensors:
            numel = local(p).numel()  # a DTensor's local shard
            if run and size + numel > bucket_size:
                runs.append(run)
                run, size = [], 0
            run.append(p)
            size += numel
        if run:
            runs.append(run)
    return runs


def set_masks(buckets: list[Bucket], masks: Mapping[torch.Tensor, torch.Tensor], momentum: str | None) -> None:
    """Validate ``{param: mask}`` and write each mask into its bucket's padded ``mask``; zero the
    ``momentum`` buffer (if any) where it is 0. Nothing changes unless every mask is valid."""
    if not isinstance(masks, Mapping):
        raise TypeError(f"momentum_masks must be a mapping {{param: mask}}, got {type(masks).__name__}")
    located = {}
    for bucket in buckets:
        for i, p in enumerate(bucket.owners):
            located[id(p)] = (bucket, i)
    checked = []
    for param, mask in masks.items():
        if id(param) not in located:
            raise ValueError(
                f"momentum_masks has a key of shape {tuple(param.shape)} that is not a trainable "
                "parameter of this optimizer; key the mapping by the parameter tensor itself"
            )
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"momentum mask must be a tensor, got {type(mask).__name__}")
        if mask.shape != param.shape:
            raise ValueError(
                f"momentum mask of shape {tuple(mask.shape)} does not match its parameter of shape "
                f"{tuple(param.shape)}; give a mask of the parameter's shape"
            )
        if mask.device != param.device:
            raise ValueError(
                f"momentum mask is on {mask.device} but its parameter is on {param.device}; "
                f"move the mask with mask.to({str(param.device)!r})"
            )
        if mask.dtype != torch.bool:
            if not mask.is_floating_point() and mask.dtype not in (torch.uint8, torch.int8, torch.int32, torch.int64):
                raise TypeError(f"momentum mask must be bool or 0/1 numbers, got dtype {mask.dtype}")
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("momentum mask must contain only 0 and 1 (or be a bool tensor)")
        if is_dtensor(param):  # a full mask, or one laid out like the parameter: this rank's shard of it
            mask = local_value(mask, param)
        checked.append((located[id(param)], mask))
    for (bucket, i), mask in checked:
        if bucket.mask is None:
            bucket.mask = torch.ones(bucket.padded, dtype=torch.float32, device=bucket.device)
        bucket.mask[bucket.slices[i]].copy_(mask.reshape(-1).to(torch.float32))
        if momentum is not None:
            bucket.buffers[momentum].mul_(bucket.mask)


def _gather_grads(bucket: Bucket, inv_scale: torch.Tensor | None, dense: bool) -> list[torch.Tensor]:
    """Copy the gradients (None: zeros) into one of the bucket's flat buffers and return the
    per-parameter views of it: end to end (``dense``, see :meth:`Bucket.dense_grads`) or in the
    bucket's padded layout (``'grad'``)."""
    views = bucket.dense_grads() if dense else [bucket.scratch("grad")[s] for s in bucket.slices]
    grads = bucket.grads()
    for view, g in zip(views, grads):
        if g is None:
            view.zero_()
        else:
            view.copy_(g.reshape(-1))
    if dense:
        bucket.presence().copy_(torch.tensor([float(g is not None) for g in grads]))
    if inv_scale is not None:
        torch._foreach_mul_(views, inv_scale.to(bucket.device))
    return [view.view(p.shape) for view, p in zip(views, bucket.params)]


def grads_of(bucket: Bucket, full_precision: bool, inv_scale: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The gradients a step reads, one per parameter (None: no gradient, i.e. zero).

    Read straight from the parameters' ``.grad`` tensors when they are float32, need no unscaling
    and are not all-reduced: nothing else reads a flat copy then. Else gathered into a flat
    buffer, returned as views of it: for a full-precision all-reduce (``full_precision``), the
    gradients end to end, so that exactly their bytes travel (:meth:`Bucket.averaged_grad` spreads
    them into the padded layout); else (GradScaler, other dtypes) the padded layout."""
    if not full_precision and inv_scale is None:
        grads = bucket.grads()
        if all(g is None or g.dtype == torch.float32 for g in grads):
            return grads
    return _gather_grads(bucket, inv_scale, dense=full_precision)


def all_finite(grads: list[list[torch.Tensor | None]]) -> bool:
    """Whether every gradient is finite: one read-only pass. A tensor's sum (few tensors) or L2
    norm (many: one foreach call instead of a call per tensor) is NaN or inf when an element is;
    when it overflowed from finite values only, the exact element-wise check decides."""
    present = [g for bucket_grads in grads for g in bucket_grads if g is not None]
    if not present:
        return True
    if len(present) <= _FEW_TENSORS:
        totals = torch.stack([g.sum() for g in present])
    else:
        totals = torch.stack(torch._foreach_norm(present, 2))
    finite = torch.isfinite(totals)
    if bool(finite.all()):
        return True
    return all(bool(torch.isfinite(g).all()) for g, ok in zip(present, finite.tolist()) if not ok)


def build_keep_mask(bucket: Bucket, dead: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """At the first compressed step (or the first after a load): the coordinates whose compressed
    value is kept 0 from then on: the user's mask, ``dead`` (bool over the padded buffer, the
    algorithm's) and the padding. Returns the kept coordinates (bool over the padded buffer) and
    the number of dead parameter coordinates."""
    keep = bucket.real()
    dead_count = 0
    if dead is not None:
        keep.masked_fill_(dead, False)
        dead_count = bucket.numel - int(torch.count_nonzero(keep))  # (a bool sum() is ~20x slower)
    if bucket.mask is not None:
        keep.masked_fill_(bucket.mask == 0, False)
    zeros = bucket.padded - int(torch.count_nonzero(keep))  # the padding included: it is zeroed too
    derived = bucket.derived
    derived.frozen_zeros = derived.frozen_keep = None
    if zeros * _DENSE_MASK_RATIO > bucket.padded:
        derived.frozen_keep = pack_keep(keep)
    elif zeros:
        derived.frozen_zeros = torch.nonzero(~keep).flatten()
    derived.frozen_mask_ready = True
    return keep, dead_count


def pack_keep(keep: torch.Tensor) -> torch.Tensor:
    """``keep`` (bool, length a multiple of 8) as the decode's packed mask: bit 1 where kept, MSB
    first, i.e. ``pack_signs`` of +1 where kept and -1 elsewhere. On the CPU numpy packs the
    bools directly (~30x faster than building the signs: 0/1 Adam rebuilds the mask after a
    variance step that gave zero-variance coordinates a variance)."""
    if keep.device.type == "cpu":
        return torch.from_numpy(np.packbits(keep.numpy()))
    return pack_signs(torch.where(keep, 1.0, -1.0))


def check_grads(buckets: list[Bucket], owner: str) -> None:
    """Every present gradient is dense, of its parameter's shape, on its device."""
    for bucket in buckets:
        for p in bucket.owners:
            g = p.grad
            if g is None:
                continue
            if is_dtensor(p) and (not is_dtensor(g) or tuple(g.placements) != tuple(p.placements)):
                laid = tuple(g.placements) if is_dtensor(g) else "a plain tensor"
                raise ValueError(
                    f"the gradient of a DTensor parameter laid out as {tuple(p.placements)} is {laid}; onebit "
                    "averages local shards, which needs the gradient laid out like its parameter (as FSDP2 and "
                    "parallelize_module leave it)")
            if g.is_sparse:
                raise ValueError(f"{owner} does not support sparse gradients; use dense embeddings (sparse=False)")
            if g.shape != p.shape:
                raise ValueError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
            if g.device != p.device:
                raise ValueError(f"gradient on {g.device} for a parameter on {p.device}; keep them on one device")
