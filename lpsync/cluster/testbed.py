"""An emulated cluster: N network namespaces on one bridge, each behind a shaped NIC.

Topology (PREFIX defaults to ``lpsync``):

    PREFIX-n0 .. PREFIX-n{N-1}   one namespace per node; its NIC ``eth0`` has
                                 198.18.0.(i+1)/24 and nothing else: no default
                                 route, so no packet can go anywhere but another node
    PREFIX-sw                    the switch: bridge ``br0`` with port ``p{i}`` per node

``eth0`` and ``p{i}`` are the two ends of one veth pair, created directly inside
their namespaces: the host's own namespace gains no interface, address or route,
and deleting the namespaces removes every link with them. A tbf qdisc on *both*
ends shapes each direction to RATE, so a node has a full-duplex NIC of RATE: its
uploads queue at eth0, its downloads at p{i}. With --delay, a netem child under
each tbf adds half the one-way delay per end.

The state (spec and names) is written to cluster-PREFIX.json in $LPSYNC_STATE_DIR
(default /run/lpsync) so that ``down`` works from any process; ``down`` also finds
namespaces by their exact name pattern, so a cluster whose ``up`` was killed halfway is
still removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from lpsync.cluster import netns
from lpsync.cluster.rate import format_rate
from lpsync.errors import ClusterError, InvalidArgumentError

SUBNET = "198.18.0.0/24"  # RFC 2544 benchmarking range; never any other address
MAX_NODES = 254
DEFAULT_STATE_DIR = Path("/run/lpsync")


def default_state_dir() -> Path:
    """Where cluster state files go: LPSYNC_STATE_DIR, read when a cluster is made."""
    return Path(os.environ.get("LPSYNC_STATE_DIR") or DEFAULT_STATE_DIR)


_PREFIX = re.compile(r"[a-z][a-z0-9]{0,11}")
# tbf: the bucket must hold a GSO super-packet and ~2 ms of traffic; the queue may hold
# 50 ms before tbf drops, like a switch port's buffer. A super-packet is 64 KiB of payload
# *plus* a header per segment (~68 KB as tbf counts it): with a 64 KiB bucket tbf cut every
# one into MTU packets, and at 200 Mbit/s on 8 nodes softirq took 4x the CPU of a 1 Gbit/s
# run carrying 5x the bytes (LP broadcast at 1.65x the wire instead of 1.1x).
_MIN_BURST = 128 * 1024
_LATENCY = "50ms"


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    rate_bits: int  # per direction of every node's NIC, bits per second
    delay_s: float | None = None  # one-way node-to-node delay (needs netem)
    prefix: str = "lpsync"

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise InvalidArgumentError(f"--nodes must be 1..{MAX_NODES}, got {self.nodes}")
        if not _PREFIX.fullmatch(self.prefix):
            raise InvalidArgumentError(
                f"--prefix must be 1-12 of [a-z0-9], starting with a letter; got {self.prefix!r}"
            )
        if self.delay_s is not None and self.delay_s < 0:
            raise InvalidArgumentError("--delay must not be negative")

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def address(self, node: int) -> str:
        return f"198.18.0.{node + 1}"

    @property
    def rate_bytes(self) -> float:
        return self.rate_bits / 8

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "rate": format_rate(self.rate_bits),
            "switch": self.switch,
            "nodes_detail": [
                {"node": i, "namespace": self.namespace(i), "address": self.address(i)}
                for i in range(self.nodes)
            ],
        }


def _ours(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}-(?:sw|n\d+)")


def state_path(prefix: str, state_dir: Path | None = None) -> Path:
    return (state_dir or default_state_dir()) / f"cluster-{prefix}.json"


def existing(prefix: str) -> list[str]:
    """The namespaces of cluster ``prefix`` that exist now (exact name pattern only)."""
    pattern = _ours(prefix)
    return sorted(n for n in netns.namespaces() if pattern.fullmatch(n))


def up(spec: ClusterSpec, state_dir: Path | None = None) -> ClusterSpec:
    """Build the cluster. Refuses when any part of a cluster with this prefix exists;
    a failure halfway removes what this call made before raising."""
    netns.require_root()
    if spec.delay_s is not None and (reason := netns.netem_missing_reason()) is not None:
        raise ClusterError(
            f"--delay needs the netem qdisc, and {reason}; nothing was created. "
            "Run without --delay (tbf shaping works), or on a kernel with netem."
        )
    if leftovers := existing(spec.prefix):
        raise ClusterError(
            f"a cluster named {spec.prefix!r} already exists ({', '.join(leftovers)}); "
            f"run `lpsync cluster down --prefix {spec.prefix}` first"
        )
    try:
        _build(spec)
        state_path(spec.prefix, state_dir).parent.mkdir(parents=True, exist_ok=True)
        state_path(spec.prefix, state_dir).write_text(json.dumps(spec.describe(), indent=1))
    except BaseException:
        down(spec.prefix, state_dir)
        raise
    return spec


def _build(spec: ClusterSpec) -> None:
    sw = spec.switch
    netns.add_namespace(sw)
    netns.ip("link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0", ns=sw)
    netns.ip("link", "set", "br0", "up", ns=sw)
    for node in range(spec.nodes):
        ns, port = spec.namespace(node), f"p{node}"
        netns.add_namespace(ns)
        netns.ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
        netns.ip("link", "set", port, "master", "br0", "up", ns=sw)
        netns.ip("addr", "add", f"{spec.address(node)}/24", "dev", "eth0", ns=ns)
        netns.ip("link", "set", "eth0", "up", ns=ns)
        _shape(spec, ns, "eth0")  # the node's uploads
        _shape(spec, sw, port)  # the node's downloads


def _shape(spec: ClusterSpec, ns: str, dev: str) -> None:
    burst = max(_MIN_BURST, int(spec.rate_bytes * 0.002))
    netns.tc(
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "handle",
        "1:",
        "tbf",
        "rate",
        f"{spec.rate_bits}bit",
        "burst",
        str(burst),
        "latency",
        _LATENCY,
        ns=ns,
    )
    if spec.delay_s:
        half_us = max(1, round(spec.delay_s * 1e6 / 2))
        netns.tc(
            "qdisc",
            "add",
            "dev",
            dev,
            "parent",
            "1:1",
            "handle",
            "10:",
            "netem",
            "delay",
            f"{half_us}us",
            ns=ns,
        )


def down(prefix: str = "lpsync", state_dir: Path | None = None) -> list[str]:
    """Remove cluster ``prefix``: stop the processes inside its namespaces, delete the
    namespaces (their veths and the bridge go with them) and the state file. Returns
    the namespaces removed; safe to call when nothing exists."""
    if not _PREFIX.fullmatch(prefix):
        raise InvalidArgumentError(f"not a cluster prefix: {prefix!r}")
    netns.require_root()
    names = existing(prefix)
    nodes_first = sorted(names, key=lambda n: n.endswith("-sw"))
    _stop_processes(nodes_first)
    for name in nodes_first:
        netns.delete_namespace(name)
    if still := existing(prefix):
        raise ClusterError(f"could not delete namespaces {', '.join(still)}")
    state_path(prefix, state_dir).unlink(missing_ok=True)
    return names


def _stop_processes(names: Sequence[str], grace: float = 3.0) -> None:
    pids = {pid for name in names for pid in netns.namespace_pids(name)}
    pids.discard(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if _alive(pid)}
            time.sleep(0.05)
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still "exists": reap it if it is ours.
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def run_in(spec: ClusterSpec, node: int, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` inside node ``node``'s namespace (``ip netns exec``)."""
    if not 0 <= node < spec.nodes:
        raise InvalidArgumentError(f"node {node} is not in this {spec.nodes}-node cluster")
    return subprocess.Popen(["ip", "netns", "exec", spec.namespace(node), *argv], **popen)


class Cluster:
    """``with Cluster(nodes, rate_bits) as cluster:`` builds the cluster and always tears it
    down: on success, on any exception, on Ctrl-C and (on the main thread) on SIGTERM."""

    def __init__(
        self,
        nodes: int,
        rate_bits: int,
        delay_s: float | None = None,
        prefix: str = "lpsync",
        state_dir: Path | None = None,
    ) -> None:
        self.spec = ClusterSpec(nodes, rate_bits, delay_s, prefix)
        self.state_dir = state_dir
        self._procs: list[subprocess.Popen[Any]] = []
        self._old_sigterm: Any = None

    def __enter__(self) -> Cluster:
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        try:
            up(self.spec, self.state_dir)
        except BaseException:
            self._restore_signal()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
            down(self.spec.prefix, self.state_dir)
        finally:
            self._restore_signal()

    def _restore_signal(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def address(self, node: int) -> str:
        return self.spec.address(node)

    def run_in(self, node: int, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start a process in ``node``; it is killed when the cluster comes down."""
        proc = run_in(self.spec, node, argv, **popen)
        self._procs.append(proc)
        return proc


def _sigterm_to_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
