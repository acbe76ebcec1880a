"""Record DeepSpeed 0.19.6's own OnebitAdam, OnebitLamb and ZeroOneAdam trajectories, for the parity tests.

DeepSpeed removed its 1-bit optimizers after 0.19.6, and onebit claims to compute what DeepSpeed's
``OnebitAdam`` and ``OnebitLamb`` computed. This script runs DeepSpeed's optimizer itself (not a
re-implementation) on real gloo ranks on CPU and saves what it did, so that a test
(``tests/test_deepspeed_parity.py``, ``tests/test_deepspeed_parity_lamb.py``) can replay the same
training with onebit and compare rank 0's parameters after every step.

Install DeepSpeed in a venv of its own, outside the repository (onebit does not depend on it)::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0        # first: takes the local CPU wheel
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install numpy deepspeed==0.19.6
    /tmp/dsvenv/bin/python scripts/deepspeed_reference.py     # writes tests/data/deepspeed_onebitadam.pt
    /tmp/dsvenv/bin/python scripts/deepspeed_reference.py --optimizer lamb   # ... deepspeed_onebitlamb.pt
    /tmp/dsvenv/bin/python scripts/deepspeed_reference.py --optimizer zoadam # ... deepspeed_zerooneadam.pt

(``--out PATH`` writes elsewhere.) The first run JIT-builds DeepSpeed's CPU shared-memory comm op (a
few minutes; cached under ~/.cache/torch_extensions), later runs take about a minute, and the file
is bitwise reproducible (same torch, same file name: ``torch.save`` names its archive after the
file). A recording's rank processes are killed if they run longer than 10 minutes. The script needs
neither CUDA nor cupy, and it never edits DeepSpeed's files: it applies two small patches at run
time, in each rank's process, where DeepSpeed 0.19.6 cannot run on CPU as shipped:

1. **Bit packing.** ``comm_backend_name='compressed'`` (the backend used here) packs signs with the
   ``PackbitsBuilder`` op, which exists only for Intel XPUs (on CPU DeepSpeed hands back a
   ``NotImplementedBuilder``). The patch gives ``deepspeed.runtime.comm.compressed`` a numpy
   packer with the op's documented semantics: bit ``1`` where the float's sign bit is clear
   (so ``-0.0`` packs as ``-1``), 8 elements per byte, the first in the most significant bit;
   unpacking gives ``+1.0`` / ``-1.0``.
2. **0-d scales in all_gather.** The backend all-gathers its 0-d scale tensors into ``[1]``-shaped
   outputs, which gloo refuses ("invalid tensor size at index 0"). The patch wraps
   ``deepspeed.comm.all_gather`` to reshape a 0-d input to ``[1]``; the values are unchanged.

Without an engine (``deepspeed.initialize`` wants a full config and a model wrapper), the
optimizer gets a small stand-in for its ``deepspeed`` argument with the three attributes it
reads: ``mpu=None`` (data-parallel group = the world), ``local_rank`` and
``enable_backward_allreduce``. The driver plays the engine's part: while that flag is True it
averages every gradient over the ranks as the engine does by default (all-reduce SUM, then
``mul_(1 / n)``); once DeepSpeed's optimizer sets it to False (the switch to compression), each
rank keeps its local gradient.

**DeepSpeed's dry run.** DeepSpeed's first ``step()`` only allocates buffers (and runs one
compressed all-reduce of the zero momentum); it discards the gradient and moves nothing. Its
call ``k`` therefore does onebit's step ``k - 1``. The driver feeds call 1 a throw-away batch and
call ``k + 1`` the batch of onebit's step ``k``. DeepSpeed switches to compression after its call
``F_ds`` (``state['step'] >= freeze_step``), i.e. after ``F_ds - 1`` warmup updates, so the
recorded run uses ``freeze_step = F + 1`` in DeepSpeed for onebit's ``freeze_step = F``.

**Padding and sizes.** In fp32 DeepSpeed's OnebitAdam compresses tensor by tensor, each padded to a
multiple of ``n * lcm(n, 8)`` (16 at n = 2, 72 at n = 3), and the padded slots take part in the scale
and accumulate error. onebit pads each tensor to a multiple of ``8 n`` (16 at n = 2, 24 at n = 3). The
two agree exactly at n = 2 for any size, so the 2-rank model has odd sizes (2250, 50, 150, 3 and 37
elements); at n = 3 they agree only for sizes that are multiples of 72 (neither pads), so the 3-rank
model has only such tensors (2592, 72, 216 and 144 elements: no bias on the output layer). A 3-rank
tensor of, say, 50 elements would be padded to 72 by DeepSpeed and 72 by onebit too, but one of 30
elements to 72 against 48: different scales, no exact match possible.

**The file** (``torch.save``, about 0.6 MB) holds: versions; the hyperparameters (onebit's
``freeze_step`` and DeepSpeed's); and for each world size ``n`` under ``runs[n]``: the model
``spec`` (keyword arguments of :class:`ParityModel`), ``names`` (parameter names in order),
``initial`` (the same initial weights on every rank), the data of every step and rank
(``inputs``, ``extra_inputs``, ``targets``: ``[steps, n, batch, ...]``), ``trajectory``
(``{name: [steps, *shape]}``: rank 0's parameters after onebit-step ``1..steps``, i.e. after
DeepSpeed's calls ``2..steps+1``), ``backward_allreduce`` (the engine flag at each of those
steps: True in warmup), and ``max_rank_difference`` (max |p_r - p_0| over ranks and steps, which
DeepSpeed keeps at 0).

**OnebitLamb** (``--optimizer lamb``; DeepSpeed's ``runtime/fp16/onebit/lamb.py``) has the same
dry run, the same engine flag and the same ``freeze_step = F + 1``: the recorded flags are True
for onebit's steps ``1..F`` and False from ``F + 1`` on (DeepSpeed's call ``F + 2``, its first
compression call). Unlike OnebitAdam it compresses all momenta as one fused buffer (padded once,
at its end, with a pad tail that is never cleared) with one worker scale, after multiplying each
tensor's momentum by ``scaling_coeff = R / r_q`` (``r_q`` the tensor's momentum RMS at the
switch, ``R`` their mean). Two cases per world size: ``single_tensor``, a
:class:`SingleTensorModel` whose only parameter (72 x 36 = 2592 elements) is padded by neither
library (a multiple of 16 and of 72), so that ``scaling_coeff`` is exactly 1 and the fused buffer
is the tensor itself: the parity case. And ``several_tensors``, the OnebitAdam runs'
:class:`ParityModel`, whose momenta DeepSpeed equalises with ``scaling_coeff`` and compresses with
shared scales where onebit gives each tensor its own: recorded to measure that difference, not to
match it. The LAMB file (about 1 MB) holds what the Adam file holds, with ``optimizer`` and the
LAMB hyperparameters added and the runs under ``runs[case][n]`` (``single_tensor`` runs have no
``extra_inputs``), and per run, for rank 0 after each step, DeepSpeed's per-tensor coefficients
``[steps, tensors]`` (float64, columns in ``names`` order; the same on every rank): ``lamb_coeffs``
(``get_lamb_coeffs()``: the coefficient applied at that step), ``lamb_coeff_freeze`` and
``last_factor``; and ``scaling_coeff`` (``[tensors]``). The script refuses a run in which a
warmup coefficient is exactly 1.0 (a zero norm, or a clamp landing on 1.0: DeepSpeed then skips
the coefficient's moving average, onebit does not) and prints any warmup coefficient clamped to
``min_coeff`` or ``max_coeff``.

**ZeroOneAdam** (``--optimizer zoadam``; DeepSpeed's ``runtime/fp16/onebit/zoadam.py``, 0/1 Adam) has
the same dry run (call ``k`` does onebit's step ``k - 1``) but no single switch: in its phase A (calls
``2 .. T_v + 1``, i.e. onebit's steps ``1 .. T_v`` for ``var_freeze_step = T_v``: no ``+ 1`` here,
DeepSpeed tests ``step > T_v``) it sets the engine flag after every call, True when the *next* call
updates the variance (``(t + 1) % var_interval == 0``, ``t`` the call index); the driver reads the flag
before each call and averages that call's gradients only when it is True. The other phase-A calls
compress each rank's local gradient (one compressed all-reduce per tensor, in fp32). In phase B (calls
``>= T_v + 2``) the flag stays False, the ranks take local steps, and every ``local_step_interval``
calls (``t % H == 0``) they sync the lr-weighted sum of their updates with one compressed all-reduce;
their parameters differ between syncs. All schedule tests use DeepSpeed's call index ``t = s + 1``
for onebit's step ``s``. One case: ``single_tensor``, a :class:`SingleTensorModel` of 16 x 36 = 576
elements (a multiple of 16, 24 and 72: padded by neither library at n = 2 and 3), on 1, 2 and 3 ranks
(at n = 1 DeepSpeed runs with no communication at all and, on phase-A steps that do not update the
variance, ignores the gradient: its defect Q2, recorded here by data). The file (about 0.6 MB) holds,
with ``optimizer``, the hyperparameters (DeepSpeed's own arguments, ``steps`` and ``batch``) and the
versions, under ``runs[n]``: ``spec``, ``names``, ``initial``, ``inputs`` / ``targets`` as above;
``trajectories`` (``{name: [n, steps, *shape]}``: every rank's parameters after onebit-step ``1..steps``,
so ``trajectories[name][r]`` is rank ``r``'s trajectory); ``backward_allreduce`` (``[steps]`` bool: the
flag each call's gradients were averaged under, the same on every rank); ``kinds`` (``[steps]`` str,
onebit's numbering: ``"variance"`` (v and m updated with the averaged gradient), ``"onebit_gradient"``
(m updated with the compressed mean of the local gradients; at n = 1 not updated at all), ``"local"``,
``"sync"``), derived in each rank from DeepSpeed's state before the call, exactly as its ``step()``
decides (``freeze_key``, ``step + 1`` modulo ``var_interval`` or ``local_step_interval``), and checked
equal on every rank; per rank and step (``[n, steps]``), DeepSpeed's schedule state after the call:
``var_interval``, ``var_counter``, ``local_step_interval``, ``local_step_counter`` (int64), ``lrs``
(float64), and whether the call changed ``exp_avg_sq`` and ``exp_avg`` (``v_changed``, ``m_changed``,
bool); and ``max_rank_difference`` (``[steps]`` float64: max over ranks and elements of
``|p_r - p_0|``, divided by ``max |p_0|``; 0 in phase A, small right after a sync).

The model and data builders below import no DeepSpeed, so that the tests can import them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

DATA_DIR = Path(__file__).resolve().parent.parent / "tests" / "data"
DEFAULT_OUT = DATA_DIR / "deepspeed_onebitadam.pt"
DEFAULT_LAMB_OUT = DATA_DIR / "deepspeed_onebitlamb.pt"
DEFAULT_ZOADAM_OUT = DATA_DIR / "deepspeed_zerooneadam.pt"

HYPERPARAMETERS = dict(lr=5e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, freeze_step=4, steps=12, batch=8)
# OnebitLamb's own arguments (DeepSpeed's defaults; max_coeff/min_coeff per group, the rest optimizer-wide).
LAMB_HYPERPARAMETERS = dict(HYPERPARAMETERS, max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0,
                            factor_min=0.5, factor_threshold=0.1)
LAMB_ARGUMENTS = ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min", "factor_threshold")
# ZeroOneAdam's: DeepSpeed's own arguments (no dry-run shift: phase A is onebit's steps 1..var_freeze_step).
# Small schedule settings so that 24 steps hold every kind of step: v updates at calls 2, 3, 4, 6, 8, 12,
# 1-bit gradient steps at calls 5, 7, 9, 10, 11, 13, syncs at calls 14, 15, 16, 18, 20, 24.
ZOADAM_HYPERPARAMETERS = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, var_freeze_step=12,
                              var_update_scaler=2, local_step_scaler=3, local_step_clipper=4, steps=24, batch=8)
ZOADAM_ARGUMENTS = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
ZOADAM_SCHEDULE_KEYS = ("var_interval", "var_counter", "local_step_interval", "local_step_counter", "lrs")
RANK_TIMEOUT_S = 600  # hard limit on a recording's rank processes

# Per world size: all tensor sizes need the same padding under DeepSpeed's and onebit's rules.
SPECS = {
    2: dict(d_in=45, hidden=50, d_out=3, out_bias=True, extra=37),  # 2250, 50, 150, 3, 37
    3: dict(d_in=36, hidden=72, d_out=3, out_bias=False, extra=144),  # 2592, 72, 216, 144
}
# One weight matrix of 72 x 36 = 2592 elements: a multiple of 16 and of 72, padded by neither library.
SINGLE_TENSOR_SPECS = {
    2: dict(d_in=36, d_out=72),
    3: dict(d_in=36, d_out=72),
}
# ZeroOneAdam's single tensor: 16 x 36 = 576 elements, a multiple of 16, 24 and 72 (no padding at n = 2, 3).
ZOADAM_SPECS = {n: dict(d_in=36, d_out=16) for n in (1, 2, 3)}
MODEL_SEED = 1234
DRY_RUN_STEP = 0  # the batch of DeepSpeed's discarded first call


class ParityModel(torch.nn.Module):
    """``fc2(tanh(fc1(x))) + z @ extra``: two Linear layers and one odd-sized vector parameter."""

    def __init__(self, d_in: int, hidden: int, d_out: int, out_bias: bool, extra: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, d_out, bias=out_bias)
        self.extra = torch.nn.Parameter(0.1 * torch.randn(extra))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + (z @ self.extra)[:, None]


class SingleTensorModel(torch.nn.Module):
    """``tanh(x @ W.T)``: one weight matrix (a Linear without bias), nothing else."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


