"""What every peer-plane transport shares: the mesh of authenticated connections, its
failure model and its requests. Backends (ucx, tcp) supply how a connection is made,
authenticated, fed and closed.

Mesh: participant ``rank`` accepts on its own entry of ``peers`` (through a runtime that
outlives the mesh) and dials every lower rank, so every pair shares one connection,
authenticated (lpsync.transport.auth) before it carries anything else.

Failure model: the endpoint is a communicator. A timeout, a peer lost (its connection
fails or closes without a goodbye) or any transport error *breaks* it: every wait, now
and later, raises that error, and all connections are closed, which cancels what is in
flight (nothing writes into a caller's buffer afterwards) and makes the other
participants fail promptly too. Recovery is a new endpoint on the same runtime.
"""

from __future__ import annotations

import _thread
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from lpsync.errors import (
    CollectiveTimeoutError,
    ConfigError,
    InvalidArgumentError,
    LpsyncError,
    UnauthenticatedError,
    UnavailableError,
)
from lpsync.transport.addresses import PeerAddress

log = logging.getLogger("lpsync.mesh")


@dataclass(frozen=True)
class MeshOptions:
    rank: int  # this participant's index into peers
    peers: tuple[PeerAddress, ...]  # every participant's listen address, in rank order
    secret: bytes = field(repr=False)  # the cluster secret (lpsync.transport.auth.load_secret)
    connect_timeout: float = 30.0  # the whole mesh must be up within this many seconds
    handshake_timeout: float = 5.0  # one connection: wire-up plus authentication
    close_timeout: float = 5.0  # how long close() waits for the other participants' goodbyes
    # Bytes of messages that arrived before their receive, held per connection (TCP
    # backend): past it the reader stops reading that connection until a receive is
    # posted or a held message is taken, so the sender meets TCP's flow control instead
    # of this process's memory growing. One message larger than this is still taken alone.
    early_bytes: int = 256 << 20
    # The TCP backend's congestion control on every connection (tcp/congestion.py); "":
    # the host's default.
    tcp_congestion: str = ""


# UCX's errors for a message larger than its receive, by class name (ucxx's, ucx-py's).
_TRUNCATED = frozenset({"UCXXMessageTruncatedError", "UCXMessageTruncatedError", "UCXMsgTruncated"})


class Done:
    """A flag set once and waited for by any number of threads, as threading.Event, on one
    C lock held until set: Event waits through a Condition and a new lock per wait in
    Python, which every message of the peer plane paid (docs/benchmarks.md at 623decd,
    2026-12-05)."""

    __slots__ = ("_lock", "flag")

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        self.flag = True
        try:  # noqa: SIM105 (per message: suppress() costs three Python calls)
            self._lock.release()
        except RuntimeError:  # already open: set twice
            pass

    def wait(self, timeout: float | None = None) -> bool:
        if self.flag:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            try:  # noqa: SIM105
                self._lock.release()  # left open for every other waiter
            except RuntimeError:  # opened meanwhile by a second set
                pass
            return True
        return self.flag


class Request:
    """One send or receive in flight; ``event`` is set once it finished."""

    __slots__ = ("_event", "done", "error", "keep", "on_done", "ucx")

    def __init__(self) -> None:
        self.ucx: Any = None  # the UCX backend's own request
        self.keep: Any = None  # the buffer being read or written: alive until the request ends
        self.done = False
        self.error: BaseException | None = None
        self.on_done: Callable[[Request], None] | None = None
        self._event: Done | None = None

    def event(self) -> Done:
        """An event set when the request finishes (made on first use: most sends are
        checked with ``done`` and never waited for)."""
        event = self._event
        if event is None:
            event = Done()
            self._event = event
            if self.done:  # finished before anyone waited
                event.set()
        return event

    def finish(self, error: BaseException | None) -> None:
        self.error, self.done, self.keep = error, True, None
        if self._event is not None:
            self._event.set()
        if self.on_done is not None:
            self.on_done(self)


