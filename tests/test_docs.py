"""The documentation cannot rot: the site builds with warnings as errors, every ```python block of
the guides and the README runs, and the README stays short.

A block that cannot run in one CPU process (several ranks, a GPU, a framework launcher) is marked
in the markdown by a comment on the line right before its fence, with the reason:

    <!-- norun: needs a torchrun launch (several ranks) -->

The blocks of one page run in order in one fresh interpreter, sharing their names (a later block
may use the model an earlier one built), with the repository on PYTHONPATH and a hard timeout.
"""

import json
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


# ------------------------------------------------------------------------------------ one source per number (issue 44, row 9)

GUIDES = ROOT / "docs" / "guides"
RESULTS = ROOT / "benchmarks" / "results"
OPTIMIZERS = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam", "OnebitDiLoCo")
_ABSENT = "—"


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of each body row of the markdown table whose header row starts with ``header``."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"no table whose header starts with {header!r}"
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _literal(cell: str):
    import ast

    return ast.literal_eval(cell.strip().strip("`"))


def _defaults(function) -> dict:
    import inspect

    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _same(documented, actual) -> bool:
    return documented == actual and type(documented) in (type(actual), int if type(actual) is float else type(actual))


def test_documented_defaults_equal_the_constructors():
    import onebit
    from onebit.autofreeze import MIN_STEPS

    rows = _table((GUIDES / "tuning.md").read_text(encoding="utf-8"), "| argument | `OnebitAdam`")
    signatures = {name: _defaults(getattr(onebit, name).__init__) for name in OPTIMIZERS}
    for cells in rows:
        name = cells[0].strip("`")
        for optimizer, cell in zip(OPTIMIZERS, cells[1:5]):
            if cell == _ABSENT:
                assert name not in signatures[optimizer], f"tuning.md: {optimizer} has {name}"
            else:
                assert _same(_literal(cell), signatures[optimizer][name]), (
                    f"tuning.md says {optimizer}'s {name} defaults to {cell}; the signature: {signatures[optimizer][name]!r}")
        meaning = cells[5]
        if meaning.startswith('with `trust_ratio="frozen"`: '):
            assert float(meaning.rsplit(": ", 1)[1]) == onebit.OnebitLamb.FROZEN_DEFAULTS[name], name
    documented = {cells[0].strip("`") for cells in rows}
    every = set().union(*signatures.values())
    assert documented == every, f"tuning.md's table misses {every - documented} or has extra {documented - every}"
    bounds = next(cells[5] for cells in rows if cells[0] == "`freeze_bounds`")
    assert bounds.endswith(f"`({MIN_STEPS}, None)`")


def test_documented_options_equal_the_engine():
    from onebit.engine import DEFAULT_BUCKET_SIZE, OnebitOptimizer

    rows = _table((GUIDES / "tuning.md").read_text(encoding="utf-8"), "| option | default |")
    engine = {k: v for k, v in _defaults(OnebitOptimizer.__init__).items()}
    documented = {cells[0].strip("`"): _literal(cells[1]) for cells in rows}
    assert documented == engine
    assert DEFAULT_BUCKET_SIZE == 2**24 and "2²⁴" in next(c[2] for c in rows if c[0] == "`bucket_size`")


# `cuda_aware=False` (default), `comm_backend_name=None` (the default)
_ASSIGNED_DEFAULT = re.compile(r"`(\w+)=([^`]+)`\s*\((?:the )?default\)")
# **`reduce_dtype`** (default `None`: ...), **`trust_ratio`** (1-bit LAMB; default `"live"`)
_BULLET_DEFAULT = re.compile(r"\*\*`(\w+)`\*\*\s*\((?:[^()]*?; )?default `([^`]+)`")


def _stated_defaults() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8").replace("\n", " ")
        for pattern in (_ASSIGNED_DEFAULT, _BULLET_DEFAULT):
            found += [(_name(page), m.group(1), m.group(2)) for m in pattern.finditer(re.sub(r" +", " ", text))]
    return found


def test_defaults_stated_in_the_prose_agree_with_the_constructors():
    import onebit
    from onebit.engine import OnebitOptimizer

    signatures = [_defaults(getattr(onebit, name).__init__) for name in OPTIMIZERS]
    engine = _defaults(OnebitOptimizer.__init__)
    stated = _stated_defaults()
    names = {name for _, name, _ in stated}
    assert {"freeze_step", "cuda_aware", "nonfinite_grads", "reduce_dtype", "comm_backend_name"} <= names, names
    for page, name, value in stated:
        actual = [s[name] for s in signatures if name in s] or ([engine[name]] if name in engine else [])
        assert actual, f"{page}: a default is stated for {name}, which no constructor has"
        assert all(_same(_literal(value), a) for a in actual), f"{page}: {name} defaults to {value}? the code: {actual}"


def _headline_rows() -> list[tuple[list[str], str]]:
    """README's "When it pays" rows whose date links a result file: (cells, the file's stem)."""
    rows = _table((ROOT / "README.md").read_text(encoding="utf-8"), "| setting | DDP + Adam |")
    out = []
    for cells in rows:
        link = re.search(r"\]\(benchmarks/results/([\w.]+)\.md\)", cells[3])
        if link:
            out.append((cells, link.group(1)))
    return out


def _result(stem: str, rate: float) -> dict:
    """DDP + Adam against a compression step in a results file, for the run at ``rate`` Gbit/s."""
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    run = next(r for r in data["runs"] if r["rate_gbit"] == rate)
    summary, configs = run["summary"], run["summary"]["configs"]
    return {"date": data["machine"]["date"], "commit": data["code"]["commit"],
            "adam_ms": round(configs["adam"]["step_s"] * 1e3),
            "compression_ms": round(configs["onebit_compression"]["step_s"] * 1e3),
            "speedup": configs["onebit_compression"]["speedup_vs_adam"],
            "setting": (summary["numel"], summary["world_size"], summary["batch"],
                        summary["buckets"]["onebit_compression"], rate)}