# The recorded cases: their model and, per world size, its keyword arguments. Adam records
# "several_tensors" only (its file holds runs[n]); LAMB records both (runs[case][n]).
CASES = {
    "single_tensor": (SingleTensorModel, SINGLE_TENSOR_SPECS),
    "several_tensors": (ParityModel, SPECS),
}

# The stacked data's keys, in make_batch's order (the model's inputs, then the target).
DATA_KEYS = {SingleTensorModel: ("inputs", "targets"), ParityModel: ("inputs", "extra_inputs", "targets")}


def _case(optimizer: str, case: str) -> tuple[type, dict]:
    """The model class and per-world-size specs of ``optimizer``'s ``case``."""
    return (SingleTensorModel, ZOADAM_SPECS) if optimizer == "zoadam" else CASES[case]


def _hyperparameters(optimizer: str) -> dict:
    return {"adam": HYPERPARAMETERS, "lamb": LAMB_HYPERPARAMETERS, "zoadam": ZOADAM_HYPERPARAMETERS}[optimizer]


def build_model(spec: dict, model_class: type = ParityModel) -> torch.nn.Module:
    torch.manual_seed(MODEL_SEED)
    return model_class(**spec)


def make_batch(spec: dict, batch: int, rank: int, step: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s batch of onebit-step ``step``: the model's inputs (``x``, and ``z`` when the
    spec has ``extra``), then the target."""
    gen = torch.Generator().manual_seed(7919 * step + 31 * rank + 5)
    x = torch.randn(batch, spec["d_in"], generator=gen)
    z = (torch.randn(batch, spec["extra"], generator=gen),) if "extra" in spec else ()
    y = torch.randn(batch, spec["d_out"], generator=gen)
    return (x, *z, y)


def make_data(spec: dict, world_size: int, steps: int, batch: int,
              model_class: type = ParityModel) -> dict[str, torch.Tensor]:
    """Every rank's batches of onebit-steps ``1..steps``, stacked ``[steps, world_size, batch, ...]``."""
    batches = [[make_batch(spec, batch, r, t) for r in range(world_size)] for t in range(1, steps + 1)]
    stack = lambda i: torch.stack([torch.stack([b[i] for b in row]) for row in batches])  # noqa: E731
    return {key: stack(i) for i, key in enumerate(DATA_KEYS[model_class])}