@dataclass(frozen=True)
class Channel:
    """One peer's messages without the Endpoint's wrappers, for a program run as data flow
    (lpsync.engine.dataflow): ``send(wire_tag, data, on_done)`` and ``post(wire_tag, out,
    on_done)`` take uint8 views and call ``on_done(request)`` on the thread that finishes
    the request (the TCP backend's reader for a receive; the sender's own thread or the
    connection's writer for a send), so that no thread is woken per message to learn of
    it; ``on_done`` must not block. A request has ``done`` and ``error``; ``wait(request,
    deadline, what)`` raises the transport's own error for one (what names it).
    A message's wire tag is ``(tag << shift) | bits``: a routed endpoint folds sender and
    receiver into it (lpsync.engine.routing)."""

    send: Callable[[int, np.ndarray, Callable[[Any], None] | None], Any]
    post: Callable[[int, np.ndarray, Callable[[Any], None]], Any]
    wait: Callable[[Any, float, object], None]
    shift: int = 0
    send_bits: int = 0
    recv_bits: int = 0
    # Whether a program may run its steps on this channel's callbacks (data flow): not on
    # UCX's, which run on the one progress thread, where a step's copy or reduction would
    # hold every other transfer of the node.
    data_flow: bool = True


class InFlight:
    """What send and post_recv return: a send (done once the span may be written again)
    or a posted receive (done once the message has landed). Its description ("send of
    message 5 to rank 2") is written only when an error names it: a pipeline makes
    hundreds of these per collective."""

    __slots__ = ("_owner", "_peer", "_request", "_sending", "_tag")

    def __init__(self, owner: MeshEndpoint, request: Request, peer: int, tag: int, sending: bool) -> None:
        self._owner, self._request = owner, request
        self._peer, self._tag, self._sending = peer, tag, sending

    def __str__(self) -> str:
        if self._sending:
            return f"send of message {self._tag} to rank {self._peer}"
        return f"message {self._tag} from rank {self._peer}"

    def done(self) -> bool:
        return self._request.done

    def wait(self, deadline: float) -> None:
        request = self._request
        if not request.done or request.error is not None:  # most sends finished inline
            self._owner._wait(request, deadline, self)


