"""onebit.from_config: DeepSpeed-style configs (dict, JSON, YAML) -> OnebitAdam, OnebitLamb or
ZeroOneAdam with its backend."""

from __future__ import annotations

import re

import copy
import datetime
import inspect
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import short_schedules
from onebit import LocalBackend, OnebitAdam, OnebitLamb, OnebitOptimizer, ZeroOneAdam, from_config
from onebit.backends.torch_dist import TorchDistBackend
from onebit.config import config_keys, load_config, optimizer_kwargs

# DeepSpeed's own 1-bit Adam examples (docs/_tutorials/onebit-adam.md): BERT pretraining ...
BERT_PRETRAINING = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 16,
    "steps_per_print": 100,
    "prescale_gradients": False,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {
            "lr": 4e-4,
            "weight_decay": 0.01,
            "bias_correction": False,
            "freeze_step": 23000,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}
# ... and SQuAD fine-tuning.
SQUAD_FINETUNING = {
    "train_batch_size": 96,
    "train_micro_batch_size_per_gpu": 3,
    "steps_per_print": 100,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {
            "lr": 3e-5,
            "freeze_step": 400,
            "weight_decay": 0.0,
            "bias_correction": False,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True},
}


def _params():
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.zeros(3))]


def _section(**params):
    return {"optimizer": {"type": "OneBitAdam", "params": params}}


def _with_backend(config, name):
    config = copy.deepcopy(config)
    config["optimizer"]["params"]["comm_backend_name"] = name
    return config


