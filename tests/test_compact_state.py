"""Compressed optimizer state (issue 43). ``error_dtype=torch.bfloat16``: compression errors held
in bfloat16, for every optimizer of the family; ``preconditioner_dtype=torch.bfloat16``: 1-bit
Adam's and 1-bit LAMB's frozen ``1 / d`` alone, in bfloat16 (its oracle is in
``test_preconditioned.py``); the kernels that read and write both.

For ``error_dtype``: The oracle: the same optimizer with float32 errors rounded to bfloat16
after each step, which is what holding them in bfloat16 means (each new error computed in float32
from what it adds, read exactly, and rounded once); the simulations with bfloat16 errors are in
``test_optimizer_distributed.py`` and ``test_diloco.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import short_schedules, tiny_mlp
from onebit import OnebitAdam, OnebitDiLoCo, from_config
from onebit.collectives import CompressionState
from onebit.kernels import reference
from onebit.kernels.registry import get_kernels

STEPS = 12
CASES = [(cls, schedule, extra) for cls, schedule in short_schedules().items()
         for extra in ([{}, {"compression_space": "preconditioned"}, {"overlap_backward": True}]
                       # (one pass: a second compresses the first's new errors within the step)
                       if cls is not OnebitDiLoCo else [{"error_feedback": "buffer", "outer_bits": 1},
                                                        {"error_feedback": "buffer", "outer_bits": 1, "sync_delay": 1}])]


def _ids(case) -> str:
    cls, _, extra = case
    return cls.__name__ + "".join(f"-{k}={v}" for k, v in extra.items())


def _grads(model: torch.nn.Module, t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _run(cls, schedule, extra, steps=STEPS, round_errors=False, **kwargs):
    kwargs.setdefault("error_dtype", torch.float32)  # (not "auto": the defaults are compact in places)
    if cls is OnebitAdam:
        kwargs.setdefault("preconditioner_dtype", torch.float32)
    model = tiny_mlp(6, 16, 3)
    opt = cls(model.parameters(), lr=1e-2, comm_backend_name="local", weight_decay=0.01, **schedule, **extra,
              **kwargs)
    trajectory = []
    for t in range(1, steps + 1):
        _grads(model, t)
        opt.step()
        if round_errors:
            for errors in opt.compression_errors():
                for error in errors:
                    error.copy_(error.bfloat16())
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return model, opt, trajectory


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_bfloat16_errors_are_float32_errors_rounded_once_per_step(case):
    cls, schedule, extra = case
    _, opt, held = _run(cls, schedule, extra, error_dtype=torch.bfloat16)
    _, twin, rounded = _run(cls, schedule, extra, round_errors=True)
    _, _, plain = _run(cls, schedule, extra)
    for t, (a, b) in enumerate(zip(held, rounded), start=1):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), t
    errors = opt.compression_errors()
    assert errors and all(w.dtype == s.dtype == torch.bfloat16 for w, s in errors)
    assert all(torch.equal(w.float(), tw) and torch.equal(s.float(), ts)
               for (w, s), (tw, ts) in zip(errors, twin.compression_errors()))
    # float32 errors end elsewhere (the comparison above can fail)
    assert not all(torch.equal(x, y) for x, y in zip(held[-1], plain[-1]))


def test_the_reference_kernels_round_each_new_error_once():
    """The kernel rule: ``b = x (* m, clamped) + e`` with ``e`` read exactly, the new error
    ``b - s q`` computed in float32 and rounded once; the server alike."""
    gen = torch.Generator().manual_seed(0)
    n, numel = 2, 64
    x = torch.randn(numel, generator=gen)
    mult = torch.rand(numel, generator=gen) + 0.5
    error = (torch.randn(numel, generator=gen) * 0.1).bfloat16()
    for codec in ({}, {"multiplier": mult}, {"multiplier": mult, "limit": 0.7}):
        wide, packed_a, packed_b = error.float(), torch.zeros(n, numel // 8 // n, dtype=torch.uint8), \
            torch.zeros(n, numel // 8 // n, dtype=torch.uint8)
        scales_a = reference.worker_compress_(x, wide, packed_a, **codec)
        out = torch.empty_like(error)
        scales_b = reference.worker_compress_(x, error, packed_b, error_out=out, **codec)
        assert torch.equal(scales_a, scales_b) and torch.equal(packed_a, packed_b)
        assert torch.equal(out, wide.bfloat16()) and out.dtype == torch.bfloat16
        assert not torch.equal(out.float(), wide)  # (a rounding happened)
    signs = torch.randint(0, 256, (n, numel // 8), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, 1, generator=gen)
    server = (torch.randn(numel, generator=gen) * 0.1).bfloat16()
    wide = server.float()
    packed_a, packed_b = torch.zeros(numel // 8, dtype=torch.uint8), torch.zeros(numel // 8, dtype=torch.uint8)
    scale_a = reference.server_compress_(signs, scales, wide, packed_a)
    scale_b = reference.server_compress_(signs, scales, server, packed_b)
    assert torch.equal(scale_a, scale_b) and torch.equal(packed_a, packed_b) and torch.equal(server, wide.bfloat16())


def _codec_calls(kernels, error_dtype, segments, codec, in_place, gen, multiplier_dtype=torch.float32):
    """One worker and one server call of ``kernels`` on errors of ``error_dtype``: what each returns and writes."""
    n, numel = 2, 16 * 8 * 2 * 37
    bounds = torch.tensor([0, numel] if segments == 1 else [0, 16 * 80, numel], dtype=torch.int64)
    x = torch.randn(numel, generator=gen)
    x[::7] = 0.0  # (signs of zeros, and errors that cancel)
    error = (torch.randn(numel, generator=gen) * 0.3).to(error_dtype)
    mult = (torch.rand(numel, generator=gen) + 0.5).to(multiplier_dtype)
    codec = {"multiplier": mult, **({"limit": 0.9} if codec == "limit" else {})} if codec else {}
    packed = torch.zeros(n, numel // 8 // n, dtype=torch.uint8)
    out = {} if in_place else {"error_out": torch.empty_like(error)}
    scales = kernels.worker_compress_(x, error, packed, bounds=bounds, **out, **codec)
    new = error if in_place else out["error_out"]
    signs = torch.randint(0, 256, (n, numel // 8 // n), dtype=torch.uint8, generator=gen)
    server = (torch.randn(numel // n, generator=gen) * 0.3).to(error_dtype)
    server_packed = torch.zeros(numel // 8 // n, dtype=torch.uint8)
    server_scales = kernels.server_compress_(signs, torch.rand(n, bounds.numel() - 1, generator=gen), server,
                                             server_packed, bounds=bounds)
    return [scales, packed, new, server_scales, server_packed, server]


def _native_kernels():
    from onebit.kernels import cpu
    try:
        return cpu.load()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"no C++ compiler: {exc}")


@pytest.fixture(params=[False, True], ids=["vector", "scalar"])
def native(request):
    """The native CPU kernels on their AVX2 paths, then on their portable ones."""
    kernels = _native_kernels()
    kernels.force_scalar(request.param)
    yield kernels
    kernels.force_scalar(False)


def test_the_native_cpu_kernels_give_the_reference_bits(native):
    """The CPU kernels read and write bfloat16 errors themselves (AVX2 and portable paths), and a
    kernel set of float32 errors only (the CUDA kernels) runs them through a float32 copy: both
    give the reference's bits, with one segment or several, a multiplier and a limit, in place or not."""
    wide_only = dataclasses.replace(native.kernel_set(), error_dtypes=(torch.float32,))
    for segments in (1, 2):
        for codec in (None, "multiplier", "limit"):
            for in_place in (True, False):
                expected = _codec_calls(reference_kernels(), torch.bfloat16, segments, codec, in_place,
                                        torch.Generator().manual_seed(5))
                got = _codec_calls(native, torch.bfloat16, segments, codec, in_place,
                                   torch.Generator().manual_seed(5))
                assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, expected)), \
                    (segments, codec, in_place)
        for staged in (False, True):
            states = []
            for kernels in (wide_only, reference_kernels()):
                state = CompressionState(128, 1, "cpu", error_dtype=torch.bfloat16)
                state.worker_error.copy_(torch.randn(128, generator=torch.Generator().manual_seed(2)) * 0.1)
                x = torch.randn(128, generator=torch.Generator().manual_seed(3))
                state._codec(kernels, "worker", staged, lambda error, out, state=state, kernels=kernels, x=x:
                             kernels.worker_compress_(x, error, state.send[:, :16], **out))
                states.append(state)
            a, b = states
            assert torch.equal(a.send, b.send)
            got = [a.next_worker_error, b.next_worker_error] if staged else [a.worker_error, b.worker_error]
            assert torch.equal(got[0], got[1]) and got[0].dtype == torch.bfloat16


