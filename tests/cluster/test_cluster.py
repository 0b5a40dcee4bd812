"""The emulated cluster: rates and names without root; with root, a real 3-node cluster
(reachability, isolation, shaped throughput, the UCX transport across namespaces) and
teardown from the API, the CLI, Ctrl-C and SIGTERM."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lpsync.cluster import (
    SUBNET,
    Cluster,
    ClusterSpec,
    down,
    existing,
    netns,
    parse_delay,
    parse_rate,
    up,
)
from lpsync.errors import ClusterError, InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
RATE = 100_000_000  # 100mbit: 12.5 MB/s, measurable in ~1.5 s


def test_parse_rate_reads_tc_units() -> None:
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("2.5Gbit") == 2_500_000_000
    assert parse_rate("10mbps") == 80_000_000  # tc: bps means bytes per second
    for bad in ("fast", "100", "1 gigabit", "1kbit"):
        with pytest.raises(InvalidArgumentError):
            parse_rate(bad)


def test_parse_delay() -> None:
    assert parse_delay("5ms") == pytest.approx(0.005)
    assert parse_delay("100us") == pytest.approx(1e-4)
    with pytest.raises(InvalidArgumentError):
        parse_delay("5 minutes")


def test_every_address_is_in_the_benchmark_range() -> None:
    spec = ClusterSpec(254, RATE)
    subnet = ipaddress.ip_network(SUBNET)
    addresses = {ipaddress.ip_address(spec.address(i)) for i in range(spec.nodes)}
    assert len(addresses) == 254 and all(a in subnet for a in addresses)
    assert subnet.network_address not in addresses and subnet.broadcast_address not in addresses
    with pytest.raises(InvalidArgumentError):
        ClusterSpec(255, RATE)
    for bad in ("", "Lp", "lp-x", "a" * 13, "1lp"):
        with pytest.raises(InvalidArgumentError):
            ClusterSpec(2, RATE, prefix=bad)


def _namespaces_work() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    probe = f"lpsprobe{os.getpid()}"
    done = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10, check=False
    )
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], timeout=10, check=False)
    return None


needs_netns = pytest.mark.skipif((reason := _namespaces_work()) is not None, reason=reason or "")


def prefix(tag: str) -> str:
    return f"t{tag}{os.getpid() % 100000}"


def links_named(fragment: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    return [line for line in out.splitlines() if fragment in line]


@needs_netns
def test_delay_without_netem_fails_before_creating_anything(tmp_path: Path) -> None:
    if netns.netem_missing_reason() is None:
        pytest.skip("this kernel has netem")
    spec = ClusterSpec(2, RATE, delay_s=0.001, prefix=prefix("d"))
    with pytest.raises(ClusterError, match="netem"):
        up(spec, tmp_path)
    assert existing(spec.prefix) == []
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if reason:
        pytest.skip(reason)
    with Cluster(3, RATE, prefix=prefix("c"), state_dir=tmp_path_factory.mktemp("state")) as cluster:
        yield cluster
    assert existing(cluster.spec.prefix) == []


def run_py(cluster: Cluster, node: int, code: str, timeout: float = 20) -> str:
    proc = cluster.run_in(
        node, [PY, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


@needs_netns
def test_nodes_reach_each_other_and_nothing_else(cluster3: Cluster) -> None:
    server = cluster3.run_in(
        1,
        [
            PY,
            "-c",
            (
                "import socket\n"
                "s = socket.create_server(('0.0.0.0', 7000)); s.settimeout(15); print('ready', flush=True)\n"
                "for _ in range(2): c, a = s.accept(); c.sendall(a[0].encode()); c.close()\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    connect = (
        "import socket\nprint(socket.create_connection(('198.18.0.2', 7000), timeout=5).recv(64).decode())"
    )
    assert run_py(cluster3, 0, connect).strip() == "198.18.0.1"
    assert run_py(cluster3, 2, connect).strip() == "198.18.0.3"
    server.wait(10)
    # No default route: anything outside the cluster's /24 is unreachable.
    out = run_py(
        cluster3,
        0,
        (
            "import socket\n"
            "try: socket.create_connection(('10.0.0.1', 80), timeout=2)\n"
            "except OSError as e: print(e.errno)\n"
        ),
    )
    assert out.strip() == "101"  # ENETUNREACH
    # The host's own namespace gained none of the cluster's addresses and none of its links
    # (a Docker engine may hold a bridge elsewhere in 198.18.0.0/24: that is not ours).
    host = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
    for node in range(3):
        assert f"inet {cluster3.address(node)}/" not in host, host
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert cluster3.spec.prefix not in links, links


@needs_netns
def test_shaped_link_carries_its_rate(cluster3: Cluster) -> None:
    server = cluster3.run_in(
        1,
        [PY, "-m", "lpsync.cluster.throughput", "serve", "--port", "5201"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    sender = cluster3.run_in(
        0,
        [PY, "-m", "lpsync.cluster.throughput", "send", "--to", "198.18.0.2:5201", "--seconds", "1.5"],
        cwd=ROOT,
    )
    sender.wait(20)
    result = json.loads(server.stdout.readline())
    server.wait(10)
    rate = result["bytes_per_second"]
    print(f"100mbit link: {rate / 1e6:.2f} MB/s over {result['seconds']:.2f} s")
    assert 10.0e6 <= rate <= 12.6e6, f"{rate / 1e6:.2f} MB/s on a 12.5 MB/s link"


@needs_netns
def test_ucx_endpoint_across_namespaces(cluster3: Cluster) -> None:
    pytest.importorskip("ucxx")
    peers = ",".join(f"{cluster3.address(i)}:13337" for i in range(3))
    procs = [
        cluster3.run_in(
            i,
            [
                PY,
                "-m",
                "tests.transport.ucx_node",
                "--rank",
                str(i),
                "--peers",
                peers,
                "--count",
                str(1 << 19),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i in range(3)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] for r in reports)
    # Speed is the benchmarks' business (docs/multinode.md); this only reports it.
    wire = (1 << 21) / (RATE / 8)
    seconds = max(r["seconds"][0] for r in reports)
    print(f"UCX LP broadcast 2 MiB, 3 nodes, 100mbit: {seconds:.3f} s = {seconds / wire:.2f} x wire")


@needs_netns
def test_cli_up_refuses_twice_and_down_from_another_process() -> None:
    name = prefix("cli")
    lpsync = [PY, "-m", "lpsync.cli", "cluster"]
    try:
        up = subprocess.run(
            [*lpsync, "up", "--nodes", "2", "--link", "1gbit", "--prefix", name, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        assert up.returncode == 0, up.stderr
        assert [n["address"] for n in json.loads(up.stdout)["nodes_detail"]] == ["198.18.0.1", "198.18.0.2"]
        again = subprocess.run(
            [*lpsync, "up", "--nodes", "2", "--link", "1gbit", "--prefix", name],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        assert again.returncode != 0 and "already exists" in again.stderr
    finally:
        gone = subprocess.run(
            [*lpsync, "down", "--prefix", name], capture_output=True, text=True, timeout=30, cwd=ROOT
        )
    assert gone.returncode == 0, gone.stderr
    assert existing(name) == [] and links_named(name) == []


@needs_netns
def test_down_removes_a_half_made_cluster(tmp_path: Path) -> None:
    name = prefix("half")
    netns.add_namespace(f"{name}-n0")  # what an `up` killed early leaves
    try:
        with pytest.raises(ClusterError, match="already exists"):
            Cluster(2, RATE, prefix=name, state_dir=tmp_path).__enter__()
    finally:
        assert down(name, tmp_path) == [f"{name}-n0"]
    assert existing(name) == []


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_user_still_tears_down(sig: signal.Signals, tmp_path: Path) -> None:
    name = prefix("sig")
    # A shell's background job inherits SIGINT ignored, and Python then raises no
    # KeyboardInterrupt: the child takes Ctrl-C as a user's terminal would deliver it.
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from pathlib import Path\n"
        "from lpsync.cluster import Cluster\n"
        f"with Cluster(2, {RATE}, prefix={name!r}, state_dir=Path({str(tmp_path)!r})) as c:\n"
        "    c.run_in(0, ['sleep', '60'])\n"
        "    print('up', flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [PY, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert len(existing(name)) == 3
        proc.send_signal(sig)
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
        leftover = existing(name)
        if leftover:
            down(name, tmp_path)
    assert leftover == [], f"{sig.name} left {leftover}"
    assert not list(tmp_path.iterdir())


@needs_netns
def test_peer_plane_benchmark_smoke() -> None:
    """The benchmark runs end to end on a tiny cluster (its figures are not asserted)."""
    pytest.importorskip("ucxx")
    done = subprocess.run(
        [
            PY,
            "-m",
            "lab.peer_plane",
            "--nodes",
            "2",
            "--link",
            "1gbit",
            "--bytes",
            "256KiB",
            "--reps",
            "1",
            "--algorithm",
            "lp,be",
            "--prefix",
            prefix("b"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["algorithm"] for r in rows] == ["lp", "be"]
    assert all(r["wrong"] == 0 and r["wire_seconds"] > 0 for r in rows)
    assert existing(prefix("b")) == []