@pytest.fixture
def gloo_group(tmp_path):
    """A one-process gloo process group (world size 1), destroyed afterwards."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _hyperparameters(opt: OnebitAdam) -> dict:
    group = opt.param_groups[0]
    return {
        "lr": group["lr"], "betas": tuple(group["betas"]), "eps": group["eps"],
        "weight_decay": group["weight_decay"], "bias_correction": group["bias_correction"],
        "freeze_step": opt.freeze_step, "bucket_size": opt.bucket_size,
    }


# ----------------------------------------------------------------------------- what it builds


def test_dict_config_sets_every_hyperparameter():
    config = _section(lr=0.005, betas=[0.8, 0.99], eps=1e-6, weight_decay=0.1, freeze_step=7,
                      bias_correction=True, bucket_size=1000, kernels="reference")
    backend = LocalBackend()
    opt = from_config(_params(), config, backend=backend)
    assert isinstance(opt, OnebitAdam) and opt.backend is backend
    assert _hyperparameters(opt) == {
        "lr": 0.005, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "bias_correction": True,
        "freeze_step": 7, "bucket_size": 1000,
    }


def test_absent_keys_take_onebitadam_defaults():
    params = _params()
    from_file = from_config(params, _section(freeze_step=5), backend=LocalBackend())
    direct = OnebitAdam(_params(), freeze_step=5, backend=LocalBackend())
    assert _hyperparameters(from_file) == _hyperparameters(direct)
    assert from_config(_params(), {"optimizer": {"type": "OneBitAdam"}}).freeze_step == OnebitAdam(_params()).freeze_step


@pytest.mark.parametrize("name", ["OneBitAdam", "OnebitAdam", "onebitadam", "ONEBITADAM"])
def test_optimizer_type_is_matched_case_insensitively(name):
    opt = from_config(_params(), {"optimizer": {"type": name, "params": {"lr": 0.5}}}, backend=LocalBackend())
    assert opt.param_groups[0]["lr"] == 0.5


def test_json_file_and_path_objects_build_the_same_optimizer(tmp_path):
    path = tmp_path / "ds_config.json"
    config = _with_backend(SQUAD_FINETUNING, "local")
    path.write_text(json.dumps(config))
    for source in (path, str(path), config):
        opt = from_config(_params(), source)
        assert opt.backend.name == "local"
        assert _hyperparameters(opt)["lr"] == 3e-5 and opt.freeze_step == 400
        assert opt.param_groups[0]["weight_decay"] == 0.0 and opt.param_groups[0]["bias_correction"] is False


def test_yaml_file_builds_the_optimizer(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "ds_config.yaml"
    path.write_text(
        "train_batch_size: 32\n"
        "optimizer:\n"
        "  type: OneBitAdam\n"
        "  params:\n"
        "    lr: 2.0e-4\n"
        "    betas: [0.9, 0.98]\n"
        "    freeze_step: 12\n"
        "    comm_backend_name: local\n"
    )
    for source in (path, tmp_path / "ds_config.yml"):
        if source.suffix == ".yml":
            source.write_text(path.read_text())
        opt = from_config(_params(), source)
        assert _hyperparameters(opt)["lr"] == 2e-4 and _hyperparameters(opt)["betas"] == (0.9, 0.98)
        assert opt.freeze_step == 12 and opt.backend.name == "local"


def test_yaml_exponent_without_a_dot_gets_a_hint(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  type: OneBitAdam\n  params:\n    lr: 1e-3\n")  # a string in YAML 1.1
    with pytest.raises(TypeError, match=r"optimizer\.params\.lr must be a number, got '1e-3'.*write e\.g\. 1\.0e-3"):
        from_config(_params(), path, backend=LocalBackend())


def test_yaml_without_pyyaml_raises_importerror_naming_the_package(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: {type: OneBitAdam}\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ImportError, match="needs PyYAML: pip install pyyaml") as info:
        from_config(_params(), path, backend=LocalBackend())
    assert isinstance(info.value.__cause__, ImportError)


def test_deepspeed_bert_pretraining_section_gives_its_keyword_arguments():
    cls, kwargs, others = optimizer_kwargs(BERT_PRETRAINING)
    assert cls is OnebitAdam
    assert kwargs == {"lr": 4e-4, "weight_decay": 0.01, "bias_correction": False, "freeze_step": 23000,
                      "cuda_aware": False, "comm_backend_name": "nccl"}
    assert others == ["fp16", "gradient_clipping", "prescale_gradients", "steps_per_print",
                      "train_batch_size", "train_micro_batch_size_per_gpu"]


@pytest.mark.parametrize("config", [BERT_PRETRAINING, SQUAD_FINETUNING], ids=["bert", "squad"])
def test_deepspeed_examples_build_on_gloo_and_keep_their_hyperparameters(gloo_group, config):
    opt = from_config(_params(), _with_backend(config, "gloo"))
    assert isinstance(opt.backend, TorchDistBackend) and opt.backend.name == "gloo"
    params = config["optimizer"]["params"]
    got = _hyperparameters(opt)
    assert (got["lr"], got["weight_decay"], got["freeze_step"]) == (params["lr"], params["weight_decay"], params["freeze_step"])


@pytest.mark.parametrize("config", [BERT_PRETRAINING, SQUAD_FINETUNING], ids=["bert", "squad"])
def test_deepspeed_examples_naming_nccl_refuse_a_gloo_process_group(gloo_group, config):
    with pytest.raises(ValueError, match=r"comm_backend_name='nccl' but the process group uses 'gloo'"):
        from_config(_params(), config)


@pytest.mark.slow
def test_deepspeed_example_naming_mpi_builds_an_mpi_backend(tmp_path):
    pytest.importorskip("mpi4py")
    path = tmp_path / "bert_mpi.json"
    path.write_text(json.dumps(_with_backend(BERT_PRETRAINING, "mpi")))
    code = (
        "import json, sys, torch, onebit\n"
        "opt = onebit.from_config([torch.nn.Parameter(torch.zeros(3))], sys.argv[1])\n"
        "print(json.dumps([type(opt.backend).__name__, opt.backend.world_size, opt.param_groups[0]['lr'], "
        "opt.freeze_step]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "ONEBIT_TEST_MPI"))}
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["MPIBackend", 1, 4e-4, 23000]


def test_other_deepspeed_sections_are_named_in_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger="onebit.config")
    opt = from_config(_params(), _with_backend(BERT_PRETRAINING, "local"))
    records = [r for r in caplog.records if r.name == "onebit.config"]
    assert len(records) == 1
    message = records[0].getMessage()
    for section in ("fp16", "gradient_clipping", "train_batch_size", "steps_per_print"):
        assert section in message
    assert opt.freeze_step == 23000


def test_an_optimizer_section_alone_logs_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="onebit.config")
    from_config(_params(), _section(lr=0.1), backend=LocalBackend())
    assert not [r for r in caplog.records if r.name == "onebit.config"]


def test_from_config_does_not_mutate_the_config():
    config = _with_backend(BERT_PRETRAINING, "local")
    config["optimizer"]["params"]["betas"] = [0.9, 0.95]
    before = copy.deepcopy(config)
    from_config(_params(), config)
    assert config == before


@pytest.mark.parametrize("kind, cls", [("OneBitAdam", OnebitAdam), ("OneBitLamb", OnebitLamb),
                                       ("ZeroOneAdam", ZeroOneAdam)])
def test_every_plain_keyword_of_the_optimizer_is_a_config_key(kind, cls):
    signature = {**inspect.signature(cls.__init__).parameters, **inspect.signature(OnebitOptimizer.__init__).parameters}
    plain = {n for n, p in signature.items() if p.kind != p.VAR_KEYWORD
             and n not in ("self", "params", "defaults", "backend", "group", "momentum_masks")}
    assert set(config_keys(cls)) == plain and OnebitOptimizer.registered()[kind] is cls
    deepspeed = {"lr", "betas", "eps", "weight_decay", "cuda_aware", "comm_backend_name"}
    deepspeed |= {
        OnebitAdam: {"freeze_step", "bias_correction"},
        OnebitLamb: {"freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
                     "factor_threshold"},
        ZeroOneAdam: {"bias_correction", "var_freeze_step", "var_update_scaler", "local_step_scaler",
                      "local_step_clipper"},
    }[cls]
    assert deepspeed <= set(config_keys(cls))


# DeepSpeed's 1-bit LAMB docs example (its tutorial's config), with the gloo backend of this machine.
LAMB_DOCS = {"optimizer": {"type": "OneBitLamb", "params": {
    "lr": 11e-3, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01, "freeze_step": 1000,
    "cuda_aware": False, "comm_backend_name": "local", "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
    "factor_threshold": 0.1}}}


@pytest.mark.parametrize("kind", ["OneBitLamb", "onebitlamb", "ONEBITLAMB", "OnebitLamb"])
def test_onebitlamb_type_is_case_insensitive_and_builds_onebitlamb(kind):
    config = copy.deepcopy(LAMB_DOCS)
    config["optimizer"]["type"] = kind
    config["optimizer"]["params"]["trust_ratio"] = "frozen"
    opt = from_config(_params(), config)
    assert type(opt) is OnebitLamb
    assert opt.freeze_step == 1000 and opt.coeff_beta == 0.9 and opt.factor_threshold == 0.1
    assert opt.trust_ratio == "frozen"
    assert opt.param_groups[0]["max_coeff"] == 0.3 and opt.param_groups[0]["lr"] == 11e-3


def test_deepspeed_s_lamb_config_asks_for_its_rule():
    """DeepSpeed's docs config sets the frozen rule's factors: under the default trust_ratio='live'
    they would be read by nothing, so the error names them and both ways out."""
    with pytest.raises(ValueError, match=r"coeff_beta=0\.9, factor_max=4\.0, factor_min=0\.5, factor_threshold=0\.1: "
                       r"read only by trust_ratio='frozen' .*Remove them, or pass trust_ratio='frozen'"):
        from_config(_params(), LAMB_DOCS)
    config = copy.deepcopy(LAMB_DOCS)
    for key in ("coeff_beta", "factor_max", "factor_min", "factor_threshold"):
        del config["optimizer"]["params"][key]
    opt = from_config(_params(), config)
    assert opt.trust_ratio == "live" and opt.param_groups[0]["max_coeff"] == 0.3


@pytest.mark.parametrize("key", ["bias_correction", "max_grad_norm", "eps_inside_sqrt", "amsgrad"])
def test_keys_deepspeed_lamb_ignored_are_refused(key):
    config = copy.deepcopy(LAMB_DOCS)
    config["optimizer"]["params"][key] = False
    with pytest.raises(ValueError, match=rf"optimizer.params.{key} is not supported by OneBitLamb .*remove '{key}'"):
        from_config(_params(), config)


def test_an_adam_only_key_is_unknown_to_lamb_and_the_message_lists_lamb_keys():
    config = copy.deepcopy(LAMB_DOCS)
    config["optimizer"]["params"]["freeze_stpe"] = 3
    with pytest.raises(ValueError, match=r"unknown key 'freeze_stpe' in optimizer.params of OneBitLamb; .*'factor_max'"):
        from_config(_params(), config)


# DeepSpeed's 0/1 Adam docs example (its tutorial's config), as written (bias_correction false: ZeroOneAdam's default).
ZOADAM_DOCS = {"optimizer": {"type": "ZeroOneAdam", "params": {
    "lr": 1e-3, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 1000, "var_update_scaler": 16,
    "local_step_scaler": 1000, "local_step_clipper": 16, "cuda_aware": False, "comm_backend_name": "nccl"}}}


def _zoadam_docs(**changes):
    """The docs example on the local backend."""
    config = copy.deepcopy(ZOADAM_DOCS)
    config["optimizer"]["params"].update(comm_backend_name="local", **changes)
    return config


@pytest.mark.parametrize("kind", ["ZeroOneAdam", "zerooneadam", "ZEROONEADAM", "ZeroOneADAM"])
def test_zerooneadam_type_is_case_insensitive_and_builds_zerooneadam(kind):
    config = _zoadam_docs()
    config["optimizer"]["type"] = kind
    opt = from_config(_params(), config)
    assert type(opt) is ZeroOneAdam and opt.backend.name == "local"
    assert (opt.var_freeze_step, opt.var_update_scaler, opt.local_step_scaler, opt.local_step_clipper) == (1000, 16, 1000, 16)
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.01 and group["betas"] == (0.9, 0.999)
    assert group["bias_correction"] is False  # the example's false: DeepSpeed's numerics, ZeroOneAdam's default
    assert opt.next_plan.name == "variance"


def test_zerooneadam_config_sets_every_hyperparameter_and_absent_keys_take_its_defaults():
    opt = from_config(_params(), _zoadam_docs(betas=[0.8, 0.98], eps=1e-6, var_freeze_step=7, var_update_scaler=2,
                                              local_step_scaler=3, local_step_clipper=4, bucket_size=1000,
                                              bias_correction=True, scale_block_size=64))
    direct = ZeroOneAdam(_params(), lr=1e-3, betas=(0.8, 0.98), eps=1e-6, weight_decay=0.01, var_freeze_step=7,
                         var_update_scaler=2, local_step_scaler=3, local_step_clipper=4, bucket_size=1000,
                         bias_correction=True, scale_block_size=64, backend=LocalBackend())
    for built in (opt, direct):
        assert built.param_groups[0]["betas"] == (0.8, 0.98) and built.param_groups[0]["eps"] == 1e-6
        assert built.param_groups[0]["bias_correction"] is True
        assert built.bucket_size == 1000 and built.scale_block_size == 64
    # The schedule decides every step's plan: the same plans from the config as from the constructor.
    assert [opt.plan_for(t).name for t in range(1, 40)] == [direct.plan_for(t).name for t in range(1, 40)]
    assert {"variance", "compressed_gradient", "local", "sync"} == {opt.plan_for(t).name for t in range(1, 40)}
    default = from_config(_params(), {"optimizer": {"type": "ZeroOneAdam", "params": {"comm_backend_name": "local"}}})
    reference = ZeroOneAdam(_params(), backend=LocalBackend())
    for key in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
        assert getattr(default, key) == getattr(reference, key)
    for key in ("lr", "betas", "eps", "weight_decay", "bias_correction"):
        assert default.param_groups[0][key] == reference.param_groups[0][key]


def test_deepspeed_zerooneadam_docs_example_keeps_its_hyperparameters_and_bias_correction():
    """DeepSpeed's example sets bias_correction false (DeepSpeed read and ignored the key); onebit's
    ZeroOneAdam implements it, off by default: false gives DeepSpeed's numerics, true corrects both
    moments, and the two train differently."""
    cls, kwargs, _ = optimizer_kwargs(ZOADAM_DOCS)
    assert cls is ZeroOneAdam and kwargs == ZOADAM_DOCS["optimizer"]["params"]
    trajectories = {}
    for value in (False, True):
        params = [torch.nn.Parameter(torch.linspace(-1.0, 1.0, 12).reshape(4, 3))]
        opt = from_config(params, _zoadam_docs(bias_correction=value, var_freeze_step=3))
        assert opt.param_groups[0]["bias_correction"] is value
        for step in range(4):
            params[0].grad = torch.full_like(params[0], 0.1 * (step + 1))
            opt.step()
        trajectories[value] = params[0].detach().clone()
    assert not torch.allclose(trajectories[False], trajectories[True])


@pytest.mark.parametrize("key", ["max_grad_norm", "eps_inside_sqrt", "amsgrad"])
def test_keys_deepspeed_zerooneadam_ignored_are_refused(key):
    assert key in ZeroOneAdam.DEEPSPEED_REFUSED
    with pytest.raises(ValueError, match=rf"optimizer.params.{key} is not supported by ZeroOneAdam .*DeepSpeed "
                                         rf"accepted and ignored it.*remove '{key}'"):
        from_config(_params(), _zoadam_docs(**{key: False}))


def test_freeze_step_in_a_zerooneadam_config_is_refused_naming_var_freeze_step():
    with pytest.raises(ValueError, match=r"optimizer.params.freeze_step is not a setting of ZeroOneAdam \(0/1 Adam "
                                         r"has no full-precision warmup; var_freeze_step is .*\): remove 'freeze_step'"):
        from_config(_params(), _zoadam_docs(freeze_step=100))


def test_a_lamb_key_is_unknown_to_zerooneadam_and_the_message_lists_its_keys():
    with pytest.raises(ValueError, match=r"unknown key 'max_coeff' in optimizer.params of ZeroOneAdam; .*"
                                         r"'local_step_clipper', 'local_step_scaler'.*'var_freeze_step'"):
        from_config(_params(), _zoadam_docs(max_coeff=0.3))
    with pytest.raises(ValueError, match=r"unknown key 'var_freeze_step' in optimizer.params of OneBitAdam"):
        from_config(_params(), _section(var_freeze_step=10), backend=LocalBackend())


def test_zerooneadam_example_builds_on_gloo(gloo_group):
    opt = from_config(_params(), _with_backend(ZOADAM_DOCS, "gloo"))
    assert type(opt) is ZeroOneAdam and isinstance(opt.backend, TorchDistBackend) and opt.backend.name == "gloo"


def test_momentum_masks_and_group_are_passed_through():
    params = _params()
    mask = torch.ones(4, 3)
    mask[0] = 0
    opt = from_config(params, _section(lr=0.1, freeze_step=1), backend=LocalBackend(), momentum_masks={params[0]: mask})
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.all(opt.state[params[0]]["exp_avg"][0] == 0)
    assert torch.all(opt.state[params[0]]["exp_avg"][1:] != 0)


def test_load_config_copies_a_mapping():
    config = _section(lr=0.1)
    loaded = load_config(config)
    assert loaded == config and loaded is not config


# ----------------------------------------------------------------------------- bad input

BAD_CONFIGS = [
    ({}, ValueError, r"config has no 'optimizer' section \(top-level keys: none\); add"),
    ({"train_batch_size": 8}, ValueError, r"no 'optimizer' section \(top-level keys: 'train_batch_size'\)"),
    ({"optimizer": ["OneBitAdam"]}, TypeError, r"config 'optimizer' must be a mapping"),
    ({"optimizer": {"params": {}}}, ValueError, r"the 'optimizer' section has no 'type'; set \"type\": \"OneBitAdam\""),
    ({"optimizer": {"type": "Adam"}}, ValueError,
     r"unsupported optimizer type 'Adam'; onebit builds 'OneBitAdam', 'OneBitLamb', 'ZeroOneAdam' or 'OneBitDiLoCo' "
     r"\(case-insensitive\)"),
    ({"optimizer": {"type": "Zero-One-Adam"}}, ValueError, r"unsupported optimizer type 'Zero-One-Adam'"),
    ({"optimizer": {"type": 1}}, TypeError, r"optimizer.type must be a string, got 1 of type int"),
    ({"optimizer": {"type": "OneBitAdam", "param": {}}}, ValueError, r"unknown keys \['param'\] in the 'optimizer' section"),
    ({"optimizer": {"type": "OneBitAdam", "params": [0.1]}}, TypeError, r"optimizer.params must be a mapping"),
    (_section(learning_rate=0.1), ValueError,
     r"unknown key 'learning_rate' in optimizer.params of OneBitAdam; expected some of 'betas', "
     r"'bias_correction', .*'lr'"),
    (_section(max_grad_norm=1.0), ValueError,
     r"optimizer.params.max_grad_norm is not supported by OneBitAdam .*remove 'max_grad_norm'"),
    (_section(amsgrad=False), ValueError,
     r"optimizer.params.amsgrad is not supported by OneBitAdam \(AMSGrad is not implemented\)"),
    (_section(eps_inside_sqrt=False), ValueError, r"optimizer.params.eps_inside_sqrt is not supported by OneBitAdam"),
    (_section(lr="0.001"), TypeError,
     r"optimizer.params.lr must be a number, got '0.001' of type str; write the number without quotes"),
    (_section(lr=None), TypeError, r"optimizer.params.lr must be a number, got None"),
    (_section(weight_decay=True), TypeError, r"optimizer.params.weight_decay must be a number, got True"),
    (_section(freeze_step=23000.0), TypeError,
     r"optimizer.params.freeze_step must be an integer \(a number of steps\) or \"auto\", got 23000.0"),
    (_section(betas=[0.9]), TypeError, r"optimizer.params.betas must be a list of two numbers \[beta1, beta2\], got \[0.9\]"),
    (_section(cuda_aware="false"), TypeError, r"optimizer.params.cuda_aware must be true or false, got 'false'"),
    (_section(comm_backend_name=5), TypeError, r"optimizer.params.comm_backend_name must be a string"),
    (_section(comm_backend_name="ncl"), ValueError, r"unknown comm_backend_name 'ncl'; expected one of 'gloo', 'hccl'"),
    (_section(lr=-1.0), ValueError, r"invalid lr: -1.0"),
    (_section(freeze_step=0), ValueError, r"invalid freeze_step: 0"),
    (_section(comm_backend_name="gloo", cuda_aware=True), ValueError, r"cuda_aware=True applies only to comm_backend_name='mpi'"),
    (_zoadam_docs(var_freeze_step=1000.0), TypeError,
     r"optimizer.params.var_freeze_step must be an integer \(a number of steps\), got 1000.0"),
    (_zoadam_docs(var_update_scaler="16"), TypeError,
     r"optimizer.params.var_update_scaler must be an integer .*, got '16' of type str; write the number without quotes"),
    (_zoadam_docs(local_step_scaler=None), TypeError, r"optimizer.params.local_step_scaler must be an integer"),
    (_zoadam_docs(local_step_clipper=True), TypeError, r"optimizer.params.local_step_clipper must be an integer"),
    (_zoadam_docs(var_freeze_step=0), ValueError, r"invalid var_freeze_step: 0; it must be >= 1"),
    (_zoadam_docs(local_step_scaler=0), ValueError, r"invalid local_step_scaler: 0; it must be >= 1"),
    (_zoadam_docs(local_step_clipper=-4), ValueError, r"invalid local_step_clipper: -4; it must be >= 1"),
    (_zoadam_docs(lr=-1.0), ValueError, r"invalid lr: -1.0"),
    (_zoadam_docs(bias_correction="false"), TypeError, r"optimizer.params.bias_correction must be true or false, got 'false'"),
    (42, TypeError, r"config must be a dict or the path of a .json/.yaml file, got int"),
    ("ds_config.txt", ValueError, r"cannot tell the format of config file 'ds_config.txt' from its suffix '.txt'"),
    ("no/such/ds_config.json", FileNotFoundError, r"config file 'no/such/ds_config.json' does not exist"),
]


@pytest.mark.parametrize("config, error, pattern", BAD_CONFIGS, ids=[p.replace("\\", "")[:48] for _, _, p in BAD_CONFIGS])
def test_bad_config_raises_with_the_fix_in_the_message(config, error, pattern):
    with pytest.raises(error, match=pattern):
        from_config(_params(), config)


@pytest.mark.parametrize("text, error, pattern", [
    ("{\"optimizer\": ", ValueError, r"is not valid JSON"),
    ("[1, 2]", TypeError, r"must hold a mapping at the top level .* got list"),
])
def test_bad_json_file_raises_naming_the_file(tmp_path, text, error, pattern):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(error, match=pattern) as info:
        from_config(_params(), path)
    assert "broken.json" in str(info.value)


def test_backend_object_and_comm_backend_name_in_the_config_conflict():
    with pytest.raises(ValueError, match=r"sets comm_backend_name='gloo' and backend= was passed too"):
        from_config(_params(), _section(comm_backend_name="gloo"), backend=LocalBackend())


def test_a_new_optimizer_needs_no_edit_to_the_config_module(fresh_optimizer_registry):
    """An optimizer defined outside the library: its CONFIG_TYPE makes it buildable from a config,
    and its refusals are read from the class (no edit to onebit/config.py)."""

    class ToyAdam(OnebitAdam):
        CONFIG_TYPE = "ToyAdam"
        DEEPSPEED_REFUSED = {**OnebitAdam.DEEPSPEED_REFUSED, "toy_knob": "the toy has no knob"}

        def __init__(self, params, lr: float = 1e-3, freeze_step: int = 1, *, toy_scale: float = 1.0, **options):
            self.toy_scale = toy_scale
            super().__init__(params, lr=lr * toy_scale, freeze_step=freeze_step, **options)

    config = {"optimizer": {"type": "toyadam", "params": {"lr": 0.5, "toy_scale": 0.1, "comm_backend_name": "local"}}}
    opt = from_config(_params(), config)
    assert type(opt) is ToyAdam and opt.toy_scale == 0.1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert "toy_scale" in config_keys(ToyAdam)
    with pytest.raises(ValueError, match=r"optimizer.params.toy_knob is not supported by ToyAdam \(the toy has no knob\)"):
        from_config(_params(), {"optimizer": {"type": "ToyAdam", "params": {"toy_knob": 1}}})
    with pytest.raises(TypeError, match=r"ToyAdam does not take toy_knob=1: the toy has no knob; remove it"):
        ToyAdam(_params(), toy_knob=1, comm_backend_name="local")
    with pytest.raises(ValueError, match=r"unsupported optimizer type 'Nope'; onebit builds .*'ToyAdam'"):
        from_config(_params(), {"optimizer": {"type": "Nope"}})


@pytest.mark.parametrize("cls", list(short_schedules()))
@pytest.mark.parametrize("key", ["max_grad_norm", "eps_inside_sqrt", "amsgrad"])
def test_every_optimizer_refuses_what_deepspeed_ignored_with_the_reason(cls, key):
    """The constructor, not only config files: OnebitAdam(max_grad_norm=1.0) names the reason."""
    why = cls.DEEPSPEED_REFUSED[key]
    with pytest.raises(TypeError, match=rf"{cls.__name__} does not take {key}=1.0: {re.escape(why)}; remove it"):
        cls(_params(), **{key: 1.0}, comm_backend_name="local")
