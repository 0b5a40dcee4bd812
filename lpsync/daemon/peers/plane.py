"""The peer manager: this daemon's node-level mesh over every daemon of the cluster.

Lifecycle (one background thread, ``lpsync-peers``): open the transport's runtime (UCX
by default, or plain TCP: lpsync.transport.backends; listener on this daemon's peer
port, kept for the daemon's life), connect the mesh on it (rank = node rank; the daemon
serves single-node jobs meanwhile), probe alpha/beta to every peer, tell each other
whether any had a mesh before and what the Exchange carries (the outcomes of their
last collectives), start heartbeats and the note readers (NOTE: any-source sends;
ATTACHED: the ranks each node serves, peers/attached.py, which on_mesh tells anew),
then wait until the mesh breaks (a peer killed, cut off, silent for
``heartbeat_timeout``, or any transport error). A broken mesh is closed, logged and
rebuilt on the same runtime in the background (only connections are made anew),
retrying until the peers are back; meanwhile a collective fails UNAVAILABLE at once
(before the first mesh it waits for one, bounded by its own deadline).

Invariants:
  * a Link is one generation of the mesh; once broken it stays broken (the endpoint is a
    communicator) and collectives that used it fail with UnavailableError;
  * control messages (heartbeats, probes, spec exchange) use tags with bit 63 set; the
    collectives' folded tags never set it (lpsync.transport.tags: every tag layout);
  * several local participant threads use one Link at once: the endpoints' send and
    recv_into are safe from any thread; only their recv_borrow staging buffer is
    shared, so SharedEndpoint gives each thread its own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from prometheus_client import Counter, Gauge

from lpsync.algorithms import LinkModel
from lpsync.daemon.peers.discovery import PeerSet
from lpsync.daemon.peers.native_channels import NativeChannels
from lpsync.engine.endpoint import PostingEndpoint, RecvRequest, SendRequest
from lpsync.errors import LpsyncError, UnavailableError
from lpsync.transport import backends
from lpsync.transport.addresses import PeerAddress
from lpsync.transport.mesh import Channel, InFlight, MeshEndpoint, MeshOptions
from lpsync.transport.tags import ATTACHED, HEARTBEAT, HISTORY, NOTE, PROBE, TOLD, control_tag

log = logging.getLogger("lpsync.peers")

NOTE_BYTES = 4096  # the largest note (note()), framed by its length
_NOTE_LENGTH = struct.Struct("<I")
_FOREVER = 1e6  # seconds a note receive waits before it is posted again: notes may not come
# (bytes, round trips; the best one counts). Small round trips are cheap, and a daemon
# that has just started shares its cores with the others starting: best of 3 measured
# alpha at 0.5-2.9 ms on links whose quiet round trip is a few hundred us.
_PROBES = ((8, 20), (4 << 20, 3))


class PeerMetrics(Protocol):
    """The series the peer plane records (the control plane's Metrics has them): the peer
    plane stands below the control plane and knows only these."""

    peers_expected: Gauge
    peers_connected: Gauge
    peer_link_bw: Gauge
    peer_heartbeats: Counter


@dataclass(frozen=True)
class PeerPlaneOptions:
    peers: PeerSet
    secret: bytes = field(repr=False)
    heartbeat_interval: float = 1.0  # seconds between heartbeats to each peer
    heartbeat_timeout: float = 5.0  # a peer silent this long breaks the mesh
    connect_timeout: float = 20.0  # one attempt to build the mesh; then retry
    tls: str | None = "tcp"  # UCX_TLS of the peer plane; None: UCX chooses
    transport: str = "ucx"  # lpsync.transport.backends.TRANSPORTS
    probe: bool = True  # measure alpha/beta to every peer after connecting
    agreement_radix: int = 8  # the agreement tree's fan-out (collectives/agreement.py)
    tcp_congestion: str = ""  # the TCP backend's congestion control; "": the host's


class SharedEndpoint:
    """An endpoint used by several threads: recv_borrow stages per thread."""

    def __init__(self, endpoint: MeshEndpoint) -> None:
        self._endpoint = endpoint
        self.rank, self.size = endpoint.rank, endpoint.size
        self._local = threading.local()
        # The endpoint's own methods, not wrappers: every message of the plane calls one.
        self.send: Callable[[int, int, np.ndarray], SendRequest] = endpoint.send
        self.recv_into: Callable[[int, int, np.ndarray, float], None] = endpoint.recv_into
        self.post_recv: Callable[[int, int, np.ndarray], RecvRequest] = endpoint.post_recv
        self._channel = getattr(endpoint, "channel", None)  # the TCP backend's too

    def channel(self, peer: int) -> Channel | None:
        return None if self._channel is None else self._channel(peer)

    def abort(self, error: BaseException) -> None:
        self._endpoint.abort(error)

    @contextlib.contextmanager
    def recv_borrow(self, peer: int, tag: int, nbytes: int, deadline: float) -> Iterator[np.ndarray]:
        staging = getattr(self._local, "staging", None)
        if staging is None or staging.nbytes < nbytes:
            staging = self._local.staging = np.empty(nbytes, np.uint8)
        view = staging[:nbytes]
        self._endpoint.recv_into(peer, tag, view, deadline)
        lent = view.view()
        lent.flags.writeable = False
        yield lent


class _Renumbered:
    """The shared endpoint in a job's own node numbers: peer i is daemon ``daemons[i]``."""

    def __init__(self, endpoint: PostingEndpoint, daemons: tuple[int, ...]) -> None:
        self._endpoint, self._daemons = endpoint, daemons
        self.rank, self.size = daemons.index(endpoint.rank), len(daemons)
        self._channel = getattr(endpoint, "channel", None)

    def channel(self, peer: int) -> Channel | None:
        return None if self._channel is None else self._channel(self._daemons[peer])

    def send(self, peer: int, tag: int, data: np.ndarray) -> SendRequest:
        return self._endpoint.send(self._daemons[peer], tag, data)

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        self._endpoint.recv_into(self._daemons[peer], tag, out, deadline)

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> RecvRequest | None:
        return self._endpoint.post_recv(self._daemons[peer], tag, out)

    def recv_borrow(self, peer: int, tag: int, nbytes: int, deadline: float):
        return self._endpoint.recv_borrow(self._daemons[peer], tag, nbytes, deadline)

    def abort(self, error: BaseException) -> None:
        self._endpoint.abort(error)


class Link:
    """One generation of the mesh: the shared endpoint and the probed link model."""

    def __init__(
        self,
        generation: int,
        endpoint: MeshEndpoint,
        peers: tuple[PeerAddress, ...] = (),
        heartbeat_interval: float = 1.0,
        agreement_radix: int = 8,
    ) -> None:
        self.generation = generation
        self.agreement_radix = agreement_radix  # the same on every node (--agreement-radix)
        self.mesh = endpoint
        self._peers, self._interval = peers, heartbeat_interval
        self.endpoint: PostingEndpoint = SharedEndpoint(endpoint)
        self.model: LinkModel | None = None  # the slowest probed peer link
        self.broken = threading.Event()  # set once: the heartbeat threads then end
        self.last_heard: dict[int, float] = {}  # peer -> monotonic time of its last heartbeat
        # The watchdog's last tick: when this daemon was last seen running. A daemon that
        # was stopped or starved finds every peer's heartbeats unread in its sockets.
        self.ran = time.monotonic()
        # Some node of this mesh had one before: a rebuild, not the cluster's start
        # (PeerPlane._history); the same on every node of the mesh.
        self.rebuilt = False
        self.notes_sent: dict[tuple[int, int], int] = {}  # (kind, peer) -> notes sent (tag counts)
        self.notes_lock = threading.Lock()
        # Deadlines of waits no thread blocks in (a Later's): the watchdog calls each
        # one's expiry on its first tick past it. Per call a dict entry, not a timer.
        self._deadlines: dict[int, tuple[float, Callable[[], None]]] = {}
        self._deadlines_lock = threading.Lock()
        self._deadline_keys = itertools.count()

    @property
    def error(self) -> LpsyncError | None:
        return self.mesh.error

    def for_job(self, daemons: tuple[int, ...]) -> Link:
        """This link as a job on ``daemons`` sees it (its nodes 0..N-1 are those daemons;
        values.NodeLayout.cluster); itself where the numbers are the same (empty)."""
        return _JobLink(self, daemons) if daemons else self

    def check(self) -> None:
        if self.mesh.error is not None:
            raise UnavailableError(f"the peer plane broke: {self.failure()}")

    def watch(self, deadline: float, expire: Callable[[], None]) -> int:
        """Call ``expire`` on the watchdog's thread once ``deadline`` has passed (within a
        tick), unless ``unwatch`` came first; a key for unwatch."""
        key = next(self._deadline_keys)
        with self._deadlines_lock:
            self._deadlines[key] = (deadline, expire)
        return key

    def unwatch(self, key: int) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(key, None)

    def expire_due(self, now: float) -> None:
        """The watchdog's tick: call the expiry of every deadline that has passed."""
        if not self._deadlines:
            return
        with self._deadlines_lock:
            due = [key for key, (deadline, _) in self._deadlines.items() if deadline <= now]
            expiries = [self._deadlines.pop(key)[1] for key in due]
        for expire in expiries:
            try:
                expire()
            except Exception:  # one failed expiry must not stop the watchdog
                log.exception("node %d: a deadline's expiry failed", self.mesh.rank)

    def did_not_run(self, now: float) -> float:
        """Seconds this daemon did not run before ``now``: how much later than one
        interval its watchdog ticks, when that is over an interval (else 0)."""
        late = now - self.ran - self._interval
        return late if late > self._interval else 0.0

    def excuse(self, paused: float, now: float) -> None:
        """Move every peer's last heartbeat ``paused`` seconds later (at most to ``now``):
        silence counts only while this daemon runs, so a dead peer is still found."""
        for peer, heard in list(self.last_heard.items()):
            self.last_heard[peer] = max(self.last_heard.get(peer, heard), min(heard + paused, now))

    def heard(self, peer: int) -> float:
        """When ``peer`` was last known to be alive: its last heartbeat, or later where the
        transport saw it sending since (its heartbeats wait behind a long message on the
        same connection, or behind one this daemon is not ready to read)."""
        return max(self.last_heard.get(peer, 0.0), self.mesh.heard_at(peer))

    def silent(self, now: float | None = None) -> list[int]:
        """Peers not heard from for over two heartbeat intervals while this daemon ran:
        the unreachable ones."""
        now = time.monotonic() if now is None else now
        now -= self.did_not_run(now)
        return sorted(p for p in list(self.last_heard) if now - self.heard(p) > 2 * self._interval)

    def failure(self) -> str:
        """What broke this mesh, naming the peers that went silent: the first error may
        come from a healthy peer that closed its side first (it lost the silent one too)."""
        now = time.monotonic()
        silent = self.silent(now)
        text = str(self.mesh.error)
        if silent:
            names = ", ".join(
                f"node {p} ({self._peers[p]}, silent {now - self.heard(p):.1f} s)"
                if p < len(self._peers)
                else f"node {p}"
                for p in silent
            )
            text += f"; unreachable: {names}"
        if paused := self.did_not_run(now):
            text += f"; this daemon did not run for {paused:.1f} s before (stopped or starved)"
        return text


STOP_BOUND = 3.0  # seconds for the peer plane's part of a daemon's 5-s SIGTERM budget


class Exchange(Protocol):
    """What every node tells every other on each new mesh before it serves a collective
    (collectives/outcomes.py: the outcomes of their last collectives)."""

    max_bytes: int  # the largest message a node sends

    def message(self) -> np.ndarray: ...

    def heard(self, told: dict[int, np.ndarray]) -> object: ...  # by peer


class PeerPlane:
    def __init__(self, options: PeerPlaneOptions, metrics: PeerMetrics) -> None:
        self.options = options
        self.exchange: Exchange | None = None  # set before start() (the collectives' side)
        self.on_note: Callable[[int, bytes], None] | None = None  # (peer, data): note()s heard
        # (peer, data): ATTACHED notes heard; and what runs on each new mesh once it is up
        # (peers/attached.py tells the ranks this node serves again).
        self.on_attached: Callable[[int, bytes], None] | None = None
        self.on_mesh: Callable[[], None] | None = None
        # What runs once a mesh is lost: armed plans across nodes stop waiting on the peers
        # (their engines do not hear the heartbeats).
        self.on_lost: Callable[[], None] | None = None
        self.rank, self.size = options.peers.node_rank, len(options.peers.peers)
        self._metrics = metrics
        metrics.peers_expected.set(self.size - 1)
        self._runtime: backends.Runtime | None = None  # opened by the manager thread, kept
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._link: Link | None = None
        self._stop = threading.Event()
        self._generation = 0
        self._lost: str | None = None  # why the last mesh broke, until a new one is up
        self._had_mesh = False  # a mesh was up once (this daemon's own history)
        # What this node owes the next mesh: (expiry, callback) of collectives it failed
        # without one (owe()); bounded, oldest dropped first.
        self._owed: list[tuple[float, Callable[[Link], None]]] = []
        self._thread = threading.Thread(target=self._main, name="lpsync-peers", daemon=True)
        self._native: NativeChannels | None = None  # made on first use (native_channels)
        self._native_failed = False

    def native_channels(self) -> NativeChannels | None:
        """The listener and dialler of armed plans' channels (native_channels.py), on the
        TCP transport only (the engine's channels are TCP sockets); None elsewhere, or
        where it cannot listen (said once in the log)."""
        if self.options.transport != "tcp" or self._native_failed:
            return None
        with self._lock:
            if self._native is None and not self._stop.is_set():
                try:
                    self._native = NativeChannels(
                        self.options.peers.peers[self.rank], self.options.secret, self.rank
                    )
                except OSError as error:
                    self._native_failed = True
                    log.warning(
                        "node %d: armed plans stay within the node: no listener for their channels: %s",
                        self.rank,
                        error,
                    )
            return self._native

    def start(self) -> None:
        self._thread.start()

    # -- for collectives ----------------------------------------------------------------------
    def link(self, deadline: float) -> Link:
        """The current healthy mesh, waiting for one until ``deadline`` while none has
        been up yet (the daemons start); UnavailableError naming the peers when there is
        none by then. Once a mesh has been lost, a collective that finds none fails at
        once, UNAVAILABLE, instead of waiting for the rebuild: the nodes whose meshes broke
        earlier failed their part of it already (and cannot tell anyone: no mesh), so on
        the next mesh it would wait out its own timeout for them (seen in the chaos run:
        7-8 s instead of the heartbeat bound) and then break that mesh with a timeout.
        For the same reason a collective that waited on a restarted daemon for its first
        mesh fails when that mesh turns out to be a rebuild (the survivors, whose mesh was
        lost, failed it at once); at the cluster's start every node waits alike."""
        link = self._link  # the common case, without the lock (one reference read)
        if link is not None and link.error is None and link.model is not None:
            return link
        waited = False
        with self._changed:
            while True:
                link = self._link
                if link is not None and link.error is None and link.model is not None:
                    if waited and link.rebuilt:
                        raise UnavailableError(
                            f"node {self.rank}: this collective waited for the peer mesh, which "
                            "was rebuilt meanwhile (a peer daemon restarted or came back): the "
                            "other nodes, whose mesh was lost, failed it already"
                        )
                    return link
                # Lost: said so by _serve, or broken and about to be (its watchdog ticks).
                lost = self._lost or (link.failure() if link is not None and link.error is not None else None)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set() or lost is not None:
                    if lost is not None:
                        raise UnavailableError(
                            f"node {self.rank}: the peer mesh is down and rebuilding (lost: {lost})"
                        )
                    peers = ", ".join(
                        f"{i}={p}" for i, p in enumerate(self.options.peers.peers) if i != self.rank
                    )
                    raise UnavailableError(
                        f"node {self.rank}: the peer daemons ({peers}) are not all connected; "
                        "is every daemon of --peers running, with the same secret and "
                        f"--peer-transport ({self.options.transport} here)?"
                    )
                waited = True
                self._changed.wait(remaining)

    def down(self) -> str | None:
        """Why the mesh is down after having been up (None: it is up, or not up yet)."""
        link = self._link
        if link is not None and link.error is None and link.model is not None:
            return None
        return self._lost or (link.failure() if link is not None and link.error is not None else None)

    def owe(self, until: float, tell: Callable[[Link], None]) -> None:
        """Run ``tell(link)`` on the next healthy mesh (now, if one is up), unless
        ``until`` (monotonic) has passed by then: a collective this node failed while its
        mesh was down tells the nodes that may run it on the next mesh. Best effort."""
        with self._changed:
            link = self._link
            if link is None or link.error is not None or link.model is None:
                self._owed = [*self._owed, (until, tell)][-_OWED_MAX:]
                return
        _pay(link, [(until, tell)])

    def note(self, peer: int, data: bytes, kind: int = NOTE) -> None:
        """Send ``data`` (at most NOTE_BYTES) to ``peer``'s ``on_note`` (``on_attached`` for
        kind ATTACHED) on the current mesh, in order with this node's other notes of that
        kind to it. Best effort: dropped without a mesh (what it announces then fails
        anyway: UNAVAILABLE; ATTACHED notes are told again on the next mesh)."""
        if len(data) > NOTE_BYTES:
            raise ValueError(f"a note of {len(data)} bytes (at most {NOTE_BYTES})")
        with self._lock:
            link = self._link
        if link is None or link.error is not None:
            return
        message = np.frombuffer(_NOTE_LENGTH.pack(len(data)) + data, np.uint8)  # never written
        with link.notes_lock:
            count = link.notes_sent.get((kind, peer), 0)
            link.notes_sent[kind, peer] = count + 1
            with contextlib.suppress(LpsyncError):  # the mesh broke: it is being rebuilt
                link.mesh.send(peer, control_tag(kind, count), message)

    def stop(self, bound: float = STOP_BOUND) -> bool:
        """Close the mesh and the runtime within ``bound`` seconds in all; False when a
        thread is still inside the transport by then (a ucxx call that never returned:
        seen when every daemon stops while meshes form), so that the caller exits
        without waiting for it."""
        deadline = time.monotonic() + bound
        self._stop.set()
        with self._changed:
            link, self._link = self._link, None
            native, self._native = self._native, None
            self._changed.notify_all()
        if native is not None:
            native.close()
        if link is not None:
            link.broken.set()
            _close(link, bound=bound / 2)
        for _ in range(2):  # closing the runtime also ends a connect attempt in progress
            if self._runtime is not None:
                self._runtime.close(max(0.1, (deadline - time.monotonic()) / 2))
            self._thread.join(max(0.0, deadline - time.monotonic()))
        runtime, self._runtime = self._runtime, None
        stuck = self._thread.is_alive() or (runtime is not None and runtime.alive)
        if stuck:
            log.error(
                "node %d: the peer plane did not stop within %.0f s; exiting without it", self.rank, bound
            )
        return not stuck

    # -- the background thread ----------------------------------------------------------------
    def _main(self) -> None:
        pause = 0.2
        while not self._stop.is_set():
            log.debug("node %d: connecting the peer mesh", self.rank)
            try:
                if self._runtime is None:
                    self._runtime = backends.open_runtime(
                        self.options.transport,
                        self.options.peers.peers[self.rank].port,
                        self.options.tls,
                        until_exit=True,  # the daemon's: it exits through serve()'s os._exit
                    )
                endpoint = backends.connect(
                    self.options.transport, self._mesh_options(), self._runtime, self.options.tls
                )
            except LpsyncError as error:
                if self._stop.is_set():  # stopping closed the runtime under the dial: no retry
                    break
                log.warning(
                    "node %d: peer mesh not up yet (%s: %s); retrying", self.rank, type(error).__name__, error
                )
                self._stop.wait(pause)
                pause = min(2.0, pause * 2)
                continue
            pause = 0.2
            self._generation += 1
            link = Link(
                self._generation,
                endpoint,
                self.options.peers.peers,
                self.options.heartbeat_interval,
                self.options.agreement_radix,
            )
            self._serve(link)

    def _mesh_options(self) -> MeshOptions:
        o = self.options
        return MeshOptions(
            rank=self.rank,
            peers=o.peers.peers,
            secret=o.secret,
            connect_timeout=o.connect_timeout,
            close_timeout=1.0,
            tcp_congestion=o.tcp_congestion,
        )

    def _serve(self, link: Link) -> None:
        """Probe, publish, heartbeat until the link breaks; then close it."""
        others = [p for p in range(self.size) if p != self.rank]
        workers = [
            threading.Thread(target=self._heartbeats_from, args=(link, p), daemon=True, name=f"lpsync-hb-{p}")
            for p in others
        ]
        workers.append(
            threading.Thread(
                target=self._heartbeats_to, args=(link, others), daemon=True, name="lpsync-hb-send"
            )
        )
        for kind, on_note in ((NOTE, self.on_note), (ATTACHED, self.on_attached)):
            if on_note is None:
                continue
            workers += [
                threading.Thread(
                    target=self._notes_from,
                    args=(link, p, kind, on_note),
                    daemon=True,
                    name=f"lpsync-note{kind}-{p}",
                )
                for p in others
            ]
        try:
            link.model = (
                self._probe(link, others)
                if self.options.probe
                else LinkModel.from_bandwidth(alpha=50e-6, bandwidth=1.25e9)
            )
            link.rebuilt = self._history(link, others)
            if self.exchange is not None:
                self._tell(link, others, self.exchange)
        except LpsyncError as error:
            log.warning("node %d: probing the peer links failed: %s", self.rank, error)
            _close(link)
            return
        for worker in workers:
            worker.start()
        with self._changed:
            self._link, self._lost, self._had_mesh = link, None, True
            owed, self._owed = self._owed, []
            self._changed.notify_all()
        _pay(link, owed)
        if self.on_mesh is not None:
            try:
                self.on_mesh()
            except Exception:  # the mesh serves on; what it would have told is retold next time
                log.exception("node %d: telling the new mesh failed", self.rank)
        self._metrics.peers_connected.set(len(others))
        log.info(
            "node %d: peer mesh up (generation %d, %d peers; alpha %.1f us, %.3g bytes/s)",
            self.rank,
            link.generation,
            len(others),
            link.model.alpha * 1e6,
            link.model.bandwidth,
        )
        now = time.monotonic()
        link.last_heard.update({p: now for p in others})
        link.ran = now
        self._watch(link)
        link.broken.set()
        failure = link.failure()
        with self._changed:
            if self._link is link:
                self._link = None
            self._lost = failure
            self._changed.notify_all()  # waiters now wait at most the heartbeat timeout
        self._metrics.peers_connected.set(0)
        if not self._stop.is_set():
            log.warning("node %d: peer mesh lost (%s); rebuilding it", self.rank, failure)
        if self.on_lost is not None:
            try:
                self.on_lost()
            except Exception:
                log.exception("node %d: stopping the armed plans across nodes failed", self.rank)
        _close(link)
        for worker in workers:
            worker.join(self.options.heartbeat_timeout + 1.0)

    def _heartbeats_to(self, link: Link, others: list[int]) -> None:
        """One beat to every peer each interval, never waiting for one to leave: a beat
        queued behind a long message to one peer (or one that peer holds back) must not
        delay the others' beats. A peer whose last beat has not left yet gets none more
        (it judges this daemon by what it reads: heard_at); counts are per peer."""
        beat = np.zeros(1, np.uint8)  # never written: safe to send while in flight
        counts = dict.fromkeys(others, 0)
        last: dict[int, InFlight] = {}
        while not link.broken.wait(self.options.heartbeat_interval):
            try:
                for p in others:
                    if (previous := last.get(p)) is not None:
                        if not previous.done():
                            continue
                        previous.wait(0.0)  # raises if it failed: the connection broke
                    last[p] = link.mesh.send(p, control_tag(HEARTBEAT, counts[p]), beat)
                    counts[p] += 1
            except LpsyncError:
                link.broken.set()
                return

    def _heartbeats_from(self, link: Link, peer: int) -> None:
        # Receives never time out on their own (that would break the mesh with a timeout);
        # the watchdog in _serve judges silence from link.last_heard and aborts the mesh
        # with UnavailableError.
        buf = np.zeros(1, np.uint8)
        count = 0
        beats = self._metrics.peer_heartbeats.labels(str(self.options.peers.peers[peer]))
        while not link.broken.is_set():
            try:
                link.mesh.recv_into(
                    peer,
                    control_tag(HEARTBEAT, count),
                    buf,
                    time.monotonic() + 10 * self.options.heartbeat_timeout,
                )
            except LpsyncError:
                link.broken.set()
                return
            link.last_heard[peer] = time.monotonic()
            beats.inc()
            count += 1

    def _notes_from(self, link: Link, peer: int, kind: int, on_note: Callable[[int, bytes], None]) -> None:
        """Until the link breaks: hand ``peer``'s notes of ``kind``, in order, to ``on_note``."""
        buf = np.zeros(_NOTE_LENGTH.size + NOTE_BYTES, np.uint8)
        count = 0
        while not link.broken.is_set():
            try:
                link.mesh.recv_into(peer, control_tag(kind, count), buf, time.monotonic() + _FOREVER)
            except LpsyncError:
                return  # the mesh broke (its watchdog and heartbeats say why)
            count += 1
            (size,) = _NOTE_LENGTH.unpack_from(buf)  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on Python 3.12+ only
            try:
                on_note(peer, buf[_NOTE_LENGTH.size : _NOTE_LENGTH.size + min(size, NOTE_BYTES)].tobytes())
            except Exception:  # a bad note must not end this peer's notes
                log.exception("node %d: a note from node %d failed", self.rank, peer)

    def _watch(self, link: Link) -> None:
        """Until the link breaks: abort it when a peer has been silent too long."""
        timeout = self.options.heartbeat_timeout
        tick = min(self.options.heartbeat_interval, timeout / 4)
        excused = False
        while not link.broken.wait(tick):
            if link.error is not None or self._stop.is_set():
                return
            now = time.monotonic()
            if (paused := link.did_not_run(now)) and not excused:
                # Stopped, a paused VM, a starved machine: the peers' heartbeats wait
                # unread in this daemon's sockets, and blaming them would break a mesh
                # they keep. The pause is not their silence; excused once in a row, so a
                # daemon late on every tick still judges.
                log.warning(
                    "node %d: this daemon did not run for %.1f s; that is not its peers' silence",
                    self.rank,
                    paused,
                )
                link.excuse(paused, now)
                link.ran, excused = now, True
                continue
            link.ran, excused = now, False
            link.expire_due(now)
            for peer in list(link.last_heard):
                if now - (heard := link.heard(peer)) > timeout:
                    error = UnavailableError(
                        f"peer node {peer} ({self.options.peers.peers[peer]}) sent no "
                        f"heartbeat for {now - heard:.1f} s (limit {timeout:g} s): declared gone"
                    )
                    log.warning("node %d: %s", self.rank, error)
                    link.mesh.abort(error)
                    return

    def _history(self, link: Link, others: list[int]) -> bool:
        """Whether any node of this mesh had a mesh before (each tells every other): a
        rebuild after a loss, not the cluster's start. Every node computes the same."""
        mine = np.array([self._had_mesh], np.uint8)
        theirs = self._all_to_all(link, others, HISTORY, mine, 1)
        return self._had_mesh or any(bool(t[0]) for t in theirs.values())

    def _tell(self, link: Link, others: list[int], exchange: Exchange) -> None:
        exchange.heard(self._all_to_all(link, others, TOLD, exchange.message(), exchange.max_bytes))

    def _all_to_all(
        self, link: Link, others: list[int], kind: int, mine: np.ndarray, most: int
    ) -> dict[int, np.ndarray]:
        """Send ``mine`` (never written again: safe while in flight) to every other node
        and receive theirs (at most ``most`` bytes each), within connect_timeout."""
        theirs = {p: np.zeros(most, np.uint8) for p in others}
        deadline = time.monotonic() + self.options.connect_timeout
        requests = [link.mesh.post_recv(p, control_tag(kind, 0), theirs[p]) for p in others]
        requests += [link.mesh.send(p, control_tag(kind, 0), mine) for p in others]
        for request in requests:
            request.wait(deadline)
        return theirs

    def _probe(self, link: Link, others: list[int]) -> LinkModel:
        """Ping-pong a small and a large message with every peer (the lower rank pings);
        alpha = half the small round trip, beta from the large one. One peer at a time, in
        the rounds of a round-robin tournament that every node derives alike: each node
        is in one pair per round, so no two probes share a NIC (probing all pairs at once
        measured the probes' own congestion: alpha of 7-39 ms on 1 Gbit/s links). Each
        pair gets connect_timeout of its own: the rounds add up with the node count (16
        nodes at 200 Mbit/s: 15 rounds of about 1 s), and a shared deadline failed the
        probe, and so the mesh, again and again."""
        results: dict[int, tuple[float, float]] = {}
        for peer in probe_order(self.rank, self.size):
            deadline = time.monotonic() + self.options.connect_timeout
            results[peer] = _ping_pong(link.mesh, peer, self.rank < peer, deadline)
        for peer, (_, bandwidth) in results.items():
            self._metrics.peer_link_bw.labels(str(self.options.peers.peers[peer])).set(bandwidth)
        alpha = max(a for a, _ in results.values()) if results else 50e-6
        bandwidth = min(b for _, b in results.values()) if results else 1.25e9
        return LinkModel.from_bandwidth(alpha=alpha, bandwidth=bandwidth, shared_nic=True)


_OWED_MAX = 256  # collectives failed without a mesh that the next one hears of


def _pay(link: Link, owed: list[tuple[float, Callable[[Link], None]]]) -> None:
    now = time.monotonic()
    for until, tell in owed:
        if until > now:
            try:
                tell(link)
            except LpsyncError as error:  # the new mesh broke already: nothing to tell on
                log.debug("could not tell the peers of a failed collective: %s", error)


def probe_order(rank: int, size: int) -> list[int]:
    """``rank``'s partner in each round of a round-robin tournament over ``size`` nodes
    (the circle method; with an odd count one node sits out each round)."""
    n = size + size % 2  # a phantom node n-1 when size is odd
    order = []
    for r in range(n - 1):
        circle = [n - 1] + [(r + i) % (n - 1) for i in range(n - 1)]
        for i in range(n // 2):
            a, b = circle[i], circle[n - 1 - i]
            if rank in (a, b):
                partner = b if a == rank else a
                if partner < size:
                    order.append(partner)
    return order


def _close(link: Link, bound: float = 15.0) -> None:
    """Close a mesh generation without ever blocking the manager for good: ucxx's thread
    joins have no timeout of their own, so the close runs on a helper thread."""
    closer = threading.Thread(target=link.mesh.close, name="lpsync-peers-close", daemon=True)
    closer.start()
    closer.join(bound)
    if closer.is_alive():
        log.error(
            "closing peer mesh generation %d takes over %.0f s; carrying on (its port "
            "may stay bound until it finishes)",
            link.generation,
            bound,
        )


def _ping_pong(endpoint: MeshEndpoint, peer: int, initiator: bool, deadline: float) -> tuple[float, float]:
    """(alpha seconds, bytes/s) to ``peer``; both ends return the initiator's figures."""
    times = []
    tag = 0
    for size, reps in _PROBES:
        buf = np.zeros(size, np.uint8)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            if initiator:
                endpoint.send(peer, control_tag(PROBE, tag), buf).wait(deadline)
                endpoint.recv_into(peer, control_tag(PROBE, tag + 1), buf, deadline)
            else:
                endpoint.recv_into(peer, control_tag(PROBE, tag), buf, deadline)
                endpoint.send(peer, control_tag(PROBE, tag + 1), buf).wait(deadline)
            best = min(best, time.perf_counter() - start)
            tag += 2
        times.append(best)
    alpha = max(times[0] / 2, 1e-6)
    one_way = max(times[1] / 2 - alpha, 1e-6)
    result = np.array([alpha, _PROBES[1][0] / one_way])
    # The initiator's measurement is the pair's: both ends must agree (the tuner's input
    # has to be identical on every node; agreement.py also takes the slowest of all).
    if initiator:
        endpoint.send(peer, control_tag(PROBE, tag), result).wait(deadline)
    else:
        endpoint.recv_into(peer, control_tag(PROBE, tag), result, deadline)
    return float(result[0]), float(result[1])


class _JobLink(Link):
    """A Link whose endpoint speaks a job's node numbers; everything else is the link's."""

    def __init__(self, link: Link, daemons: tuple[int, ...]) -> None:  # no Link.__init__: a view
        self._link = link
        self.endpoint = _Renumbered(link.endpoint, daemons)  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # the attributes a view has not: the link's
        return getattr(self._link, name)