def backward(model: torch.nn.Module, *batch: torch.Tensor) -> None:
    """The gradient of the MSE loss of ``model(*inputs)`` against the target (``batch[-1]``)."""
    model.zero_grad(set_to_none=False)
    torch.nn.functional.mse_loss(model(*batch[:-1]), batch[-1]).backward()


# ----------------------------------------------------------------- DeepSpeed side (its venv only)


class _NumpyPackbits:
    """Stand-in for DeepSpeed's XPU packbits op, with its semantics (see the module docstring)."""

    @staticmethod
    def packbits(tensor: torch.Tensor, input_size: int, rank: int) -> torch.Tensor:
        import numpy as np

        keep = ~np.signbit(tensor.detach().reshape(-1)[:input_size].numpy())
        return torch.from_numpy(np.packbits(keep))

    @staticmethod
    def unpackbits(tensor: torch.Tensor, input_size: int, rank: int) -> torch.Tensor:
        import numpy as np

        bits = np.unpackbits(tensor.reshape(-1)[:input_size].numpy())
        return torch.from_numpy(bits.astype(np.float32) * 2.0 - 1.0)


class _NumpyPackbitsBuilder:
    def load(self) -> _NumpyPackbits:
        return _NumpyPackbits()


def _patch_deepspeed() -> None:
    import deepspeed.comm as ds_comm
    import deepspeed.runtime.comm.compressed as compressed

    compressed.PackbitsBuilder = _NumpyPackbitsBuilder
    all_gather = ds_comm.all_gather
    if getattr(all_gather, "_onebit_reference_patch", False):
        return

    def all_gather_1d(tensor_list, tensor, *args, **kwargs):
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        return all_gather(tensor_list, tensor, *args, **kwargs)

    all_gather_1d._onebit_reference_patch = True
    ds_comm.all_gather = all_gather_1d


