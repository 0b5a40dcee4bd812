"""Status: what ``lpsync status`` shows, read from the daemon's parts (state.py) when it
asks, never kept per call. The engines' records join the flight recorders first."""

from __future__ import annotations

import time
from typing import cast

from lpsync import __version__, native
from lpsync.daemon.collectives.conductor import RECORD_FIELDS
from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.control.state import DaemonState
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Waiting
from lpsync_client.wire.proto import lpsync_pb2 as pb


def status(state: DaemonState, request: pb.StatusRequest) -> pb.StatusResponse:
    """What ``lpsync status`` shows: sessions and their buffers, devices, the recent
    collectives, each job's flight recorder and path, the failures across nodes."""
    state.conductor.native_finished(state.jobs.all())  # the engines' records join the flight recorder
    now = time.time()
    response = pb.StatusResponse(
        version=__version__, uptime_seconds=now - state.started, peer_plane=state.peer_plane
    )
    for s in sorted(state.sessions.all(), key=lambda s: (s.job, s.rank)):
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
                else f"{cast(DeviceRegistry, state.devices).kind.name}:{b.device.device}",
            )
    if state.devices is not None:
        kind, registry = state.devices.kind, state.devices
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
    recent = list(state.conductor.recent)
    limit = request.recent or 20
    for entry in recent[-limit:]:
        response.recent.add(**dict(zip(RECORD_FIELDS, entry, strict=True)))
    for job in sorted(state.jobs.all(), key=lambda j: j.name):
        info = response.jobs.add()
        _job_info(info, job, request.history)
        info.path = path_of(state, job)
        if job.native is not None:
            info.armed_plans = job.native.armed()
            info.native_answered, info.native_fallbacks = job.native.stats()
            info.doorbell_page = job.native.page.name
        for w in state.placing.waiting(job) if state.placing is not None else ():
            _waiting_info(info, w)
        for rank, tag, seconds in state.any_source.inbox.waiting(job.name):
            info.receiving_any.add(rank=rank, tag=tag, waiting_seconds=seconds)
    for across in state.outcomes.failed(limit) if state.outcomes is not None else ():
        response.failed_across.add(
            job=across.job,
            sequence=across.sequence,
            nodes=[pb.NodeOutcome(node=d, code=across.codes.get(d, "")) for d in across.daemons],
            split=across.split(),
        )
    return response


def path_of(state: DaemonState, job: Job) -> str:
    """Which path the job's collectives take, and why (``lpsync status``)."""
    if job.native is not None:
        return "native"
    if state.config.native == "off":
        return "python (--native off)"
    if native.engine() is None:
        return f"python ({native.reason()})"
    if job.layout is not None:
        if state.plane is None or state.plane.native_channels() is None:
            return "python (a multi-node job on the UCX peer transport: armed plans cross nodes on tcp)"
        return "python (no plan armed yet: a repeated host collective arms one on its third call)"
    return "python (no plan armed yet: a repeated host collective up to 2 MiB arms one)"


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
