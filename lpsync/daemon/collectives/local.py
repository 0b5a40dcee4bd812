"""The single-node runners' work (runners.py chooses among them): direct, host, device.

Chosen per collective and identical on every participant:
  * direct: host buffers up to DIRECT_MAX_BYTES, one participant, a barrier, or
    ``algorithm="direct"``: the flat program of lpsync/native/program.py, run with numpy,
    then armed for the native engine where the job runs natively; where it does, at every
    size the engine serves (its tiles and threads beat the host pipeline there), and
    above DIRECT_MAX_BYTES the engine runs the first call too;
  * a host pipeline: the tuner picks an algorithm and chunk count for local memory (or
    ``algorithm=`` forces one) and the engine's LocalGroup runs the schedule with one
    thread per participant over the zero-copy inproc transport; where the job runs
    natively (then only a forced algorithm comes here), up to SCHEDULE_NATIVE_MAX_BYTES,
    the schedule is then compiled into one program (native/across.py, every participant
    on this node) and armed: its repeats ring the engine, in the schedule's own order of
    reduction;
  * device spans: an allreduce up to ONESHOT_MAX_BYTES as one kernel per device (the
    tuner's device rule, lpsync.algorithms.oneshot; OneShot), else the chain over the
    node's devices ordered by topology, run on the job's own streams (DeviceGroup);
    either after each client's ready event, which those streams wait on, and answered
    once enqueued (stream-ordered: the reply carries a done event) or once finished.
Plans are built once per key (plans.plan_key: spec, schedule, buffers) and reused.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from lpsync.algorithms import LinkModel, generate, select
from lpsync.algorithms.chain_order import chain_order
from lpsync.algorithms.oneshot import ONESHOT, select_device
from lpsync.algorithms.registry import DIRECT
from lpsync.algorithms.tuner import chunks_for
from lpsync.daemon.collectives.plans import plan_key
from lpsync.daemon.collectives.task import Task
from lpsync.daemon.collectives.views import REDUCING, buffers, facts, nccl_bytes, reduction
from lpsync.daemon.device_registry import DeviceRegistry
from lpsync.daemon.values import Arrival, Outcome, Spec
from lpsync.engine import oneshot
from lpsync.engine.device_group import DeviceContext, DeviceGroup, Lanes, StreamPlan
from lpsync.engine.group import LocalGroup
from lpsync.engine.oneshot import OneShot, Refused
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Topology
from lpsync.native import across, program
from lpsync.native.program import MAX_OPS, Program
from lpsync.types import BLOCKED, REDUCE_OP_OF, Collective, dtype_of

if TYPE_CHECKING:
    import numpy as np

    from lpsync.algorithms.schedule import Schedule
    from lpsync.memory.kind import Span
    from lpsync.native.armed import Plan
    from lpsync.reduction import Reduction

# Measured (docs/benchmarks.md, 4 ranks on 2 cores): numpy's one thread reducing every
# view beats the thread-per-participant schedules up to 2 MiB; be/lp win from 4 MiB on.
# Where the job runs natively, the engine's tiled, threaded run of the same program wins
# at every size (docs/architecture.md, "The native steady-state path"): no cap there.
DIRECT_MAX_BYTES = 2 * 1024 * 1024
_BARRIER = Program(None, 1, 0)  # every participant arrived: nothing to move

# A host pipeline's schedule is armed up to this size (measured, docs/architecture.md,
# "Forced algorithms"): the compiled program stages each message in its scratch (a second
# pass over memory, and a scratch as large as the messages) where the LocalGroup's threads
# hand spans over without a copy; at 1-16 MiB the engine was at par or faster (its tiles
# and threads, no thread hand-offs), at 64 MiB 1.1-1.8x slower.
SCHEDULE_NATIVE_MAX_BYTES = 16 * 1024 * 1024

# Local memory as the tuner sees it: a thread hand-off per message, memcpy bandwidth,
# and a link of its own between every pair of participants (no shared NIC).
LOCAL_LINK = LinkModel.from_bandwidth(alpha=30e-6, bandwidth=8e9, shared_nic=False)
# Device memory as the tuner sees it: a step's host-side cost (its copies and kernels
# enqueued from Python, its events recorded) and an NVLink-class copy; every pair of
# devices has links of its own. alpha is fitted to the H200 run (docs/benchmarks.md,
# "GPU"): 100-130 us per pipeline stage, where the 10 us of a bare launch had the tuner
# slice a 32 MiB allreduce into 96 ring steps (10.8 ms, against ~2 ms for be's 4).
DEVICE_LINK = LinkModel.from_bandwidth(alpha=100e-6, bandwidth=100e9, shared_nic=False)
# The one-shot allreduce (one kernel per device, lpsync.engine.oneshot) is chosen on this
# model (lpsync.algorithms.oneshot: one alpha and P-1 inputs pulled, against the chain's
# alphas per step) up to this cap: at 256 KiB the data takes ~2.6 us at DEVICE_LINK's
# 100 GB/s, noise beside any step's alpha, while above it the kernel's (P-1)n pull
# through one port starts to cost what a ring's 2(P-1)/P n spreads; where between the
# cap and the model's own crossover (megabytes at this alpha) it stops winning is for a
# GPU run to measure (docs/gpu.md). Never yet run on a GPU.
ONESHOT_MAX_BYTES = 256 * 1024


def is_direct(spec: Spec, participants: int, native: Callable[[], bool] | None = None) -> bool:
    """Whether ``run`` takes the direct path for this spec (decided the same way there):
    up to DIRECT_MAX_BYTES, and at every size where the engine serves the program's
    element type and reduction and the job runs natively (``native()``, asked only then:
    it makes the job's engine)."""
    if spec.op == Collective.BARRIER or spec.algorithm == DIRECT:
        return True
    if spec.algorithm:
        return False
    itemsize = dtype_of(spec.dtype).itemsize
    if participants == 1 or nccl_bytes(spec.op, spec.count, itemsize, participants) <= DIRECT_MAX_BYTES:
        return True
    reducing = REDUCE_OP_OF[spec.reduce_op] if spec.op in REDUCING else None
    return native is not None and program.served(spec.dtype, reducing) and native()


def runs_natively(task: Task) -> Callable[[], bool]:
    """Whether the task's job has an engine (made at its first use where it may), asked
    when called."""
    return lambda: task.job.native_plans() is not None


def is_inline(spec: Spec, participants: int) -> bool:
    """Whether the event loop may run this collective itself: the direct path and small
    (``algorithm="direct"`` on a big buffer is direct but long: it goes to a worker)."""
    if spec.op == Collective.BARRIER:
        return True
    if not is_direct(spec, participants):
        return False
    return nccl_bytes(spec.op, spec.count, dtype_of(spec.dtype).itemsize, participants) <= DIRECT_MAX_BYTES


def direct_key(task: Task) -> tuple:
    """The plan key of a direct-path collective (plans.key: buffers by address)."""
    return plan_key(task.spec, (DIRECT, 1), task.arrivals)


def direct_program(task: Task) -> tuple[Program, list[np.ndarray]]:
    """The direct path's flat program for ``task`` (built once per plan key) and the
    views it runs over, in buffer-number order."""
    spec, p = task.spec, task.participants
    if task.op is Collective.BARRIER:
        return _BARRIER, []
    pairs = cast("list[tuple[np.ndarray, np.ndarray]]", [buffers(spec, a, p) for a in task.arrivals])

    def build() -> Program:
        return program.direct(task.op, spec.root, pairs, reduction(spec, task.dtype, p), spec.count)

    return task.job.plans.get(direct_key(task), build), program.flatten(pairs)


@dataclass(frozen=True)
class Route:
    """How a single-node collective on host buffers runs: the direct program, or a host
    pipeline's schedule (the tuner's, or the one the client forces), and the key its plan
    (and its armed plan, where the job runs natively) is found under."""

    direct: bool
    algorithm: str
    chunks: int
    key: tuple


def route(task: Task) -> Route:
    """``task``'s Route, decided the same way wherever it is asked (runners.choose, the
    native runner, the host pipeline)."""
    if is_direct(task.spec, task.participants, runs_natively(task)):
        return Route(True, DIRECT, 1, direct_key(task))
    algorithm = task.spec.algorithm
    if algorithm:
        chunks = chunks_for(algorithm, task.participants, task.nbytes, LOCAL_LINK, op=task.op)
    else:
        choice = select(task.op, task.nbytes, task.participants, LOCAL_LINK)
        algorithm, chunks = choice.algorithm, choice.chunks
    return Route(False, algorithm, chunks, plan_key(task.spec, (algorithm, chunks), task.arrivals))


def direct(task: Task) -> Outcome:
    """The direct path: its program run, then armed where the job runs natively, so that
    its identical later calls ring the engine (the reply tells the clients). Above
    DIRECT_MAX_BYTES it is armed first and the engine runs this call too: numpy's one
    thread is the slowest way to run a big one; numpy runs what the engine does not."""
    compiled, views = direct_program(task)
    plan = None
    if task.nbytes > DIRECT_MAX_BYTES:
        plan = arm(task, compiled, views)
        native = task.job.native
        if plan is not None and (native is None or not native.run(plan)):
            plan = None  # disarmed meanwhile (a buffer released): numpy runs it, then it arms again
    if plan is None:
        compiled.run(views)
        plan = arm(task, compiled, views)
    return Outcome(algorithm=DIRECT, chunks=1, seconds=task.elapsed(), armed=plan.reply if plan else None)


def arm(task: Task, compiled: Program, views: list[np.ndarray]) -> Plan | None:
    """``compiled`` armed (or found armed) in the job's engine; None where the job does not
    run natively or the engine does not take it. At any size: the engine runs a big one
    tiled and on threads (a disarm waits for a run of it, milliseconds at 256 MiB)."""
    return _arm(task, direct_key(task), DIRECT, lambda: compiled, views)


def _arm(
    task: Task, key: tuple, algorithm: str, compiled: Callable[[], Program | None], views: list[np.ndarray]
) -> Plan | None:
    """The plan armed under ``key`` in the job's engine, armed now (``compiled()``: its
    program, None where there is none) where it is not yet; None where the job does not
    run natively or the engine does not take it."""
    native = task.job.native_plans()
    if native is None:
        return None
    armed = native.find(key)
    if armed is None:
        built = compiled()
        if built is None:
            return None
        _, _, nbytes, bus = facts(task.spec, task.participants)
        series = (task.spec.op, algorithm, task.spec.dtype, nbytes, bus)
        handles = tuple(h for a in task.arrivals for h in a.handles)
        armed = native.arm(key, built, views, task.timeout, handles, series, task.spec)
    return armed


def on_host(task: Task) -> tuple[str, int, Plan | None]:
    """A host pipeline: the tuner's (or the forced) schedule on a LocalGroup; then, where
    the job runs natively and up to SCHEDULE_NATIVE_MAX_BYTES, that schedule compiled into
    one program (native/across.py, its participants all on this node) and armed, so that
    its identical later calls ring the engine: a forced algorithm keeps its own order of
    reduction, bit for bit."""
    spec, op, p = task.spec, task.op, task.participants
    views = cast("list[tuple[np.ndarray, np.ndarray]]", [buffers(spec, a, p) for a in task.arrivals])  # host
    chosen = route(task)
    algorithm, chunks = chosen.algorithm, chosen.chunks

    def build() -> LocalGroup:
        schedule = generate(op, algorithm, p, spec.count, spec.root, chunks)
        return LocalGroup(schedule, views, reduction(spec, task.dtype, p))

    group = task.job.plans.get(chosen.key, build)
    group.run(task.timeout)

    def compiled() -> Program | None:
        """The schedule as one program, built once per key (None: too long for the engine)."""
        return task.job.plans.get(
            plan_key(spec, (algorithm, chunks, "program"), task.arrivals),
            lambda: schedule_program(group.schedule, views, reduction(spec, task.dtype, p)),
        ).program

    if task.nbytes > SCHEDULE_NATIVE_MAX_BYTES:
        return algorithm, chunks, None
    return algorithm, chunks, _arm(task, chosen.key, algorithm, compiled, program.flatten(views))


@dataclass
class _Compiled:
    """A schedule's program (None: none) as the plan cache holds it (it closes what it evicts)."""

    program: Program | None

    def close(self, wait: bool = True) -> None:
        """Nothing to free."""


def schedule_program(
    schedule: Schedule, pairs: list[tuple[np.ndarray, np.ndarray]], reducing: Reduction | None
) -> _Compiled:
    """A single-node schedule compiled as one node's part (native/across.py: its walk
    orders the participants' rows so that every receive follows its send, each message
    staged in the scratch at its send); None where the engine cannot hold its ops."""
    if schedule.num_ops > MAX_OPS:
        return _Compiled(None)
    node = across.compile_node(schedule, (0,) * schedule.participants, 0, pairs, reducing)
    return _Compiled(node.program if node is not None else None)


def on_devices(task: Task, devices: DeviceRegistry) -> tuple[str, int]:
    """A collective over device spans: the one-shot allreduce where the tuner picks it and
    the buffers allow it, else the chain ordered by topology; run on streams."""
    spec, op, p = task.spec, task.op, task.participants
    views = cast("list[tuple[Span, Span]]", [buffers(spec, a, p) for a in task.arrivals])  # on_device
    if device_oneshot(spec.algorithm, op, p, task.nbytes, DEVICE_LINK):

        def build_oneshot() -> OneShot | Refused:
            reducing = reduction(spec, task.dtype, p)
            assert reducing is not None  # an allreduce
            return oneshot.plan(devices.context, views, reducing, lambda: _lanes(task, devices))

        # Buffers that refuse it (kind.oneshot_refusal) are remembered as such per key.
        found = task.job.plans.get(plan_key(spec, (ONESHOT, 1, "device"), task.arrivals), build_oneshot)
        if isinstance(found, OneShot):
            _run_on_devices(task, devices, found, views, list(range(p)))
            return ONESHOT, 1
    algorithm, chunks = device_schedule(op, spec.algorithm, p, task.nbytes, DEVICE_LINK)
    order = device_chain(op, spec.root, [inp.device for inp, _ in views], devices.context.topology)

    def build() -> DeviceGroup:
        schedule = generate(op, algorithm, p, spec.count, order.index(spec.root), chunks)
        return DeviceGroup(
            devices.context,
            schedule,
            [views[r] for r in order],
            reduction(spec, task.dtype, p),
            lanes=_lanes(task, devices),
        )

    group = task.job.plans.get(plan_key(spec, (algorithm, chunks, "device"), task.arrivals), build)
    _run_on_devices(task, devices, group, views, order)
    return algorithm, chunks


def _lanes(task: Task, devices: DeviceRegistry) -> Lanes:
    """The job's own streams for a plan (a client that never reaches its ready event
    holds only its job's streams)."""
    return Lanes(devices.context, (task.job.name,))


def _run_on_devices(
    task: Task, devices: DeviceRegistry, plan: StreamPlan, views: list[tuple[Span, Span]], order: list[int]
) -> None:
    """Launch ``plan`` (in ``order``: the plan's participants) on the job's own streams;
    the clients' mappings stay open until it finished there. Stream-ordered (issue 47,
    item 1) where every participant asked for it and got a done event: the streams wait
    for the clients' ready events (cudaStreamWaitEvent), and it is answered at once, each
    reply carrying its done event; an error found later fails the job's next device
    collective. Else the ready events are polled first and it is answered once finished
    (its error, or its timeout, in the reply)."""
    context, owner = devices.context, (task.job.name,)
    earlier = context.take_failure(owner)
    if earlier is not None:
        raise type(earlier)(
            f"an earlier device collective of this job failed after it was answered: {earlier}"
        )
    arrivals = [task.arrivals[r] for r in order]
    deadline = time.monotonic() + task.timeout
    busy = devices.use([span.memory for pair in views for span in pair])
    done = _done_events(context, arrivals, views, order)
    ordered = all(d is not None for d in done) and devices.stream_ordered(busy)
    if not ordered:  # not asked by all, or a buffer released meanwhile: answered once closed
        _give_done(context, arrivals, done)
        done = [None] * len(arrivals)
    try:
        ready = [a.ready for a in arrivals]
        if not ordered:
            # Answered once finished: the ready events are polled first (the job's thread),
            # so one never reached in time fails the collective before anything is queued.
            for event in ready:
                if event is not None:
                    context.kind.wait_ready(event, deadline)
            ready = []
        events = [(i, d[0]) for i, d in enumerate(done) if d is not None]
        launch = plan.launch(owner, deadline, ready, events)
    except BaseException:
        _give_done(context, arrivals, done)
        devices.done(busy, ordered)
        raise

    def settled(error: object) -> None:
        _give_done(context, arrivals, done)
        devices.done(busy, ordered)  # never before the streams let go of the clients' memory

    launch.then(settled)
    if ordered:
        for arrival, (_, handle) in zip(arrivals, cast("list[tuple[object, bytes]]", done), strict=True):
            arrival.done = _with_done_event(arrival.done, handle)
        launch.answered()
        return
    launch.wait(deadline)


def _done_events(
    context: DeviceContext, arrivals: list[Arrival], views: list[tuple[Span, Span]], order: list[int]
) -> list[tuple[object, bytes] | None]:
    """A done event per participant (plan order) where every one asked for stream order
    (its output on its input's device: its stream waits on it there); else none at all
    (the host waits, and answers once finished)."""
    wanted = all(
        a.stream_ordered and views[r][0].device == views[r][1].device
        for a, r in zip(arrivals, order, strict=True)
    )
    if not wanted:
        return [None] * len(arrivals)
    done: list[tuple[object, bytes] | None] = []
    for arrival, r in zip(arrivals, order, strict=True):
        entry = context.done_events.take(arrival.handles[0][0], views[r][0].device)
        if entry is None:  # the session has DONE_EVENTS out: this one waits on the host
            _give_done(context, arrivals, done)
            return [None] * len(arrivals)
        done.append(entry)
    return done


def _give_done(context: DeviceContext, arrivals: list[Arrival], done: list) -> None:
    for arrival, entry in zip(arrivals, done, strict=False):
        if entry is not None:
            context.done_events.give(arrival.handles[0][0], entry[0].device, entry)


def _with_done_event(reply: Callable[[Outcome], None], handle: bytes) -> Callable[[Outcome], None]:
    """The reply with the done event's handle, where it succeeded (enqueued)."""

    def answer(outcome: Outcome) -> None:
        reply(outcome if outcome.error is not None else dataclasses.replace(outcome, done_event=handle))

    return answer


def device_oneshot(forced: str, op: Collective, participants: int, nbytes: int, model: LinkModel) -> bool:
    """Whether the tuner gives this device collective to the one-shot allreduce (never a
    forced one: the clients' algorithm= names schedules); the buffers may still refuse."""
    if forced:
        return False
    return select_device(op, nbytes, participants, model, ONESHOT_MAX_BYTES).algorithm == ONESHOT


def device_schedule(
    op: Collective, forced: str, participants: int, nbytes: int, model: LinkModel
) -> tuple[str, int]:
    """(algorithm, chunks) of a collective on device buffers: the forced one, else the
    tuner's pick for ``model``; never direct (a host-buffer path)."""
    if forced == DIRECT:
        raise InvalidArgumentError(
            "algorithm='direct' serves host buffers; device buffers run lp, ring, mst, be "
            "or the tuner's choice"
        )
    if forced:
        return forced, chunks_for(forced, participants, nbytes, model, op=op)
    choice = select(op, nbytes, participants, model)
    return choice.algorithm, choice.chunks


def device_chain(op: Collective, root: int, devices: list[int], topology: Topology) -> list[int]:
    """Ranks in schedule order: for broadcast, reduce and allreduce the chain over the
    devices with the fewest slow crossings (a broadcast's root heads it, a reduce's root
    ends it); the blocked collectives keep rank order (their blocks are rank-indexed)."""
    if op in BLOCKED:
        return list(range(len(devices)))
    links = [[int(x) for x in row] for row in topology.links]
    return chain_order(
        devices,
        links,
        first=root if op is Collective.BROADCAST else None,
        last=root if op is Collective.REDUCE else None,
    )
