"""Client processes for the point-to-point tests (spawned: importable by name)."""

from __future__ import annotations

import os
import time

import numpy as np

import lpsync_client
from tests.daemon.layout_workers import _store


def ring_and_tags(rank: int, world: int, sockets: list[str], port: int, job: str) -> list[str]:
    """Each rank sends to the next (a ring, async both ways), then messages whose tags are
    received in the other order than they were sent, then a large message; the failures."""
    failures: list[str] = []
    with lpsync_client.connect(
        sockets[rank], job=job, rank=rank, world_size=world, store=_store(rank, world, port), timeout=30
    ) as c:
        right, left = (rank + 1) % world, (rank - 1) % world
        for step in range(3):
            out = c.zeros(5, "int64")
            out[:] = rank * 100 + step
            got = c.zeros(5, "int64")
            sent = c.send_async(out, right)
            c.recv(got, left)
            sent.result(30)
            if list(got) != [left * 100 + step] * 5:
                failures.append(f"ring step {step}: got {list(got)} from {left}")
        # Tag 7 sent before tag 3; the receiver takes tag 3 first: tags never wait on each other.
        if rank == 0:
            a, b = np.full(3, 7.0, np.float32), np.full(3, 3.0, np.float32)
            f7, f3 = c.send_async(a, 1, tag=7), c.send_async(b, 1, tag=3)
            f7.result(30)
            f3.result(30)
        elif rank == 1:
            x, y = np.zeros(3, np.float32), np.zeros(3, np.float32)
            c.recv(y, 0, tag=3)
            c.recv(x, 0, tag=7)
            if list(x) != [7.0] * 3 or list(y) != [3.0] * 3:
                failures.append(f"tags: tag 7 got {list(x)}, tag 3 got {list(y)}")
        # A large message (the pipeline, not the agreement, across nodes).
        big = np.arange(400_000, dtype=np.float64) + rank
        if rank == world - 1:
            c.send(big, 0, tag=1)
        elif rank == 0:
            into = np.zeros_like(big)
            c.recv(into, world - 1, tag=1)
            if not np.array_equal(into, np.arange(400_000, dtype=np.float64) + world - 1):
                failures.append("large message differs")
        c.barrier()
    return failures


def wrong_size(rank: int, socket: str, job: str) -> tuple[str, float]:
    """Rank 0 sends 8 elements, rank 1 posts a receive of 6: both fail at once, naming both."""
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=20) as c:
        started = time.monotonic()
        try:
            if rank == 0:
                c.send(np.ones(8, np.float32), 1)
            else:
                c.recv(np.zeros(6, np.float32), 0)
            return "no error", 0.0
        except lpsync_client.LpsyncError as error:
            return f"{type(error).__name__}: {error}", time.monotonic() - started


def dies_before_sending(rank: int, socket: str, job: str) -> tuple[str, float]:
    """Rank 0 exits without sending; rank 1's pending receive fails within the bound."""
    import os

    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=60) as c:
        c.barrier()
        if rank == 0:
            c.ping()
            c.send(np.ones(1, np.float32), 1, tag=9)  # opens the pair job, delivered
            os._exit(0)
        c.recv(np.zeros(1, np.float32), 0, tag=9)
        started = time.monotonic()
        try:
            c.recv(np.zeros(1, np.float32), 0, tag=9)
            return "no error", 0.0
        except lpsync_client.LpsyncError as error:
            return f"{type(error).__name__}: {error}", time.monotonic() - started


