"""The Python steps of ``scripts/gpu_check.sh`` that are not tests: detect, describe, preflight.

    python scripts/gpu_env.py detect      # exit 0: a usable GPU and every package; 3: no GPU; 4: a package missing
    python scripts/gpu_env.py env         # versions, the device, where onebit is imported from
    python scripts/gpu_env.py preflight   # CuPy runs on the device and compiles onebit's CUDA kernels

Imports only the standard library before it has checked that torch is there. With
``GPU_CHECK_DRY_RUN=1`` (the check's own test, without a GPU) it asks for no GPU and no CuPy.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
import time

NO_GPU, MISSING = 3, 4
DRY_RUN = os.environ.get("GPU_CHECK_DRY_RUN") == "1"
PACKAGES = ("numpy", "pytest") + (() if DRY_RUN else ("cupy",))  # torch is checked first, on its own


def detect() -> int:
    try:
        import torch
    except ImportError as exc:
        print(f"gpu_check: torch is not importable ({exc}); this check installs nothing: use a Python that has "
              "torch (a CUDA build), CuPy, numpy and pytest", file=sys.stderr)
        return MISSING
    if not torch.cuda.is_available() and not DRY_RUN:
        smi = "nvidia-smi found" if shutil.which("nvidia-smi") else "no nvidia-smi on the PATH"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        print(f"gpu_check: no usable CUDA device here (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}; {smi}; CUDA_VISIBLE_DEVICES={visible!r}): nothing ran. "
              "Run scripts/gpu_check.sh on a machine with an NVIDIA GPU.", file=sys.stderr)
        return NO_GPU
    missing = []
    for name in PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # CuPy without its CUDA libraries fails here too
            missing.append(f"{name} ({exc})")
    if missing:
        print(f"gpu_check: a GPU is here but these packages are not importable: {'; '.join(missing)}. "
              "This check installs nothing: pip install numpy pytest cupy-cuda13x (or cupy-cuda12x, to match "
              f"torch's CUDA {torch.version.cuda}) first.", file=sys.stderr)
        return MISSING
    return 0


def _version(name: str) -> str:
    try:
        return getattr(importlib.import_module(name), "__version__", "?")
    except Exception as exc:  # noqa: BLE001 (mpi4py without an MPI library raises at import)
        return f"not importable ({type(exc).__name__}: {exc})"


def env() -> int:
    import torch

    import onebit

    if DRY_RUN and not torch.cuda.is_available():
        print(f"python {platform.python_version()}, torch {torch.__version__}, onebit {onebit.__version__} from "
              f"{os.path.dirname(onebit.__file__)}; dry run: no device")
        return 0
    props = torch.cuda.get_device_properties(0)
    try:
        import torch.cuda.nccl as nccl_module

        nccl = ".".join(map(str, nccl_module.version()))
    except Exception as exc:  # noqa: BLE001 (a build without NCCL)
        nccl = f"unavailable ({type(exc).__name__})"
    lines = [
        f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, cuDNN {torch.backends.cudnn.version()}",
        f"device 0 of {torch.cuda.device_count()}: {props.name}, compute capability {props.major}.{props.minor}, "
        f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs",
        ", ".join(f"{name} {_version(name)}" for name in ("cupy", "numpy", "pytest", "mpi4py")),
        f"onebit {onebit.__version__} from {os.path.dirname(onebit.__file__)}",
    ]
    print("\n".join(lines))
    return 0


def preflight() -> int:
    if DRY_RUN:
        print("dry run: no CuPy, no device, nothing compiled")
        return 0
    import cupy
    import torch

    from onebit.kernels import get_kernels

    start = time.perf_counter()
    total = int(cupy.arange(10).sum())  # the first CuPy kernel: driver and runtime agree
    if total != 45:
        print(f"gpu_check: CuPy computed sum(0..9) = {total} on the device", file=sys.stderr)
        return 1
    kernels = get_kernels("cuda", "cuda")  # compiles kernels/onebit_kernels.cu with NVRTC (cached on disk)
    print(f"CuPy {cupy.__version__} runs on {torch.cuda.get_device_name(0)}; onebit's {kernels.name} kernels "
          f"compiled and loaded in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str]) -> int:
    commands = {"detect": detect, "env": env, "preflight": preflight}
    if len(argv) != 2 or argv[1] not in commands:
        print(f"usage: python scripts/gpu_env.py {{{'|'.join(commands)}}}", file=sys.stderr)
        return 2
    return commands[argv[1]]()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
