"""The documentation cannot rot: the site builds with warnings as errors, every ```python block of
the guides and the README runs, and the README stays short.

A block that cannot run in one CPU process (several ranks, a GPU, a framework launcher) is marked
in the markdown by a comment on the line right before its fence, with the reason:

    <!-- norun: needs a torchrun launch (several ranks) -->

The blocks of one page run in order in one fresh interpreter, sharing their names (a later block
may use the model an earlier one built), with the repository on PYTHONPATH and a hard timeout.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
README_MAX_BYTES = 20_000
# At most this share of all python blocks may be marked norun.
MAX_NORUN_SHARE = 0.35
PAGE_TIMEOUT_S = 120

_FENCE = re.compile(r"^```(\S*)(.*)$")
_NORUN = re.compile(r"^<!--\s*norun:\s*(\S.*?)\s*-->$")


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(first code line, code, norun reason or None) of every ```python block of ``path``."""
    blocks = []
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: unclosed code fence")
        if match.group(1) == "python":
            note = _NORUN.match(lines[i - 1].strip()) if i > 0 else None
            blocks.append((i + 2, "\n".join(lines[i + 1:end]) + "\n", note.group(1) if note else None))
        i = end + 1
    return blocks


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


RUNNABLE = [path for path in PAGES if any(reason is None for _, _, reason in python_blocks(path))]

# Runs the blocks in order in one namespace; each block is compiled under the page's name and its
# own line numbers, so a traceback points at the markdown line.
_DRIVER = """
import json, sys
page, blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for line, code in blocks:
    print(f"--- {page}:{line}", flush=True)
    exec(compile("\\n" * (line - 1) + code, page, "exec"), namespace)
"""


@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_python_blocks_of_the_page_run(page, tmp_path):
    import json

    blocks = [(line, code) for line, code, reason in python_blocks(page) if reason is None]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([_name(page), blocks]))
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a single process, whatever launched pytest
    try:
        done = subprocess.run([sys.executable, str(driver), str(spec)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{_name(page)}: the python blocks ran past {PAGE_TIMEOUT_S} s\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, f"{_name(page)}: a python block failed\n{done.stdout}\n{done.stderr}"


def test_few_python_blocks_are_marked_norun():
    counts = {"run": 0, "norun": 0}
    for page in PAGES:
        for _, _, reason in python_blocks(page):
            counts["norun" if reason else "run"] += 1
    total = counts["run"] + counts["norun"]
    assert total > 0
    assert counts["norun"] <= MAX_NORUN_SHARE * total, (
        f"{counts['norun']} of {total} python blocks are marked norun (at most {MAX_NORUN_SHARE:.0%}): "
        "write examples that run in one CPU process (comm_backend_name='local')")


def test_norun_marks_sit_right_before_a_python_block():
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").split("\n")
        for i, line in enumerate(lines):
            if "norun" in line and line.strip().startswith("<!--"):
                assert _NORUN.match(line.strip()), f"{_name(page)}:{i + 1}: write <!-- norun: the reason -->"
                assert i + 1 < len(lines) and lines[i + 1].startswith("```python"), (
                    f"{_name(page)}:{i + 1}: a norun mark must be on the line right before a ```python fence")


def test_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to docs/"


def test_readme_links_point_at_files():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+://", t) and not t.startswith("#")]
    assert local, "the README links to no page of the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_site_builds_without_warnings(tmp_path):
    pytest.importorskip("mkdocs", reason='the docs extra is not installed: pip install -e ".[docs]"')
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed\n{output}"
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "reference" / "onebit" / "index.html").exists()
