"""A rate-capped network between ranks on one machine: network namespaces, veth pairs, ``tc tbf``.

    with SlowLink(world_size=2, rate_gbit=1.0) as link:
        link.popen(rank, [sys.executable, "peers.py", ...], env)   # one rank per namespace

    with SlowLink(world_size=4, rate_gbit=0.1, ranks_per_node=2) as link:   # 2 nodes x 2 ranks
        link.popen(rank, argv, env)   # ranks 0, 1 in node 0's namespace, ranks 2, 3 in node 1's

Each *node* gets a namespace: by default a node is one rank; with ``ranks_per_node=L`` consecutive
groups of ``L`` ranks share one (and its veth), so traffic between two ranks of a node goes through
that namespace's loopback (a connection to the namespace's own address is routed over ``lo``) and
only traffic between nodes crosses a capped veth. Two nodes: namespaces ``ob<pid>r0`` and
``ob<pid>r1`` joined by one veth pair. More nodes: one namespace per node plus a hub namespace
``ob<pid>hub`` holding a bridge, each node joined to it by its own veth pair. Every veth end (both
directions, the bridge side too) gets a token-bucket cap ``tbf rate <rate> burst 256kb latency 50ms``,
so each node has a full-duplex link of that rate, as behind a switch. Addresses are
``10.<a>.<b>.<node+1>/24`` inside those namespaces only; nothing is routed out of them, and nothing
outside them is touched.

Teardown deletes the namespaces the object created (their veths go with them) on ``__exit__``, at
interpreter exit (``atexit``) and on SIGTERM/SIGHUP, so that a failed or interrupted run leaves nothing
behind; rank processes started through :meth:`SlowLink.popen` are killed first. Needs root and
iproute2 (``ip``, ``tc``): :func:`unavailable_reason` says why not, for a clean skip.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["SlowLink", "unavailable_reason", "LinkCounters", "wait_ranks"]

BURST = "256kb"
LATENCY = "50ms"


def unavailable_reason() -> str | None:
    """None when namespaces can be made here, else a sentence saying what is missing."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run as root; slowlink.py --quick runs on loopback without them)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"obprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def wait_ranks(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for every rank process within ``timeout_s`` in all; raise RuntimeError naming the first
    that failed or ran out of time, after killing every one still running."""
    deadline = time.monotonic() + timeout_s
    try:
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"rank {rank} did not finish within {timeout_s:.0f} s") from None
            if code != 0:
                raise RuntimeError(f"rank {rank} exited with code {code}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _run(*args: str) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")


class LinkCounters:
    """Bytes and packets a rank's interface sent and received (``/sys/class/net/<if>/statistics``),
    read from inside its namespace (``ip netns exec`` mounts that namespace's sysfs)."""

    FIELDS = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")

    def __init__(self, ifname: str) -> None:
        self.base = Path("/sys/class/net") / ifname / "statistics"

    def read(self) -> dict[str, int]:
        return {f: int((self.base / f).read_text()) for f in self.FIELDS}


class SlowLink:
    """Namespaces, veths and rate caps for ``world_size`` ranks in nodes of ``ranks_per_node``; see
    the module docstring."""

    def __init__(self, world_size: int, rate_gbit: float, *, mtu: int = 1500, tag: str | None = None,
                 ranks_per_node: int = 1) -> None:
        if world_size < 2:
            raise ValueError(f"a link needs at least 2 ranks, got world_size={world_size}")
        if not rate_gbit > 0:
            raise ValueError(f"rate_gbit must be > 0, got {rate_gbit!r}")
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or world_size % ranks_per_node or world_size // ranks_per_node < 2:
            raise ValueError(f"ranks_per_node must be a positive int dividing world_size={world_size} into at least "
                             f"2 nodes, got ranks_per_node={ranks_per_node!r}")
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.nodes = world_size // ranks_per_node
        self.rate_gbit = rate_gbit
        self.mtu = mtu
        tag = tag or str(os.getpid())
        self.prefix = f"ob{tag}"
        pid = os.getpid()
        self.subnet = f"10.{100 + pid % 100}.{(pid // 100) % 250}"
        # one namespace and one veth per node (a node is a rank unless ranks_per_node > 1)
        self.namespaces = [f"{self.prefix}r{r}" for r in range(self.nodes)]
        self.hub = f"{self.prefix}hub" if self.nodes > 2 else None
        self.ifnames = [f"{self.prefix}v{r}" for r in range(self.nodes)]
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}

    def address(self, node: int) -> str:
        """The veth address of ``node`` (of rank ``node`` when ``ranks_per_node`` is 1)."""
        return f"{self.subnet}.{node + 1}"

    def node_of(self, rank: int) -> int:
        """The node (the index into ``namespaces`` and ``ifnames``) that ``rank`` runs in."""
        return rank // self.ranks_per_node

    @property
    def master_addr(self) -> str:
        return self.address(0)

    def _rate(self) -> str:
        return f"{self.rate_gbit * 1000:g}mbit"

    def _cap(self, namespace: str, ifname: str) -> None:
        _run("tc", "-n", namespace, "qdisc", "add", "dev", ifname, "root", "tbf", "rate", self._rate(),
             "burst", BURST, "latency", LATENCY)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def up(self) -> "SlowLink":
        atexit.register(self.down)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for ns in self.namespaces:
                self._add_namespace(ns)
            if self.hub is None:
                a, b = self.ifnames
                _run("ip", "link", "add", a, "netns", self.namespaces[0], "type", "veth",
                     "peer", "name", b, "netns", self.namespaces[1])
            else:
                self._add_namespace(self.hub)
                _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
                _run("ip", "-n", self.hub, "link", "set", "br0", "up")
                for r, (ns, ifname) in enumerate(zip(self.namespaces, self.ifnames)):
                    port = f"p{r}"
                    _run("ip", "link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", port,
                         "netns", self.hub)
                    _run("ip", "-n", self.hub, "link", "set", port, "mtu", str(self.mtu))
                    _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
                    _run("ip", "-n", self.hub, "link", "set", port, "up")
                    self._cap(self.hub, port)
            for r, (ns, ifname) in enumerate(zip(self.namespaces, self.ifnames)):
                _run("ip", "-n", ns, "link", "set", ifname, "mtu", str(self.mtu))
                _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", ifname)
                _run("ip", "-n", ns, "link", "set", ifname, "up")
                self._cap(ns, ifname)
        except BaseException:
            self.down()
            raise
        return self

    def popen(self, rank: int, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside the namespace of rank's node with GLOO_SOCKET_IFNAME (the node's
        veth) and MASTER_ADDR (node 0's address) set."""
        node = self.node_of(rank)
        env = {**env, "GLOO_SOCKET_IFNAME": self.ifnames[node], "MASTER_ADDR": self.master_addr,
               "ONEBIT_BENCH_IFNAME": self.ifnames[node]}
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv], env=env, **kwargs)
        self.procs.append(proc)
        return proc

    def down(self) -> None:
        """Kill the ranks this object started and delete its namespaces (idempotent)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self.procs = []
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created = []
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        atexit.unregister(self.down)

    def _on_signal(self, signum, frame) -> None:
        self.down()
        raise SystemExit(128 + signum)

    def __enter__(self) -> "SlowLink":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
