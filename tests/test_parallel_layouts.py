"""onebit across the slow dimension of modern parallel layouts (issue 25), on 4 real gloo ranks.

One launch runs several checks (process start-up, and importing FSDP and tensor parallelism, is
most of a distributed test's time):

* HSDP, the recipe: FSDP2 over the "shard" dimension of a 2 x 2 mesh, onebit over "replicate".
  Warmup equals native HSDP (``fully_shard`` over the whole 2-D mesh) with ``torch.optim.AdamW``;
  after the switch the replicas' shards are bit-identical every step; the state is the shard's.
* A group that mixes different shards (FSDP over all 4 ranks, onebit over all 4) fails the
  layout check with the fix, on every rank.
* Tensor parallel x data parallel: ``parallelize_module`` over "tp", onebit over "dp"; warmup
  equals AdamW after a hand-written "dp" all-reduce; replicas bit-identical after the switch.
* Two pipeline stages (hand-written send/recv), one optimizer per stage over its stage's data-
  parallel group: no hang, warmup equals Adam on the whole model, replicas identical.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist

from conftest import LogMessages, tiny_mlp
from distributed import dcp_load, dcp_save, run_ranks
from onebit import (LocalBackend, OnebitAdam, OnebitLamb, ZeroOneAdam, load_compression_errors, save_checkpoint,
                    save_compression_errors)

pytestmark = pytest.mark.slow

LR = 1e-2
BETAS = (0.9, 0.999)
EPS = 1e-8
WD = 0.01
FREEZE = 4
STEPS = 9


def _mlp() -> torch.nn.Module:
    # 33 outputs: uneven shards (17 and 16 rows); Linear(33, 1): an empty shard on the second rank
    return tiny_mlp(16, 33, 1)


def _batch(rank: int, t: int, features: int = 16, outputs: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(8, features, generator=gen), torch.randn(8, outputs, generator=gen)


def _shard_model(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, rank: int, steps: range, after_step=None, grads=None) -> list[float]:
    """``grads``: a list to append each step's local gradient shards to."""
    losses = []
    for t in steps:
        x, y = _batch(rank, t)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if grads is not None:
            grads.append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if after_step is not None:
            after_step(t)
    return losses


def _locals(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _whole_norms(tensors: list[torch.Tensor], group) -> torch.Tensor:
    """Each tensor's norm over its shards on ``group``."""
    squares = torch.stack([t.double().square().sum() for t in tensors])
    dist.all_reduce(squares, group=group)
    return squares.sqrt()


def _same_over(group, tensors: list[torch.Tensor]) -> bool:
    """Whether every rank of ``group`` holds exactly these tensors."""
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for entry in opt.state.values() for t in entry.values()
               if isinstance(t, torch.Tensor))


