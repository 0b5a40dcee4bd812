"""The executor: one participant's part of a schedule, bound to its buffers, run on a transport.

Plan once, run many: a Plan slices every span of the participant's program into
numpy views when it is built (when a buffer is registered or a collective first
seen); ``run`` only moves and reduces. Invariants:
  * the participant owns IN, OUT and TMP for the duration of ``run``; IN is only read;
  * a send's span is not written until the send has completed (the transport may be
    reading it in place), so writes first wait for the overlapping sends in flight;
  * every wait has the collective's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lpsync.algorithms.schedule import Kind, Schedule
from lpsync.engine.reduce import Reduction
from lpsync.engine.transport import Endpoint, SendRequest
from lpsync.errors import InvalidArgumentError

_SEND, _RECV, _RECV_REDUCE, _COPY = (int(k) for k in Kind)


def _address(view: np.ndarray) -> tuple[int, int]:
    start = view.__array_interface__["data"][0]
    return start, start + view.nbytes


@dataclass
class _Step:
    kind: int
    peer: int
    tag: int
    dst: np.ndarray  # the span sent, or written
    lo: int  # byte addresses of dst, for the overlap check
    hi: int
    src: np.ndarray | None  # RECV_REDUCE: the accumulator; COPY: the source
    final: bool


class Plan:
    """Participant ``rank``'s ops of ``schedule`` over (IN, OUT[, TMP]) 1-D arrays of one dtype.

    IN and OUT may alias (in place); TMP is allocated here when the schedule needs it
    and none is given.
    """

    def __init__(self, schedule: Schedule, rank: int, buffers: Sequence[np.ndarray],
                 reduction: Reduction | None = None) -> None:
        inp, out = buffers[0], buffers[1]
        if inp.dtype != out.dtype:
            raise InvalidArgumentError(f"input is {inp.dtype} but output is {out.dtype}")
        for name, arr, need in (("input", inp, schedule.in_elements()),
                                ("output", out, schedule.out_elements())):
            if arr.ndim != 1 or not arr.flags.c_contiguous or arr.size != need:
                raise InvalidArgumentError(
                    f"{name} must be a contiguous 1-D array of {need} elements, got shape "
                    f"{arr.shape}")
        tmp = buffers[2] if len(buffers) > 2 else np.empty(schedule.tmp_elements, inp.dtype)
        self.schedule, self.rank, self.dtype = schedule, rank, inp.dtype
        self.reduction = reduction
        bufs = (inp, out, tmp)
        self._steps: list[_Step] = []
        for kind, peer, buf, lo, hi, src, src_lo, final, tag in schedule.program(rank):
            dst = bufs[buf][lo:hi]
            source = bufs[src][src_lo:src_lo + hi - lo] if kind in (_RECV_REDUCE, _COPY) else None
            a, b = _address(dst)
            if kind == _COPY and source is not None and _address(source) == (a, b):
                continue  # in place: the data is already there
            if kind == _RECV_REDUCE and reduction is None:
                raise InvalidArgumentError(f"{schedule.op} needs a reduce op")
            self._steps.append(_Step(kind, peer, tag, dst, a, b, source, bool(final)))

    def run(self, endpoint: Endpoint, deadline: float, tag_base: int = 0) -> None:
        """Run the program once; raises the transport's errors (timeouts, aborts)."""
        in_flight: list[tuple[int, int, SendRequest]] = []
        reduction, dtype = self.reduction, self.dtype
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
                assert reduction is not None and step.src is not None
                with endpoint.recv_borrow(step.peer, tag_base + step.tag, step.dst.nbytes,
                                          deadline) as raw:
                    reduction.combine(step.src, raw.view(dtype), step.dst)
                if step.final:
                    reduction.finalize(step.dst)
            else:
                np.copyto(step.dst, step.src)
        for _, _, request in in_flight:
            request.wait(deadline)


def _wait_overlapping(in_flight: list[tuple[int, int, SendRequest]], lo: int, hi: int,
                      deadline: float) -> None:
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
