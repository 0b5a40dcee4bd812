"""The LpSync gRPC servicer: validates requests, maps them onto sessions and matching.

Errors leave as gRPC status codes named by the LpsyncError class (``.code``); the
class name and, for collectives, the in-place buffer's state (INTACT/PARTIAL) go in
trailing metadata ``lpsync-error`` / ``lpsync-buffer-state`` (unary) or in the
CollectiveResult (Session stream). No request can take the daemon down: every
handler turns LpsyncError into a status and logs anything else as a bug.

Threads: the gRPC handlers are coroutines on one asyncio loop (grpc.aio). A Session
stream is a reader task (requests -> ``handle``) and the handler writing replies from
an asyncio queue. When a request is the last arrival of a small collective, the loop
runs it inline (the direct path) and queues both replies: no thread hand-off at all.
Larger collectives run on worker threads (``_dispatch``) and reply through
call_soon_threadsafe, as do the watcher (timeouts) and the trigger socket's readers
(trigger.py), which feed the same ``handle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import cast

import grpc

from lpsync import __version__, native
from lpsync.algorithms import ALGORITHMS
from lpsync.algorithms.registry import DIRECT
from lpsync.daemon.collectives.conductor import RECORD_FIELDS, Conductor
from lpsync.daemon.collectives.matching import Job, Jobs, Recorder
from lpsync.daemon.collectives.outcomes import Outcomes
from lpsync.daemon.collectives.views import REDUCING
from lpsync.daemon.control import layout as layouts
from lpsync.daemon.control import limits, replies
from lpsync.daemon.control.any_source import AnySource
from lpsync.daemon.control.config import DaemonConfig
from lpsync.daemon.control.metrics import BUCKETS, JobState, Metrics
from lpsync.daemon.control.placing import Placing
from lpsync.daemon.control.sessions import Session as _Session  # Service.Session (an RPC) shadows it
from lpsync.daemon.control.sessions import SessionTable
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.peers.attached import MAX_JOB_BYTES, Attached
from lpsync.daemon.peers.plane import PeerPlane
from lpsync.daemon.values import Arrival, Outcome, Spec, Waiting
from lpsync.daemon.watcher import Watcher
from lpsync.errors import (
    InvalidArgumentError,
    LpsyncError,
    NotFoundError,
    UnavailableError,
)
from lpsync.memory.devices import open_kind, parse_devices
from lpsync.memory.kind import Span
from lpsync.native.armed import ArmedPlans
from lpsync.types import OUT_OF_PLACE_ONLY, ROOTED_OPS, Collective, ReduceOp, blocks, dtype_of
from lpsync_client.wire.pairs import parse_pair
from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc

log = logging.getLogger("lpsync.daemon")

OPS = limits.OPS


class Service(pb_grpc.LpSyncServicer):
    def __init__(self, config: DaemonConfig, metrics: Metrics, plane: PeerPlane | None = None) -> None:
        self.config, self.metrics = config, metrics
        self.plane = plane  # the peer manager; None: a single-node daemon
        # Which node this is, for the ranks that discover their job's layout (layout.py).
        self.node_info = _node_info(plane)
        # Multi-node: this node's outcomes of cross-node collectives and what the other
        # nodes told of theirs on each new mesh (outcomes.py), for Status.
        self.outcomes = Outcomes(plane.rank) if plane is not None else None
        if plane is not None:
            plane.exchange = self.outcomes
        self.started = time.time()
        kind = open_kind(parse_devices(config.devices))
        self.devices = DeviceRegistry(kind, config.device_staging_bytes) if kind is not None else None
        self.limits = config.limits()
        self.sessions = SessionTable(self.limits, on_bytes=self._bytes_changed, devices=self.devices)
        if self.devices is not None:
            metrics.describe_devices(self.devices.kind.name, self.devices.kind.devices)
        self.watcher = Watcher()
        # Receive from any source: the sends announced to this daemon's receivers.
        self.any_source = AnySource(self.watcher, plane, self.limits.max_pending)
        # Where the jobs' complete collectives run, and what is kept of each (conductor.py).
        self.conductor = Conductor(
            config.workers, metrics, self.any_source.inbox, plane, self.devices, self.outcomes
        )
        self.jobs = Jobs(
            self.watcher,
            self.conductor,
            Recorder(config.flight_recorder, config.stall_seconds),
            max_pending=self.limits.max_pending,
            native=self._native_plans if config.native != "off" and native.engine() is not None else None,
        )
        # The engine's counts join the metrics at each scrape (never per call).
        metrics.before_collect(lambda: self.conductor.native_finished(self.jobs.all()))
        if plane is not None:  # a lost mesh stops armed runs across nodes (their engines
            plane.on_lost = self._peers_lost  # do not hear the heartbeats)
        # Multi-node: where every job's ranks attached, as the daemons tell each other, and
        # its first collectives held until that settles its layout (placing.py).
        self.placing = (
            Placing(
                Attached(plane),
                self.watcher,
                self._release,
                self._placed,
                self.jobs.get,
                on_failure=metrics.collective_failed,
            )
            if plane is not None
            else None
        )
        metrics.session_bytes_limit.set(config.max_session_bytes)
        metrics.buffer_bytes_limit.set(config.max_buffer_bytes)
        metrics.watch(
            lambda: [JobState(j.name, j.outstanding(), j.last_progress) for j in self.jobs.all()],
            lambda: [s.nbytes for s in self.sessions.all()],
        )
        self._closing = False
        self._ending = threading.Lock()
        self.trigger_path = ""  # set by the server when it offers the trigger socket
        # The peer plane's transport and device path, chosen at start (server.py); empty
        # on a single node.
        self.peer_plane = pb.PeerPlaneInfo()
        # gRPC handlers run on one asyncio loop (bind_loop).
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = -1

    def _native_plans(self, job: Job) -> ArmedPlans | None:
        """A job's armed plans (its doorbell page and engine thread), made at its first plan
        armed; None where it cannot have them (its slots, a failure)."""
        module = native.engine()
        if module is None or job.world_size > module.MAX_SLOTS:
            return None
        try:
            local = tuple(job.local_ranks) if job.layout is not None else None
            plans = ArmedPlans(job.world_size, BUCKETS, self.metrics.collectives_done, local)
        except (OSError, LpsyncError, ValueError) as error:
            log.warning("job runs on the Python path: " + str(error), extra={"job": job.name})
            return None
        log.info("job's repeated collectives run natively", extra={"job": job.name, "page": plans.page.name})
        return plans

    def _peers_lost(self) -> None:
        for job in self.jobs.all():
            if job.native is not None:
                job.native.abort_net()

    def _bytes_changed(self, total: int) -> None:
        self.metrics.registered_bytes.set(total)
        if self.devices is not None:
            self.metrics.device_bytes(self.devices.registered)

    # -- lifecycle -------------------------------------------------------------------------
    def end_session(self, session: _Session, reason: str, wait: bool = False) -> None:
        """Idempotent: abort what waits on the session, free its buffers, end its stream.
        Device mappings close on the registry's thread unless ``wait`` (a Detach: its
        client frees the memory once answered, so they must be closed by then)."""
        with self._ending:
            if session.ended:
                return
            session.ended = True
        # Abort first, so the other ranks hear of it; then free the buffers.
        self.jobs.leave(session.job, session.rank, reason)
        if self.placing is not None:
            self.placing.left(session.job, session.rank, reason)
        buffers = self.sessions.remove(session, wait)
        job = self.jobs.get(session.job)
        if job is not None:
            for buffer in buffers:
                job.plans.forget(session.id, buffer.handle)
        for callback in session.on_close:
            callback()
        self.metrics.sessions.set(len(self.sessions.all()))
        self.conductor.wake()  # shutdown() drains only while some session is attached
        log.info(
            "session ended",
            extra={
                "session": session.id,
                "job": session.job,
                "rank": session.rank,
                "reason": reason,
                "buffers_freed": len(buffers),
            },
        )

    def shutdown(self, drain: float) -> None:
        """Refuse new work, let running collectives finish (up to ``drain`` s) while a
        session is attached to take their results, end all. A collective whose ranks are
        all gone (a trainer killed inside a call) has no one to answer, and across nodes
        it waits for nodes that are draining too: waiting for it would hold every exit."""
        self._closing = True
        self.conductor.drain(time.monotonic() + drain, lambda: bool(self.sessions.all()))
        for session in self.sessions.all():
            self.end_session(session, "daemon shutting down")
        self.sessions.close_all()
        if self.devices is not None:
            self.devices.close()
        self.watcher.stop()
        self.conductor.stop()

    def _check_open(self) -> None:
        if self._closing:
            raise UnavailableError("the daemon is shutting down")

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

    def _refused(self, name: str, rank: int, error: LpsyncError) -> None:
        """A rank of a job whose other ranks are here was refused for a contradiction (its
        layout, world size or node: a retry is refused alike): what they wait for fails
        now, naming it and why, instead of at their timeout; a later attach of that rank
        that is accepted lets the job go on (Job.join)."""
        job = self.jobs.get(name)
        if job is None or rank not in job.local_ranks or rank in job.sessions:
            return  # no job here yet, not a rank of it, or a duplicate of a live rank
        self.jobs.leave(name, rank, f"its attach was refused: {error}")

    # -- RPCs ----------------------------------------------------------------------------------
    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        try:
            self._check_open()
            # Every field is checked before anything is built from it (limits.py).
            limits.check_attach(
                request.job,
                request.rank,
                request.world_size,
                request.local_rank,
                request.local_world_size,
                request.pid,
                self.limits,
            )
            info = self.node_info
            limits.check_rank_nodes(request.rank_nodes, request.world_size, info.nodes)
            said = self._hints(request)
            rank_nodes = request.rank_nodes
            if said is None and (pair := self._pair_of(request)) is not None:
                # A pair job of send/recv whose main job's layout is settled here: its two
                # ranks are where that says (a send's announcement needs its receiver's node).
                parent, source, destination = pair
                rank_nodes = layouts.pair_nodes(parent.layout, source, destination, info.node_rank)
                said = f"the layout of its main job {parent.name!r}"
            layout = layouts.resolve(
                request.job,
                request.rank,
                request.world_size,
                request.local_rank,
                request.local_world_size,
                rank_nodes,
                info.node_rank,
                info.nodes,
            )
            hinted = layouts.Hinted(layout, said) if said is not None else None
            if hinted is None and self.placing is not None:  # found by the daemons: as settled
                existing = self.jobs.get(request.job)
                layout = existing.layout if existing is not None else None
            else:
                limits.check_local_world(
                    request.job, len(layout.local_ranks) if layout else request.world_size, self.limits
                )
            session = self.sessions.create(
                request.job, request.rank, request.world_size, request.pid, multinode=layout is not None
            )
            try:
                job = self.jobs.join(session.job, session.rank, session.world_size, session.id, layout)
                if self.placing is not None:
                    self.placing.attached(job, session.rank, hinted)
            except LpsyncError:
                self.sessions.remove(session)
                raise
        except LpsyncError as error:
            # The client raises it; the log is where an operator sees why a rank never joined.
            log.info(
                "attach refused",
                extra={
                    "job": request.job[:200],
                    "rank": request.rank,
                    "code": error.code,
                    "error": str(error),
                },
            )
            if isinstance(error, InvalidArgumentError):
                self._refused(request.job, request.rank, error)
                if self.placing is not None and request.job and request.rank < request.world_size:
                    self.placing.refused(request.job[:MAX_JOB_BYTES], request.world_size, request.rank, error)
            await _abort(context, error)
            raise AssertionError from error  # unreachable: abort raises
        # A session whose client never opens its stream would never learn of its death.
        self.watcher.at(
            time.monotonic() + self.config.stream_grace,
            lambda: (
                None
                if session.stream_bound or session.closed
                else self.end_session(session, "no Session stream opened")
            ),
        )
        self.metrics.sessions.set(len(self.sessions.all()))
        log.info(
            "attached",
            extra={"session": session.id, "job": session.job, "rank": session.rank, "pid": session.pid},
        )
        return pb.AttachResponse(
            session_id=session.id,
            daemon_version=__version__,
            trigger_socket=self.trigger_path,
            node=self.node_info,
        )

    def _hints(self, request: pb.AttachRequest) -> str | None:
        """What an attach said of its job's layout, in words (None: nothing; on a daemon
        with peers the daemons find it). A job name too long to tell the peers is refused."""
        if self.placing is not None and len(request.job.encode()) > MAX_JOB_BYTES:
            raise InvalidArgumentError(
                f"a job name of over {MAX_JOB_BYTES} bytes cannot be told to the peer daemons"
            )
        if request.rank_nodes:
            return "a layout discovered through a store (rank_nodes)"
        if request.local_world_size:
            return f"LOCAL_WORLD_SIZE={request.local_world_size}, LOCAL_RANK={request.local_rank}"
        return None

    def _pair_of(self, request: pb.AttachRequest) -> tuple[Job, int, int] | None:
        """(main job, source, destination) of a pair job (lpsync_client.wire.pairs) whose main
        job's layout is settled here; None for any other attach."""
        pair = parse_pair(request.job) if self.placing is not None and request.world_size == 2 else None
        if pair is None:
            return None
        parent, source, destination, _ = pair
        job = self.jobs.get(parent)
        if (
            job is None
            or not cast(Placing, self.placing).settled(job)
            or max(source, destination) >= job.world_size
        ):
            return None
        return job, source, destination

    def _placed(self, job: Job) -> None:
        """``job``'s layout settled (placing.py), before its first collective goes on."""
        for session in self.sessions.all():
            if session.job == job.name:
                session.multinode = job.layout is not None

    def _release(self, session: _Session, arrival: Arrival) -> None:
        """A collective that waited for its job's layout goes on (placing.py), on a worker
        thread: the thread that settled the layout may be a peer's note reader, which a
        collective run on it would hold from the notes it waits for."""
        self.conductor.submit(self._resubmit, session, arrival)

    def _resubmit(self, session: _Session, arrival: Arrival) -> None:
        try:
            self._submit(session, arrival, announced=True)
        except LpsyncError as error:
            self.metrics.collective_failed(arrival.spec.op, error.code)
            arrival.done(Outcome(error))

    async def Node(self, request: pb.NodeRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        return self.node_info

    async def Detach(self, request: pb.DetachRequest, context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        try:
            session = self.sessions.get(request.session_id)
            # Off the event loop: its device mappings close before the answer (wait=True).
            assert self.loop is not None  # bound before serving (bind_loop)
            await self.loop.run_in_executor(None, self.end_session, session, "detached", True)
        except LpsyncError as error:
            await _abort(context, error)
        return pb.DetachResponse()

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.Buffer:
        return await self._allocate(request.session_id, request.nbytes, False, context)

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Buffer:
        if request.device in ("", "cpu"):
            return await self._allocate(request.session_id, request.nbytes, True, context)
        try:
            self._check_open()
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
            self._check_open()
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
            await self.loop.run_in_executor(None, self._release_buffer, session, request.handle)
        except LpsyncError as error:
            await _abort(context, error)
        job = self.jobs.get(session.job)
        if job is not None:
            job.plans.forget(session.id, request.handle)
        return pb.ReleaseResponse()

    def _release_buffer(self, session: _Session, handle: int) -> None:
        """Release a buffer: its armed plans are disarmed before it is unmapped."""
        job = self.jobs.get(session.job)
        if job is not None and job.native is not None:
            job.native.forget(session.id, handle)
        self.sessions.release(session, handle)

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
            arrival = self._arrival(session, request, done)
            self._submit(session, arrival)
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
            algorithm=outcome.algorithm, chunks=outcome.chunks, seconds=outcome.seconds
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
        context.add_done_callback(lambda _: self.end_session(session, "session stream closed"))
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
            self.end_session(session, "session stream closed")

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
                self.any_source.probe(
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
            arrival = self._arrival(session, request.collective, done)
            self._submit(session, arrival)
        except LpsyncError as error:
            self.metrics.collective_failed(request.collective.op, error.code)
            (done if arrival is None else arrival.done)(Outcome(error))

    def _submit(self, session: _Session, arrival: Arrival, announced: bool = False) -> None:
        """``announced``: a collective released by placing.py, announced when it came."""
        if self._closing:  # _check_open, inline: this runs for every request
            self._check_open()
        job = self.jobs.get(session.job)
        if job is None or session.closed:
            raise NotFoundError(f"session {session.id} has ended")
        # Announced first: submit may run the collective on this thread, which waits for
        # the receiver, which waits for the announcement (and so does a receiver's attach,
        # which the layout of a send held by placing waits for).
        if not announced:
            self.any_source.sent(job, session.rank, arrival)
        try:
            if self.placing is not None and self.placing.holds(job, session, arrival):
                # It goes on once the job's layout is settled. Without a mesh no daemon can
                # learn where ranks elsewhere are: if it is still down a heartbeat timeout
                # from now, UNAVAILABLE, as a settled job's collective gets (a job whose
                # ranks all come here settles meanwhile: the survivors keep serving).
                assert self.plane is not None  # placing exists with peers only
                if self.plane.down() is not None:
                    self.watcher.at(
                        time.monotonic() + self.config.heartbeat_timeout, lambda: self._unplaceable(job)
                    )
                return
            job.submit(arrival)
        except LpsyncError:
            self.any_source.refused(job, session.rank, arrival)
            raise

    def _unplaceable(self, job: Job) -> None:
        """A heartbeat timeout after a collective of ``job`` was held with the mesh down:
        if it is still down, what the job holds fails UNAVAILABLE."""
        assert self.plane is not None and self.placing is not None
        lost = self.plane.down()
        if lost is not None:
            self.placing.fail_open(
                job.name,
                UnavailableError(
                    f"node {self.plane.rank}: the peer mesh is down and rebuilding (lost: {lost}); "
                    f"job {job.name!r}'s layout cannot be settled without it"
                ),
            )

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        self.conductor.native_finished(self.jobs.all())  # the engines' records join the flight recorder
        now = time.time()
        response = pb.StatusResponse(
            version=__version__, uptime_seconds=now - self.started, peer_plane=self.peer_plane
        )
        for s in sorted(self.sessions.all(), key=lambda s: (s.job, s.rank)):
            response.sessions.add(
                session_id=s.id,
                job=s.job,
                rank=s.rank,
                world_size=s.world_size,
                pid=s.pid,
                buffers=len(s.buffers),
                registered_bytes=s.nbytes,
                attached_seconds=now - s.attached_at,
            )
            for b in list(s.buffers.values()):
                response.buffers.add(
                    session_id=s.id,
                    handle=b.handle,
                    nbytes=b.nbytes,
                    staged=b.staged,
                    shm_name=b.segment.name if b.segment is not None else "",
                    # A device buffer exists only where the daemon has devices (register_device).
                    device=""
                    if b.device is None
                    else f"{cast(DeviceRegistry, self.devices).kind.name}:{b.device.device}",
                )
        if self.devices is not None:
            kind, registry = self.devices.kind, self.devices
            opened = registry.open_allocations()
            opens, closes = registry.counters()
            rows = kind.topology.describe()
            for d in range(kind.devices):
                response.devices.add(
                    index=d,
                    kind=kind.name,
                    name=f"{kind.name}:{d}",
                    registered_bytes=registry.registered[d],
                    open_allocations=opened[d],
                    ipc_opens=opens[d],
                    ipc_closes=closes[d],
                    links=rows[d],
                )
        recent = list(self.conductor.recent)
        limit = request.recent or 20
        for entry in recent[-limit:]:
            response.recent.add(**dict(zip(RECORD_FIELDS, entry, strict=True)))
        for job in sorted(self.jobs.all(), key=lambda j: j.name):
            info = response.jobs.add()
            _job_info(info, job, request.history)
            info.path = self._path_of(job)
            if job.native is not None:
                info.armed_plans = job.native.armed()
                info.native_answered, info.native_fallbacks = job.native.stats()
                info.doorbell_page = job.native.page.name
            for w in self.placing.waiting(job) if self.placing is not None else ():
                _waiting_info(info, w)
            for rank, tag, seconds in self.any_source.inbox.waiting(job.name):
                info.receiving_any.add(rank=rank, tag=tag, waiting_seconds=seconds)
        for across in self.outcomes.failed(limit) if self.outcomes is not None else ():
            response.failed_across.add(
                job=across.job,
                sequence=across.sequence,
                nodes=[pb.NodeOutcome(node=d, code=across.codes.get(d, "")) for d in across.daemons],
                split=across.split(),
            )
        return response

    def _path_of(self, job: Job) -> str:
        """Which path the job's collectives take, and why (``lpsync status``)."""
        if job.native is not None:
            return "native"
        if self.config.native == "off":
            return "python (--native off)"
        if native.engine() is None:
            return f"python ({native.reason()})"
        if job.layout is not None:
            if self.plane is None or self.plane.native_channels() is None:
                return "python (a multi-node job on the UCX peer transport: armed plans cross nodes on tcp)"
            return "python (no plan armed yet: a repeated host collective arms one on its third call)"
        return "python (no plan armed yet: a repeated host collective up to 2 MiB arms one)"

    # -- collectives -------------------------------------------------------------------------
    def _arrival(
        self, session: _Session, request: pb.CollectiveRequest, done: Callable[[Outcome], None]
    ) -> Arrival:
        # A repeat of a request this session made before (the fields but the sequence
        # number): its checks passed and its views are made. Released buffers clear this.
        key = None if request.ready_event else _request_key(request)
        known = session.requests.get(key) if key is not None else None
        if known is not None:
            spec, timeout, data, out, handles = known
            if self.devices is not None:
                done = self._holding_devices(data, out, done)
            return Arrival(session.rank, request.sequence, spec, timeout, data, out, handles, done)
        op, p = request.op, session.world_size
        limits.check_collective(request, p, self.limits, ALGORITHMS)
        timeout = request.timeout or self.config.timeout
        if op == Collective.BARRIER:
            spec = Spec(op, "", 0, 0, "", "", request.name)
            self._known(session, key, (spec, timeout, None, None, ()))
            return Arrival(session.rank, request.sequence, spec, timeout, None, None, (), done)
        dtype = dtype_of(request.dtype)
        count = request.count
        root = request.root if op in ROOTED_OPS else 0
        reducing = op in REDUCING
        reduce_op = (request.reduce_op or ReduceOp.SUM) if reducing else ""
        algorithm = request.algorithm
        if algorithm == DIRECT and session.multinode:
            raise InvalidArgumentError(
                "algorithm='direct' serves single-node jobs only; this "
                "job spans nodes (use lp, ring, mst, be or the tuner)"
            )
        if algorithm and algorithm != DIRECT and Collective(op) not in ALGORITHMS[algorithm].generators:
            raise InvalidArgumentError(f"algorithm {algorithm!r} has no {op}")
        in_place = request.output.handle == 0
        if in_place and op in OUT_OF_PLACE_ONLY:
            raise InvalidArgumentError(f"{op} runs out of place only: pass an output buffer")
        b_in, b_out = blocks(op, p, session.rank, root)
        # In place, the one buffer holds the larger side (lpsync.engine.group.layout).
        n_in = count * (max(b_in, b_out) if in_place else b_in)
        n_out = count * b_out
        data = self.sessions.view(session, request.input.handle, request.input.offset, dtype, n_in)
        out = None
        handles = [(session.id, request.input.handle)]
        if not in_place:
            out = self.sessions.view(session, request.output.handle, request.output.offset, dtype, n_out)
            if _overlap(data, out) and data.size and out.size:
                raise InvalidArgumentError(
                    "input and output overlap; pass no output for an in-place collective"
                )
            handles.append((session.id, request.output.handle))
        spec = Spec(op, request.dtype, count, root, reduce_op, algorithm, request.name)
        ready = None
        if request.ready_event:
            if not isinstance(data, Span):
                raise InvalidArgumentError("a ready event goes with device buffers only")
            ready = self.sessions.ready_event(session, data.device, request.ready_event)
        self._known(session, key, (spec, timeout, data, out, tuple(handles)))
        done = self._holding_devices(data, out, done)
        return Arrival(
            session.rank, request.sequence, spec, timeout, data, out, tuple(handles), done, ready=ready
        )

    @staticmethod
    def _known(session: _Session, key: tuple | None, checked: tuple) -> None:
        """Keep a checked request's parts for its repeats (bounded, as the views are)."""
        if key is None:
            return
        if len(session.requests) > 256:
            session.requests.clear()
        session.requests[key] = checked

    def _holding_devices(
        self, data: object, out: object, done: Callable[[Outcome], None]
    ) -> Callable[[Outcome], None]:
        """Device buffers are busy from their arrival until the reply: a Release or the
        session's end in between defers the close of their mappings until then (on CUDA a
        mapping closed under a pending collective faults the daemon's context on that
        device; issue 25, point 5). The returned ``done`` frees them, then replies: a
        mapping released meanwhile is closed before the client hears the result, so it
        never frees memory the daemon still maps (cudaFree before cudaIpcCloseMemHandle)."""
        if self.devices is None:
            return done
        spans = [s for s in (data, out) if isinstance(s, Span)]
        if not spans:
            return done
        devices = self.devices
        busy = devices.use([s.memory for s in spans])
        once = threading.Lock()

        def reply(outcome: Outcome) -> None:
            try:
                if once.acquire(blocking=False):
                    devices.done(busy)
            finally:
                done(outcome)

        return reply


def _request_key(request: pb.CollectiveRequest) -> tuple:
    """A collective request's fields but its sequence number (and session: one table per
    session); requests with a ready event are never repeats (the event is new each time)."""
    return (
        request.op,
        request.dtype,
        request.count,
        request.root,
        request.reduce_op,
        request.algorithm,
        request.timeout,
        request.name,
        request.input.handle,
        request.input.offset,
        request.output.handle,
        request.output.offset,
    )


def _node_info(plane: PeerPlane | None) -> pb.NodeInfo:
    """This daemon as the Node RPC and Attach describe it. The cluster identity is the
    --peers list (node-rank order, the same on every daemon of a cluster); a daemon without
    peers is a cluster of its own: its host and a token drawn at start."""
    if plane is None:
        return pb.NodeInfo(node_rank=0, nodes=1, cluster=f"{socket.gethostname()}/{secrets.token_hex(4)}")
    peers = ",".join(str(p) for p in plane.options.peers.peers)
    digest = hashlib.sha256(peers.encode()).hexdigest()[:12]
    return pb.NodeInfo(node_rank=plane.rank, nodes=plane.size, cluster=f"peers-{digest}")


def _job_info(info: pb.JobInfo, job: Job, history: int) -> None:
    """The flight recorder of one job: what it waits for, and its last collectives."""
    layout = job.layout
    info.job, info.world_size = job.name, job.world_size
    info.nodes, info.node = (layout.nodes, layout.node) if layout is not None else (1, 0)
    with job.lock:
        info.attached.extend(sorted(job.sessions))
        records = list(job.history)
    for w in job.waiting():
        _waiting_info(info, w)
    for r in records[-history if history else 0 :]:
        record = info.history.add(
            sequence=r.sequence,
            op=r.spec.op,
            dtype=r.spec.dtype,
            count=r.spec.count,
            algorithm=r.algorithm,
            chunks=r.chunks,
            code=r.code,
            message=r.message,
            started_at=r.started_at,
            total_seconds=r.seconds,
        )
        for rank, after in r.arrivals:
            record.arrivals.add(rank=rank, after_seconds=after)
        for stage, seconds in r.stages:
            record.stages.add(stage=stage, seconds=seconds)


def _waiting_info(info: pb.JobInfo, w: Waiting) -> None:
    info.waiting.add(
        sequence=w.sequence,
        op=w.op,
        stage=w.stage,
        started_at=w.started_at,
        waiting_seconds=w.seconds,
        arrived=w.arrived,
        missing_ranks=w.missing_ranks,
        missing_nodes=w.missing_nodes,
        stalled=w.stalled,
    )


def _overlap(a, b) -> bool:
    if isinstance(a, Span) != isinstance(b, Span):
        raise InvalidArgumentError("input and output must both be host or both device buffers")
    if isinstance(a, Span):
        return a.memory is b.memory and a.lo < b.hi and b.lo < a.hi
    a0, b0 = a.__array_interface__["data"][0], b.__array_interface__["data"][0]
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


async def _abort(context: grpc.aio.ServicerContext, error: LpsyncError, buffer_state: str = "") -> None:
    """End the call with the error's status; raises (grpc.aio's abort always does)."""
    metadata = [("lpsync-error", type(error).__name__)]
    if buffer_state:
        metadata.append(("lpsync-buffer-state", buffer_state))
    code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNKNOWN)
    await context.abort(code, str(error), trailing_metadata=tuple(metadata))
