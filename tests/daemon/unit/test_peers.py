"""Peer discovery (lpsync.daemon.peers.discovery) and the daemon's peer settings."""

from __future__ import annotations

import argparse
import types

import pytest

from lpsync.daemon.control import config as daemon_config
from lpsync.daemon.peers.discovery import discover, expand_nodelist, from_dns, from_slurm, is_local_address
from lpsync.daemon.peers.plane import Link
from lpsync.errors import ConfigError, InvalidArgumentError
from lpsync.transport.addresses import PeerAddress
from lpsync.transport.tags import HEARTBEAT, control_tag


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("a1", ["a1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("r[1-2]-c[3,5]", ["r1-c3", "r1-c5", "r2-c3", "r2-c5"]),
        ("x,y[1],z", ["x", "y1", "z"]),
    ],
)
def test_slurm_nodelist_expands_in_order(text: str, want: list[str]) -> None:
    assert expand_nodelist(text) == want


@pytest.mark.parametrize("text", ["", "n[1-2", "n1-2]", "n[a-b]", "n[1-]"])
def test_bad_nodelists_are_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        expand_nodelist(text)


def test_slurm_peers_use_nodeid_and_peer_port() -> None:
    env = {"SLURM_JOB_NODELIST": "node[01-03]", "SLURM_NODEID": "2"}
    found = from_slurm(env, 4000, None)
    assert found.peers == tuple(PeerAddress(f"node0{i}", 4000) for i in (1, 2, 3))
    assert found.node_rank == 2
    assert from_slurm(env, 4000, 0).node_rank == 0  # --node-rank wins
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        from_slurm({}, 4000, None)
    with pytest.raises(ConfigError, match="node rank 5"):
        from_slurm({"SLURM_JOB_NODELIST": "a,b", "SLURM_NODEID": "5"}, 1, None)


def test_dns_peers_are_sorted_numerically_and_this_node_found_by_address() -> None:
    resolved = ["10.0.0.10", "10.0.0.9", "10.0.0.10", "10.0.0.100"]
    found = from_dns(
        "svc.ns:7000", None, resolve=lambda name, port: resolved, is_local=lambda host: host == "10.0.0.10"
    )
    assert [p.host for p in found.peers] == ["10.0.0.9", "10.0.0.10", "10.0.0.100"]
    assert all(p.port == 7000 for p in found.peers)
    assert found.node_rank == 1
    given = from_dns("svc:7000", 2, resolve=lambda n, p: resolved, is_local=lambda h: False)
    assert given.node_rank == 2
    with pytest.raises(ConfigError, match="give --node-rank"):
        from_dns("svc:7000", None, resolve=lambda n, p: resolved, is_local=lambda h: False)


def test_dns_of_a_real_name_and_local_addresses() -> None:
    found = from_dns(
        "localhost:7000",
        None,
        is_local=lambda host: host in ("127.0.0.1", "::1"),
        resolve=lambda n, p: ["127.0.0.1"],
    )
    assert found.peers == (PeerAddress("127.0.0.1", 7000),)
    assert is_local_address("127.0.0.1")
    assert not is_local_address("198.18.0.254")


def test_discover_needs_one_source_and_a_rank_for_lists() -> None:
    assert discover("", "", False, -1, 1, {}) is None
    found = discover("h1:1,h2:2", "", False, 1, 1, {})
    assert found is not None and found.node_rank == 1
    with pytest.raises(ConfigError, match="--node-rank"):
        discover("h1:1,h2:2", "", False, -1, 1, {})
    with pytest.raises(ConfigError, match="one peer source"):
        discover("h1:1", "svc:1", False, 0, 1, {})
    with pytest.raises(ConfigError, match="not an index"):
        discover("h1:1,h2:2", "", False, 2, 1, {})


