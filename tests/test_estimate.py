"""onebit.estimate: byte formulas, the step model, measurements, bad input and the command line."""

from __future__ import annotations

import json
import re
import math
import subprocess
import sys

import pytest

import onebit
from onebit.estimate import (
    SCHEMES,
    TCP_ETHERNET_EFFICIENCY,
    LocalCosts,
    estimate_speedup,
    estimate_two_level,
    fp32_allreduce_bytes,
    main,
    measure_codec_gbps,
    measure_local_costs,
    onebit_allreduce_bytes,
    two_level_wire_bytes,
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


def test_overlap_backward_hides_all_buckets_but_the_last_behind_backward():
    """overlap_backward: the last bucket's transfers stay exposed, the others hide behind backward
    (two thirds of compute_s unless backward_s is given) as far as it lasts."""
    numel, n = 40_000_000, 2
    slow = estimate_speedup(numel, n, 0.1, buckets=4, compute_s=0.9, overlap_backward=True, **COSTS)
    assert slow.onebit_wire_s > 0.4  # 418 ms of wire: 314 ms would hide, backward is 600 ms
    assert slow.onebit_wire_exposed_s == pytest.approx(slow.onebit_wire_s / 4)
    short = estimate_speedup(numel, n, 0.1, buckets=4, compute_s=0.9, overlap_backward=True, backward_s=0.1, **COSTS)
    assert short.onebit_wire_exposed_s == pytest.approx(short.onebit_wire_s - 0.1)
    one = estimate_speedup(numel, n, 0.1, buckets=1, compute_s=0.9, overlap_backward=True, **COSTS)
    assert one.onebit_wire_exposed_s == one.onebit_wire_s
    with pytest.raises(ValueError, match="backward_s applies only with overlap_backward"):
        estimate_speedup(numel, n, 0.1, backward_s=0.1, **COSTS)


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


# ------------------------------------------------------------------------------------ two levels

# Hand-computed (docs: HIERARCHY.md section 2.5), one bucket of one tensor: (inter-node bytes a node
# sends each direction, intra-node bytes a rank sends). P=2, L=2, N=M=8,388,608: n=4, a row of the n
# chunks r_n = M/32 + 4 = 262,148, of the L shards r_L = M/16 + 4 = 524,292.
#   fp32: 2 (n-1)/n 4N = 6N on each ring edge; flat: 4 + 3 rows out, 1 + 3 rows in;
#   compressed: 2 L (P-1) = 4 rows out, r_L + P r_n in; node_mean: 4 rows out, 4M/2 + 2 r_n in.
# P=16, L=8, N=M=2**27: n=128, r_n = M/1024 + 4 = 131,076, r_L = M/64 + 4 = 2,097,156.
#   fp32: 8N 127/128; flat: 64*15 + 127 = 1,087 rows out, 7 + 127 in; compressed: 2*8*15 = 240 rows
#   out, 7 r_L + 7*16 r_n in; node_mean: 240 rows out, 7 * 4M/8 + 7*16 r_n in.
HAND = {
    (2, 2, 8_388_608): {"fp32": (50_331_648, 50_331_648), "flat": (1_835_036, 1_048_592),
                        "compressed": (1_048_592, 1_048_588), "node_mean": (1_048_592, 17_301_512)},
    (16, 8, 2**27): {"fp32": (1_065_353_216, 1_065_353_216), "flat": (142_479_612, 17_564_184),
                     "compressed": (31_458_240, 29_360_604), "node_mean": (31_458_240, 484_442_560)},
}
# HIERARCHY.md section 2.5's table, in units of M/8 per node (sign bytes only).
TABLE = {(2, 2): {"fp32": 48, "flat": 1 + 0.75, "compressed": 1.0, "node_mean": 1.0},
         (16, 8): {"fp32": 63.5, "flat": 7.5 + 0.99, "compressed": 1.875, "node_mean": 1.875}}


@pytest.mark.parametrize("nodes, local, numel", list(HAND))
def test_two_level_bytes_match_hand_computed_numbers(nodes, local, numel):
    assert two_level_wire_bytes(numel, nodes, local) == HAND[(nodes, local, numel)]


@pytest.mark.parametrize("nodes, local", list(TABLE))
def test_two_level_bytes_match_the_design_table(nodes, local):
    numel = 2**27
    got = two_level_wire_bytes(numel, nodes, local)
    for scheme, units in TABLE[(nodes, local)].items():
        assert got[scheme][0] / (numel / 8) == pytest.approx(units, rel=2e-3), scheme
    inter = {k: v[0] for k, v in got.items()}
    # flat / two-level: 1.75 at P=2, L=2; about 4.5 at P=16, L=8
    assert inter["flat"] / inter["compressed"] == pytest.approx(1.75 if nodes == 2 else 4.53, rel=1e-2)
    # intra-node bytes per rank: compressed 2 (L-1)/L, node_mean 32 (L-1)/L + (L-1)/L
    frac = (local - 1) / local
    assert got["compressed"][1] / (numel / 8) == pytest.approx(2 * frac, rel=1e-3)
    assert got["node_mean"][1] / (numel / 8) == pytest.approx(33 * frac, rel=1e-3)


def test_two_level_bytes_count_one_scale_per_tensor_in_each_row():
    one, many = two_level_wire_bytes(8_388_608, 2, 2), two_level_wire_bytes(8_388_608, 2, 2, segments=16)
    assert many["compressed"][0] - one["compressed"][0] == 4 * 15 * 4  # 4 rows out of the node, 15 more scales each
    assert many["fp32"] == one["fp32"]


@pytest.mark.parametrize("nodes", [2, 4])
def test_two_level_bytes_equal_flat_with_one_rank_per_node(nodes):
    got = two_level_wire_bytes(1_000_000, nodes, 1)
    assert got["compressed"] == got["node_mean"] == got["flat"]
    assert got["flat"][1] == 0 and got["fp32"][1] == 0


TWO = dict(compute_s=0.05, local_s={"fp32": 0.02, "flat": 0.03, "compressed": 0.035, "node_mean": 0.04})


def test_two_level_estimate_adds_the_intra_and_inter_stages():
    numel, gbit, intra = 8_388_608, 0.1, 2.0
    est = estimate_two_level(numel, 2, 2, gbit, intra, latency_s=1e-4, **TWO)
    assert set(est.schemes) == set(SCHEMES)
    goodput, intra_rate = gbit * 1e9 / 8 * TCP_ETHERNET_EFFICIENCY, intra * 1e9 / 8
    nbytes = two_level_wire_bytes(numel, 2, 2)
    for scheme in ("compressed", "node_mean"):
        e = est[scheme]
        assert (e.inter_node_bytes, e.intra_node_bytes) == nbytes[scheme]
        assert e.wire_s == pytest.approx(nbytes[scheme][0] / goodput + nbytes[scheme][1] / intra_rate)
        assert e.latency_s == pytest.approx(4 * 1e-4)  # 2 (P-1) + 2 (L-1) messages
        assert e.step_s == pytest.approx(0.05 + TWO["local_s"][scheme] + e.wire_s + e.latency_s)
    # flat at 100 Mbit/s is inter-bound: its wire is its inter-node bytes at the link's goodput
    assert est["flat"].wire_s == pytest.approx(nbytes["flat"][0] / goodput)
    assert est["flat"].latency_s == pytest.approx(6 * 1e-4)
    fp32 = est["fp32"]
    assert fp32.step_s == pytest.approx(0.05 + 0.02 + nbytes["fp32"][0] / goodput + 6e-4)
    assert est.as_dict()["schemes"]["flat"]["inter_node_bytes"] == nbytes["flat"][0]


def test_node_mean_beats_flat_only_when_the_node_is_much_faster_inside():
    """HIERARCHY.md section 2.6: variant A beats flat iff B_intra / B_node > 32 (L-1)/L / (F - 2 (P-1)/P),
    about 4.4 at P=16, L=8 (with A's compressed intra all-gather). Variant B wins down to a ratio of
    about 0.12 (section 2.6 says 0.3, leaving out that flat's ring all-gather also crosses the slow
    intra-node links)."""
    def wires(ratio):
        est = estimate_two_level(2**27, 16, 8, 10.0, 10.0 * ratio, **TWO)
        return {k: v.wire_s for k, v in est.schemes.items()}

    slow, fast = wires(3.0), wires(6.0)
    assert slow["node_mean"] > slow["flat"] and fast["node_mean"] < fast["flat"]
    assert wires(0.5)["compressed"] < wires(0.5)["flat"] < wires(0.5)["node_mean"]
    assert wires(0.05)["compressed"] > wires(0.05)["flat"]


def test_two_level_estimate_models_local_costs_when_not_given():
    est = estimate_two_level(8_388_608, 2, 2, 1.0, 2.0, codec_gbps=2.0, adam_step_s=0.1, onebit_step_s=0.05)
    codec = 4 * 8_388_608 / 2e9
    assert est["fp32"].local_s == pytest.approx(0.1)
    assert est["flat"].local_s == pytest.approx(0.05 + codec)
    assert est["compressed"].local_s == pytest.approx(0.05 + codec * 3.5 / 3)  # + the node server's pass
    assert est["node_mean"].local_s == pytest.approx(0.05 + codec)  # 2 + 2/L passes at L = 2
    partial = estimate_two_level(8_388_608, 2, 2, 1.0, 2.0, codec_gbps=2.0, adam_step_s=0.1, onebit_step_s=0.05,
                                 local_s={"flat": 0.5})
    assert partial["flat"].local_s == 0.5 and partial["compressed"].local_s == est["compressed"].local_s


TWO_BAD = [
    (dict(nodes=0), "nodes: 0"),
    (dict(ranks_per_node=0), "ranks_per_node: 0"),
    (dict(nodes=1, ranks_per_node=1), "nodes \\* ranks_per_node: 1"),
    (dict(inter_node_gbps=0), "inter_node_gbps: 0"),
    (dict(intra_node_gbps=-1.0), "intra_node_gbps: -1.0"),
    (dict(segments=0), "segments: 0"),
    (dict(local_s={"ddp": 0.1}), "local_s key: 'ddp'"),
    (dict(local_s={"flat": -0.1}), "local_s\\['flat'\\]: -0.1"),
]


@pytest.mark.parametrize("bad, message", TWO_BAD, ids=[m for _, m in TWO_BAD])
def test_two_level_bad_input_raises_value_error_naming_the_value(bad, message):
    args = dict(num_params=1_000_000, nodes=2, ranks_per_node=2, inter_node_gbps=1.0, intra_node_gbps=2.0,
                codec_gbps=2.0, adam_step_s=0.1, onebit_step_s=0.1)
    args.update(bad)
    with pytest.raises(ValueError, match="invalid " + message):
        estimate_two_level(**args)


def test_cli_prints_the_two_level_estimate(capsys):
    argv = ["--params", "8388608", "--world-size", "4", "--bandwidth-gbps", "0.1", "--ranks-per-node", "2",
            "--intra-gbps", "2", "--codec-gbps", "2", "--adam-step-s", "0.1", "--onebit-step-s", "0.1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "2 nodes x 2 ranks" in text and "node_mean" in text and "1,048,592" in text
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schemes"]["compressed"]["inter_node_bytes"] == 1_048_592
    with pytest.raises(SystemExit):
        main(argv[:8] + argv[10:])  # --ranks-per-node without --intra-gbps
    assert "needs --intra-gbps" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the command line (issue 44, row 8)

from onebit.estimate import REDUCE_GBPS, Measured, cached_spread, measure_spread  # noqa: E402
from onebit.estimate import cache as cache_module  # noqa: E402
from onebit.estimate.cli import build_parser  # noqa: E402

GIVEN = ["--codec-gbps", "2", "--adam-step-s", "0.1", "--onebit-step-s", "0.12"]


def test_every_flag_has_help():
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {"--reduce-gbps", "--latency-s", "--device", "--remeasure", "--no-cache"} <= {
        s for a in flags for s in a.option_strings}
    missing = [a.option_strings[0] for a in flags if not a.help or len(a.help) < 15]
    assert not missing, f"flags without help: {missing}"
    text = parser.format_help()
    assert "one-way latency per message" in text and "fp32 all-reduce's own work" in text


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_reduce_speed_follows_the_device(device):
    est = estimate_speedup(50_000_000, 8, 10, device=device, **COSTS)
    assert est.reduce_gbps == REDUCE_GBPS[device] and est.device == device
    assert est.fp32_reduce_s == pytest.approx(4 * 50_000_000 / (REDUCE_GBPS[device] * 1e9))
    assert est.speedup == estimate_speedup(50_000_000, 8, 10, reduce_gbps=REDUCE_GBPS[device], **COSTS).speedup
    # an explicit reduce_gbps wins over the device's default
    assert estimate_speedup(50_000_000, 8, 10, device=device, reduce_gbps=0.25, **COSTS).reduce_gbps == 0.25


def test_a_gpu_job_is_not_bound_by_the_cpu_reduce_speed(capsys):
    """The issue's case: GPU-like local costs on a fast link. With the CPU's reduce speed the fp32
    step is the reduce's, and the speedup is several times what the wire gives."""
    gpu = dict(codec_gbps=500.0, adam_step_s=0.002, onebit_step_s=0.002)
    cpu_default = estimate_speedup(100_000_000, 8, 100, compute_s=0.1, device="cpu", **gpu)
    cuda_default = estimate_speedup(100_000_000, 8, 100, compute_s=0.1, device="cuda", **gpu)
    assert cpu_default.fp32_reduce_s > cpu_default.fp32_wire_s  # 0.8 s of CPU reduce against 56 ms of wire
    assert cuda_default.fp32_reduce_s == 0 and cuda_default.speedup < cpu_default.speedup / 3
    argv = ["--params", "1e8", "--world-size", "8", "--bandwidth-gbps", "100", "--compute-s", "0.1",
            "--codec-gbps", "500", "--adam-step-s", "0.002", "--onebit-step-s", "0.002", "--json"]
    assert main(argv + ["--device", "cuda"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["speedup"] == pytest.approx(cuda_default.speedup)
    assert data["reduce_gbps"] is None and data["device"] == "cuda"  # infinite: null in JSON
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["speedup"] == pytest.approx(cpu_default.speedup)


def test_a_cuda_estimate_without_a_gpu_asks_for_the_costs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="cannot measure a CUDA job's local costs here.*--codec-gbps"):
        measure_spread(1000, 2, device="cuda")
    with pytest.raises(ValueError, match="cannot measure a CUDA job's local costs here"):
        estimate_speedup(1000, 2, 1.0, device="cuda", codec_gbps=2.0)
    with pytest.raises(SystemExit) as exit_info:
        main(["--params", "1e6", "--world-size", "2", "--bandwidth-gbps", "1", "--device", "cuda",
              "--cache-file", str(tmp_path / "c.json")])
    assert exit_info.value.code == 2
    assert "--adam-step-s" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("device", ["tpu", "", None, 3])
def test_an_unknown_device_is_refused(device):
    with pytest.raises(ValueError, match=f"invalid device: {re.escape(repr(device))}; expected one of 'cpu', 'cuda'"):
        estimate_speedup(1000, 2, 1.0, device=device, **COSTS)


def _fake_measurements(monkeypatch):
    """measure_spread replaced by one whose every call gives other numbers (the n-th call: codec
    n GB/s), so that two estimates agree only if the second reused the first's measurement."""
    calls = []

    def fake(num_params, world_size, *, sample, repeats, kernels, device):
        calls.append((num_params, world_size, device))
        k = len(calls)
        samples = tuple(LocalCosts(num_params, float(k) + 0.1 * i, 0.01 * (1 + i), 0.005 * (2 - i)) for i in range(3))
        return Measured(samples=samples[:repeats], device=device, threads=1, world_size=world_size,
                        measured_at=f"call {k}")

    monkeypatch.setattr(cache_module, "measure_spread", fake)
    return calls


CLI = ["--params", "4e6", "--world-size", "2", "--bandwidth-gbps", "1", "--compute-s", "0.05", "--json"]


def test_two_identical_calls_give_the_same_estimate(monkeypatch, tmp_path, capsys):
    calls = _fake_measurements(monkeypatch)
    monkeypatch.setenv("ONEBIT_CACHE_DIR", str(tmp_path))
    assert main(CLI) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(CLI) == 0
    second = json.loads(capsys.readouterr().out)
    assert len(calls) == 1 and (tmp_path / "estimate.json").exists()
    assert first["local_costs"]["source"] == "measured" and second["local_costs"]["source"] == "cache"
    assert second["speedup"] == first["speedup"] and second["codec_gbps"] == first["codec_gbps"] == 1.1
    # --remeasure measures again (other numbers here) and replaces the cached ones
    assert main(CLI + ["--remeasure"]) == 0
    assert json.loads(capsys.readouterr().out)["codec_gbps"] == 2.1 and len(calls) == 2
    assert main(CLI) == 0
    assert json.loads(capsys.readouterr().out)["codec_gbps"] == 2.1 and len(calls) == 2
    # --no-cache: measured now, the file untouched
    before = (tmp_path / "estimate.json").read_text()
    assert main(CLI + ["--no-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["local_costs"]["cache_file"] is None
    assert len(calls) == 3 and (tmp_path / "estimate.json").read_text() == before


def test_the_cache_keys_on_what_the_measurement_depends_on(monkeypatch, tmp_path):
    calls = _fake_measurements(monkeypatch)
    path = tmp_path / "sub" / "costs.json"
    a, hit_a = cached_spread(4_000_000, 2, path=path, repeats=3)
    b, hit_b = cached_spread(8_000_000, 2, path=path, repeats=3)  # another sample size
    c, hit_c = cached_spread(4_000_000, 3, path=path, repeats=3)  # another world size
    d, hit_d = cached_spread(4_000_000, 2, path=path, repeats=3)
    assert (hit_a, hit_b, hit_c, hit_d) == (False, False, False, True) and len(calls) == 3
    assert d == a
    big, hit = cached_spread(50_000_000, 2, path=path, repeats=3, sample=8_000_000)  # scaled from the 8M sample
    assert hit and big.samples[0].adam_step_s == pytest.approx(b.samples[0].adam_step_s * 50 / 8)
    assert big.median.codec_gbps == b.median.codec_gbps
    monkeypatch.setattr("torch.get_num_threads", lambda: 977)  # another thread count
    assert cached_spread(4_000_000, 2, path=path, repeats=3)[1] is False and len(calls) == 4


def test_a_damaged_cache_is_measured_again_and_rewritten(monkeypatch, tmp_path, caplog):
    calls = _fake_measurements(monkeypatch)
    path = tmp_path / "estimate.json"
    path.write_text("{not json")
    with caplog.at_level("WARNING", logger="onebit.estimate.cache"):
        _, hit = cached_spread(1_000_000, 2, path=path, repeats=2)
    assert not hit and len(calls) == 1 and "ignoring the unreadable cache" in caplog.text
    assert json.loads(path.read_text())["format"] == 1
    assert cached_spread(1_000_000, 2, path=path, repeats=2)[1] is True


def test_the_spread_of_the_runs_is_printed_with_the_speedups_at_its_ends(monkeypatch, tmp_path, capsys):
    _fake_measurements(monkeypatch)
    argv = [a for a in CLI if a != "--json"] + ["--cache-file", str(tmp_path / "c.json")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # the fake's runs: codec 1.0/1.1/1.2 GB/s, Adam 10/20/30 ms, 1-bit maths 10/5/0 ms
    assert "3 runs; median (min-max)): codec 1.10 GB/s (1.00-1.20), Adam step 20.00 ms (10.00-30.00)" in text
    assert "1-bit maths 5.00 ms (0.00-10.00)" in text and "saved in" in text
    low = estimate_speedup(4_000_000, 2, 1, compute_s=0.05, codec_gbps=1.0, adam_step_s=0.01, onebit_step_s=0.01)
    high = estimate_speedup(4_000_000, 2, 1, compute_s=0.05, codec_gbps=1.2, adam_step_s=0.03, onebit_step_s=0.0)
    assert f"over the measured spread: {low.speedup:.2f}x to {high.speedup:.2f}x" in text
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["speedup_range"] == pytest.approx([low.speedup, high.speedup])
    assert low.speedup < data["speedup"] < high.speedup
    # a cost given as a flag stays as given at both ends
    assert main(argv + ["--json", "--codec-gbps", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["codec_gbps"] == 4.0 and data["speedup_range"][0] == pytest.approx(estimate_speedup(
        4_000_000, 2, 1, compute_s=0.05, codec_gbps=4.0, adam_step_s=0.01, onebit_step_s=0.01).speedup)


def test_measured_runs_are_kept_and_scaled():
    got = measure_spread(1 << 18, 2, sample=1 << 14, repeats=3)
    assert len(got.samples) == 3 and {s.num_params for s in got.samples} == {1 << 18}
    assert got.device == "cpu" and got.world_size == 2 and got.threads >= 1
    low, high = got.bounds()
    assert low.codec_gbps <= got.median.codec_gbps <= high.codec_gbps
    assert low.onebit_step_s >= got.median.onebit_step_s >= high.onebit_step_s
    assert got.median.adam_step_s == sorted(s.adam_step_s for s in got.samples)[1]
    assert Measured.from_dict(json.loads(json.dumps(got.as_dict()))) == got


def test_a_real_measurement_is_reused_from_the_cache(tmp_path):
    path = tmp_path / "estimate.json"
    first, hit = cached_spread(1 << 14, 2, path=path, repeats=2)
    again, hit_again = cached_spread(1 << 14, 2, path=path, repeats=2)
    assert (hit, hit_again) == (False, True) and again == first


def test_local_costs_scale_linearly():
    costs = LocalCosts(1000, 3.0, 0.01, 0.02).scaled(5000)
    assert costs == LocalCosts(5000, 3.0, 0.05, 0.1)


def test_without_compute_time_the_estimate_says_it_is_an_upper_bound(capsys):
    assert estimate_speedup(1_000_000, 2, 1.0, **COSTS).upper_bound is True
    assert estimate_speedup(1_000_000, 2, 1.0, compute_s=0.1, **COSTS).upper_bound is False
    argv = ["--params", "1e6", "--world-size", "2", "--bandwidth-gbps", "1", *GIVEN]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "expected speedup of the compression phase: at most" in text and "an upper bound" in text
    assert main(argv + ["--compute-s", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "upper bound" not in text and "at most" not in text
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["upper_bound"] is True
    two = ["--params", "1e6", "--world-size", "4", "--bandwidth-gbps", "1", "--ranks-per-node", "2",
           "--intra-gbps", "10", *GIVEN]
    assert main(two) == 0
    assert "an upper bound" in capsys.readouterr().out
    assert main(two + ["--compute-s", "0.1"]) == 0
    assert "upper bound" not in capsys.readouterr().out
    assert estimate_two_level(1_000_000, 2, 2, 1.0, 10.0, **COSTS).upper_bound is True
