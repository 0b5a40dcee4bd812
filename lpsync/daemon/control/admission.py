"""Admission: what the daemon checks before it takes anything on. An attach (its fields,
its node layout, a pair job's place) becomes a session in its job; a collective request
(its fields against the limits, its buffers' views) becomes an Arrival for its job.
Every field is checked before anything is built from it (limits.py); a refusal is an
LpsyncError, which the servicer turns into a status.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import cast

from lpsync.algorithms import ALGORITHMS
from lpsync.algorithms.registry import DIRECT
from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.collectives.views import REDUCING
from lpsync.daemon.control import layout as layouts
from lpsync.daemon.control import limits
from lpsync.daemon.control.placing import Placing
from lpsync.daemon.control.sessions import Session
from lpsync.daemon.control.state import DaemonState
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.peers.attached import MAX_JOB_BYTES
from lpsync.daemon.values import Arrival, Outcome, Spec
from lpsync.errors import InvalidArgumentError, LpsyncError
from lpsync.memory.kind import Span
from lpsync.types import OUT_OF_PLACE_ONLY, ROOTED_OPS, Collective, ReduceOp, blocks, dtype_of
from lpsync_client.wire.pairs import parse_pair
from lpsync_client.wire.proto import lpsync_pb2 as pb

log = logging.getLogger("lpsync.daemon")


class Admission:
    def __init__(self, state: DaemonState) -> None:
        self._state = state
        self.config, self.limits, self.metrics = state.config, state.limits, state.metrics
        self.sessions, self.jobs, self.placing = state.sessions, state.jobs, state.placing
        self.devices, self.watcher, self.node_info = state.devices, state.watcher, state.node_info

    def _refused(self, name: str, rank: int, error: LpsyncError) -> None:
        """A rank of a job whose other ranks are here was refused for a contradiction (its
        layout, world size or node: a retry is refused alike): what they wait for fails
        now, naming it and why, instead of at their timeout; a later attach of that rank
        that is accepted lets the job go on (Job.join)."""
        job = self.jobs.get(name)
        if job is None or rank not in job.local_ranks or rank in job.sessions:
            return  # no job here yet, not a rank of it, or a duplicate of a live rank
        self.jobs.leave(name, rank, f"its attach was refused: {error}")

    def attach(self, request: pb.AttachRequest) -> Session:
        """A rank's attach: its session, in its job, on the node layout it said or the
        daemons find. Refused (LpsyncError) with a line in the log; a refusal for a
        contradiction fails what its job's other ranks here wait for (``_refused``)."""
        try:
            self._state.check_open()
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
            raise
        # A session whose client never opens its stream would never learn of its death.
        self.watcher.at(
            time.monotonic() + self.config.stream_grace,
            lambda: (
                None
                if session.stream_bound or session.closed
                else self._state.end_session(session, "no Session stream opened")
            ),
        )
        self.metrics.sessions.set(len(self.sessions.all()))
        log.info(
            "attached",
            extra={"session": session.id, "job": session.job, "rank": session.rank, "pid": session.pid},
        )
        return session

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

    # -- collectives -------------------------------------------------------------------------
    def arrival(
        self, session: Session, request: pb.CollectiveRequest, done: Callable[[Outcome], None]
    ) -> Arrival:
        # A repeat of a request this session made before (the fields but the sequence
        # number): its checks passed and its views are made. Released buffers clear this.
        key = None if request.ready_event else _request_key(request)
        known = session.requests.get(key) if key is not None else None
        if known is not None:
            spec, timeout, data, out, handles = known
            if self.devices is not None:
                done = holding_devices(self.devices, data, out, done)
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
        done = holding_devices(self.devices, data, out, done)
        return Arrival(
            session.rank,
            request.sequence,
            spec,
            timeout,
            data,
            out,
            tuple(handles),
            done,
            ready=ready,
            stream_ordered=request.stream_ordered and ready is not None,
        )

    @staticmethod
    def _known(session: Session, key: tuple | None, checked: tuple) -> None:
        """Keep a checked request's parts for its repeats (bounded, as the views are)."""
        if key is None:
            return
        if len(session.requests) > 256:
            session.requests.clear()
        session.requests[key] = checked


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


def _overlap(a, b) -> bool:
    if isinstance(a, Span) != isinstance(b, Span):
        raise InvalidArgumentError("input and output must both be host or both device buffers")
    if isinstance(a, Span):
        return a.memory is b.memory and a.lo < b.hi and b.lo < a.hi
    a0, b0 = a.__array_interface__["data"][0], b.__array_interface__["data"][0]
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def holding_devices(
    devices: DeviceRegistry | None, data: object, out: object, done: Callable[[Outcome], None]
) -> Callable[[Outcome], None]:
    """Device buffers are busy from their arrival until the reply: a Release or the
    session's end in between defers the close of their mappings until then (on CUDA a
    mapping closed under a pending collective faults the daemon's context on that
    device; issue 25, point 5). The returned ``done`` frees them, then replies: a
    mapping released meanwhile is closed before the client hears the result, so it
    never frees memory the daemon still maps (cudaFree before cudaIpcCloseMemHandle)."""
    if devices is None:
        return done
    spans = [s for s in (data, out) if isinstance(s, Span)]
    if not spans:
        return done
    busy = devices.use([s.memory for s in spans])
    once = threading.Lock()

    def reply(outcome: Outcome) -> None:
        try:
            if once.acquire(blocking=False):
                devices.done(busy)
        finally:
            done(outcome)

    return reply