def _hsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group("replicate")
    result: dict = {}

    # native HSDP + AdamW: the reference of the warmup
    native = _shard_model(mesh)
    adamw = torch.optim.AdamW(native.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    _train(native, adamw, rank, range(1, FREEZE + 1))

    # the recipe: FSDP over "shard", onebit over "replicate"
    model = _shard_model(mesh["shard"])
    start = _locals(model)
    options = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, bias_correction=True, freeze_step=FREEZE)
    opt = OnebitAdam(model.named_parameters(), group=mesh["replicate"], **options)
    grads: list = []
    _train(model, opt, rank, range(1, FREEZE + 1), grads=grads)
    result["warmup_rel"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                               for a, b in zip(_locals(model), _locals(native)))
    identical = []
    losses = _train(model, opt, rank, range(FREEZE + 1, STEPS + 1), grads=grads,
                    after_step=lambda t: identical.append(_same_over(replicate, _locals(model))))
    # the oracle: plain tensors (the initial shards) stepped over the replicate group with the same gradients
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    oracle = OnebitAdam(plain, group=replicate, **options)
    for step_grads in grads:
        for p, g in zip(plain, step_grads):
            p.grad = g
        oracle.step()
    result["equals_plain_tensors"] = all(torch.equal(a, b) for a, b in zip(_locals(model), plain))
    result["identical_after_switch"] = identical
    result["losses"] = losses
    result["local_shapes"] = [tuple(p.to_local().shape) for p in model.parameters()]
    result["state_shapes"] = [tuple(opt.state[p]["exp_avg"].shape) for p in model.parameters()]
    result["state_bytes"] = _state_bytes(opt)
    full = _mlp()
    result["unsharded_state_bytes"] = _state_bytes(OnebitAdam(full.parameters(), backend=LocalBackend()))

    # torch.optim's conventions on shards: a live load of its own state_dict continues bit for bit (errors
    # restored); a parameter without a gradient is left alone with its state
    twin = _shard_model(mesh["shard"])
    for a, b in zip(twin.parameters(), model.parameters()):
        a.to_local().detach().copy_(b.to_local().detach())
    twin_opt = OnebitAdam(twin.parameters(), group=mesh["replicate"], **options)
    twin_opt.restore(opt.state_dict(), [(w.clone(), e.clone()) for w, e in opt.compression_errors()])
    bias = list(model.parameters())[1]
    held = (bias.to_local().clone(), opt.state[bias]["exp_avg"].clone())
    for m, o in ((model, opt), (twin, twin_opt)):
        x, y = _batch(rank, STEPS + 1)
        torch.nn.functional.mse_loss(m(x), y).backward()
        list(m.parameters())[1].grad = None
        o.step()
        o.zero_grad(set_to_none=True)
    result["live_load_bit_for_bit"] = all(torch.equal(a, b) for a, b in zip(_locals(model), _locals(twin)))
    result["no_grad_untouched"] = (torch.equal(held[0], bias.to_local()) and
                                   torch.equal(held[1], opt.state[bias]["exp_avg"]))
    result["others_moved"] = not torch.equal(start[0], _locals(model)[0])

    # a momentum mask given whole (as for an unsharded model) applies to each rank's shard of it
    model = _shard_model(mesh["shard"])
    weight = model[0].weight
    mask = torch.ones(33, 16)
    mask[::3] = 0  # rows 0, 3, ..., 15 on the first shard; 18, 21, ... (local rows 1, 4, ...) on the second
    masked = OnebitAdam(model.parameters(), lr=LR, freeze_step=2, group=mesh["replicate"], momentum_masks={weight: mask})
    _train(model, masked, rank, range(1, 5))
    local_mask = mask.chunk(2)[mesh["shard"].get_local_rank()]
    momentum = masked.state[weight]["exp_avg"]
    result["mask_zero_where_masked"] = bool((momentum[local_mask == 0] == 0).all())
    result["mask_free_elsewhere"] = bool((momentum[local_mask == 1] != 0).all())

    # ZeroOneAdam on the same recipe: replicas identical after every sync
    model = _shard_model(mesh["shard"])
    zo = ZeroOneAdam(model.parameters(), lr=LR, var_freeze_step=3, var_update_scaler=1, local_step_scaler=1,
                     local_step_clipper=2, group=mesh["replicate"])
    _train(model, zo, rank, range(1, 9))
    zo.synchronize()
    result["zoadam_identical"] = _same_over(replicate, _locals(model))

    # onebit's own checkpoint files hold rank 0's state: refused for shards (DCP saves them)
    try:
        save_checkpoint(f"/tmp/never-written-{rank}.pt", opt)
        result["save_checkpoint"] = None
    except ValueError as exc:
        result["save_checkpoint"] = str(exc)

    # 1-bit LAMB: its trust ratios and factors read whole-tensor norms and maxima (reduced over the shards):
    # its warmup equals unsharded 1-bit LAMB over all 4 ranks with the same data; replicas identical after;
    # with trust_ratio="live" each compression step is -lr c (u + wd p) with c = ||p|| / ||u_smoothed + wd p||
    # of the whole tensors (recomputed here from the state); with "frozen" the factor is in its range
    result["lamb"] = {}
    for rule in ("live", "frozen"):
        model = _shard_model(mesh["shard"])
        lamb = OnebitLamb(model.parameters(), lr=LR, freeze_step=FREEZE, weight_decay=WD, group=mesh["replicate"],
                          trust_ratio=rule)
        plain = _mlp()
        plain_lamb = OnebitLamb(plain.parameters(), lr=LR, freeze_step=FREEZE, weight_decay=WD, trust_ratio=rule)
        for m, o in ((model, lamb), (plain, plain_lamb)):
            _train(m, o, rank, range(1, FREEZE + 1))
        shard = mesh["shard"].get_local_rank()
        out = {"warmup_rel": max(float((a - b.detach().chunk(2)[shard]).norm() / b.detach().norm())
                                 for a, b in zip(_locals(model), plain.parameters()) if a.numel()),
               "identical": [], "live_step_error": [], "local_norms_step_error": []}
        before = [_locals(model)]

        def after(t, model=model, out=out, before=before, lamb=lamb, rule=rule):
            now = _locals(model)
            out["identical"].append(_same_over(replicate, now))
            if rule == "live":
                saved = lamb.state_dict()["state"]  # (the variance as saved: released, d stands for it)
                order = [id(q) for group in lamb.param_groups for q in group["params"]]
                states = [{k: v.to_local() if hasattr(v, "to_local") else v for k, v in saved[order.index(id(q))].items()}
                          for q in model.parameters()]
                directions = [s["exp_avg"] / (s["exp_avg_sq"].sqrt() + EPS) + WD * b for s, b in zip(states, before[0])]
                smoothed = [s["smoothed_update"] + WD * b for s, b in zip(states, before[0])]
                for key, norm in (("live_step_error", lambda ts: _whole_norms(ts, mesh["shard"].get_group())),
                                  ("local_norms_step_error", lambda ts: torch.stack([t.double().norm() for t in ts]))):
                    coeffs = (norm(before[0]) / norm(smoothed)).clamp(0.01, 10.0)
                    out[key].append(max(float((a - (b - LR * float(c) * d)).abs().max() / b.abs().max())
                                        for a, b, c, d in zip(now, before[0], coeffs, directions) if b.numel()))
            before[0] = now

        _train(model, lamb, rank, range(FREEZE + 1, STEPS + 1), after_step=after)
        out["factor"] = lamb.comm_stats()["max_factor"]
        result["lamb"][rule] = out

    # group= takes a 1-D mesh only
    try:
        OnebitAdam(_mlp().parameters(), group=mesh)
        result["two_d_mesh"] = None
    except ValueError as exc:
        result["two_d_mesh"] = str(exc)

    # a group that mixes different shards: FSDP over all 4 ranks, onebit over all 4
    world_mesh = init_device_mesh("cpu", (4,))
    wrong = _shard_model(world_mesh)
    bad = OnebitAdam(wrong.parameters(), lr=LR, freeze_step=FREEZE)
    x, y = _batch(rank, 1)
    torch.nn.functional.mse_loss(wrong(x), y).backward()
    try:
        bad.step()
        result["mixed"] = None
    except ValueError as exc:
        result["mixed"] = str(exc)
    return result


