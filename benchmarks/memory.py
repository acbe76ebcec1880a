"""Memory of every onebit optimizer next to ``torch.optim.Adam``, measured the same way in one run,
and the accounting behind it: every buffer each optimizer holds, and every transient a step allocates.

    python benchmarks/memory.py                        # 2 gloo ranks, one 16M-element parameter
    python benchmarks/memory.py --numel 4e6 --tag quick
    python benchmarks/memory.py --compact              # and the compressed state of each 1-bit optimizer

Three parts, each in ranks of their own (``--world-size``, default 2, gloo on loopback, one thread):

1. **RSS**: each optimizer in fresh processes, over one fp32 parameter of ``--numel`` elements whose
   gradient is written in place every step (no model: only the optimizer allocates). Imports and
   kernels are warmed first (every optimizer takes steps on a small parameter), then the resident
   set size (``VmRSS``) with the parameter and its gradient is the baseline. The peak (``VmHWM``) is
   reset (``/proc/self/clear_refs``) before construction and before each step. Reported per rank 0:
   B/param held after the last step of each phase (steady) and the largest peak of the run.
2. **Held buffers**: every tensor the optimizer object reaches (its buckets' buffers, scratch,
   compression states, the algorithms' caches; not the parameters, nor their gradients), found by
   walking the object (:func:`held_buffers`), by name, after construction and after a step of
   each plan; exact bytes, over a parameter of ``--accounting-numel`` elements and a small one of
   1001 (so that the padding of the compressed layout shows).
3. **Transients**: each step of part 2 under ``torch.profiler`` with memory tracking: the most new
   bytes alive at once during the step (above what it held at its start) and each allocation of at
   least 1/8 byte per parameter, by the onebit function and operator that made it, kept or freed
   by the step's end (:func:`step_allocations`).

Writes ``results/memory[_<tag>].{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from local_ranks import run_local_ranks  # noqa: E402

NAMES = ("Adam", "OnebitAdam", "OnebitLamb", "ZeroOneAdam", "OnebitDiLoCo")
#: ``--compact``: the suffixes of a 1-bit optimizer's name that build it with a given state precision
#: (the plain names: the defaults), and the options they add (``preconditioner_dtype``: 1-bit Adam
#: and 1-bit LAMB only; ``float32`` and ``compact`` are measured for them alone)
VARIANTS = {" float32": {"error_dtype": torch.float32, "preconditioner_dtype": torch.float32},
            " bf16 errors": {"error_dtype": torch.bfloat16, "preconditioner_dtype": torch.float32},
            " compact": {"error_dtype": torch.bfloat16, "preconditioner_dtype": torch.bfloat16}}
#: steps of each run: 4 of warmup (phase 1) for every schedule below, then 12 past it
STEPS = 16
SMALL = 1001  # the accounting's second parameter (odd: the compressed layout pads it)


def build(name: str, params: list[torch.nn.Parameter], **options: Any) -> torch.optim.Optimizer:
    """The optimizer ``name`` with a schedule that switches at step 4 (0/1 Adam: variance and
    compressed-gradient steps up to 8, then local steps and syncs; DiLoCo: an outer step every 4)."""
    import onebit

    for suffix, variant in VARIANTS.items():
        if name.endswith(suffix):
            return build(name[:-len(suffix)], params, **variant, **options)
    if name == "Adam":
        return torch.optim.Adam(params, lr=1e-3)
    backend = {"comm_backend_name": "gloo" if dist.is_initialized() else "local", **options}
    if name == "OnebitAdam":
        return onebit.OnebitAdam(params, lr=1e-3, freeze_step=4, **backend)
    if name == "OnebitLamb":
        return onebit.OnebitLamb(params, lr=1e-3, freeze_step=4, **backend)
    if name in ("ZeroOneAdam", "OnebitDiLoCo"):  # (no frozen preconditioner)
        backend.pop("preconditioner_dtype", None)
    if name == "ZeroOneAdam":
        return onebit.ZeroOneAdam(params, lr=1e-3, var_freeze_step=8, var_update_scaler=1, local_step_scaler=2,
                                  local_step_clipper=4, **backend)
    if name == "OnebitDiLoCo":
        return onebit.OnebitDiLoCo(params, lr=1e-3, sync_every=4, **backend)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(NAMES)} (1-bit ones with a suffix of "
                     f"{list(VARIANTS)})")


def plan_name(opt: torch.optim.Optimizer) -> str:
    """The name of the next step's plan (``'adam'`` for torch's Adam)."""
    return getattr(opt, "phase", "adam")


# ----------------------------------------------------------------------------- held buffers


def held_buffers(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of every tensor storage ``opt`` reaches, by name (the path of attributes and string
    keys that first reached it, without indices: ``bucket.buffers[exp_avg]``,
    ``bucket.compression._worker_error``); each storage counted once, the parameters' and their
    gradients' not at all. Walks dicts, sequences, weak dictionaries, optimizers and the objects
    of onebit's own classes (the optimizer's buckets first, so that a state entry that views a bucket's buffer
    is named after the buffer)."""
    excluded = set()
    for group in opt.param_groups:
        for p in group["params"]:
            excluded.add(p.untyped_storage().data_ptr())
            if p.grad is not None:
                excluded.add(p.grad.untyped_storage().data_ptr())
    held: dict[str, int] = {}
    seen_storages: set[int] = set()
    seen_objects: set[int] = set()

    def visit(obj: Any, label: str) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in excluded and key not in seen_storages:
                seen_storages.add(key)
                held[label] = held.get(label, 0) + storage.nbytes()
            return
        if id(obj) in seen_objects or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        seen_objects.add(id(obj))
        if isinstance(obj, (Mapping, weakref.WeakKeyDictionary)):
            for key, value in list(obj.items()):
                visit(value, f"{label}[{key}]" if isinstance(key, str) else label)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in obj:
                visit(value, label)
        elif (type(obj).__module__.startswith("onebit") or isinstance(obj, torch.optim.Optimizer)) and hasattr(obj, "__dict__"):
            for key, value in sorted(vars(obj).items(), key=lambda item: item[0] != "_buckets"):
                visit(value, _member(label, key))

    visit(opt, "")
    return held