def test_peer_settings_follow_flags_env_toml_precedence(tmp_path) -> None:
    toml = tmp_path / "d.toml"
    toml.write_text('peers = "a:1,b:1"\nnode_rank = 0\nheartbeat_timeout = 3.0\n')
    parser = argparse.ArgumentParser()
    daemon_config.add_flags(parser)
    args = parser.parse_args(["--config", str(toml), "--node-rank", "1"])
    cfg = daemon_config.from_args(args, {"LPSYNC_PEERS": "x:1,y:1,z:1", "LPSYNC_NODE_RANK": "2"})
    assert (cfg.peers, cfg.node_rank, cfg.heartbeat_timeout) == ("x:1,y:1,z:1", 1, 3.0)
    found = cfg.peer_set({})
    assert found is not None and found.peers[found.node_rank] == PeerAddress("y", 1)
    with pytest.raises(SystemExit):  # the sources exclude each other on the command line
        parser.parse_args(["--peers", "a:1", "--peers-slurm"])
    with pytest.raises(InvalidArgumentError):
        daemon_config.load({"heartbeat_timeout": 0.5}, {})


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 9, 16])
def test_probe_order_covers_every_peer_and_runs_in_size_minus_one_rounds(size: int) -> None:
    """Every node probes its peers one at a time, in its own order; play it out: in each
    round every pair whose two nodes both want each other next probes. It must finish (no
    node waits on a peer that waits on someone else forever) in the tournament's rounds."""
    from lpsync.daemon.peers.plane import probe_order

    pending = [list(probe_order(rank, size)) for rank in range(size)]
    for rank, order in enumerate(pending):
        assert sorted(order) == [p for p in range(size) if p != rank]
    rounds = 0
    while any(pending):
        ready = [
            a for a in range(size) if pending[a] and pending[pending[a][0]] and pending[pending[a][0]][0] == a
        ]
        assert ready, f"deadlock after {rounds} rounds: {pending}"
        for a in ready:
            pending[a].pop(0)
        rounds += 1
    assert rounds <= size - 1 + size % 2


