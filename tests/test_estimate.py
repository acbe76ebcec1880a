"""onebit.estimate: byte formulas, the step model, measurements, bad input and the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import onebit
from onebit.estimate import (
    LocalCosts,
    estimate_speedup,
    fp32_allreduce_bytes,
    main,
    measure_codec_gbps,
    measure_local_costs,
    onebit_allreduce_bytes,
)

# Fixed local costs, so that these tests measure nothing and are exact.
COSTS = dict(codec_gbps=2.0, adam_step_s=0.1, onebit_step_s=0.12)


def test_estimate_speedup_is_exported():
    assert onebit.estimate_speedup is estimate_speedup
    assert "estimate_speedup" in onebit.__all__


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("numel", [1, 1000, 33_554_432, 50_000_001])
def test_byte_formulas(numel, n):
    assert fp32_allreduce_bytes(numel, n) == (2 * (n - 1) * 4 * numel) // n
    padded = -(-numel // (8 * n)) * 8 * n
    assert onebit_allreduce_bytes(numel, n) == 2 * (n - 1) * (padded // (8 * n) + 4)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_onebit_sends_32x_fewer_bytes_on_large_buffers(n):
    numel = 1 << 25
    ideal = 2 * (n - 1) / n * numel / 8
    assert onebit_allreduce_bytes(numel, n) <= 1.0001 * ideal
    assert fp32_allreduce_bytes(numel, n) / onebit_allreduce_bytes(numel, n) == pytest.approx(32, rel=1e-3)


def test_estimate_matches_the_documented_model():
    n, numel, gbit = 4, 10_000_000, 5.0
    est = estimate_speedup(numel, n, gbit, compute_s=0.3, latency_s=1e-4, reduce_gbps=2.0, wire_efficiency=0.9, **COSTS)
    goodput = gbit * 1e9 / 8 * 0.9
    padded = -(-numel // (8 * n)) * 8 * n
    fp32 = 0.3 + 0.1 + max((2 * 3 * 4 * numel // 4) / goodput, 4 * numel / 2e9) + 6e-4
    onebit_step = 0.3 + 0.12 + 4 * padded / 2e9 + 2 * 3 * (padded // 32 + 4) / goodput + 6e-4
    assert est.baseline_step_s == pytest.approx(fp32)
    assert est.compressed_step_s == pytest.approx(onebit_step)
    assert est.speedup == pytest.approx(fp32 / onebit_step)
    assert float(est) == est.speedup
    assert est.as_dict()["world_size"] == n


def test_pipelined_buckets_hide_wire_time_behind_the_codec():
    """With k buckets, the transfers of k - 1 of them overlap the codec of the others, as far as
    the codec lasts; one bucket hides nothing; the default k is ceil(N / 2**24)."""
    numel, n, gbit = 40_000_000, 2, 1.0
    one = estimate_speedup(numel, n, gbit, buckets=1, **COSTS)
    assert one.onebit_wire_exposed_s == one.onebit_wire_s
    four = estimate_speedup(numel, n, gbit, buckets=4, **COSTS)
    assert four.codec_s > four.onebit_wire_s  # codec 80 ms, wire 42 ms: 3/4 of the wire hides
    assert four.onebit_wire_exposed_s == pytest.approx(four.onebit_wire_s / 4)
    assert four.compressed_step_s == pytest.approx(one.compressed_step_s - 0.75 * one.onebit_wire_s)
    slow_link = estimate_speedup(numel, n, 0.1, buckets=4, **COSTS)  # wire 420 ms > codec: codec-bound
    assert slow_link.onebit_wire_exposed_s == pytest.approx(slow_link.onebit_wire_s - 0.75 * slow_link.codec_s)
    assert estimate_speedup(numel, n, gbit, **COSTS).buckets == 3


def test_speedup_falls_as_bandwidth_rises():
    rates = [0.1, 0.5, 1, 2, 5, 10, 25, 100, 400]
    free_reduce = [estimate_speedup(50_000_000, 8, r, compute_s=0.2, reduce_gbps=math.inf, **COSTS).speedup
                   for r in rates]
    assert all(a > b for a, b in zip(free_reduce, free_reduce[1:]))
    assert free_reduce[0] > 5  # a slow link: compression pays a lot
    assert free_reduce[-1] < 1  # a fast link and a free all-reduce: the codec costs more than the wire saves
    # With a CPU-bound fp32 all-reduce the speedup falls while the wire sets the fp32 time, then
    # levels off once the reduce does (the 1-bit wire still shrinks a little).
    cpu_reduce = [estimate_speedup(50_000_000, 8, r, compute_s=0.2, reduce_gbps=0.5, **COSTS).speedup for r in rates]
    assert all(a > b for a, b in zip(cpu_reduce[:6], cpu_reduce[1:6]))
    assert max(cpu_reduce[5:]) / min(cpu_reduce[5:]) < 1.05


def test_more_compute_dilutes_the_speedup():
    light = estimate_speedup(30_000_000, 2, 1.0, compute_s=0.01, **COSTS).speedup
    heavy = estimate_speedup(30_000_000, 2, 1.0, compute_s=2.0, **COSTS).speedup
    assert light > heavy > 1


def test_infinite_reduce_throughput_leaves_the_reduce_out():
    est = estimate_speedup(1_000_000, 2, 10, reduce_gbps=math.inf, **COSTS)
    assert est.fp32_reduce_s == 0.0


def test_the_slower_of_wire_and_reduce_sets_the_fp32_all_reduce():
    slow_link = estimate_speedup(10_000_000, 2, 0.1, reduce_gbps=0.5, **COSTS)
    assert slow_link.baseline_step_s == pytest.approx(slow_link.adam_step_s + slow_link.fp32_wire_s + slow_link.latency_s)
    fast_link = estimate_speedup(10_000_000, 2, 400, reduce_gbps=0.5, **COSTS)
    assert fast_link.baseline_step_s == pytest.approx(fast_link.adam_step_s + fast_link.fp32_reduce_s
                                                      + fast_link.latency_s)


BAD = [
    (dict(num_params=0), "num_params: 0"),
    (dict(num_params=-3), "num_params: -3"),
    (dict(num_params=2.5), "num_params: 2.5"),
    (dict(num_params=True), "num_params: True"),
    (dict(num_params="1e6"), "num_params: '1e6'"),
    (dict(world_size=1), "world_size: 1"),
    (dict(world_size=0), "world_size: 0"),
    (dict(bandwidth_gbps=0), "bandwidth_gbps: 0"),
    (dict(bandwidth_gbps=-1.0), "bandwidth_gbps: -1.0"),
    (dict(bandwidth_gbps=math.nan), "bandwidth_gbps: nan"),
    (dict(bandwidth_gbps=math.inf), "bandwidth_gbps: inf"),
    (dict(codec_gbps=0.0), "codec_gbps: 0.0"),
    (dict(adam_step_s=-0.1), "adam_step_s: -0.1"),
    (dict(onebit_step_s=math.nan), "onebit_step_s: nan"),
    (dict(compute_s=-1), "compute_s: -1"),
    (dict(latency_s=-1e-6), "latency_s: -1e-06"),
    (dict(reduce_gbps=0), "reduce_gbps: 0"),
    (dict(wire_efficiency=1.5), "wire_efficiency: 1.5"),
    (dict(wire_efficiency=0), "wire_efficiency: 0"),
    (dict(buckets=0), "buckets: 0"),
    (dict(buckets=1.5), "buckets: 1.5"),
]


@pytest.mark.parametrize("bad, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_raises_value_error_naming_the_value(bad, message):
    args = dict(num_params=1_000_000, world_size=2, bandwidth_gbps=1.0, **COSTS)
    args.update(bad)
    with pytest.raises(ValueError, match="invalid " + message.replace("(", r"\(").replace(".", r"\.")):
        estimate_speedup(**args)


def test_measured_codec_throughput_is_positive():
    gbps = measure_codec_gbps(2, 1 << 16, repeats=2)
    assert math.isfinite(gbps) and gbps > 0


def test_local_costs_scale_with_the_parameter_count():
    costs = measure_local_costs(1 << 22, 2, sample=1 << 16, repeats=2)
    assert isinstance(costs, LocalCosts)
    assert costs.num_params == 1 << 22
    assert costs.codec_gbps > 0 and costs.adam_step_s > 0 and costs.onebit_step_s >= 0
    est = estimate_speedup(1 << 16, 2, 1.0)  # measures what it is not given
    assert est.speedup > 0 and est.codec_gbps > 0


def test_measurement_rejects_bad_sizes():
    with pytest.raises(ValueError, match="invalid numel: 0"):
        measure_codec_gbps(2, 0)
    with pytest.raises(ValueError, match="invalid world_size: 0"):
        measure_local_costs(1000, 0)


def test_cli_prints_the_estimate(capsys):
    argv = ["--params", "50e6", "--world-size", "8", "--bandwidth-gbps", "10", "--codec-gbps", "2",
            "--adam-step-s", "0.1", "--onebit-step-s", "0.1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "50.0M float32 parameters, 8 ranks, 10 Gbit/s" in text
    assert "expected speedup of the compression phase" in text
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == 50_000_000
    assert data["speedup"] == pytest.approx(
        estimate_speedup(50_000_000, 8, 10, codec_gbps=2, adam_step_s=0.1, onebit_step_s=0.1).speedup)


def test_cli_rejects_bad_input_with_the_value(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--params", "1e6", "--world-size", "1", "--bandwidth-gbps", "1", "--codec-gbps", "1"])
    assert exit_info.value.code == 2
    assert "invalid world_size: 1" in capsys.readouterr().err


def test_module_runs_as_a_script_without_warnings():
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "onebit.estimate", "--params", "1e6", "--world-size", "2",
         "--bandwidth-gbps", "1", "--codec-gbps", "2", "--adam-step-s", "0.01", "--onebit-step-s", "0.01"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "expected speedup" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr
