"""``scripts/gpu_check.sh`` where there is no GPU: it exits at once with its own code, its steps run
end to end in a dry run, a failed step fails it, and the Python files it runs ask nothing of torch
that torch 2.11 (the GPU machine's) lacks.

The last check is static: ``tests/data/torch_newer_than_2_11.txt`` lists the names that torch
2.13 has and 2.11's sources and libraries never mention (made once by
``scripts/torch_api_diff.py`` from a 2.11 wheel); every ``torch.…`` attribute, ``from torch…
import`` and alias use in those files (and in all of ``onebit/``) is looked up there. It cannot see
a new keyword argument of an old function, nor a name reached through ``getattr`` (the guarded
form, ``getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor``, is the way to
use a newer name).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NEWER = ROOT / "tests" / "data" / "torch_newer_than_2_11.txt"
IMPORT_ROOTS = (ROOT, ROOT / "tests")  # where the check's Python finds modules (PYTHONPATH, pytest's rootdir)
STEPS = ("environment", "preflight", "kernel tests", "CUDA tests", "benchmark")


def _env(**extra: str) -> dict:
    """This environment without a GPU (on any machine) and without the check's own variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_DRY_RUN", "OUT", "PYTHON")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def _run(tmp_path: Path, timeout: float, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env=_env(**extra), capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def test_without_a_gpu_the_check_exits_at_once_with_code_3(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _run(tmp_path, 120, OUT=str(out))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no usable CUDA device here" in proc.stderr and "nothing ran" in proc.stderr
    assert time.monotonic() - start < 60
    assert not out.exists()


def test_without_python_the_check_exits_with_code_4(tmp_path):
    proc = _run(tmp_path, 60, PYTHON=str(tmp_path / "no-python"))
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "no Python 3.10+ to run" in proc.stderr


