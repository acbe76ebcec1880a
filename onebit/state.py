"""The ``state_dict`` contract of every onebit optimizer (used by :class:`onebit.engine.OnebitOptimizer`).

Format (version 3)::

    {
      "state": {index: {name: Tensor, ..., scalar: float, ...}, ...},  # tensors shaped like each param
      "param_groups": [{<the algorithm's group hyperparameters>, "compress", "params": [index, ...],
                        "onebit": {"format_version": 3, "algorithm": "OnebitAdam", "step": int, <its schedule>}},
                       ...],
    }

The ``"onebit"`` entry is the same in every group: groups and per-parameter state are all that
``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` keeps (version 2 had it at the top
level, and still loads). For DTensor parameters (FSDP2, tensor parallel) each per-element tensor
is a DTensor laid out like its parameter, over this rank's shard, so that DCP saves every shard
once and reshards on load; a full tensor (from an unsharded run) loads into a sharded optimizer too.

The per-parameter names are the algorithm's (``OnebitAdam``: ``exp_avg``, ``exp_avg_sq``), and so
is the schedule (``freeze_step`` for 1-bit Adam and 1-bit LAMB). Parameters are numbered in
param-group order, as ``torch.optim`` does. Nothing depends on the world size: compression errors
are rank-local and are reset on load (``onebit.save_checkpoint(..., exact_resume=True)`` keeps
them per rank); masks belong to the model code and are given to the constructor. Version 1 (onebit
0.1's ``OnebitAdam``, without ``algorithm``) still loads into ``OnebitAdam``. Loading never
communicates for tensors laid out like their parameters, full or sharded.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .layout import layout_digest
from .shards import is_dtensor, like_param, local, local_value
from .spec import StateSpec
from .validation import TORCH_FLAGS, TORCH_NEUTRAL, is_int, torch_flag_problem, with_tuple_betas

if TYPE_CHECKING:
    from .buckets import Bucket

FORMAT_VERSION = 3

logger = logging.getLogger("onebit.engine")

__all__ = ["FORMAT_VERSION", "StateDictContract", "build_state_dict", "validate_state_dict", "check_compression_errors",
           "apply_state", "LoadedState", "saved_step", "allocate_lazy", "release_lazy", "is_torch_adam_state_dict",
           "torch_adam_step", "from_torch_adam", "to_torch_adam"]


@dataclass
class LoadedState:
    """A validated state dict, ready to apply."""
    step: int
    schedule: dict[str, Any]
    hyperparameters: list[dict[str, Any]]  # every key of each saved group but "params"
    entries: dict[int, dict[str, Any]]  # parameter index -> {name: tensor or float, and other entries as saved}
    others: dict[Any, Any]  # state entries under keys that are not parameter indices


def allocate_lazy(state: dict[Any, Any], bucket: Bucket, name: str) -> None:
    """Allocate the lazy buffer ``name`` of ``bucket`` (zeros) and enter it in the state."""
    if name not in bucket.buffers:
        bucket.add_buffer(name)
        for p, view in zip(bucket.owners, bucket.views[name]):
            state[p][name] = view


def release_lazy(state: dict[Any, Any], bucket: Bucket, name: str) -> None:
    """Free the lazy buffer ``name`` of ``bucket``."""
    if name in bucket.buffers:
        bucket.drop_buffer(name)
        for p in bucket.owners:
            state[p].pop(name, None)


def _own_entry(spec: StateSpec, p: torch.Tensor, entry: Mapping[str, Any]) -> dict[str, Any]:
    """A frozen parameter's loaded state, in tensors of its own: buffers as float32 tensors of the
    parameter's (local) shape and device, scalars as 0-d float64 tensors, other entries copied."""
    device = local(p).device
    own: dict[str, Any] = {}
    for name, value in entry.items():
        if name in spec.buffers:
            own[name] = value.detach().to(device=device, dtype=torch.float32, copy=True)
        elif name in spec.owned:
            own[name] = torch.tensor(float(value), dtype=torch.float64, device=device)
        else:
            own[name] = copy.deepcopy(value)
    return own


