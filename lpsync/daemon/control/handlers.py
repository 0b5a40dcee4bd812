"""The LpSync gRPC servicer, thin: each RPC translates its request, calls the part that
does the work (admission.py: attach and a collective's checks; state.py: sessions,
buffers, where a collective goes; status.py: Status) and translates the answer back.
The trigger socket (trigger.py) feeds the same ``handle`` as a Session stream.

Errors leave as gRPC status codes named by the LpsyncError class (``.code``); the
class name and, for collectives, the in-place buffer's state (INTACT/PARTIAL) go in
trailing metadata ``lpsync-error`` / ``lpsync-buffer-state`` (unary) or in the
CollectiveResult (Session stream). No request can take the daemon down: every
handler turns LpsyncError into a status and logs anything else as a bug.

Threads: the gRPC handlers are coroutines on one asyncio loop (grpc.aio). A Session
stream is a reader task (requests -> ``handle``) and the handler writing replies from
an asyncio queue. When a request is the last arrival of a small collective, the loop
runs it inline (the direct path) and queues both replies: no thread hand-off at all.
Larger collectives run on worker threads (collectives/conductor.py) and reply through
call_soon_threadsafe, as do the watcher (timeouts) and the trigger socket's readers
(trigger.py), which feed the same ``handle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable

import grpc

from lpsync import __version__
from lpsync.daemon.control import limits, replies
from lpsync.daemon.control.admission import Admission
from lpsync.daemon.control.sessions import Session as _Session  # Service.Session (an RPC) shadows it
from lpsync.daemon.control.state import DaemonState
from lpsync.daemon.control.status import status
from lpsync.daemon.values import Outcome
from lpsync.errors import InvalidArgumentError, LpsyncError, UnavailableError
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc

log = logging.getLogger("lpsync.daemon")


class Service(pb_grpc.LpSyncServicer):
    def __init__(self, state: DaemonState) -> None:
        self.state = state
        self.admission = Admission(state)
        # The parts the RPCs use most (state.py builds them; they never change).
        self.config, self.limits, self.metrics = state.config, state.limits, state.metrics
        self.sessions, self.jobs, self.conductor = state.sessions, state.jobs, state.conductor
        # gRPC handlers run on one asyncio loop (bind_loop).
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = -1

    # -- the event loop ----------------------------------------------------------------------
    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that runs the gRPC handlers (server.py calls this before serving)."""
        self.loop = loop
        self._loop_thread = threading.get_ident()
        self.conductor.on_loop(self._loop_thread)

    def _putter(self, responses: asyncio.Queue) -> Callable[[object], None]:
        """A put for ``responses`` callable from any thread: direct on the loop's own
        thread (the common case: no hand-off), through call_soon_threadsafe elsewhere."""
        loop, put = self.loop, responses.put_nowait

        def putter(item: object) -> None:
            if threading.get_ident() == self._loop_thread:
                put(item)
            else:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads
                    assert loop is not None  # bound before serving (bind_loop)
                    loop.call_soon_threadsafe(put, item)

        return putter

    # -- RPCs ----------------------------------------------------------------------------------
    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        try:
            session = self.admission.attach(request)
        except LpsyncError as error:
            await _abort(context, error)
            raise AssertionError from error  # unreachable: abort raises
        return pb.AttachResponse(
            session_id=session.id,
            daemon_version=__version__,
            trigger_socket=self.state.trigger_path,
            node=self.state.node_info,
        )

    async def Node(self, request: pb.NodeRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        return self.state.node_info

    async def Detach(self, request: pb.DetachRequest, context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        try:
            session = self.sessions.get(request.session_id)
            # Off the event loop: its device mappings close before the answer (wait=True).
            assert self.loop is not None  # bound before serving (bind_loop)
            await self.loop.run_in_executor(None, self.state.end_session, session, "detached", True)
        except LpsyncError as error:
            await _abort(context, error)
        return pb.DetachResponse()

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.Buffer:
        return await self._allocate(request.session_id, request.nbytes, False, context)

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Buffer:
        if request.device in ("", "cpu"):
            return await self._allocate(request.session_id, request.nbytes, True, context)
        try:
            self.state.check_open()
            if request.device not in ("cuda", "emulated"):
                raise InvalidArgumentError(
                    f"unknown device kind {request.device[: limits.MAX_KEYWORD]!r}; expected "
                    "cpu, cuda or emulated"
                )
            session = self.sessions.get(request.session_id)
            # Opening an IPC handle can take milliseconds on CUDA: off the event loop.
            buffer = await asyncio.get_running_loop().run_in_executor(
                self.conductor.pool,
                self.sessions.register_device,
                session,
                request.device,
                request.device_index,
                request.ipc_handle,
                request.ipc_offset,
                request.nbytes,
                request.allocation_bytes,
            )
        except LpsyncError as error:
            await _abort(context, error)
            raise AssertionError from error
        return pb.Buffer(
            handle=buffer.handle,
            nbytes=buffer.nbytes,
            device=request.device,
            device_index=request.device_index,
        )

    async def _allocate(
        self, session_id: str, nbytes: int, staged: bool, context: grpc.aio.ServicerContext
    ) -> pb.Buffer:
        try:
            self.state.check_open()
            session = self.sessions.get(session_id)
            # Off the event loop: reserving a big segment's pages takes a while (~0.3 s/GiB).
            buffer = await asyncio.get_running_loop().run_in_executor(
                None, self.sessions.allocate, session, nbytes, staged
            )
        except LpsyncError as error:
            await _abort(context, error)
            raise AssertionError from error
        assert buffer.segment is not None  # allocate() makes host buffers
        return pb.Buffer(
            handle=buffer.handle, shm_name=buffer.segment.name, nbytes=buffer.segment.nbytes, staged=staged
        )

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        try:
            session = self.sessions.get(request.session_id)
            # Off the event loop: closing a device mapping can synchronize the device, and a
            # disarm waits for a run of the plan.
            assert self.loop is not None  # bound before serving (bind_loop)
            await self.loop.run_in_executor(None, self.state.release_buffer, session, request.handle)
        except LpsyncError as error:
            await _abort(context, error)
        job = self.jobs.get(session.job)
        if job is not None:
            job.plans.forget(session.id, request.handle)
        return pb.ReleaseResponse()

    async def Collective(
        self, request: pb.CollectiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.CollectiveResponse:
        assert self.loop is not None  # bound before serving (bind_loop)
        finished: asyncio.Future = self.loop.create_future()

        def settle(outcome: Outcome) -> None:
            if not finished.done():  # the call may have given up (cancelled) already
                finished.set_result(outcome)

        def done(outcome: Outcome) -> None:
            if threading.get_ident() == self._loop_thread:
                settle(outcome)
            else:
                with contextlib.suppress(RuntimeError):  # loop closed: nobody waits
                    assert self.loop is not None  # bound before serving (bind_loop)
                    self.loop.call_soon_threadsafe(settle, outcome)

        arrival = None
        try:
            session = self.sessions.get(request.session_id)
            arrival = self.admission.arrival(session, request, done)
            self.state.submit(session, arrival)
        except LpsyncError as error:
            if arrival is not None:
                arrival.done(Outcome(error))  # frees what its arrival holds
            await _abort(context, error)
            raise AssertionError from error
        # The watcher fails the collective at its timeout and execution has the same bound,
        # so this wait ends; the margin only guards against a bug.
        try:
            outcome = await asyncio.wait_for(finished, 2 * arrival.timeout + 5)
        except TimeoutError:
            outcome = Outcome(UnavailableError("collective did not complete: daemon overloaded"))
        except asyncio.CancelledError:  # the client cancelled the call or its deadline passed
            job = self.jobs.get(session.job)
            if job is not None:
                job.withdraw(session.rank, arrival.sequence, "cancelled its call", arrival)
            raise
        if outcome.error is not None:
            await _abort(context, outcome.error, outcome.buffer_state)
        return pb.CollectiveResponse(
            algorithm=outcome.algorithm,
            chunks=outcome.chunks,
            seconds=outcome.seconds,
            done_event=outcome.done_event,
        )

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionResponse]:
        try:
            try:
                # A stream that never says which session it is would be held forever.
                first = await asyncio.wait_for(anext(request_iterator), self.config.stream_grace)
            except (StopAsyncIteration, grpc.RpcError, asyncio.CancelledError):
                return
            except TimeoutError:
                raise InvalidArgumentError(
                    f"no open{{session_id}} message within {self.config.stream_grace:g} s (stream_grace)"
                ) from None
            if first.WhichOneof("body") != "open":
                raise InvalidArgumentError("the first message of a Session stream must be open")
            session = self.sessions.get(first.open.session_id)
            if session.stream_bound:
                raise InvalidArgumentError("this session already has a Session stream")
            session.stream_bound = True
        except LpsyncError as error:
            await _abort(context, error)
            return
        responses: asyncio.Queue[pb.SessionResponse | None] = asyncio.Queue()
        put = self._putter(responses)
        session.on_close.append(lambda: put(None))
        context.add_done_callback(lambda _: self.state.end_session(session, "session stream closed"))
        # Set when the replies drain below max_queued: the reader waits on it (back-pressure).
        drained = asyncio.Event()
        drained.set()
        failure: list[LpsyncError] = []
        reader = asyncio.get_running_loop().create_task(
            self._read_stream(request_iterator, session, put, responses, drained, failure)
        )
        yield pb.SessionResponse(request_id=first.request_id, opened=first.open)
        try:
            # Ends with the None that end_session puts (detach, stream closed, shutdown).
            while (response := await responses.get()) is not None:
                if responses.qsize() < self.limits.max_queued:
                    drained.set()
                yield response  # waits while the client does not read (HTTP/2 flow control)
        finally:
            reader.cancel()
        if failure:  # a request that did not decode ends the stream with its reason
            await _abort(context, failure[0])

    async def _read_stream(
        self,
        requests: AsyncIterator[pb.SessionRequest],
        session: _Session,
        put: Callable[[object], None],
        responses: asyncio.Queue,
        drained: asyncio.Event,
        failure: list[LpsyncError],
    ) -> None:
        """Feeds ``handle``. A client that stops reading its replies is not read either once
        max_queued replies wait for it, so its requests back up in HTTP/2 flow control and
        the daemon holds at most max_queued replies plus its job's pending collectives."""
        try:
            async for request in requests:
                self.handle(session, request, put)
                if responses.qsize() >= self.limits.max_queued:
                    log.debug(
                        "session stream paused: the client is not reading its replies",
                        extra={"session": session.id, "held": responses.qsize()},
                    )
                    drained.clear()
                    await drained.wait()
        except (grpc.RpcError, asyncio.CancelledError):
            pass  # the client is gone; handled below
        except LpsyncError as error:  # undecodable bytes (decoding.py)
            failure.append(error)
            log.info("session stream refused", extra={"session": session.id, "reason": str(error)})
        except Exception:
            log.exception("session reader failed", extra={"session": session.id})
        finally:
            self.state.end_session(session, "session stream closed")

    def handle(
        self,
        session: _Session,
        request: pb.SessionRequest,
        reply: Callable[[pb.SessionResponse], None],
        reply_bytes: Callable[[bytes], None] | None = None,
    ) -> None:
        """One request of a Session stream or of the trigger socket; ``reply`` sends the
        answer (from whichever thread completes it); ``reply_bytes``, where given, sends
        a collective's result serialized already (replies.result_bytes)."""
        rid, body = request.request_id, request.WhichOneof("body")
        if body == "ping":
            reply(pb.SessionResponse(request_id=rid, pong=request.ping))
            return
        if body == "cancel":
            job = self.jobs.get(session.job)
            if job is not None:
                job.withdraw(session.rank, request.cancel.sequence, "cancelled its call")
            reply(replies.result(rid, Outcome()))
            return
        if body == "probe":
            try:
                limits.check_timeout(request.probe.timeout)
                timeout = request.probe.timeout or self.config.timeout
                self.state.any_source.probe(
                    session,
                    timeout,
                    request.probe,
                    lambda response: reply(replies.with_id(response, rid)),
                    lambda error: reply(replies.result(rid, Outcome(error))),
                )
            except LpsyncError as error:
                reply(replies.result(rid, Outcome(error)))
            return
        if body != "collective":
            unexpected = InvalidArgumentError(f"unexpected {body} message on an open session")
            reply(replies.result(rid, Outcome(unexpected)))
            return

        def done(outcome: Outcome) -> None:
            if reply_bytes is not None:
                reply_bytes(replies.result_bytes(rid, outcome))
            else:
                reply(replies.result(rid, outcome))

        arrival = None
        try:
            arrival = self.admission.arrival(session, request.collective, done)
            self.state.submit(session, arrival)
        except LpsyncError as error:
            self.metrics.collective_failed(request.collective.op, error.code)
            (done if arrival is None else arrival.done)(Outcome(error))

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return status(self.state, request)


async def _abort(context: grpc.aio.ServicerContext, error: LpsyncError, buffer_state: str = "") -> None:
    """End the call with the error's status; raises (grpc.aio's abort always does)."""
    metadata = [("lpsync-error", type(error).__name__)]
    if buffer_state:
        metadata.append(("lpsync-buffer-state", buffer_state))
    code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNKNOWN)
    await context.abort(code, str(error), trailing_metadata=tuple(metadata))
