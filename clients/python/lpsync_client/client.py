"""The lpsync client: attach to the node's daemon, place buffers in shared memory and run
collectives over them.

    import lpsync_client
    with lpsync_client.connect() as client:          # RANK, WORLD_SIZE, LPSYNC_JOB... from env
        grads = client.zeros(1 << 20, "float32")     # lives in shared memory: zero copy
        grads[:] = 1.0
        client.allreduce(grads)                      # in place, sum over the job's ranks
        t = torch.ones(10)                           # anything else is staged transparently
        client.allreduce(client.register(t), op="avg")

Every collective blocks until it completes; each has an ``*_async`` twin that returns a
concurrent.futures.Future. Collectives must be issued in the same order on every rank
(they are matched by a per-job sequence number). Errors are typed (lpsync_client.errors).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import grpc
import numpy as np

from lpsync_client import _ops, doorbell, layout
from lpsync_client._operands import (
    Buffers,
    DeviceRegistered,
    Operand,
    Registered,
    after_answer,
    order_streams,
)
from lpsync_client._order import InFlight, array_spans
from lpsync_client._p2p import PairJobs
from lpsync_client._pending import Call, Latch
from lpsync_client._rings import Ring, Rings
from lpsync_client._stream import SessionStream
from lpsync_client._trigger import TriggerStream
from lpsync_client.errors import (
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    UnavailableError,
    from_status,
)
from lpsync_client.wire import DEFAULT_SOCKET
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT = 300.0
_STATES = {pb.INTACT: "INTACT", pb.PARTIAL: "PARTIAL"}
# What _submit gives a blocking call (Client._blocking) answered on its own thread: a done
# Future standing for "the result is in Client._here.answered". A Future per call, with
# its Condition, locks and completion, was most of such a call's client CPU
# (docs/benchmarks.md at 623decd, 2026-12-06). Never leaves the client.
_ANSWERED: Future = Future()
_ANSWERED.set_result(None)


@dataclass(frozen=True)
class _Armed:
    """A prepared request whose plan the daemon armed (doorbell.py)."""

    page: str
    plan: int
    generation: int


def _copy(message: pb.SessionRequest) -> pb.SessionRequest:
    fresh = pb.SessionRequest()
    fresh.CopyFrom(message)
    return fresh


def _ready(channel: grpc.Channel, where: str, tcp: bool, timeout: float) -> None:
    """Wait until the daemon answers; UnavailableError saying why not."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        reason = None if tcp else _refusal(where)
        raise from_status(
            "UNAVAILABLE", f"no lpsync daemon answers at {where} ({reason or 'is it running?'})"
        ) from None


def _node(info: pb.NodeInfo) -> layout.Node:
    return layout.Node(info.node_rank, info.nodes or 1, info.cluster)


def _read_already(call: Call, timeout: float) -> bool:
    """How a blocking call answered on its own thread (Client._answer_now) settles: done."""
    return True


def _plain(result: object, response: pb.SessionResponse) -> object:
    """Completion of a collective over shared-memory arrays: nothing to copy back."""
    r = response.result
    if r.code != "OK":
        raise from_status(r.code, r.message, r.error, _STATES.get(r.buffer_state, ""))
    return result


