"""The peer benchmark's smoke test: ``benchmarks/slowlink.py --quick`` (loopback, small model) in a
subprocess with a hard timeout, the run averages' arithmetic, and the namespace helper's setup and
teardown where root allows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from onebit.compression import padded_length

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ZOADAM_KINDS = {  # what is recorded: (the kind of step timed, the kind of the step before it)
    "zoadam_variance": ("variance", "compressed_gradient"),
    "zoadam_compressed_gradient": ("compressed_gradient", "compressed_gradient"),
    "zoadam_compressed_gradient_after_variance": ("compressed_gradient", "variance"),
    "zoadam_local": ("local", "sync"),
    "zoadam_sync": ("sync", "local"),
}
CONFIGS = {"adam", "powersgd1", "powersgd4", "onebit_warmup", "onebit_compression", *ZOADAM_KINDS}


def _bench_module(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("quick")
    try:
        proc = subprocess.run([sys.executable, str(BENCH / "slowlink.py"), "--quick", "--out-dir", str(out)],
                              capture_output=True, text=True, timeout=240, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"slowlink.py --quick did not finish in {exc.timeout} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    markdown = (out / "quick.md").read_text()
    assert markdown.startswith("# onebit vs peers")
    return {**json.loads((out / "quick.json").read_text()), "markdown": markdown}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_times_every_configuration(quick):
    assert quick["quick"] is True and quick["machine"]["cores"] >= 1
    (run,) = quick["runs"]
    summary = run["summary"]
    assert set(summary["configs"]) == CONFIGS
    for name, row in summary["configs"].items():
        assert len(row["steps_s"]) == summary["rounds"], name
        assert 0 < row["step_s"] < 60, name
        assert row["fwd_bwd_s"] > 0 and row["opt_s"] > 0, name
        assert row["speedup_vs_adam"] > 0, name
    assert summary["configs"]["onebit_warmup"]["phase"] == "warmup"
    assert summary["configs"]["onebit_compression"]["phase"] == "compression"
    assert summary["local_costs"]["codec_gbps"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_compression_bytes_are_near_the_1bit_ideal(quick):
    summary = quick["runs"][0]["summary"]
    ideal, fp32 = summary["ideal_1bit_bytes"], summary["fp32_ring_bytes"]
    assert ideal == pytest.approx(2 * (summary["world_size"] - 1) / summary["world_size"] * summary["numel"] / 8)
    compression = summary["configs"]["onebit_compression"]
    for sent in compression["stats_bytes_per_rank"]:
        assert ideal <= sent <= 1.05 * ideal
        assert fp32 / sent >= 30
    warmup = summary["configs"]["onebit_warmup"]
    for sent in warmup["stats_bytes_per_rank"]:
        assert sent == pytest.approx(fp32, rel=0.01)
    profile = compression["profile_s"]
    assert {"codec_worker", "codec_server", "codec_decode", "comm", "compress_input", "update"} <= set(profile)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_times_each_kind_of_zoadam_step(quick):
    summary = quick["runs"][0]["summary"]
    ideal, fp32 = summary["ideal_1bit_bytes"], summary["fp32_ring_bytes"]
    for name, (kind, before) in ZOADAM_KINDS.items():
        row = summary["configs"][name]
        assert row["kinds"] == [[kind, before]], name  # every timed step, on every rank, of its kind
        for sent in row["stats_bytes_per_rank"]:
            if kind == "variance":
                assert sent == pytest.approx(fp32, rel=0.01), name
            elif kind == "local":
                assert sent == 0 and row["collectives"] == 0, name
            else:
                assert ideal <= sent <= 1.05 * ideal, name
    averages = summary["run_average"]["optimizers"]
    assert set(averages) == {"adam", "onebit", "zoadam"}
    assert averages["zoadam"]["counts"] == {"variance": 49, "compressed_gradient_after_variance": 33,
                                            "compressed_gradient": 38, "local": 365, "sync": 115}
    # 0/1 Adam sends less than 1-bit Adam over the run: mostly local steps, no fp32 warmup
    assert averages["zoadam"]["stats_bytes_per_step"] < averages["onebit"]["stats_bytes_per_step"]
    assert "0/1 Adam vs 1-bit Adam over the run" in quick["markdown"]


def test_run_average_weights_each_kind_by_its_count_in_the_schedule():
    run_average = _bench_module("run_average")
    schedule = run_average.parse_schedule("steps=10,var_freeze_step=4,var_update_scaler=2,local_step_scaler=1,"
                                          "local_step_clipper=2")
    assert schedule["freeze_step"] == 4  # OnebitAdam freezes with ZeroOneAdam unless told otherwise
    counts = run_average.schedule_counts(schedule)
    # ZeroOneAdam.plan_for: steps 1, 2 and 3 variance, 4 compressed_gradient; then H = 1 (step 5),
    # 2 (steps 6-10: syncs at 7 and 9)
    assert counts["zoadam"] == {"variance": 3, "compressed_gradient_after_variance": 1, "compressed_gradient": 0,
                                "local": 3, "sync": 3}
    assert counts["onebit"] == {"warmup": 4, "compression": 6} and counts["adam"] == {"step": 10}

    def row(step_s, sent=None, collectives=None, rounds=(1.0, 2.0)):
        r = {"step_s": step_s, "steps_s": [step_s * f for f in rounds], "step_s_quartiles": (step_s, step_s),
             "fwd_bwd_s": step_s / 2, "opt_s": step_s / 2}
        if sent is not None:
            r.update(stats_bytes_per_rank=[sent, sent], collectives=collectives,
                     link_per_rank=[{"tcp_payload_bytes": sent + 10}, {"tcp_payload_bytes": sent}])
        return r

    summary = {"configs": {
        "adam": row(1.0), "onebit_warmup": row(1.0, 400, 1), "onebit_compression": row(0.2, 12, 3),
        "zoadam_variance": row(1.0, 400, 1), "zoadam_compressed_gradient_after_variance": row(2.0, 12, 3),
        "zoadam_local": row(0.1, 0, 0), "zoadam_sync": row(0.3, 12, 3, rounds=(1.0, 4.0)),
        # zoadam_compressed_gradient is not timed: the schedule has none, so it is not needed
    }}
    run_average.add_run_average(summary, schedule)
    ra = summary["run_average"]
    zo, ob, adam = (ra["optimizers"][k] for k in ("zoadam", "onebit", "adam"))
    assert zo["step_s"] == pytest.approx((3 * 1.0 + 2.0 + 3 * 0.1 + 3 * 0.3) / 10)
    assert ob["step_s"] == pytest.approx((4 * 1.0 + 6 * 0.2) / 10)
    assert zo["run_s"] == pytest.approx(zo["step_s"] * 10)
    assert zo["stats_bytes_per_step"] == pytest.approx((3 * 400 + 4 * 12) / 10)
    assert zo["tcp_payload_bytes_per_step"] == pytest.approx((3 * 410 + 4 * 22 + 3 * 10) / 10)  # the busier rank
    assert zo["collectives_per_step"] == pytest.approx((3 * 1 + 4 * 3) / 10)
    assert adam["stats_bytes_per_step"] is None and adam["collectives_per_step"] is None
    # round 2: every time doubles, the syncs' quadruple
    assert zo["step_s_by_round"][1] == pytest.approx((3 * 2.0 + 4.0 + 3 * 0.2 + 3 * 1.2) / 10)
    cmp = ra["zoadam_vs_onebit"]
    assert cmp["speedup"] == pytest.approx(ob["step_s"] / zo["step_s"])
    assert cmp["speedup_paired_median"] == pytest.approx(
        (ob["step_s"] / zo["step_s"] + 2 * ob["step_s"] / zo["step_s_by_round"][1]) / 2)
    assert cmp["zoadam_not_slower"] is (zo["step_s"] <= ob["step_s"])
    assert ob["speedup_vs_adam"] == pytest.approx(1.0 / ob["step_s"])
    text = "\n".join(run_average.run_average_markdown(summary, {}))
    assert "| ZeroOneAdam (0/1 Adam) | local (`zoadam_local`) | 3 |" in text
    assert "1-bit / 0/1 =" in text

    # a kind of step the schedule needs but the run did not time: no average for that optimizer
    del summary["configs"]["zoadam_local"]
    run_average.add_run_average(summary, schedule)
    assert set(summary["run_average"]["optimizers"]) == {"adam", "onebit"}


def test_run_average_of_the_bfloat16_warmup_uses_its_own_warmup_row():
    run_average = _bench_module("run_average")
    schedule = run_average.parse_schedule("steps=10,freeze_step=4")
    rows = {name: {"step_s": s, "steps_s": [s], "stats_bytes_per_rank": [b], "collectives": 2}
            for name, s, b in (("adam", 1.0, 0), ("onebit_warmup", 1.0, 400), ("onebit_warmup_bf16", 0.6, 200),
                               ("onebit_compression", 0.2, 12))}
    summary = {"configs": rows}
    run_average.add_run_average(summary, schedule)
    optimizers = summary["run_average"]["optimizers"]
    assert optimizers["onebit_bf16"]["step_s"] == pytest.approx((4 * 0.6 + 6 * 0.2) / 10)
    assert optimizers["onebit_bf16"]["stats_bytes_per_step"] == pytest.approx((4 * 200 + 6 * 12) / 10)
    assert optimizers["onebit"]["step_s"] == pytest.approx((4 * 1.0 + 6 * 0.2) / 10)


def test_autofreeze_cost_writes_the_check_time(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "autofreeze_cost.py"), "--params", "2e5", "--width", "128",
                           "--repeats", "3", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "autofreeze_cost.json").read_text())
    assert 0 < result["check_ms_median"] and result["per_step_ms"] == pytest.approx(result["check_ms_median"] / 10)
    assert "per warmup step" in (tmp_path / "autofreeze_cost.md").read_text()


@pytest.mark.parametrize("text, message", [
    ("steps=0", "must be >= 1"), ("steps=ten", "is not an int"), ("freeze=3", "key one of"), ("steps", "key one of"),
])
def test_run_schedule_rejects_bad_input(text, message):
    run_average = _bench_module("run_average")
    with pytest.raises(ValueError, match=message):
        run_average.parse_schedule(text)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_scaling_does_not_grow_with_tensors(quick):
    rows = quick["scaling"]
    assert {(r["world_size"], r["tensors"]) for r in rows} == {(n, t) for n in (2, 3, 4) for t in (10, 1000)}
    by_world = {}
    for r in rows:
        assert r["buckets"] == 1
        # Every tensor carries its own float32 scale in each wire row: the bytes grow by those
        # (8 (n-1) per tensor) and by each tensor's padding to a multiple of 8n, nothing else.
        n, per = r["world_size"], r["numel"] // r["tensors"]
        assert per * r["tensors"] == r["numel"]  # equal tensors in the scaling model
        assert r["scale_bytes"] == 8 * (n - 1) * r["tensors"]
        signs = 2 * (n - 1) * r["tensors"] * padded_length(per, n) // (8 * n)
        flag = 2 * (n - 1) * 12 // n  # the flag's all-reduce (finiteness, error ratio, missing gradients)
        # exactly the padded signs (1 bit per element; 100-element tensors pad to 112, 120 or 128),
        # the scales and the flag
        assert r["compression_bytes"] == signs + r["scale_bytes"] + flag
        by_world.setdefault(r["world_size"], set()).add(r["compression_collectives"])
    for world, values in by_world.items():
        assert len(values) == 1, f"collectives depend on the tensor count at {world} ranks: {values}"


def test_slowlink_rejects_a_single_rank():
    sys.path.insert(0, str(BENCH))
    try:
        import netns
    finally:
        sys.path.remove(str(BENCH))
    with pytest.raises(ValueError, match="world_size=1"):
        netns.SlowLink(1, 1.0)
    with pytest.raises(ValueError, match="rate_gbit must be > 0"):
        netns.SlowLink(2, 0)


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.timeout(60)
def test_slowlink_namespaces_are_removed_afterwards():
    sys.path.insert(0, str(BENCH))
    try:
        import netns
    finally:
        sys.path.remove(str(BENCH))
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)

    link = netns.SlowLink(2, 1.0, tag="t" + str(id(_netns_names) % 100000))
    try:
        with link:
            assert set(link.namespaces) <= _netns_names()
            qdisc = subprocess.run(["tc", "-n", link.namespaces[0], "qdisc", "show", "dev", link.ifnames[0]],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "rate 1Gbit" in qdisc
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert not set(link.namespaces) & _netns_names()


def test_slowlink_nodes_of_several_ranks_share_a_namespace():
    netns = _bench_module("netns")
    link = netns.SlowLink(4, 0.1, ranks_per_node=2, tag="unused")
    assert link.nodes == 2 and len(link.namespaces) == 2 and link.hub is None
    assert [link.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert link.master_addr == link.address(0)
    assert netns.SlowLink(4, 0.1, tag="unused").namespaces == [f"obunusedr{r}" for r in range(4)]  # default: a rank each
    for bad in (3, 0, 4, True, 1.0):
        with pytest.raises(ValueError, match="ranks_per_node must be a positive int dividing world_size=4"):
            netns.SlowLink(4, 1.0, ranks_per_node=bad)


def _run_two_node_quick(script: str, out: Path) -> None:
    """``benchmarks/<script> --quick --out-dir out`` (skipped without network namespaces): it must
    finish in time, succeed and leave no namespace behind."""
    reason = _bench_module("netns").unavailable_reason()
    if reason:
        pytest.skip(reason)
    before = _netns_names()
    try:
        proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--out-dir", str(out)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} --quick did not finish in {exc.timeout} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _netns_names() == before, "namespaces left behind"


@pytest.fixture(scope="module")
def hierarchy_quick(tmp_path_factory) -> dict:
    """``benchmarks/hierarchy.py --quick``: 2 nodes x 2 ranks in two namespaces, 1 Gbit/s between them."""
    out = tmp_path_factory.mktemp("hierarchy")
    _run_two_node_quick("hierarchy.py", out)
    markdown = (out / "hierarchy_quick.md").read_text()
    assert markdown.startswith("# Two-level 1-bit all-reduce: 2 nodes x 2 ranks")
    return {**json.loads((out / "hierarchy_quick.json").read_text()), "markdown": markdown}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hierarchy_quick_times_every_scheme_and_counts_bytes_per_node(hierarchy_quick):
    (run,) = hierarchy_quick["runs"]
    assert run["rate_gbit"] == 1.0 and run["nodes"] == 2 and run["ranks_per_node"] == 2
    assert run["intra_gbps_measured"] > 0
    schemes = run["schemes"]
    assert set(schemes) == {"adam", "flat", "compressed", "node_mean"}
    for name, row in schemes.items():
        assert len(row["steps_s"]) == run["rounds"] and 0 < row["step_s"] < 60, name
        assert [v["node"] for v in row["veth_per_node"]] == [0, 1], name
        for v in row["veth_per_node"]:
            # the model's bytes, plus headers, barriers and the finiteness flag (a few KB)
            assert row["estimate_inter_node_bytes"] <= v["tx_payload_bytes"] <= 1.2 * row["estimate_inter_node_bytes"] + 4096
        assert row["estimate_step_s"] > 0, name
    for name in ("compressed", "node_mean"):
        for node in schemes[name]["stats_per_node"]:  # comm_stats' inter-node count is exactly the model's
            assert node["inter_node_bytes_sent"] == schemes[name]["estimate_inter_node_bytes"]
            assert node["intra_node_bytes_sent"] == 2 * schemes[name]["estimate_intra_node_bytes"]
    assert "inter_node_bytes_sent" not in schemes["flat"]["stats_per_node"][0]
    assert {t["target"] for t in hierarchy_quick["targets"]} >= {"inter-node bytes <= 0.6x flat's"}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hierarchy_quick_two_level_sends_fewer_bytes_between_nodes(hierarchy_quick):
    schemes = hierarchy_quick["runs"][0]["schemes"]
    for name in ("compressed", "node_mean"):
        for hier, flat, ddp in zip(schemes[name]["veth_per_node"], schemes["flat"]["veth_per_node"],
                                   schemes["adam"]["veth_per_node"]):
            assert hier["tx_bytes"] < 0.7 * flat["tx_bytes"] and hier["rx_bytes"] < 0.7 * flat["rx_bytes"], name
            assert hier["tx_bytes"] < flat["tx_bytes"] < ddp["tx_bytes"] / 10, name
        assert schemes[name]["veth_bytes_vs_flat"] < 0.7
    # node_mean moves float32 shards inside the node: its loopback carries far more than compressed's
    assert schemes["node_mean"]["veth_per_node"][0]["lo_tx_bytes"] > 5 * schemes["compressed"]["veth_per_node"][0]["lo_tx_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hsdp_quick_onebit_sends_a_fraction_of_hsdp_adamw_bytes_and_keeps_half_the_state(tmp_path):
    """``benchmarks/hsdp.py --quick``: the 2 x 2 HSDP layout on two emulated nodes at 1 Gbit/s."""
    _run_two_node_quick("hsdp.py", tmp_path)
    assert (tmp_path / "hsdp_quick.md").read_text().startswith("# HSDP recipe: 2 nodes x 2 ranks")
    (run,) = json.loads((tmp_path / "hsdp_quick.json").read_text())["runs"]
    assert run["rate_gbit"] == 1.0 and run["nodes"] == 2 and run["ranks_per_node"] == 2
    configs = run["configs"]
    assert set(configs) == {"hsdp_adamw", "hsdp_onebit", "ddp_onebit"}
    for name, row in configs.items():
        assert len(row["steps_s"]) == run["rounds"] and 0 < row["step_s"] < 60, name
        assert [v["node"] for v in row["veth_per_node"]] == [0, 1], name
        for v in row["veth_per_node"]:  # the model's payload, plus headers, barriers and flags
            assert row["model_inter_node_bytes"] <= v["tx_payload_bytes"] <= 1.3 * row["model_inter_node_bytes"] + 8192
    onebit, adamw, ddp = configs["hsdp_onebit"], configs["hsdp_adamw"], configs["ddp_onebit"]
    # the replicate all-reduce is the only traffic between the nodes: comm_stats counts the model's bytes and
    # the finiteness flag's all-reduce (12 bytes per rank)
    for sent in onebit["stats_bytes_sent_per_node"]:
        assert onebit["model_inter_node_bytes"] <= sent <= onebit["model_inter_node_bytes"] + 64
    # 1-bit across the slow dimension; the quick model is small, so barriers and scales weigh more than at 4.2M
    for hsdp, native in zip(onebit["veth_per_node"], adamw["veth_per_node"]):
        assert hsdp["tx_bytes"] < native["tx_bytes"] / 20 and hsdp["rx_bytes"] < native["rx_bytes"] / 20
    # its warmup step all-reduces full precision: about HSDP + AdamW's bytes
    assert onebit["veth_per_node"][0]["untimed_phases"] == ["warmup", "compression"]
    assert onebit["veth_per_node"][0]["untimed_both_bytes"][0] == pytest.approx(adamw["veth_both_bytes_max"], rel=0.05)
    # the recipe's optimizer holds its shard's state: half the unsharded optimizer's
    # (AdamW's adds a 4-byte step per tensor)
    assert onebit["state_vs_ddp_onebit"] <= 0.55
    assert onebit["state_bytes_max"] == pytest.approx(adamw["state_bytes_max"], abs=4 * run["tensors"])
    assert ddp["state_keys"] == onebit["state_keys"]
    assert {t["target"] for t in json.loads((tmp_path / "hsdp_quick.json").read_text())["targets"]} >= {
        "optimizer state per rank <= 0.55x the unsharded optimizer's (ddp_onebit)"}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_diloco_workers_quick_inner_steps_stay_inside_the_nodes(tmp_path):
    """``benchmarks/diloco_workers.py --quick``: OnebitDiLoCo with workers of 2 ranks (DDP or FSDP2
    inside each emulated node) at 1 Gbit/s between the nodes: an inner step sends nothing between
    the nodes (barriers aside) and DDP's gradient all-reduce inside; an outer step sends the 1-bit
    pseudo-gradient, each DDP rank the whole model's, each FSDP2 rank its shard's."""
    _run_two_node_quick("diloco_workers.py", tmp_path)
    assert (tmp_path / "diloco_workers_quick.md").read_text().startswith("# OnebitDiLoCo, workers of 2 ranks")
    (run,) = json.loads((tmp_path / "diloco_workers_quick.json").read_text())["runs"]
    configs, numel = run["configs"], run["numel"]
    assert set(configs) == {"ddp_adam", "ddp_inner", "ddp_outer", "fsdp_inner", "fsdp_outer"}
    one_bit_pass = numel / 8  # bytes of one rank's 1-bit all-reduce of the whole model over 2 ranks, about
    for inside in ("ddp", "fsdp"):
        inner, outer = configs[f"{inside}_inner"], configs[f"{inside}_outer"]
        assert inner["veth_tx_bytes_max"] < 16384 < one_bit_pass  # barriers only
        assert all(b == 0 for b in inner["bytes_sent_per_rank"])
        assert outer["veth_tx_bytes_max"] > one_bit_pass
    assert configs["ddp_inner"]["lo_tx_bytes_max"] > 4 * numel  # the fp32 gradient all-reduce inside the node
    ddp_sent, fsdp_sent = configs["ddp_outer"]["bytes_sent_per_rank"], configs["fsdp_outer"]["bytes_sent_per_rank"]
    assert all(1.8 * one_bit_pass < b < 2.6 * one_bit_pass for b in ddp_sent)  # two passes of the whole model
    assert all(0.4 * d < f < 0.6 * d for d, f in zip(ddp_sent, fsdp_sent))  # the shard's
    assert configs["ddp_adam"]["veth_tx_bytes_max"] > 4 * numel / 2
    assert {f"{inside}_h{h}" for inside in ("ddp", "fsdp") for h in (8, 16, 32, 64)} == set(run["utilisation"])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_streaming_quick_rounds_carry_one_exchange_per_fragment(tmp_path):
    """``benchmarks/streaming.py --quick``: rounds of H steps of OnebitDiLoCo on a 1 Gbit/s link, aligned so
    that each carries one exchange of every fragment: every configuration with outer steps sends the
    same bytes per round (two 1-bit passes of the whole model, whatever sync_delay and fragments),
    ``compute`` nothing; utilisation is ``compute``'s round time over each one's."""
    _run_two_node_quick("streaming.py", tmp_path)
    assert (tmp_path / "streaming_quick.md").read_text().startswith("# OnebitDiLoCo's sync_delay on a capped link")
    (run,) = json.loads((tmp_path / "streaming_quick.json").read_text())["runs"]
    configs, numel = run["configs"], run["numel"]
    assert set(configs) == {"compute", "defaults", "tau0", "tau1", "tau2", "tau4", "f4_tau0", "f4_tau2"}
    assert configs["compute"]["bytes_per_step"] == 0 and configs["compute"]["utilisation"] == 1.0
    per_round = [row["bytes_per_step"] * 16 for name, row in configs.items() if name != "compute"]
    one_bit_pass = numel / 8  # bytes of one rank's 1-bit all-reduce of the whole model over 2 ranks, about
    assert all(1.8 * one_bit_pass < b < 2.6 * one_bit_pass for b in per_round), (per_round, one_bit_pass)
    assert all(row["utilisation"] > 0 for row in configs.values())