def test_hsdp_recipe_warmup_equals_native_hsdp_and_replicas_stay_identical(tmp_path):
    results = run_ranks(_hsdp, 4, tmp_path, timeout=240)
    for rank, r in enumerate(results):
        assert r["warmup_rel"] < 1e-5, (rank, r["warmup_rel"])
        assert all(r["identical_after_switch"]), (rank, r["identical_after_switch"])
        assert r["equals_plain_tensors"]
        assert r["live_load_bit_for_bit"] and r["no_grad_untouched"] and r["others_moved"]
        assert "torch.distributed.checkpoint" in r["save_checkpoint"]
        assert r["zoadam_identical"]
        assert r["mask_zero_where_masked"] and r["mask_free_elsewhere"]
        for rule, lamb in r["lamb"].items():
            assert lamb["warmup_rel"] < 1e-5, (rank, rule, lamb["warmup_rel"])
            assert all(lamb["identical"]) and len(lamb["identical"]) == STEPS - FREEZE, rule
        live, frozen = r["lamb"]["live"], r["lamb"]["frozen"]
        assert len(live["live_step_error"]) == STEPS - FREEZE and max(live["live_step_error"]) < 1e-6, live
        # ... from whole-tensor norms: each shard's own norms would give other steps
        assert max(live["local_norms_step_error"]) > 1e-4, live
        assert live["factor"] == 1.0 and 0.5 < frozen["factor"] < 4.0
        assert "2-D DeviceMesh ('replicate', 'shard')" in r["two_d_mesh"] and "group=mesh['replicate']" in r["two_d_mesh"]
        assert "other shards of the DTensor parameters" in r["mixed"] and "group=mesh['replicate']" in r["mixed"]
        assert r["state_shapes"] == r["local_shapes"]
        assert r["state_bytes"] <= 0.55 * r["unsharded_state_bytes"], (r["state_bytes"], r["unsharded_state_bytes"])
    # shard coordinates: ranks 0 and 2 hold the first shards (17 rows; the 1-row output layer), 1 and 3 the rest
    assert results[0]["local_shapes"] == [(17, 16), (17,), (1, 33), (1,)]
    assert results[1]["local_shapes"] == [(16, 16), (16,), (0, 33), (0,)]


