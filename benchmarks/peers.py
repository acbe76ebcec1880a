"""One rank of the peer benchmark; started by ``benchmarks/slowlink.py`` (not meant to be run by hand).

``--mode steps``: every configuration below is built once (its own copy of the model), warmed up,
then run one step at a time, **interleaved** (round ``r`` runs every configuration once, in an
order rotated by ``r``), so that a change of load on the machine hits every configuration alike:

* ``adam``: ``DistributedDataParallel`` + ``torch.optim.Adam``;
* ``powersgd1`` / ``powersgd4``: DDP + the PowerSGD comm hook (rank 1 / 4, ``start_powerSGD_iter=2``)
  + Adam;
* ``onebit_warmup``: ``OnebitAdam`` in its warmup phase (it all-reduces the gradients itself);
* ``onebit_compression``: ``OnebitAdam`` in its compression phase (``kernels='auto'``);
* ``onebit_warmup_bf16`` (optional): the warmup with ``reduce_dtype=torch.bfloat16`` (half the bytes);
* ``onebit_compression_momentum`` (optional): the same with ``compression_space="momentum"``
  (DeepSpeed's numerics; the default before 2026-11-26);
* ``onebit_ddp_compression`` (optional): DDP + ``attach_ddp`` + OnebitAdam in compression;
* ``onebit_ddp_nosync_compression`` (optional): the same, with backward run under
  ``ddp.no_sync()`` in the compression phase (DDP then neither copies nor hooks the gradients);
* ``onebit_warmup_overlap``, ``onebit_compression_overlap`` (optional): the same two with
  ``overlap_backward=True`` (communication started from gradient hooks during backward);
* ``onebit_ddp_view_compression`` (optional): DDP with ``gradient_as_bucket_view=True`` +
  ``attach_ddp`` (the gradients live in DDP's buckets, so there is nothing to copy back);
* ``diloco`` (optional): ``OnebitDiLoCo`` (``sync_every`` 4), timing an inner step
  (``diloco_inner``: no communication) and an outer step (``diloco_outer``) per round;
* ``zoadam_phase1``, ``zoadam_compressed_gradient``, ``zoadam_phase2``: ``ZeroOneAdam`` (0/1 Adam),
  each timing one or two kinds of step per round (``ZOADAM_PARTS``), recorded under their own
  names: ``zoadam_variance`` (full-precision gradient all-reduce) and, right after it,
  ``zoadam_compressed_gradient_after_variance`` (1-bit gradient all-reduce; after a variance step
  it also rebuilds the frozen-coordinate mask and the denominator, as ``v`` changed);
  ``zoadam_compressed_gradient`` (the same after another such step); ``zoadam_local`` (no
  communication) and, right after it, ``zoadam_sync`` (1-bit all-reduce of the accumulated
  update). Each has a schedule in which its kinds recur (``zoadam_schedule``); before each timed
  step it takes untimed steps until the next one is of the kind wanted (plans come from the step
  number, so every rank takes the same ones). ``slowlink.py`` weights them by a real schedule.

Each step is timed from a barrier to the end of ``optimizer.step()``, split into forward+backward
(which includes DDP's overlapped all-reduce) and the optimizer step. When ``ONEBIT_BENCH_IFNAME``
names this rank's interface, its sysfs counters are read before and after every step. For
``onebit_compression`` the codec calls and the optimizer's element-wise maths are timed by
wrapping them (this reaches into ``OnebitAdam``'s private ``_kernels`` and ``_gather_grads``: a
benchmark may, the library must not).

``--mode scaling``: collectives and bytes per compression step for models of ``--tensors`` tensors.

Rank, world size and the rendezvous come from the environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``); each rank writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit import OnebitAdam, OnebitDiLoCo, ZeroOneAdam
from onebit.estimate import measure_local_costs
from onebit.integrations import attach_ddp

DEFAULT_CONFIGS = ("adam", "powersgd1", "powersgd4", "onebit_warmup", "onebit_compression")
ONEBIT_DDP_CONFIGS = ("onebit_ddp_compression", "onebit_ddp_nosync_compression", "onebit_ddp_view_compression")
#: ZeroOneAdam configurations: the steps each times in a round, in order: (the name its times are
#: recorded under, the kind of step, the kind the step before it must be).
ZOADAM_PARTS = {
    "zoadam_phase1": (("zoadam_variance", "variance", "compressed_gradient"),
                      ("zoadam_compressed_gradient_after_variance", "compressed_gradient", "variance")),
    "zoadam_compressed_gradient": (("zoadam_compressed_gradient", "compressed_gradient", "compressed_gradient"),),
    "zoadam_phase2": (("zoadam_local", "local", "sync"), ("zoadam_sync", "sync", "local")),
}
ZOADAM_CONFIGS = tuple(ZOADAM_PARTS)
DEFAULT_CONFIGS += ZOADAM_CONFIGS
#: OnebitDiLoCo (optional, sync_every 4): an inner step (no communication) and an outer step (the
#: inner step and the 1-bit all-reduce of the pseudo-gradient), as ZeroOneAdam's parts are timed.
LOCAL_STEP_PARTS = {"diloco": (("diloco_inner", "inner", "inner"), ("diloco_outer", "outer", "inner"))}
# The same with overlap_backward=True (phase 2 starts nothing during backward: not repeated).
for _name in ("zoadam_phase1", "zoadam_compressed_gradient"):
    ZOADAM_PARTS[_name + "_overlap"] = tuple((part + "_overlap", kind, before) for part, kind, before in ZOADAM_PARTS[_name])
OVERLAP_CONFIGS = ("onebit_warmup_overlap", "onebit_compression_overlap", "zoadam_phase1_overlap",
                   "zoadam_compressed_gradient_overlap")
ALL_CONFIGS = (DEFAULT_CONFIGS + ONEBIT_DDP_CONFIGS + OVERLAP_CONFIGS + ("onebit_compression_momentum", "onebit_warmup_bf16")
               + tuple(LOCAL_STEP_PARTS))
COUNTER_FIELDS = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")


def make_model(params: float, width: int, seed: int = 0) -> torch.nn.Module:
    """A stack of square Linear + ReLU layers with about ``params`` parameters."""
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks[:-1])


def _counters() -> dict[str, int] | None:
    ifname = os.environ.get("ONEBIT_BENCH_IFNAME")
    if not ifname:
        return None
    base = Path("/sys/class/net") / ifname / "statistics"
    return {f: int((base / f).read_text()) for f in COUNTER_FIELDS}


class _Timers:
    """Accumulates seconds by label for the step being timed (``OnebitOptimizer.register_timer``)."""

    def __init__(self) -> None:
        self.active: dict[str, float] | None = None

    def __call__(self, label: str, seconds: float) -> None:
        if self.active is not None:
            self.active[label] = self.active.get(label, 0.0) + seconds


TIMERS = _Timers()


def serialized_powersgd_hook(state, bucket):  # unannotated: DDP checks the annotations at run time
    """``powerSGD_hook``, waited for before the next bucket's hook runs. The hook issues its later
    all-reduces from the callbacks of earlier ones (on gloo's threads), while autograd's thread
    goes on issuing the next bucket's: on gloo the ranks can then enqueue collectives in different
    orders and fail ("Received data size doesn't match expected size"). Waiting per bucket keeps
    the order, at the cost of PowerSGD's (small) overlap of communication with backward."""
    fut = powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def zoadam_schedule(name: str, repeats: int) -> dict[str, int]:
    """ZeroOneAdam's schedule for configuration ``name``, in which its kinds of step recur for the
    ``repeats`` rounds it times (warmup + rounds):

    * phase1: ``var_update_scaler`` ``repeats``: ``repeats`` variance steps, then variance and
      compressed_gradient steps alternate for ``2 * repeats`` steps;
    * compressed_gradient: ``var_update_scaler`` 1: variance only at steps ``2**k - 1``;
    * phase2: ``var_freeze_step`` 1, sync interval 2 from step 3 on: local and sync alternate.
    """
    never = 10**9
    name = name.removesuffix("_overlap")
    return {
        "zoadam_phase1": dict(var_freeze_step=never, var_update_scaler=max(1, repeats)),
        "zoadam_compressed_gradient": dict(var_freeze_step=never, var_update_scaler=1),
        "zoadam_phase2": dict(var_freeze_step=1, local_step_scaler=1, local_step_clipper=2),
    }[name]


class Config:
    def __init__(self, name: str, args: argparse.Namespace, seed: int) -> None:
        self.name = name
        self.model = make_model(args.params, args.width, seed)
        self.onebit = name.startswith(("onebit", "zoadam", "diloco"))
        buckets = {} if args.bucket_size is None else {"bucket_size": args.bucket_size}
        self.forward = self.model
        # (record name, kind, kind before) of each step timed per round; kinds None: any step
        self.parts = ZOADAM_PARTS.get(name) or LOCAL_STEP_PARTS.get(name) or ((name, None, None),)
        self.last_kind: str | None = None
        self.untimed_steps = 0
        if name == "adam" or name.startswith("powersgd"):
            self.forward = DDP(self.model)
            if name.startswith("powersgd"):
                state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(name[-1]),
                                               start_powerSGD_iter=2, random_seed=0)
                self.forward.register_comm_hook(state, serialized_powersgd_hook)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        elif name in ("onebit_warmup", "onebit_warmup_overlap", "onebit_warmup_bf16"):
            self.optimizer = OnebitAdam(self.model.parameters(), lr=1e-5, freeze_step=10**9, comm_backend_name="gloo",
                                        overlap_backward=name.endswith("_overlap"), **buckets,
                                        reduce_dtype=torch.bfloat16 if name.endswith("_bf16") else None)
        elif name in ("onebit_compression", "onebit_compression_overlap", *ONEBIT_DDP_CONFIGS):
            self.optimizer = OnebitAdam(self.model.parameters(), lr=1e-5, freeze_step=2, comm_backend_name="gloo",
                                        kernels=args.kernels, overlap_backward=name.endswith("_overlap"), **buckets)
            if name in ONEBIT_DDP_CONFIGS:
                self.forward = DDP(self.model, gradient_as_bucket_view=name == "onebit_ddp_view_compression")
                attach_ddp(self.forward, self.optimizer)
                self.no_sync = name == "onebit_ddp_nosync_compression"
            else:
                self.optimizer.register_timer(TIMERS)
        elif name == "onebit_compression_momentum":
            self.optimizer = OnebitAdam(self.model.parameters(), lr=1e-5, freeze_step=2, comm_backend_name="gloo",
                                        kernels=args.kernels, compression_space="momentum", **buckets)
        elif name in ZOADAM_PARTS:
            self.optimizer = ZeroOneAdam(self.model.parameters(), lr=1e-5, comm_backend_name="gloo",
                                         kernels=args.kernels, overlap_backward=name.endswith("_overlap"), **buckets,
                                         **zoadam_schedule(name, args.warmup_steps + args.rounds))
        elif name in LOCAL_STEP_PARTS:
            self.optimizer = OnebitDiLoCo(self.model.parameters(), lr=1e-5, sync_every=4, comm_backend_name="gloo",
                                          kernels=args.kernels, **buckets)
        else:
            raise ValueError(f"unknown configuration {name!r}; expected one of {', '.join(ALL_CONFIGS)}")
        self.records: dict[str, list[dict]] = {part: [] for part, _, _ in self.parts}

    def _sync_context(self):
        if getattr(self, "no_sync", False) and self.optimizer.phase == "compression":
            return self.forward.no_sync()
        return contextlib.nullcontext()

    def _advance(self, x: torch.Tensor, kind: str | None, before: str | None) -> None:
        """Untimed steps until the next one is a ``kind`` step after a ``before`` step (the same
        steps on every rank: plans come from the step number)."""
        if kind is None:
            return
        for taken in range(10_001):
            if self.optimizer.next_plan.name == kind and self.last_kind == before:
                return
            if taken == 10_000:
                raise RuntimeError(f"{self.name}: no {kind} step after a {before} step in 10,000 steps")
            self.last_kind = self.optimizer.next_plan.name
            self.optimizer.zero_grad()
            self.forward(x).square().mean().backward()
            self.optimizer.step()
            self.untimed_steps += 1

    def step(self, x: torch.Tensor, record: bool) -> None:
        """One timed step of each part (one, or two for some ZeroOneAdam configurations)."""
        for part, kind, before in self.parts:
            self._advance(x, kind, before)
            self._timed_step(x, self.records[part] if record else None)

    def _timed_step(self, x: torch.Tensor, records: list[dict] | None) -> None:
        kind = self.optimizer.next_plan.name if self.onebit else None
        dist.barrier()
        before = _counters()
        timers: dict[str, float] = {}
        TIMERS.active = timers if self.name == "onebit_compression" else None
        start, cpu_start = time.perf_counter(), time.process_time()
        self.optimizer.zero_grad()
        with self._sync_context():
            self.forward(x).square().mean().backward()
        middle = time.perf_counter()
        self.optimizer.step()
        end, cpu_end = time.perf_counter(), time.process_time()
        TIMERS.active = None
        after = _counters()
        previous, self.last_kind = self.last_kind, kind
        if records is None:
            return
        row = {"step_s": end - start, "fwd_bwd_s": middle - start, "opt_s": end - middle, "cpu_s": cpu_end - cpu_start,
               "profile": timers}
        if before is not None:
            row["link"] = {f: after[f] - before[f] for f in COUNTER_FIELDS}
        if self.onebit:
            stats = self.optimizer.comm_stats()
            row["phase"] = stats["phase"]
            row["onebit"] = stats["last_step"]
            row["kind"], row["after"] = kind, previous
        records.append(row)