def _make_optimizer(optimizer: str, params: list[torch.Tensor], engine: SimpleNamespace) -> torch.optim.Optimizer:
    """DeepSpeed's optimizer, with ``freeze_step = F + 1`` for onebit's ``F`` (its dry-run call); ZeroOneAdam
    with its arguments as they are."""
    if optimizer == "zoadam":
        from deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam

        h = ZOADAM_HYPERPARAMETERS
        return ZeroOneAdam(params, deepspeed=engine, lr=h["lr"], betas=h["betas"], eps=h["eps"],
                           weight_decay=h["weight_decay"], cuda_aware=False, comm_backend_name="compressed",
                           **{k: h[k] for k in ZOADAM_ARGUMENTS})
    if optimizer == "adam":
        from deepspeed.runtime.fp16.onebit.adam import OnebitAdam

        h = HYPERPARAMETERS
        return OnebitAdam(params, deepspeed=engine, lr=h["lr"], freeze_step=h["freeze_step"] + 1, betas=h["betas"],
                          eps=h["eps"], weight_decay=h["weight_decay"], cuda_aware=False,
                          comm_backend_name="compressed")
    from deepspeed.runtime.fp16.onebit.lamb import OnebitLamb

    h = LAMB_HYPERPARAMETERS
    return OnebitLamb(params, deepspeed=engine, lr=h["lr"], freeze_step=h["freeze_step"] + 1, betas=h["betas"],
                      eps=h["eps"], weight_decay=h["weight_decay"], cuda_aware=False, comm_backend_name="compressed",
                      **{k: h[k] for k in LAMB_ARGUMENTS})