def _tp_mlp() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def _adamw_step_rel(model, reference) -> float:
    return max(float((a.detach().to_local() - b.detach().to_local()).norm() / b.detach().to_local().norm().clamp_min(1e-30))
               for a, b in zip(model.parameters(), reference.parameters()))


def _tensor_parallel(rank: int, world: int, dp, tp) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    model = parallelize_module(_tp_mlp(), tp, plan)
    reference = parallelize_module(_tp_mlp(), tp, plan)
    dp_group = dp.get_group()
    dp_rank = dp.get_local_rank()
    adamw = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt = OnebitAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, bias_correction=True,
                     freeze_step=FREEZE, group=dp)
    result: dict = {"placements": [str(tuple(p.placements)) for p in model.parameters()], "identical": []}
    for t in range(1, STEPS + 1):
        x, y = _batch(dp_rank, t, 16, 16)  # the same input on both ranks of a tensor-parallel pair
        for m in (model, reference) if t <= FREEZE else (model,):
            torch.nn.functional.mse_loss(m(x), y).backward()
        if t <= FREEZE:
            for p in reference.parameters():  # the data-parallel average by hand
                g = p.grad.to_local()
                dist.all_reduce(g, group=dp_group)
                g.div_(dist.get_world_size(dp_group))
            adamw.step()
            adamw.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if t == FREEZE:
            result["warmup_rel"] = _adamw_step_rel(model, reference)
        if t > FREEZE:
            result["identical"].append(_same_over(dp_group, [p.to_local() for p in model.parameters()]))
    return result