def _measure_costs(args: argparse.Namespace, numel: int, world: int) -> dict:
    """What ``onebit.estimate`` measures on this machine, measured by every rank at once, between
    rounds: the cores and the memory bus are shared as they are during the steps."""
    dist.barrier()
    costs = measure_local_costs(numel, world, repeats=1, kernels=args.kernels).as_dict()
    dist.barrier()
    return costs


def run_steps(args: argparse.Namespace, rank: int, world: int) -> dict:
    numel = sum(p.numel() for p in make_model(args.params, args.width).parameters())
    configs = [Config(name, args, seed=i) for i, name in enumerate(args.configs)]
    tensors = sum(1 for _ in configs[0].model.parameters())
    torch.manual_seed(1000 + rank)
    x = torch.randn(args.batch, args.width)
    started = time.perf_counter()
    for cfg in configs:
        for _ in range(args.warmup_steps):
            cfg.step(x, record=False)
    costs = []
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for cfg in order:
            cfg.step(x, record=True)
        if r < args.cost_rounds:
            costs.append(_measure_costs(args, numel, world))
    median = {k: statistics.median(c[k] for c in costs) for k in costs[0]} if costs else None
    buckets = {part: c.optimizer.num_buckets for c in configs if c.onebit for part in c.records}
    zoadam = {part: {"config": c.name, "kind": kind, "after": before, "untimed_steps_of_config": c.untimed_steps,
                     "schedule": zoadam_schedule(c.name, args.warmup_steps + args.rounds)}
              for c in configs if c.name in ZOADAM_PARTS for part, kind, before in c.parts}
    return {"rank": rank, "world_size": world, "numel": numel, "tensors": tensors, "batch": args.batch,
            "width": args.width, "rounds": args.rounds, "wall_s": time.perf_counter() - started,
            "buckets": buckets, "zoadam": zoadam, "local_costs": median, "local_costs_by_round": costs,
            "configs": {part: records for c in configs for part, records in c.records.items()}}


