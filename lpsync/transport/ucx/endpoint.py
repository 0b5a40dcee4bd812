"""The Endpoint of lpsync.engine.transport over UCX (ucxx), one per participant.

Mesh: participant ``rank`` listens on the port of its own entry in ``peers`` and
dials every lower rank; each connection is authenticated (lpsync.transport.auth)
before it is used, so every pair shares exactly one UCX endpoint. Messages use UCX
tag matching; ucxx hashes the message tag with a random per-connection tag agreed
at connect time, so (peer, tag) never collides across connections or with tags a
refused peer could guess.

Threads: ucxx is asyncio-only; a LoopThread owns every ucxx object and the caller's
thread submits coroutines to it and waits on threading events with deadlines. UCX
progresses on ucxx's progress thread, which sleeps in epoll on the worker's event
fd, and completions reach the loop as Python futures through ucxx's notifier thread.
(ucxx's "blocking" mode is no good here: without Python futures every pending
request's wait() is a loop of ``asyncio.sleep(0)``, a busy poll.) Idle, all of these
threads sleep: ~0% CPU.

Failure model: the endpoint is a communicator. A timeout, a peer lost (its UCX
endpoint errors or closes without saying goodbye) or any transport error *breaks*
it: every wait, now and later, raises that error, and all peer connections are
aborted — which cancels the in-flight UCX requests (nothing writes into a caller's
buffer afterwards) and makes the other participants fail promptly too. Recovery is
a new UcxEndpoint. ``close`` is collective like MPI_Finalize: each side says goodbye
and waits (bounded) for the others' goodbyes before tearing connections down, so
an eager message still in flight is never lost to an early close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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
from lpsync.transport.auth import client_handshake, server_handshake
from lpsync.transport.ucx.loop import LoopThread

log = logging.getLogger("lpsync.ucx")

_GOODBYE = b"\x00"
_EPOLL_TIMEOUT_MS = 10


@dataclass(frozen=True)
class UcxOptions:
    rank: int  # this participant's index into peers
    peers: tuple[PeerAddress, ...]  # every participant's listen address, in rank order
    secret: bytes = field(repr=False)  # the cluster secret (lpsync.transport.auth.load_secret)
    connect_timeout: float = 30.0  # the whole mesh must be up within this many seconds
    handshake_timeout: float = 5.0  # one connection: UCX wire-up plus authentication
    close_timeout: float = 5.0  # how long close() waits for the other participants' goodbyes
    tls: str | None = None  # UCX_TLS for this context ("tcp" forces TCP); None: env/UCX default
    ucx_config: tuple[tuple[str, str], ...] = ()  # further UCX options, e.g. (("RNDV_THRESH", "64K"),)


class _Peer:
    __slots__ = ("address", "departed", "endpoint", "goodbye", "rank")

    def __init__(self, rank: int, address: PeerAddress, endpoint: Any) -> None:
        self.rank, self.address, self.endpoint = rank, address, endpoint
        self.departed = False  # said goodbye: its connection closing is no failure
        self.goodbye: asyncio.Task[None] | None = None


class _Send:
    """A send in flight; done once UCX no longer needs the span."""

    __slots__ = ("_future", "_owner", "_what")

    def __init__(self, owner: UcxEndpoint, future: Future[Any], what: str) -> None:
        self._owner, self._future, self._what = owner, future, what

    def done(self) -> bool:
        return self._future.done()

    def wait(self, deadline: float) -> None:
        self._owner._wait(self._future, deadline, self._what)


class UcxEndpoint:
    """One participant's connections to every other; build with ``UcxEndpoint.connect``."""

    def __init__(self, options: UcxOptions) -> None:
        if not 0 <= options.rank < len(options.peers):
            raise ConfigError(f"rank {options.rank} is not an index into {len(options.peers)} peers")
        self.options = options
        self.rank, self.size = options.rank, len(options.peers)
        self._peers: dict[int, _Peer] = {}
        self._lock = threading.Lock()
        self._waiters: set[threading.Event] = set()
        self._broken: LpsyncError | None = None
        self._closing = False
        self._closed = False
        self._staging = np.empty(0, np.uint8)
        self._loop: LoopThread | None = None
        self._ctx: Any = None
        self._progress: Any = None
        self._listener: Any = None
        self._mesh_ready: asyncio.Event | None = None

    # -- setup ---------------------------------------------------------------------------

    @classmethod
    def connect(cls, options: UcxOptions) -> UcxEndpoint:
        """Listen, dial the lower ranks, accept the higher ones, authenticate all; raises
        CollectiveTimeoutError naming the missing ranks, UnauthenticatedError on a refusal."""
        endpoint = cls(options)
        try:
            endpoint._start()
        except BaseException:
            endpoint.close()
            raise
        return endpoint

    def _start(self) -> None:
        opts = self.options
        deadline = time.monotonic() + opts.connect_timeout
        self._loop = LoopThread(f"lpsync-ucx-r{self.rank}")
        self._loop.call(self._a_init(), opts.connect_timeout)
        self._loop.call(self._a_mesh(deadline), opts.connect_timeout + 5.0)

    async def _a_init(self) -> None:
        # Imported here: importing ucxx sets UCX environment variables, which an
        # import of lpsync must not do.
        import ucxx
        from ucxx._lib_async import ApplicationContext
        from ucxx._lib_async.application_context import ProgressTasks

        # A daemon restarted after a crash must rebind its fixed port while the old
        # connections sit in TIME_WAIT.
        # ucxx exports UCX_MEMTYPE_CACHE, which this UCX no longer knows: mute that warning.
        config = {"TCP_CM_REUSEADDR": "y", "WARN_UNUSED_ENV_VARS": "n",
                  **dict(self.options.ucx_config)}
        if self.options.tls is not None:
            config["TLS"] = self.options.tls
        self._ctx = ApplicationContext(config, progress_mode="thread", enable_python_future=True,
                                       connect_timeout=self.options.handshake_timeout)
        # ucxx keeps the progress task only in a module dict that any context's
        # finalizer clears; hold it here so another context's teardown in this
        # process cannot stop ours.
        self._progress = ProgressTasks.get(asyncio.get_running_loop())
        # ucxx's progress thread wakes from epoll every 1 ms even when idle (~1.5% of a
        # core); new requests signal the worker, so 10 ms costs no latency we could measure
        # and idles at ~0%.
        self._ctx.worker.stop_progress_thread()
        self._ctx.worker.start_progress_thread(polling_mode=False, epoll_timeout=_EPOLL_TIMEOUT_MS)
        self._mesh_ready = asyncio.Event()
        if self.size == 1:
            self._mesh_ready.set()
        port = self.options.peers[self.rank].port
        try:
            self._listener = self._ctx.create_listener(self._accept, port=port)
        except ucxx.exceptions.UCXError as error:
            raise UnavailableError(f"rank {self.rank} cannot listen on port {port}: {error}") \
                from None

    async def _a_mesh(self, deadline: float) -> None:
        assert self._mesh_ready is not None
        await asyncio.gather(*(self._dial(peer, deadline) for peer in range(self.rank)))
        try:
            await asyncio.wait_for(self._mesh_ready.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            missing = [r for r in range(self.rank + 1, self.size) if r not in self._peers]
            raise CollectiveTimeoutError(
                f"rank {self.rank}: ranks {missing} did not connect within "
                f"{self.options.connect_timeout:.0f} s (started? same --peers list? "
                "a firewall?)") from None

    async def _dial(self, peer: int, deadline: float) -> None:
        import ucxx

        address = self.options.peers[peer]
        host = await _resolve(address.host)
        pause, last = 0.05, "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeoutError(f"rank {self.rank} could not reach rank {peer} at "
                                             f"{address} ({last})")
            # UCX gives up on a port nobody listens on only after its whole connect
            # timeout; a plain TCP connect says "refused" at once, so wait for that first.
            if not await _port_open(host, address.port, min(1.0, remaining)):
                last = "connection refused"
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(1.0, pause * 2)
                continue
            try:
                ep = await self._ctx.create_endpoint(
                    host, address.port, endpoint_error_handling=True,
                    connect_timeout=min(self.options.handshake_timeout, remaining))
                break
            except (ucxx.exceptions.UCXError, TimeoutError) as error:
                # Not listening yet, most likely: retry with backoff until the deadline.
                last = f"{type(error).__name__}: {error}"
                await asyncio.sleep(min(pause, max(0.0, remaining)))
                pause = min(1.0, pause * 2)
        try:
            result = await asyncio.wait_for(
                client_handshake(_sender(ep), _receiver(ep), self.options.secret, self.rank,
                                 expect_rank=peer),
                self.options.handshake_timeout)
        except UnauthenticatedError:
            ep.abort()
            raise
        except (ucxx.exceptions.UCXError, TimeoutError) as error:
            ep.abort()
            raise UnauthenticatedError(f"rank {peer} at {address} dropped the connection during "
                                       f"authentication ({error}); it refused us or is not lpsync") \
                from None
        self._register(result.peer_rank, ep)

    async def _accept(self, ep: Any) -> None:
        import ucxx

        where = f"listener :{self.options.peers[self.rank].port}"
        try:
            result = await asyncio.wait_for(
                server_handshake(_sender(ep), _receiver(ep), self.options.secret, self.rank,
                                 where=where, admit=self._admit),
                self.options.handshake_timeout)
        except (UnauthenticatedError, ucxx.exceptions.UCXError, TimeoutError) as error:
            if not isinstance(error, UnauthenticatedError):
                # A peer holding another secret rejects our proof and hangs up here.
                log.warning("rank %d: refused a connection at %s: it left authentication "
                            "unfinished (%s: %s); a peer with another secret does that",
                            self.rank, where, type(error).__name__, error)
            ep.abort()
            return
        self._register(result.peer_rank, ep)

    def _admit(self, rank: int) -> str | None:
        if not self.rank < rank < self.size:
            return (f"rank {rank} should not dial rank {self.rank} (higher ranks dial lower "
                    f"ones; {self.size} participants)")
        if rank in self._peers:
            return f"rank {rank} is already connected"
        return None

    def _register(self, rank: int, ep: Any) -> None:
        peer = _Peer(rank, self.options.peers[rank], ep)
        self._peers[rank] = peer
        ep.set_close_callback(self._on_close, cb_args=(rank,))
        peer.goodbye = asyncio.get_running_loop().create_task(self._await_goodbye(peer))
        if len(self._peers) == self.size - 1 and self._mesh_ready is not None:
            self._mesh_ready.set()
        log.debug("rank %d: connected to rank %d at %s", self.rank, rank, peer.address)

    async def _await_goodbye(self, peer: _Peer) -> None:
        # The connection's base tag carried the handshake; its next message is goodbye.
        buf = bytearray(1)
        try:
            await peer.endpoint.recv(buf)
        except Exception as error:  # the connection died first: _on_close reports that
            _release_frames(error)
            return
        peer.departed = True

    def _on_close(self, rank: int) -> None:
        # Runs on ucxx's progress thread, inside UCX progress: only hand over to the loop.
        peer = self._peers.get(rank)
        if self._closing or peer is None or peer.departed or self._loop is None:
            return
        self._loop.loop.call_soon_threadsafe(self._judge_close_soon, peer)

    def _judge_close_soon(self, peer: _Peer) -> None:
        asyncio.get_running_loop().create_task(self._judge_close(peer))

    async def _judge_close(self, peer: _Peer) -> None:
        # A goodbye that arrived in the same progress call as the close has not been
        # delivered to its task yet; give it that moment. When the connection died
        # instead, the goodbye receive is cancelled and the task ends at once.
        if peer.goodbye is not None:
            await asyncio.wait({peer.goodbye}, timeout=0.5)
        if self._closing or peer.departed:
            return
        self._fail(UnavailableError(f"peer rank {peer.rank} at {peer.address} is gone: its "
                                    "connection failed or closed mid-collective"))

    # -- failure -------------------------------------------------------------------------

    def _fail(self, error: LpsyncError) -> None:
        """Break the endpoint with ``error`` (the first one wins) and wake every waiter."""
        with self._lock:
            if self._broken is not None:
                return
            self._broken = error
            waiters = list(self._waiters)
        for event in waiters:
            event.set()
        log.warning("rank %d: %s", self.rank, error)
        if self._loop is not None and self._loop.alive and not self._closing:
            # Aborting cancels in-flight requests and tells the peers at once. Never from
            # inside a UCX callback, hence call_soon.
            self._loop.loop.call_soon_threadsafe(self._abort_all)

    def abort(self, error: LpsyncError) -> None:
        """Break the endpoint from outside (a heartbeat watchdog that declared a peer
        gone): every wait raises ``error``, unless something broke it first."""
        self._fail(error)

    @property
    def error(self) -> LpsyncError | None:
        """What broke this endpoint (a lost peer, a timeout), or None while it is healthy;
        set as soon as UCX reports a peer gone, even when nothing was waiting on it."""
        return self._broken

    def _abort_all(self) -> None:
        for peer in self._peers.values():
            if peer.endpoint is not None and not peer.departed:
                peer.endpoint.abort(period=10**9)

    def _check(self) -> None:
        broken = self._broken
        if broken is not None:
            # A fresh instance per raise: one shared exception would pile up tracebacks.
            raise type(broken)(*broken.args)
        if self._closed:
            raise UnavailableError(f"rank {self.rank}'s UCX endpoint is closed")

    def _peer(self, peer: int) -> Any:
        self._check()
        try:
            return self._peers[peer].endpoint
        except KeyError:
            raise InvalidArgumentError(f"rank {self.rank} has no peer rank {peer} "
                                       f"({self.size} participants)") from None

    def _wait(self, future: Future[Any], deadline: float, what: str) -> None:
        """Wait for ``future`` until ``deadline``; waking early when the endpoint breaks."""
        if not future.done():
            event = threading.Event()
            future.add_done_callback(lambda _f: event.set())
            with self._lock:
                self._waiters.add(event)
            try:
                while not future.done():
                    self._check()
                    remaining = deadline - time.monotonic()
                    if (remaining <= 0 or not event.wait(remaining)) and not future.done():
                        self._fail(CollectiveTimeoutError(
                            f"rank {self.rank} timed out waiting for {what}"))
                        self._check()
            finally:
                with self._lock:
                    self._waiters.discard(event)
        # Errors are raised outside the except block and without tracebacks of ucxx's:
        # a ucxx frame kept alive by a traceback keeps its endpoint alive, and an accepted
        # endpoint keeps the listener's port bound (a rebuilt mesh could not listen again).
        failure = ""
        try:
            future.result()
        except LpsyncError:
            raise
        except (Exception, CancelledError) as error:
            _release_frames(error)
            if type(error).__name__ in ("UCXMessageTruncatedError", "UCXMsgTruncated"):
                failure = "truncated"
            else:
                failure = f"{what} failed: {type(error).__name__}: {error}"
        if failure == "truncated":
            raise InvalidArgumentError(f"{what}: the message is larger than the receive "
                                       "buffer (mismatched counts across participants?)")
        if failure:
            self._fail(UnavailableError(failure))
            self._check()

    # -- the Endpoint interface ----------------------------------------------------------

    def send(self, peer: int, tag: int, data: np.ndarray) -> _Send:
        ep = self._peer(peer)
        assert self._loop is not None
        future = self._loop.submit(_guarded(ep.send(_bytes_view(data), tag=tag)))
        return _Send(self, future, f"send of message {tag} to rank {peer}")

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        ep = self._peer(peer)
        assert self._loop is not None
        future = self._loop.submit(_guarded(ep.recv(_bytes_view(out), tag=tag)))
        self._wait(future, deadline, f"message {tag} from rank {peer}")

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

    # -- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye, wait (bounded) for the others' goodbyes, close everything, stop
        the loop thread. Idempotent; never raises for a broken endpoint."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is not None and loop.alive:
            try:
                loop.call(self._a_close(), self.options.close_timeout + 5.0)
            except LpsyncError as error:
                log.warning("rank %d: unclean UCX close: %s", self.rank, error)
            ctx = self._ctx
            if ctx is not None:
                # Join ucxx's threads ourselves: the notifier thread is only stopped on
                # request, and the progress thread only by a finalizer.
                ctx.stop_notifier_thread()
                ctx.worker.stop_progress_thread()
            loop.stop()
        self._ctx = self._progress = self._listener = None
        self._peers.clear()

    async def _a_close(self) -> None:
        peers = list(self._peers.values())
        if self._broken is None and peers:
            await asyncio.gather(*(_say_goodbye(p) for p in peers), return_exceptions=True)
            pending = [p.goodbye for p in peers if p.goodbye is not None]
            _, late = await asyncio.wait(pending, timeout=self.options.close_timeout)
            if late:
                log.warning("rank %d: no goodbye from %d peer(s) within %.0f s; closing anyway",
                            self.rank, len(late), self.options.close_timeout)
        self._closing = True
        for peer in peers:
            if peer.goodbye is not None:
                peer.goodbye.cancel()
            try:
                await asyncio.wait_for(peer.endpoint.close(period=10**9), 2.0)
            except Exception:
                peer.endpoint.abort(period=10**9)
        # The goodbye receives must finish before the loop stops: a receive left suspended
        # keeps its ucxx endpoint alive, and an accepted endpoint keeps the listener's port
        # bound, so this process could not listen on it again (a rebuilt mesh).
        # (ucxx's recv may catch the first cancellation and post a second receive, so
        # cancel again until the tasks are done.)
        goodbyes = {p.goodbye for p in peers if p.goodbye is not None}
        for _ in range(3):
            goodbyes = {g for g in goodbyes if not g.done()}
            if not goodbyes:
                break
            for goodbye in goodbyes:
                goodbye.cancel()
            await asyncio.wait(goodbyes, timeout=0.5)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> UcxEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_frames(error: BaseException) -> None:
    """Drop the locals of the finished frames in ``error``'s traceback. ucxx keeps a failed
    request's exception alive (its C++ side holds the future), and through the traceback
    the ucxx endpoint of the frame, which keeps an accepted connection's listener bound:
    without this, a process cannot listen on its port again after a peer is lost."""
    tb = error.__traceback__
    while tb is not None:
        # A frame still executing (our own) refuses: its locals are ours anyway.
        with contextlib.suppress(RuntimeError):
            tb.tb_frame.clear()
        tb = tb.tb_next


async def _guarded(coro: Any) -> Any:
    """Await a ucxx request; a failure leaves no ucxx frame alive (see _release_frames)."""
    try:
        return await coro
    except BaseException as error:
        _release_frames(error)
        raise


async def _say_goodbye(peer: _Peer) -> None:
    await asyncio.wait_for(peer.endpoint.send(np.frombuffer(_GOODBYE, np.uint8)), 2.0)


def _sender(ep: Any) -> Any:
    async def send(data: bytes) -> None:
        await ep.send(np.frombuffer(data, np.uint8))
    return send


def _receiver(ep: Any) -> Any:
    async def recv(size: int) -> bytes:
        buf = bytearray(size)
        await ep.recv(buf)
        return bytes(buf)
    return recv


def _bytes_view(data: np.ndarray) -> np.ndarray:
    if not data.flags.c_contiguous:
        raise InvalidArgumentError("UCX sends and receives contiguous spans only")
    return data.reshape(-1).view(np.uint8)


async def _port_open(host: str, port: int, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def _resolve(host: str) -> str:
    """UCX wants a numeric address; resolve names (IPv4 first) here."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(f"cannot resolve peer host {host!r}: {error}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])
