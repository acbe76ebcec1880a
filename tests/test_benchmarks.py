"""The peer benchmark's smoke test: ``benchmarks/slowlink.py --quick`` (loopback, small model) in a
subprocess with a hard timeout, and the namespace helper's setup and teardown where root allows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from onebit.compression import padded_length

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
CONFIGS = {"adam", "powersgd1", "powersgd4", "onebit_warmup", "onebit_compression"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("quick")
    try:
        proc = subprocess.run([sys.executable, str(BENCH / "slowlink.py"), "--quick", "--out-dir", str(out)],
                              capture_output=True, text=True, timeout=150, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"slowlink.py --quick did not finish in {exc.timeout} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "quick.md").read_text().startswith("# onebit vs peers")
    return json.loads((out / "quick.json").read_text())


@pytest.mark.timeout(200)
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


@pytest.mark.timeout(200)
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


@pytest.mark.timeout(200)
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
        flag = 2 * (n - 1) * 8 // n  # the finiteness flag's all-reduce
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

    def names() -> set[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {line.split()[0] for line in out.splitlines() if line.strip()}

    link = netns.SlowLink(2, 1.0, tag="t" + str(id(names) % 100000))
    try:
        with link:
            assert set(link.namespaces) <= names()
            qdisc = subprocess.run(["tc", "-n", link.namespaces[0], "qdisc", "show", "dev", link.ifnames[0]],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "rate 1Gbit" in qdisc
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert not set(link.namespaces) & names()
