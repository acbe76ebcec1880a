"""What an algorithm keeps and saves, declared once per optimizer class: its per-parameter state
(:class:`StateSpec`, the class attribute ``STATE``) and the settings of its schedule (a :class:`Schedule`
of :class:`Setting` values). :mod:`onebit.state` builds, validates and applies state dicts from them.

For example, 0/1 Adam's::

    STATE = StateSpec(
        buffers=("exp_avg", "exp_avg_sq", "momentum_accumulator", "sync_point"), nonnegative=("exp_avg_sq",),
        lazy=("momentum_accumulator", "sync_point"), scalars={"lr_sum": 0.0}, shared_scalars=("lr_sum",),
        masked="exp_avg", group_keys=("lr", "betas", "eps", "weight_decay", "bias_correction"), schedule=SCHEDULE)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

logger = logging.getLogger("onebit.engine")

__all__ = ["StateSpec", "Schedule", "Setting"]

_REQUIRED = object()  # a setting a checkpoint must hold
_NEVER = object()  # a setting saved whatever its value


@dataclass(frozen=True)
class Setting:
    """One setting of an algorithm's schedule, saved in every state dict's ``"onebit"`` entry under
    ``name`` and kept in the optimizer's attribute ``attribute`` (default: ``name``).

    ``check``: a saved value -> the value to adopt (raises TypeError/ValueError, whose message the
    load reports); ``absent``: what a checkpoint without it means (older formats; default: it must
    be there); ``omit``: an attribute value that is not saved (so that state dicts of a default
    stay as they were); ``save``: the attribute's value -> what is saved (default: as it is);
    ``logged``: a load that changes it says so (once, on rank 0)."""

    name: str
    check: Callable[[Any], Any]
    attribute: str = ""
    absent: Any = _REQUIRED
    omit: Any = _NEVER
    save: Callable[[Any], Any] | None = None
    logged: bool = True

    def __post_init__(self) -> None:
        if not self.attribute:
            object.__setattr__(self, "attribute", self.name)


@dataclass(frozen=True)
class Schedule:
    """An algorithm's schedule settings as one value: what a state dict saves of them
    (:meth:`save`), validates (:meth:`check`) and adopts (:meth:`apply`). ``check_all``: a check
    across settings (of the values :meth:`check` gives); ``after_load``: called with the optimizer
    once a load adopted them."""

    settings: tuple[Setting, ...] = ()
    check_all: Callable[[dict[str, Any]], None] | None = None
    after_load: Callable[[Any], None] | None = None

    def extend(self, *settings: Setting) -> Schedule:
        """This schedule with ``settings`` added (a subclass's)."""
        return dataclasses.replace(self, settings=(*self.settings, *settings))

    def save(self, opt: Any) -> dict[str, Any]:
        saved = {}
        for s in self.settings:
            value = getattr(opt, s.attribute)
            if s.omit is _NEVER or value != s.omit:
                saved[s.name] = value if s.save is None else s.save(value)
        return saved

    def check(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """The values to adopt, by attribute; raises TypeError/ValueError."""
        values = {}
        for s in self.settings:
            if s.name in meta or s.absent is _REQUIRED:
                values[s.attribute] = s.check(meta.get(s.name))
            else:
                values[s.attribute] = s.absent
        if self.check_all is not None:
            self.check_all(values)
        return values

    def apply(self, opt: Any, values: Mapping[str, Any], loaded: bool = True) -> None:
        """Adopt checked ``values``; after a load (``loaded``) a changed setting is logged."""
        for s in self.settings:
            value = values[s.attribute]
            if loaded and s.logged and value != getattr(opt, s.attribute) and opt._speaks:
                logger.info("onebit: %s %r restored from the checkpoint (was %r)", s.name, value,
                            getattr(opt, s.attribute))
            setattr(opt, s.attribute, value)
        if loaded and self.after_load is not None:
            self.after_load(opt)


@dataclass(frozen=True)
class StateSpec:
    """What an algorithm keeps and saves, declared once per class (``STATE``).

    ``buffers``: per-element state (flat buffers in the buckets, param-shaped in the state dict);
    ``lazy``: those of them that exist only in the phases that need them (see :func:`allocate_lazy`;
    the state dict holds them while they exist); ``nonnegative``: those a load refuses negative
    entries in; ``scalars``: per-parameter scalars and their initial values; ``shared_scalars``:
    those that advance with the step on every rank, gradient or not (a parameter left alone for
    want of a gradient keeps its other state as it was); ``masked``: the buffer the momentum masks
    apply to (None: none); ``group_keys``: the group hyperparameters a checkpoint must hold;
    ``schedule``: the schedule settings saved beside the step."""

    buffers: tuple[str, ...] = ()
    lazy: tuple[str, ...] = ()
    nonnegative: tuple[str, ...] = ()
    scalars: Mapping[str, float] = field(default_factory=dict)
    shared_scalars: tuple[str, ...] = ()
    masked: str | None = None
    group_keys: tuple[str, ...] = ("lr", "betas", "eps", "weight_decay")
    schedule: Schedule = Schedule()

    def __post_init__(self) -> None:
        for name in ("buffers", "lazy", "nonnegative", "shared_scalars", "group_keys"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "scalars", MappingProxyType(dict(self.scalars)))
        for what, names, among in (("lazy", self.lazy, self.buffers), ("nonnegative", self.nonnegative, self.buffers),
                                   ("shared_scalars", self.shared_scalars, tuple(self.scalars))):
            if not set(names) <= set(among):
                raise ValueError(f"StateSpec: {what} {names} must be among {among}")
        if self.masked is not None and self.masked not in self.eager:
            raise ValueError(f"StateSpec: masked={self.masked!r} must be one of the buffers that always exist, "
                             f"{self.eager}")

    @property
    def eager(self) -> tuple[str, ...]:
        """The buffers that always exist."""
        return tuple(name for name in self.buffers if name not in self.lazy)

    @property
    def owned(self) -> frozenset[str]:
        """Every per-parameter name the spec declares (other entries of the state are kept as they are)."""
        return frozenset(self.buffers) | frozenset(self.scalars)