def _decode_calls(kernels, divisor_dtype, gen, keep: bool):
    n, numel = 2, 16 * 8 * 2 * 37
    bounds = torch.tensor([0, 16 * 80, numel], dtype=torch.int64)
    signs = torch.randint(0, 256, (n, numel // 8 // n), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, 2, generator=gen)
    divisor = (torch.rand(numel, generator=gen) * 4).to(divisor_dtype)
    divisor[::5] = 0.0  # (+0.0 there)
    divisor[1::5] = -0.0
    mask = torch.randint(0, 256, (numel // 8,), dtype=torch.uint8, generator=gen) if keep else None
    out = torch.full((numel,), float("nan"))
    kernels.decode_(signs, scales, out, mask, bounds=bounds, divisor=divisor)
    return out


def test_the_native_cpu_kernels_take_a_bfloat16_multiplier_and_a_divisor(native):
    """The worker's multiplier in bfloat16 (read exactly), and decode's divisor (float32 or
    bfloat16; +0.0 where it is 0): the reference's bits on the AVX2 and the portable paths."""
    for error_dtype in (torch.float32, torch.bfloat16):
        for codec in ("multiplier", "limit"):
            gen = torch.Generator().manual_seed(11)
            expected = _codec_calls(reference_kernels(), error_dtype, 2, codec, True, gen, torch.bfloat16)
            gen = torch.Generator().manual_seed(11)
            got = _codec_calls(native, error_dtype, 2, codec, True, gen, torch.bfloat16)
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), (error_dtype, codec)
    for divisor_dtype in (torch.float32, torch.bfloat16):
        for keep in (False, True):
            expected = _decode_calls(reference_kernels(), divisor_dtype, torch.Generator().manual_seed(4), keep)
            got = _decode_calls(native, divisor_dtype, torch.Generator().manual_seed(4), keep)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (divisor_dtype, keep)
            assert bool((expected == 0).any()) and not bool(expected.isnan().any())
    with pytest.raises(ValueError, match="a multiplier or a divisor, not both"):
        native.decode_(torch.zeros(1, 2, dtype=torch.uint8), torch.ones(1), torch.zeros(16),
                       multiplier=torch.ones(16), divisor=torch.ones(16))


def test_lamb_with_a_bfloat16_preconditioner_takes_either_trust_ratio():
    """1-bit LAMB holds 1 / d alone in bfloat16 too; DeepSpeed's rule (trust_ratio='frozen'),
    which compares d with a fresh denominator, derives d for its step."""
    from onebit import OnebitLamb
    for rule in ("live", "frozen"):
        _, opt, held = _run(OnebitLamb, dict(freeze_step=3), {"trust_ratio": rule}, preconditioner_dtype="bfloat16")
        _, _, wide = _run(OnebitLamb, dict(freeze_step=3), {"trust_ratio": rule})
        inverses = [entry.inverse for entry in opt._frozen_denominator._entries.values()]
        assert inverses and all(x.dtype == torch.bfloat16 for x in inverses)
        assert all(entry.flat is None for entry in opt._frozen_denominator._entries.values())
        gap = max(float((a - b).abs().max()) for a, b in zip(held[-1], wide[-1]))
        assert 0 < gap < 1e-2, (rule, gap)  # (not float32's steps, but close to them)
        assert all(torch.isfinite(p).all() for p in held[-1])


def test_a_float16_error_is_refused_by_the_kernels():
    native = _native_kernels()
    with pytest.raises(ValueError, match="an error of torch.float32 or torch.bfloat16, got torch.float32 and torch.float16"):
        native.worker_compress_(torch.zeros(16), torch.zeros(16, dtype=torch.float16), torch.zeros(2, dtype=torch.uint8))


def reference_kernels():
    return get_kernels("cpu", "reference")


def test_exact_resume_and_loads_across_precisions():
    """Errors saved from bfloat16 restore bit for bit; float32 errors loaded into a bfloat16
    optimizer are rounded once, bfloat16 ones into a float32 optimizer widened exactly."""
    schedule = dict(freeze_step=3)
    model, opt, _ = _run(OnebitAdam, schedule, {}, steps=6, error_dtype=torch.bfloat16)
    saved = {"params": [p.detach().clone() for p in model.parameters()], "state": opt.state_dict(),
             "errors": [(w.clone(), s.clone()) for w, s in opt.compression_errors()]}
    for t in range(7, 11):
        _grads(model, t)
        opt.step()
    expected = [p.detach().clone() for p in model.parameters()]

    fresh = tiny_mlp(6, 16, 3)
    with torch.no_grad():
        for p, v in zip(fresh.parameters(), saved["params"]):
            p.copy_(v)
    again = OnebitAdam(fresh.parameters(), lr=1e-2, comm_backend_name="local", weight_decay=0.01, freeze_step=3,
                       error_dtype="bfloat16", preconditioner_dtype=torch.float32)
    again.restore(saved["state"], saved["errors"])
    for t in range(7, 11):
        _grads(fresh, t)
        again.step()
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), expected))

    wide = OnebitAdam(tiny_mlp(6, 16, 3).parameters(), lr=1e-2, comm_backend_name="local", freeze_step=3,
                      error_dtype=torch.float32)
    wide.restore(saved["state"], saved["errors"])
    assert all(w.dtype == torch.float32 and torch.equal(w, sw.float()) for (w, _), (sw, _) in
               zip(wide.compression_errors(), saved["errors"]))
    float32_errors = [(w + 1e-3 * torch.rand_like(w), s) for w, s in wide.compression_errors()]
    narrow = OnebitAdam(tiny_mlp(6, 16, 3).parameters(), lr=1e-2, comm_backend_name="local", freeze_step=3,
                        error_dtype=torch.bfloat16)
    narrow.restore(saved["state"], float32_errors)
    assert all(w.dtype == torch.bfloat16 and torch.equal(w, fw.bfloat16()) for (w, _), (fw, _) in
               zip(narrow.compression_errors(), float32_errors))


