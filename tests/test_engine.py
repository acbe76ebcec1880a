"""The engine shared by the onebit optimizers: plans, statistics per plan, timers, the contract a
subclass fills in, and the package's import hygiene."""

from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import onebit
from conftest import seeded_params
from distributed import run_ranks
from onebit import LocalBackend, OnebitAdam, OnebitLamb, OnebitOptimizer, StepPlan
from onebit.buckets import Bucket
from onebit.spec import StateSpec
from onebit.testing import simulate_compressed_allreduce

PACKAGE = Path(onebit.__file__).resolve().parent


class CompressedSGD(OnebitOptimizer):
    """A third algorithm, written only against the engine's contract: every ``period``-th step
    averages the gradient with the 1-bit all-reduce, the steps between are local, and step 1
    averages in full precision. ``p -= lr * g``."""

    PLAN_NAMES = ("full", "compressed", "local")
    STATE = StateSpec(buffers=("grad_copy",), masked="grad_copy")

    def __init__(self, params, lr=0.1, period=2, **options):
        self.period = period
        super().__init__(params, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), **options)

    def plan_for(self, step):
        if step == 1:
            return StepPlan("full", average_gradients=True)
        return StepPlan("compressed", compress=True) if step % self.period == 0 else StepPlan("local")

    def _update_averaged(self, bucket: Bucket, group, t):
        torch._foreach_add_(bucket.params, bucket.view(bucket.averaged_grad()), alpha=-group["lr"])

    def _compress_input(self, bucket: Bucket, grads, group, t, staged=False):
        buffer = bucket.buffers["grad_copy"]
        for view, g in zip(bucket.views["grad_copy"], grads):
            view.copy_(g) if g is not None else view.zero_()
        return buffer

    def _update_compressed(self, bucket: Bucket, group, t):
        torch._foreach_add_(bucket.params, bucket.views["grad_copy"], alpha=-group["lr"])

    def _update_local(self, bucket: Bucket, grads, group, t):
        torch._foreach_add_(bucket.params, [g for g in grads], alpha=-group["lr"])


