"""Exit a finished distributed run without the interpreter's teardown (shared by the examples).

After a run has written everything and destroyed its process group, the interpreter's own
teardown can still abort a finished rank ("terminate called without an active exception",
SIGABRT, with no Python frame left): a C++ thread, gloo's, that something kept alive runs into
finalization. onebit keeps nothing alive past ``destroy_process_group()`` (``tests/test_teardown.py``
checks it), but frameworks can: FSDP2 keeps its device mesh, and the mesh's gloo threads, alive
(torch 2.13). Seen about 1 run in 20 of ``bert/pretrain.py`` (before and after onebit's own fix),
now and then with ``fsdp/train_hsdp.py``, and once each in CI with ``hf_trainer/train.py`` and
``accelerate/train.py`` (2026-11-26). A finished rank exits at once instead.

The examples run as scripts from their own folders, so each imports this module at its end::

    if __name__ == "__main__":
        main()
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: teardown.py
        from teardown import exit_skipping_teardown

        exit_skipping_teardown()
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_skipping_teardown(code: int = 0) -> NoReturn:
    """Finalize MPI if this process initialized it (under ``mpiexec``, as mpi4py's exit handler
    would), flush the logs and the standard streams, then ``os._exit(code)``: no atexit handlers,
    no module finalization, no C++ destructors. Call it only when the run has finished."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
