"""Run a benchmark's rank function on local gloo ranks and read rank 0's result (the helper of
``step_time.py``, ``profile_step.py`` and ``space_cost.py``; not meant to be run by hand)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


def run_local_ranks(rank_fn: Callable[..., None], world_size: int, args: Any) -> dict:
    """Spawn ``world_size`` processes running ``rank_fn(rank, world_size, args, store, out)``
    (``store``: a FileStore path for ``init_process_group``; ``out``: where rank 0 writes its JSON
    result) and return that result."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "result.json")
        mp.start_processes(rank_fn, args=(world_size, args, os.path.join(tmp, "store"), raw),
                           nprocs=world_size, start_method="spawn")
        return json.loads(Path(raw).read_text())