def _member(label: str, key: str) -> str:
    if not label and key == "_buckets":
        return "bucket"
    return f"{label}.{key}" if label else key


# ----------------------------------------------------------------------------- transients


def step_allocations(step: Callable[[], None], threshold: int) -> dict[str, Any]:
    """Run ``step`` under the profiler with memory tracking: ``peak``, the most bytes allocated
    during it and alive at once (frees of what existed before it not counted), and
    ``allocations``: ``{where: [bytes, bytes kept at the end]}`` of the allocations of at least
    ``threshold`` bytes, ``where`` the innermost onebit (or torch.optim) function and the operator."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        step()
    events = []

    def walk(nodes: Any, path: list[str]) -> None:
        for node in nodes:
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr, path))
            else:
                walk(node.children, path + [node.name])

    walk(prof.profiler.kineto_results.experimental_event_tree(), [])
    events.sort(key=lambda e: e[0])
    live: dict[int, str] = {}
    allocations: dict[str, list[int]] = {}
    mine: set[int] = set()  # what the step allocated (frees of earlier blocks are not all reported)
    alive = peak = 0
    for _, size, ptr, path in events:
        if size > 0:
            mine.add(ptr)
            alive += size
        elif ptr in mine:
            mine.discard(ptr)
            alive += size
        peak = max(peak, alive)
        if size > 0 and size >= threshold:
            where = _where(path)
            entry = allocations.setdefault(where, [0, 0])
            entry[0] += size
            entry[1] += size
            live[ptr] = where
        elif size < 0 and ptr in live:
            allocations[live.pop(ptr)][1] += size
    return {"peak": peak, "allocations": allocations}


def _where(path: list[str]) -> str:
    """``file.py:function (op)``: the innermost frame of onebit (or torch.optim), and the operator."""
    frames = [name for name in path if "onebit/" in name or "torch/optim/" in name]
    ops = [name for name in path if name.startswith("aten::")]
    where = "?"
    if frames:  # "onebit/frozen.py(87): preconditioner"
        file_line, _, function = frames[-1].partition(": ")
        where = f"{file_line.split('(')[0].rsplit('/', 1)[-1]}:{function}"
    return f"{where} ({ops[0].removeprefix('aten::')})" if ops else where


# ----------------------------------------------------------------------------- the ranks


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))


def _warm(measured: list[str]) -> None:
    """Import and run every optimizer ``measured`` once on a small parameter (kernels built, code paths taken)."""
    for name in measured:
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = build(name, [p])
        for _ in range(STEPS):
            p.grad = torch.randn(4096)
            opt.step()
        del opt, p


def _rss_rank(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    _init(rank, world, store)
    _warm(names(args))
    numel = int(args.numel)
    generator = torch.Generator().manual_seed(rank)
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.zeros(numel)
    dist.barrier()
    base = _status("VmRSS")
    _reset_peak()
    opt = build(args.name, [p])
    record = [{"after": "construction", "rss": _status("VmRSS") - base, "peak": _status("VmHWM") - base}]
    for _ in range(STEPS):
        plan = plan_name(opt)
        p.grad.normal_(generator=generator)
        _reset_peak()
        opt.step()
        record.append({"after": plan, "rss": _status("VmRSS") - base, "peak": _status("VmHWM") - base})
    if rank == 0:
        Path(out).write_text(json.dumps({"name": args.name, "numel": numel, "steps": record}))
    dist.destroy_process_group()


def _accounting_rank(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    _init(rank, world, store)
    _warm(names(args))
    numel = int(args.accounting_numel) + SMALL
    generator = torch.Generator().manual_seed(rank)
    result = {}
    for name in names(args):
        params = [torch.nn.Parameter(torch.zeros(int(args.accounting_numel))), torch.nn.Parameter(torch.zeros(SMALL))]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = build(name, params)
        phases = [{"after": "construction", "held": held_buffers(opt)}]
        for _ in range(STEPS):
            plan = plan_name(opt)
            for p in params:
                p.grad.normal_(generator=generator)
            transient = step_allocations(opt.step, numel // 8)
            phases.append({"after": plan, "held": held_buffers(opt), **transient})
        result[name] = phases
        del opt, params
    if rank == 0:
        Path(out).write_text(json.dumps({"numel": numel, "optimizers": result}))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the report


def summarize_rss(run: dict) -> dict[str, Any]:
    """B/param held after the last step of each plan, and the largest peak of the run."""
    numel = run["numel"]
    steady = {}
    for row in run["steps"]:
        steady[row["after"]] = row["rss"] / numel
    return {"steady": steady, "peak": max(row["peak"] for row in run["steps"]) / numel,
            "final": run["steps"][-1]["rss"] / numel}


def held_by_plan(phases: list[dict], numel: int) -> dict[str, dict[str, float]]:
    """B/param held by name after construction and after the last step of each plan."""
    return {phase["after"]: {k: v / numel for k, v in sorted(phase["held"].items())} for phase in phases}


def transients_by_plan(phases: list[dict], numel: int) -> dict[str, dict[str, Any]]:
    """Per plan: the largest peak of its steps (B/param) and the allocations of the step with it."""
    out: dict[str, dict[str, Any]] = {}
    for phase in phases[1:]:
        known = out.get(phase["after"])
        if known is None or phase["peak"] / numel > known["peak"]:
            out[phase["after"]] = {
                "peak": phase["peak"] / numel,
                "allocations": {k: [v[0] / numel, v[1] / numel] for k, v in sorted(phase["allocations"].items())}}
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Optimizer memory, {result['world_size']} gloo ranks", "",
             f"{result['machine']}; {result['date']}; commit {result['commit']}.", "",
             f"## RSS: one fp32 parameter of {result['numel'] / 1e6:.1f}M elements, rank 0", "",
             "Bytes per parameter above the parameter and its gradient: held after the last step of each kind "
             "(steady), and the largest resident peak of the run (construction and every step).", "",
             "| optimizer | steady B/param (after each kind of step) | final | peak B/param |", "|---|---|---:|---:|"]
    for name, rss in result["rss"].items():
        steady = ", ".join(f"{plan} {value:.1f}" for plan, value in rss["steady"].items())
        lines.append(f"| {name} | {steady} | {rss['final']:.1f} | {rss['peak']:.1f} |")
    numel = result["accounting"]["numel"]
    lines += ["", f"## Held buffers by name (B/param; {numel:,} elements in two parameters)", "",
              "After construction and after the last step of each kind; 0.0: under 0.05 B/param.", ""]
    for name, plans in result["held"].items():
        labels = sorted({label for held in plans.values() for label in held})
        lines += [f"### {name}", "", "| buffer | " + " | ".join(plans) + " |", "|---|" + "---:|" * len(plans)]
        for label in labels:
            cells = [f"{held[label]:.1f}" if label in held else "-" for held in plans.values()]
            lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
        lines.append("| **total** | " + " | ".join(f"**{sum(held.values()):.1f}**" for held in plans.values()) + " |")
        lines.append("")
    lines += ["## Transients of a step (B/param)", "",
              "Per kind of step (the step with the largest peak): the most new bytes alive at once during it, and "
              "each allocation of at least 1/8 B/param by where it was made (bytes allocated; kept: still held at "
              "the step's end).", "", "| optimizer | step | peak | allocations (allocated / kept) |", "|---|---|---:|---|"]
    for name, plans in result["transients"].items():
        for plan, row in plans.items():
            made = "; ".join(f"`{where}` {a:.2f}/{k:.2f}" for where, (a, k) in row["allocations"].items()) or "none"
            lines.append(f"| {name} | {plan} | {row['peak']:.2f} | {made} |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        import subprocess

        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def names(args: argparse.Namespace) -> list[str]:
    """The optimizers measured, with their defaults: :data:`NAMES`; with ``--compact`` also 1-bit
    Adam and LAMB with float32 state, each 1-bit one with bfloat16 errors, and 1-bit Adam and LAMB
    with their frozen preconditioner in bfloat16 too."""
    if not args.compact:
        return list(NAMES)
    return [*NAMES, "OnebitAdam float32", "OnebitLamb float32", *(name + " bf16 errors" for name in NAMES[1:]),
            "OnebitAdam compact", "OnebitLamb compact"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=float, default=16e6, help="elements of the RSS runs' parameter")
    parser.add_argument("--accounting-numel", type=float, default=4e6, help="elements of the accounting's parameter")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tag", default="", help="results/memory_<tag>.{json,md}")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--compact", action="store_true",
                        help="measure each 1-bit optimizer with error_dtype=torch.bfloat16 too, and 1-bit Adam and "
                             "LAMB with preconditioner_dtype=torch.bfloat16 as well")
    args = parser.parse_args()
    # Every allocation of 1 MiB or more is its own mapping, returned to the system when freed (glibc
    # otherwise raises its threshold after a free, and keeps freed blocks of up to 32 MiB resident):
    # the resident size is then what is alive, for torch's Adam and onebit alike.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    accounting = run_local_ranks(_accounting_rank, args.world_size, args)
    rss = {}
    for name in names(args):
        rss[name] = summarize_rss(run_local_ranks(_rss_rank, args.world_size, argparse.Namespace(**vars(args), name=name)))
    numel = accounting["numel"]
    result = {
        "world_size": args.world_size, "numel": int(args.numel), "rss": rss, "accounting": {"numel": numel},
        "held": {name: held_by_plan(phases, numel) for name, phases in accounting["optimizers"].items()},
        "transients": {name: transients_by_plan(phases, numel) for name, phases in accounting["optimizers"].items()},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _commit(),
    }
    text = markdown(result)
    print(text)
    stem = "memory" + (f"_{args.tag}" if args.tag else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