class Client(Buffers):
    """One attached rank. Prefer :func:`connect`, which reads torchrun's environment.
    ``node`` is the daemon it attached to (node rank, node count, cluster); ``rank_nodes``
    the node of every rank when they were discovered through a store (else None)."""

    def __init__(
        self,
        *,
        socket: str | None = None,
        target: str | None = None,
        job: str,
        rank: int,
        world_size: int,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = 10.0,
        trigger: str = "auto",
        store: layout.Store | None = None,
        rank_nodes: Sequence[int] | None = None,
    ) -> None:
        """``rank_nodes``: the node of every rank, known already (a pair job of send/recv
        takes its ranks' nodes from its main job); ``store``: discover them."""
        if trigger not in ("auto", "grpc", "socket"):
            raise InvalidArgumentError(f"trigger must be 'auto', 'grpc' or 'socket', got {trigger!r}")
        self.job, self.rank, self.world_size = job, rank, world_size
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if target:  # TCP: the daemon only listens there with TLS
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(target, credentials)
        else:
            self._channel = grpc.insecure_channel(f"unix:{socket or DEFAULT_SOCKET}")
        self._stub = pb_grpc.LpSyncStub(self._channel)
        # Buffers and registrations (_operands.py, which documents each).
        self._segments, self._device, self._scratch = {}, {}, {}
        self._dead = queue.SimpleQueue()
        self._reaper = None
        self._lock = threading.Lock()
        # .foreground: this thread's next request is waited at once (a blocking call);
        # .answer_here: its next request is answered on it if it can be (answer_next_here).
        self._here = threading.local()
        self._sequence = 0
        self._closed = False
        self._store: layout.Store | None = None  # the layout's store, once discovered
        # Prepared requests by (op, spans, parameters) for arrays in shared memory.
        self._prepared: dict[tuple, pb.SessionRequest] = {}
        # Prepared requests whose plans the daemon armed, and the doorbell pages mapped.
        self._armed: dict[tuple, _Armed] = {}
        self._bells: dict[str, doorbell.Page] = {}
        self._rings: Rings | None = None  # asynchronous calls of armed plans (_rings.py)
        # Set once the last request sent the general way (_send) is answered; its Future
        # is not kept: it holds the written array, whose registration goes with it.
        self._last_sent: Latch | None = None
        # Each live view's data address by id(): __array_interface__ makes a dict per call.
        self._addresses: dict[int, tuple[weakref.ref, int]] = {}
        self._in_flight = InFlight()  # staged collectives not finished yet (_order.py)
        where = target or socket or DEFAULT_SOCKET
        # What a pair job of send/recv attaches with (_p2p.py): this client's daemon.
        self._settings: dict[str, Any] = {
            "socket": socket,
            "target": target,
            "token": token,
            "root_certificates": root_certificates,
            "timeout": timeout,
            "connect_timeout": connect_timeout,
            "trigger": trigger,
        }

        def ask() -> layout.Node:
            _ready(self._channel, where, bool(target), connect_timeout)
            return _node(self._call(self._stub.Node, pb.NodeRequest(), connect_timeout))

        try:
            if rank_nodes is not None:  # known (a pair job): nothing to discover
                _ready(self._channel, where, bool(target), connect_timeout)
                hints = layout.Hints(local_rank or 0, local_world_size or 0)
                rank_nodes = list(rank_nodes)
            elif store is not None:  # discovered: local_rank/local_world_size are hints
                hints = layout.Hints(local_rank or 0, local_world_size or 0)
                # A daemon that does not answer is published too: the other ranks fail at once.
                rank_nodes = layout.discover(store, f"lpsync/layout/{job}", job, rank, world_size, ask, hints)
                # Held while the client lives: rank 0's may host the store (a TCPStore made
                # for connect() alone), and the other ranks may still be reading the table.
                self._store = store
            else:  # claimed: node-major from local_world_size; without it, the daemons find it
                _ready(self._channel, where, bool(target), connect_timeout)
                hints = layout.Hints(
                    0 if local_world_size is None else local_rank or 0,
                    local_world_size or 0,
                )
                rank_nodes = []
            attached = self._call(
                self._stub.Attach,
                pb.AttachRequest(
                    job=job,
                    rank=rank,
                    world_size=world_size,
                    local_rank=hints.local_rank,
                    local_world_size=hints.local_world_size,
                    pid=os.getpid(),
                    rank_nodes=rank_nodes,
                ),
                connect_timeout,
            )
            self.session_id = attached.session_id
            # The daemon this rank attached to, and the node of every rank when discovered.
            self.node = _node(attached.node)
            self.rank_nodes: list[int] | None = list(rank_nodes) or None
            per_node = hints.local_world_size
            self._p2p = PairJobs(
                job,
                rank,
                world_size,
                # The node of a rank: discovered, node-major by LOCAL_WORLD_SIZE, or unknown
                # here (-1: the daemons find it, as for this job).
                lambda r: self.rank_nodes[r] if self.rank_nodes else r // per_node if per_node else -1,
                self._open_pair,
            )
            self._stream = SessionStream(self._stub, self.session_id, self._metadata, connect_timeout)
            # Collectives and pings go through the trigger socket when asked for (and
            # offered); the gRPC stream above stays open either way: it is the lifeline.
            self._trigger: TriggerStream | None = None
            if trigger == "socket" and not attached.trigger_socket:
                raise from_status(
                    "UNAVAILABLE", "the daemon offers no trigger socket (TCP, or started with --no-trigger)"
                )
            # auto never leaves a TCP connection for a local socket: the daemon may be remote.
            if attached.trigger_socket and (trigger == "socket" or (trigger == "auto" and not target)):
                try:
                    self._trigger = TriggerStream(attached.trigger_socket, self.session_id, connect_timeout)
                except LpsyncError:
                    if trigger == "socket":
                        raise
                    # auto: e.g. the socket is not reachable from this container; gRPC works
            self._path = self._trigger or self._stream
            self.trigger = "socket" if self._trigger is not None else "grpc"
        except BaseException:
            self._channel.close()
            raise

    # -- plumbing --------------------------------------------------------------------------
    # -- collectives -----------------------------------------------------------------------
    def _submit(
        self,
        op: str,
        x: object | None,
        out: object | None,
        *,
        count_of,
        root: int = 0,
        reduce_op: str = "",
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        timeout = self.timeout if timeout is None else timeout
        # Hot path: arrays already in shared memory, a call seen before -> copy a prepared
        # request, number it, send. No lookups, no staging.
        key: tuple | None = None
        if x is None and out is None:  # no operand (a barrier): its request repeats as is
            key = (op, None, None, root, reduce_op, algorithm, timeout, name)
        elif type(x) is np.ndarray and (out is None or type(out) is np.ndarray):
            key = (
                op,
                self._span(x),
                None if out is None else self._span(out),
                root,
                reduce_op,
                algorithm,
                timeout,
                name,
            )
        if key is not None:
            template = self._prepared.get(key)
            if template is not None:
                written = x if out is None else out
                here = self._here
                foreground = getattr(here, "foreground", False)
                if (foreground or getattr(here, "answer_here", False)) and self._answer_now(
                    template, timeout, key
                ):
                    if foreground:  # Client._blocking takes the result: no Future is made
                        here.answered = written
                        return _ANSWERED
                    call = Call()  # the caller (torch's work) tracks a Future
                    call.settle_with = _read_already
                    call.set_result(written)
                    return call
                armed = self._armed.get(key)
                if armed is not None and not foreground:  # an async call of an armed plan
                    rung = self._ring_later(armed, template, written, timeout, key)
                    if rung is not None:
                        return rung
                return self._send(_copy(template), self._learning(written, key))
        operands: list[Operand] = []
        message = pb.SessionRequest()
        request = message.collective
        request.session_id, request.op, request.root = self.session_id, op, root
        request.reduce_op, request.algorithm = reduce_op, algorithm or ""
        request.timeout, request.name = timeout, name
        try:
            if x is not None:
                a = self._operand(x, writes=out is None)
                operands.append(a)
                request.input.CopyFrom(a.ref)
                request.dtype = a.dtype
                if out is not None:
                    b = self._operand(out, writes=True)
                    operands.append(b)
                    request.output.CopyFrom(b.ref)
                    if b.dtype != a.dtype:
                        raise InvalidArgumentError(f"input is {a.dtype} but out is {b.dtype}")
                    request.count = count_of(a.array.size, b.array.size)
                else:
                    request.count = count_of(a.array.size, None)
            # Staged buffers wait for earlier staged collectives on the same memory (_order.py).
            staged = array_spans(
                pair[1] for o in operands for pair in (o.copy_in, o.copy_out) if pair is not None
            )
            self._in_flight.wait_before(staged, 2 * timeout + 10)
            for operand in operands:
                if operand.copy_in is not None:
                    staging, source = operand.copy_in
                    np.copyto(staging, source)
            if operands and operands[0].device is not None:
                order_streams(request, operands)
                request.stream_ordered &= not self.device_host_wait
        except BaseException:
            self._recycle(operands)
            raise
        result = out if out is not None else x
        if isinstance(result, Registered | DeviceRegistered):
            result = result.original
        finished = Latch()  # the staged buffers are final (before the Future is)

        def complete(response: pb.SessionResponse) -> object:
            try:
                r = response.result
                if r.code != "OK":
                    raise from_status(r.code, r.message, r.error, _STATES.get(r.buffer_state, ""))
                for operand in operands:
                    if operand.copy_out is not None:
                        staging, source = operand.copy_out
                        np.copyto(source, staging)
                after_answer(operands, r.response)
                return result
            finally:
                finished.set()
                self._recycle(operands)

        if key is not None and all(o.copy_in is None and o.scratch is None for o in operands):
            with self._lock:
                if len(self._prepared) > 1024:
                    self._prepared.clear()
                    self._armed.clear()
                # Copied for each call by _send; _answer_now numbers and sends it as it is.
                self._prepared[key] = _copy(message)
        try:
            future = self._send(message, complete)
        except BaseException:
            finished.set()
            raise
        self._in_flight.add(finished, staged)
        return future

    def _learning(self, written: object, key: tuple) -> Callable[[pb.SessionResponse], object]:
        """The completion of a prepared request sent the general way: its result, and
        the plan the daemon armed for it (its next asynchronous call rings)."""

        def complete(response: pb.SessionResponse) -> object:
            result = _plain(written, response)
            plan = response.result.response.armed
            if plan.page and self.world_size <= 256:
                self._armed[key] = _Armed(plan.page, plan.plan, plan.generation)
            return result

        return complete

    def _ring_later(
        self, armed: _Armed, template: pb.SessionRequest, written: object, timeout: float, key: tuple
    ) -> Call | None:
        """An asynchronous call of an armed plan, queued to ring (_rings.py); None where it
        cannot ring (the page gone): it goes the general way. Behind a general request
        still in flight it rings once that one is answered: one call of a step that went
        the general way does not send the rest of the step there too."""
        trigger = self._trigger
        if trigger is None:
            return None
        after = self._last_sent if trigger.pending() else None
        page = self._bell(armed)
        if page is None:
            return None
        if self._rings is None:
            self._rings = Rings(trigger.peer_closed)
        message = _copy(template)

        def general() -> Call:  # the engine did not run it: the request, same number
            self._armed.pop(key, None)
            return self._path.submit(message, self._learning(written, key))

        call = Call()
        with self._lock:  # sequence numbers leave in submission order
            self._sequence += 1
            sequence = self._sequence
            if not sequence & 0xFFFFFFFF:  # would look unrung as 32 bits
                self._sequence -= 1
                return None
            message.collective.sequence = sequence
            call.on_cancel = functools.partial(self._cancelled, sequence)
            ring = Ring(
                page, armed.plan, armed.generation, sequence, written, general, 2 * timeout + 10, call, after
            )
            return self._rings.submit(ring)

    def _send(self, message: pb.SessionRequest, hook) -> Call:
        if self._rings is not None and self._rings.busy():  # after the queued rings, in order
            self._rings.drain(2 * self.timeout + 10)
        here = self._here
        foreground = getattr(here, "foreground", False)
        if foreground:
            here.foreground = False  # only the first request of a blocking call
        with self._lock:  # sequence numbers leave in submission order
            self._sequence += 1
            message.collective.sequence = sequence = self._sequence
            future = self._path.submit(message, hook, foreground)
            self._last_sent = future.latch
        future.on_cancel = functools.partial(self._cancelled, sequence)
        return future

    def _span(self, a: np.ndarray) -> tuple:
        """Where ``a``'s bytes are, as the prepared requests' keys name them: its data
        address, size, element type and layout. The address is remembered for a view (an
        array over memory it does not own, as every array in a segment is): it never
        changes while the view lives. The rest is read each time (a view's dtype and
        strides may be reassigned in place)."""
        known = self._addresses.get(id(a))
        if known is not None and known[0]() is a:
            address = known[1]
        else:
            address = a.__array_interface__["data"][0]
            if a.base is not None:
                if len(self._addresses) > 1024:
                    self._addresses.clear()
                self._addresses[id(a)] = (weakref.ref(a), address)
        return (address, a.nbytes, a.dtype, a.flags.c_contiguous)

    def _answer_now(self, template: pb.SessionRequest, timeout: float, key: tuple) -> bool:
        """A blocking call of a prepared request over the trigger socket, sent and its reply
        read on this thread with no Future in the table of requests in flight (TriggerStream
        .reply_to). True once it succeeded (raises the collective's error); False where
        another thread reads the replies now (``_send`` then).

        Where the daemon armed the request's plan (``_armed``) and nothing else of this
        client is in flight, it rings the job's doorbell instead (doorbell.py): no request,
        no reply to parse; a FALLBACK sends the request after all, same sequence number.

        ``template`` is sent as it is, numbered in place: one thread at a time gets here
        (the reading lock), and every other sender numbers its own copy (``_send``)."""
        trigger = self._trigger
        if self._rings is not None and self._rings.busy():  # one ring at a time per slot
            self._rings.drain(2 * timeout + 10)
        if trigger is None or not trigger.read_alone():
            return False
        here = self._here
        here.foreground = here.answer_here = False
        bound = 2 * timeout + 10
        try:
            with self._lock:  # sequence numbers leave in submission order
                self._sequence += 1
                sequence = self._sequence
            armed = self._armed.get(key)
            # Sequence numbers ring as 32 bits; one that is 0 there would look unrung.
            if armed is not None and sequence & 0xFFFFFFFF and not trigger.pending():
                if self._ring(armed, sequence, bound, trigger) == doorbell.OK:
                    return True
                self._armed.pop(key, None)  # ask again: the reply says whether it is armed
            template.collective.sequence = sequence
            request_id = trigger.send_unlisted(template)
            response = trigger.reply_to(request_id, bound)
        finally:
            trigger.stop_reading()
        if response is None:
            raise CollectiveTimeoutError(f"the daemon did not answer within {bound:g} s")
        _plain(None, response)  # raises the collective's error
        plan = response.result.response.armed
        if plan.page and self.world_size <= 256:
            self._armed[key] = _Armed(plan.page, plan.plan, plan.generation)
        return True

    def _bell(self, armed: _Armed) -> doorbell.Page | None:
        """The doorbell page ``armed`` rings, mapped once (None: gone meanwhile)."""
        page = self._bells.get(armed.page)
        if page is None:
            try:
                page = doorbell.Page(armed.page, self.rank)
            except (OSError, ValueError):  # gone meanwhile: the request says why
                return None
            if len(self._bells) > 16 and not (self._rings is not None and self._rings.busy()):
                for old in self._bells.values():
                    old.close()
                self._bells.clear()
            self._bells[armed.page] = page
        return page

    def _ring(self, armed: _Armed, sequence: int, bound: float, trigger: TriggerStream) -> int:
        """Ring the doorbell for ``sequence`` (the reading lock held); OK or FALLBACK."""
        page = self._bell(armed)
        if page is None:
            return doorbell.FALLBACK
        try:
            return page.ring(sequence, armed.plan, armed.generation, bound, trigger.peer_closed)
        except TimeoutError:
            if trigger.peer_closed():
                raise UnavailableError("the daemon closed the session during a collective") from None
            raise CollectiveTimeoutError(f"the daemon did not answer within {bound:g} s") from None

    def answer_next_here(self, on: bool = True) -> None:
        """For a caller that waits for its next collective at once anyway (a framework's
        synchronous op): this thread's next request, where it repeats an earlier one on
        shared-memory arrays, is sent and answered on this thread before its Future is
        returned, done (no hand-off to the background reader and back). Any other request
        takes the usual way. ``on=False`` withdraws it when no request followed."""
        self._here.answer_here = on

    def _cancelled(self, sequence: int) -> None:
        """A collective's Future was cancelled: tell the daemon, which fails it for every
        participant if it still waits for some (a queued or running one completes)."""
        with contextlib.suppress(LpsyncError):  # the session is gone: nothing waits on it
            self._path.submit(pb.SessionRequest(cancel=pb.Cancel(sequence=sequence)), lambda r: None)

    def _blocking(self, start: Callable[[], Future], timeout: float | None) -> object:
        """``start()`` a collective and wait for it, its reply read on this thread where
        it can be (TriggerStream.settle)."""
        here = self._here
        here.foreground = True
        future = None
        try:
            future = start()
        finally:
            here.foreground = False
            if future is not _ANSWERED and not (type(future) is Call and future.settle_with is not None):
                # Whatever start() sent was not that one Call: the background reader reads it.
                self._path.wake()
        if future is _ANSWERED:  # answered on this thread (_answer_now): its result is here
            answered, here.answered = here.answered, None
            return answered
        return self._wait(future, timeout)

    def _wait(self, future: Future, timeout: float | None) -> object:
        bound = 2 * (self.timeout if timeout is None else timeout) + 10
        try:
            if type(future) is Call and not future.wait(bound):  # the light wait
                raise TimeoutError
            return future.result(timeout=bound)
        except TimeoutError:
            if future.done():
                raise  # the daemon's own timeout error, delivered through the future
            raise CollectiveTimeoutError(f"the daemon did not answer within {bound:g} s") from None

    def _start(
        self,
        op: str,
        x: object | None,
        out: object | None,
        root: int = 0,
        reduce_op: str = "",
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        """Submit collective ``op`` with its element-count rule from the table (_ops.OPS)."""
        if op == "gather" and self.rank != root:
            out = None  # only the root receives: another rank's out is ignored, as in MPI
        elif op == "scatter" and self.rank != root and out is not None:
            x, out = out, None  # another rank only receives: into out
        elif op == "alltoall" and out is None:
            raise InvalidArgumentError("alltoall runs out of place: pass out (as large as x)")
        rule = _ops.OPS[op].count
        return self._submit(
            op,
            x,
            out,
            count_of=None if rule is None else rule(self.world_size, self.rank, root),
            root=root,
            reduce_op=reduce_op,
            algorithm=algorithm,
            timeout=timeout,
            name=name,
        )

    # Each call: its *_async method here, its blocking twin made from the table (_ops.py).
    def allreduce_async(
        self,
        x,
        op: str = "sum",
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        """Start an allreduce; the Future's result is the output (``out`` or ``x``)."""
        return self._start("allreduce", x, out, 0, op, algorithm, timeout, name)

    def broadcast_async(
        self,
        x,
        root: int = 0,
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("broadcast", x, out, root, "", algorithm, timeout, name)

    def reduce_async(
        self,
        x,
        root: int = 0,
        op: str = "sum",
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("reduce", x, out, root, op, algorithm, timeout, name)

    def allgather_async(
        self, x, out=None, algorithm: str | None = None, timeout: float | None = None, name: str = ""
    ) -> Future:
        return self._start("allgather", x, out, 0, "", algorithm, timeout, name)

    def reduce_scatter_async(
        self,
        x,
        op: str = "sum",
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("reduce_scatter", x, out, 0, op, algorithm, timeout, name)

    def gather_async(
        self,
        x,
        root: int = 0,
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("gather", x, out, root, "", algorithm, timeout, name)

    def scatter_async(
        self,
        x,
        root: int = 0,
        out=None,
        algorithm: str | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> Future:
        return self._start("scatter", x, out, root, "", algorithm, timeout, name)

    def alltoall_async(
        self, x, out, algorithm: str | None = None, timeout: float | None = None, name: str = ""
    ) -> Future:
        return self._start("alltoall", x, out, 0, "", algorithm, timeout, name)

    def barrier_async(self, timeout: float | None = None, name: str = "") -> Future:
        return self._start("barrier", None, None, timeout=timeout, name=name)

    def send_async(self, x, dst: int, tag: int = 0, timeout: float | None = None) -> Future:
        return self._p2p.send(x, dst, tag, timeout)

    def recv_async(self, x, src: int, tag: int = 0, timeout: float | None = None) -> Future:
        return self._p2p.recv(x, src, tag, timeout)

    def recv_any_async(self, x, tag: int = 0, timeout: float | None = None) -> Future:
        """A Future of the sending rank; ``x`` holds its message once it completes."""
        return self.any_source_async(tag, lambda source: self._p2p.recv(x, source, tag, timeout), timeout)

    allreduce = _ops.blocking(allreduce_async)
    broadcast = _ops.blocking(broadcast_async)
    reduce = _ops.blocking(reduce_async)
    allgather = _ops.blocking(allgather_async)
    reduce_scatter = _ops.blocking(reduce_scatter_async)
    gather = _ops.blocking(gather_async)
    scatter = _ops.blocking(scatter_async)
    alltoall = _ops.blocking(alltoall_async)
    barrier = _ops.blocking(barrier_async)
    send = _ops.blocking(send_async)
    recv = _ops.blocking(recv_async)
    recv_any = _ops.blocking(recv_any_async)

    def any_source_async(
        self, tag: int, issue: Callable[[int], Future | None], timeout: float | None = None
    ) -> Future:
        """For adapters that receive a message in pieces: find the rank whose message with
        ``tag`` comes next, then call ``issue(rank)``, which issues the receives from it
        (``recv_async``) and returns a Future done when they are (or None); in order with
        this tag's other receives from any source. A Future of the rank."""
        timeout = self.timeout if timeout is None else timeout

        def receive() -> tuple[int, Future | None]:
            source = cast(int, self._wait(self._probe(tag, timeout), timeout))
            return source, issue(source)

        return self._p2p.any_source(tag, receive)

    def _probe(self, tag: int, timeout: float) -> Future:
        """Ask the daemon which rank's message with ``tag`` comes next (pb.Probe)."""
        issued = self._p2p.issued(tag)
        message = pb.SessionRequest(
            probe=pb.Probe(tag=tag, sources=list(issued), issued=list(issued.values()), timeout=timeout)
        )

        def complete(response: pb.SessionResponse) -> int:
            if response.WhichOneof("body") == "probed":
                return response.probed.source
            r = response.result
            raise from_status(r.code, r.message, r.error, "")

        return self._path.submit(message, complete)

    def _open_pair(self, job: str, rank: int, rank_nodes: list[int]) -> Client:
        """Attach a pair job of send/recv (_p2p.py) to this client's daemon."""
        if -1 in rank_nodes:  # unknown here: the daemons find the pair's layout
            return Client(**self._settings, job=job, rank=rank, world_size=2)
        local = sum(1 for n in rank_nodes if n == rank_nodes[rank])
        return Client(
            **self._settings,
            job=job,
            rank=rank,
            world_size=2,
            local_rank=rank if local == 2 else 0,
            local_world_size=local,
            rank_nodes=rank_nodes if rank_nodes[0] != rank_nodes[1] else None,
        )

    def ping(self, timeout: float = 10.0, via: str | None = None) -> None:
        """One empty round trip: on the path collectives take (default), or ``via="grpc"``
        (the gRPC Session stream) or ``via="socket"`` (the trigger socket)."""
        path = {None: self._path, "grpc": self._stream, "socket": self._trigger}[via]
        if path is None:
            raise InvalidArgumentError("this client has no trigger socket")
        path.submit(pb.SessionRequest(ping=pb.Ping()), lambda r: None).result(timeout)

    def status(self, recent: int = 0) -> pb.StatusResponse:
        """The daemon's status; ``recent``: also its last collectives (up to that many)."""
        return self._call(self._stub.Status, pb.StatusRequest(recent=recent))

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Detach: the daemon frees this client's buffers; arrays from empty() stay
        readable in this process until dropped (their memory is no longer shared)."""
        if self._closed:
            return
        self._closed = True
        reaper = self._reaper
        if reaper is not None:  # (its pending releases: the Detach below frees them all)
            self._dead.put(None)
            if reaper is not threading.current_thread():
                reaper.join(5.0)
        self._p2p.close()
        if self._rings is not None:  # what is queued is answered first (or times out)
            self._rings.drain(2 * self.timeout + 10)
            self._rings.close()
        # The daemon may be gone or have ended the session already: nothing to free then.
        with contextlib.suppress(Exception):
            self._call(self._stub.Detach, pb.DetachRequest(session_id=self.session_id), 10.0)
        if self._trigger is not None:
            self._trigger.close()
        self._stream.close()
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            self._scratch.clear()
            self._device.clear()  # the daemon closed its mappings; the arrays are ours
            bells = list(self._bells.values())
            self._bells.clear()
            self._armed.clear()
        for segment in segments:
            segment.mapping.close()
        for page in bells:
            page.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refusal(path: str) -> str | None:
    """Why this process may not connect to the daemon's Unix socket, if the kernel says
    so (the socket's mode 0660 admits its owner and group only)."""
    import socket as sk

    with sk.socket(sk.AF_UNIX, sk.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except PermissionError:
            try:
                st = os.stat(path)
                owner = f"mode {st.st_mode & 0o777:o}, uid {st.st_uid}, gid {st.st_gid}"
            except OSError:
                owner = "its directory is not searchable"
            return (
                f"permission denied for uid {os.getuid()} ({owner}): the daemon admits "
                "its own user and the socket's group"
            )
        except OSError:
            return None
    return None


def _connect_timeout(given: float | None, raw: str | None) -> float:
    """``given``, else LPSYNC_CONNECT_TIMEOUT's seconds, else 10; finite and positive."""
    where = "connect_timeout"
    value: float = 10.0
    if given is not None:
        value = given
    elif raw:
        where = f"LPSYNC_CONNECT_TIMEOUT={raw!r}"
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"{where}: the seconds to wait for the daemon must be a number above 0")
    return value


def connect(
    socket: str | None = None,
    *,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    target: str | None = None,
    token: str | None = None,
    root_certificates: bytes | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    trigger: str | None = None,
    store: layout.Store | None = None,
    connect_timeout: float | None = None,
) -> Client:
    """Attach to the node's daemon. Unset arguments come from the environment as torchrun
    sets it: LPSYNC_SOCKET, LPSYNC_JOB, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
    (and LPSYNC_TARGET / LPSYNC_TOKEN for TCP). ``timeout`` is the default collective
    timeout in seconds. ``connect_timeout`` (or LPSYNC_CONNECT_TIMEOUT; default 10) is how
    many seconds to wait for the daemon to answer: longer where training may start before
    its daemon does, shorter to fail fast. ``trigger`` (or LPSYNC_TRIGGER) picks the path of collectives:
    "socket" the daemon's trigger socket (the Session messages without gRPC: several
    times lower latency for small collectives), "grpc" the gRPC Session stream, "auto"
    (default) the socket when the daemon offers one (Unix socket), else gRPC.

    Which node serves each rank needs no saying: daemons that are peers tell each other
    which ranks attached to them and settle the job's layout before its first collective
    (any launcher, any numbering of ranks, any number of ranks per node).
    LOCAL_RANK / LOCAL_WORLD_SIZE, where set, are hints the daemons check (node-major:
    RANK = node * LOCAL_WORLD_SIZE + LOCAL_RANK), never trusted over what they saw.
    ``store``: a store every rank of the job reaches (``set(key, bytes)``, ``get(key)``
    waiting for the key; torch.distributed's TCPStore and FileStore qualify), fresh for
    the job or under a job name of its own: the ranks then also exchange the layout
    themselves before attaching (lpsync_client.layout), each rank knows it
    (``Client.rank_nodes``), and daemons that are not peers are found out at once.

    >>> with lpsync_client.connect(job="demo", rank=0, world_size=2) as client:
    ...     client.allreduce(client.zeros(8))
    """
    env = os.environ

    def pick(value, name: str, default=None, cast=str):
        if value is not None:
            return value
        raw = env.get(name)
        if raw is None or raw == "":
            if default is None:
                raise InvalidArgumentError(f"{name} is not set; pass it to connect()")
            return default
        return cast(raw)

    rank = pick(rank, "RANK", cast=int)
    world_size = pick(world_size, "WORLD_SIZE", cast=int)
    # Hints only (0 where the launcher said nothing): the daemons check them.
    local_world_size = pick(local_world_size, "LOCAL_WORLD_SIZE", 0, int)
    local_rank = pick(local_rank, "LOCAL_RANK", 0, int) if local_world_size else 0
    return Client(
        socket=pick(socket, "LPSYNC_SOCKET", DEFAULT_SOCKET),
        target=target or env.get("LPSYNC_TARGET") or None,
        job=pick(job, "LPSYNC_JOB", "default"),
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size or None,
        token=token or env.get("LPSYNC_TOKEN") or None,
        root_certificates=root_certificates,
        timeout=timeout,
        trigger=trigger or env.get("LPSYNC_TRIGGER") or "auto",
        store=store,
        connect_timeout=_connect_timeout(connect_timeout, env.get("LPSYNC_CONNECT_TIMEOUT")),
    )