def _pipeline(rank: int, world: int, pp, dp) -> dict:
    """Two stages (ranks 0, 1: the first; 2, 3: the second), hand-written send/recv between a rank
    and its peer of the other stage, one OnebitAdam per stage over the stage's data-parallel group."""
    stage = pp.get_local_rank()
    dp_rank = dp.get_local_rank()
    torch.manual_seed(2)
    first, second = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh()), torch.nn.Linear(24, 1)
    whole = copy.deepcopy(torch.nn.Sequential(*first, second))
    reference = torch.optim.Adam(whole.parameters(), lr=LR, betas=BETAS, eps=EPS)
    mine = first if stage == 0 else second
    opt = OnebitAdam(mine.parameters(), lr=LR, betas=BETAS, eps=EPS, bias_correction=True, freeze_step=FREEZE,
                     group=dp)
    peer = rank + 2 if stage == 0 else rank - 2
    result: dict = {"stage": stage, "identical": []}
    for t in range(1, STEPS + 1):
        x, y = _batch(dp_rank, t)
        if stage == 0:
            h = first(x)
            dist.send(h.detach().contiguous(), peer)
            grad = torch.empty_like(h)
            dist.recv(grad, peer)
            h.backward(grad)
        else:
            h = torch.empty(8, 24)
            dist.recv(h, peer)
            h.requires_grad_(True)
            torch.nn.functional.mse_loss(second(h), y).backward()
            dist.send(h.grad.contiguous(), peer)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if t <= FREEZE:  # the oracle: Adam on the whole model over both data-parallel batches
            reference.zero_grad()
            for r in range(dist.get_world_size(dp.get_group())):
                xr, yr = _batch(r, t)
                (torch.nn.functional.mse_loss(whole(xr), yr) / 2).backward()
            reference.step()
        if t == FREEZE:
            theirs = list(whole[:2].parameters()) if stage == 0 else list(whole[2].parameters())
            result["warmup_rel"] = max(float((a - b).norm() / b.norm()) for a, b in zip(mine.parameters(), theirs))
        if t > FREEZE:
            result["identical"].append(_same_over(dp.get_group(), [p.detach() for p in mine.parameters()]))
    return result


