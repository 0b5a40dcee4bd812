"""The UCX endpoint's Channel (lpsync.transport.mesh.Channel): two endpoints in this
process, UCX forced onto TCP. A request's callback runs on its endpoint's progress
thread (a small collective on a leaf of the agreement finishes there); data flow is kept
off it (lpsync.engine.dataflow.channels_for). A message larger than its receive is a
mismatch (InvalidArgumentError), not a lost peer: ucxx's error class is named
UCXXMessageTruncatedError, which mesh.py did not know, and the wait broke the mesh."""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from lpsync.engine.dataflow import Flow, channels_for
from lpsync.errors import InvalidArgumentError
from lpsync.transport import backends
from tests.transport.pairs import connected_pair, next_message_intact

pytest.importorskip("ucxx")

SECRET = b"test cluster secret"


def pair() -> AbstractContextManager[tuple[Any, Any]]:
    return connected_pair(lambda options: backends.connect("ucx", options, tls="tcp"), SECRET, "lpsync-ucx")


def test_a_channel_calls_back_on_the_progress_thread_and_reports_a_message_too_large() -> None:
    rng = np.random.default_rng(3)
    with pair() as (a, b):
        into, out_of = b.channel(0), a.channel(1)
        seen: list[tuple[str, object, str]] = []
        done = threading.Semaphore(0)

        def note(what: str):  # type: ignore[no-untyped-def]
            def then(request):  # type: ignore[no-untyped-def]
                seen.append((what, request.error, threading.current_thread().name))
                done.release()

            return then

        data = rng.integers(0, 255, 1 << 20, dtype=np.uint8)
        out = np.zeros(data.size, np.uint8)
        received = into.post(10, out, note("received"))
        sent = out_of.send(10, data, note("sent"))
        assert done.acquire(timeout=10) and done.acquire(timeout=10), seen
        assert (out == data).all() and received.error is None and sent.error is None
        threads = {what: thread for what, _, thread in seen}
        assert threads["received"].startswith("lpsync-ucx"), seen
        assert threads["sent"].startswith("lpsync-ucx"), seen
        assert threading.current_thread().name not in threads.values()
        # Too large for its receive: the callback sees the error, and the wait names it.
        seen.clear()
        small = into.post(20, np.zeros(8, np.uint8), note("too large"))
        out_of.send(20, np.arange(64, dtype=np.uint8), None)
        assert done.acquire(timeout=10), seen
        assert seen[0][1] is not None
        with pytest.raises(InvalidArgumentError, match="larger than the receive"):
            into.wait(small, time.monotonic() + 5, "the test's message")
        # A mismatch, not a lost peer: neither endpoint broke, the next message lands.
        next_message_intact(a, b, time.monotonic() + 10)


def test_data_flow_keeps_off_the_ucx_channel() -> None:
    with pair() as (a, _):
        assert a.channel(1).data_flow is False
        # channels_for reads a flow's peers only.
        assert channels_for(a, cast(Flow, SimpleNamespace(peers=(1,)))) is None
