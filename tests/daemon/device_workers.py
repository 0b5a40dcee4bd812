"""Client processes for the device tests (spawned: importable top-level functions)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import lpsync_client
from lpsync_client import emulated
from lpsync_client._convert import numpy_dtype


def _client(rank: int, socket: str, world: int, job: str) -> lpsync_client.Client:
    return lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=60)


def run_cases(rank: int, socket: str, world: int, devices: list[int], cases: list[tuple]) -> list:
    """Each case: (op, dtype, reduce_op, in_place, root, count, inputs of every rank as bytes).
    Returns, per case, this rank's output bytes and its input buffer's bytes afterwards."""
    results = []
    with _client(rank, socket, world, "devices") as client:
        device = devices[rank]
        for op, dtype, reduce_op, in_place, root, count, inputs in cases:
            dt = numpy_dtype(dtype)
            mine = np.frombuffer(inputs[rank], dt)
            if in_place and op == "allgather":
                buf = np.zeros(world * count, dt)
                buf[rank * count:(rank + 1) * count] = mine
                x, out = emulated.asarray(buf, device, dtype), None
            else:
                x = emulated.asarray(mine, device, dtype)
                out = None
                if not in_place:
                    size = count * world if op == "allgather" else count
                    out = emulated.zeros(size, dtype, device)
            kwargs = {"out": out}
            if op in ("allreduce", "reduce", "reduce_scatter"):
                kwargs["op"] = reduce_op
            if op in ("broadcast", "reduce"):
                kwargs["root"] = root
            getattr(client, op)(x, **kwargs)
            target = x if out is None else out
            if in_place and op == "reduce_scatter":
                target = x[rank * count:(rank + 1) * count]
            results.append((target.get().tobytes(), x.get().tobytes()))
            client.release(x)
            if out is not None:
                client.release(out)
    return results


def ordered_after_stream(rank: int, socket: str, world: int, delay: float) -> list[float]:
    """A write queued on the current stream (after ``delay`` s) must be what is reduced."""
    with _client(rank, socket, world, "ordering") as client:
        x = emulated.zeros(1000, "float32", device=rank % 2)
        client.register(x)
        client.barrier()
        x.set_async(np.full(1000, rank + 1.0, np.float32), delay=delay)
        client.allreduce(x)
        return x.get()[:3].tolist()


def register_and_sleep(rank: int, socket: str, ready_file: str) -> None:
    """Register device buffers, say so, then wait to be killed (SIGKILL: no cleanup)."""
    client = lpsync_client.connect(socket, job=f"victim{rank}", rank=0, world_size=1)
    alloc = emulated.Allocation(1 << 20, device=1)
    client.register(alloc.array(0, 1000, "float32"))
    client.register(alloc.array(8192, 1000, "float32"))
    client.allreduce(alloc.array(0, 1000, "float32"))
    with open(ready_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def kill_self_after_register(socket: str, ready_file: str) -> None:
    register_and_sleep(0, socket, ready_file)
    os.kill(os.getpid(), signal.SIGKILL)


def run_cases_on_nodes(rank: int, sockets: list[str], per_node: int, world: int,
                       devices: list[int], cases: list[tuple]) -> list:
    """run_cases for a multi-node job: node-major ranks, each on its node's daemon."""
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    return run_cases(rank, sockets[rank // per_node], world, devices, cases)
