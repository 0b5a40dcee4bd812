"""Client bodies of the layout tests (test_layout.py): each rank attaches to the daemon
its test names (any node, any numbering), with or without LOCAL_RANK/LOCAL_WORLD_SIZE,
and discovers its job's layout through a torch TCPStore (the plain client, no torch
backend); results are checked against numpy."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np

import lpsync_client

COUNT_SMALL, COUNT_LARGE = 37, 40_000  # 40 000 float32 (160 KB) is past the riding size


def _env(hints: tuple[int, int] | None) -> None:
    """torchrun's LOCAL_* variables as the test sets them; none at all by default."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    if hints is not None:
        os.environ.update(LOCAL_RANK=str(hints[0]), LOCAL_WORLD_SIZE=str(hints[1]))


def _store(rank: int, world: int, port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))


def _input(rank: int, count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(1000 * seed + rank).standard_normal(count).astype(np.float32)


def ops(rank: int, world: int, sockets: list[str], port: int, job: str) -> dict:
    """Every data collective, small (riding the agreement) and large (the pipeline), with
    roots on every node; returns what each rank saw and the numpy reference's verdict."""
    _env(None)
    started = time.monotonic()
    with lpsync_client.connect(
        sockets[rank], job=job, rank=rank, world_size=world, store=_store(rank, world, port)
    ) as c:
        attached = time.monotonic() - started
        failures = every_op(c, rank, world)
        return {
            "node": c.node.node_rank,
            "rank_nodes": c.rank_nodes,
            "attach_seconds": attached,
            "failures": failures,
        }


def every_op(c: lpsync_client.Client, rank: int, world: int) -> list[str]:
    """Each data collective once small and once large on ``c``, against numpy; then a
    barrier. What differed, one line each."""
    failures: list[str] = []
    for count in (COUNT_SMALL, COUNT_LARGE):
        inputs = [_input(r, count, 1) for r in range(world)]
        x = c.zeros(count, "float32")
        x[:] = inputs[rank]
        c.allreduce(x)
        _close(failures, f"allreduce {count}", x, np.sum(inputs, axis=0))
        for root in range(world) if count == COUNT_SMALL else (world - 1,):
            x[:] = inputs[rank]
            c.broadcast(x, root=root)
            _close(failures, f"broadcast {count} root {root}", x, inputs[root], exact=True)
        root = world - 1
        x[:] = inputs[rank]
        c.reduce(x, root=root)
        if rank == root:
            _close(failures, f"reduce {count} root {root}", x, np.sum(inputs, axis=0))
        gathered = c.zeros(count * world, "float32")
        x[:] = inputs[rank]
        c.allgather(x, gathered)
        _close(failures, f"allgather {count}", gathered, np.concatenate(inputs), exact=True)
        blocks = [_input(r, count * world, 2) for r in range(world)]
        full = c.zeros(count * world, "float32")
        full[:] = blocks[rank]
        c.reduce_scatter(full, out=x)
        want = np.sum(blocks, axis=0)[rank * count : (rank + 1) * count]
        _close(failures, f"reduce_scatter {count}", x, want)
    c.barrier()
    return failures


def one_allreduce(rank: int, world: int, sockets: list[str], port: int, job: str) -> dict:
    """Attach with no LOCAL_* variables, one allreduce: how long from connect() to result."""
    _env(None)
    store = _store(rank, world, port)  # torch imported and the store up: not timed
    started = time.monotonic()
    with lpsync_client.connect(sockets[rank], job=job, rank=rank, world_size=world, store=store) as c:
        x = c.zeros(1000, "float64")
        x[:] = rank + 1
        c.allreduce(x)
        return {"seconds": time.monotonic() - started, "ok": bool((x == world * (world + 1) / 2).all())}


class _SlowReader:
    """A store whose reads come ``delay`` seconds late: a rank that is slow to read the
    layout table (a loaded machine)."""

    def __init__(self, store, delay: float) -> None:
        self.store, self.delay = store, delay

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        time.sleep(self.delay)
        return self.store.get(key)


def inline_store_late_reader(rank: int, world: int, sockets: list[str], port: int, job: str) -> bool:
    """Each rank passes its store inline (nothing else holds it: rank 0's hosts the
    TCPStore); rank 1 reads the table 2 s late, after rank 0's connect() has returned. Then
    one allreduce and a barrier; whether the sum is right."""
    _env(None)
    store = _store(rank, world, port)
    if rank == 1:
        store = _SlowReader(store, 2.0)
    with lpsync_client.connect(sockets[rank], job=job, rank=rank, world_size=world, store=store) as c:
        del store  # the client's reference is the only one left
        x = c.zeros(4, "float32")
        x[:] = rank + 1
        c.allreduce(x)
        c.barrier()
        return bool((x == world * (world + 1) / 2).all())


def refused(
    rank: int, world: int, sockets: list[str], port: int, job: str, hints: list[tuple[int, int]] | None = None
) -> dict:
    """Attach (hints[rank] as LOCAL_RANK/LOCAL_WORLD_SIZE) and run one allreduce: the error
    this rank got, and after how many seconds."""
    _env(hints[rank] if hints else None)
    store = _store(rank, world, port)
    started = time.monotonic()
    try:
        with lpsync_client.connect(
            sockets[rank], job=job, rank=rank, world_size=world, store=store, timeout=60
        ) as c:
            x = c.zeros(8, "float32")
            c.allreduce(x)
        return {"error": None, "seconds": time.monotonic() - started}
    except lpsync_client.LpsyncError as error:
        return {
            "error": f"{type(error).__name__}: {error}",
            "code": error.code,
            "seconds": time.monotonic() - started,
        }


def _close(failures: list[str], what: str, got: np.ndarray, want: np.ndarray, exact: bool = False) -> None:
    ok = np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-5, atol=1e-5)
    if not ok:
        failures.append(f"{what}: largest difference {np.max(np.abs(got - want)) if got.size else 0}")


