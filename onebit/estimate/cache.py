"""Measured local costs kept between runs of ``python -m onebit.estimate``, so that two identical
calls give the same estimate.

One JSON file (``$ONEBIT_CACHE_DIR/estimate.json``, else ``$XDG_CACHE_HOME/onebit/estimate.json``,
else ``~/.cache/onebit/estimate.json``) holds one entry per measurement key: the host, the device
and its processor, torch's thread count, the kernels, the world size, the sample size, and the
torch and onebit versions. A measurement is reused only under the same key; a damaged file is
ignored (with a warning) and rewritten.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

from .measure import DEFAULT_REPEATS, DEFAULT_SAMPLE, Measured, checked_device, measure_spread

logger = logging.getLogger(__name__)

ENV_VAR = "ONEBIT_CACHE_DIR"
FILE_NAME = "estimate.json"
_FORMAT = 1


def default_cache_path() -> Path:
    """Where the measurements are kept unless a path is given (see the module docstring)."""
    root = os.environ.get(ENV_VAR)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "onebit")
    return Path(root) / FILE_NAME


def _processor(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measurement_key(device: str, world_size: int, sample: int, kernels: str | None) -> dict:
    """What a measurement depends on; a cached one is reused only under an equal key."""
    from .. import __version__

    return {"host": platform.node(), "device": device, "processor": _processor(device),
            "threads": torch.get_num_threads(), "kernels": kernels or os.environ.get("ONEBIT_KERNELS", "auto"),
            "world_size": world_size, "sample": sample, "torch": torch.__version__, "onebit": __version__}


def _entries(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        logger.warning("onebit.estimate: ignoring the unreadable cache %s (%s); it will be rewritten", path, exc)
        return []
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("entries"), list):
        logger.warning("onebit.estimate: ignoring the cache %s (not format %d); it will be rewritten", path, _FORMAT)
        return []
    return [e for e in data["entries"] if isinstance(e, dict) and "key" in e and "measured" in e]


def load(path: Path, key: dict) -> Measured | None:
    """The measurement cached under ``key`` in ``path``, or None."""
    for entry in _entries(path):
        if entry["key"] == key:
            try:
                return Measured.from_dict(entry["measured"])
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("onebit.estimate: ignoring a damaged entry of the cache %s (%s)", path, exc)
    return None


def store(path: Path, key: dict, measured: Measured) -> None:
    """Keep ``measured`` under ``key`` in ``path`` (replacing an entry with the same key; the file
    is replaced atomically)."""
    entries = [e for e in _entries(path) if e["key"] != key] + [{"key": key, "measured": measured.as_dict()}]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".estimate-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump({"format": _FORMAT, "entries": entries}, out, indent=1)
    os.replace(tmp, path)


def cached_spread(num_params: int, world_size: int, *, path: Path | None, refresh: bool = False,
                  device: str = "cpu", kernels: str | None = None, repeats: int = DEFAULT_REPEATS,
                  sample: int = DEFAULT_SAMPLE) -> tuple[Measured, bool]:
    """``(measurement scaled to num_params, whether it came from the cache)``: the cached one for
    this machine and sample size when ``path`` holds one and ``refresh`` is False, else measured
    now (:func:`onebit.estimate.measure_spread`) and stored in ``path``. ``path`` None: measured
    now, nothing read or written."""
    device = checked_device(device).type
    size = min(num_params, sample)
    key = measurement_key(device, world_size, size, kernels) if path is not None else None
    if path is not None and not refresh:
        hit = load(path, key)
        if hit is not None:
            return hit.scaled(num_params), True
    measured = measure_spread(size, world_size, sample=size, repeats=repeats, kernels=kernels, device=device)
    if path is not None:
        store(path, key, measured)
    return measured.scaled(num_params), False
