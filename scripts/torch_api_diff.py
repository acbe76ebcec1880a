"""List the torch names that the installed torch has and an older release lacks (one-time, by hand).

    python scripts/torch_api_diff.py OLD_TORCH_TREE > tests/data/torch_newer_than_2_11.txt

``OLD_TORCH_TREE`` is the ``torch/`` folder of an older release, unpacked from any of its wheels
(its ``.py``/``.pyi`` files are read, and its shared libraries for their strings, so a wheel for
another platform will do; the list in ``tests/data`` came from
``torch-2.11.0-cp312-cp312-macosx_11_0_arm64.whl``, 81 MB, unpacked with
``unzip WHEEL 'torch/*.py' 'torch/*.pyi' 'torch/lib/*.dylib'``, against torch 2.13.0 installed here).

For every object in :data:`OBJECTS` it lists each name of ``dir(obj)`` in the installed torch
(dunders left out) that appears nowhere, as a word, in the older release's sources of that object:
the module's own files (a package's top-level files, not its subpackages; for a class, the files of
the modules of its bases too), the binding stubs ``torch/_C/**/*.pyi`` and the strings of the
compiled libraries ``torch/lib/*`` (which name what the compiled part provides, ``torch.uint3`` and
``Tensor.const_data_ptr`` among them, where the stubs do not). A name the older release merely
mentions (in a comment, another function's body, any string of its libraries) counts as present,
so the list may miss a new name but rarely lists an old one. Names re-exported from outside torch
(the standard library's ``multiprocessing``, ``typing``) are left out. ``tests/test_gpu_check.py``
scans the files ``scripts/gpu_check.sh`` runs for uses of the listed names.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
import warnings
from pathlib import Path

import torch

# Modules (and classes, whose attributes are used through instances) that onebit, its tests and
# benchmarks reach into; a class is given as "module:Class".
OBJECTS = (
    "torch", "torch:Tensor", "torch.nn", "torch.nn:Module", "torch.nn:Parameter", "torch.nn.functional",
    "torch.nn.parallel", "torch.nn.utils", "torch.optim", "torch.optim:Optimizer", "torch.optim.lr_scheduler",
    "torch.cuda", "torch.cuda:Stream", "torch.cuda:Event", "torch.cuda.amp", "torch.amp", "torch.autograd",
    "torch.distributed", "torch.distributed:ProcessGroup", "torch.distributed:Work", "torch.distributed.tensor",
    "torch.distributed.device_mesh", "torch.distributed.fsdp", "torch.distributed.algorithms",
    "torch.multiprocessing", "torch.utils", "torch.utils.data", "torch.utils.hooks", "torch.utils.checkpoint",
    "torch.testing", "torch.backends", "torch.backends.cuda", "torch.backends.cudnn", "torch.library",
    "torch.compiler", "torch.profiler", "torch.serialization", "torch.random",
)

WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BINARY_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]{2,}")


def _words(paths) -> set[str]:
    words: set[str] = set()
    for path in paths:
        words.update(WORD.findall(path.read_text(encoding="utf-8", errors="replace")))
    return words


def _module_files(old: Path, module: str | None) -> list[Path]:
    """The files of ``module`` in the old tree: a package's top-level files, or the module's file."""
    if not module or not module.startswith("torch"):
        return []
    parts = module.split(".")[1:]
    folder = old.joinpath(*parts)
    if folder.is_dir():
        return sorted(p for p in folder.iterdir() if p.suffix in (".py", ".pyi"))
    files = [folder.with_suffix(suffix) for suffix in (".py", ".pyi")]
    return [f for f in files if f.is_file()]


def _defining_module(obj: object, name: str) -> str | None:
    """Where the installed torch defines ``obj.name``: the owner class's module for an attribute
    of a class, the value's own module (or the module itself) for a name in a module."""
    if isinstance(obj, type):
        owner = next((c for c in obj.__mro__ if name in vars(c)), None)
        return getattr(owner, "__module__", None)
    value = getattr(obj, name, None)
    if isinstance(value, types.ModuleType):
        return value.__name__
    module = getattr(value, "__module__", None)
    return module if isinstance(module, str) else None


def _binary_words(old: Path) -> set[str]:
    """The identifier-like strings of the old release's compiled libraries."""
    words: set[bytes] = set()
    for path in sorted((old / "lib").glob("*")) + sorted(old.glob("_C*.so")):
        if path.suffix in (".so", ".dylib", ".dll") or ".so." in path.name:
            words.update(BINARY_WORD.findall(path.read_bytes()))
    return {w.decode("ascii") for w in words}


def newer_names(old: Path) -> list[str]:
    """``module.name`` (or ``module.Class.name``) for each name that only the installed torch has."""
    stubs = _words(sorted((old / "_C").rglob("*.pyi")) + list(old.glob("_VF.py*"))) | _binary_words(old)
    cache: dict[str | None, set[str]] = {}

    def words_of(module: str | None) -> set[str]:
        if module not in cache:
            cache[module] = _words(_module_files(old, module))
        return cache[module]

    lines = []
    for spec in OBJECTS:
        module, _, cls = spec.partition(":")
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        if cls:
            obj = getattr(obj, cls, None)
            if obj is None:
                continue
        home = words_of(module) | stubs
        if cls:  # the class's own module and its bases' (Parameter's methods are Tensor's)
            for base in obj.__mro__:
                home |= words_of(base.__module__)
            if issubclass(obj, torch.Tensor):
                home |= words_of("torch")
        prefix = module + ("." + cls if cls else "")
        for name in sorted(dir(obj)):
            defined_in = _defining_module(obj, name)
            if defined_in is not None and not defined_in.startswith("torch"):
                continue  # a re-export of the standard library's (torch.multiprocessing's `import *`)
            if name.startswith("__") or name in home or name in words_of(defined_in):
                continue
            lines.append(f"{prefix}.{name}")
    return lines


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")  # deprecated aliases warn when dir() walks them
    if len(argv) != 2 or not (Path(argv[1]) / "version.py").is_file():
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    old = Path(argv[1])
    version = re.search(r"__version__ = '([^']+)'", (old / "version.py").read_text()).group(1)
    print(f"# Names that torch {torch.__version__} has and torch {version} lacks (its sources never mention them).")
    print("# Generated by scripts/torch_api_diff.py; read by tests/test_gpu_check.py.")
    for line in newer_names(old):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