def any_source(rank: int, world: int, sockets: list[str], port: int, job: str) -> list[str]:
    """Rank 0 receives from any source (checked against what each rank sent), a receive
    from a named source issued first keeps that source's message, two async any-source
    receives complete in order, a large message, and a receive nobody sends to times out."""
    failures: list[str] = []
    with lpsync_client.connect(
        sockets[rank], job=job, rank=rank, world_size=world, store=_store(rank, world, port), timeout=30
    ) as c:
        # Every other rank sends two messages with tag 5: rank 0 takes them in any order,
        # each source's in its order.
        if rank:
            for i in range(2):
                c.send(np.full(4, rank * 10 + i, np.int64), 0, tag=5)
        else:
            seen: dict[int, int] = {}
            for _ in range(2 * (world - 1)):
                got = np.zeros(4, np.int64)
                source = c.recv_any(got, tag=5)
                i = seen.get(source, 0)
                seen[source] = i + 1
                if list(got) != [source * 10 + i] * 4:
                    failures.append(f"tag 5: from {source} got {list(got)}, expected {source * 10 + i}")
            if seen != {r: 2 for r in range(1, world)}:
                failures.append(f"tag 5: messages by source {seen}")
        c.barrier()
        # A receive from rank 2 issued first keeps rank 2's message, although it is sent
        # (and announced) before rank 1's: the any-source receive gets rank 1's.
        if rank == 0:
            named = np.zeros(2, np.float32)
            pending = c.recv_async(named, 2, tag=6)
            c.barrier()
            anyone = np.zeros(2, np.float32)
            source = c.recv_any(anyone, tag=6)
            pending.result(30)
            if source != 1 or list(anyone) != [1.0, 1.0] or list(named) != [2.0, 2.0]:
                failures.append(f"tag 6: any source got {list(anyone)} from {source}, rank 2's {list(named)}")
        else:
            c.barrier()
            if rank == 2:
                c.send(np.full(2, 2.0, np.float32), 0, tag=6)
            elif rank == 1:
                time.sleep(0.3)  # after rank 2's announcement
                c.send(np.full(2, 1.0, np.float32), 0, tag=6)
        # Two async any-source receives, then a large message (the pipeline across nodes).
        big = np.arange(300_000, dtype=np.float64)
        if rank == 0:
            a, b = np.zeros(1, np.int32), np.zeros(1, np.int32)
            fa, fb = c.recv_any_async(a, tag=7), c.recv_any_async(b, tag=7)
            sources = sorted([fa.result(30), fb.result(30)])
            if sources != [1, 2] or sorted([int(a[0]), int(b[0])]) != [1, 2]:
                failures.append(f"tag 7: sources {sources}, values {a[0]}, {b[0]}")
            into = np.zeros_like(big)
            source = c.recv_any(into, tag=9)
            if source != world - 1 or not np.array_equal(into, big + source):
                failures.append(f"tag 9: the large message from {source} differs")
        else:
            if rank in (1, 2):
                c.send(np.full(1, rank, np.int32), 0, tag=7)
            if rank == world - 1:
                c.send(big + rank, 0, tag=9)
        c.barrier()
        if rank == 0:
            started = time.monotonic()
            try:
                c.recv_any(np.zeros(1, np.int32), tag=8, timeout=1.0)
                failures.append("tag 8: a receive nobody sends to returned")
            except lpsync_client.CollectiveTimeoutError as error:
                if "any source" not in str(error) or time.monotonic() - started > 10:
                    failures.append(f"tag 8: {error} after {time.monotonic() - started:.1f} s")
        c.barrier()
    return failures


def mapped_segments(pid: int) -> set[str]:
    """The /dev/shm segments of lpsync mapped into process ``pid`` now (an unlinked one
    stays listed, " (deleted)", while it is mapped)."""
    with open(f"/proc/{pid}/maps") as maps:
        lines = maps.read().splitlines()
    return {line.split("/dev/shm/", 1)[1].split()[0] for line in lines if "/dev/shm/lpsync-" in line}