def _rate(cells: list[str]) -> float:
    return float(re.search(r"(\d+(?:\.\d+)?) Gbit/s", cells[0]).group(1))


def test_readme_headline_numbers_equal_their_result_files():
    rows = _headline_rows()
    assert len(rows) >= 2, "the README's step times should link the result files they quote"
    for cells, stem in rows:
        got = _result(stem, _rate(cells))
        assert cells[1] == f"{got['adam_ms']:,} ms a step", (stem, cells[1])
        assert cells[2].startswith(f"{got['compression_ms']:,} ms a step ({got['speedup']:.2f}x faster"), (stem, cells[2])
        assert cells[3].startswith(f"[{got['date'][:10]}]"), (stem, cells[3])


def test_readme_headlines_are_the_newest_runs_of_their_setting():
    for cells, stem in _headline_rows():
        quoted = _result(stem, _rate(cells))
        for path in RESULTS.glob("*.json"):
            data = json.loads(path.read_text())
            runs = data.get("runs") if isinstance(data, dict) else None
            for run in runs if isinstance(runs, list) else []:
                configs = run.get("summary", {}).get("configs")
                if not isinstance(configs, dict) or not {"adam", "onebit_compression"} <= set(configs):
                    continue
                other = _result(path.stem, run["rate_gbit"])
                if other["setting"] == quoted["setting"]:
                    assert other["date"] <= quoted["date"], (
                        f"README quotes {stem} ({quoted['date']}); {path.name} ({other['date']}) is newer")


def test_headline_numbers_agree_between_the_readme_and_the_benchmarks_guide():
    guide = (GUIDES / "benchmarks.md").read_text(encoding="utf-8").replace("\n", " ")
    for cells, stem in _headline_rows():
        got = _result(stem, _rate(cells))
        at = guide.find(f"`results/{stem}.md`")
        assert at >= 0, f"benchmarks.md does not name results/{stem}.md, which the README quotes"
        sentence = guide[max(0, at - 220):at]
        for part in (f"{got['adam_ms']:,} ms", f"{got['compression_ms']:,} ms", f"{got['speedup']:.2f}x",
                     got["date"][:10], f"commit {got['commit']}"):
            assert part in sentence, (stem, part, sentence)


def test_the_readmes_other_measurements_are_the_guides():
    guides = " ".join((GUIDES / page).read_text(encoding="utf-8") for page in ("benchmarks.md", "hierarchy.md"))
    rows = _table((ROOT / "README.md").read_text(encoding="utf-8"), "| setting | DDP + Adam |")
    numbers = [n for cells in rows if "benchmarks/results/" not in cells[3]
               for n in re.findall(r"\d+[.,]\d+", " ".join(cells[1:3]))]
    assert len(numbers) >= 6
    missing = [n for n in numbers if n not in guides]
    assert not missing, f"the README quotes numbers no guide has: {missing}"


def test_the_estimate_guide_states_the_estimates_defaults():
    from onebit.estimate import REDUCE_GBPS
    from onebit.estimate.cache import ENV_VAR, FILE_NAME
    from onebit.estimate.measure import DEFAULT_REPEATS

    guide = (GUIDES / "benchmarks.md").read_text(encoding="utf-8").replace("\n", " ")
    section = guide[guide.index("## Should I compress?"):]
    for fact in (f"{DEFAULT_REPEATS} timed runs", f"~/.cache/onebit/{FILE_NAME}", f"${ENV_VAR}",
                 f"at {REDUCE_GBPS['cpu']:g} GB/s", "upper bound"):
        assert fact in section, fact


def test_examples_leave_the_backend_name_out_on_several_ranks():
    """The guides' rule: on several ranks, leave comm_backend_name out (the default process group);
    no example names "gloo", "nccl" or "hccl" (one that does would break on the other backend)."""
    named = re.compile(r"""comm_backend_name\s*=\s*["'](gloo|nccl|hccl)["']""")
    for page in PAGES:
        for line, code, _ in python_blocks(page):
            assert not named.search(code), f"{_name(page)}:{line}: leave comm_backend_name out on several ranks"


def test_equality_with_adamw_is_claimed_with_its_condition():
    """A guide that says OnebitAdam equals torch.optim.AdamW says under bias_correction=True (the
    default, DeepSpeed's, has no bias correction); DiLoCo's inner steps are AdamW by default."""
    for page in sorted(GUIDES.glob("*.md")):
        for paragraph in (" ".join(p.split()) for p in page.read_text(encoding="utf-8").split("\n\n")):
            if "torch.optim.AdamW" in paragraph and "equal" in paragraph and "inner steps" not in paragraph:
                assert "bias_correction=True" in paragraph or "with bias correction" in paragraph, (
                    f"{_name(page)}: {paragraph[:200]}")


def test_the_transports_guide_says_what_the_default_does_under_a_launcher(monkeypatch):
    from onebit.backends import resolve_backend

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="the launcher reports 2 processes") as raised:
        resolve_backend(None)
    with pytest.raises(ValueError, match="trains each rank alone"):
        resolve_backend("local")
    guide = (GUIDES / "backends.md").read_text(encoding="utf-8").replace("\n", " ")
    paragraph = guide[guide.index("`comm_backend_name=None` (the default)"):][:900]
    for fact in (type(raised.value).__name__, "WORLD_SIZE", "init_process_group", '`"local"` named explicitly'):
        assert fact in paragraph, fact