def test_bfloat16_errors_hold_half_the_bytes():
    def held(opt):
        return sum(w.nbytes + s.nbytes for w, s in opt.compression_errors())
    narrow = _run(OnebitAdam, dict(freeze_step=2), {}, steps=3, error_dtype=torch.bfloat16)[1]
    wide = _run(OnebitAdam, dict(freeze_step=2), {}, steps=3)[1]
    assert 2 * held(narrow) == held(wide) > 0


@pytest.mark.parametrize("value,pattern", [
    (torch.float16, "invalid error_dtype: torch.float16"),
    ("bf16", "invalid error_dtype: 'bf16'"),
    (torch.float64, "'auto' .the default., torch.float32 or torch.bfloat16"),
])
def test_bad_values_are_refused(value, pattern):
    with pytest.raises(ValueError, match=pattern):
        OnebitAdam(tiny_mlp(6, 16, 3).parameters(), comm_backend_name="local", freeze_step=2, error_dtype=value)


def test_not_with_hierarchy():
    with pytest.raises(ValueError, match="error_dtype='bfloat16' does not work with hierarchy=2"):
        OnebitAdam(tiny_mlp(6, 16, 3).parameters(), comm_backend_name="local", freeze_step=2, error_dtype="bfloat16",
                   hierarchy=2)