def test_each_probe_pair_has_connect_timeout_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probing takes one round per peer, one after another: on many nodes or slow links
    the rounds together outlast connect_timeout though no pair does (16 nodes at 200 Mbit/s
    failed the mesh again and again). Each pair must get the whole bound; a pair that
    overruns it still fails."""
    import time
    from types import SimpleNamespace

    from lpsync.daemon.peers import plane as peer_plane
    from lpsync.errors import CollectiveTimeoutError

    pair_seconds = 0.25

    def ping_pong(endpoint, peer: int, initiator: bool, deadline: float) -> tuple[float, float]:
        if time.monotonic() + pair_seconds > deadline:
            raise CollectiveTimeoutError(f"probe of peer {peer} past its deadline")
        time.sleep(pair_seconds)  # the pair's round trips, well inside its own bound
        return 1e-4, 1e8

    monkeypatch.setattr(peer_plane, "_ping_pong", ping_pong)
    gauge = SimpleNamespace(labels=lambda *_: SimpleNamespace(set=lambda _: None))
    plane = SimpleNamespace(
        rank=0,
        size=5,
        _metrics=SimpleNamespace(peer_link_bw=gauge),
        options=SimpleNamespace(connect_timeout=0.5, peers=SimpleNamespace(peers=list(range(5)))),
    )
    link = SimpleNamespace(mesh=None)
    model = peer_plane.PeerPlane._probe(plane, link, [1, 2, 3, 4])  # 4 rounds: 1 s in all
    assert model.alpha == pytest.approx(1e-4)
    pair_seconds = 0.6  # one pair slower than connect_timeout
    with pytest.raises(CollectiveTimeoutError, match="past its deadline"):
        peer_plane.PeerPlane._probe(plane, link, [1, 2, 3, 4])


def _link(interval: float, heard_at: dict[int, float] | None = None) -> Link:
    seen = heard_at or {}
    endpoint = types.SimpleNamespace(
        rank=0, size=3, send=None, recv_into=None, post_recv=None, heard_at=lambda p: seen.get(p, 0.0)
    )
    peers = tuple(PeerAddress(f"n{i}", 4000) for i in range(3))
    return Link(1, endpoint, peers, heartbeat_interval=interval)  # type: ignore[arg-type]


def test_a_peer_silent_while_this_daemon_ran_is_named_unreachable() -> None:
    link = _link(0.5)
    link.ran = 100.0
    link.last_heard = {1: 99.9, 2: 98.0}
    assert link.did_not_run(100.4) == 0.0
    assert link.silent(100.4) == [2]  # 2.4 s without a beat, over two intervals


def test_a_daemon_that_did_not_run_blames_no_peer_for_its_own_pause() -> None:
    """SIGSTOP for ~5 s: every peer's heartbeats wait unread; the silence is this daemon's."""
    link = _link(0.5)
    link.ran = 100.0
    link.last_heard = {1: 99.8, 2: 99.7}
    assert link.did_not_run(105.0) == pytest.approx(4.5)  # beyond one interval
    assert link.silent(105.0) == []  # judged without the pause
    link.excuse(4.5, 105.0)
    link.ran = 105.0
    assert link.last_heard == {1: pytest.approx(104.3), 2: pytest.approx(104.2)}
    assert link.did_not_run(105.1) == 0.0
    assert link.silent(105.1) == []  # 0.9 s since the beats that came before the pause
    link.last_heard[1] = 105.8  # node 1 beats again; node 2 stays silent
    link.ran = 106.3
    assert link.silent(106.5) == [2]  # silent for 2.3 s while this daemon ran: named


def test_a_pause_does_not_hide_a_peer_that_was_already_silent() -> None:
    link = _link(0.5)
    link.ran = 100.0
    link.last_heard = {1: 99.8, 2: 98.5}  # node 2 silent for 1.5 s before the pause
    link.excuse(2.0, 102.5)
    assert link.last_heard == {1: pytest.approx(101.8), 2: pytest.approx(100.5)}
    link.ran = 102.5
    assert link.silent(102.5) == [2]


def test_a_watched_deadline_expires_once_on_the_first_tick_past_it() -> None:
    link = _link(0.5)
    expired: list[str] = []
    link.watch(10.0, lambda: expired.append("early"))
    gone = link.watch(10.0, lambda: expired.append("unwatched"))
    link.watch(20.0, lambda: expired.append("late"))
    link.unwatch(gone)
    link.expire_due(9.9)
    assert expired == []
    link.expire_due(10.4)
    link.expire_due(10.9)
    assert expired == ["early"]
    link.expire_due(25.0)
    assert expired == ["early", "late"]


def test_a_failing_expiry_does_not_stop_the_others(caplog) -> None:
    link = _link(0.5)
    expired: list[int] = []
    link.watch(1.0, lambda: 1 / 0)  # type: ignore[func-returns-value]
    link.watch(1.0, lambda: expired.append(1))
    link.expire_due(2.0)
    assert expired == [1]
    assert "expiry failed" in caplog.text


def test_a_peer_the_transport_sees_sending_is_not_silent() -> None:
    """Its heartbeats wait behind a long message (or one this daemon holds back): the
    transport's heard_at keeps it heard; a peer neither beats nor sends is named."""
    heard_at = {1: 104.9}
    link = _link(0.5, heard_at)
    link.ran = 105.0
    link.last_heard = {1: 100.0, 2: 100.0}
    assert link.heard(1) == 104.9 and link.heard(2) == 100.0
    assert link.silent(105.0) == [2]


class _Beat:
    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done

    def wait(self, deadline: float) -> None:
        assert self._done


def test_a_beat_stuck_behind_one_peers_data_delays_no_other_peers_beats() -> None:
    """Node 2's connection is held back: its first beat never leaves. Node 1 still gets a
    beat every interval, numbered in its own sequence; node 2 gets no second one queued."""
    from lpsync.daemon.peers import plane as peer_plane

    sent: list[tuple[int, int]] = []
    rounds = 4

    def send(peer: int, tag: int, data) -> _Beat:
        sent.append((peer, tag))
        if sum(1 for p, _ in sent if p == 1) == rounds:
            link.broken.set()  # ends the loop after this round
        return _Beat(done=peer != 2)

    link = _link(0.01)
    link.mesh.send = send  # type: ignore[attr-defined]
    plane = types.SimpleNamespace(options=types.SimpleNamespace(heartbeat_interval=0.01))
    peer_plane.PeerPlane._heartbeats_to(plane, link, [1, 2])  # type: ignore[arg-type]
    beats_to = {p: [t for q, t in sent if q == p] for p in (1, 2)}
    assert beats_to[1] == [control_tag(HEARTBEAT, i) for i in range(rounds)]
    assert beats_to[2] == [control_tag(HEARTBEAT, 0)]
