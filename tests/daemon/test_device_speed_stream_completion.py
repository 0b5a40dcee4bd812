"""Stream-ordered completion (issue 47, item 1) end to end on the emulated device: real
daemons (--devices emulated:N), client processes, results against numpy.

A device collective is answered once its work is enqueued on the daemon's streams; the
answer carries a done event that the client's current stream waits on, so the client's
later work (an emulated "kernel" queued on its stream) sees the whole result, never part
of it. The client's ready event is waited on by the job's own streams, so a client that
never reaches it holds only its job."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import lpsync_client
from lpsync.engine.device_group import DONE_EVENTS
from lpsync_client import emulated
from tests.daemon.harness import DaemonProcess, helper_context, run_ranks

COUNT = 1 << 20  # 4 MiB of float32: over the one-shot cap, so the chain's copies run (slowed)
ROUNDS = 12


def _client(rank: int, socket: str, world: int, job: str) -> lpsync_client.Client:
    return lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=60)


def ordered_rounds(rank: int, socket: str, world: int, host_wait: bool, delay: float) -> dict:
    """ROUNDS allreduces of fresh values, each queued behind a slow write on the client's
    stream; after each answer a check queued on the stream compares the buffer with the
    exact sum (numpy). Records how long each answer took and whether the buffer held the
    result already when the answer came."""
    with _client(rank, socket, world, f"ordered-{host_wait}") as client:
        client.device_host_wait = host_wait
        x = emulated.zeros(COUNT, "float32", device=rank % 2)
        client.register(x)
        client.barrier()
        stream = emulated.current_stream(x.device)
        wrong: list[int] = []
        final_at_answer, answered_in = [], []
        for i in range(ROUNDS):
            mine = np.full(COUNT, (i + 1) * (rank + 1), np.float32)
            expected = sum(np.full(COUNT, (i + 1) * (r + 1), np.float32) for r in range(world))
            x.set_async(mine, delay=delay if i == 0 else 0.0)
            start = time.monotonic()
            client.allreduce_async(x, algorithm="ring").result(timeout=60)
            answered_in.append(time.monotonic() - start)
            final_at_answer.append(bool(np.array_equal(x.host, expected)))

            def check(i: int = i, expected: np.ndarray = expected) -> None:  # a later "kernel"
                if not np.array_equal(x.host, expected):
                    wrong.append(i)

            stream.enqueue(check)
        stream.synchronize(60)
        client.release(x)
        return {"wrong": wrong, "final_at_answer": final_at_answer, "answered_in": answered_in}


@pytest.fixture
def slow(tmp_path: Path):
    """Two emulated devices whose copies run at 200 MB/s: a 4 MiB ring takes tens of ms."""
    proc = DaemonProcess(tmp_path, "--devices", "emulated:2,bw=200000000")
    try:
        yield proc
    finally:
        proc.stop_and_check()


def test_answered_when_enqueued_and_later_work_sees_the_whole_result(slow):
    delay = 1.0
    results = run_ranks(2, ordered_rounds, slow.socket, 2, False, delay, timeout=240)
    for r in results:
        assert r["wrong"] == [], f"later work on the stream saw a partial result in rounds {r['wrong']}"
        # The first answer came before the client's own write had even run (it sat 1 s on
        # its stream): the daemon answered at enqueue, its streams waited for that write.
        assert r["answered_in"][0] < delay / 2, r["answered_in"]
        assert not r["final_at_answer"][0]


def test_host_wait_answers_once_finished(slow):
    delay = 0.5
    results = run_ranks(2, ordered_rounds, slow.socket, 2, True, delay, timeout=240)
    for r in results:
        assert r["wrong"] == []
        assert all(r["final_at_answer"]), r["final_at_answer"]
        assert r["answered_in"][0] >= delay


def _status(socket: str):
    with lpsync_client.connect(socket, job="status", rank=0, world_size=1) as client:
        return client.status()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def many_calls(rank: int, socket: str, world: int, calls: int) -> dict:
    """``calls`` stream-ordered allreduces (small: the one-shot path; every 10th forced
    onto the chain), the last result checked on the stream; the done events this process
    opened."""
    with _client(rank, socket, world, "many") as client:
        x = emulated.zeros(256, "float32", device=rank % 2)
        client.register(x)
        for i in range(calls):
            x.set_async(np.full(256, rank + i, np.float32))
            client.allreduce(x, algorithm="ring" if i % 10 == 0 else None)
        got = x.get()
        client.release(x)
        expected = sum(np.full(256, r + calls - 1, np.float32) for r in range(world))
        return {"equal": bool(np.array_equal(got, expected)), "opened": len(emulated._opened)}


def test_no_event_or_mapping_leak_across_1000_calls(tmp_path: Path):
    daemon = DaemonProcess(tmp_path, "--devices", "emulated:2")
    try:
        run_ranks(2, many_calls, daemon.socket, 2, 20, timeout=120)  # warm: lanes, pools, watchers
        fds, threads = _fds(daemon.pid), _threads(daemon.pid)
        results = run_ranks(2, many_calls, daemon.socket, 2, 1000, timeout=600)
        for r in results:
            assert r["equal"]
            # The daemon's done events are pooled: as many as were outstanding at once.
            assert 0 < r["opened"] <= DONE_EVENTS, r
        # Every mapping closed; the sessions' done events destroyed (each a memfd here).
        rows = _status(daemon.socket).devices
        assert all(row.open_allocations == 0 and row.registered_bytes == 0 for row in rows)
        assert _fds(daemon.pid) <= fds + 8, (fds, _fds(daemon.pid))
        assert _threads(daemon.pid) <= threads + 8, (threads, _threads(daemon.pid))
    finally:
        daemon.stop_and_check()


def stuck_rank(rank: int, socket: str, ready_file: str) -> None:
    """Job "stuck", rank 1: its stream never reaches the ready event of its allreduce
    (a kernel that never ends); says when it submitted, then waits to be killed."""
    with _client(rank, socket, 2, "stuck") as client:
        x = emulated.zeros(COUNT, "float32", device=1)
        client.register(x)
        client.barrier()
        never = threading.Event()
        emulated.current_stream(1).enqueue(lambda: never.wait(600))
        client.allreduce_async(x, algorithm="ring")
        Path(ready_file).write_text("submitted")
        time.sleep(600)


def stuck_peer(rank: int, socket: str, ready_file: str) -> dict:
    """Job "stuck", rank 0: answered at enqueue although rank 1's stream never gets there;
    its stream is held on the done event until rank 1 dies; its next collective fails."""
    with _client(rank, socket, 2, "stuck") as client:
        x = emulated.asarray(np.full(COUNT, 5.0, np.float32), device=0)
        client.register(x)
        client.barrier()
        start = time.monotonic()
        client.allreduce_async(x, algorithm="ring").result(timeout=60)
        answered = time.monotonic() - start
        Path(ready_file).write_text("answered")
        start = time.monotonic()
        x.get(timeout=120)  # held until rank 1's session ends and the streams give up
        released = time.monotonic() - start
        try:
            client.allreduce(x, algorithm="ring", timeout=20)
            error = ""
        except lpsync_client.LpsyncError as failure:
            error = type(failure).__name__
        return {"answered": answered, "released": released, "error": error}


def other_job(rank: int, socket: str) -> list[float]:
    with _client(rank, socket, 2, "other") as client:
        x = emulated.asarray(np.full(COUNT, rank + 1.0, np.float32), device=rank)
        client.register(x)
        for _ in range(3):
            client.allreduce(x, algorithm="ring")
        return x.get()[:3].tolist()


def test_a_client_that_never_gets_ready_blocks_only_its_job(tmp_path: Path):
    daemon = DaemonProcess(tmp_path, "--devices", "emulated:2")
    ctx = helper_context()
    submitted, answered = tmp_path / "submitted", tmp_path / "answered"
    stuck = ctx.Process(target=stuck_rank, args=(1, daemon.socket, str(submitted)))
    peer_result = ctx.Queue()

    try:
        stuck.start()
        peer = ctx.Process(
            target=_put, args=(peer_result, stuck_peer, 0, daemon.socket, str(answered)), daemon=True
        )
        peer.start()
        deadline = time.monotonic() + 60
        while not (submitted.exists() and answered.exists()):
            assert time.monotonic() < deadline, "job 'stuck' never submitted and answered"
            time.sleep(0.05)
        # Job "stuck" sits on its own streams; another job's device collectives still run.
        start = time.monotonic()
        results = run_ranks(2, other_job, daemon.socket, timeout=60)
        assert time.monotonic() - start < 30
        values = [np.float32(1.0), np.float32(2.0)]
        for _ in range(3):  # the reference: three in-place allreduces
            values = [values[0] + values[1]] * 2
        assert results == [[float(v)] * 3 for v in values]
        stuck.kill()
        stuck.join(10)
        got = peer_result.get(timeout=90)
        peer.join(10)
        assert got["answered"] < 10, got
        assert got["error"], "the stuck job's next collective succeeded"
    finally:
        if stuck.is_alive():
            stuck.kill()
        daemon.stop_and_check()


def _put(queue, target, *args) -> None:
    queue.put(target(*args))


def release_right_after_answer(rank: int, socket: str, world: int, delay: float) -> dict:
    """Answered at enqueue, the client releases and frees its buffer at once (as a caching
    allocator may): the daemon's Release must answer only once its mapping closed, so the
    free never finds it still mapped (cudaFree before cudaIpcCloseMemHandle)."""
    with _client(rank, socket, world, "release-early") as client:
        allocation = emulated.Allocation(COUNT * 4, device=rank % 2)
        x = allocation.array(0, COUNT, "float32")
        x.host[...] = rank + 1.0
        client.register(x)
        client.barrier()
        x.set_async(np.full(COUNT, rank + 1.0, np.float32), delay=delay)  # work still pending
        client.allreduce_async(x, algorithm="ring").result(timeout=60)
        client.release(x)
        mapped = allocation.mapped_elsewhere()
        allocation.free()
        return {"mapped_after_release": mapped, "freed_while_mapped": list(emulated.freed_while_mapped)}


def test_release_after_an_early_answer_waits_for_the_work(slow):
    results = run_ranks(2, release_right_after_answer, slow.socket, 2, 0.5, timeout=120)
    for r in results:
        assert not r["mapped_after_release"], r
        assert r["freed_while_mapped"] == [], r
    rows = _status(slow.socket).devices
    assert all(row.open_allocations == 0 for row in rows)
