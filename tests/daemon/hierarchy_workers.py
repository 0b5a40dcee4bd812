"""Client processes of the hierarchical device tests (spawned: importable functions)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np

import lpsync_client
import tests.daemon.device_workers as device_workers
from tests.daemon.device_workers import _client, run_cases


def _on_node(rank: int, node_of: list[int]) -> int:
    """This rank's node; LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun would set them."""
    node = node_of[rank]
    mine = [r for r, n in enumerate(node_of) if n == node]
    os.environ["LOCAL_RANK"] = str(mine.index(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(len(mine))
    return node


def cases_on_nodes(
    rank: int,
    sockets: list[str],
    node_of: list[int],
    devices: list[int],
    cases: list[tuple],
    algorithm: str,
    store_port: int = 0,
    framework: str = "emulated",
) -> list:
    """run_cases for a job whose ranks sit on the nodes ``node_of`` names; with
    ``store_port`` the ranks discover that layout through a TCPStore (nodes of unequal
    size are no torchrun numbering)."""
    node = _on_node(rank, node_of)
    if store_port:
        import torch.distributed as dist

        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name)
        world = len(node_of)
        store = dist.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=timedelta(seconds=60))

        def connect(rank: int, socket: str, world: int, job: str) -> lpsync_client.Client:
            return lpsync_client.connect(
                socket, job=job, rank=rank, world_size=world, timeout=60, store=store
            )

        device_workers._client = connect  # this process only: run_cases attaches through the store
    return run_cases(rank, sockets[node], len(node_of), devices, cases, framework, algorithm)


def cases_mixed(
    rank: int,
    sockets: list[str],
    node_of: list[int],
    devices: list[int],
    cases: list[tuple],
    host_nodes: list[int],
) -> list:
    """run_cases where the ranks of ``host_nodes`` pass host buffers, the others emulated
    device buffers: a job that takes the flat path (collectives/staging.py)."""
    node = _on_node(rank, node_of)
    framework = "host" if node in host_nodes else "emulated"
    return run_cases(rank, sockets[node], len(node_of), devices, cases, framework)


def big_allreduce(
    rank: int, sockets: list[str], node_of: list[int], count: int, framework: str | list[str] = "emulated"
) -> dict:
    """One allreduce of ``count`` float32 on this rank's device (rank + 1 each; emulated:
    device rank mod 2, cupy: GPU 0): whether every element came back as the sum, and how
    long it took. ``framework`` per node (a list): "host" ranks pass registered host
    memory (a job that mixes host and device buffers)."""
    node = _on_node(rank, node_of)
    world = len(node_of)
    kind = framework[node] if isinstance(framework, list) else framework
    with _client(rank, sockets[node], world, "big") as client:
        device = rank % 2 if kind == "emulated" else 0
        x = device_workers.to_device(np.full(count, rank + 1, np.float32), device, "float32", kind)
        handle = client.register(x)
        target = handle if kind == "host" else x  # host memory: the registered copy works
        client.barrier()
        start = time.monotonic()
        client.allreduce(target, timeout=300)
        seconds = time.monotonic() - start
        want = world * (world + 1) / 2
        result = handle.original if kind == "host" else device_workers.to_host(x, kind)
        ok = bool((np.asarray(result) == want).all())
        client.release(target)
    return {"ok": ok, "seconds": seconds}


def allreduce_until_lost(rank: int, sockets: list[str], node_of: list[int], ready_file: str) -> None:
    """An 8 MB allreduce on slow emulated copies; rank 0 says when it has submitted. The
    outcome's name (OK, or the error's type: its peer daemon is killed meanwhile) goes to
    ``ready_file``.rank<N>."""
    with open(f"{ready_file}.rank{rank}", "w") as f:
        f.write(_until_lost(rank, sockets, node_of, ready_file))


def _until_lost(rank: int, sockets: list[str], node_of: list[int], ready_file: str) -> str:
    node = _on_node(rank, node_of)
    try:
        with _client(rank, sockets[node], len(node_of), "lost") as client:
            x = device_workers.to_device(np.ones(2_000_000, np.float32), rank % 2, "float32", "emulated")
            client.register(x)
            client.barrier()
            future = client.allreduce_async(x, timeout=120)
            if rank == 0:
                with open(ready_file, "w") as f:
                    f.write("submitted")
            future.result(timeout=150)
            return "OK"
    except lpsync_client.LpsyncError as error:
        return type(error).__name__


def device_ring_messages(rank: int, sockets: list[str], node_of: list[int], count: int) -> list[float]:
    """Point-to-point on emulated device buffers: each rank sends its array (rank + 1) to
    the next rank and receives the previous one's; returns what arrived (first, last)."""
    node = _on_node(rank, node_of)
    world = len(node_of)
    with _client(rank, sockets[node], world, "device-p2p") as client:
        mine = device_workers.to_device(np.full(count, rank + 1, np.float32), rank % 2, "float32", "emulated")
        got = device_workers.to_device(np.zeros(count, np.float32), (rank + 1) % 2, "float32", "emulated")
        sent = client.send_async(mine, (rank + 1) % world, tag=3)
        client.recv(got, (rank - 1) % world, tag=3)
        sent.result(timeout=60)
        values = device_workers.to_host(got, "emulated")
        return [float(values[0]), float(values[-1])]
