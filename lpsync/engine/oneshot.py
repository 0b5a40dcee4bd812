"""The one-shot allreduce on device buffers (issue 47, item 3): one kernel per device.

Every device that holds a participant's output runs one launch (the memory kind's
``oneshot_async``) on its first shared stream: it reads every participant's input, its
own device's directly and other devices' through peer access, reduces them in rank order
(deterministic: the same bits whatever the topology), divides once for avg, and writes
the outputs of the participants on that device. On one GPU (the common case: several
processes sharing it) that is one launch for the whole collective.

No flags in device memory: the launches never wait on each other. Every input is ready
before any launch runs (each launch's stream first waits for every client's ready event,
StreamPlan.launch, or the host polled them first, StreamPlan.run; as the chain does),
and no launch writes what another one reads: with
more than one device, outputs must be apart from every input (``eligible`` refuses
in-place buffers there, and those run the chain). A single device's launch may write in
place: each element's inputs are read by the thread that then writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lpsync.engine.device_group import DeviceContext, Lanes, StreamPlan
from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Span, oneshot_refusal
from lpsync.reduction import Reduction


def _devices(buffers: Sequence[tuple[Span, Span]]) -> list[int]:
    return _devices_of([out.device for _, out in buffers])


def _devices_of(outs: Sequence[int]) -> list[int]:
    """The output devices, one launch each, in launch order."""
    return sorted(set(outs))


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
        self,
        context: DeviceContext,
        buffers: Sequence[tuple[Span, Span]],
        reduction: Reduction,
        lanes: Lanes | None = None,
    ) -> None:
        """``lanes``: the job's own streams (owned: ``close`` gives them back), else the
        context's shared ones."""
        super().__init__()
        why = refusal(context, buffers, reduction.dtype)
        if why is not None:
            raise InvalidArgumentError(f"the one-shot allreduce cannot run here: {why}")
        self.context, self.kind = context, context.kind
        self._lanes = lanes
        kind = self.kind
        inputs = [inp for inp, _ in buffers]
        self._outs = [out.device for _, out in buffers]
        self.ops, self.finals, self._streams = [], [], []
        for device in _devices(buffers):
            stream = context.stream(device, 0) if lanes is None else lanes.get(device, "main0")
            outs = [out for _, out in buffers if out.device == device]
            self.ops.append((kind.oneshot_async, (reduction, outs, inputs, stream)))
            self._streams.append(stream)
        for stream, device in zip(self._streams, _devices(buffers), strict=True):
            event = kind.event(device)
            self.ops.append((kind.record, (event, stream)))
            self.finals.append(event)

    def all_streams(self) -> list:
        return list(self._streams)

    def stream_of(self, participant: int) -> Any:
        """The stream of the launch that writes ``participant``'s output."""
        return self._streams[_devices_of(self._outs).index(self._outs[participant])]

    def close(self, wait: bool = True) -> None:
        """No memory to give back (the kernel's pointers go by value); the lanes, after
        the last launch in flight finished."""
        if self.close_after_launches():
            self._give_back()

    def _give_back(self) -> None:
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            lanes.close()


class Refused:
    """What the plan cache keeps for buffers the one-shot path refused (``why``): the
    check runs once per plan key, and those buffers then run the chain."""

    def __init__(self, why: str) -> None:
        self.why = why

    def close(self, wait: bool = True) -> None:
        """Nothing held."""


def plan(
    context: DeviceContext,
    buffers: Sequence[tuple[Span, Span]],
    reduction: Reduction,
    lanes: Callable[[], Lanes] | None = None,
) -> OneShot | Refused:
    """The one-shot plan of these buffers, or why they cannot have one; ``lanes`` makes
    the job's own streams for it (taken only where it can run)."""
    why = refusal(context, buffers, reduction.dtype)
    if why is not None:
        return Refused(why)
    return OneShot(context, buffers, reduction, lanes() if lanes is not None else None)
