"""An optimizer's life outside its steps: copies (``deepcopy``, pickle) and a trainable set that
changes (parameters that start or stop requiring gradients). Used by
:class:`onebit.engine.OnebitOptimizer`, which inherits these methods, as it does the ``state_dict``
contract of :mod:`onebit.state`."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from .backends import BACKEND_NAMES
from .buckets import Bucket, set_masks

logger = logging.getLogger("onebit.engine")

__all__ = ["Lifecycle"]


class Lifecycle:
    """Copies are built again from the constructor's arguments (recorded by ``__new__``), the
    param groups, the state dict and this rank's compression errors; a changed trainable set lays
    the buckets out again, every parameter keeping its state."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Lifecycle:
        # The constructor's arguments, less the parameters: what a copy is built again from.
        self = super().__new__(cls)
        self._init_args = (args[1:], {k: v for k, v in kwargs.items() if k != "params"})
        return self

    def _copy_state(self) -> dict[str, Any]:
        """What a copy is made of: the constructor's arguments, the param groups (their tensors
        and hyperparameters), the state dict, this rank's compression errors and the bookkeeping
        of a step; the transport and kernels are not copied but resolved again."""
        args, kwargs = self._init_args
        return {"args": args, "kwargs": kwargs, "param_groups": self.param_groups, "state_dict": self._build_state_dict(),
                "errors": [(w.clone(), s.clone()) for w, s in self.compression_errors()],
                "layout": self.layout_digest(), "health": self._health, "gradients_averaged": self._gradients_averaged,
                "compressed_steps": self._compressed_steps, "layout_checked": self._layout_checked}

    def __deepcopy__(self, memo: dict[int, Any]) -> Lifecycle:
        """A copy that shares nothing mutable with this optimizer (its parameters are the copies
        made in the same ``deepcopy``, e.g. of ``(model, optimizer)``), and the same transport."""
        state = self._copy_state()
        kwargs = state.pop("kwargs")
        shared = {k: kwargs[k] for k in ("backend", "group") if kwargs.get(k) is not None}
        state = copy.deepcopy({**state, "kwargs": {k: v for k, v in kwargs.items() if k not in shared}}, memo)
        state["kwargs"].update(shared)
        new = type(self).__new__(type(self))
        new.__setstate__(state)
        return new

    def __getstate__(self) -> dict[str, Any]:
        """Pickling: a transport object cannot travel; the copy resolves its transport again by
        name (as torch's PowerSGD state does with its process group): a ``backend`` object by its
        name, a ``group`` as the default group (logged)."""
        state = self._copy_state()
        kwargs = dict(state["kwargs"])
        backend = kwargs.pop("backend", None)
        if backend is not None:
            kwargs["comm_backend_name"] = backend.name if getattr(backend, "name", None) in BACKEND_NAMES else None
        if kwargs.pop("group", None) is not None:
            logger.warning("onebit: pickling %s: its process group cannot be pickled; the copy will use the default "
                           "group", type(self).__name__)
        state["kwargs"] = kwargs
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._init_args = (state["args"], state["kwargs"])
        type(self).__init__(self, state["param_groups"], *state["args"], **state["kwargs"])
        same = state["layout"] == self.layout_digest()
        self._copying = True
        try:
            self.restore(state["state_dict"], state["errors"] if same else None)
        finally:
            del self._copying
        if not same:
            logger.info("onebit: the copy of %s has another layout (world size?): compression errors reset",
                        type(self).__name__)
        self._health = state["health"]
        self._gradients_averaged = state["gradients_averaged"]
        self._compressed_steps = state["compressed_steps"]
        self._layout_checked = state["layout_checked"] and same

    # ----------------------------------------------------------------- the trainable set

    def _trainable(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for group in self.param_groups for p in group["params"])

    def _rebuild_buckets(self) -> None:
        """Parameters started or stopped requiring gradients (a layer unfrozen, or frozen): lay the
        buckets out again over the trainable ones, as at construction, so that frozen parameters
        cost no bytes. Every parameter keeps its state: in a bucket, or, once frozen, as tensors
        of its own until it trains again; a newcomer starts from zeros. The compression errors
        start afresh (their layout changed) and the ranks check the new layout at this step."""
        self._bring_back()
        saved = {p: {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in entry.items()}
                 for p, entry in self.state.items() if isinstance(p, torch.Tensor)}
        for bucket in self._buckets:
            for p in bucket.owners:
                del self.state[p]
        self._buckets = []
        for index in range(len(self.param_groups)):
            self._build_group_buckets(index)
        owned = self.STATE.owned
        for bucket in self._buckets:
            for name in self.STATE.lazy:
                if any(name in saved.get(p, {}) for p in bucket.owners):
                    self._allocate(bucket, name)
            newcomers = []
            for i, p in enumerate(bucket.owners):
                entry = saved.pop(p, None)
                if entry is None:
                    newcomers.append(i)
                    continue
                for name, value in entry.items():
                    if name not in owned:
                        self.state[p][name] = value
                    elif name in self.state[p]:
                        self.state[p][name].copy_(value)
            for i in newcomers:
                self._adopt(bucket, i, newcomers)
        for p, entry in saved.items():  # frozen now: their state waits for them
            self.state[p] = entry
        located = {id(p) for bucket in self._buckets for p in bucket.owners}
        set_masks(self._buckets, {p: m for p, m in self._momentum_masks.items() if id(p) in located}, self.STATE.masked)
        self._invalidate()
        self._layout_checked = False
        self._trainable_at_build = self._trainable()
        if self._speaks:
            logger.info("onebit: step %d: the trainable parameters changed (%d of %d now): buckets laid out again, "
                        "compression errors reset", self._step + 1, sum(self._trainable_at_build),
                        len(self._trainable_at_build))

    def _adopt(self, bucket: Bucket, index: int, newcomers: list[int]) -> None:
        """Parameter ``index`` of ``bucket`` joins the buckets without state (it did not require
        gradients before; so did ``newcomers``): its state is zeros, and its scalars that every
        parameter shares with the step (``STATE.shared_scalars``) take those of a parameter that had
        state."""
        others = [i for i in range(len(bucket.params)) if i not in newcomers]
        for name in self.STATE.shared_scalars:
            if others:
                bucket.scalars[name][index] = bucket.scalars[name][others[0]]
