"""onebit in a PyTorch Lightning Trainer: OnebitCallback on 2 gloo ranks under torchrun.

Two torchrun jobs, run once for the module: ``examples/lightning/train.py`` itself (1-bit Adam,
a ModelCheckpoint every 5 steps, ``--exact-resume``), then this file as a script on the same 2
ranks (one Lightning import for several runs): two resumes from the first job's checkpoint in the
compression phase (by default: errors reset; with ``--exact-resume``: errors restored), 1-bit LAMB
with 2 micro-batches, 0/1 Adam in bf16-mixed with a checkpoint between syncs and an exact resume
from it, and the plain loops (no Lightning, the same per-rank batches as Lightning's
DistributedSampler gives) that each run must equal.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lightning")

from conftest import max_abs_diff, seeded_params  # noqa: E402
from launch import run_job, torchrun  # noqa: E402
from onebit import OnebitAdam  # noqa: E402
from onebit.compression import padded_length  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/lightning/train.py"
STEPS, FREEZE, SAVED_AT = 10, 3, 5  # 5 steps per epoch; the checkpoint at step 5 is in the compression phase
ZO_STEPS, ZO_FREEZE = 15, 6  # 0/1 Adam: variance, compressed_gradient, sync and local steps; ends on a sync
ZO_SAVED_AT = 10  # a local step (the ranks differ after it) at an epoch boundary
LR = 1e-2


# ----------------------------------------------------------------- the rank side (python tests/test_lightning.py)

def _example():
    spec = importlib.util.spec_from_file_location("onebit_lightning_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain(ex, optimizer: str, steps: int, freeze: int, *, accumulate: int = 1, bf16: bool = False,
           reload_at: int | None = None) -> list[float]:
    """The plain loop: no Lightning, no DDP; the same model, optimizer and per-rank micro-batches
    (DistributedSampler, shuffled with seed 0 and the epoch, as Lightning sets it up); each
    micro-batch's loss divided by ``accumulate`` as Lightning does. ``reload_at``: round-trip the
    optimizer's state_dict after that step (what a resume does: compression errors reset)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    net = ex.make_net()
    opt = ex.build_optimizer(optimizer, net.parameters(), LR, freeze)
    data = ex.synthetic_data()
    sampler = DistributedSampler(data, dist.get_world_size(), dist.get_rank(), shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=ex.BATCH // accumulate, sampler=sampler)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        epoch += 1
        batches = iter(loader)
        for _ in range(len(loader) // accumulate):
            for x, y in (next(batches) for _ in range(accumulate)):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = ex.loss_of(net, x, y)
                (loss / accumulate).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step == reload_at:
                opt.load_state_dict(opt.state_dict())
            if step == steps:
                break
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def _ranks_main(out: Path, checkpoint: Path) -> None:
    import torch.distributed as dist

    ex = _example()
    common = ["--freeze-step", str(FREEZE), "--lr", str(LR)]
    ex.main(["--steps", str(STEPS), "--resume", str(checkpoint), "--result", str(out / "resumed"), *common])
    ex.main(["--steps", str(STEPS), "--resume", str(checkpoint), "--exact-resume", "--result", str(out / "exact"),
             *common])
    ex.main(["--optimizer", "lamb", "--steps", "6", "--accumulate", "2", "--result", str(out / "lamb"), *common])
    zoadam = ["--optimizer", "zoadam", "--steps", str(ZO_STEPS), "--freeze-step", str(ZO_FREEZE),
              "--precision", "bf16-mixed", "--lr", str(LR), "--exact-resume"]
    ex.main([*zoadam, "--checkpoint-dir", str(out / "zo_ckpt"), "--result", str(out / "zoadam")])
    ex.main([*zoadam, "--resume", str(_zo_checkpoint(out)), "--result", str(out / "zoadam_exact")])
    plain = {
        "adam": _plain(ex, "adam", STEPS, FREEZE),
        "adam_reloaded": _plain(ex, "adam", STEPS, FREEZE, reload_at=SAVED_AT),
        "lamb": _plain(ex, "lamb", 6, FREEZE, accumulate=2),
        "zoadam": _plain(ex, "zoadam", ZO_STEPS, ZO_FREEZE, bf16=True),
    }
    (out / f"plain.rank{dist.get_rank()}.json").write_text(json.dumps(plain))
    dist.barrier()
    dist.destroy_process_group()


def _zo_checkpoint(out: Path) -> Path:
    return out / "zo_ckpt" / f"epoch={ZO_SAVED_AT // 5 - 1}-step={ZO_SAVED_AT}.ckpt"


# ----------------------------------------------------------------- the test side

def _load(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = [torchrun(), "--standalone", "--nproc-per-node", "2"]
    first = run_job([*launcher, str(EXAMPLE), "--steps", str(STEPS), "--freeze-step", str(FREEZE), "--lr", str(LR),
                     "--checkpoint-dir", str(out / "ckpt"), "--save-every", str(SAVED_AT), "--exact-resume",
                     "--result", str(out / "adam")],
                    120, env=env, cwd=out)
    assert first.returncode == 0, first.stdout[-5000:]
    checkpoint = out / "ckpt" / f"epoch=0-step={SAVED_AT}.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in (out / "ckpt").iterdir())
    second = run_job([*launcher, __file__, str(out), str(checkpoint)], 180, env=env, cwd=out)
    assert second.returncode == 0, second.stdout[-5000:]
    names = ("adam", "resumed", "exact", "lamb", "zoadam", "zoadam_exact", "plain")
    return {"dir": out, **{name: _load(out, name) for name in names}}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam", "resumed", "exact", "lamb", "zoadam", "zoadam_exact"])
def test_parameters_bit_identical_on_every_rank(runs, name):
    first, second = runs[name]
    assert first["replicas_identical"] and second["replicas_identical"]
    assert first["params"] == second["params"]


def _steps_of(result: dict, kind: str) -> list[int]:
    return [int(t) for t, plan in result["plans"].items() if plan == kind]


@pytest.mark.slow
def test_gradients_averaged_once_by_ddp_in_warmup_and_never_in_compression(runs):
    numel = len(runs["adam"][0]["params"])
    for result in runs["adam"]:
        warmup, compression = _steps_of(result, "warmup"), _steps_of(result, "compression")
        assert warmup == [1, 2, 3] and compression == list(range(4, STEPS + 1))
        assert result["ddp_comm_hook"] == "onebit_ddp_hook"  # DDP reduces through it, so the count sees DDP's traffic
        # One all-reduce carrying every gradient (one DDP bucket) before each warmup step, none after.
        assert result["grad_allreduces"] == {str(t): [numel] for t in warmup}
        assert result["sync_flags"] == {str(t): [t in warmup] for t in range(1, STEPS + 1)}
        stats = result["stats"]
        # The optimizer itself sent only the 8-byte layout check in warmup (DDP's all-reduce is not its own) ...
        assert stats["warmup"]["steps"] == 3 and stats["warmup"]["bytes_sent"] - stats["warmup"]["framework_bytes_sent"] == 8
        # ... and 1-bit momentum in compression: padded / 8 sign bytes, a 4-byte scale per tensor in each of
        # its 2 collectives, and the 12-byte flag (finiteness, error ratio, missing gradients).
        sizes = [p.numel() for p in _example().make_net().parameters()]
        per_step = sum(padded_length(s, 2) for s in sizes) // 8 + 8 * len(sizes) + 12
        assert stats["compression"]["steps"] == STEPS - 3
        assert stats["compression"]["bytes_sent"] == (STEPS - 3) * per_step


@pytest.mark.slow
def test_accumulation_syncs_only_the_last_micro_batch_of_a_warmup_step(runs):
    numel = len(runs["lamb"][0]["params"])
    for result in runs["lamb"]:
        warmup = _steps_of(result, "warmup")
        assert warmup == [1, 2, 3] and result["step_count"] == 6 and result["ddp_comm_hook"] == "onebit_ddp_hook"
        # Lightning's no_sync() on the first micro-batch, the onebit flag on the second.
        assert result["sync_flags"] == {str(t): [False, t in warmup] for t in range(1, 7)}
        assert result["grad_allreduces"] == {str(t): [numel] for t in warmup}
        assert result["stats"]["warmup"]["bytes_sent"] - result["stats"]["warmup"]["framework_bytes_sent"] == 8


@pytest.mark.slow
def test_zero_one_adam_lets_ddp_average_only_before_variance_steps(runs):
    numel = len(runs["zoadam"][0]["params"])
    for result in runs["zoadam"]:
        kinds = set(result["plans"].values())
        assert kinds == {"variance", "compressed_gradient", "sync", "local"}
        assert result["ddp_comm_hook"] == "onebit_ddp_hook"
        variance = _steps_of(result, "variance")
        assert result["grad_allreduces"] == {str(t): [numel] for t in variance}
        assert result["sync_flags"] == {str(t): [t in variance] for t in range(1, ZO_STEPS + 1)}
        assert result["stats"]["local"]["bytes_sent"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam", "lamb", "zoadam"])
def test_trajectory_equals_the_plain_loop(runs, name):
    # DDP divides each gradient by 2 before summing, the optimizer after: both exact on 2 ranks,
    # so the runs agree bit for bit (measured: 0.0 for all three, bf16-mixed included).
    for rank in range(2):
        assert max_abs_diff(runs[name][rank]["params"], runs["plain"][rank][name]) == 0.0


@pytest.mark.slow
def test_resume_through_lightning_continues_the_schedule(runs):
    for resumed, uninterrupted, plain in zip(runs["resumed"], runs["adam"], runs["plain"]):
        assert resumed["global_step"] == resumed["step_count"] == STEPS
        # Only the steps after the checkpoint ran, all of them compression steps, with DDP's sync off
        # (the load set the flag back from the warmup value attach_ddp started with).
        assert resumed["stats"]["warmup"]["steps"] == 0 and resumed["stats"]["compression"]["steps"] == STEPS - SAVED_AT
        assert resumed["sync_flags"] == {str(t): [False] for t in range(SAVED_AT + 1, STEPS + 1)}
        assert resumed["grad_allreduces"] == {}
        # A load resets the compression errors (rank-local, not in the state dict): the resumed run
        # equals the plain loop that round-tripped its state_dict at the same step, bit for bit ...
        assert resumed["params"] == plain["adam_reloaded"]
        # ... and differs from the uninterrupted run by as much as that reset moves the plain loop.
        reset_effect = max_abs_diff(plain["adam"], plain["adam_reloaded"])
        assert max_abs_diff(resumed["params"], uninterrupted["params"]) == reset_effect
        assert reset_effect > 0.0


@pytest.mark.slow
def test_exact_resume_through_lightning_continues_bit_for_bit(runs):
    for resumed, uninterrupted in zip(runs["exact"], runs["adam"], strict=True):
        assert resumed["global_step"] == resumed["step_count"] == STEPS
        assert resumed["stats"]["warmup"]["steps"] == 0 and resumed["stats"]["compression"]["steps"] == STEPS - SAVED_AT
        # Every rank got its own compression errors back: the run the reset test shows moved by a
        # reset equals the uninterrupted one (measured: 0.0 on both ranks).
        assert max_abs_diff(resumed["params"], uninterrupted["params"]) == 0.0


@pytest.mark.slow
def test_exact_resume_between_zero_one_adam_syncs_gives_every_rank_its_own_state(runs):
    checkpoint = torch.load(_zo_checkpoint(runs["dir"]), map_location="cpu", weights_only=True)
    saved = checkpoint["onebit"]
    assert saved["world_size"] == 2 and saved["step"] == ZO_SAVED_AT and [e["rank"] for e in saved["ranks"]] == [0, 1]
    # Saved after a local step: each rank saved its own model and optimizer state, and they differ,
    # so a resume from rank 0's alone (what Lightning restores) would change rank 1.
    models = [entry["model"] for entry in saved["ranks"]]
    assert all("optimizer" in entry for entry in saved["ranks"])
    assert all(torch.equal(models[0][key], value) for key, value in checkpoint["state_dict"].items())
    assert any(not torch.equal(models[0][key], models[1][key]) for key in models[0])
    for resumed, uninterrupted in zip(runs["zoadam_exact"], runs["zoadam"], strict=True):
        assert uninterrupted["plans"][str(ZO_SAVED_AT)] == "local" and uninterrupted["plans"][str(ZO_STEPS)] == "sync"
        assert resumed["global_step"] == resumed["step_count"] == ZO_STEPS
        assert max_abs_diff(resumed["params"], uninterrupted["params"]) == 0.0  # measured: 0.0 on both ranks


# ----------------------------------------------------------------- one process, and bad input

class _Tiny:
    """A LightningModule class whose configure_optimizers returns ``make_optimizers(params)``."""

    @staticmethod
    def build(make_optimizers):
        import lightning as L

        class Tiny(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(4, 2)

            def training_step(self, batch, batch_idx):
                return self.net(batch[0]).pow(2).mean()

            def configure_optimizers(self):
                return make_optimizers(list(self.parameters()))

        return Tiny()


def _fit(make_optimizers, steps: int = 2):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from onebit.integrations.lightning import OnebitCallback

    module = _Tiny.build(make_optimizers)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[OnebitCallback()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    return trainer


def test_one_process_is_a_noop_with_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger="onebit.integrations.lightning")
    trainer = _fit(lambda params: OnebitAdam(params, lr=1e-3, freeze_step=1))
    records = [r for r in caplog.records if r.name == "onebit.integrations.lightning"]
    assert len(records) == 1 and "nothing to attach" in records[0].getMessage()
    assert trainer.optimizers[0].step_count == 2


def test_a_foreign_optimizer_fails_fit_naming_it():
    with pytest.raises(ValueError, match=r"configure_optimizers returned SGD; return OnebitAdam\(self.parameters"):
        _fit(lambda params: torch.optim.SGD(params, lr=0.1))


def _strategy(name: str):
    from lightning.pytorch import strategies

    strategy = getattr(strategies, name)()
    strategy.model = torch.nn.Linear(4, 2)
    return strategy


def _single():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    return SingleDeviceStrategy("cpu")


def _onebit():
    return OnebitAdam([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, comm_backend_name="local")


@pytest.mark.parametrize("optimizers, strategy, pattern", [
    (lambda: [], _single, r"exactly one optimizer from configure_optimizers, got 0 \(none\)"),
    (lambda: [_onebit(), _onebit()], _single, r"got 2 \(OnebitAdam, OnebitAdam\); return a single OnebitAdam"),
    (lambda: [torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])], _single, r"configure_optimizers returned Adam"),
    (lambda: [_onebit()], lambda: _strategy("FSDPStrategy"), r"strategy FSDPStrategy .* use Trainer\(strategy=\"ddp\"\)"),
    (lambda: [_onebit()], lambda: _strategy("DeepSpeedStrategy"), r"strategy DeepSpeedStrategy .*not DistributedDataParallel"),
])
def test_bad_input_raises_naming_the_value_and_the_fix(optimizers, strategy, pattern):
    from onebit.integrations.lightning import OnebitCallback

    trainer = SimpleNamespace(optimizers=optimizers(), strategy=strategy(), global_rank=0, world_size=1)
    with pytest.raises(ValueError, match=pattern):
        OnebitCallback().on_fit_start(trainer, None)


def _compressing_adam(steps: int = 3) -> OnebitAdam:
    """1-bit Adam on one process, ``steps`` steps in (compression from step 2): nonzero worker errors."""
    params = seeded_params(5, (3, 2))
    optimizer = OnebitAdam(params, lr=1e-2, freeze_step=1, comm_backend_name="local")
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return optimizer


def _errors(optimizer) -> list[torch.Tensor]:
    return [e.clone() for pair in optimizer.compression_errors() for e in pair]


def _drop(checkpoint):
    del checkpoint["onebit"]


@pytest.mark.parametrize("change, logged", [
    (lambda ckpt: None, r"exact resume at step 3: every rank restored its own compression errors$"),
    (lambda ckpt: ckpt["onebit"].update(world_size=2), r"not possible \(it was saved on 2 ranks, this run has 1\); "
                                                       r"compression errors reset, every rank continues from rank 0's"),
    (lambda ckpt: ckpt["onebit"].update(layout="0" * 16), r"not possible \(it was saved with another parameter layout "
                                                          r"\(layout digest 0{16}, this optimizer's [0-9a-f]{16}\)\)"),
    (lambda ckpt: ckpt["onebit"].update(step=2), r"its compression errors are of step 2, the optimizer state is of step 3"),
    (_drop, r"not possible \(the checkpoint was saved without OnebitCallback\(exact_resume=True\)\)"),
])
def test_exact_resume_restores_only_a_matching_checkpoint_and_logs_why_not(caplog, change, logged):
    from onebit.integrations.lightning import OnebitCallback

    caplog.set_level(logging.INFO, logger="onebit.integrations.lightning")
    saving = _compressing_adam()
    saved_errors = _errors(saving)
    assert any(e.abs().sum() > 0 for e in saved_errors)
    checkpoint = {"optimizer_states": [saving.state_dict()]}
    OnebitCallback(exact_resume=True).on_save_checkpoint(SimpleNamespace(optimizers=[saving], global_rank=0), None,
                                                         checkpoint)
    change(checkpoint)
    # What Lightning does on resume: on_load_checkpoint, a new optimizer, load_state_dict (errors
    # reset), on_train_start.
    callback = OnebitCallback(exact_resume=True)
    trainer = SimpleNamespace(optimizers=[_compressing_adam(steps=0)], global_rank=0)
    callback.on_load_checkpoint(trainer, None, checkpoint)
    trainer.optimizers[0].load_state_dict(checkpoint["optimizer_states"][0])
    callback.on_train_start(trainer, None)
    records = [r.getMessage() for r in caplog.records if r.name == "onebit.integrations.lightning"]
    assert len(records) == 1 and re.search(logged, records[0]), records
    restored = _errors(trainer.optimizers[0])
    if "restored" in logged:
        assert all(torch.equal(a, b) for a, b in zip(restored, saved_errors, strict=True))
    else:
        assert all(e.abs().sum() == 0 for e in restored)
    callback.on_train_start(trainer, None)  # the entry is used once: a later fit starts clean
    assert len([r for r in caplog.records if r.name == "onebit.integrations.lightning"]) == 1


def test_without_exact_resume_nothing_is_gathered_or_restored():
    from onebit.integrations.lightning import OnebitCallback

    optimizer = _compressing_adam()
    trainer = SimpleNamespace(optimizers=[optimizer], global_rank=0)
    checkpoint = {}
    OnebitCallback().on_save_checkpoint(trainer, None, checkpoint)
    assert checkpoint == {}
    OnebitCallback(exact_resume=True).on_save_checkpoint(trainer, None, checkpoint)
    callback = OnebitCallback()
    callback.on_load_checkpoint(trainer, None, checkpoint)
    optimizer.load_state_dict(optimizer.state_dict())
    callback.on_train_start(trainer, None)
    assert all(e.abs().sum() == 0 for e in _errors(optimizer))
    with pytest.raises(TypeError):
        OnebitCallback(True)  # keyword-only


def test_lightning_is_imported_only_by_the_adapter_and_its_absence_names_the_extra():
    code = ("import sys\n"
            "import onebit, onebit.integrations\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]\n"
            "sys.modules['lightning'] = None  # as if it were not installed\n"
            "try:\n    import onebit.integrations.lightning\nexcept ImportError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'pip install "onebit[lightning]"' in proc.stdout


if __name__ == "__main__":  # run by torchrun from the fixture above
    _ranks_main(Path(sys.argv[1]), Path(sys.argv[2]))