def build_state_dict(spec: StateSpec, meta: Mapping[str, Any], groups: list[dict[str, Any]],
                     state: Mapping[Any, Any], released: Mapping[Any, Mapping[str, torch.Tensor]] | None = None
                     ) -> dict[str, Any]:
    """The state dict of ``groups`` and ``state``; ``meta``: the algorithm, step and schedule;
    ``released``: buffers the algorithm holds in another form, as saved (fresh tensors)."""
    meta = {"format_version": FORMAT_VERSION, **meta}
    index_of: dict[int, int] = {}
    saved_groups = []
    for group in groups:
        ids = []
        for p in group["params"]:
            index_of[id(p)] = len(index_of)
            ids.append(index_of[id(p)])
        saved = with_tuple_betas({k: v for k, v in group.items() if k != "params"})
        saved["params"] = ids
        saved["onebit"] = dict(meta)
        saved_groups.append(saved)
    saved_state: dict[Any, Any] = {}
    for key, entry in state.items():
        if not isinstance(key, torch.Tensor) or id(key) not in index_of:
            saved_state[key] = entry  # an entry a tool keeps under a key of its own: as torch does, kept as it is
            continue
        saved_state[index_of[id(key)]] = {
            name: (like_param(value.clone(), key) if name in spec.buffers else float(value)) if name in spec.owned
            else value for name, value in entry.items()
        }
        if released and key in released:
            saved_state[index_of[id(key)]].update({name: like_param(value, key) for name, value in released[key].items()})
    return {"state": saved_state, "param_groups": saved_groups}


def _fail(message: str) -> None:
    raise ValueError(f"cannot load optimizer state: {message}")


def _check_int(name: str, value: Any, low: int) -> int:
    if not is_int(value, low):
        _fail(f"{name} must be an int >= {low}, got {value!r}")
    return value


def validate_state_dict(spec: StateSpec, owner: str, sd: Any, groups: list[dict[str, Any]], state: Mapping[Any, Any],
                        buckets: list[Bucket], check_group: Callable[[Mapping[str, Any]], None]) -> LoadedState:
    """Check everything ``sd`` holds against the optimizer ``owner`` (class name) of ``groups``,
    ``state`` and ``buckets`` (``check_group``: its check of a param group); change nothing."""
    if not isinstance(sd, Mapping):
        _fail(f"expected a dict from {owner}.state_dict(), got {type(sd).__name__}")
    missing = [k for k in ("state", "param_groups") if k not in sd]
    if missing:
        _fail(f"missing keys {missing}")
    meta = _meta(sd, owner)
    version = _check_int("format_version", meta.get("format_version"), 1)
    if version > FORMAT_VERSION:
        _fail(f"format_version {version} is newer than this onebit supports ({FORMAT_VERSION}); upgrade onebit")
    algorithm = meta.get("algorithm", "OnebitAdam")  # version 1 had only OnebitAdam
    if algorithm != owner:
        _fail(f"it was saved by {algorithm!r}, this optimizer is {owner!r}; load it into a {algorithm}")
    step = _check_int("step", meta.get("step"), 0)
    try:
        schedule = spec.schedule.check(meta)
    except (TypeError, ValueError) as exc:
        _fail(str(exc))
    hypers, params_by_key = _validate_groups(spec, sd["param_groups"], groups, check_group)
    saved_state = sd["state"]
    if not isinstance(saved_state, Mapping):
        _fail(f"'state' must be a dict, got {type(saved_state).__name__}")
    entries: dict[int, dict[str, Any]] = {}
    for key, (index, p) in params_by_key.items():
        if p not in state and saved_state.get(key) is None:
            continue  # not trainable here (requires_grad=False) and nothing saved for it
        # (a parameter frozen here keeps what was saved for it until it trains again, as in the run that saved it)
        entries[index] = _validate_entry(spec, index, p, saved_state.get(key))
    others = {key: value for key, value in saved_state.items() if key not in params_by_key}
    index_of = {id(p): index for index, p in params_by_key.values()}
    for bucket in buckets:  # a bucket's lazy buffers exist for all its parameters or none
        present = {frozenset(n for n in spec.lazy if n in entries.get(index_of[id(p)], {})) for p in bucket.owners}
        if len(present) > 1:
            _fail(f"some parameters of one bucket have {'/'.join(spec.lazy)} and others do not; the checkpoint "
                  "is corrupt")
    return LoadedState(step, schedule, hypers, entries, others)


