"""The "run" stage: one table of runners, chosen per (task, verdict).

Every runner has one signature, ``(task, context) -> Outcome``; ``choose`` names the row
and nothing else learns which rows exist. Single node (no verdict):
  native     the collective's plan is armed (the direct program's, or a host pipeline's
             schedule compiled): the engine runs it (lpsync/native)
  direct     host buffers up to DIRECT_MAX_BYTES (at every size where the job runs
             natively and the engine serves the type), one participant, a barrier, or
             algorithm="direct": the flat program (native/program.py) run with numpy
             (above DIRECT_MAX_BYTES by the engine), then armed
  host       a host pipeline: the tuner's (or the forced) schedule on the engine's
             LocalGroup, then armed where the job runs natively
  device     the chain over the node's devices, on streams
Across nodes, after the verdict (path.py agreed it):
  packed     every node on devices, a blocked op: packed segments (packed.py)
  hierarchy  every node on devices: device chain, bounded host ring, peers (hierarchy.py)
  pipeline   host buffers or mirrors: one chunk pipeline over the nodes (planning.py)
Identical calls of an armed plan never reach this table: the clients ring the engine's
doorbell (docs/architecture.md, "The native steady-state path"); across nodes, a
pipeline run on host buffers arms its node's part of the plan (native_across.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lpsync.daemon.collectives import hierarchy as hierarchical
from lpsync.daemon.collectives import local, native_across, packed, planning
from lpsync.daemon.collectives.staging import stage
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Outcome
from lpsync.errors import InvalidArgumentError

if TYPE_CHECKING:
    from lpsync.daemon.collectives.agreement import Verdict
    from lpsync.daemon.collectives.learning import Learner
    from lpsync.daemon.peers.plane import Link, PeerPlane


@dataclass(frozen=True)
class Context:
    """What a runner may need beyond the Task: the node's devices and, across nodes, the
    mesh link, the verdict, the deadline and the collective's message tags."""

    devices: DeviceRegistry | None
    link: Link | None = None
    verdict: Verdict | None = None
    learner: Learner | None = None
    deadline: float = 0.0
    tags: int = 0
    plane: PeerPlane | None = None  # across nodes: where armed plans' channels come from


Runner = Callable[[Task, Context], Outcome]


def choose(task: Task, context: Context) -> str:
    """The row of the table that runs ``task``."""
    if context.verdict is not None:
        return across(task, context.verdict)
    if task.on_device:
        return "device"
    route = local.route(task)
    native = task.job.native
    if native is not None and native.find(route.key):
        return "native"
    return "direct" if route.direct else "host"


def across(task: Task, verdict: Verdict) -> str:
    """The row that runs ``task`` across nodes, by the verdict every node reached."""
    if verdict.segment:  # every node's participants are on devices: bounded staging
        return "packed" if task.op in packed.PACKED else "hierarchy"
    return "pipeline"


def run(task: Task, context: Context) -> Outcome:
    return RUNNERS[choose(task, context)](task, context)


def run_across(task: Task, context: Context) -> Outcome:
    """``run`` where the path is across nodes (path.py): only the rows after a verdict."""
    assert context.verdict is not None
    return RUNNERS[across(task, context.verdict)](task, context)


def _direct(task: Task, context: Context) -> Outcome:
    return local.direct(task)


def _native(task: Task, context: Context) -> Outcome:
    """A general-path call of an armed plan (a fallback, an async call): the engine runs
    it on this thread; disarmed meanwhile, the direct path or the host pipeline does."""
    route = local.route(task)
    native = task.job.native
    plan = native.find(route.key) if native is not None else None
    if native is None or plan is None or not native.run(plan):
        return _direct(task, context) if route.direct else _host(task, context)
    return Outcome(algorithm=route.algorithm, chunks=route.chunks, seconds=task.elapsed(), armed=plan.reply)


def _host(task: Task, context: Context) -> Outcome:
    algorithm, chunks, plan = local.on_host(task)
    armed = plan.reply if plan is not None else None
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=task.elapsed(), armed=armed)


def _device(task: Task, context: Context) -> Outcome:
    if context.devices is None:
        raise InvalidArgumentError("this daemon serves no devices (--devices)")
    algorithm, chunks = local.on_devices(task, context.devices)
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=task.elapsed())


def _packed(task: Task, context: Context) -> Outcome:
    assert context.link is not None and context.verdict is not None and context.devices is not None
    algorithm, chunks = packed.run(
        task, context.link, context.devices, context.verdict, context.deadline, context.tags
    )
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=task.elapsed())


def _hierarchy(task: Task, context: Context) -> Outcome:
    assert context.link is not None and context.verdict is not None and context.devices is not None
    algorithm, chunks = hierarchical.run(
        task, context.link, context.devices, context.verdict, context.deadline, context.tags
    )
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=task.elapsed())


def _pipeline(task: Task, context: Context) -> Outcome:
    """Host buffers (or host mirrors of device spans) in one chunk pipeline over the nodes."""
    link, verdict = context.link, context.verdict
    assert link is not None and verdict is not None
    algorithm, chunks = planning.choose(task, verdict.model, verdict.use)
    staged = stage(task, context.devices) if context.devices is not None else None
    group = planning.bind(task, link, algorithm, chunks, staged)
    began = time.perf_counter()
    timeout = max(0.0, context.deadline - time.monotonic())
    if staged is None:
        group.run(timeout, context.tags)
    else:
        staged.run(group, context.deadline, timeout, context.tags)
    if verdict.trial and context.learner is not None:
        context.learner.ran(task.pending.sequence, time.perf_counter() - began)
    armed = None
    if staged is None and context.plane is not None:  # host buffers: it may run armed next
        armed = native_across.after_run(task, context.plane, verdict, group.schedule, algorithm, chunks)
    return Outcome(algorithm=algorithm, chunks=chunks, seconds=task.elapsed(), armed=armed)


RUNNERS: dict[str, Runner] = {
    "native": _native,
    "direct": _direct,
    "host": _host,
    "device": _device,
    "packed": _packed,
    "hierarchy": _hierarchy,
    "pipeline": _pipeline,
}