@pytest.mark.slow
def test_dry_run_runs_every_step_and_writes_the_results(tmp_path):
    out = tmp_path / "out"
    proc = _run(tmp_path, 400, OUT=str(out), GPU_CHECK_DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert summary.rstrip().endswith(f"RESULT: PASS (results in {out})")
    assert "DRY RUN" in summary
    for step in STEPS:
        assert re.search(rf"^{step} +PASS ", summary, re.MULTILINE), f"no PASS row for {step!r}:\n{summary}"
    assert re.search(r"^kernel tests .*passed.*skipped", summary, re.MULTILINE)
    for name in ("env.txt", "kernels.xml", "cuda.xml", "gpu_codec.md", "gpu_codec_summary.txt"):
        assert (out / name).is_file(), name
    results = json.loads((out / "gpu_codec.json").read_text())
    assert {(r["impl"], r["op"]) for r in results["codec"]} >= {
        ("cpu", "worker"), ("cpu", "server"), ("cpu", "decode"), ("reference", "worker"), ("torch", "copy")}
    assert len(results["steps"]) == 7 and not any("error" in r for r in results["steps"])
    assert all(r["median_ms"] > 0 for r in results["codec"] + results["steps"])


@pytest.mark.slow
def test_a_failing_step_fails_the_check_and_the_others_still_run(tmp_path):
    out = tmp_path / "out"
    proc = _run(tmp_path, 400, OUT=str(out), GPU_CHECK_DRY_RUN="1", PYTEST_ADDOPTS="--no-such-option")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^kernel tests +FAIL \(exit 4\)", summary, re.MULTILINE), summary
    assert re.search(r"^benchmark +PASS ", summary, re.MULTILINE), summary
    assert summary.rstrip().endswith(f"RESULT: FAIL (logs in {out})")
    assert "--no-such-option" in proc.stdout  # the failed step's log tail is shown


# ------------------------------------------------------------------------------------------------
# torch 2.11


def _newer_names() -> set[str]:
    lines = NEWER.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def torch_uses(source: str) -> set[str]:
    """Every dotted ``torch.…`` name ``source`` reaches by attribute or import (aliases resolved:
    ``import torch.distributed as dist; dist.x`` is ``torch.distributed.x``), and ``.name`` for
    every other attribute access (a method called on a tensor)."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    uses: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    uses.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                if alias.name != "*":
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    uses.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in aliases:
            uses.add(".".join([aliases[value.id], *reversed(chain)]))
        uses.add("." + node.attr)
    return uses


def newer_uses(source: str, newer: set[str]) -> set[str]:
    """The uses in ``source`` of names in ``newer``: a dotted name, any prefix of one, or a tensor
    method (``torch.Tensor.name``, ``torch.nn.Parameter.name``) called on anything."""
    methods = {"." + n.rsplit(".", 1)[1] for n in newer if n.startswith(("torch.Tensor.", "torch.nn.Parameter."))}
    found = set()
    for use in torch_uses(source):
        if use.startswith("."):
            if use in methods:
                found.add(use)
            continue
        parts = use.split(".")
        found.update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in newer)
    return found


def _module_file(name: str, package: Path | None = None) -> Path | None:
    """The repository file of module ``name`` (absolute, or relative to ``package``), if any."""
    roots = (package,) if package is not None else IMPORT_ROOTS
    for root in roots:
        base = root.joinpath(*name.split(".")) if name else root
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def local_imports(path: Path) -> set[Path]:
    """The repository files that ``path`` imports (absolute and relative imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names, package = [], None
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = path.parent
                for _ in range(node.level - 1):
                    package = package.parent
            module = node.module or ""
            names = [module] + [f"{module}.{alias.name}".lstrip(".") for alias in node.names]
        for name in names:
            hit = _module_file(name, package)
            if hit is not None:
                found.add(hit)
    return found


def files_the_check_runs() -> list[Path]:
    """The Python files ``gpu_check.sh`` names, everything they import from this repository, and
    all of ``onebit/`` (whose submodules load as the code needs them)."""
    named = {ROOT / m for m in re.findall(r"[\w/]+\.py\b", SCRIPT.read_text()) if (ROOT / m).is_file()}
    todo, seen = list(named | set((ROOT / "onebit").rglob("*.py"))), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(local_imports(path) - seen)
    return sorted(seen)


def test_the_check_names_the_files_it_runs():
    files = {p.relative_to(ROOT).as_posix() for p in files_the_check_runs()}
    assert {"scripts/gpu_env.py", "tests/test_kernels.py", "tests/test_cuda.py", "benchmarks/gpu_codec.py",
            "tests/conftest.py", "tests/distributed.py", "onebit/kernels/cuda.py"} <= files


def test_the_files_the_check_runs_use_nothing_newer_than_torch_2_11():
    newer = _newer_names()
    problems = {}
    for path in files_the_check_runs():
        found = newer_uses(path.read_text(), newer)
        if found:
            problems[path.relative_to(ROOT).as_posix()] = sorted(found)
    assert not problems, (
        f"torch 2.11 lacks these names (see {NEWER.relative_to(ROOT)}): {problems}; reach them through "
        "getattr(module, 'name', None) with a fallback, as onebit/backends/torch_dist.py does")


def test_the_list_of_newer_names_holds_a_known_one():
    """torch 2.13 renamed all_gather_into_tensor to all_gather_single: 2.11 has only the old name."""
    newer = _newer_names()
    assert "torch.distributed.all_gather_single" in newer
    assert "torch.distributed.all_gather_into_tensor" not in newer and "torch.cuda.Stream" not in newer


@pytest.mark.parametrize("source, expected", [
    ("import torch.distributed as dist\ndist.all_gather_single(a, b)", {"torch.distributed.all_gather_single"}),
    ("import torch\ntorch.distributed.all_gather_single(a, b)", {"torch.distributed.all_gather_single"}),
    ("from torch.distributed import all_gather_single", {"torch.distributed.all_gather_single"}),
    ("from torch import distributed as d\nd.all_gather_single", {"torch.distributed.all_gather_single"}),
    ("x._philox_normal_()", {"._philox_normal_"}),
    ("import torch.distributed as dist\nf = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor",
     set()),
    ("import torch\ntorch.cuda.synchronize()", set()),
])
def test_newer_uses_are_found_in_every_spelling(source, expected):
    newer = {"torch.distributed.all_gather_single", "torch.Tensor._philox_normal_"}
    assert newer_uses(source, newer) == expected