def _tp_and_pipeline(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    stages = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return {"tp": _tensor_parallel(rank, world, mesh["dp"], mesh["tp"]),
            "pp": _pipeline(rank, world, stages["pp"], stages["dp"])}


def test_tensor_parallel_by_data_parallel_and_pipeline_stages(tmp_path):
    results = run_ranks(_tp_and_pipeline, 4, tmp_path, timeout=240)
    for rank, r in enumerate(results):
        tp, pp = r["tp"], r["pp"]
        assert tp["placements"] == ["(Shard(dim=0),)", "(Shard(dim=0),)", "(Shard(dim=1),)", "(Replicate(),)"]
        assert tp["warmup_rel"] < 1e-5, (rank, tp["warmup_rel"])
        assert all(tp["identical"]) and len(tp["identical"]) == STEPS - FREEZE
        assert pp["stage"] == rank // 2
        assert pp["warmup_rel"] < 1e-5, (rank, pp["warmup_rel"])
        assert all(pp["identical"]) and len(pp["identical"]) == STEPS - FREEZE


# ----------------------------------------------------------------------------- universal checkpoints (DCP)

DCP_FREEZE = 3


def _full(model, opt) -> dict:
    """Parameters, momentum and variance as full tensors (a collective for DTensors: every rank calls)."""
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
    sd = opt.state_dict()
    return {"params": [whole(p.detach()) for p in model.parameters()],
            "exp_avg": [whole(sd["state"][i]["exp_avg"]) for i in range(len(sd["state"]))],
            "exp_avg_sq": [whole(sd["state"][i]["exp_avg_sq"]) for i in range(len(sd["state"]))],
            "step": opt.step_count}


def _layout(kind: str, rank: int):
    """``(model, optimizer)`` of one layout: 'hsdp' (2 x 2, the recipe), 'fsdp' (4 shards, no
    replicas: onebit over a group of one), 'ddp' (plain tensors, onebit over every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    options = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=DCP_FREEZE)
    if kind == "ddp":
        model = _mlp()
        return model, OnebitAdam(model.parameters(), **options)
    shape = (2, 2) if kind == "hsdp" else (1, 4)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = _shard_model(mesh["shard"])
    return model, OnebitAdam(model.parameters(), group=mesh["replicate"], **options)


def _checkpoint_leg(rank: int, world: int, load_from: str | None, layouts: list[str], directory: str) -> dict:
    """Load ``load_from`` (if any) into each layout in turn, compare with what was saved, train two
    steps, save; what each layout saved, as full tensors, is the next one's reference."""
    import pathlib
    lines = LogMessages(logging.INFO)
    logging.getLogger("onebit").addHandler(lines)
    logging.getLogger("onebit").setLevel(logging.INFO)
    result: dict = {"loaded": [], "steps": []}
    source = load_from
    for n, kind in enumerate(layouts):
        model, opt = _layout(kind, rank)
        if source is None:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
            get_optimizer_state_dict(model, opt)  # DCP initializes empty optimizer state by calling step()
            result["fresh_step_after_get"] = opt.step_count
            _train(model, opt, rank, range(1, DCP_FREEZE + 3))
        else:
            dcp_load(model, opt, source)
            saved = torch.load(pathlib.Path(source) / "full.pt", weights_only=True)
            now = _full(model, opt)
            result["loaded"].append(all(torch.equal(a, b) for key in ("params", "exp_avg", "exp_avg_sq")
                                        for a, b in zip(now[key], saved[key])) and now["step"] == saved["step"])
            result.setdefault("errors_after_load", []).append(opt.comm_stats()["worker_error_norm"])
            result.setdefault("errors_restored", []).append(load_compression_errors(source, opt))  # another layout
            start = opt.step_count + 1
            _train(model, opt, rank, range(start, start + 2))
        result["steps"].append(opt.step_count)
        source = f"{directory}/{kind}-{n}-{world}"
        dcp_save(model, opt, source)
        save_compression_errors(source, opt)
        full = _full(model, opt)
        if rank == 0:
            torch.save(full, pathlib.Path(source) / "full.pt")
        dist.barrier()
        if load_from is None and n == 0:  # the same layout again: an exact resume, bit for bit
            again, again_opt = _layout(kind, rank)
            dcp_load(again, again_opt, source)
            result["exact_restored"] = load_compression_errors(source, again_opt)
            start = opt.step_count + 1
            _train(model, opt, rank, range(start, start + 2))
            _train(again, again_opt, rank, range(start, start + 2))
            result["exact_bit_for_bit"] = all(torch.equal(a, b) for a, b in zip(_locals(model), _locals(again)))
            result["exact_lines"] = sum("compression errors restored (exact resume)" in line for line in lines.messages)
    result["reset_lines"] = sum("compression errors reset" in line for line in lines.messages)
    return result


def test_dcp_checkpoints_move_between_hsdp_fsdp_and_ddp(tmp_path):
    """HSDP 2 x 2 -> FSDP over 4 ranks (4 ranks), -> plain DDP on 2 ranks, -> HSDP again (4 ranks):
    parameters, momentum and variance equal as full tensors after every move, the step kept,
    compression errors reset with one log line per load."""
    first = run_ranks(_checkpoint_leg, 4, tmp_path / "first", None, ["hsdp", "fsdp"], str(tmp_path), timeout=240)
    for r in first:
        assert r["fresh_step_after_get"] == 0
        assert r["exact_restored"] and r["exact_bit_for_bit"]
        assert r["loaded"] == [True] and r["errors_after_load"] == [0.0] and r["errors_restored"] == [False]
        assert r["steps"] == [DCP_FREEZE + 2, DCP_FREEZE + 4]
    # info lines come from rank 0 of the first shard's group only (in the FSDP layout each rank is a group)
    assert [r["reset_lines"] for r in first] == [1, 0, 0, 0]
    assert [r["exact_lines"] for r in first] == [1, 0, 0, 0]
    second = run_ranks(_checkpoint_leg, 2, tmp_path / "second", f"{tmp_path}/fsdp-1-4", ["ddp"], str(tmp_path), timeout=120)
    assert [r["loaded"] for r in second] == [[True], [True]]
    assert [r["errors_restored"] for r in second] == [[False], [False]]
    assert [r["reset_lines"] for r in second] == [1, 0]
    third = run_ranks(_checkpoint_leg, 4, tmp_path / "third", f"{tmp_path}/ddp-0-2", ["hsdp"], str(tmp_path), timeout=240)
    assert all(r["loaded"] == [True] and r["errors_restored"] == [False] and r["steps"] == [DCP_FREEZE + 8]
               for r in third)
    assert [r["reset_lines"] for r in third] == [1, 0, 0, 0]
