"""Who reads the trigger socket's replies (lpsync_client/_trigger.py), with a real daemon:
a blocking call reads its own reply on the calling thread; async calls are read by the
background reader; threads that mix both on one client all finish, with the right
results, and nothing waits for a reader that is not coming."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import lpsync_client
from lpsync_client import _pending, _trigger
from tests.daemon.harness import DaemonProcess


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    # The Python path: with --native on, a blocking call's repeats ring the doorbell and
    # read no reply at all (tests/native covers that path and its threads).
    d = DaemonProcess(Path(tmp_path_factory.mktemp("trigger-reading")), "--native", "off")
    yield d
    d.stop_and_check()


def _on_threads(work: Callable[[int], None], count: int) -> None:
    """``work(t)`` on ``count`` threads at once; each one's error is raised here, and
    none may still be waiting after two minutes."""
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            work(t)
        except BaseException as error:  # reported below, not lost with the thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a thread is still waiting"
    assert not errors, errors[0]


def test_a_blocking_call_reads_its_reply_and_async_ones_the_reader(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    readers: list[str] = []  # the thread that read each reply
    tabled: list[int] = []  # the replies that completed a Future of the table
    read, complete = _trigger.TriggerStream._next, _pending.PendingRequests.complete

    def recorded_read(self):
        response = read(self)
        if response is not None:
            readers.append(threading.current_thread().name)
        return response

    def recorded_complete(self, response) -> None:
        tabled.append(response.request_id)
        complete(self, response)

    monkeypatch.setattr(_trigger.TriggerStream, "_next", recorded_read)
    monkeypatch.setattr(_pending.PendingRequests, "complete", recorded_complete)
    with lpsync_client.connect(daemon.socket, job="who-reads", rank=0, world_size=1, trigger="socket") as c:
        x = c.zeros(4, "float32")
        x[:] = 3
        readers.clear()  # the session's opening, on the gRPC stream's thread
        tabled.clear()
        for _ in range(20):
            c.allreduce(x)
        blocking, readers[:], tabled_blocking, tabled[:] = list(readers), [], list(tabled), []
        futures = [c.allreduce_async(x) for _ in range(20)]
        for f in futures:
            f.result(30)
    assert blocking == [threading.current_thread().name] * 20
    # The first call prepares the request and goes through the table; its repeats are
    # answered on this thread without a Future (Client._answer_now).
    assert len(tabled_blocking) == 1, tabled_blocking
    assert set(readers) == {"lpsync-client-trigger"} and len(readers) == 20
    assert len(tabled) == 20
    np.testing.assert_array_equal(x, 3)


def test_threads_mixing_blocking_and_async_calls_on_one_client_all_finish(daemon: DaemonProcess) -> None:
    with lpsync_client.connect(daemon.socket, job="mixed", rank=0, world_size=1, trigger="socket") as c:

        def work(t: int) -> None:
            x = c.zeros(8, "float32")
            x[:] = t
            done = threading.Event()
            for i in range(150):
                if i % 3 == 0:  # an async call left to the background reader
                    done.clear()
                    f = c.broadcast_async(x, root=0)
                    f.add_done_callback(lambda _: done.set())
                    assert done.wait(30), f"thread {t}: call {i} never completed"
                else:
                    c.allreduce(x, timeout=30)
                assert (x == t).all(), f"thread {t}: {x}"
            c.barrier(timeout=30)

        _on_threads(work, 4)


def test_a_callback_of_an_async_call_may_run_inside_a_blocking_call(daemon: DaemonProcess) -> None:
    """The async call's reply may be read by a thread blocked in another call: its
    callback then runs there, and may issue (not wait for) another collective."""
    seen: list = []
    with lpsync_client.connect(daemon.socket, job="callbacks", rank=0, world_size=1, trigger="socket") as c:
        x, y = c.zeros(4, "float32"), c.zeros(4, "float32")
        for _ in range(50):
            f = c.allreduce_async(x)
            f.add_done_callback(lambda _: seen.append(c.allreduce_async(y)))
            c.allreduce(y, timeout=30)
            f.result(30)
        for g in seen:
            g.result(30)
    assert len(seen) == 50


def test_threads_in_blocking_calls_only_hand_the_reading_on(daemon: DaemonProcess) -> None:
    """No async call wakes the background reader here: when the thread that reads stops
    (its own reply came), the others' replies are still read."""
    with lpsync_client.connect(daemon.socket, job="blocking", rank=0, world_size=1, trigger="socket") as c:

        def work(t: int) -> None:
            x = c.zeros(8, "float32")
            for i in range(200):
                x[:] = t + i
                c.allreduce(x, timeout=10)
                assert (x == t + i).all(), f"thread {t}: {x}"

        _on_threads(work, 4)


def test_a_repeated_call_on_fresh_views_reads_where_each_view_is(daemon: DaemonProcess) -> None:
    """The client remembers a view's data address by its id (Client._span) while the
    view lives. Fresh views of two places, each made and dropped call after call, take
    the same id: each prepared call must still read where its own view is."""
    with lpsync_client.connect(daemon.socket, job="fresh-views", rank=0, world_size=1, trigger="socket") as c:
        src, out = c.zeros(8, "float32"), c.zeros(4, "float32")
        ids = []
        for k in range(1, 41):
            a = src[0:4] if k % 2 else src[4:8]  # a new view object each time
            ids.append(id(a))
            a[:] = k  # the other place still holds k - 1
            c.allreduce(a, out=out)  # one rank: out = a
            np.testing.assert_array_equal(out, k, err_msg=f"call {k} read another place")
            del a
    assert len(set(ids)) < len(ids), "no id was reused: the test did not exercise the case"
