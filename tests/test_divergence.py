"""A run going wrong says so: skipped steps in a row and compression errors out of proportion to
the momentum are warned about once per episode (or raised with ``divergence='raise'``)."""

from __future__ import annotations

import logging

import pytest
import torch

import onebit.kernels as kernels
import onebit.kernels.registry as registry
from conftest import seeded_params
from onebit import OnebitAdam
from onebit.kernels import REFERENCE, KernelSet, reference
from onebit.health import ERROR_RATIO_TO_WARN, HEALTH_CHECK_INTERVAL, SKIPS_TO_WARN


def _opt(**kwargs):
    params = seeded_params(300, 40)
    return params, OnebitAdam(params, lr=1e-3, freeze_step=2, comm_backend_name="local", kernels="reference", **kwargs)


def _step(params, opt, bad: bool = False):
    for p in params:
        p.grad = torch.randn_like(p)
    if bad:
        params[1].grad[3] = float("nan")
    opt.step()


def _warnings(caplog, text):
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.message]


def test_skipped_steps_in_a_row_warn_once_per_episode(caplog):
    params, opt = _opt()
    with caplog.at_level(logging.WARNING, logger="onebit"):
        _step(params, opt)
        for k in range(SKIPS_TO_WARN + 2):
            _step(params, opt, bad=True)
            assert opt.comm_stats()["skipped_in_a_row"] == k + 1
        assert len(_warnings(caplog, "in a row were skipped for non-finite gradients")) == 1
        message = _warnings(caplog, "in a row were skipped")[0].message
        assert f"{SKIPS_TO_WARN} step() calls" in message and "at step 2" in message
        _step(params, opt)  # an applied step ends the episode, and says so
        assert opt.comm_stats()["skipped_in_a_row"] == 0
        assert len(_warnings(caplog, "applied after 5 skipped steps in a row")) == 1
        for _ in range(SKIPS_TO_WARN):
            _step(params, opt, bad=True)
    assert len(_warnings(caplog, "in a row were skipped for non-finite gradients")) == 2


def test_fewer_skips_than_the_threshold_stay_quiet(caplog):
    params, opt = _opt()
    with caplog.at_level(logging.WARNING, logger="onebit"):
        for _ in range(4):
            for _ in range(SKIPS_TO_WARN - 1):
                _step(params, opt, bad=True)
            _step(params, opt)
    assert not _warnings(caplog, "skipped")
    assert opt.step_count == 4


def test_divergence_raise_raises_on_the_threshold_without_changing_anything():
    params, opt = _opt(divergence="raise")
    _step(params, opt)
    for _ in range(SKIPS_TO_WARN - 1):
        _step(params, opt, bad=True)
    before = [p.detach().clone() for p in params]
    with pytest.raises(FloatingPointError, match=r"3 step\(\) calls in a row were skipped.*divergence='raise'"):
        _step(params, opt, bad=True)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert opt.step_count == 1


def test_a_healthy_run_reports_its_error_ratio_and_stays_quiet(caplog):
    params, opt = _opt()
    with caplog.at_level(logging.WARNING, logger="onebit"):
        for _ in range(2 + 3 * HEALTH_CHECK_INTERVAL + 1):
            _step(params, opt)
    ratio = opt.comm_stats()["error_to_momentum"]
    # 1-bit quantization of Gaussian-like momenta leaves an error of about 0.75 of the momentum.
    assert ratio is not None and 0.3 < ratio < 2.0
    assert not _warnings(caplog, "")


@pytest.fixture
def lossy_kernels():
    """A broken codec whose decode loses the scale (the agreed momentum is 1000 times smaller than
    what the workers compressed): error feedback no longer tracks anything that arrives."""

    def decode(signs, scales, out, keep=None, *, bounds=None):
        reference.decode_(signs, scales, out, keep, bounds=bounds)
        return out.mul_(1e-3)

    kernels.register("test-lossy", lambda: KernelSet("test-lossy", REFERENCE.worker_compress_,
                                                     REFERENCE.server_compress_, decode))
    yield "test-lossy"
    registry._LOADERS.pop("test-lossy", None)
    registry._LOADED.pop("test-lossy", None)


def _mixed_run(kernel_name, divergence, steps):
    """A large tensor with unit gradients and a small one whose gradients are 1e-4 of them."""
    params = seeded_params(300, 40)
    opt = OnebitAdam(params, lr=1e-3, freeze_step=2, comm_backend_name="local", kernels=kernel_name,
                     divergence=divergence)
    for _ in range(steps):
        params[0].grad = torch.randn(300)
        params[1].grad = torch.randn(40) * 1e-4
        opt.step()
    return params, opt


def test_per_tensor_scales_keep_a_small_tensor_healthy(caplog):
    with caplog.at_level(logging.WARNING, logger="onebit"):
        _, opt = _mixed_run("reference", "warn", 2 + 2 * HEALTH_CHECK_INTERVAL + 1)
    assert opt.comm_stats()["error_to_momentum"] < 2.0
    assert not _warnings(caplog, "")


def test_errors_out_of_proportion_are_warned_about_once(caplog, lossy_kernels):
    with caplog.at_level(logging.WARNING, logger="onebit"):
        _, opt = _mixed_run(lossy_kernels, "warn", 2 + 4 * HEALTH_CHECK_INTERVAL + 1)
    assert len(_warnings(caplog, "times its momentum's norm")) == 1
    assert opt.comm_stats()["error_to_momentum"] > ERROR_RATIO_TO_WARN


def test_errors_out_of_proportion_raise_with_divergence_raise(lossy_kernels):
    with pytest.raises(FloatingPointError, match=r"error norm of a tensor is .* times its momentum"):
        _mixed_run(lossy_kernels, "raise", 2 + 4 * HEALTH_CHECK_INTERVAL + 1)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(divergence="loud"), r"invalid divergence: 'loud'; expected one of 'warn', 'raise'"),
        (dict(scale_block_size=0), r"invalid scale_block_size: 0; it must be a positive int"),
        (dict(scale_block_size=True), r"invalid scale_block_size: True"),
        (dict(scale_block_size=2.5), r"invalid scale_block_size: 2.5"),
    ],
)
def test_bad_divergence_and_scale_block_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        OnebitAdam([torch.nn.Parameter(torch.zeros(3))], freeze_step=1, comm_backend_name="local", **kwargs)