class MeshEndpoint:
    """The transport-neutral half of an endpoint: forming the mesh, breaking it, waiting."""

    def __init__(self, options: MeshOptions) -> None:
        if not 0 <= options.rank < len(options.peers):
            raise ConfigError(f"rank {options.rank} is not an index into {len(options.peers)} peers")
        self.options = options
        self.rank, self.size = options.rank, len(options.peers)
        self._lock = threading.Lock()
        self._formed = threading.Condition(self._lock)
        self._waiters: set[Done] = set()
        self._broken: LpsyncError | None = None
        self._closing = False
        self._closed = False
        self._conns: dict[int, Any] = {}  # peer rank -> the backend's connection
        self._staging = np.empty(0, np.uint8)
        self._handshakes: list[threading.Thread] = []  # accepted connections authenticating
        self._runtime: Any = None  # the backend's runtime: listener (and UCX worker)
        self._owns_runtime = False

    def heard_at(self, peer: int) -> float:
        """The last moment ``peer`` was seen sending (time.monotonic()), where the backend
        can tell (TCP: a long message read, or held back, keeps the peer heard); 0.0 where
        it cannot, and silence is then judged by the heartbeats alone."""
        return 0.0

    @classmethod
    def connect(cls, options: Any, runtime: Any = None) -> Self:
        """Dial the lower ranks, accept the higher ones, authenticate all. Without
        ``runtime`` the endpoint makes its own (listening on its entry's port) and closes
        it with itself. Raises CollectiveTimeoutError naming the missing ranks,
        UnauthenticatedError on a refusal."""
        endpoint = cls(options)
        try:
            endpoint._start(runtime)
        except BaseException:
            endpoint.close()
            raise
        return endpoint

    def _start(self, runtime: Any) -> None:
        deadline = time.monotonic() + self.options.connect_timeout
        if runtime is None:
            runtime = self._own_runtime()
            self._owns_runtime = True
        if not runtime.alive:
            raise UnavailableError("the transport runtime is closed")
        self._runtime = runtime
        runtime.set_acceptor(self._on_accept)
        try:
            self._form(deadline)
        finally:
            runtime.set_acceptor(None)
            self._join_handshakes(deadline)

    def _own_runtime(self) -> Any:
        """A runtime listening on this rank's port, for an endpoint connected without one."""
        raise NotImplementedError

    def _alive(self) -> bool:
        return self._runtime is not None and bool(self._runtime.alive)

    def _on_accept(self, connection: Any) -> None:
        # On the runtime's thread: authenticate on a thread of its own (it waits for messages).
        thread = threading.Thread(
            target=self._accept, args=(connection,), daemon=True, name=f"lpsync-accept-r{self.rank}"
        )
        with self._lock:
            self._handshakes.append(thread)
        thread.start()

    def _accept(self, connection: Any) -> None:
        raise NotImplementedError

    def _unfinished(self, error: Exception) -> None:
        """Log an accepted connection that failed authentication (a refusal logs itself)."""
        if not isinstance(error, UnauthenticatedError):
            # A peer holding another secret rejects our proof and hangs up here.
            log.warning(
                "rank %d: refused a connection at :%d: it left authentication "
                "unfinished (%s: %s); a peer with another secret does that",
                self.rank,
                self.options.peers[self.rank].port,
                type(error).__name__,
                error,
            )

    def _join_handshakes(self, deadline: float) -> None:
        with self._lock:
            threads, self._handshakes = self._handshakes, []
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + self.options.handshake_timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    # -- forming -------------------------------------------------------------------------

    def _form(self, deadline: float) -> None:
        """Dial the lower ranks (each on a thread of its own) and wait until every
        connection is up: CollectiveTimeoutError naming the missing ranks at ``deadline``."""
        errors: list[BaseException] = []
        dialers = [
            threading.Thread(
                target=self._dial_guarded,
                args=(peer, deadline, errors),
                name=f"lpsync-dial-{peer}",
                daemon=True,
            )
            for peer in range(self.rank)
        ]
        for thread in dialers:
            thread.start()
        for thread in dialers:
            thread.join(max(0.0, deadline - time.monotonic()) + self.options.handshake_timeout)
        if errors:
            raise errors[0]
        with self._formed:
            while len(self._conns) < self.size - 1 and self._broken is None:
                if not self._alive():
                    raise UnavailableError("the transport runtime was closed while connecting")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = self._missing()
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: ranks {missing} did not connect within "
                        f"{self.options.connect_timeout:.0f} s (started? same --peers list? "
                        "a firewall?)"
                    )
                self._formed.wait(min(remaining, 0.5))
        self._check()

    def _missing(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank and r not in self._conns]

    def _dial_guarded(self, peer: int, deadline: float, errors: list[BaseException]) -> None:
        try:
            self._dial(peer, deadline)
        except BaseException as error:
            errors.append(error)

    def _dial(self, peer: int, deadline: float) -> None:
        """Dial ``peer`` until ``_connect`` succeeds or the deadline passes; a refusal
        (UnauthenticatedError) is final, anything else is retried."""
        address = self.options.peers[peer]
        host = resolve(address.host)
        pause, last = 0.05, "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if not self._alive():
                raise UnavailableError("the transport runtime was closed while connecting")
            if remaining <= 0:
                raise CollectiveTimeoutError(
                    f"rank {self.rank} could not reach rank {peer} at {address} ({last})"
                )
            try:
                self._connect(peer, host, address.port, remaining, deadline)
                return
            except UnauthenticatedError:
                raise
            except ConnectionRefusedError:
                last = "connection refused"
            except Exception as error:
                # Not listening yet, or no mesh forming there yet (it closes us before the
                # verdict): retry until the deadline.
                last = f"{type(error).__name__}: {error}"
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(1.0, pause * 2)

    def _connect(self, peer: int, host: str, port: int, remaining: float, deadline: float) -> None:
        """Make, authenticate and register one connection to ``peer``; raise to retry."""
        raise NotImplementedError

    def _admit(self, rank: int) -> str | None:
        if not self.rank < rank < self.size:
            return (
                f"rank {rank} should not dial rank {self.rank} (higher ranks dial lower "
                f"ones; {self.size} participants)"
            )
        if rank not in self._missing():
            return f"rank {rank} is already connected"
        return None

    # -- failure -------------------------------------------------------------------------

    def _fail(self, error: LpsyncError) -> None:
        """Break the endpoint with ``error`` (the first one wins) and wake every waiter."""
        with self._formed:
            if self._broken is not None:
                return
            self._broken = error
            waiters = list(self._waiters)
            self._formed.notify_all()
        for event in waiters:
            event.set()
        log.warning("rank %d: %s", self.rank, error)
        if not self._closing:
            self._close_connections()  # cancels in-flight requests and tells the peers at once

    def _close_connections(self) -> None:
        raise NotImplementedError

    def abort(self, error: BaseException) -> None:
        """Break the endpoint from outside (a heartbeat watchdog that declared a peer
        gone, a collective that failed with receives posted): every wait raises
        ``error`` (an LpsyncError; anything else as UnavailableError), unless something
        broke it first."""
        self._fail(
            error
            if isinstance(error, LpsyncError)
            else UnavailableError(f"rank {self.rank}: aborted: {error!r}")
        )

    @property
    def error(self) -> LpsyncError | None:
        """What broke this endpoint (a lost peer, a timeout), or None while it is healthy;
        set as soon as a peer is reported gone, even when nothing was waiting on it."""
        return self._broken

    def _check(self) -> None:
        broken = self._broken
        if broken is not None:
            # A fresh instance per raise: one shared exception would pile up tracebacks.
            raise type(broken)(*broken.args)
        if self._closed:
            raise UnavailableError(f"rank {self.rank}'s endpoint is closed")

    def _conn(self, peer: int) -> Any:
        if self._broken is not None or self._closed:
            self._check()
        try:
            return self._conns[peer]
        except KeyError:
            raise InvalidArgumentError(
                f"rank {self.rank} has no peer rank {peer} ({self.size} participants)"
            ) from None

    def _peer_gone(self, rank: int, address: PeerAddress) -> None:
        """A connection closed: a failure unless its peer said goodbye or we are closing."""
        if not self._closing:
            self._fail(
                UnavailableError(
                    f"peer rank {rank} at {address} is gone: its connection failed or closed mid-collective"
                )
            )

    def _wait(self, request: Request, deadline: float, what: object) -> None:
        """Wait for ``request`` until ``deadline``; waking early when the endpoint breaks.
        ``what`` names it in errors (str() of it, taken only then)."""
        if not request.done:
            event = request.event()
            with self._lock:
                self._waiters.add(event)
            try:
                while not request.done:
                    self._check()
                    remaining = deadline - time.monotonic()
                    if (remaining <= 0 or not event.wait(remaining)) and not request.done:
                        self._fail(CollectiveTimeoutError(f"rank {self.rank} timed out waiting for {what}"))
                        self._check()
            finally:
                with self._lock:
                    self._waiters.discard(event)
        error = request.error
        if error is None:
            return
        self._check()  # cancelled because the endpoint broke: report why it broke
        # ucxx names its class UCXXMessageTruncatedError (exported as UCXMessageTruncatedError).
        if isinstance(error, InvalidArgumentError) or type(error).__name__ in _TRUNCATED:
            raise InvalidArgumentError(
                f"{what}: the message is larger than the receive "
                "buffer (mismatched counts across participants?)"
            )
        self._fail(UnavailableError(f"{what} failed: {type(error).__name__}: {error}"))
        self._check()

    # -- receiving, for every backend ---------------------------------------------------------

    def send(self, peer: int, tag: int, data: np.ndarray) -> InFlight:
        raise NotImplementedError

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> InFlight:
        raise NotImplementedError

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        self.post_recv(peer, tag, out).wait(deadline)

    @contextmanager
    def recv_borrow(self, peer: int, tag: int, nbytes: int, deadline: float) -> Iterator[np.ndarray]:
        # One staging buffer, reused: the executor holds at most one borrow at a time.
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, np.uint8)
        view = self._staging[:nbytes]
        self.recv_into(peer, tag, view, deadline)
        lent = view.view()
        lent.flags.writeable = False
        yield lent

    def _late_goodbyes(self, goodbyes: list[threading.Event | Done], deadline: float) -> None:
        late = sum(not event.wait(max(0.0, deadline - time.monotonic())) for event in goodbyes)
        if late:
            log.warning(
                "rank %d: no goodbye from %d peer(s) within %.0f s; closing anyway",
                self.rank,
                late,
                self.options.close_timeout,
            )


def bytes_view(data: np.ndarray) -> np.ndarray:
    """``data`` as flat bytes; InvalidArgumentError unless it is contiguous."""
    if not data.flags.c_contiguous:
        raise InvalidArgumentError("transports send and receive contiguous spans only")
    return data.reshape(-1).view(np.uint8)


def port_open(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve(host: str) -> str:
    """A numeric address for ``host`` (IPv4 first): UCX wants one, and it is resolved once."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(f"cannot resolve peer host {host!r}: {error}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])