def _grads(params, rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _sgd_rank(rank, world_size, steps):
    params = seeded_params((5, 7), 3)
    opt = CompressedSGD(params, lr=0.1, period=2, comm_backend_name="gloo")
    for t in range(1, steps + 1):
        _grads(params, rank, t)
        opt.step()
    return {"params": [p.detach().clone() for p in params], "stats": opt.comm_stats()}


@pytest.mark.slow
def test_a_third_algorithm_on_the_engine_matches_its_oracle_on_gloo_ranks(tmp_path):
    n, steps = 2, 5
    results = run_ranks(_sgd_rank, n, tmp_path, steps)
    torch.manual_seed(0)
    params = [[torch.randn(5, 7), torch.randn(3)]] * n
    params = [[p.clone() for p in ps] for ps in params]
    numels = [35, 3]
    we = [torch.zeros(sum(-(-k // (8 * n)) * 8 * n for k in numels)) for _ in range(n)]
    se = [torch.zeros(we[0].numel() // n) for _ in range(n)]
    for t in range(1, steps + 1):
        grads = []
        for r in range(n):
            holder = [torch.zeros(5, 7), torch.zeros(3)]
            _grads(holder, r, t)
            grads.append([g.grad for g in holder])
        if t == 1:
            mean = [torch.stack([grads[r][i] for r in range(n)]).mean(0) for i in range(2)]
            params = [[p - 0.1 * m for p, m in zip(ps, mean)] for ps in params]
        elif t % 2 == 0:
            flat = [torch.cat([g.reshape(-1) for g in grads[r]]) for r in range(n)]
            result = simulate_compressed_allreduce(flat, we, se, numels=numels)
            we, se = result.worker_errors, result.server_errors
            avg = [result.output[:35].view(5, 7), result.output[35:]]
            params = [[p - 0.1 * a for p, a in zip(ps, avg)] for ps in params]
        else:
            params = [[p - 0.1 * g for p, g in zip(ps, grads[r])] for r, ps in enumerate(params)]
    for r in range(n):
        for got, want in zip(results[r]["params"], params[r]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    stats = results[0]["stats"]
    assert (stats["full"]["steps"], stats["compressed"]["steps"], stats["local"]["steps"]) == (1, 2, 2)
    assert stats["full"]["collectives"] == 2  # the layout check and the gradient all-reduce
    assert stats["compressed"]["collectives"] == 2 * 3  # finiteness flag, all-to-all, all-gather
    # Local steps communicate nothing (a rank with non-finite gradients skips alone: tests/test_zoadam.py).
    assert stats["local"]["collectives"] == 0 and stats["local"]["bytes_sent"] == 0


def test_plans_come_from_the_step_number():
    opt = OnebitAdam([torch.nn.Parameter(torch.zeros(4))], freeze_step=3, backend=LocalBackend())
    assert [opt.plan_for(t).name for t in range(1, 6)] == ["warmup"] * 3 + ["compression"] * 2
    assert opt.plan_for(3) == StepPlan("warmup", average_gradients=True)
    assert opt.plan_for(4) == StepPlan("compression", compress=True)
    assert opt.next_plan == opt.plan_for(1) and opt.phase == "warmup"
    assert OnebitLamb.PLAN_NAMES == OnebitAdam.PLAN_NAMES == ("warmup", "compression")


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_timers_see_every_part_of_a_compression_step(cls):
    p = torch.nn.Parameter(torch.randn(64))
    opt = cls([p], lr=1e-3, freeze_step=1, backend=LocalBackend())
    seen: list[str] = []
    p.grad = torch.randn(64)
    opt.step()
    opt.register_timer(lambda label, seconds: seen.append(label) if seconds >= 0 else None)
    p.grad = torch.randn(64)
    opt.step()
    assert set(seen) == {"gather_grads", "finite_check", "compress_input", "codec_worker", "codec_server",
                         "codec_decode", "update"}
    with pytest.raises(TypeError, match="timer must be callable, got int"):
        opt.register_timer(3)


def test_timers_keep_what_the_kernels_can_do():
    """Timed kernels keep ``separate_errors`` and ``multipliers``: without them a timed run would
    take the slower paths it is meant to measure (copies of the errors, the preconditioned space's
    multiplies in passes of their own)."""
    from onebit.kernels import REFERENCE
    from onebit.stats import timed_kernels
    timed = timed_kernels(REFERENCE, lambda label: contextlib.nullcontext())
    assert (timed.name, timed.separate_errors, timed.multipliers) == (REFERENCE.name, True, True)
    assert timed.worker_compress_ is not REFERENCE.worker_compress_


def test_the_parts_are_profiler_ranges():
    p = torch.nn.Parameter(torch.randn(64))
    opt = OnebitAdam([p], lr=1e-3, freeze_step=1, backend=LocalBackend())
    for _ in range(2):
        p.grad = torch.randn(64)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
    names = {event.key for event in prof.key_averages()}
    assert {"onebit.compress_input", "onebit.update", "onebit.gather_grads"} <= names


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """onebit modules imported at module level (not under TYPE_CHECKING, not inside functions);
    ``from . import x`` depends on the submodule ``x`` when there is one, else on the package."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1]
    found = set()
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = ".".join(package[: len(package) - node.level + 1])
            target = f"{base}.{node.module}" if node.module else base
        elif node.module and node.module.startswith("onebit"):
            target = node.module
        else:
            continue
        submodules = {f"{target}.{alias.name}" for alias in node.names} & modules
        found |= submodules or {target}
    return found


def test_no_import_circle_between_onebit_modules():
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {name: {m for m in _module_imports(path, set(modules)) if m in modules and m != name}
             for name, path in modules.items()}
    graph = {name: {m for m in deps if m != "onebit"} for name, deps in graph.items() if name != "onebit"}

    def visit(node, stack):
        if node in stack:
            raise AssertionError(f"import circle: {' -> '.join(stack[stack.index(node):] + [node])}")
        for dep in graph.get(node, ()):
            visit(dep, stack + [node])

    for name in graph:
        visit(name, [])
    assert "onebit.engine" in graph["onebit.checkpoint"]  # the checker sees imports (checkpoint uses the engine)


@pytest.mark.slow
def test_import_onebit_sets_no_warnings_filter_and_the_estimate_cli_runs_without_warnings():
    # torch and numpy install their own filters when imported; onebit must add none.
    code = ("import torch, numpy, warnings; before = list(warnings.filters); import onebit, onebit.estimate; "
            "assert warnings.filters == before, [f for f in warnings.filters if f not in before]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "onebit.estimate", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RuntimeWarning" not in out.stderr


def test_pack_keep_is_pack_signs_of_the_keep_signs():
    from onebit.buckets import pack_keep
    from onebit.kernels.reference import pack_signs

    gen = torch.Generator().manual_seed(3)
    for n in (8, 64, 8 * 1001):
        keep = torch.rand(n, generator=gen) < 0.7
        assert torch.equal(pack_keep(keep), pack_signs(torch.where(keep, 1.0, -1.0)))


@pytest.mark.parametrize("declared, message", [
    (dict(buffers=("m",), lazy=("v",)), r"lazy \('v',\) must be among \('m',\)"),
    (dict(buffers=("m",), nonnegative=("v",)), r"nonnegative \('v',\) must be among \('m',\)"),
    (dict(scalars={"s": 0.0}, shared_scalars=("t",)), r"shared_scalars \('t',\) must be among \('s',\)"),
    (dict(buffers=("m", "v"), lazy=("v",), masked="v"), r"masked='v' must be one of the buffers that always exist"),
])
def test_a_state_spec_refuses_declarations_that_disagree(declared, message):
    with pytest.raises(ValueError, match=message):
        StateSpec(**declared)


def test_every_optimizer_declares_its_state_in_one_spec():
    for cls in OnebitOptimizer.registered().values():
        spec = cls.STATE
        assert isinstance(spec, StateSpec) and spec.masked == "exp_avg" and "exp_avg_sq" in spec.nonnegative
        assert not any(hasattr(cls, name) for name in ("_BUFFERS", "_LAZY", "_SCALARS", "_GROUP_KEYS", "_schedule_state"))
        params = seeded_params((3, 4))
        opt = cls(params, lr=0.1, comm_backend_name="local")
        # (and the lazy buffers its configuration needs from the first step: OnebitDiLoCo's sync_input at its defaults)
        assert set(opt._lazy_at_build()) <= set(spec.lazy)
        assert set(opt.state[params[0]]) == set(spec.eager) | set(spec.scalars) | set(opt._lazy_at_build())
        saved = spec.schedule.check(opt.state_dict()["param_groups"][0]["onebit"])  # what it saves, it reads back
        assert saved == {s.attribute: getattr(opt, s.attribute) for s in spec.schedule.settings}