def _validate_groups(spec: StateSpec, groups: Any, live_groups: list[dict[str, Any]],
                     check_group: Callable[[Mapping[str, Any]], None]
                     ) -> tuple[list[dict[str, Any]], dict[Any, tuple[int, torch.Tensor]]]:
    """The saved groups' hyperparameters, and their parameters by saved key (an index; a name where
    torch.distributed.checkpoint saved it) -> (position, live parameter); as in torch.optim, saved
    and live parameters pair up by their order in the groups."""
    if not isinstance(groups, (list, tuple)) or len(groups) != len(live_groups):
        count = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
        _fail(f"the checkpoint has {count} param groups, this optimizer has {len(live_groups)}")
    hypers = []
    params_by_key: dict[Any, tuple[int, torch.Tensor]] = {}
    for g, (saved, live) in enumerate(zip(groups, live_groups)):
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
            _fail(f"param group {g} is not a dict with a 'params' list")
        if len(saved["params"]) != len(live["params"]):
            _fail(f"param group {g} has {len(saved['params'])} parameters in the checkpoint, "
                  f"{len(live['params'])} here; was it saved from a different model?")
        absent = [k for k in spec.group_keys if k not in saved]
        if absent:
            _fail(f"param group {g} lacks hyperparameters {absent}")
        if saved.get("compress", True) != live["compress"]:
            _fail(f"param group {g} has compress={saved.get('compress')!r} in the checkpoint and "
                  f"compress={live['compress']!r} here; build the optimizer with the same groups")
        # every saved key but the parameters and onebit's entry (a scheduler's initial_lr too, as torch keeps it)
        hyper = with_tuple_betas({k: v for k, v in saved.items() if k not in ("params", "onebit")})
        try:
            check_group({**hyper, "compress": live["compress"]})
        except (TypeError, ValueError) as exc:
            _fail(f"param group {g}: {exc}")
        hypers.append(hyper)
        for index, p in zip(saved["params"], live["params"]):
            if isinstance(index, bool) or not isinstance(index, (int, str)) or isinstance(index, int) and index < 0:
                _fail(f"param keys in group {g} must be ints >= 0 (or parameter names), got {index!r}")
            if index in params_by_key:
                _fail(f"param key {index!r} appears twice in the param groups; the checkpoint is corrupt")
            params_by_key[index] = (len(params_by_key), p)
    return hypers, params_by_key


def _metas(sd: Mapping[str, Any]) -> list[Any]:
    """Where the ``"onebit"`` entry is: ``[it]`` at the top level (versions 1 and 2), else each
    param group's (version 3; None where a group has none); ``[]`` without groups."""
    if "onebit" in sd:
        return [sd["onebit"]]
    groups = sd.get("param_groups")
    return [g.get("onebit") for g in groups if isinstance(g, Mapping)] if isinstance(groups, (list, tuple)) else []


def _meta(sd: Mapping[str, Any], owner: str) -> Mapping[str, Any]:
    """The ``"onebit"`` entry, validated: the same in every param group (version 3)."""
    metas = _metas(sd)
    if not metas or any(m is None for m in metas):
        _fail(f"no 'onebit' entry in its param groups (this looks like a torch.optim state dict, not {owner}'s)")
    if any(m != metas[0] for m in metas[1:]):
        _fail("the param groups disagree on their 'onebit' entry (step, schedule); the checkpoint is corrupt")
    meta = metas[0]
    if not isinstance(meta, Mapping):
        _fail(f"'onebit' must be a dict, got {type(meta).__name__}")
    return meta


