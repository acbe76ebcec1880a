"""overlap_backward=True on real gloo ranks (issue 26): the same numbers as without it, step for
step, for every plan of the three optimizers, however the training loop treats its gradients.

The oracle is the same optimizer without overlap, run in the same process on the same batches:
parameters and state must be bit-identical after every step. One launch per world size runs every
scenario for every optimizer (process start-up is most of a distributed test's time).
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import LogMessages, short_schedules
from distributed import run_ranks
from onebit import OnebitLamb
from onebit.integrations import attach_ddp

pytestmark = pytest.mark.slow

# (OnebitDiLoCo refuses overlap_backward: its inner steps send nothing to overlap)
SCHEDULES = {cls: schedule for cls, schedule in short_schedules().items() if cls.__name__ != "OnebitDiLoCo"}
STEPS = 12
NAN_STEPS = (2, 5, 9)  # a warmup (variance) step, a compressed one, and one of 0/1 Adam's phase 2
SCENARIOS = ("plain", "nan", "no_sync", "accumulate", "clip", "unused", "absent", "zero_grad", "preconditioned", "ddp",
             "bounded")


class _Net(torch.nn.Module):
    """Buckets of at most 40 elements, started in this order: [second.bias, side.weight, side.bias],
    [second.weight], [first.bias, mid.weight, mid.bias], [first.weight]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 16)
        self.mid = torch.nn.Linear(4, 4)  # unused on every rank on some steps of the "absent" scenario
        self.second = torch.nn.Linear(16, 3)
        self.side = torch.nn.Linear(6, 3)  # used on rank 0 only in the "unused" scenario

    def forward(self, x: torch.Tensor, side: bool = True, mid: bool = True) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if mid:
            h = h + torch.nn.functional.pad(self.mid(h[:, :4]), (0, 12))
        return self.second(h) + (self.side(x) if side else 0.0)


