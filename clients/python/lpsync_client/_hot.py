"""The client's hot path: a collective from the caller's arguments to the daemon and back.

A call on arrays in shared memory that was seen before copies a prepared request,
numbers it and sends it; where the daemon armed its plan, a blocking call rings the job's
doorbell instead (doorbell.py) and an asynchronous one queues a ring (_rings.py); a
blocking call's reply is read on the caller's thread where it can be (``_answer_now``).
Anything else is resolved (_operands.py), staged in order (_order.py) and sent the general
way (``_send``), and its completion learns the plan the daemon armed (``_learning``).

``HotPath`` is a part of Client (as ``Buffers`` is): its state is set by ``_init_hot``
from Client's __init__, and it reads the attached session's fields declared below. A
mixin, not an object Client calls into: the hot path pays no extra call per collective,
and the tests that read or patch ``Client._answer_now`` or ``_send`` still find them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from lpsync_client import _ops, doorbell
from lpsync_client._operands import DeviceRegistered, Operand, Registered, after_answer, order_streams
from lpsync_client._order import InFlight, array_spans
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
from lpsync_client.wire.proto import lpsync_pb2 as pb

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


def _read_already(call: Call, timeout: float) -> bool:
    """How a blocking call answered on its own thread (Client._answer_now) settles: done."""
    return True


def _plain(result: object, response: pb.SessionResponse) -> object:
    """Completion of a collective over shared-memory arrays: nothing to copy back."""
    r = response.result
    if r.code != "OK":
        raise from_status(r.code, r.message, r.error, _STATES.get(r.buffer_state, ""))
    return result


class HotPath:
    """Client's collectives from submission to answer (its state: ``_init_hot``)."""

    # The attached session's, set by Client.__init__.
    rank: int
    world_size: int
    timeout: float
    session_id: str
    _lock: threading.Lock
    _trigger: TriggerStream | None
    _path: TriggerStream | SessionStream  # the trigger socket if any, else the gRPC stream
    # From Buffers (_operands.py): operand resolution, and giving staging back.
    _operand: Callable[..., Operand]
    _recycle: Callable[[list[Operand]], None]
    device_host_wait: bool  # answer device collectives once finished (issue 47: at enqueue)

    def _init_hot(self) -> None:
        """The hot path's state (Client.__init__ calls it before attaching)."""
        # .foreground: this thread's next request is waited at once (a blocking call);
        # .answer_here: its next request is answered on it if it can be (answer_next_here).
        self._here = threading.local()
        self._sequence = 0
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

    def _stop_hot(self) -> None:
        """Answer what is queued to ring (or time it out), then stop the ring thread."""
        if self._rings is not None:
            self._rings.drain(2 * self.timeout + 10)
            self._rings.close()

    def _forget_plans(self) -> list[doorbell.Page]:
        """Forget the armed plans; the doorbell pages mapped, for the caller to close
        (``self._lock`` held: Client.close)."""
        bells = list(self._bells.values())
        self._bells.clear()
        self._armed.clear()
        return bells

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