def test_from_a_config_file():
    params = {"lr": 1e-3, "freeze_step": 2, "comm_backend_name": "local", "error_dtype": "bfloat16"}
    config = {"optimizer": {"type": "OneBitAdam", "params": params}}
    opt = from_config(tiny_mlp(6, 16, 3).parameters(), config)
    assert opt.error_dtype is torch.bfloat16
    config["optimizer"]["params"]["error_dtype"] = 16
    with pytest.raises((TypeError, ValueError), match="error_dtype"):
        from_config(tiny_mlp(6, 16, 3).parameters(), config)


def test_widened_products_equal_the_whole_ones():
    """The chunked forms of ``out += v a float(b)`` and ``a * float(b)`` (a bfloat16 ``b`` widened a
    chunk at a time): the numbers of widening it all first, across chunk boundaries and tensor sizes."""
    from onebit import functional as F
    gen = torch.Generator().manual_seed(0)
    sizes = [5, 3000, 7, 10, 2500, 999, 1]
    outs = [torch.randn(n, generator=gen) for n in sizes]
    a = [torch.randn(n, generator=gen) for n in sizes]
    b = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    want = [torch.addcmul(o, x, y.float(), value=-0.3) for o, x, y in zip(outs, a, b)]
    F.addcmul_widened_(outs, a, b, -0.3, chunk=1000)
    assert all(torch.equal(x, y) for x, y in zip(outs, want))
    flat_a, flat_b = torch.cat(a), torch.cat(b)
    out = torch.empty_like(flat_a)
    assert torch.equal(F.mul_widened(flat_a, flat_b, out, chunk=1000), flat_a * flat_b.float())


def test_the_double_average_digests_tell_equal_gradients_from_close_ones():
    """The first steps keep digests of a rank's gradients, not a copy: the average of equal
    gradients matches them (on 3 ranks: rounded in its last bits); gradients 1e-4 apart, whose
    plain sums and norms would agree within 1e-6, do not match."""
    from onebit.health import chunk_digests, digests_match
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(600_000, generator=gen)
    assert digests_match(chunk_digests((g + g + g) / 3), chunk_digests(g))
    d = torch.randn(600_000, generator=gen) * 1e-4 * float(g.abs().mean())
    for local in (g + d, g - d):
        assert not digests_match(chunk_digests(g), chunk_digests(local))
    assert not digests_match(chunk_digests(torch.zeros_like(g)), chunk_digests(g))
    assert digests_match(chunk_digests(torch.zeros(10)), chunk_digests(torch.zeros(10)))
