"""The Endpoint of lpsync.engine.endpoint over plain TCP sockets, one per participant.

The mesh and its failure model are lpsync.transport.mesh's; each connection is one TCP
socket, authenticated (lpsync.transport.auth) before it carries anything else, with
TCP_NODELAY (a 4-byte collective must not wait for Nagle).

Wire format: every message is a 16-byte header (tag, bytes; little-endian u64) and its
bytes. One connection per peer pair and nothing but authenticated peers on it, so tags
need no mixing (the UCX backend mixes them because its tag matching is per worker).

Why a second backend: the UCX one hands every send and receive to its progress thread
and back (two thread hand-offs per message on each side); here a send is one
``sendmsg`` on the caller's thread when the socket has room (a writer thread per
connection takes over only when it has not), and each connection's reader thread
receives straight into the buffer a receive was posted with (one hand-off, none for the
bytes). Messages that arrive before their receive is posted wait in memory, per tag, in
order, at most MeshOptions.early_bytes per connection: beyond it the reader stops reading
until a receive is posted or a kept message taken (back-pressure through TCP itself).
On the emulated cluster this backend halves the hand-offs of a small collective and takes
the progress thread out of large ones (docs/multinode.md, "Peer transports").

``close`` is collective, as in the UCX backend: a goodbye frame follows everything sent
on each connection, and each side waits (bounded) for the others' before hanging up.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from lpsync.errors import InvalidArgumentError, UnavailableError
from lpsync.transport.addresses import PeerAddress
from lpsync.transport.auth import authenticate_client_socket, authenticate_server_socket
from lpsync.transport.mesh import Channel, InFlight, MeshEndpoint, MeshOptions, Request, bytes_view
from lpsync.transport.tags import GOODBYE
from lpsync.transport.tcp import congestion
from lpsync.transport.tcp.runtime import TcpRuntime

log = logging.getLogger("lpsync.tcp")

_HEADER = struct.Struct("<QQ")  # tag, message bytes
_NO_BYTES = np.zeros(0, np.uint8)
_BYTE = np.dtype(np.uint8)  # the one instance numpy gives every uint8 array
_DRAIN = 1 << 20  # bytes read at a time when discarding a message too large for its receive


class _Conn:
    """One authenticated socket to a peer, its reader and writer threads, and its queues."""

    def __init__(self, rank: int, address: PeerAddress, sock: socket.socket) -> None:
        self.rank, self.address, self.sock = rank, address, sock
        self.departed = False  # said goodbye: its connection closing is no failure
        self.goodbye = threading.Event()
        self.lock = threading.Lock()  # guards posted, unexpected and early
        # Signalled when a receive is posted, a kept message is taken, or the connection stops.
        self.room = threading.Condition(self.lock)
        self.reader_waits = False  # the reader is in room.wait: only then is a notify needed
        self.posted: dict[int, collections.deque[Request]] = {}
        self.unexpected: dict[int, collections.deque[np.ndarray]] = {}
        self.early = 0  # bytes held in unexpected (and being read into it)
        # Liveness as the reader sees it (heard_at): the time the last message ended, and
        # whether one is being read or waits for room (the peer is sending; we are not
        # reading, so a heartbeat behind it cannot arrive).
        self.heard = time.monotonic()
        self.in_message = False
        self.out_lock = threading.Lock()
        self.out_ready = threading.Condition(self.out_lock)
        self.outbox: collections.deque[tuple[list[memoryview], Request]] = collections.deque()
        self.stopped = False
        self.ended = False  # orphans() was called: a receive posted after it never lands
        self.reader: threading.Thread | None = None
        self.writer: threading.Thread | None = None

    def take_posted(self, tag: int) -> Request | None:
        with self.lock:
            return self.take_posted_locked(tag)

    def take_posted_locked(self, tag: int) -> Request | None:
        queue = self.posted.get(tag)
        if not queue:
            return None
        request = queue.popleft()
        if not queue:
            del self.posted[tag]
        return request

    def wait_room(self, tag: int, nbytes: int, limit: int) -> Request | None:
        """Before reading a message nobody has asked for yet: a receive posted for ``tag``
        meanwhile (read into it), or None once ``nbytes`` more fit under ``limit`` (they are
        counted as held). Blocks the reader, and so the sender, while neither holds."""
        with self.lock:
            while True:
                request = self.take_posted_locked(tag)
                if request is not None:
                    return request
                if self.early == 0 or self.early + nbytes <= limit or self.stopped:
                    self.early += nbytes
                    return None
                self.reader_waits = True
                self.room.wait(1.0)
                self.reader_waits = False

    def stop(self) -> None:
        """Wake both threads: the writer's wait, and any blocking socket call."""
        with self.lock:
            self.room.notify_all()
        with self.out_lock:
            self.stopped = True
            self.out_ready.notify_all()
        with contextlib.suppress(OSError):  # already shut down
            self.sock.shutdown(socket.SHUT_RDWR)

    def orphans(self) -> list[Request]:
        """Every request still queued (once both threads are gone)."""
        with self.lock, self.out_lock:
            self.ended = True
            left = [r for queue in self.posted.values() for r in queue]
            left += [r for _, r in self.outbox]
            self.posted.clear()
            self.outbox.clear()
        return left