def _lamb_statistics(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, list[float]]:
    """OnebitLamb's per-tensor coefficients after a call (``scaling_coeff`` NaN until it exists)."""
    return {
        "lamb_coeffs": opt.get_lamb_coeffs(),
        "lamb_coeff_freeze": [opt.state[p]["lamb_coeff_freeze"] for p in params],
        "last_factor": [opt.state[p]["last_factor"] for p in params],
        "scaling_coeff": [opt.state[p].get("scaling_coeff", float("nan")) for p in params],
    }


def _zoadam_kind(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> str:
    """The kind of ZeroOneAdam's coming call, decided as its ``step()`` decides, from its state now."""
    state = opt.state[params[0]]
    t = state["step"] + 1
    if not opt.freeze_key:
        return "variance" if t % state["var_interval"] == 0 else "onebit_gradient"
    return "sync" if t % state["local_step_interval"] == 0 else "local"


def _run_rank(rank: int, world_size: int, store: str, out_dir: str, optimizer: str, case: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        import deepspeed
        import deepspeed.comm as ds_comm

        ds_comm.init_distributed(dist_backend="gloo")  # wraps the process group made above
        _patch_deepspeed()
        h = _hyperparameters(optimizer)
        model_class, specs = _case(optimizer, case)
        spec = specs[world_size]
        model = build_model(spec, model_class)
        params = list(model.parameters())
        engine = SimpleNamespace(mpu=None, local_rank=rank, enable_backward_allreduce=True)
        opt = _make_optimizer(optimizer, params, engine)
        snapshots, flags, statistics = [], [], []
        for call in range(1, h["steps"] + 2):
            step = DRY_RUN_STEP if call == 1 else call - 1
            backward(model, *make_batch(spec, h["batch"], rank, step))
            flag = engine.enable_backward_allreduce  # set by the optimizer's previous call
            if flag:  # the engine's default gradient averaging: SUM, then scale by 1/n
                for p in params:
                    dist.all_reduce(p.grad)
                    p.grad.mul_(1.0 / world_size)
            if optimizer == "zoadam" and call > 1:
                kind = _zoadam_kind(opt, params)
                before = [opt.state[params[0]][key].clone() for key in ("exp_avg_sq", "exp_avg")]
            opt.step()
            if call > 1:
                snapshots.append({name: p.detach().clone() for name, p in model.named_parameters()})
                flags.append(flag)
                if optimizer == "lamb":
                    statistics.append(_lamb_statistics(opt, params))
                if optimizer == "zoadam":
                    state = opt.state[params[0]]
                    statistics.append({"kind": kind, **{key: state[key] for key in ZOADAM_SCHEDULE_KEYS},
                                       "v_changed": not torch.equal(before[0], state["exp_avg_sq"]),
                                       "m_changed": not torch.equal(before[1], state["exp_avg"])})
        torch.save({"snapshots": snapshots, "flags": flags, "statistics": statistics,
                    "deepspeed": deepspeed.__version__}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(world_size: int, store: str, out_dir: str, optimizer: str, case: str) -> None:
    """The ranks, each killed if all have not finished within ``RANK_TIMEOUT_S``."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_run_rank, args=(world_size, store, out_dir, optimizer, case), nprocs=world_size,
                                 start_method="spawn", join=False)
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{optimizer} {case} n={world_size}: ranks still running after {RANK_TIMEOUT_S} s")


def record(world_size: int, optimizer: str = "adam", case: str = "several_tensors") -> dict:
    h = _hyperparameters(optimizer)
    model_class, specs = _case(optimizer, case)
    spec = specs[world_size]
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(world_size, str(Path(tmp) / "store"), tmp, optimizer, case)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world_size)]
    model = build_model(spec, model_class)
    names = [name for name, _ in model.named_parameters()]
    snapshots = ranks[0]["snapshots"]
    if optimizer == "zoadam":
        return _zoadam_run(world_size, spec, model, names, ranks)
    difference = max(float((r["snapshots"][t][k] - snapshots[t][k]).abs().max())
                     for r in ranks for t in range(h["steps"]) for k in names)
    run = {
        "deepspeed": ranks[0]["deepspeed"],
        "spec": dict(spec),
        "names": names,
        "initial": {name: p.detach().clone() for name, p in model.named_parameters()},
        **make_data(spec, world_size, h["steps"], h["batch"], model_class),
        "trajectory": {k: torch.stack([s[k] for s in snapshots]) for k in names},
        "backward_allreduce": ranks[0]["flags"],
        "max_rank_difference": difference,
    }
    if optimizer == "lamb":
        per_rank = [{key: torch.tensor([s[key] for s in r["statistics"]], dtype=torch.float64)
                     for key in ("lamb_coeffs", "lamb_coeff_freeze", "last_factor", "scaling_coeff")} for r in ranks]
        for r, statistics in enumerate(per_rank[1:], 1):  # the coefficients too are the same on every rank
            for key, value in statistics.items():
                if not torch.allclose(value, per_rank[0][key], rtol=0, atol=0, equal_nan=True):
                    raise RuntimeError(f"{case} n={world_size}: rank {r}'s {key} differs from rank 0's")
        run.update({key: per_rank[0][key] for key in ("lamb_coeffs", "lamb_coeff_freeze", "last_factor")})
        run["scaling_coeff"] = per_rank[0]["scaling_coeff"][-1]
    return run


def _zoadam_run(world_size: int, spec: dict, model: torch.nn.Module, names: list[str], ranks: list[dict]) -> dict:
    """ZeroOneAdam's run: every rank's trajectory, the flags, the step kinds and the schedule state."""
    h = ZOADAM_HYPERPARAMETERS
    for r, rank in enumerate(ranks[1:], 1):  # the engine flags and the schedule are the same on every rank
        if rank["flags"] != ranks[0]["flags"] or [s["kind"] for s in rank["statistics"]] != \
                [s["kind"] for s in ranks[0]["statistics"]]:
            raise RuntimeError(f"zoadam n={world_size}: rank {r}'s flags or step kinds differ from rank 0's")
    trajectories = {k: torch.stack([torch.stack([s[k] for s in rank["snapshots"]]) for rank in ranks]) for k in names}
    difference = torch.zeros(h["steps"], dtype=torch.float64)
    for k, traj in trajectories.items():  # [n, steps, ...]
        scale = traj[0].reshape(h["steps"], -1).abs().amax(dim=1).double()
        spread = (traj - traj[0]).reshape(world_size, h["steps"], -1).abs().amax(dim=(0, 2)).double()
        difference = torch.maximum(difference, spread / scale)
    dtypes = {"lrs": torch.float64, "v_changed": torch.bool, "m_changed": torch.bool}
    return {
        "deepspeed": ranks[0]["deepspeed"],
        "spec": dict(spec),
        "names": names,
        "initial": {name: p.detach().clone() for name, p in model.named_parameters()},
        **make_data(spec, world_size, h["steps"], h["batch"], SingleTensorModel),
        "trajectories": trajectories,
        "backward_allreduce": ranks[0]["flags"],
        "kinds": [s["kind"] for s in ranks[0]["statistics"]],
        **{key: torch.tensor([[s[key] for s in rank["statistics"]] for rank in ranks],
                             dtype=dtypes.get(key, torch.int64))
           for key in (*ZOADAM_SCHEDULE_KEYS, "v_changed", "m_changed")},
        "max_rank_difference": difference,
    }


def _zoadam_summary(n: int, run: dict) -> str:
    kinds = run["kinds"]
    syncs = [t for t, kind in enumerate(kinds) if kind == "sync"]
    after_sync = float(run["max_rank_difference"][syncs].max()) if n > 1 else 0.0
    between = max((float(run["max_rank_difference"][t]) for t, kind in enumerate(kinds) if kind == "local"),
                  default=0.0)
    short = {"variance": "V", "onebit_gradient": "G", "local": "L", "sync": "S"}
    return (f"n={n}: kinds (onebit steps 1..{len(kinds)}) {''.join(short[k] for k in kinds)}; flags "
            f"{''.join('T' if f else 'F' for f in run['backward_allreduce'])}; v changed at steps "
            f"{[t + 1 for t in range(len(kinds)) if run['v_changed'][0, t]]}; m unchanged at steps "
            f"{[t + 1 for t in range(len(kinds)) if not run['m_changed'][0, t]]}; relative cross-rank difference: "
            f"after syncs max {after_sync:.3g}, after local steps max {between:.3g}")


def _check_lamb(case: str, n: int, run: dict) -> None:
    """Refuse a warmup coefficient of exactly 1.0 (it skips DeepSpeed's moving average); note clamps."""
    h = LAMB_HYPERPARAMETERS
    warmup = run["lamb_coeffs"][:h["freeze_step"]]
    if (warmup == 1.0).any():
        raise RuntimeError(f"{case} n={n}: a warmup lamb coefficient is exactly 1.0 (a zero norm or a clamp "
                           f"landing on 1.0); DeepSpeed then skips its moving average and onebit does not:\n{warmup}")
    clamped = ((warmup == h["min_coeff"]) | (warmup == h["max_coeff"])).nonzero().tolist()
    if clamped:
        print(f"{case} n={n}: warmup coefficients clamped to min_coeff/max_coeff at (step - 1, tensor) {clamped}")


def _summary(n: int, run: dict) -> str:
    return (f"n={n}: {sum(p.numel() for p in run['initial'].values())} parameters "
            f"{[p.numel() for p in run['initial'].values()]}, warmup flags {run['backward_allreduce']}, "
            f"max rank difference {run['max_rank_difference']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("adam", "lamb", "zoadam"), default="adam")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"default: {DEFAULT_OUT} (adam), {DEFAULT_LAMB_OUT} (lamb), {DEFAULT_ZOADAM_OUT} (zoadam)")
    args = parser.parse_args(argv)
    if args.optimizer == "adam":
        out = args.out or DEFAULT_OUT
        h = HYPERPARAMETERS
        runs = {n: record(n) for n in SPECS}
        result = {
            "format": 1,
            "deepspeed_version": runs[2]["deepspeed"],
            "torch_version": torch.__version__,
            "hyperparameters": {**h, "deepspeed_freeze_step": h["freeze_step"] + 1, "bias_correction": False},
            "runs": {n: {k: v for k, v in run.items() if k != "deepspeed"} for n, run in runs.items()},
        }
        for n, run in runs.items():
            print(_summary(n, run))
    elif args.optimizer == "zoadam":
        out = args.out or DEFAULT_ZOADAM_OUT
        runs = {n: record(n, "zoadam", "single_tensor") for n in ZOADAM_SPECS}
        result = {
            "format": 1,
            "optimizer": "ZeroOneAdam",
            "deepspeed_version": runs[2]["deepspeed"],
            "torch_version": torch.__version__,
            "hyperparameters": {**ZOADAM_HYPERPARAMETERS, "bias_correction": False},
            "runs": {n: {k: v for k, v in run.items() if k != "deepspeed"} for n, run in runs.items()},
        }
        for n, run in runs.items():
            print(_zoadam_summary(n, run))
    else:
        out = args.out or DEFAULT_LAMB_OUT
        h = LAMB_HYPERPARAMETERS
        runs = {case: {n: record(n, "lamb", case) for n in specs} for case, (_, specs) in CASES.items()}
        for case, by_n in runs.items():
            for n, run in by_n.items():
                _check_lamb(case, n, run)
        result = {
            "format": 1,
            "optimizer": "OnebitLamb",
            "deepspeed_version": runs["single_tensor"][2]["deepspeed"],
            "torch_version": torch.__version__,
            "hyperparameters": {**h, "deepspeed_freeze_step": h["freeze_step"] + 1, "bias_correction": False},
            "runs": {case: {n: {k: v for k, v in run.items() if k != "deepspeed"} for n, run in by_n.items()}
                     for case, by_n in runs.items()},
        }
        for case, by_n in runs.items():
            for n, run in by_n.items():
                print(f"{case} {_summary(n, run)}; scaling_coeff {run['scaling_coeff'].tolist()}")
                for key in ("lamb_coeffs", "lamb_coeff_freeze", "last_factor"):
                    print(f"  {key} per step (rows) and tensor:\n{run[key].numpy()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
