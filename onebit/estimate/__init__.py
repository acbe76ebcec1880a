"""Should I compress? The expected speedup of a compression-phase step on a given link.

A first-order model of one data-parallel step on ``n`` ranks holding ``N`` float32 parameters,
each rank on a full-duplex link of ``B`` Gbit/s. What runs on one rank's processor is measured
on this machine (on the job's ``device``, ``'cpu'`` or ``'cuda'``); only the network is modelled::

    fp32 step   = compute_s + adam_step_s   + max(fp32_wire, fp32_reduce)    + 2 (n-1) latency_s
    1-bit step  = compute_s + onebit_step_s + codec + exposed(onebit_wire)  + 2 (n-1) latency_s

* ``fp32_wire = 2 (n-1)/n * 4N bytes / goodput``: a bandwidth-optimal (ring) all-reduce;
* ``fp32_reduce = 4N bytes / reduce_gbps``: the all-reduce's own work (gloo sums and copies on the
  CPU, DDP copies into and out of its buckets), by default :data:`REDUCE_GBPS` of the device: 0.5
  GB/s on a CPU, none (``math.inf``) on a GPU, where NCCL reduces at memory speed. A ring
  all-reduce sums one chunk while the next is on the wire, so the slower of the two sets its time;
  the 1-bit codec runs before and after its transfers, so codec and wire add up;
* ``onebit_wire = 2 (n-1) * (M/(8n) + 4) bytes / goodput``: the all-to-all and all-gather of
  :func:`onebit.collectives.compressed_allreduce_`, ``M`` the padded length;
* ``exposed(w) = w - min(w, codec) * (k-1)/k`` with ``k`` buckets: OnebitAdam pipelines its
  buckets, so the transfers of all but one bucket can hide behind the codec work of the others
  (with one bucket nothing is hidden); with ``overlap_backward=True`` they start during backward
  instead: ``exposed(w) = w/k + max(0, w (k-1)/k - backward_s)`` (the last bucket's transfers
  start after backward; the others' hide behind what is left of it);
* ``goodput = B * wire_efficiency``: TCP payload rate (default 1448/1514: 1500-byte Ethernet frames);
* ``codec = 4M bytes / codec_gbps``: this rank's worker compress, server compress and decode;
* ``adam_step_s``: a ``torch.optim.Adam`` step on ``N`` parameters; ``onebit_step_s``: the rest of
  an ``OnebitAdam`` compression step (finiteness check, momentum, mask, update), i.e.
  a local step minus its codec time; ``compute_s``: forward + backward.

``codec_gbps``, ``adam_step_s`` and ``onebit_step_s`` are measured here when not given
(:func:`measure_local_costs`, on a sample of at most one default bucket, 16M parameters, scaled
linearly; a few seconds), so run the estimate on the machine that will train, with the thread count
it will use. :func:`measure_spread` keeps every timed run; the command line caches its
measurement per machine (:mod:`onebit.estimate.cache`) so that identical calls agree, and prints
the runs' spread with the speedups at both ends of it. With ``compute_s`` 0 (not given) forward and
backward cost nothing in either step: the speedup is an upper bound, and says so.
The model leaves out what DDP's overlap of the all-reduce with backward hides (at most the
backward time) and the slowdown of memory-bound work when other processes share the memory bus.

Two levels (:func:`estimate_two_level`): ``P`` nodes of ``L`` ranks, the node's network link of
``B_node`` Gbit/s each direction (all its NICs together) and each rank's link inside the node of
``B_intra`` Gbit/s. Per scheme it counts the bytes each node sends to the others
(:func:`two_level_wire_bytes`, in units of ``M/8``, sign bytes only; the formulas add the 4-byte
scales)::

    fp32 ring all-reduce      64 (n-1)/n                  (a ring of node-contiguous ranks)
    flat 1-bit                L (P-1)/P + (n-1)/n         (personalized all-to-all, ring all-gather)
    compressed, node_mean     2 (P-1)/P                   (:mod:`onebit.hierarchy`)

and the bytes each rank sends inside its node: flat ``(L-1)/n + (n-1)/n`` (at most), compressed
``2 (L-1)/L``, node_mean ``32 (L-1)/L + (L-1)/L`` (float32 shards). The two-level stages run one
after another (intra, inter, inter, intra), so their wire time is
``inter / B_node + intra / B_intra``; the flat scheme's and the ring's transfers share their
stages, so each stage takes the slower of its inter- and intra-node parts.

Command line (``--help`` describes every flag)::

    python -m onebit.estimate --params 50e6 --world-size 8 --bandwidth-gbps 10 --compute-s 0.2
    python -m onebit.estimate --params 1e9 --world-size 64 --bandwidth-gbps 100 --device cuda \
        --compute-s 0.5 --codec-gbps 500 --adam-step-s 0.004 --onebit-step-s 0.005
    python -m onebit.estimate --params 8.4e6 --world-size 4 --bandwidth-gbps 0.1 --ranks-per-node 2 --intra-gbps 2
"""

from .cache import cached_spread, default_cache_path
from .cli import main
from .measure import DEFAULT_SAMPLE, LocalCosts, Measured, measure_codec_gbps, measure_local_costs, measure_spread
from .model import (DEFAULT_LATENCY_S, REDUCE_GBPS, TCP_ETHERNET_EFFICIENCY, SpeedupEstimate, estimate_speedup,
                    format_estimate, fp32_allreduce_bytes, onebit_allreduce_bytes)
from .two_level import SCHEMES, SchemeEstimate, TwoLevelEstimate, estimate_two_level, format_two_level, two_level_wire_bytes

__all__ = [
    "SpeedupEstimate",
    "LocalCosts",
    "Measured",
    "estimate_speedup",
    "measure_codec_gbps",
    "measure_local_costs",
    "measure_spread",
    "cached_spread",
    "default_cache_path",
    "fp32_allreduce_bytes",
    "onebit_allreduce_bytes",
    "format_estimate",
    "SCHEMES",
    "SchemeEstimate",
    "TwoLevelEstimate",
    "estimate_two_level",
    "format_two_level",
    "two_level_wire_bytes",
    "DEFAULT_LATENCY_S",
    "DEFAULT_SAMPLE",
    "REDUCE_GBPS",
    "TCP_ETHERNET_EFFICIENCY",
    "main",
]