def plain(
    rank: int,
    world: int,
    sockets: list[str],
    job: str,
    hints: list[tuple[int, int]] | None = None,
    steps: int = 0,
) -> dict:
    """The README's call and nothing more (job, rank, world size; hints[rank] as
    LOCAL_RANK/LOCAL_WORLD_SIZE only where given), then every op and ``steps`` allreduces
    against numpy; or the error this rank got, and after how many seconds."""
    _env(hints[rank] if hints else None)
    started = time.monotonic()
    try:
        with lpsync_client.connect(sockets[rank], job=job, rank=rank, world_size=world, timeout=60) as c:
            failures = every_op(c, rank, world)
            x = c.zeros(100, "float64")
            for step in range(steps):
                x[:] = rank + step
                c.allreduce(x)
                want = sum(r + step for r in range(world))
                if not (x == want).all():
                    failures.append(f"allreduce step {step}: {x[0]} != {want}")
            return {"node": c.node.node_rank, "failures": failures, "seconds": time.monotonic() - started}
    except lpsync_client.LpsyncError as error:
        return {
            "error": f"{type(error).__name__}: {error}",
            "code": error.code,
            "seconds": time.monotonic() - started,
        }


def jax_pytree(rank: int, world: int, sockets: list[str], job: str) -> list[str]:
    """lpsync_client.jax from the environment alone (RANK, WORLD_SIZE, LPSYNC_SOCKET,
    LPSYNC_JOB; no LOCAL_WORLD_SIZE), a pytree summed and averaged against numpy; what
    differed."""
    _env(None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LPSYNC_SOCKET=sockets[rank], LPSYNC_JOB=job)
    import jax.numpy as jnp

    import lpsync_client.jax as lpj

    def tree(r: int) -> dict:
        return {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1),
            "b": np.full(5, r, np.int32),
            "inner": [np.linspace(0, 1, 7, dtype=np.float64) + r],
        }

    mine = tree(rank)
    trees = [tree(r) for r in range(world)]
    failures: list[str] = []
    summed = lpj.allreduce({k: _jax(jnp, v) for k, v in mine.items()}, op="sum")
    averaged = lpj.pmean({"w": jnp.asarray(mine["w"])})
    want_w = np.sum([t["w"] for t in trees], axis=0)
    _close(failures, "sum w", np.asarray(summed["w"]), want_w)
    _close(failures, "sum b", np.asarray(summed["b"]), np.sum([t["b"] for t in trees], axis=0), exact=True)
    _close(
        failures, "sum inner", np.asarray(summed["inner"][0]), np.sum([t["inner"][0] for t in trees], axis=0)
    )
    _close(failures, "mean w", np.asarray(averaged["w"]), want_w / world)
    lpj.default_client().close()
    return failures


def _jax(jnp, value):
    return [jnp.asarray(v) for v in value] if isinstance(value, list) else jnp.asarray(value)


def plain_p2p(rank: int, world: int, sockets: list[str], job: str) -> list[str]:
    """Point-to-point with no hint and no store: a ring of sends (async both ways), then
    rank 0 receives from any source a message from every other rank; what differed."""
    _env(None)
    failures: list[str] = []
    with lpsync_client.connect(sockets[rank], job=job, rank=rank, world_size=world, timeout=60) as c:
        c.barrier()  # the job's layout is settled on every node: its pair jobs take theirs
        right, left = (rank + 1) % world, (rank - 1) % world
        out, got = c.zeros(5, "int64"), c.zeros(5, "int64")
        out[:] = rank * 100
        sent = c.send_async(out, right)
        c.recv(got, left)
        sent.result(60)
        if list(got) != [left * 100] * 5:
            failures.append(f"ring: got {list(got)} from {left}")
        if rank:
            c.send(np.full(4, rank * 10, np.int64), 0, tag=5)
        else:
            sources = []
            for _ in range(world - 1):
                x = np.zeros(4, np.int64)
                source = c.recv_any(x, tag=5)
                sources.append(source)
                if list(x) != [source * 10] * 4:
                    failures.append(f"any source: from {source} got {list(x)}")
            if sorted(sources) != list(range(1, world)):
                failures.append(f"any source: sources {sources}")
        c.barrier()
    return failures
