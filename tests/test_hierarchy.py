"""The two-level compressed all-reduce (onebit.hierarchy) on spawned gloo ranks against the
single-process oracle (onebit.testing.simulate_hierarchical_allreduce), bit for bit; the oracle
against the flat one where they must agree; and OnebitAdam with ``hierarchy=``."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import tiny_mlp
from distributed import run_ranks
from onebit import OnebitAdam, ZeroOneAdam
from onebit.collectives import finish_, start_server_, start_worker_
from onebit.compression import SegmentLayout, row_bytes
from onebit.hierarchy import TwoLevelState, build_topology, node_groups
from onebit.kernels import get_kernels
from onebit.testing import simulate_compressed_allreduce, simulate_hierarchical_allreduce

NUMELS = [37, 300, 130]
CALLS = 3


def _inputs(n: int, call: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * call + 7)
    return [torch.randn(sum(NUMELS), generator=gen) * (1 + r) for r in range(n)]


def _padded(layout: SegmentLayout, flat: torch.Tensor) -> torch.Tensor:
    out, offset = torch.zeros(layout.padded), 0
    for start, numel in zip(layout.starts, NUMELS):
        out[start:start + numel] = flat[offset:offset + numel]
        offset += numel
    return out


def _unpadded(layout: SegmentLayout, buffer: torch.Tensor) -> torch.Tensor:
    return torch.cat([buffer[s] for s in layout.slices()])


def _two_level_rank(rank, world_size, local, variant, block, kernel_name):
    from onebit.backends.torch_dist import TorchDistBackend

    topology = build_topology(TorchDistBackend(), local, variant)
    layout = SegmentLayout.build(NUMELS, world_size, block)
    state = TwoLevelState(layout.padded, layout.edges, topology, "cpu")
    kernels = get_kernels(torch.device("cpu"), kernel_name)
    outputs, errors = [], []
    for call in range(CALLS):
        buffer = _padded(layout, _inputs(world_size, call)[rank])
        start_worker_(buffer, state, None, kernels)
        start_server_(state, None, kernels)
        finish_(buffer, state, kernels)
        outputs.append(_unpadded(layout, buffer))
        errors.append((state.worker_error.clone(), state.server_error.clone()))
    return {"topology": (topology.nodes, topology.local, topology.node, topology.local_rank),
            "outputs": outputs, "errors": errors}


# Each variant on 2 x 2, 3 x 2 and 2 x 3 (nodes x ranks); native (fused CPU) and reference kernels,
# per-block and per-tensor scales.
CASES = [(4, 2, "compressed", 64, "auto"), (4, 2, "node_mean", 64, "reference"), (6, 2, "compressed", None, "auto"),
         (6, 2, "node_mean", None, "auto"), (6, 3, "compressed", None, "reference"), (6, 3, "node_mean", 64, "auto")]


@pytest.mark.slow
@pytest.mark.parametrize("world_size, local, variant, block, kernels", CASES)
def test_two_level_allreduce_equals_the_oracle_bit_for_bit(tmp_path, world_size, local, variant, block, kernels):
    ranks = run_ranks(_two_level_rank, world_size, tmp_path, local, variant, block, kernels)
    worker = server = None
    for call in range(CALLS):
        want = simulate_hierarchical_allreduce(_inputs(world_size, call), local, variant, worker, server,
                                               numels=NUMELS, scale_block_size=block)
        worker, server = want.worker_errors, want.server_errors
        for r, got in enumerate(ranks):
            assert torch.equal(got["outputs"][call], want.output), (call, r)
            assert torch.equal(got["errors"][call][0], worker[r]), (call, r, "worker error")
            assert torch.equal(got["errors"][call][1], server[r]), (call, r, "server error")
    nodes = world_size // local
    assert [r["topology"] for r in ranks] == [(nodes, local, r // local, r % local) for r in range(world_size)]


@pytest.mark.parametrize("local", [1, 4])
def test_compressed_variant_is_the_flat_algorithm_on_one_node_or_one_rank_per_node(local):
    worker = server = flat_worker = flat_server = None
    for call in range(CALLS):
        inputs = _inputs(4, call)
        two = simulate_hierarchical_allreduce(inputs, local, "compressed", worker, server, numels=NUMELS)
        flat = simulate_compressed_allreduce(inputs, flat_worker, flat_server, numels=NUMELS)
        assert torch.equal(two.output, flat.output)
        worker, server = two.worker_errors, two.server_errors
        flat_worker, flat_server = flat.worker_errors, flat.server_errors


def test_node_groups_say_why_they_do_not_apply():
    assert node_groups(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert node_groups(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]  # by host, not by rank arithmetic
    assert "one node" in node_groups(["a"] * 4)
    assert "one rank per node" in node_groups(["a", "b", "c"])
    assert "uneven nodes (2, 1 ranks)" in node_groups(["a", "a", "b"])


def test_hierarchy_arguments_are_checked():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"invalid hierarchy: 'hosts'; expected None \(flat\), 'host'"):
        OnebitAdam([p], comm_backend_name="local", hierarchy="hosts")
    with pytest.raises(ValueError, match=r"invalid hierarchy_variant: 'B'; expected one of 'compressed', 'node_mean'"):
        OnebitAdam([p], comm_backend_name="local", hierarchy=2, hierarchy_variant="B")
    assert OnebitAdam([p], comm_backend_name="local", hierarchy=2).topology is None  # one rank: flat


def _train(rank, cls, hierarchy, variant):
    model = tiny_mlp(8, 24, 3)
    if cls == "adam":
        opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, hierarchy=hierarchy, hierarchy_variant=variant)
    else:
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=4, var_update_scaler=1, local_step_scaler=1,
                          local_step_clipper=2, hierarchy=hierarchy, hierarchy_variant=variant)
    gen = torch.Generator().manual_seed(rank)
    params, identical = [], []
    for _ in range(8):
        opt.zero_grad()
        model(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        identical.append(opt.replicas_identical)
    return {"params": params, "stats": opt.comm_stats(), "identical": identical,
            "topology": None if opt.topology is None else (opt.topology.nodes, opt.topology.local)}


def _optimizers_rank(rank, world_size):
    return {(cls, hierarchy, variant): _train(rank, cls, hierarchy, variant)
            for cls, hierarchy, variant in [("adam", None, "compressed"), ("adam", 2, "compressed"),
                                            ("adam", 2, "node_mean"), ("zoadam", 2, "compressed")]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_ranks(_optimizers_rank, 4, tmp_path_factory.mktemp("hierarchy_optimizers"))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["compressed", "node_mean"])
def test_onebit_adam_with_hierarchy_keeps_ranks_identical_and_counts_each_level(trained, variant):
    two = [r["adam", 2, variant] for r in trained]
    flat = [r["adam", None, "compressed"] for r in trained]
    assert [r["topology"] for r in two] == [(2, 2)] * 4 and flat[0]["topology"] is None
    for r in two:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], two[0]["params"]))
    assert all(torch.equal(a, b) for a, b in zip(two[0]["params"][:2], flat[0]["params"][:2]))  # warmup: same
    assert not torch.equal(two[0]["params"][-1], flat[0]["params"][-1])  # then another algorithm
    stats, flat_stats = two[0]["stats"]["compression"], flat[0]["stats"]["compression"]
    steps = stats["steps"]
    layout = SegmentLayout.build([8 * 24, 24, 24 * 3, 3], 4)
    row = row_bytes(layout.padded, 4, layout.segments)  # one of the n global chunks, with its scales
    # Between nodes this rank sends one row in the cross all-to-all and one in the cross all-gather
    # (2 (P-1) rows, P = 2); flat sends 2 (n-1) = 6 rows, to both nodes.
    assert stats["inter_node_bytes_sent"] == steps * 2 * row
    flat_allreduce = steps * 2 * 3 * row
    if variant == "compressed":  # 1-bit rows of the whole buffer (L = 2 rows), then the node's P rows
        intra = row_bytes(layout.padded, 2, layout.segments) + 2 * row
    else:  # float32 shards, then the node's P rows
        intra = layout.padded * 4 // 2 + 2 * row
    assert stats["intra_node_bytes_sent"] == steps * intra
    # Everything else (the finiteness flag, the health check) is what flat sends besides its all-reduce.
    assert stats["bytes_sent"] - stats["inter_node_bytes_sent"] - stats["intra_node_bytes_sent"] == (
        flat_stats["bytes_sent"] - flat_allreduce)


@pytest.mark.slow
def test_zero_one_adam_with_hierarchy_is_identical_after_syncs(trained):
    ranks = [r["zoadam", 2, "compressed"] for r in trained]
    assert ranks[0]["topology"] == (2, 2)
    assert ranks[0]["identical"] == ranks[1]["identical"] and any(ranks[0]["identical"][4:])
    for step, identical in enumerate(ranks[0]["identical"]):
        if identical:
            assert all(torch.equal(r["params"][step], ranks[0]["params"][step]) for r in ranks), step


def _fallback_rank(rank, world_size):
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("onebit.hierarchy")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    out = {}
    for hierarchy in (3, "host", 1):
        opt = OnebitAdam([torch.nn.Parameter(torch.zeros(8))], hierarchy=hierarchy)
        out[hierarchy] = (opt.topology, list(messages))
        messages.clear()
    logger.removeHandler(handler)
    return out


@pytest.mark.slow
def test_topologies_without_two_levels_fall_back_to_flat_with_one_log_line(tmp_path):
    ranks = run_ranks(_fallback_rank, 4, tmp_path)
    for hierarchy, why in [(3, "4 ranks are not whole groups of hierarchy=3"),
                           ("host", "one node (4 ranks): nothing crosses a network between nodes"),
                           (1, "one rank per node (4 nodes): the two-level scheme would be the flat one")]:
        assert [r[hierarchy][0] for r in ranks] == [None] * 4
        assert ranks[0][hierarchy][1] == [f"onebit: hierarchy={hierarchy!r} falls back to the flat all-reduce: {why}"]
        assert all(r[hierarchy][1] == [] for r in ranks[1:])  # rank 0 only


def test_hierarchy_needs_a_torch_distributed_transport():
    from onebit.backends.base import CommBackend

    class TwoRanks(CommBackend):
        name = "custom"
        rank, world_size = 0, 2

        def all_reduce_mean_(self, tensor):
            return tensor

        def all_to_all(self, output, input):
            return output

        def all_gather(self, output, input):
            return output

        def barrier(self):
            pass

    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"hierarchy=2 needs a torch.distributed transport .* got 'custom'"):
        OnebitAdam([p], backend=TwoRanks(), hierarchy=2)
    assert OnebitAdam([p], backend=TwoRanks()).topology is None