def _backward(model: _Net, rank: int, t: int, micro: int = 0, nan: bool = False, side: bool = True,
              mid: bool = True) -> None:
    gen = torch.Generator().manual_seed(1000 * t + 10 * micro + rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    if nan:
        x[0, 0] = float("nan")
    torch.nn.functional.mse_loss(model(x, side, mid), y).backward()


def _train(cls, rank: int, overlap: bool, scenario: str) -> tuple[list[list[torch.Tensor]], dict]:
    model = net = _Net()
    extra = dict(compression_space="preconditioned") if scenario == "preconditioned" else {}
    if scenario == "bounded":  # update_bound's clamp (in the codec's pass) on the staged input too
        extra = dict(compression_space="preconditioned", update_bound=0.05)
    opt = cls(model.parameters(), lr=1e-2, bucket_size=40, overlap_backward=overlap, **SCHEDULES[cls], **extra)
    if scenario == "ddp":  # accumulation the DDP way: ddp.no_sync() (attach_ddp makes it the optimizer's too)
        net = DDP(model)
        attach_ddp(net, opt)
    trajectory, started, sent = [], [], []
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        if scenario in ("no_sync", "accumulate", "ddp"):
            with opt.no_sync() if scenario == "no_sync" else net.no_sync() if scenario == "ddp" else contextlib.nullcontext():
                _backward(net, rank, t, micro=1)
            _backward(net, rank, t, micro=2)
        elif scenario == "zero_grad" and t % 4 == 0:  # a backward whose step never comes
            _backward(model, rank, t, micro=1)
            opt.zero_grad(set_to_none=True)
            _backward(model, rank, t, micro=2)
        else:
            _backward(model, rank, t, nan=scenario == "nan" and rank == 1 and t in NAN_STEPS,
                      side=scenario != "unused" or rank == 0, mid=scenario != "absent" or t % 3 != 0)
        if scenario == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        started.append(opt._overlap.started if overlap else 0)  # buckets started during this backward
        opt.step()
        sent.append(opt.comm_stats()["last_step"]["bytes_sent"])
        trajectory.append([p.detach().clone() for p in model.parameters()]
                          + [v.clone() for p in model.parameters() for v in opt.state[p].values()
                             if isinstance(v, torch.Tensor)]
                          + [e.clone() for pair in opt.compression_errors() for e in pair])
    stats = opt.comm_stats()
    return trajectory, {"started": started, "sent": sent, "steps": {k: stats[k]["steps"] for k in opt.PLAN_NAMES},
                        "skipped": sum(stats[k]["skipped_steps"] for k in opt.PLAN_NAMES),
                        "buckets": opt.num_buckets}


def _all_scenarios(rank: int, world_size: int) -> dict:
    out = {}
    for cls in SCHEDULES:
        for scenario in SCENARIOS:
            if scenario == "preconditioned" and cls is OnebitLamb:
                continue
            said = LogMessages(logging.WARNING)
            logger = logging.getLogger("onebit")
            logger.addHandler(said)
            try:
                plain, plain_info = _train(cls, rank, False, scenario)
                overlapped, info = _train(cls, rank, True, scenario)
            finally:
                logger.removeHandler(said)
            differ = [t + 1 for t, (a, b) in enumerate(zip(plain, overlapped))
                      if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b))]
            out[(cls.__name__, scenario)] = dict(differ=differ, info=info, plain_info=plain_info,
                                                 warned=any("changed between backward" in m for m in said.messages))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_overlap_is_bit_identical_for_every_plan_and_loop(tmp_path, world_size):
    results = run_ranks(_all_scenarios, world_size, tmp_path, timeout=600)
    for rank, result in enumerate(results):
        for (name, scenario), r in result.items():
            where = f"{name}, {scenario}, rank {rank} of {world_size}"
            assert r["differ"] == [], f"{where}: parameters/state/errors differ at steps {r['differ']}"
            assert r["info"]["steps"] == r["plain_info"]["steps"], where
            assert r["info"]["skipped"] == r["plain_info"]["skipped"], where
            if scenario == "nan":  # every rank skipped the steps with a NaN on rank 1
                assert r["info"]["skipped"] == len(NAN_STEPS), where
            # Every plan ran (0/1 Adam: variance, compressed gradient, local and sync steps).
            assert all(steps > 0 for steps in r["info"]["steps"].values()), where
            assert r["info"]["buckets"] == 4, where
            # The communication really started during backward (step 1 checks the layout first): every
            # bucket on the steps that start early, when every parameter had a gradient.
            started = r["info"]["started"]
            assert started[0] == 0, where
            early = [t for t in range(2, STEPS + 1) if name != "ZeroOneAdam" or t <= 5]
            if scenario in ("plain", "no_sync", "clip", "preconditioned", "bounded"):
                assert all(started[t - 1] == 4 for t in early), f"{where}: started {started}"
            if scenario == "ddp" and name != "ZeroOneAdam":  # warmup: DDP averages; compression: started early
                assert started[1:3] == [0, 0] and all(s == 4 for s in started[3:]), f"{where}: started {started}"
            if scenario == "absent":  # steps 3, 6, ...: mid has no gradient anywhere; its bucket and the next start in step()
                assert all(started[t - 1] == (2 if t % 3 == 0 else 4) for t in early), f"{where}: started {started}"
            if scenario == "unused" and rank == 1:
                # side's bucket (started first: last built) has no gradient here: nothing starts before step()
                assert max(started) == 0, f"{where}: started {started}"
            # What the step sent, counted for the step (backward's share too): the same bytes, but for
            # the vote on changed gradients (one more float in the finiteness flag, or a flag of its own).
            # (A skipped step sends what backward started: not compared.)
            if scenario in ("plain", "nan", "unused", "absent", "preconditioned"):
                extra = [a - b for t, (a, b) in enumerate(zip(r["info"]["sent"], r["plain_info"]["sent"]), 1)
                         if scenario != "nan" or t not in NAN_STEPS]
                assert all(0 <= e <= 8 for e in extra), f"{where}: bytes beyond the unoverlapped steps' {extra}"
            # Redone (and said) exactly when the loop changed gradients after their bucket started.
            assert r["warned"] == (scenario in ("accumulate", "clip", "zero_grad") and rank == 0), where