def repeated_pair(rank: int, sockets: list[str], pids: list[int], port: int, job: str, calls: int) -> dict:
    """Rank 0 sends, rank 1 receives, ``calls`` times on the same buffers (blocking, then
    asynchronous, then blocking through plain numpy arrays, then messages of six shapes
    in turn), each message checked against numpy; then the main client's buffers are
    released and, after the client closed, what its daemon (``sockets[rank]``, process
    ``pids[rank]``) still maps of them and of the pair jobs' copies."""
    found: dict = {"wrong": []}
    daemon_pid = pids[rank]
    store = _store(rank, 2, port)
    with lpsync_client.connect(sockets[rank], job=job, rank=rank, world_size=2, store=store, timeout=30) as c:
        x = c.zeros(6, "float32")  # in the main client's shared memory
        plain = np.zeros(1000, np.int64)  # in none
        for call in range(calls):
            want = np.arange(6, dtype=np.float32) * (call + 1) - 0.5
            if rank == 0:
                x[:] = want
                c.send(x, 1)
            else:
                x[:] = -1
                c.recv(x, 0)
                if not np.array_equal(x, want):
                    found["wrong"].append(("blocking", call, x.tolist()))
        for call in range(calls):  # asynchronous (what torch's isend/irecv call), tag 5
            want = np.arange(6, dtype=np.float32) + 100 * call
            if rank == 0:
                x[:] = want
                c.send_async(x, 1, tag=5).result(30)
            else:
                x[:] = -1
                c.recv_async(x, 0, tag=5).result(30)
                if not np.array_equal(x, want):
                    found["wrong"].append(("async", call, x.tolist()))
        for call in range(calls):  # a numpy array the client does not own, tag 9
            want = np.arange(1000, dtype=np.int64) * (call + 3)
            if rank == 0:
                plain[:] = want
                c.send(plain, 1, tag=9)
            else:
                plain[:] = 0
                c.recv(plain, 0, tag=9)
                if not np.array_equal(plain, want):
                    found["wrong"].append(("plain", call, plain[:4].tolist()))
        for call in range(2 * 6):  # 6 shapes in turn: more than a pair job keeps copies of
            want = np.arange(call % 6 + 1, dtype=np.float64) - call
            got = want.copy() if rank == 0 else np.zeros_like(want)
            c.send(got, 1, tag=11) if rank == 0 else c.recv(got, 0, tag=11)
            if not np.array_equal(got, want):
                found["wrong"].append(("shapes", call, got.tolist()))
        status = c.status()
        found["jobs"] = {
            j.job: (j.path, j.native_answered - j.native_fallbacks, j.armed_plans)
            for j in status.jobs
            if "/p2p/" in j.job
        }
        # This rank's segments (the main client's, its pair jobs' copies, any scratch): the
        # ones this process maps too; and the one x lies in.
        own = mapped_segments(os.getpid())
        segment = c._find(x)[0].mapping.name
        found["main_mapped"] = segment in mapped_segments(daemon_pid)
        c.release(x)
        del x
        found["main_left"] = _still_mapped(daemon_pid, {segment})
        c.barrier()
    found["all_left"] = _still_mapped(daemon_pid, own)
    found["owned"] = len(own)
    return found


def _still_mapped(pid: int, segments: set[str]) -> list[str]:
    """Which of ``segments`` process ``pid`` still maps after 5 s (none: at once)."""
    deadline = time.monotonic() + 5.0
    while (left := segments & mapped_segments(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(left)


def armed_then(rank: int, socket: str, job: str, then: str) -> tuple[str, float] | None:
    """Four messages 0 -> 1 on the same arrays (the last two rung), then ``then``: "dies"
    (rank 0 exits instead of sending the fifth) or "size" (rank 1 receives the fifth into
    an array of another size). Rank 1's error (rank 0's too for "size") and how long it
    took to come."""
    import os

    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=60) as c:
        x = c.zeros(8, "float32")
        for call in range(4):
            x[:] = call if rank == 0 else -1
            c.send(x, 1) if rank == 0 else c.recv(x, 0)
            assert np.all(x == call), (call, x)
        c.barrier()
        if then == "dies" and rank == 0:
            os._exit(0)
        started = time.monotonic()
        try:
            if rank == 0:
                c.send(x, 1)
            else:
                c.recv(x if then == "dies" else c.zeros(6, "float32"), 0)
            return "no error", 0.0
        except lpsync_client.LpsyncError as error:
            return f"{type(error).__name__}: {error}", time.monotonic() - started
