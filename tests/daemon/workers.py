"""Client-side bodies run in spawned processes by the tests (importable by name)."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

import lpsync_client
from lpsync_client.wire import ROOTED_OPS, blocks

OPS = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather", "scatter", "alltoall")
_REDUCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}


def dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def inputs(op: str, dt: np.dtype, rank: int, world: int, count: int, seed: int, root: int = 0) -> np.ndarray:
    """Integer values in 1..3: every reduction of a few ranks is exact in every dtype, so
    results can be compared bit for bit whatever order the algorithm reduces in."""
    n = count * blocks(op, world, rank, root)[0]
    rng = np.random.default_rng(seed * 1000 + rank)
    return rng.integers(1, 4, n).astype(dt)


def expected(
    op: str, rop: str, dt: np.dtype, rank: int, world: int, count: int, root: int, seed: int
) -> np.ndarray | None:
    all_in = [inputs(op, dt, r, world, count, seed, root) for r in range(world)]
    mine = slice(rank * count, (rank + 1) * count)
    if op == "broadcast":
        return all_in[root]
    if op == "allgather" or (op == "gather" and rank == root):
        return np.concatenate(all_in)
    if op == "gather":
        return None  # a non-root receives nothing
    if op == "scatter":
        return all_in[root][mine]
    if op == "alltoall":
        return np.concatenate([x[mine] for x in all_in])
    acc = all_in[0].copy()
    for x in all_in[1:]:
        _REDUCE[rop](acc, x, out=acc)
    if rop == "avg":
        if np.issubdtype(dt, np.integer):
            np.floor_divide(acc, world, out=acc)
        else:
            np.divide(acc, np.asarray(world, dtype=dt), out=acc)
    if op == "reduce":
        return acc if rank == root else None
    if op == "reduce_scatter":
        return acc[rank * count : (rank + 1) * count]
    return acc


def check_cases(
    rank: int, socket: str, job: str, world: int, cases: list, trigger: str = "auto"
) -> list[str]:
    """Run every (op, dtype, rop, count, in_place, algorithm, root) case; returns
    [failure descriptions] plus a digest of all results (for cross-rank bitwise checks)."""
    failures: list[str] = []
    digest = hashlib.sha256()
    with lpsync_client.connect(
        socket, job=job, rank=rank, world_size=world, timeout=30, trigger=trigger
    ) as client:
        for seed, (op, dname, rop, count, in_place, algorithm, root, shm) in enumerate(cases):
            dt = dtype(dname)
            label = f"{op} {dname} {rop} n={count} in_place={in_place} algo={algorithm} root={root} shm={shm}"
            x = inputs(op, dt, rank, world, count, seed, root)
            make = (lambda n, d=dt: client.zeros(n, d.name)) if shm else (lambda n, d=dt: np.zeros(n, d))
            kwargs: dict = {"algorithm": algorithm}
            if op in ("allreduce", "reduce", "reduce_scatter"):
                kwargs["op"] = rop
            if op in ROOTED_OPS:
                kwargs["root"] = root
            n_in, n_out = blocks(op, world, rank, root)
            if in_place:
                # One buffer, the larger side; the smaller is this rank's block of it.
                buf = make(count * max(n_in, n_out))
                if n_in < n_out and n_in:
                    buf[rank * count : (rank + 1) * count] = x
                elif n_in >= n_out:
                    buf[:] = x
                before = buf.copy()
                getattr(client, op)(buf, **kwargs)
                result = buf[rank * count : (rank + 1) * count] if n_out < n_in else buf
            else:
                src = make(max(x.size, 1))[: x.size]  # a scatter's non-root has no input
                src[:] = x
                out = make(count * n_out)
                getattr(client, op)(src, out=out, **kwargs)
                if not np.array_equal(src.view(np.uint8), x.view(np.uint8)):
                    failures.append(f"{label}: out-of-place input was modified")
                result = out
            want = expected(op, rop, dt, rank, world, count, root, seed)
            if want is None:  # reduce at a non-root
                if in_place and not np.array_equal(buf.view(np.uint8), before.view(np.uint8)):
                    failures.append(f"{label}: non-root buffer of reduce was written")
                continue
            if not np.array_equal(np.asarray(result).view(np.uint8), want.view(np.uint8)):
                failures.append(f"{label}: got {np.asarray(result)[:6]} want {want[:6]}")
            digest.update(np.ascontiguousarray(result).view(np.uint8).tobytes())
    return [*failures, "digest:" + digest.hexdigest()]


def mismatch(rank: int, socket: str, job: str) -> dict:
    """Rank 0 and rank 1 disagree on count (and rank 1 on dtype in the second call)."""
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=10) as c:
        out = {}
        x = c.zeros(8 if rank == 0 else 4, "float32")
        try:
            c.allreduce(x)
        except lpsync_client.MismatchError as error:
            out["count"] = (type(error).__name__, str(error), error.buffer_state)
        y = c.zeros(4, "float32" if rank == 0 else "int32")
        try:
            c.allreduce(y, out=c.zeros(4, y.dtype))
        except lpsync_client.InvalidArgumentError as error:
            out["dtype"] = (type(error).__name__, str(error), error.buffer_state)
        c.barrier()  # the job still works afterwards
        z = c.zeros(3, "int32")
        z[:] = rank + 1
        c.allreduce(z)
        out["after"] = z.tolist()
        return out


def attach_and_wait(
    rank: int, socket: str, job: str, world: int, ready, hold: float, trigger: str = "auto"
) -> None:
    """Attach, allocate buffers, start an allreduce (rank != 0 only waits), then sleep to be
    killed."""
    import time

    c = lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=60, trigger=trigger)
    c.zeros(1 << 16, "float32")
    c.register(np.zeros(100, np.float64))
    ready.set()
    time.sleep(hold)


def isolated(rank: int, socket: str, job: str, value: int) -> list:
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=20) as c:
        results = []
        for i in range(20):
            x = c.zeros(16, "int64")
            x[:] = value * (rank + 1) + i
            c.allreduce(x)
            results.append(int(x[0]))
        return results


def partial_inplace(rank: int, socket: str, job: str) -> list:
    """A large in-place allreduce whose timeout passes while it runs: PARTIAL, not INTACT.
    Tried a few times (the arrival wait itself may take the whole budget: then INTACT)."""
    states = []
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=30) as c:
        x = c.zeros(32 << 20, "float32")  # 128 MiB: far longer than the 20 ms budget
        for _ in range(3):
            c.barrier()
            try:
                c.allreduce(x, algorithm="lp", timeout=0.02)
                states.append("OK")
            except lpsync_client.TimeoutError as error:
                states.append(error.buffer_state)
        src = c.zeros(32 << 20, "float32")
        src[:] = 1
        out = c.zeros(32 << 20, "float32")
        c.barrier()
        try:
            c.allreduce(src, out=out, algorithm="lp", timeout=0.02)
        except lpsync_client.TimeoutError as error:
            states.append(f"out-of-place:{error.buffer_state}:{int(src.min())}:{int(src.max())}")
    return states


def async_and_barrier(rank: int, socket: str, job: str) -> list:
    """Several collectives in flight at once (futures), completed in order."""
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=20) as c:
        bufs = [c.zeros(5, "int32") for _ in range(6)]
        for i, b in enumerate(bufs):
            b[:] = (rank + 1) * (i + 1)
        futures = [c.allreduce_async(b) for b in bufs]
        futures.append(c.barrier_async())
        big = np.full(100_000, rank + 1, np.float32)  # staged: not in shared memory
        futures.append(c.allreduce_async(big, op="max"))
        results = [f.result(timeout=20) for f in futures]
        assert results[-1] is big
        return [int(b[0]) for b in bufs] + [float(big[0])]


def bad_data_movement(rank: int, socket: str, job: str) -> list[str]:
    """Requests the client or the daemon must refuse with a reason; then one that works."""
    got = []
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=10) as client:
        x = client.zeros(4, "float32")
        try:
            client.alltoall(x, None)
            got.append("no error")
        except lpsync_client.InvalidArgumentError as error:
            got.append(str(error))
        try:
            client.gather(x[:2], root=5, out=x if rank == 5 else None)
            got.append("no error")
        except lpsync_client.InvalidArgumentError as error:
            got.append(str(error))
        y = client.zeros(4, "float32")
        y[:] = rank + 1
        out = client.zeros(4, "float32")
        client.alltoall(y, out)
        got.append("ok" if list(out) == [1, 1, 2, 2] else f"wrong: {list(out)}")
    return got
