"""The executor: one participant's part of a schedule, bound to its buffers, run on a transport.

Plan once, run many: a Plan slices every span of the participant's program into
numpy views when it is built (when a buffer is registered or a collective first
seen); ``run`` only moves and reduces. Invariants:
  * the participant owns IN, OUT and TMP for the duration of ``run``; IN is only read;
  * a send's span is not written until the send has completed (the transport may be
    reading it in place), so writes first wait for the overlapping sends in flight;
  * every wait has the collective's deadline;
  * on a transport that posts receives ahead (PostingEndpoint: the network), up to
    ``RECV_WINDOW`` receives are posted before their turn, in program order, so a
    message flows while earlier steps run. A receive into the participant's buffers is
    posted only once no earlier pending step touches its span; a receive to reduce
    lands in one of the window's staging slots. A failed run aborts such a transport.
  * on a transport with channels (the TCP backend), a host program whose spans line up
    runs as data flow instead (dataflow.py): each step on the thread that finished what
    it waits for;
  * the buffers are host arrays, or device spans worked on through their kind
    (lpsync.engine.buffers: the peer plane's direct device path), on a posting transport;
    bounced device spans (the flat path of jobs mixing host and device buffers) send
    and receive every message through a few host slots, the rest stays on the device.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lpsync.algorithms.schedule import Kind, Schedule
from lpsync.engine.buffers import HOST, BouncedBuffers, Buffers
from lpsync.engine.dataflow import Flow, Run, channels_for, check_tags
from lpsync.engine.endpoint import Endpoint, PostingEndpoint, RecvRequest, SendRequest
from lpsync.errors import InvalidArgumentError
from lpsync.reduction import Reduction

_SEND, _RECV, _RECV_REDUCE, _COPY = (int(k) for k in Kind)
RECV_WINDOW = 4  # receives posted ahead: enough to keep a pipeline's next chunks flowing
_LOOKAHEAD = 64  # steps scanned past the current one for receives to post
# Finished sends are dropped from the in-flight list past this length: a middle node of an
# LP pipeline sends every chunk, and a list of them all made each receive posted scan
# them all (quadratic in the chunk count).
_PRUNE_AT = 16


@dataclass
class _Step:
    kind: int
    peer: int
    tag: int
    dst: np.ndarray  # the span sent, or written
    wire: np.ndarray  # dst as the transport takes it (dst itself for host arrays)
    lo: int  # byte addresses of dst, for the overlap check
    hi: int
    src: np.ndarray | None  # RECV_REDUCE: the accumulator; COPY: the source
    final: bool
    src_lo: int = 0  # byte addresses of src (0, 0 without one)
    src_hi: int = 0

    def touches(self, lo: int, hi: int) -> bool:
        return (self.lo < hi and lo < self.hi) or (self.src_lo < hi and lo < self.src_hi)


class Plan:
    """Participant ``rank``'s ops of ``schedule`` over (IN, OUT[, TMP]) 1-D arrays of one dtype.

    IN and OUT may alias (in place); TMP is allocated here when the schedule needs it
    and none is given. ``memory``: what the buffers are (host arrays by default, or
    device spans: lpsync.engine.buffers).
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        buffers: Sequence[np.ndarray],
        reduction: Reduction | None = None,
        memory: Buffers = HOST,
    ) -> None:
        inp, out = buffers[0], buffers[1]
        if inp.dtype != out.dtype:
            raise InvalidArgumentError(f"input is {inp.dtype} but output is {out.dtype}")
        for name, arr, need in (
            ("input", inp, schedule.in_elements(rank)),
            ("output", out, schedule.out_elements(rank)),
        ):
            if not memory.fits(arr, need):
                raise InvalidArgumentError(
                    f"{name} must be a contiguous 1-D array of {need} elements, got {arr.size} "
                    f"({type(arr).__name__})"
                )
        self.nbytes = 0  # the scratch this plan allocated: what a plan cache holds with it
        if len(buffers) > 2:
            tmp = buffers[2]
        else:
            tmp_bytes = schedule.tmp_elements * inp.dtype.itemsize
            tmp = memory.typed(memory.scratch("tmp", tmp_bytes), tmp_bytes, inp.dtype)
            self.nbytes += tmp_bytes
        self.schedule, self.rank, self.dtype = schedule, rank, inp.dtype
        self.reduction, self.memory = reduction, memory
        bufs = (inp, out, tmp)
        self._steps: list[_Step] = []
        for kind, peer, buf, lo, hi, src, src_lo, final, tag in schedule.program(rank):
            dst = bufs[buf][lo:hi]
            source = bufs[src][src_lo : src_lo + hi - lo] if kind in (_RECV_REDUCE, _COPY) else None
            a, b = memory.address(dst)
            if kind == _COPY and source is not None and memory.address(source) == (a, b):
                continue  # in place: the data is already there
            if kind == _RECV_REDUCE and reduction is None:
                raise InvalidArgumentError(f"{schedule.op} needs a reduce op")
            sa, sb = memory.address(source) if source is not None else (0, 0)
            wire = memory.wire(dst) if kind in (_SEND, _RECV) else dst
            self._steps.append(_Step(kind, peer, tag, dst, wire, a, b, source, bool(final), sa, sb))
        # Bounced buffers (device spans whose bytes travel through host slots, buffers.py)
        # receive every message in the window's slots, not only those to reduce.
        self._bouncer = memory if isinstance(memory, BouncedBuffers) else None
        landing = (_RECV_REDUCE, _RECV) if self._bouncer is not None else (_RECV_REDUCE,)
        chunk = max((s.dst.nbytes for s in self._steps if s.kind in landing), default=0)
        window = RECV_WINDOW
        if self._bouncer is not None:  # each slot is host memory held: no more than needed
            receives = sum(1 for s in self._steps if s.kind in landing)
            window = min(receives, self._bouncer.window(chunk, window))
        self._staging = [memory.scratch(("slot", i), chunk) for i in range(window)] if chunk else []
        self.nbytes += chunk * len(self._staging)
        self._staging_wire = [memory.wire(slot) for slot in self._staging]

    @functools.cached_property
    def _flow(self) -> Flow | None:
        """The program as data flow (dataflow.py), worked out on the first run on a
        transport with channels; None for device buffers or spans that do not line up."""
        return Flow.of(self._steps) if self.memory.host else None

    def run(self, endpoint: Endpoint, deadline: float, tag_base: int = 0) -> None:
        """Run the program once; raises the transport's errors (timeouts, aborts)."""
        if hasattr(endpoint, "post_recv"):
            has_channels = hasattr(endpoint, "channel")
            flow = self._flow if has_channels else None
            channels = channels_for(endpoint, flow) if flow is not None else None
            if flow is not None and channels is not None:
                check_tags(tag_base, self._steps, channels)
                run = Run(
                    self._steps,
                    flow,
                    channels,
                    tag_base,
                    self._staging,
                    self.reduction,
                    self.rank,
                    deadline,
                    RECV_WINDOW,
                    endpoint.abort,  # type: ignore[attr-defined]
                )
                run.start()
                run.wait()
                return
            self._run_posting(endpoint, deadline, tag_base)  # type: ignore[arg-type]
            return
        if not self.memory.host:
            raise InvalidArgumentError("device buffers cross a posting (network) transport only")
        in_flight: list[tuple[int, int, SendRequest]] = []
        for step in self._steps:
            if step.kind == _SEND:
                request = endpoint.send(step.peer, tag_base + step.tag, step.dst)
                in_flight.append((step.lo, step.hi, request))
                continue
            if in_flight:
                _wait_overlapping(in_flight, step.lo, step.hi, deadline)
            if step.kind == _RECV:
                endpoint.recv_into(step.peer, tag_base + step.tag, step.dst, deadline)
            elif step.kind == _RECV_REDUCE:
                with endpoint.recv_borrow(step.peer, tag_base + step.tag, step.dst.nbytes, deadline) as raw:
                    self._reduce(step, raw.view(self.dtype), deadline)
            else:
                self.memory.copy(step.dst, step.src, deadline)
        for _, _, request in in_flight:
            request.wait(deadline)

    def _reduce(self, step: _Step, incoming: np.ndarray, deadline: float) -> None:
        assert self.reduction is not None and step.src is not None
        self.memory.combine(self.reduction, step.src, incoming, step.dst, step.final, deadline)

    def _run_posting(self, endpoint: PostingEndpoint, deadline: float, tag_base: int) -> None:
        steps = self._steps
        in_flight: list[tuple[int, int, SendRequest]] = []
        posted: dict[int, tuple[RecvRequest, int]] = {}  # step -> (request, staging slot)
        free_slots = list(range(len(self._staging)))
        scan = 0  # the next step to consider posting
        bouncer = self._bouncer
        bounced = bouncer is not None

        def post_ahead(now: int) -> None:
            nonlocal scan
            scan = max(scan, now)
            while len(posted) < RECV_WINDOW and scan < len(steps) and scan < now + _LOOKAHEAD:
                step = steps[scan]
                if step.kind == _RECV_REDUCE or (bounced and step.kind == _RECV):
                    if not free_slots:  # bounced: a window no wider than the receives
                        return
                    slot = free_slots.pop()
                    out = self._staging_wire[slot][: step.dst.nbytes]
                elif step.kind == _RECV:
                    # Its span must be free: no pending step before it reads or writes
                    # there, no send from there still in flight.
                    if any(steps[k].touches(step.lo, step.hi) for k in range(now, scan)) or any(
                        lo < step.hi and step.lo < hi and not r.done() for lo, hi, r in in_flight
                    ):
                        return
                    slot, out = -1, step.wire
                else:
                    scan += 1
                    continue
                request = endpoint.post_recv(step.peer, tag_base + step.tag, out)
                if request is None:  # received in turn (a local peer)
                    if slot >= 0:
                        free_slots.append(slot)
                else:
                    posted[scan] = (request, slot)
                scan += 1

        try:
            for index, step in enumerate(steps):
                if len(posted) < RECV_WINDOW:  # else post_ahead would post nothing
                    post_ahead(index)
                if step.kind == _SEND:
                    request: SendRequest | RecvRequest  # also a receive's, below
                    if bouncer is not None:  # its bytes in a host slot: the span is free at once
                        wire = bouncer.outgoing(step.dst, deadline)
                        request = endpoint.send(step.peer, tag_base + step.tag, wire)
                        bouncer.sending(wire, request)
                    else:
                        request = endpoint.send(step.peer, tag_base + step.tag, step.wire)
                    in_flight.append((step.lo, step.hi, request))
                    if len(in_flight) > _PRUNE_AT:  # each post_ahead scans the sends in flight
                        in_flight[:] = [item for item in in_flight if not item[2].done()]
                    continue
                entry = posted.pop(index, None)
                if in_flight and entry is None and not bounced:  # bounced: sends read slots
                    _wait_overlapping(in_flight, step.lo, step.hi, deadline)
                if step.kind == _RECV and bouncer is not None:  # a slot or lent bytes, then H2D
                    nbytes = step.dst.nbytes
                    if entry is None:
                        with endpoint.recv_borrow(step.peer, tag_base + step.tag, nbytes, deadline) as raw:
                            bouncer.land(step.dst, raw, deadline)
                    else:
                        request, slot = entry
                        request.wait(deadline)
                        bouncer.land(step.dst, self._staging_wire[slot][:nbytes], deadline)
                        free_slots.append(slot)
                elif step.kind == _RECV:
                    if entry is None:
                        endpoint.recv_into(step.peer, tag_base + step.tag, step.wire, deadline)
                    else:
                        entry[0].wait(deadline)
                elif step.kind == _RECV_REDUCE:
                    if in_flight and entry is not None and not bounced:
                        _wait_overlapping(in_flight, step.lo, step.hi, deadline)
                    if entry is None:  # a local peer's message, received in turn
                        if not self.memory.host and not bounced:
                            raise InvalidArgumentError("device buffers are reduced from posted receives only")
                        with endpoint.recv_borrow(
                            step.peer, tag_base + step.tag, step.dst.nbytes, deadline
                        ) as raw:
                            self._reduce(step, raw.view(self.dtype), deadline)
                    else:
                        request, slot = entry
                        request.wait(deadline)
                        incoming = self.memory.typed(self._staging[slot], step.dst.nbytes, self.dtype)
                        self._reduce(step, incoming, deadline)
                        free_slots.append(slot)
                else:
                    self.memory.copy(step.dst, step.src, deadline)
            for _, _, request in in_flight:
                request.wait(deadline)
        except BaseException as error:
            if posted:  # receives still posted would land in these buffers later
                endpoint.abort(error)
            raise


def _wait_overlapping(
    in_flight: list[tuple[int, int, SendRequest]], lo: int, hi: int, deadline: float
) -> None:
    still = []
    for item in in_flight:
        s_lo, s_hi, request = item
        if request.done():
            continue
        if s_lo < hi and lo < s_hi:
            request.wait(deadline)
            continue
        still.append(item)
    in_flight[:] = still


def deadline_after(timeout: float) -> float:
    return time.monotonic() + timeout
