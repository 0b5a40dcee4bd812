"""Running one collective of a multi-node job: agree across nodes, then one pipeline.

When every local rank of a sequence number has arrived (matching.py), this daemon:
  1. takes the current peer mesh (peer_plane.py), waiting for it up to the deadline;
  2. exchanges a summary with every other node of the job — its Spec and the peer
     plane's link model — over control tags, and compares: any difference fails the
     collective on every node alike with MismatchError (INVALID_ARGUMENT) naming the
     fields, nodes and ranks (every node compares the same summaries, so all agree);
  3. picks algorithm and chunks with the tuner from the slowest probed link of all nodes
     (shared_nic=True: one NIC per node), or takes the forced ``algorithm=``; the inputs
     are identical on every node, so every node builds the same schedule;
  4. runs its own participants' share with LocalGroup over a node-major Placement: local
     stage -> inter-node chain -> local stage is one chunk pipeline.
A peer lost mid-way breaks the mesh and every waiting participant fails at once with
UnavailableError. Invariant: message tags of collectives stay below 2**39 (bit 63 is the
peer plane's control space): tag = job hash (7 bits) | sequence (12 bits) | step (20 bits).
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict

import numpy as np

from lpsync.algorithms import LinkModel, generate, select
from lpsync.algorithms.tuner import chunks_for
from lpsync.daemon.device_staging import Staged, stage
from lpsync.daemon.devices import DeviceRegistry
from lpsync.daemon.execute import BARRIER, GroupCache, _buffers, nccl_bytes
from lpsync.daemon.matching import RUNNING, Job, Outcome, Pending, Spec
from lpsync.daemon.peer_plane import SPEC, Link, PeerPlane, control_tag
from lpsync.engine.group import LocalGroup
from lpsync.engine.reduce import Reduction
from lpsync.engine.routing import Placement
from lpsync.errors import (
    AbortedError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    MismatchError,
    UnavailableError,
)
from lpsync.types import Collective, ReduceOp, dtype_of

_SUMMARY_BYTES = 4096
_STEP_BITS, _SEQ_BITS, _JOB_BITS = 20, 12, 7
_REDUCING = (Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER)
_FIELDS = ("op", "count", "dtype", "root", "reduce_op", "algorithm", "name")


def job_hash(name: str) -> int:
    return zlib.crc32(name.encode())


def tag_base(job: str, sequence: int) -> int:
    return (((job_hash(job) & ((1 << _JOB_BITS) - 1)) << _SEQ_BITS
             | (sequence & ((1 << _SEQ_BITS) - 1))) << _STEP_BITS)


def run(job: Job, pending: Pending, plane: PeerPlane,
        devices: DeviceRegistry | None = None) -> Outcome:
    """The Runner for multi-node jobs (servicer.py picks it when job.layout is set).

    Device buffers cross nodes through host mirrors filled and drained chunk by chunk
    while the pipeline runs (device_staging.py).
    """
    assert job.layout is not None
    start = time.perf_counter()
    spec = pending.spec
    arrivals = [pending.arrivals[r] for r in job.local_ranks]
    timeout = min(a.timeout for a in arrivals)
    deadline = time.monotonic() + timeout
    link = plane.link(deadline)
    try:
        model = _agree(job, pending, link, deadline)
        pending.enter(RUNNING)
        if spec.op == BARRIER:
            return Outcome(algorithm="exchange", chunks=1, seconds=time.perf_counter() - start)
        if job.cache is None:
            job.cache = GroupCache()
        staged = stage(job, pending, devices, job.cache) if devices is not None else None
        algorithm, chunks = _run_pipeline(job, pending, link, model, deadline, staged)
    except LpsyncError as error:
        if link.error is not None and not isinstance(error, MismatchError):
            if isinstance(link.error, CollectiveTimeoutError):
                raise type(link.error)(f"collective #{pending.sequence} of job {job.name!r} "
                                       f"timed out across nodes: {link.error}") from None
            raise UnavailableError(f"collective #{pending.sequence} of job {job.name!r} "
                                   f"lost a peer node: {link.failure()}") from None
        raise
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=time.perf_counter() - start)


def _summary(job: Job, spec: Spec, link: Link) -> dict:
    assert job.layout is not None and link.model is not None
    ranks = job.local_ranks
    return {"node": job.layout.node, "ranks": [ranks[0], ranks[-1]], "spec": asdict(spec),
            "alpha": link.model.alpha, "beta": link.model.beta}


def _encode(summary: dict) -> np.ndarray:
    raw = json.dumps(summary).encode()
    if len(raw) > _SUMMARY_BYTES:
        raise InvalidArgumentError(f"collective name too long ({len(raw)} bytes of summary)")
    out = np.zeros(_SUMMARY_BYTES, np.uint8)
    out[:len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def _spec_tag(job: Job, sequence: int) -> int:
    return control_tag(SPEC, (job_hash(job.name) << 32) | (sequence & 0xFFFFFFFF))


_ERRORS = {"INVALID_ARGUMENT": MismatchError, "DEADLINE_EXCEEDED": CollectiveTimeoutError,
           "ABORTED": AbortedError}


def notify_failure(job: Job, pending: Pending, error: LpsyncError, plane: PeerPlane) -> None:
    """This node failed ``pending`` before running it: send the other nodes a summary that
    carries the error in place of the Spec, so they fail it too instead of timing out (a
    timeout would break the mesh). Best effort: without a mesh there is nothing to tell."""
    if job.layout is None:
        return
    try:
        link = plane.link(time.monotonic())
    except LpsyncError:
        return
    lo, hi = job.local_ranks[0], job.local_ranks[-1]
    message = f"node {job.layout.node} (ranks {lo}-{hi}): {error}"[:_SUMMARY_BYTES // 2]
    out = _encode({"node": job.layout.node, "ranks": [lo, hi],
                   "error": [error.code, message]})
    tag = _spec_tag(job, pending.sequence)
    deadline = time.monotonic() + 5.0
    try:
        for request in [link.endpoint.send(n, tag, out) for n in range(job.layout.nodes)
                        if n != job.layout.node]:
            request.wait(deadline)
    except LpsyncError:
        pass  # the mesh broke meanwhile: the other nodes learn of that instead


def _agree(job: Job, pending: Pending, link: Link, deadline: float) -> LinkModel:
    """Exchange summaries with every other node; MismatchError on any difference, the
    other node's error when it failed this collective before running it."""
    assert job.layout is not None
    mine = _summary(job, pending.spec, link)
    out = _encode(mine)
    tag = _spec_tag(job, pending.sequence)
    others = [n for n in range(job.layout.nodes) if n != job.layout.node]
    sends = [link.endpoint.send(n, tag, out) for n in others]
    summaries = {job.layout.node: mine}
    pending.waiting_nodes = tuple(others)  # for `lpsync status` and the stall warning
    for i, n in enumerate(others):
        buf = np.zeros(_SUMMARY_BYTES, np.uint8)
        link.endpoint.recv_into(n, tag, buf, deadline)
        summaries[n] = json.loads(buf.tobytes().rstrip(b"\0"))
        pending.waiting_nodes = tuple(others[i + 1:])
    for request in sends:
        request.wait(deadline)
    failed = [n for n in sorted(summaries) if "error" in summaries[n]]
    if failed:
        code, message = summaries[failed[0]]["error"]
        raise _ERRORS.get(code, UnavailableError)(
            f"collective #{pending.sequence} of job {job.name!r} failed on another node: "
            f"{message}")
    nodes = sorted(summaries)
    specs = {n: summaries[n]["spec"] for n in nodes}
    fields = [f for f in _FIELDS if len({json.dumps(specs[n][f]) for n in nodes}) > 1]
    if fields:
        def who(n: int) -> str:
            lo, hi = summaries[n]["ranks"]
            return f"node {n} (ranks {lo}-{hi})"
        detail = "; ".join(f"{f}: " + ", ".join(f"{who(n)}={specs[n][f]!r}" for n in nodes)
                           for f in fields)
        raise MismatchError(f"collective #{pending.sequence} of job {job.name!r}: nodes "
                            f"disagree on {', '.join(fields)} ({detail})")
    alpha = max(summaries[n]["alpha"] for n in nodes)
    beta = max(summaries[n]["beta"] for n in nodes)
    return LinkModel(alpha=alpha, beta=beta, shared_nic=True)


