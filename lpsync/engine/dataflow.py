"""A plan's program run as data flow on a transport with channels: each step goes as
soon as what it depends on is done, on the thread that finished that (the TCP backend's
connection threads: lpsync.transport.mesh.Channel).

Why: the sequential run (executor.py) wakes the collective's thread for every message
it waits for, and every message crosses the Endpoint's wrappers. Here a ring's slice is
reduced and sent on by the reader that received it, a pipeline's chunk is forwarded by
it, and the collective's thread sleeps from its first sends to the end.

Dependencies (Flow, worked out once per plan) are those of program order, per span:
  * a send waits for the step that last wrote its span;
  * a write (receive, reduce, copy) waits for the step that last wrote its span and for
    every step that read it since (a send in flight reads it in place);
  * a reduce or copy also waits for the last write of its source span.
A receive into the buffers is posted once its write may go; a receive to reduce lands in
a staging slot and its reduce waits. Receives are posted in program order, at most
``window`` at once. It applies where every span written is equal to or apart from every
span accessed (chunk-aligned, as the schedules of lpsync.algorithms are): a dictionary
per span then holds the dependencies.

Threads: every completion is queued and one thread at a time works the queue (the one
that found it idle), so the run's state needs no lock beyond the queue's, and a deep
chain of completions is a loop, not a recursion.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lpsync.algorithms.schedule import Kind
from lpsync.errors import CollectiveTimeoutError, InvalidArgumentError
from lpsync.reduction import Reduction
from lpsync.transport.mesh import Channel

_SEND, _RECV, _RECV_REDUCE, _COPY = (int(k) for k in Kind)


class Step(Protocol):
    """What the executor's plan steps offer (executor._Step)."""

    kind: int
    peer: int
    tag: int
    dst: np.ndarray
    lo: int
    hi: int
    src: np.ndarray | None
    final: bool
    src_lo: int
    src_hi: int


@dataclass(frozen=True)
class Flow:
    """Which steps each step waits for (counts and reverse edges), and each step's bytes."""

    waits: tuple[int, ...]
    then: tuple[tuple[int, ...], ...]  # per step: the steps waiting for it
    receives: tuple[int, ...]  # the receive steps, in program order
    # Sends nothing waits for: no callback; the collective's thread checks them at the end.
    quiet: tuple[int, ...]
    peers: tuple[int, ...]
    raw: tuple[np.ndarray, ...]  # per step: dst as bytes (what a send or receive moves)

    @classmethod
    def of(cls, steps: Sequence[Step]) -> Flow | None:
        """The flow of host ``steps``, or None where a span written overlaps another span
        without being equal to it."""
        if not _aligned(steps):
            return None
        writer: dict[tuple[int, int], int] = {}
        readers: dict[tuple[int, int], list[int]] = {}
        then: list[list[int]] = [[] for _ in steps]
        waits = []
        for i, s in enumerate(steps):
            span = (s.lo, s.hi)
            need = {writer[span]} if span in writer else set()
            if s.kind == _SEND:
                readers.setdefault(span, []).append(i)
            else:
                need.update(readers.pop(span, ()))
                if s.kind != _RECV:
                    source = (s.src_lo, s.src_hi)
                    if source in writer:
                        need.add(writer[source])
                    if source != span:
                        readers.setdefault(source, []).append(i)
                writer[span] = i
            need.discard(i)
            for j in need:
                then[j].append(i)
            waits.append(len(need))
        return cls(
            waits=tuple(waits),
            then=tuple(tuple(t) for t in then),
            receives=tuple(i for i, s in enumerate(steps) if s.kind in (_RECV, _RECV_REDUCE)),
            quiet=tuple(i for i, s in enumerate(steps) if s.kind == _SEND and not then[i]),
            peers=tuple(sorted({s.peer for s in steps if s.kind != _COPY})),
            raw=tuple(s.dst.reshape(-1).view(np.uint8) for s in steps),
        )


def _aligned(steps: Sequence[Step]) -> bool:
    """Whether every span written is equal to or apart from every span accessed (spans
    only read may overlap: reads do not order each other)."""
    spans = {(s.lo, s.hi) for s in steps}
    spans.update((s.src_lo, s.src_hi) for s in steps if s.kind in (_RECV_REDUCE, _COPY))
    ordered = sorted(span for span in spans if span[0] < span[1])
    los = [lo for lo, _ in ordered]
    reach = list(itertools.accumulate((hi for _, hi in ordered), max, initial=0))  # max end before i
    for s in steps:
        if s.kind == _SEND or s.lo == s.hi:
            continue
        first, last = bisect.bisect_left(los, s.lo), bisect.bisect_left(los, s.hi)
        if reach[first] > s.lo or last - first != 1:  # one before reaches in, or others start inside
            return False
    return True


