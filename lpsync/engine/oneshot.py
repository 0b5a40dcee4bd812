"""The one-shot allreduce on device buffers (issue 47, item 3): one kernel per device.

Every device that holds a participant's output runs one launch (the memory kind's
``oneshot_async``) on its first shared stream: it reads every participant's input, its
own device's directly and other devices' through peer access, reduces them in rank order
(deterministic: the same bits whatever the topology), divides once for avg, and writes
the outputs of the participants on that device. On one GPU (the common case: several
processes sharing it) that is one launch for the whole collective.

No flags in device memory: the launches never wait on each other. Every input is ready
before any launch is enqueued (StreamPlan.run waits for each client's ready event on
the host first, as the chain does), and no launch writes what another one reads: with
more than one device, outputs must be apart from every input (``eligible`` refuses
in-place buffers there, and those run the chain). A single device's launch may write in
place: each element's inputs are read by the thread that then writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lpsync.engine.device_group import DeviceContext, StreamPlan
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span, oneshot_refusal
from lpsync.reduction import Reduction


def _devices(buffers: Sequence[tuple[Span, Span]]) -> list[int]:
    return sorted({out.device for _, out in buffers})


def refusal(context: DeviceContext, buffers: Sequence[tuple[Span, Span]], dtype: np.dtype) -> str | None:
    """Why these (IN, OUT) spans, rank order, cannot run one-shot (None: they can).
    Enables peer access between their devices first (once per pair), so that a pair the
    device refused (too many peers) is seen as staged and refused here."""
    devices = _devices(buffers)
    context.enable_peers(sorted(devices + [inp.device for inp, _ in buffers if inp.device >= 0]))
    inputs = [inp for inp, _ in buffers]
    for device in devices:
        outs = [out for _, out in buffers if out.device == device]
        why = oneshot_refusal(outs, inputs, dtype, device, context.topology, in_place=len(devices) == 1)
        if why is not None:
            return why
    return None


class OneShot(StreamPlan):
    """The plan: one ``oneshot_async`` per output device, then each stream's final record."""

    def __init__(
        self, context: DeviceContext, buffers: Sequence[tuple[Span, Span]], reduction: Reduction
    ) -> None:
        why = refusal(context, buffers, reduction.dtype)
        if why is not None:
            raise InvalidArgumentError(f"the one-shot allreduce cannot run here: {why}")
        self.context, self.kind = context, context.kind
        kind = self.kind
        inputs = [inp for inp, _ in buffers]
        self.ops, self.finals, self._streams = [], [], []
        for device in _devices(buffers):
            stream = context.stream(device, 0)
            outs = [out for _, out in buffers if out.device == device]
            self.ops.append((kind.oneshot_async, (reduction, outs, inputs, stream)))
            self._streams.append(stream)
        for stream, device in zip(self._streams, _devices(buffers), strict=True):
            event = kind.event(device)
            self.ops.append((kind.record, (event, stream)))
            self.finals.append(event)

    def all_streams(self) -> list:
        return list(self._streams)

    def close(self, wait: bool = True) -> None:
        """Nothing to give back: the plan holds no memory (the kernel's pointers go by value)."""


class Refused:
    """What the plan cache keeps for buffers the one-shot path refused (``why``): the
    check runs once per plan key, and those buffers then run the chain."""

    def __init__(self, why: str) -> None:
        self.why = why

    def close(self, wait: bool = True) -> None:
        """Nothing held."""


def plan(
    context: DeviceContext, buffers: Sequence[tuple[Span, Span]], reduction: Reduction
) -> OneShot | Refused:
    """The one-shot plan of these buffers, or why they cannot have one."""
    why = refusal(context, buffers, reduction.dtype)
    return Refused(why) if why is not None else OneShot(context, buffers, reduction)
