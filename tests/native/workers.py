"""Rank processes of the native-path tests (tests/native/test_native_daemon.py)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

import lpsync_client
from lpsync.types import ROOTED_OPS, Collective, blocks
from lpsync_client._convert import numpy_dtype
from tests.collective_cases import in_place_buffer

REPEATS = 4  # the first call plans, the second arms, the later ones ring the engine


def run_cases(
    rank: int,
    socket: str,
    world: int,
    cases: list[tuple],
    repeats: int = REPEATS,
    algorithms: list[str | None] | None = None,
) -> tuple[list, dict]:
    """Each case (tests/collective_cases.every_case) REPEATS times on shared-memory buffers
    made once (so the call repeats exactly), the inputs written afresh before each call,
    with ``algorithms``' algorithm for it forced (None: the daemon's choice); per case this
    rank's output bytes and input bytes after the last call, and how the calls went (how
    many the doorbell answered)."""
    results = []
    forced = algorithms or [None] * len(cases)
    with lpsync_client.connect(socket, job="cases", rank=rank, world_size=world, timeout=60) as client:
        for (op, dtype, reduce_op, in_place, root, count, inputs), algorithm in zip(
            cases, forced, strict=True
        ):
            dt = numpy_dtype(dtype)
            mine = np.frombuffer(inputs[rank], dt)
            c = Collective(op)
            n_in, n_out = blocks(op, world, rank, root)
            start = in_place_buffer(c, rank, world, count, mine, root) if in_place else mine
            x = client.empty(start.size, dt) if (in_place or n_in) else None
            out = None if in_place or not n_out else client.empty(count * n_out, dt)
            kwargs: dict = {"out": out, "algorithm": algorithm}
            if op in ("allreduce", "reduce", "reduce_scatter"):
                kwargs["op"] = reduce_op
            if op in ROOTED_OPS:
                kwargs["root"] = root
            for _ in range(repeats):
                if x is not None:
                    x[:] = start
                if out is not None:
                    out[:] = 0
                getattr(client, op)(x, **kwargs)
            target = x if out is None else out
            got = b"" if target is None or not n_out else target.tobytes()
            if in_place and n_out < n_in:  # this rank's block of the one buffer
                got = got[rank * count * dt.itemsize : (rank + 1) * count * dt.itemsize]
            results.append((got, b"" if x is None else x.tobytes()))
            for array in (x, out):
                if array is not None:
                    client.release(array)
        status = client.status()
        job = next(j for j in status.jobs if j.job == "cases")
        info = {"path": job.path, "answered": job.native_answered, "fallbacks": job.native_fallbacks}
    return results, info


def repeat_then(rank: int, socket: str, world: int, job: str, then: str, timeout: float = 30.0) -> dict:
    """An allreduce armed on every rank, then rank 1 does ``then``: "mismatch" (another
    count), "absent" (nothing, it waits), "die" (exits without a word) or "release" (its
    buffer released, a new one). Rank 0 repeats the armed call. What each saw."""
    report: dict = {}
    client = lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=timeout)
    x = client.zeros(16, "float32")
    for i in range(3):
        x[:] = rank + i
        client.allreduce(x)
        assert (x == sum(r + i for r in range(world))).all(), x
    report["armed"] = bool(client._armed)
    client.barrier()
    start = time.monotonic()
    try:
        if rank == 1 and then == "mismatch":
            client.allreduce(client.zeros(8, "float32"))
        elif rank == 1 and then == "absent":
            time.sleep(timeout + 3)
            report["slept"] = True
            return report
        elif rank == 1 and then == "die":
            time.sleep(0.5)  # rank 0 rings first
            os._exit(0)
        elif rank == 1 and then == "release":
            client.release(x)
            x = client.zeros(16, "float32")
            x[:] = 5
            client.allreduce(x)
            report["sum"] = x.tolist()
        else:
            x[:] = 5
            client.allreduce(x)
            report["sum"] = x.tolist()
    except lpsync_client.LpsyncError as error:
        report["error"] = (type(error).__name__, error.code, str(error))
    report["seconds"] = time.monotonic() - start
    client.close()
    return report


def big_then_die(rank: int, socket: str, count: int, timeout: float = 30.0) -> dict:
    """Two ranks arm an allreduce of ``count`` float32 (the engine runs it by tiles on its
    threads); then both call it again and rank 1 exits without a word a moment after it
    rang, while the engine runs the program or before: rank 0 calls on until an error.
    What rank 0 saw: the calls that completed (and whether each summed right), the error
    and how long it took."""
    client = lpsync_client.connect(socket, job="bigdies", rank=rank, world_size=2, timeout=timeout)
    x = client.zeros(count, "float32")
    for i in range(3):
        x[:] = rank + i
        client.allreduce(x)
        assert (x == 1 + 2 * i).all()
    armed = bool(client._armed)
    client.barrier()
    if rank == 1:
        x[:] = 1
        threading.Thread(target=client.allreduce, args=(x,), daemon=True).start()
        time.sleep(0.003)  # it rang; the engine runs the 4 passes over its memory now
        os._exit(0)
    report: dict = {"armed": armed, "completed": 0, "wrong": 0}
    start = time.monotonic()
    try:
        for _ in range(10):
            x[:] = 2
            client.allreduce(x)
            report["completed"] += 1
            report["wrong"] += int(not (x == 3).all())
    except lpsync_client.LpsyncError as error:
        report["error"] = (type(error).__name__, error.code, str(error))
    report["seconds"] = time.monotonic() - start
    client.close()
    return report


def ring_until_killed(rank: int, socket: str, ready, timeout: float = 60.0) -> dict:
    """Both ranks arm an allreduce; then rank 0 rings alone (rank 1 waits for the daemon to
    be killed): what rank 0 saw, and when."""
    client = lpsync_client.connect(socket, job="killed", rank=rank, world_size=2, timeout=timeout)
    x = client.zeros(4, "float32")
    for _ in range(3):
        client.allreduce(x)
    armed = bool(client._armed)
    ready.put(rank)
    if rank == 1:
        time.sleep(timeout)
        return {}
    start = time.monotonic()
    try:
        client.allreduce(x)
        return {"armed": armed, "error": None}
    except lpsync_client.LpsyncError as error:
        return {
            "armed": armed,
            "error": (type(error).__name__, str(error)),
            "seconds": time.monotonic() - start,
        }
    finally:
        client.close()


def run_cases_on_nodes(
    rank: int, sockets: list[str], per_node: int, world: int, cases: list[tuple], repeats: int
) -> tuple:
    """run_cases on this rank's node's daemon (node-major ranks, as torchrun numbers them)."""
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    return run_cases(rank, sockets[rank // per_node], world, cases, repeats)


def repeat_then_on_nodes(
    rank: int, sockets: list[str], per_node: int, world: int, job: str, then: str
) -> dict:
    """repeat_then on this rank's node's daemon."""
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    return repeat_then(rank, sockets[rank // per_node], world, job, then)


def async_mix(rank: int, sockets: list[str], per_node: int, world: int, calls: int) -> dict:
    """Two asynchronous allreduces in flight at once, as a comm hook's buckets are, with a
    blocking broadcast and a call seen once in between now and then: every result checked
    against the closed form; how many the engine answered."""
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    wrong = 0
    with lpsync_client.connect(
        sockets[rank // per_node], job="async", rank=rank, world_size=world, timeout=60
    ) as client:
        x, y, z = client.zeros(30_000, "float32"), client.zeros(7, "int32"), client.zeros(5, "float64")
        for i in range(calls):
            x[:] = rank + i
            y[:] = rank * i
            first, second = client.allreduce_async(x), client.allreduce_async(y)
            first.result(60)
            second.result(60)
            wrong += int(not (x == sum(range(world)) + world * i).all())
            wrong += int(not (y == i * sum(range(world))).all())
            if i % 7 == 3:
                z[:] = rank
                client.broadcast(z, root=i % world)
                wrong += int(not (z == i % world).all())
            if i % 11 == 5:  # a call seen once: the general path between armed ones
                once = client.zeros(3 + i, "int64")
                once[:] = 1
                client.allreduce(once)
                wrong += int(not (once == world).all())
                client.release(once)
        status = client.status()
        job = next(j for j in status.jobs if j.job == "async")
    return {"wrong": wrong, "answered": job.native_answered - job.native_fallbacks}
