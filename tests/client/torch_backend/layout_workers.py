"""What each rank of the backend's layout tests runs (test_backend_layout.py): torch's
environment as a launcher other than torchrun leaves it (RANK, WORLD_SIZE, MASTER_*;
LOCAL_* only when a test sets them), each rank on the daemon its test names, then
``init_process_group("lpsync")``; results against numpy."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


def init(rank: int, world: int, sockets: list[str], port: int, hints: tuple[int, int] | None = None) -> float:
    """The default group on lpsync; the seconds init_process_group took."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    if hints is not None:
        os.environ.update(LOCAL_RANK=str(hints[0]), LOCAL_WORLD_SIZE=str(hints[1]))
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LPSYNC_SOCKET=sockets[rank],
    )
    import lpsync_client.torch  # noqa: F401 - registers "lpsync"

    started = time.monotonic()
    dist.init_process_group("lpsync", timeout=timedelta(seconds=60))
    return time.monotonic() - started


def first_all_reduce(rank: int, world: int, sockets: list[str], port: int) -> dict:
    """init and one all_reduce: how long, and whether it is right."""
    started = time.monotonic()
    init(rank, world, sockets, port)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    seconds = time.monotonic() - started
    ok = bool((t == world * (world + 1) / 2).all())
    dist.destroy_process_group()
    return {"seconds": seconds, "ok": ok}


def ops(rank: int, world: int, sockets: list[str], port: int) -> list[str]:
    """all_reduce, broadcast from the last rank, all_gather, reduce_scatter, a barrier, and
    a sub-group of every rank but the last (a layout torchrun's numbering could not
    describe, refused before discovery): small and large tensors against numpy."""
    init(rank, world, sockets, port)
    failures: list[str] = []
    for count in (37, 40_000):
        inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(world)]
        t = torch.from_numpy(inputs[rank].copy())
        dist.all_reduce(t)
        _close(failures, f"all_reduce {count}", t, np.sum(inputs, axis=0))
        t = torch.from_numpy(inputs[rank].copy())
        dist.broadcast(t, src=world - 1)
        _close(failures, f"broadcast {count}", t, inputs[world - 1])
        out = [torch.empty(count) for _ in range(world)]
        dist.all_gather(out, torch.from_numpy(inputs[rank]))
        _close(failures, f"all_gather {count}", torch.cat(out), np.concatenate(inputs))
        full = [
            np.random.default_rng(100 + r).standard_normal(count * world).astype(np.float32)
            for r in range(world)
        ]
        mine = torch.empty(count)
        dist.reduce_scatter_tensor(mine, torch.from_numpy(full[rank]))
        _close(
            failures, f"reduce_scatter {count}", mine, np.sum(full, axis=0)[rank * count : (rank + 1) * count]
        )
    members = list(range(world - 1))
    group = dist.new_group(members)
    if rank in members:
        t = torch.full((5,), float(rank))
        dist.all_reduce(t, group=group)
        _close(failures, "sub-group all_reduce", t, np.full(5, float(sum(members))))
    dist.barrier()
    dist.destroy_process_group()
    return failures


def refused(
    rank: int, world: int, sockets: list[str], port: int, hints: list[tuple[int, int]] | None
) -> dict:
    """init (with hints[rank] as LOCAL_RANK/LOCAL_WORLD_SIZE): the error it raised, and
    after how many seconds."""
    started = time.monotonic()
    try:
        init(rank, world, sockets, port, hints[rank] if hints else None)
    except dist.DistBackendError as error:
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    dist.destroy_process_group()
    return {"error": None, "seconds": time.monotonic() - started}


def _close(failures: list[str], what: str, got: torch.Tensor, want: np.ndarray) -> None:
    if not np.allclose(got.numpy(), want, rtol=1e-5, atol=1e-5):
        failures.append(f"{what}: largest difference {np.max(np.abs(got.numpy() - want))}")


def under_torchrun() -> None:
    """A rank started by torchrun (``python -m torch.distributed.run ... -m
    tests.client.torch_backend.layout_workers``): torchrun's own environment, LPSYNC_SOCKET
    from its agent; one JSON line of what it saw."""
    import json

    import lpsync_client.torch  # noqa: F401 - registers "lpsync"

    dist.init_process_group("lpsync", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    out = [torch.empty(3) for _ in range(world)]
    dist.all_gather(out, torch.full((3,), float(rank)))
    line = {
        "rank": rank,
        "world": world,
        "local": [int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])],
        "socket": os.environ["LPSYNC_SOCKET"],
        "sum": t[0].item(),
        "gathered": [o[0].item() for o in out],
    }
    # One write: the ranks of one torchrun agent share its stdout pipe, and with unbuffered
    # output (PYTHONUNBUFFERED, which CI environments often set) print()'s text and newline
    # are two writes that another rank's line can land between.
    os.write(1, ("RESULT " + json.dumps(line) + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    under_torchrun()
