"""The two-level model: per scheme, the bytes each node and each rank send and the step time, on
``P`` nodes of ``L`` ranks (the formulas: :mod:`onebit.estimate`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..compression import allreduce_wire_bytes, padded_length, row_bytes
from ._args import device_type, int_at_least, real
from .model import DEFAULT_LATENCY_S, TCP_ETHERNET_EFFICIENCY, UPPER_BOUND_NOTE, local_costs, reduce_gbps_for

#: The schemes of :func:`estimate_two_level`: DDP's fp32 all-reduce, the flat 1-bit all-reduce, and
#: the two ``hierarchy_variant`` values.
SCHEMES = ("fp32", "flat", "compressed", "node_mean")
# Passes of the codec over the buffer, relative to the flat scheme's worker compress + server
# compress + decode (3 passes): each stage costs about one pass over the larger of its input and
# output. compressed: + the node server (L rows of M/L); node_mean: worker and server on the shard
# (2/L), decode (1), the node mean (1).
_CODEC_PASSES = {"flat": lambda L: 3.0, "compressed": lambda L: 3.0 + 1.0 / L,
                 "node_mean": lambda L: 2.0 + 2.0 / L}


def two_level_wire_bytes(num_params: int, nodes: int, ranks_per_node: int, *,
                         segments: int = 1) -> dict[str, tuple[int, int]]:
    """Bytes per compression step (one bucket of ``num_params`` elements in ``segments`` tensors)
    on ``nodes`` (P) nodes of ``ranks_per_node`` (L) ranks, for each of :data:`SCHEMES`:
    ``(inter, intra)``, ``inter`` what one node sends to the other nodes (each direction of its
    link), ``intra`` what one rank sends to the ranks of its own node (at most).

    With ``n = P L``, ``M`` the padded length, a row ``r_n = M/(8n) + 4 segments`` and
    ``r_L = M/(8L) + 4 segments``:

    * fp32 ring all-reduce: ``2(n-1)/n * 4N`` on each ring edge, one of which leaves each node;
    * flat: all-to-all ``L * L(P-1)`` rows ``r_n`` out of the node, ``L-1`` inside per rank; ring
      all-gather ``n-1`` rows ``r_n`` on each edge;
    * compressed: inter ``2 L (P-1) r_n`` (cross all-to-all and all-gather); intra
      ``(L-1) (r_L + P r_n)`` (1-bit all-to-all, all-gather of the node's ``P`` rows);
    * node_mean: inter as compressed; intra ``(L-1) (4M/L + P r_n)`` (float32 shards).
    """
    p = int_at_least("nodes", nodes, 1)
    local = int_at_least("ranks_per_node", ranks_per_node, 1)
    num_params = int_at_least("num_params", num_params, 1)
    k = int_at_least("segments", segments, 1)
    n = p * local
    padded = padded_length(num_params, n)
    row_n, row_l = row_bytes(padded, n, k), row_bytes(padded, local, k)
    ring = allreduce_wire_bytes(4 * num_params, n)
    cross = 2 * local * (p - 1) * row_n
    intra_gather = (local - 1) * p * row_n
    return {
        "fp32": (ring if p > 1 else 0, ring if local > 1 else 0),
        "flat": (local * local * (p - 1) * row_n + ((n - 1) * row_n if p > 1 else 0),
                 (local - 1) * row_n + ((n - 1) * row_n if local > 1 else 0)),
        "compressed": (cross, (local - 1) * row_l + intra_gather),
        "node_mean": (cross, (local - 1) * 4 * padded // local + intra_gather),
    }


@dataclass(frozen=True)
class SchemeEstimate:
    """One scheme of :func:`estimate_two_level` (seconds per step; bytes per step)."""

    scheme: str
    inter_node_bytes: int
    intra_node_bytes: int
    inter_wire_s: float
    intra_wire_s: float
    wire_s: float
    local_s: float
    latency_s: float
    step_s: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TwoLevelEstimate:
    """Per-scheme estimates (``schemes``, keyed by :data:`SCHEMES`) for one configuration."""

    num_params: int
    nodes: int
    ranks_per_node: int
    inter_node_gbps: float
    intra_node_gbps: float
    compute_s: float
    device: str
    upper_bound: bool  # compute_s is 0: forward and backward count as free in every scheme
    schemes: dict

    def __getitem__(self, scheme: str) -> SchemeEstimate:
        return self.schemes[scheme]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["schemes"] = {k: v.as_dict() for k, v in self.schemes.items()}
        return out


def estimate_two_level(
    num_params: int, nodes: int, ranks_per_node: int, inter_node_gbps: float, intra_node_gbps: float, *,
    compute_s: float = 0.0,
    codec_gbps: float | None = None,
    adam_step_s: float | None = None,
    onebit_step_s: float | None = None,
    local_s: dict[str, float] | None = None,
    segments: int = 1,
    latency_s: float = DEFAULT_LATENCY_S,
    reduce_gbps: float | None = None,
    wire_efficiency: float = TCP_ETHERNET_EFFICIENCY,
    device: str = "cpu",
) -> TwoLevelEstimate:
    """Wire time and step time of a compression-phase step for each of :data:`SCHEMES` on
    ``nodes`` (P) nodes of ``ranks_per_node`` (L) ranks (model: :mod:`onebit.estimate`).

    Args:
        num_params: float32 elements averaged per step (one bucket; no pipelining across buckets).
        nodes: ``P``, the number of nodes.
        ranks_per_node: ``L``, ranks on each node.
        inter_node_gbps: a node's link to the other nodes, Gbit/s each direction (all its NICs).
        intra_node_gbps: one rank's payload rate to the ranks of its node, Gbit/s each direction
            (NVLink, PCIe, or in an emulation the loopback).
        compute_s: forward + backward seconds per step.
        codec_gbps: as in :func:`estimate_speedup` (measured here when None and needed); the
            codec of each 1-bit scheme is the flat codec times its passes over the buffer
            (compressed ``1 + 1/(3L)``, node_mean ``(2 + 2/L)/3``).
        adam_step_s: as in :func:`estimate_speedup` (measured when None and needed).
        onebit_step_s: likewise.
        local_s: seconds per step of each scheme apart from compute and communication (for fp32
            the Adam step; for 1-bit schemes maths and codec), overriding the modelled ones,
            e.g. measured in a run; schemes it leaves out are modelled.
        segments: tensors in the bucket (one float32 scale per tensor in each wire row).
        latency_s: per message; fp32 and flat pay ``2(n-1)``, two levels ``2(P-1) + 2(L-1)``.
        reduce_gbps: as in :func:`estimate_speedup` (default by ``device``).
        device: ``'cpu'`` or ``'cuda'``, as in :func:`estimate_speedup`.
        wire_efficiency: TCP payload over link rate between nodes (inside a node: 1).

    Raises ``ValueError`` naming an argument out of range.
    """
    num_params = int_at_least("num_params", num_params, 1)
    p, local = _nodes(nodes, ranks_per_node)
    inter = real("inter_node_gbps", inter_node_gbps, positive=True)
    intra = real("intra_node_gbps", intra_node_gbps, positive=True, allow_inf=True)
    compute_s, latency_s = real("compute_s", compute_s, positive=False), real("latency_s", latency_s, positive=False)
    device, efficiency = device_type(device), real("wire_efficiency", wire_efficiency, positive=True, upper=1.0)
    reduce_gbps, local_s = reduce_gbps_for(device, reduce_gbps), _checked_local_s(local_s)
    costs = local_costs(num_params, p * local, codec_gbps, adam_step_s, onebit_step_s,
                        needed=bool(set(SCHEMES) - set(local_s)), device=device)
    nbytes = two_level_wire_bytes(num_params, p, local, segments=segments)
    rates = (inter * 1e9 / 8 * efficiency, intra * 1e9 / 8)  # payload bytes per second between and inside nodes
    schemes = {s: _scheme_estimate(s, nbytes[s], rates, num_params, p, local, segments, reduce_gbps, local_s, costs,
                                   compute_s, latency_s) for s in SCHEMES}
    return TwoLevelEstimate(num_params=num_params, nodes=p, ranks_per_node=local, inter_node_gbps=inter,
                            intra_node_gbps=intra, compute_s=compute_s, device=device, upper_bound=compute_s == 0,
                            schemes=schemes)


def _nodes(nodes: int, ranks_per_node: int) -> tuple[int, int]:
    p = int_at_least("nodes", nodes, 1)
    local = int_at_least("ranks_per_node", ranks_per_node, 1)
    if p * local < 2:
        raise ValueError(f"invalid nodes * ranks_per_node: {p * local}; expected at least 2 ranks")
    return p, local


def _checked_local_s(local_s: dict[str, float] | None) -> dict[str, float]:
    local_s = dict(local_s or {})
    for key, value in local_s.items():
        if key not in SCHEMES:
            raise ValueError(f"invalid local_s key: {key!r}; expected one of {', '.join(map(repr, SCHEMES))}")
        real(f"local_s[{key!r}]", value, positive=False)
    return local_s


def _scheme_estimate(scheme: str, nbytes: tuple[int, int], rates: tuple[float, float], num_params: int, p: int,
                     local: int, segments: int, reduce_gbps: float, local_s: dict[str, float],
                     costs: tuple[float | None, float | None, float | None], compute_s: float,
                     latency_s: float) -> SchemeEstimate:
    """One scheme of :func:`estimate_two_level`, from checked arguments (``costs``: codec GB/s, the
    Adam step's and the 1-bit step's seconds)."""
    n = p * local
    (inter_b, intra_b), (goodput, intra_rate) = nbytes, rates
    inter_s, intra_s = inter_b / goodput, intra_b / intra_rate
    padded = padded_length(num_params, n)
    if scheme == "fp32":  # every ring edge at once: the slowest sets the pace, or the CPU's reduce
        wire = max(inter_s, intra_s, 4 * num_params / (reduce_gbps * 1e9))
    elif scheme == "flat":  # all-to-all (inter and intra at once), then the ring all-gather
        ring = (n - 1) * row_bytes(padded, n, segments)
        a2a_inter, a2a_intra = inter_b - (ring if p > 1 else 0), intra_b - (ring if local > 1 else 0)
        wire = max(a2a_inter / goodput, a2a_intra / intra_rate) + max(
            ring / goodput if p > 1 else 0.0, ring / intra_rate if local > 1 else 0.0)
    else:  # intra all-to-all, cross all-to-all and all-gather, intra all-gather: one after another
        wire = inter_s + intra_s
    codec_gbps, adam_step_s, onebit_step_s = costs
    if scheme in local_s:
        here = float(local_s[scheme])
    elif scheme == "fp32":
        here = float(adam_step_s)
    else:
        here = float(onebit_step_s) + 4 * padded / (float(codec_gbps) * 1e9) * _CODEC_PASSES[scheme](local) / 3.0
    messages = 2 * (n - 1) if scheme in ("fp32", "flat") else 2 * (p - 1) + 2 * (local - 1)
    return SchemeEstimate(
        scheme=scheme, inter_node_bytes=inter_b, intra_node_bytes=intra_b, inter_wire_s=inter_s,
        intra_wire_s=intra_s, wire_s=wire, local_s=here, latency_s=messages * latency_s,
        step_s=compute_s + here + wire + messages * latency_s)


def format_two_level(est: TwoLevelEstimate) -> str:
    """A small table for people."""
    ms = lambda s: f"{s * 1e3:9.1f} ms"
    lines = [f"{est.num_params / 1e6:.1f}M float32 parameters, {est.nodes} nodes x {est.ranks_per_node} ranks, "
             f"{est.inter_node_gbps:g} Gbit/s per node between nodes, {est.intra_node_gbps:g} Gbit/s per rank inside",
             f"  {'scheme':<11} {'inter-node B/node':>18} {'intra-node B/rank':>18} {'wire':>12} {'step':>12}"]
    for s in est.schemes.values():
        lines.append(f"  {s.scheme:<11} {s.inter_node_bytes:>18,} {s.intra_node_bytes:>18,} {ms(s.wire_s)} {ms(s.step_s)}")
    if est.upper_bound:
        lines.append(f"  (step times without forward and backward: {UPPER_BOUND_NOTE})")
    return "\n".join(lines) + "\n"
