"""Run examples/elastic_train.py with SIGKILLs injected, for tests/test_crash_restarts.py.

``ONEBIT_CRASH=<point>:<rank>:<step>,...``: a list of crashes, one per incarnation of the job under
``torchrun --max-restarts``: each incarnation arms the first crash not yet done (a marker file
``<out>/crashed-<k>`` says it was), so a restart that fails for another reason does not skip one.
Points:

* ``train``: rank dies right after optimizer step ``step`` (between saves);
* ``part``: rank dies half-way through writing its part of the save at ``step`` (rank 0: its
  state part; another rank: its error part), before the rename;
* ``exchange``: rank dies after writing its part, before the ranks exchange digests;
* ``commit``: rank 0 dies half-way through writing the manifest (the commit);
* ``committed``: rank 0 dies right after the commit, before removing the previous state part.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
from pathlib import Path

import onebit
import onebit.checkpoint as checkpoint
from onebit.engine import OnebitOptimizer

faulthandler.dump_traceback_later(120, exit=True)  # a hung incarnation fails, torchrun restarts it
OUT = Path(sys.argv[sys.argv.index("--out") + 1])
CRASHES = [entry.split(":") for entry in os.environ["ONEBIT_CRASH"].split(",")]
pending = [k for k in range(len(CRASHES)) if not (OUT / f"crashed-{k}").exists()]
current = pending[0] if pending else None
point, crash_rank, crash_step = CRASHES[current] if current is not None else ("none", "-1", "-1")
crash_rank, crash_step = int(crash_rank), int(crash_step)
rank = int(os.environ.get("RANK", "0"))
saving = {"step": None}


def die(out: Path) -> None:
    (out / f"crashed-{current}").write_text(f"{point} on rank {rank}")
    os.kill(os.getpid(), signal.SIGKILL)


def armed(step: int | None) -> bool:
    return rank == crash_rank and step == crash_step


original_step = OnebitOptimizer.step
original_save = onebit.save_checkpoint
original_write = checkpoint._atomic_write
original_exchange = checkpoint._exchange
original_clean = checkpoint._clean


def step(self, closure=None):
    loss = original_step(self, closure)
    if point == "train" and armed(self.step_count):
        die(OUT)
    return loss


def save(path, optimizer, **kwargs):
    saving["step"] = optimizer.step_count
    try:
        original_save(path, optimizer, **kwargs)
    finally:
        saving["step"] = None


def write(data, path):
    is_manifest = path.name == "checkpoint.pt"
    if armed(saving["step"]) and ((point == "part" and not is_manifest) or (point == "commit" and is_manifest)):
        path.with_name(f".{path.name}.tmp-{os.getpid()}").write_bytes(data[: len(data) // 2])
        die(OUT)
    original_write(data, path)


def exchange(*args):
    if point == "exchange" and armed(saving["step"]):
        die(OUT)
    return original_exchange(*args)


def clean(path, kind, keep):
    if point == "committed" and kind == "state" and armed(saving["step"]):
        die(OUT)
    original_clean(path, kind, keep)


OnebitOptimizer.step = step
onebit.save_checkpoint = save
checkpoint._atomic_write = write
checkpoint._exchange = exchange
checkpoint._clean = clean
example = Path(__file__).resolve().parent.parent / "examples" / "elastic_train.py"
sys.argv = [str(example), *sys.argv[1:]]
runpy.run_path(str(example), run_name="__main__")