def run_scaling(args: argparse.Namespace, rank: int, world: int) -> dict:
    """One launch of ``max(worlds)`` ranks; each world size runs on a subgroup of the first ranks."""
    rows = []
    for size in args.worlds:
        group = dist.new_group(ranks=list(range(size)))  # every rank takes part in new_group
        if rank < size:
            for count in args.tensors:
                rows.append(_scaling_row(args, rank, size, group, count))
        dist.barrier()
    return {"rank": rank, "world_size": world, "rows": rows}


def _scaling_row(args: argparse.Namespace, rank: int, size: int, group, count: int) -> dict:
    numel = max(1, int(args.params) // count)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
    opt = OnebitAdam(params, lr=1e-5, freeze_step=1, comm_backend_name="gloo", group=group, kernels=args.kernels)
    torch.manual_seed(1000 + rank)
    steps = []
    for _ in range(3):  # one warmup step (with the first-step layout check), two compression steps
        for p in params:
            p.grad = torch.randn_like(p)
        phase = opt.phase
        opt.step()
        steps.append({"phase": phase, **opt.comm_stats()["last_step"]})
    return {"world_size": size, "tensors": count, "numel": numel * count, "buckets": opt.num_buckets,
            "steps": steps}


def _config_names(text: str) -> list[str]:
    names = []
    for name in text.split(","):
        names += ZOADAM_CONFIGS if name == "zoadam" else [name]
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("steps", "scaling"), default="steps")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--params", type=float, default=25.2e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--cost-rounds", type=int, default=5,
                        help="rounds after which the estimator's local costs are measured (median)")
    parser.add_argument("--configs", type=_config_names, default=list(DEFAULT_CONFIGS),
                        help="comma-separated configuration names; 'zoadam' stands for all of " + ", ".join(ZOADAM_CONFIGS))
    parser.add_argument("--tensors", type=lambda s: [int(v) for v in s.split(",")], default=[10, 1000])
    parser.add_argument("--worlds", type=lambda s: [int(v) for v in s.split(",")], default=[2, 3, 4],
                        help="scaling: world sizes (subgroups of the launched ranks)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--bucket-size", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        result = run_steps(args, rank, world) if args.mode == "steps" else run_scaling(args, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result["load_average_1min"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
