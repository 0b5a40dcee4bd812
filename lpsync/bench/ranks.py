"""The rank processes of an ``lpsync bench`` sweep, local (runner.py) or on the emulated
cluster (cluster.py): one protocol and one reader for both drivers.

A rank (worker.py, cluster_worker.py) prints one JSON object a line on stdout per point it
measured: its own times, #wrong and whatever else the driver joins. The driver reads every
rank's lines, blocking in select, until all have exited; a point is handed on once every
rank has reported it, and its time per iteration is the slowest rank's (a collective is
as slow as its last participant). A rank that exits with an error, a failed check of the
driver's (its daemons alive) or the deadline ends the run with that rank's log.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from lpsync.errors import LpsyncError

Row = dict[str, Any]  # one rank's line


class RankError(LpsyncError):
    """A rank process failed, or the ranks gave no result in time."""


def emit(**row: object) -> None:
    """A rank's line for one point (stdout is the driver's pipe: nothing else goes there)."""
    print(json.dumps(row), flush=True)


def slowest(times: Sequence[Sequence[float]]) -> list[float]:
    """Per iteration, the slowest rank's time (one list per rank, the same length)."""
    return [max(t) for t in zip(*times, strict=True)]


def read(
    workers: Sequence[subprocess.Popen[bytes]],
    key: Callable[[Row], Hashable],
    on_point: Callable[[dict[int, Row]], None],
    deadline: float,
    check: Callable[[], None] = lambda: None,
    describe: Callable[[int], str] = lambda rank: f"rank {rank}",
    log: Callable[[int], str] = lambda rank: "",
) -> None:
    """Read every rank's lines until all have exited; ``on_point(rows by rank)`` once all
    ranks sent the row of one ``key``. ``check`` runs about once a second and raises to end
    the run; ``describe``/``log`` name a failed rank and give its log's tail."""
    world = len(workers)
    partial: dict[Hashable, dict[int, Row]] = {}
    pending = {rank: b"" for rank in range(world)}
    with selectors.DefaultSelector() as selector:
        for rank, proc in enumerate(workers):
            assert proc.stdout is not None
            selector.register(proc.stdout, selectors.EVENT_READ, rank)
        while pending:
            if time.monotonic() > deadline:
                raise RankError("no result from the ranks in time")
            check()
            for sel, _ in selector.select(timeout=1.0):
                rank = sel.data
                data = os.read(sel.fd, 1 << 16)
                if not data:
                    selector.unregister(sel.fileobj)
                    del pending[rank]
                    if (rc := workers[rank].wait(30)) != 0:
                        raise RankError(f"{describe(rank)} failed with exit code {rc}" + _tail(log(rank)))
                    continue
                *lines, pending[rank] = (pending[rank] + data).split(b"\n")
                for line in lines:
                    row = json.loads(line)
                    got = partial.setdefault(key(row), {})
                    got[rank] = row
                    if len(got) == world:
                        on_point(partial.pop(key(row)))


def stop(workers: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM to the ranks still running, SIGKILL to those that outlive ``grace``."""
    for proc in workers:
        if proc.poll() is None:
            proc.terminate()
    end = time.monotonic() + grace
    for proc in workers:
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


def _tail(text: str) -> str:
    return f":\n{text}" if text else ""