class Run:
    """One run of a flow: ``start`` on the collective's thread, then ``wait`` there."""

    def __init__(
        self,
        steps: Sequence[Step],
        flow: Flow,
        channels: dict[int, Channel],
        tag_base: int,
        slots: Sequence[np.ndarray],
        reduction: Reduction | None,
        rank: int,
        deadline: float,
        window: int,
        abort: Callable[[BaseException], None],
    ) -> None:
        self._steps, self._flow, self._channels = steps, flow, channels
        self._slots, self._reduction, self._rank = slots, reduction, rank
        self._deadline, self._window, self._abort = deadline, window, abort
        self._tags = [tag_base + s.tag for s in steps]
        self._waits = list(flow.waits)  # per step: the steps it still waits for
        self._landed = bytearray(len(steps))  # a receive to reduce: its message is in its slot
        self._finished_steps = bytearray(len(steps))
        self._slot = [-1] * len(steps)
        self._free = list(range(len(slots)))
        self._requests: list[Any] = [None] * len(steps)
        self._next_receive = 0  # index into flow.receives: the next to post
        self._posted = 0  # receives posted and not landed
        self._left = len(steps) - len(flow.quiet)  # steps whose end is reported
        self._failed: tuple[int, BaseException] | None = None
        self._queue: deque[tuple[Callable[[int, Any], None], int, Any]] = deque()
        self._lock = threading.Lock()
        self._working = True  # start() works the queue first
        self._idle = threading.Condition(self._lock)
        self._finished = threading.Event()

    def start(self) -> None:
        """Start every step that waits for nothing, and post the first receives."""
        self._queue.extend((self._ready, i, None) for i, n in enumerate(self._waits) if n == 0)
        self._queue.append((self._post_receives, -1, None))
        self._work()

    def wait(self) -> None:
        """Until every step is done; raises what failed, or CollectiveTimeoutError at the
        deadline. A failed run breaks the endpoint before raising: receives still posted
        must not land in these buffers later."""
        try:
            self._wait()
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """Drop what ties this run to its buffers. Its requests call back into it, so
        run and requests form a cycle that only the cyclic collector frees, whenever it
        next runs: meanwhile every view of the run's steps kept a released buffer mapped
        (64 MiB at a time across nodes). A request that finishes later finds nothing."""
        with self._lock:
            while self._working:  # a transport thread still working the queue ends first
                self._idle.wait()
            self._requests = [None] * len(self._requests)
            self._queue.clear()
            self._steps, self._slots, self._channels = (), (), {}

    def _wait(self) -> None:
        if self._left and not self._finished.wait(max(0.0, self._deadline - time.monotonic())):
            what = self._stuck()
            self._fail(-1, CollectiveTimeoutError(f"participant {self._rank} timed out waiting for {what}"))
        if self._failed is None:
            index = -1
            try:
                for index in self._flow.quiet:  # issued by now: their senders are done
                    request = self._requests[index]
                    if not request.done or request.error is not None:
                        self._channels[self._steps[index].peer].wait(
                            request, self._deadline, self._name(index)
                        )
                return
            except BaseException as raised:  # already the transport's own
                self._fail(index, raised)
        assert self._failed is not None
        index, error = self._failed
        if isinstance(error, _RequestFailed):  # the transport's own error for it
            step = self._steps[index]
            try:
                self._channels[step.peer].wait(self._requests[index], self._deadline, self._name(index))
            except BaseException as raised:
                error = raised
        self._abort(error)
        with self._lock:  # a step at work on another thread ends before this returns
            while self._working:
                self._idle.wait()
        raise error

    # -- the queue: one thread at a time works it ------------------------------------------

    def _notify(self, work: Callable[[int, Any], None], index: int, request: Any) -> None:
        """A request finished, on the thread that finished it: queue its work, and work
        the queue unless another thread already is."""
        with self._lock:
            self._queue.append((work, index, request))
            if self._working:
                return
            self._working = True
        self._work()

    def _work(self) -> None:
        queue, lock = self._queue, self._lock
        while True:
            with lock:
                if not queue:
                    self._working = False
                    self._idle.notify_all()
                    return
                work, index, request = queue.popleft()
            if self._failed is not None:
                continue  # nothing more moves once the run failed
            try:
                work(index, request)
            except BaseException as error:  # never into a connection's thread
                self._fail(index, error)

    # -- the steps -------------------------------------------------------------------------

    def _ready(self, index: int, _: object) -> None:
        """``index`` waits for nothing more: a send goes, a copy runs, a landed receive is
        reduced, a receive into the buffers may be posted (in order)."""
        step = self._steps[index]
        kind = step.kind
        if kind == _SEND:
            channel = self._channels[step.peer]
            tag = (self._tags[index] << channel.shift) | channel.send_bits
            # A send nothing waits for has no callback: wait() checks it at the end.
            then = functools.partial(self._notify, self._sent, index) if self._flow.then[index] else None
            self._requests[index] = channel.send(tag, self._flow.raw[index], then)
            if then is None:
                self._finished_steps[index] = 1
        elif kind == _COPY:
            assert step.src is not None  # a copy has a source
            np.copyto(step.dst, step.src)
            self._done(index)
        elif kind == _RECV_REDUCE:
            if self._landed[index]:
                self._reduce(index)
        else:
            self._post_receives(-1, None)

    def _post_receives(self, _: int, __: object) -> None:
        """Post receives in program order while the window has room: one into the
        buffers once its span is free, one to reduce once a slot is."""
        receives, steps = self._flow.receives, self._steps
        while self._next_receive < len(receives) and self._posted < self._window:
            index = receives[self._next_receive]
            step = steps[index]
            if step.kind == _RECV:
                if self._waits[index]:
                    return  # its span is still in use: later receives wait their turn
                out = self._flow.raw[index]
            else:
                if not self._free:
                    return
                slot = self._slot[index] = self._free.pop()
                out = self._slots[slot][: step.dst.nbytes]
            self._next_receive += 1
            self._posted += 1
            channel = self._channels[step.peer]
            tag = (self._tags[index] << channel.shift) | channel.recv_bits
            self._requests[index] = channel.post(
                tag, out, functools.partial(self._notify, self._received, index)
            )

    def _sent(self, index: int, request: Any) -> None:
        if request.error is not None:
            raise _RequestFailed
        self._done(index)

    def _received(self, index: int, request: Any) -> None:
        if request.error is not None:
            raise _RequestFailed
        self._posted -= 1
        if self._steps[index].kind == _RECV:
            self._done(index)
        else:
            self._landed[index] = 1
            if not self._waits[index]:
                self._reduce(index)
        self._post_receives(-1, None)

    def _reduce(self, index: int) -> None:
        step, slot, reduction = self._steps[index], self._slot[index], self._reduction
        assert reduction is not None and step.src is not None
        incoming = self._slots[slot][: step.dst.nbytes].view(step.dst.dtype)
        reduction.combine(step.src, incoming, step.dst)
        if step.final:
            reduction.finalize(step.dst)
        self._free.append(slot)
        self._done(index)

    def _done(self, index: int) -> None:
        waits = self._waits
        self._finished_steps[index] = 1
        for later in self._flow.then[index]:
            waits[later] -= 1
            if not waits[later]:
                self._ready(later, None)
        self._left -= 1
        if not self._left:
            self._finished.set()

    # -- failure ---------------------------------------------------------------------------

    def _fail(self, index: int, error: BaseException) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = (index, error)
        self._finished.set()

    def _stuck(self) -> str:
        """The first step not done, as a timeout names it."""
        index = self._finished_steps.find(0)
        return self._name(max(index, 0))

    def _name(self, index: int) -> str:
        step = self._steps[index]
        if step.kind == _SEND:
            return f"its send of message {self._tags[index]} to participant {step.peer}"
        if step.kind == _COPY:
            return "a local copy"
        return f"message {self._tags[index]} from participant {step.peer}"


class _RequestFailed(Exception):
    """A send or receive finished with an error: wait() raises the transport's own."""


def channels_for(endpoint: object, flow: Flow) -> dict[int, Channel] | None:
    """Every peer's Channel of ``endpoint``, or None where it lacks one for any of them."""
    channel = getattr(endpoint, "channel", None)
    if channel is None:
        return None
    out = {}
    for peer in flow.peers:
        got = channel(peer)
        if got is None or not got.data_flow:
            return None
        out[peer] = got
    return out


def check_tags(tag_base: int, steps: Sequence[Step], channels: dict[int, Channel]) -> None:
    """A folded tag must fit its field (lpsync.engine.routing.fold)."""
    shifts = {c.shift for c in channels.values()}
    if shifts and max(shifts) != 0 and steps:
        top = tag_base + max(s.tag for s in steps)
        if top >= 1 << (64 - max(shifts)):
            raise InvalidArgumentError(f"message tag {top} does not fit in {64 - max(shifts)} bits")
