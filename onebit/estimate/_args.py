"""Argument checks shared by the estimate's modules: each raises a ``ValueError`` naming the
argument, the value received and what is expected."""

from __future__ import annotations

import math

#: Devices the estimate knows: where the training job's tensors live (and where its local costs are
#: measured).
DEVICES = ("cpu", "cuda")


def int_at_least(name: str, value, minimum: int) -> int:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value != int(value) or int(value) < minimum:
        raise ValueError(f"invalid {name}: {value!r}; expected an integer >= {minimum}")
    return int(value)


def real(name: str, value, *, positive: bool, upper: float | None = None, allow_inf: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)
    ok = ok and (allow_inf or math.isfinite(value))
    if not ok or (value <= 0 if positive else value < 0) or (upper is not None and value > upper):
        bound = ("> 0" if positive else ">= 0") + (f" and <= {upper}" if upper is not None else "")
        raise ValueError(f"invalid {name}: {value!r}; expected a finite number {bound}")
    return float(value)


def device_type(device) -> str:
    """``'cpu'`` or ``'cuda'`` from a name or a ``torch.device`` (``'cuda:1'`` is ``'cuda'``)."""
    name = getattr(device, "type", device)
    if isinstance(name, str) and name.split(":")[0] in DEVICES:
        return name.split(":")[0]
    raise ValueError(f"invalid device: {device!r}; expected one of {', '.join(map(repr, DEVICES))} "
                     "(where the training job's tensors live)")