class TcpEndpoint(MeshEndpoint):
    """One participant's sockets to every other; build with ``TcpEndpoint.connect``."""

    def __init__(self, options: MeshOptions) -> None:
        super().__init__(options)
        self._conns: dict[int, _Conn] = {}
        self._channels: dict[int, Channel] = {}  # made once per peer: a leaf asks per collective
        self._runtime: TcpRuntime | None = None

    # -- setup ---------------------------------------------------------------------------

    def _own_runtime(self) -> TcpRuntime:
        return TcpRuntime(self.options.peers[self.rank].port)

    def _connect(self, peer: int, host: str, port: int, remaining: float, deadline: float) -> None:
        timeout = min(remaining, self.options.handshake_timeout)
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            authenticate_client_socket(sock, self.options.secret, self.rank, timeout, expect_rank=peer)
            self._register(peer, sock)
        except BaseException:
            sock.close()
            raise

    def _accept(self, sock: socket.socket) -> None:
        try:
            result = authenticate_server_socket(
                sock, self.options.secret, self.rank, self.options.handshake_timeout, admit=self._admit
            )
        except Exception as error:
            self._unfinished(error)
            sock.close()
            return
        self._register(result.peer_rank, sock)

    def _register(self, rank: int, sock: socket.socket) -> None:
        sock.settimeout(None)  # blocking from now on: failures come from stop(), not timeouts
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        congestion.apply(sock, self.options.tcp_congestion)  # checked at the daemon's start
        conn = _Conn(rank, self.options.peers[rank], sock)
        with self._formed:
            duplicate = rank in self._conns or self._closed
            if not duplicate:
                self._conns[rank] = conn
                self._formed.notify_all()
        if duplicate:
            sock.close()
            return
        conn.reader = threading.Thread(
            target=self._read, args=(conn,), daemon=True, name=f"lpsync-tcp-r{self.rank}-from-{rank}"
        )
        conn.writer = threading.Thread(
            target=self._write, args=(conn,), daemon=True, name=f"lpsync-tcp-r{self.rank}-to-{rank}"
        )
        conn.reader.start()
        conn.writer.start()
        log.debug("rank %d: connected to rank %d at %s", self.rank, rank, conn.address)

    # -- the connection threads ------------------------------------------------------------

    def _read(self, conn: _Conn) -> None:
        """Receive every message of ``conn`` into its posted receive, or keep it until one
        is posted; on EOF or error, a peer that said no goodbye is gone."""
        header = bytearray(_HEADER.size)
        head = memoryview(header)
        # The common case without a Python call per read: one recv_into that waits for
        # all the bytes (_read_rest only when a read comes back short).
        recv_into, size = conn.sock.recv_into, _HEADER.size
        try:
            while True:
                got = recv_into(head, size, socket.MSG_WAITALL)
                if got != size and not _read_rest(conn.sock, head, got):
                    break
                tag, nbytes = _HEADER.unpack(header)
                conn.in_message = True
                if tag == GOODBYE:
                    conn.departed = True
                    conn.goodbye.set()
                    conn.in_message = False
                    continue
                request = conn.take_posted(tag) or conn.wait_room(tag, nbytes, self.options.early_bytes)
                if request is None:
                    data = np.empty(nbytes, np.uint8)
                    # numpy's stubs give ndarray __buffer__ on Python 3.12+ only.
                    if not _read_exactly(conn.sock, memoryview(data)):  # type: ignore[arg-type]
                        break
                    self._keep(conn, tag, data)
                    del data
                elif nbytes > request.keep.nbytes:
                    if not _discard(conn.sock, nbytes):
                        break
                    request.finish(InvalidArgumentError("message larger than its receive"))
                else:
                    got = recv_into(request.keep, nbytes, socket.MSG_WAITALL) if nbytes else 0
                    if got != nbytes and not _read_rest(conn.sock, memoryview(request.keep)[:nbytes], got):
                        break
                    request.finish(None)
                conn.heard, conn.in_message = time.monotonic(), False
                del request  # not held while waiting for the next message (as in _write)
        except OSError as error:
            log.debug("rank %d: reading from rank %d: %s", self.rank, conn.rank, error)
        except Exception as error:  # e.g. a header announcing more bytes than memory holds
            log.warning(
                "rank %d: unreadable message from rank %d: %s: %s",
                self.rank,
                conn.rank,
                type(error).__name__,
                error,
            )
        if not conn.departed:
            self._peer_gone(conn.rank, conn.address)
        conn.stop()
        if conn.writer is not None:
            conn.writer.join()
        gone = UnavailableError(f"the connection to rank {conn.rank} is closed")
        for request in conn.orphans():
            request.finish(gone)
        conn.sock.close()

    def _keep(self, conn: _Conn, tag: int, data: np.ndarray) -> None:
        """A message that came before its receive: hand it to a receive posted while it
        was being read, else keep it for the next post_recv of its tag."""
        with conn.lock:
            request = conn.take_posted_locked(tag)
            if request is None:
                conn.unexpected.setdefault(tag, collections.deque()).append(data)
                return
            conn.early -= data.nbytes
            conn.room.notify_all()
        _deliver(request, data)

    def _write(self, conn: _Conn) -> None:
        """Send what ``send`` could not put into the socket at once, in order."""
        while True:
            with conn.out_lock:
                while not conn.outbox and not conn.stopped:
                    conn.out_ready.wait()
                if conn.stopped:
                    return
                pieces, request = conn.outbox[0]  # stays queued: later sends go behind it
            sent = self._send_all(conn, pieces)
            # Nothing of the message stays in this frame while it waits for the next one:
            # its pieces are views of a client's buffer, which could not be unmapped.
            del pieces
            if not sent:
                return
            with conn.out_lock:
                conn.outbox.popleft()
            request.finish(None)
            del request

    def _send_all(self, conn: _Conn, pieces: list) -> bool:
        try:
            for piece in pieces:
                conn.sock.sendall(piece)
        except OSError as error:
            log.debug("rank %d: sending to rank %d: %s", self.rank, conn.rank, error)
            conn.stop()  # the reader reports the loss (or the goodbye that preceded it)
            return False
        return True

    # -- the Endpoint interface ----------------------------------------------------------

    def _enqueue(
        self, conn: _Conn, tag: int, buf: np.ndarray, on_done: Callable[[Request], None] | None = None
    ) -> Request:
        request = Request()
        request.on_done = on_done  # before any thread can finish it
        header = _HEADER.pack(tag, buf.nbytes)
        with conn.out_lock:
            if conn.stopped:
                request.finish(UnavailableError(f"the connection to rank {conn.rank} is closed"))
                return request
            sent = 0
            if not conn.outbox:
                try:
                    # numpy's stubs give ndarray __buffer__ on Python 3.12+ only.
                    sent = conn.sock.sendmsg([header, buf], [], socket.MSG_DONTWAIT)  # type: ignore[list-item]
                except BlockingIOError:
                    sent = 0
                except OSError as error:
                    request.finish(UnavailableError(f"sending to rank {conn.rank}: {error}"))
                    return request
                if sent == len(header) + buf.nbytes:
                    request.finish(None)
                    return request
            request.keep = buf
            # numpy's stubs give ndarray __buffer__ on Python 3.12+ only.
            conn.outbox.append((_rest([memoryview(header), memoryview(buf)], sent), request))  # type: ignore[arg-type]
            conn.out_ready.notify()
        return request

    # send and post_recv look up the connection and take a flat byte array as _conn and
    # bytes_view do, written out for the common case: every message costs two calls less.

    def send(self, peer: int, tag: int, data: np.ndarray) -> InFlight:
        conn = self._conns.get(peer) if self._broken is None and not self._closed else None
        if conn is None:
            conn = self._conn(peer)  # raises why: broken, closed, or no such peer
        if data.dtype is not _BYTE or data.ndim != 1 or not data.flags.c_contiguous:
            data = bytes_view(data)
        return InFlight(self, self._enqueue(conn, tag, data), peer, tag, sending=True)

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> InFlight:
        conn = self._conns.get(peer) if self._broken is None and not self._closed else None
        if conn is None:
            conn = self._conn(peer)  # raises why: broken, closed, or no such peer
        if out.dtype is not _BYTE or out.ndim != 1 or not out.flags.c_contiguous:
            out = bytes_view(out)
        return InFlight(self, self._post(conn, tag, out, None), peer, tag, sending=False)

    def channel(self, peer: int) -> Channel:
        """``peer``'s connection as a Channel (lpsync.engine.endpoint): its queues
        without the Endpoint's wrappers, for a program run as data flow."""
        conn = self._conn(peer)  # checks the endpoint first, every time
        channel = self._channels.get(peer)
        if channel is None:
            channel = self._channels[peer] = Channel(
                functools.partial(self._enqueue, conn), functools.partial(self._post, conn), self._wait
            )
        return channel

    def _post(
        self, conn: _Conn, tag: int, view: np.ndarray, on_done: Callable[[Request], None] | None
    ) -> Request:
        request = Request()
        request.keep, request.on_done = view, on_done
        with conn.lock:
            kept = conn.unexpected.get(tag)
            data = kept.popleft() if kept else None
            if kept is not None and not kept:
                del conn.unexpected[tag]
            # Its reader is gone (a channel outlives the endpoint's checks): nothing would
            # finish a receive posted now, unless its message came before.
            ended = data is None and conn.ended
            if data is not None:
                conn.early -= data.nbytes
            elif not ended:
                conn.posted.setdefault(tag, collections.deque()).append(request)
            if conn.reader_waits:  # for room, or for this very receive
                conn.room.notify_all()
        if ended:
            request.finish(UnavailableError(f"the connection to rank {conn.rank} is closed"))
        elif data is not None:
            _deliver(request, data)
        return request

    def heard_at(self, peer: int) -> float:
        """Now while a message of ``peer``'s is being read or waits for room to be read
        (a heartbeat queued behind it cannot arrive, and the peer is plainly sending),
        else when its last message ended."""
        conn = self._conns.get(peer)
        if conn is None:
            return 0.0
        return time.monotonic() if conn.in_message else conn.heard

    def early_bytes(self, peer: int) -> int:
        """Bytes of messages from ``peer`` held before their receive (bounded by
        MeshOptions.early_bytes, or one larger message)."""
        conn = self._conn(peer)
        with conn.lock:
            return conn.early

    # -- failure and teardown ------------------------------------------------------------

    def _close_connections(self) -> None:
        for conn in list(self._conns.values()):
            conn.stop()

    def close(self) -> None:
        """Say goodbye, wait (bounded) for the others' goodbyes, close every connection,
        and the listener if this endpoint made it. Idempotent; never raises for a broken
        endpoint."""
        if self._closed:
            return
        with self._formed:
            self._closed = True
            conns = list(self._conns.values())
        self._join_handshakes(time.monotonic())
        if self._broken is None and conns:
            deadline = time.monotonic() + self.options.close_timeout
            sends = [self._enqueue(conn, GOODBYE, _NO_BYTES) for conn in conns]
            for request in sends:
                request.event().wait(max(0.0, deadline - time.monotonic()))
            self._late_goodbyes([conn.goodbye for conn in conns], deadline)
        self._closing = True
        self._close_connections()
        me = threading.current_thread()
        for conn in conns:
            if conn.reader is not None and conn.reader is not me:
                conn.reader.join(5.0)
        if self._owns_runtime and self._runtime is not None:
            self._runtime.close()
        self._conns.clear()


def _read_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False at end of stream."""
    return _read_rest(sock, view, 0)


def _read_rest(sock: socket.socket, view: memoryview, got: int) -> bool:
    """Fill ``view`` from ``sock``, its first ``got`` bytes already read; False at end
    of stream."""
    need = len(view)
    while got < need:
        n = sock.recv_into(view[got:], need - got, socket.MSG_WAITALL)
        if n == 0:
            return False
        got += n
    return True


def _discard(sock: socket.socket, nbytes: int) -> bool:
    scratch = memoryview(bytearray(min(nbytes, _DRAIN)))
    while nbytes:
        step = min(nbytes, len(scratch))
        if not _read_exactly(sock, scratch[:step]):
            return False
        nbytes -= step
    return True


def _deliver(request: Request, data: np.ndarray) -> None:
    out = request.keep
    if data.nbytes > out.nbytes:
        request.finish(InvalidArgumentError("message larger than its receive"))
        return
    out[: data.nbytes] = data
    request.finish(None)


def _rest(pieces: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``pieces`` once their first ``sent`` bytes went out."""
    rest = []
    for piece in pieces:
        if sent >= len(piece):
            sent -= len(piece)
            continue
        rest.append(piece[sent:])
        sent = 0
    return rest