def saved_step(sd: Any) -> Any:
    """The step a state dict says it was saved at (either format), or None where it says none."""
    metas = _metas(sd) if isinstance(sd, Mapping) else []
    meta = metas[0] if metas else None
    return meta.get("step") if isinstance(meta, Mapping) else None


def _validate_entry(spec: StateSpec, index: int, p: torch.Tensor, entry: Any) -> dict[str, Any]:
    names = [*spec.eager, *spec.scalars]
    if not isinstance(entry, Mapping) or any(name not in entry for name in names):
        _fail(f"no {'/'.join(names)} for parameter {index} of shape {tuple(p.shape)}; "
              "was it saved from a different model?")
    names += [name for name in spec.lazy if name in entry]
    buffers = {name: _validate_buffer(spec, name, index, p, entry[name]) for name in spec.buffers if name in names}
    for name in spec.scalars:
        value = entry[name]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            _fail(f"{name} of parameter {index} must be a finite number, got {value!r}")
    return {**{name: buffers.get(name, entry[name]) for name in names},
            **{k: v for k, v in entry.items() if k not in spec.owned}}


def _validate_buffer(spec: StateSpec, name: str, index: int, p: torch.Tensor, t: Any) -> torch.Tensor:
    """The saved buffer ``name`` of parameter ``index``, checked; this rank's shard of it for DTensors."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        _fail(f"{name} of parameter {index} must be a float tensor, got {type(t).__name__}")
    if t.shape != p.shape:
        _fail(f"{name} of parameter {index} has shape {tuple(t.shape)}, the parameter has "
              f"{tuple(p.shape)}; was it saved from a different model?")
    if is_dtensor(t) or is_dtensor(p):  # checked and loaded as this rank's shard
        try:
            t = local_value(t, p)
        except ValueError as exc:
            _fail(f"{name} of parameter {index}: {exc}")
        if t.shape != local(p).shape:
            _fail(f"{name} of parameter {index} has a local shard of shape {tuple(t.shape)}, the parameter's is "
                  f"{tuple(local(p).shape)}")
    if not bool(torch.isfinite(t).all()):
        _fail(f"{name} of parameter {index} contains NaN or inf; the checkpoint is corrupt")
    if name in spec.nonnegative and bool((t < 0).any()):
        _fail(f"{name} of parameter {index} has negative entries; the checkpoint is corrupt")
    return t


# ----------------------------------------------------------------------------- torch.optim Adam / AdamW
# A torch.optim.Adam or AdamW state dict: {"state": {key: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups":
# [{"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", ..., "decoupled_weight_decay", "params"}]}.
# Its moments are OnebitAdam's with bias_correction=True (torch's Adam always corrects), its step
# is per parameter (onebit keeps one), its weight decay decoupled where decoupled_weight_decay is True.

TORCH_ADAM = "torch.optim Adam/AdamW"
_TORCH_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_torch_adam_state_dict(sd: Any) -> bool:
    """Whether ``sd`` is a torch.optim.Adam / AdamW state dict (no onebit entry; every param group
    has torch's ``betas`` and ``amsgrad``)."""
    if not isinstance(sd, Mapping) or "onebit" in sd or not isinstance(sd.get("state"), Mapping):
        return False
    groups = sd.get("param_groups")
    return (isinstance(groups, (list, tuple)) and bool(groups)
            and all(isinstance(g, Mapping) and "onebit" not in g and "betas" in g and "amsgrad" in g for g in groups))


def torch_adam_step(sd: Mapping[str, Any], owner: str) -> int:
    """The step a torch.optim Adam/AdamW state dict ``sd`` continues from, the same for every
    parameter with state (0 without state); a ValueError lists everything onebit cannot continue
    (flags whose value changes the maths, an ambiguous weight decay, per-parameter steps)."""
    problems = []
    for g, group in enumerate(sd["param_groups"]):
        decay = group.get("weight_decay", 0.0)
        for key in TORCH_FLAGS:
            why = torch_flag_problem(key, group[key], decay) if key in group else None
            if why is not None:
                problems.append(f"param group {g} has {key}={group[key]!r} ({why})")
        if "decoupled_weight_decay" not in group and decay != 0:
            problems.append(f"param group {g} has weight_decay={decay!r} and does not say whether it is decoupled "
                            "(AdamW's) or an L2 penalty (Adam's; torch before decoupled_weight_decay existed): set "
                            f"param_groups[{g}]['decoupled_weight_decay'] = True in the dict if it came from AdamW")
    steps: dict[float, list[Any]] = {}
    for key, entry in sd["state"].items():
        step = entry.get("step") if isinstance(entry, Mapping) else None
        value = float(step) if isinstance(step, (int, float, torch.Tensor)) and not isinstance(step, bool) else None
        if value is None or not math.isfinite(value) or value < 0 or value != int(value):
            problems.append(f"the state of parameter {key!r} has step {step!r}, not a whole number >= 0")
        else:
            steps.setdefault(value, []).append(key)
    if len(steps) > 1:
        counts = ", ".join(f"{int(v)} for parameters {keys[:4]}{' ...' if len(keys) > 4 else ''}"
                           for v, keys in sorted(steps.items()))
        problems.append(f"its parameters are at different steps ({counts}): onebit keeps one step count for "
                        "every parameter; set every entry's 'step' to one value (the bias correction of the "
                        "others then changes) to continue")
    if problems:
        _fail(f"a {TORCH_ADAM} state dict cannot continue in {owner}: " + "; ".join(problems))
    return int(next(iter(steps))) if steps else 0


def from_torch_adam(sd: Mapping[str, Any], live_groups: list[dict[str, Any]], state: Mapping[Any, Any],
                    meta: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict of this format that holds the torch.optim Adam/AdamW state ``sd`` (checked
    by :func:`torch_adam_step`) for the optimizer of ``live_groups`` and ``state``: its moments,
    its groups with ``bias_correction=True`` and each live group's ``compress``, ``meta`` (step,
    schedule) in every group. A parameter without torch state (it never had a gradient) starts
    from zeros, as in onebit. Shapes and values are checked by :func:`validate_state_dict`."""
    meta = {"format_version": FORMAT_VERSION, **meta}
    groups, entries = [], {}
    for g, saved in enumerate(sd["param_groups"]):
        live = live_groups[g] if g < len(live_groups) else {"compress": True, "params": []}
        groups.append({**saved, "bias_correction": True, "compress": live["compress"], "onebit": dict(meta)})
        for key, p in zip(saved.get("params", []), live["params"]):
            if key not in sd["state"] and p in state:
                entries[key] = {name: torch.zeros_like(p, dtype=torch.float32) for name in _TORCH_MOMENTS}
    for key, entry in sd["state"].items():
        entries[key] = {name: value for name, value in entry.items() if name != "step"}
    return {"state": entries, "param_groups": groups}


def to_torch_adam(sd: Mapping[str, Any]) -> dict[str, Any]:
    """A torch.optim.AdamW state dict (it loads into ``torch.optim.Adam`` too, decoupled weight decay
    included) from OnebitAdam's state dict ``sd`` of this format: each parameter's moments with the
    step, the groups with torch's flags at their defaults (``decoupled_weight_decay=True``) and
    without onebit's keys."""
    meta = _meta(sd, "OnebitAdam")
    step = torch.tensor(float(meta["step"]), dtype=torch.float32)
    neutral = {key: values[0] for key, values in TORCH_NEUTRAL.items()}
    groups = [{**{k: v for k, v in g.items() if k not in ("bias_correction", "compress", "onebit")}, **neutral}
              for g in sd["param_groups"]]
    state = {key: {"step": step.clone(), **{name: entry[name] for name in _TORCH_MOMENTS}}
             for key, entry in sd["state"].items() if isinstance(entry, Mapping) and "exp_avg" in entry}
    return {"state": state, "param_groups": groups}


def _restored(errors: list[tuple[torch.Tensor, torch.Tensor]] | None, dtype: torch.dtype) -> str:
    """What the load's line says of the compression errors."""
    if errors is None:
        return "reset"
    other = {t.dtype for pair in errors for t in pair} - {dtype}
    if other:  # (restore() copies them into this optimizer's type)
        how = "rounded" if dtype == torch.bfloat16 else "widened"
        return f"restored ({how} from {'/'.join(sorted(str(d) for d in other))} to {dtype}: not an exact resume)"
    return "restored (exact resume)"


def check_compression_errors(opt: Any, errors: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    """``errors`` (or None) fit ``opt.compression_errors()``: same count, same shapes."""
    if errors is None:
        return
    live = opt.compression_errors()
    if len(errors) != len(live) or any(w.shape != lw.shape or s.shape != ls.shape
                                       for (w, s), (lw, ls) in zip(errors, live)):
        _fail("the compression errors do not match this optimizer's buckets (saved with another world size "
              "or layout?)")


def apply_state(spec: StateSpec, loaded: LoadedState, groups: list[dict[str, Any]], state: dict[Any, Any],
                buckets: Iterable[Bucket]) -> None:
    """Copy a validated state into ``state`` (the parameters' state) and ``groups`` (lazy buffers
    are allocated or freed to match it)."""
    params = [p for group in groups for p in group["params"]]
    entry_of = {id(p): loaded.entries.get(index, {}) for index, p in enumerate(params)}
    for bucket in buckets:
        present = entry_of[id(bucket.owners[0])]
        for name in spec.lazy:
            (allocate_lazy if name in present else release_lazy)(state, bucket, name)
        for name in spec.eager:  # released by the algorithm (held in another form): the load puts it back
            allocate_lazy(state, bucket, name)
    in_buckets = {id(p) for bucket in buckets for p in bucket.owners}
    index = 0
    for group, hyper in zip(groups, loaded.hyperparameters):
        for p in group["params"]:
            if p in state:  # as torch: the state is what was saved, entries of other tools included
                for name in [name for name in state[p] if name not in spec.owned]:
                    del state[p][name]
            if id(p) not in in_buckets:  # frozen here: its saved state as tensors of its own (see _rebuild_buckets)
                state.pop(p, None)
                if index in loaded.entries:
                    state[p] = _own_entry(spec, p, loaded.entries[index])
                index += 1
                continue
            for name, value in loaded.entries.get(index, {}).items():
                if name in spec.buffers:
                    state[p][name].copy_(value)
                elif name in spec.owned:  # a per-parameter scalar (a float, or a 0-d tensor): float64 state, no rounding
                    state[p][name].fill_(float(value))
                else:
                    state[p][name] = copy.deepcopy(value)
            index += 1
        group.update(hyper)
    for key in [key for key in state if not isinstance(key, torch.Tensor)]:
        del state[key]
    for key, value in loaded.others.items():
        state[key] = copy.deepcopy(value)


class StateDictContract:
    """The ``state_dict`` methods of :class:`onebit.engine.OnebitOptimizer` (which inherits them),
    and what checkpoint files need besides: this rank's compression errors and the layout digest."""

    def compression_errors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The live (worker error, server error) of every compressed bucket, in bucket order; they
        are this rank's own (copy them to keep them)."""
        return [(b.compression.worker_error, b.compression.server_error) for b in self._buckets
                if b.compression is not None]

    def reset_compression_errors(self) -> None:
        """Zero the worker and server errors of every bucket (what ``load_state_dict`` does)."""
        for bucket in self._buckets:
            if bucket.compression is not None:
                bucket.compression.reset_errors_()

    def restore_compression_errors(self, errors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put back this rank's compression errors (as :meth:`compression_errors` gave them, on the
        same world size and layout) after a ``load_state_dict``, for a loader that cannot pass them
        to :meth:`restore` (``torch.distributed.checkpoint``'s ``set_optimizer_state_dict``; see
        :func:`onebit.checkpoint.load_compression_errors`): the run then continues bit for bit."""
        check_compression_errors(self, errors)
        for (worker, server), (w, s) in zip(self.compression_errors(), errors):
            worker.copy_(w)
            server.copy_(s)
        if self._load_note is not None:  # the load's line, said at the next step, says "restored"
            self._load_note = (*self._load_note[:-1], _restored(errors, self.error_dtype))

    def layout_digest(self) -> str:
        """16 hex digits that differ when the parameter layout (groups, shapes, dtypes, buckets,
        segments) does: what must match for compression errors to be exchanged."""
        return layout_digest(self._buckets)

    def _build_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without its hooks."""
        meta = {"algorithm": type(self).__name__, "step": self._step, **self.STATE.schedule.save(self)}
        return build_state_dict(self.STATE, meta, self.param_groups, self.state, self._released_state())

    def state_dict(self) -> dict[str, Any]:
        """World-size independent state (see :mod:`onebit.state`): the step, each parameter's
        state (copies), hyperparameters, the schedule, a format version. Compression errors and
        masks are not saved. Hooks registered with ``register_state_dict_pre_hook`` /
        ``_post_hook`` run as in torch."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._build_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (from any world size). Validates everything before changing
        anything, never modifies ``state_dict``, and resets the compression errors (they are
        rank-local; the paper shows a reset does not hurt)."""
        self.restore(state_dict)

    def _from_torch_adam(self, state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """A torch.optim Adam/AdamW ``state_dict`` in this optimizer's format, and what to call it in
        the load's log line followed by notes on what changed; an algorithm that can continue from
        one overrides it (OnebitAdam)."""
        _fail(f"this is a {TORCH_ADAM} state dict; {type(self).__name__} cannot continue from it. OnebitAdam can "
              "(build OnebitAdam(params, bias_correction=True, ...) and load it there)")

    def restore(self, state_dict: dict[str, Any],
                compression_errors: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """:meth:`load_state_dict`, with this rank's ``compression_errors`` (as
        :meth:`compression_errors` gave them, on the same world size and layout) restored instead
        of reset: the run then continues bit for bit. Hooks registered with
        ``register_load_state_dict_pre_hook`` / ``_post_hook`` run as in torch."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        what = ["optimizer state"]  # (what was loaded, and notes for the load's log line)
        converted = is_torch_adam_state_dict(state_dict)
        if converted:
            state_dict, what = self._from_torch_adam(state_dict)
        loaded = validate_state_dict(self.STATE, type(self).__name__, state_dict, self.param_groups, self.state,
                                     self._buckets, self._check_group)
        check_compression_errors(self, compression_errors)
        self._drain()  # work started during a backward is dropped: it read the old state
        # Everything is checked: from here on nothing can fail half-way on the user's input.
        apply_state(self.STATE, loaded, self.param_groups, self.state, self._buckets)
        self.STATE.schedule.apply(self, loaded.schedule, loaded=not converted)  # (else the notes say)
        self._step = loaded.step
        self._steps_taken = 0
        self._synced_at = None
        self._health.reset()
        for bucket in self._buckets:
            if bucket.mask is not None and self.STATE.masked is not None:
                bucket.buffers[self.STATE.masked].mul_(bucket.mask)
        self._invalidate()
        self.reset_compression_errors()
        for (worker, server), (w, s) in zip(self.compression_errors(), compression_errors or []):
            worker.copy_(w)
            server.copy_(s)
        # Said at the next step, once, for the last load before it: a framework that loads the state
        # (errors reset) and then an exact resume that restores them log one line, "restored".
        self._load_note = None if getattr(self, "_copying", False) else (
            f"onebit: loaded {what[0]} at step %d (next: a %s step{''.join('; ' + n for n in what[1:])}); "
            "compression errors %s",
            self._step, self.phase, _restored(compression_errors, self.error_dtype))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