def _run_pipeline(job: Job, pending: Pending, link: Link, model: LinkModel,
                  deadline: float, staged: Staged | None = None) -> tuple[str, int]:
    assert job.layout is not None
    spec, layout, p = pending.spec, job.layout, job.world_size
    op, dtype = Collective(spec.op), dtype_of(spec.dtype)
    arrivals = (staged.arrivals if staged is not None
                else [pending.arrivals[r] for r in job.local_ranks])
    buffers = [_buffers(op, a, p, spec.count) for a in arrivals]
    reduction = Reduction(ReduceOp(spec.reduce_op), dtype, p) if op in _REDUCING else None
    nbytes = nccl_bytes(op, spec.count, dtype.itemsize, p)
    if spec.algorithm:
        algorithm, chunks = spec.algorithm, chunks_for(spec.algorithm, p, nbytes, model, op=op)
    else:
        choice = select(op, nbytes, p, model)
        algorithm, chunks = choice.algorithm, choice.chunks
    if job.cache is None:
        job.cache = GroupCache()
    # The mesh generation is part of the key: a rebuilt mesh is another remote endpoint.
    key = (spec, algorithm, chunks, link.generation,
           tuple(arr.__array_interface__["data"][0] for pair in buffers for arr in pair),
           staged.mirrors.serial if staged is not None else 0,  # plans bound to these mirrors
           tuple(h for a in arrivals for h in a.handles))

    def build() -> LocalGroup:
        schedule = generate(op, algorithm, p, spec.count, spec.root, chunks)
        if schedule.tags.size and int(schedule.tags.max()) >= 1 << _STEP_BITS:
            raise InvalidArgumentError(f"{algorithm} {op} of {spec.count} elements needs more "
                                       f"than 2**{_STEP_BITS} messages per pair")
        placement = Placement.node_major([layout.ranks_per_node] * layout.nodes, layout.node)
        group = LocalGroup(schedule, buffers, reduction, placement, link.endpoint)
        if staged is not None:
            staged.attach(group)
        return group

    group = job.cache.get(key, build)
    timeout, tags = max(0.0, deadline - time.monotonic()), tag_base(job.name, pending.sequence)
    if staged is None:
        group.run(timeout, tags)
    else:
        staged.run(group, deadline, timeout, tags)
    return algorithm, chunks
