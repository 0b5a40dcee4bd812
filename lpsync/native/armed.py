"""One job's armed plans on this daemon: its doorbell page and its engine.

A single-node job's collective that ran on the direct path is armed here, and so is a
multi-node job's node program (across.py) once the nodes agreed to: its program goes to
the engine with its buffers' addresses, and the reply tells the clients (Armed{page,
plan, generation}); their identical later calls ring the page and the engine's own
thread runs the program and answers them, without Python. A multi-node job's page has a
slot per rank of the job, of which the engine serves this node's (``local``); its
channels (one socket per other node) are the engine's once handed over (``connect``).

What disarms (engine.c, the doorbell: waiting rings fall back, and the clients send their request the
general way, where the daemon answers with the errors of docs/reliability.md): a buffer
of the plan released (``forget``), a rank that leaves the job (``disarm_all``), the job's
end or the daemon's stop (``close``), a plan evicted for a newer one (MAX_PLANS per job,
and only one idle for IDLE_SECONDS: a step with more collectives than slots keeps the
first ones armed instead of evicting each for the next, every call a miss);
for plans with messages also a failed run and a failed collective (``drop_net``).
Invariant: a plan is disarmed before any of its buffers is unmapped; the engine's lock,
which a running program holds, makes ``disarm`` wait for that run.

Counters and the last records live in the engine; ``sync`` brings them into the
metrics and the flight recorder (at a scrape and at ``lpsync status``), never per call.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lpsync.memory.shm import SharedSegment
from lpsync.native import FALLBACK, OK
from lpsync.native import engine as native_engine
from lpsync.native.program import Program, encode

# (op, algorithm, dtype, nbytes, per-bucket counts, seconds, busbw factor): the metrics'
# series of collectives the engine ran (Metrics.collectives_done).
Record = Callable[[str, str, str, int, list[int], float, float], None]

IDLE_SECONDS = 10.0  # a plan not run for this long may give its slot to a new one
_SCAN_EVERY = 1.0  # seconds between looks for an idle plan while every slot is taken


@dataclass
class Plan:
    index: int
    generation: int
    spec: Any  # the Spec it runs (daemon.values), for the flight recorder
    views: list[np.ndarray]  # held: a released buffer stays mapped until the plan goes
    handles: tuple[tuple[str, int], ...]
    series: tuple[str, str, str, int, float]  # op, algorithm, dtype, nbytes, busbw factor
    reply: tuple[str, int, int]  # Armed{page, plan, generation}
    net: bool = False  # it has messages (a multi-node job's node program)
    seen: tuple[int, float, tuple[int, ...]] = field(default=(0, 0.0, ()))  # stats read so far
    last_calls: int = 0  # the engine's count of its runs when last looked at (_idle)
    last_busy: float = field(default_factory=time.monotonic)  # when that count last moved


class ArmedPlans:
    """Created by a job's first armed plan; closed with the job."""

    def __init__(
        self, slots: int, bounds: tuple[float, ...], record: Record, local: tuple[int, ...] | None = None
    ) -> None:
        module = native_engine()
        if module is None:
            raise RuntimeError("the native engine is not built")
        self._module = module
        size = -(-(module.HEADER_BYTES + module.SLOT_BYTES * slots) // 4096) * 4096
        self.page = SharedSegment.create(size)
        address = self.page.array.__array_interface__["data"][0]
        try:
            self.engine: Any = module.Engine(self.page.array, address, size, slots, bounds)
        except BaseException:
            self.page.close()
            self.page.unlink()
            raise
        self.slots = slots
        try:
            if local is not None:  # a multi-node job: the engine serves this node's ranks
                self.activate(local)
        except BaseException:
            self.engine.close()
            self.page.close()
            self.page.unlink()
            raise
        self.channels: set[int] = set()  # the other nodes the engine holds a socket to
        self._record = record
        self._lock = threading.Lock()
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()  # by plan key, oldest first
        self._free = list(range(module.MAX_PLANS))
        self._scanned = 0.0  # when _idle last looked (monotonic)
        self._answered = 0  # engine records already brought into the flight recorder
        self.closed = False

    def find(self, key: tuple) -> Plan | None:
        with self._lock:
            return self._plans.get(key)

    def arm(
        self,
        key: tuple,
        program: Program,
        views: list[np.ndarray],
        timeout: float,
        handles: tuple[tuple[str, int], ...],
        series: tuple[str, str, str, int, float],
        spec: Any = None,
        net_key: int = 0,
    ) -> Plan | None:
        """Arm ``program`` over ``views`` under ``key``; None where the engine does not
        serve it (an element type it lacks, an unaligned buffer: it stays on Python)."""
        encoded = encode(program, views)
        if encoded is None:
            return None
        data, bases, sizes = encoded
        # Where every slot is taken, a plan gone idle makes room (looked for outside the
        # lock: the engine's stats wait for a running program, and find() must not).
        idle = self._idle() if not self._free else None
        with self._lock:
            if self.closed:
                return None
            evicted = None
            if not self._free:
                if idle is None or self._plans.get(idle) is None:
                    return None  # every slot in use: this one stays on the general path
                evicted = self._plans.pop(idle)
                self._free.append(evicted.index)
            index = self._free.pop()
        if evicted is not None:
            self._retire(evicted)
        try:
            generation = self.engine.arm(index, data, bases, sizes, timeout, net_key)
        except ValueError:  # refused by the engine's checks: not armed
            with self._lock:
                self._free.append(index)
            return None
        plan = Plan(
            index, generation, spec, views, handles, series, (self.page.name, index, generation), net_key != 0
        )
        with self._lock:
            self._plans[key] = plan
        return plan

    def _idle(self) -> tuple | None:
        """The key of the oldest plan the engine has not run for IDLE_SECONDS; None where
        every plan is in use, or it looked less than _SCAN_EVERY ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._scanned < _SCAN_EVERY:
                return None
            self._scanned = now
            plans = list(self._plans.items())  # oldest first
        for key, plan in plans:
            calls = self.engine.stats(plan.index)[0]
            if calls != plan.last_calls:
                plan.last_calls, plan.last_busy = calls, now
            elif now - plan.last_busy >= IDLE_SECONDS:
                return key
        return None

    def run(self, plan: Plan) -> bool:
        """Run an armed plan for a general-path call (False: disarmed meanwhile)."""
        plan.last_busy = time.monotonic()  # in use (the engine counts rung runs only)
        return self.engine.run(plan.index, plan.generation) == OK

    def yield_seq(self, sequence: int) -> None:
        self.engine.yield_seq(sequence)

    def activate(self, local: Iterable[int]) -> None:
        """The slots the engine serves: this node's ranks of the job."""
        mine = set(local)
        self.engine.activate(bytes(1 if slot in mine else 0 for slot in range(self.slots)))

    # -- plans with messages (a multi-node job) -----------------------------------------------
    def connect(self, node: int, sock: Any) -> None:
        """Hand the socket to ``node`` to the engine: it holds the only descriptor from then
        on, so that one it closes (a failed run) is closed for the peer too."""
        with sock:
            self.engine.connect(node, sock.fileno())
        with self._lock:
            self.channels.add(node)

    def notice(self, sequence: int, node: int) -> None:
        """This node (``node`` of the job) runs ``sequence`` on the general path: armed
        peers fall back at once (a NOTICE to the GO round's root, node 0; its to all)."""
        if self.channels:
            self.engine.notice(sequence & 0xFFFFFFFF, -1 if node == 0 else 0)

    def abort_net(self) -> None:
        """The peers are lost: a run waiting on them ends now (LOST), and the channels and
        plans with messages go."""
        if self.channels:
            self.engine.abort()  # never blocks: the run holds the lock drop_net takes
            self.drop_net()

    def drop_net(self) -> None:
        """A collective failed: every channel closed, every plan with messages disarmed."""
        with self._lock:
            self.channels.clear()
            stale = [k for k, plan in self._plans.items() if plan.net]
            plans = [self._plans.pop(k) for k in stale]
        for plan in plans:
            self._drain(plan)
        self.engine.drop_net()
        with self._lock:
            self._free.extend(plan.index for plan in plans)

    def failure(self, sequence: int) -> tuple[int, int] | None:
        """(code, node) where the engine's run of ``sequence`` failed (not a fallback)."""
        _, _, records = self.engine.records()
        for seq, _, code, *_ in reversed(records):
            if seq == sequence & 0xFFFFFFFF and code not in (OK, FALLBACK):
                return code, self.engine.failed_channel()
        return None

    def forget(self, session_id: str, handle: int) -> None:
        """A buffer was released: disarm the plans over it, before it is unmapped."""
        with self._lock:
            stale = [k for k, plan in self._plans.items() if (session_id, handle) in plan.handles]
            plans = [self._plans.pop(k) for k in stale]
        for plan in plans:
            self._retire(plan)
            with self._lock:
                self._free.append(plan.index)

    def disarm_all(self) -> None:
        """Membership changed: every plan of the job goes."""
        with self._lock:
            plans = list(self._plans.values())
            self._plans.clear()
        for plan in plans:
            self._retire(plan)
            with self._lock:
                self._free.append(plan.index)

    def _retire(self, plan: Plan) -> None:
        self._drain(plan)
        self.engine.disarm(plan.index)  # waits for a run of it: its buffers may go next
        self._drain(plan)

    def sync(self) -> list[tuple[int, Any, str, int, float, float, float]]:
        """Bring the engine's counts into the metrics; the collectives it answered since the
        last sync: (seq, spec, algorithm, code, first arrival, last arrival, done),
        monotonic seconds; spec None where the plan went meanwhile."""
        with self._lock:
            plans = list(self._plans.values())
        by_index = {plan.index: plan for plan in plans}
        for plan in plans:
            self._drain(plan)
        total, _, records = self.engine.records()
        new = min(total - self._answered, len(records))
        self._answered = total
        out = []
        for seq, index, code, first, last, done in records[len(records) - new :]:
            found = by_index.get(index)
            spec, algorithm = (found.spec, found.series[1]) if found is not None else (None, "")
            out.append((seq, spec, algorithm, code, first, last, done))
        return out

    def _drain(self, plan: Plan) -> None:
        calls, seconds, buckets = self.engine.stats(plan.index)
        seen_calls, seen_seconds, seen_buckets = plan.seen
        if calls < seen_calls:  # re-armed meanwhile: counted from zero again
            seen_calls, seen_seconds, seen_buckets = 0, 0.0, ()
        if calls == seen_calls:
            return
        counts = [b - (seen_buckets[i] if seen_buckets else 0) for i, b in enumerate(buckets)]
        plan.seen = (calls, seconds, tuple(buckets))
        op, algorithm, dtype, nbytes, factor = plan.series
        self._record(op, algorithm, dtype, nbytes, counts, seconds - seen_seconds, factor)

    def armed(self) -> int:
        """How many plans are armed now."""
        with self._lock:
            return len(self._plans)

    def stats(self) -> tuple[int, int]:
        """(collectives the engine answered, of them fallen back to the general path)."""
        total, fallbacks, _ = self.engine.records()
        return total, fallbacks

    def close(self) -> None:
        """Every waiting ring falls back; the engine's thread ends; the page goes."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            plans = list(self._plans.values())
            self._plans.clear()
        for plan in plans:
            self._drain(plan)
        self.engine.close()
        self.page.close()
        self.page.unlink()


def monotonic_to_wall(t: float) -> float:
    """A CLOCK_MONOTONIC reading as unix time."""
    return time.time() - (time.monotonic() - t)
