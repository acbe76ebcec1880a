"""OnebitDiLoCo's settings: their checks, the defaults that depend on ``sync_every``, and the
schedule a state dict saves (:class:`onebit.spec.Schedule`)."""

from __future__ import annotations

from typing import Any

from .spec import Schedule, Setting
from .validation import check_choice, check_number, is_int

__all__ = ["COMPRESSIONS", "ERROR_FEEDBACK", "OUTER_STATE", "OUTER_BUFFERS", "SCHEDULE", "STREAMING_FROM"]

COMPRESSIONS = ("onebit", "none")
#: where the part of the pseudo-gradient that one bit did not carry waits for the next outer step
ERROR_FEEDBACK = ("buffer", "model")
#: where the global parameters and the outer momentum live
OUTER_STATE = ("device", "host")
OUTER_BUFFERS = ("global_params", "outer_momentum_buffer")


def _check_outer(sync_every: Any, outer_lr: Any, outer_momentum: Any, saved: bool = False) -> None:
    _check_sync_every(sync_every, saved)
    _check_outer_lr(outer_lr, saved)
    _check_outer_momentum(outer_momentum)


def _check_sync_every(value: Any, saved: bool = False) -> int:
    if not is_int(value, 1):
        where = " in the checkpoint" if saved else ""
        raise ValueError(f"sync_every must be an int >= 1 (the steps between outer steps){where}, got {value!r}")
    return value


def _check_outer_lr(value: Any, saved: bool = False) -> float:
    check_number("outer_lr", value, low=0.0)
    if not value > 0:
        raise ValueError(f"outer_lr must be > 0{' in the checkpoint' if saved else ''}, got {value!r}")
    return float(value)


def _check_outer_momentum(value: Any) -> float:
    check_number("outer_momentum", value, low=0.0, high=1.0, high_open=True)
    return float(value)


def _check_outer_bits(value: Any) -> int:
    if not is_int(value, 1) or value > 8:
        raise ValueError(f"outer_bits must be an int from 1 to 8 (1-bit passes over the pseudo-gradient at each outer "
                         f"step), got {value!r}")
    return value


def _check_error_feedback(value: Any) -> str:
    check_choice("error_feedback", value, ERROR_FEEDBACK)
    return value


def _check_fragments(value: Any, saved: bool = False) -> int:
    if not is_int(value, 1):
        where = " in the checkpoint" if saved else ""
        raise ValueError(f"fragments must be an int >= 1 (the parts of the parameters that take their outer steps in "
                         f"turn; 1: all at once){where}, got {value!r}")
    return value


def _check_fragments_fit(fragments: int, sync_every: int, saved: bool = False) -> None:
    if fragments > sync_every:
        where = " in the checkpoint" if saved else ""
        raise ValueError(f"fragments={fragments} > sync_every={sync_every}{where}: each fragment takes its outer step "
                         f"at a step of its own in every round of sync_every steps; pass fragments <= sync_every "
                         f"(or sync_every >= {fragments})")


#: the defaults of ``fragments`` and ``sync_delay`` from ``sync_every`` up (see :func:`_streaming_defaults`)
STREAMING_FROM = 16


def _streaming_defaults(sync_every: int, fragments: int | None, sync_delay: int | None) -> tuple[Any, Any]:
    """``fragments`` and ``sync_delay`` where left out (None): from ``sync_every >= 16`` (the
    default 32), ``min(4, sync_every // 8)`` fragments (fewer when the parameters make fewer
    buckets) and a delay of 2 steps; below, 1 and 0 (the blocking outer step). Chosen on the BERT
    example and a 100 Mbit/s link (``docs/guides/tuning.md``); given values are kept as they are."""
    streams = is_int(sync_every, STREAMING_FROM)
    if fragments is None:
        fragments = max(1, min(4, sync_every // 8)) if streams else 1
    if sync_delay is None:
        sync_delay = 2 if streams and is_int(fragments, 1) and sync_every // fragments > 2 else 0
    return fragments, sync_delay


def _check_sync_delay(value: Any, saved: bool = False) -> int:
    if not is_int(value, 0):
        where = " in the checkpoint" if saved else ""
        raise ValueError(f"sync_delay must be an int >= 0 (the inner steps an outer step's exchange runs beside before "
                         f"it is applied; 0: at once){where}, got {value!r}")
    return value


def _check_delay_fits(delay: int, fragments: int, sync_every: int, saved: bool = False) -> None:
    gap = sync_every // fragments  # (the fewest steps between two fragments' outer steps)
    if delay >= gap:
        fix = ("the checkpoint is not one this version wrote, or was edited" if saved
               else f"pass sync_delay <= {gap - 1}")
        raise ValueError(f"sync_delay={delay} with sync_every={sync_every} and fragments={fragments}"
                         f"{' in the checkpoint' if saved else ''}: an exchange must land before the next outer step "
                         f"starts one ({gap} steps apart at the least); {fix}")


def _check_sync_mix(value: Any, saved: bool = False) -> float:
    check_number("sync_mix" + (" in the checkpoint" if saved else ""), value, low=0.0, high=1.0)
    return float(value)


def _check_pending(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or set(value) != {"step", "params", "absent"} or not is_int(value["step"], 1)
            or any(not isinstance(value[k], list) or not all(is_int(i, 0) for i in value[k]) for k in ("params", "absent"))):
        raise ValueError(f"sync_pending in the checkpoint must be None or {{'step': int >= 1, 'params': [parameter "
                         f"places], 'absent': [parameter places]}} (the exchange in flight), got {value!r}")
    return {"step": value["step"], "params": list(value["params"]), "absent": list(value["absent"])}


def _check_schedule(values: dict[str, Any]) -> None:
    _check_fragments_fit(values["fragments"], values["sync_every"], saved=True)
    _check_delay_fits(values["sync_delay"], values["fragments"], values["sync_every"], saved=True)


#: the schedule saved with the state: the position in the round comes from the step number
SCHEDULE = Schedule((
    Setting("sync_every", lambda value: _check_sync_every(value, saved=True)),
    Setting("outer_lr", lambda value: _check_outer_lr(value, saved=True)),
    Setting("outer_momentum", _check_outer_momentum),
    Setting("error_feedback", lambda value: _check_error_feedback(value), absent="buffer", omit="buffer"),
    Setting("outer_bits", lambda value: _check_outer_bits(value), absent=1, omit=1),
    Setting("fragments", lambda value: _check_fragments(value, saved=True), absent=1, omit=1),
    Setting("sync_delay", lambda value: _check_sync_delay(value, saved=True), absent=0, omit=0),
    Setting("sync_mix", lambda value: _check_sync_mix(value, saved=True), absent=1.0, omit=1.0),
    Setting("sync_pending", _check_pending, attribute="_sync_pending", absent=None, omit=None, logged=False),
), check_all=_check_schedule)
