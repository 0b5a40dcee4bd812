"""One trainer of the chaos run: verified allreduces and broadcasts in a loop.

Run by lpsync.chaos (and the clean-exit measurement) as
``python -m lpsync.chaos.trainer SOCKET RANK WORLD PER_NODE TIMEOUT``. Its stdin
carries epochs, one number a line: epoch E is the job ``chaos-E``; a trainer moves to the
newest epoch before each collective, and after a failure waits (blocking) for a newer one,
since its job's sequence numbers may no longer line up with the other ranks'. Its stdout
carries one JSON object a line per collective:
``{"rank", "epoch", "op", "start", "end", "outcome": "ok" | "wrong" | <error class>, "message"}``
with ``time.monotonic()`` times (one clock for every process of the machine).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

import lpsync_client

COUNT = 4096  # int64 elements: small enough for a 2-core machine, over one chunk


class Epochs:
    """The newest epoch read from stdin; waiting for a newer one blocks on a condition."""

    def __init__(self) -> None:
        self.value = -1
        self.closed = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="epochs", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            with self._changed:
                self.value = max(self.value, int(line))
                self._changed.notify_all()
        with self._changed:  # the controller is gone: stop
            self.closed = True
            self._changed.notify_all()

    def newer_than(self, epoch: int) -> int | None:
        """The first epoch > ``epoch``, or None once stdin closed."""
        with self._changed:
            self._changed.wait_for(lambda: self.value > epoch or self.closed)
            return None if self.closed else self.value


def expected(op: str, step: int, world: int) -> np.ndarray:
    """What every rank must hold after collective ``step``."""
    base = np.arange(COUNT, dtype=np.int64)
    if op == "allreduce":
        return sum(base * (r + 1) + step for r in range(world))  # type: ignore[return-value]
    root = step % world
    return base * (root + 1) + step


def run(socket: str, rank: int, world: int, per_node: int, timeout: float) -> None:
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank % per_node), str(per_node)
    epochs = Epochs()
    epoch = epochs.newer_than(-1)
    client: lpsync_client.Client | None = None
    joined, step = -1, 0  # the epoch whose job ``client`` is in
    while epoch is not None and not epochs.closed:
        epoch = max(epoch, epochs.value)
        if epoch != joined:  # a new job: all ranks start it even
            if client is not None:
                client.close()
            client, joined, step = None, epoch, 0
            try:
                client = lpsync_client.connect(
                    socket, job=f"chaos-{epoch}", rank=rank, world_size=world, timeout=timeout
                )
                x = client.zeros(COUNT, "int64")
            except lpsync_client.LpsyncError as error:
                _report(rank, epoch, "connect", time.monotonic(), type(error).__name__, str(error))
                epoch = epochs.newer_than(epoch)
                continue
        assert client is not None
        op = "allreduce" if step % 3 else "broadcast"
        x[:] = np.arange(COUNT, dtype=np.int64) * (rank + 1) + step
        start = time.monotonic()
        try:
            if op == "allreduce":
                client.allreduce(x)
            else:
                client.broadcast(x, root=step % world)
        except lpsync_client.LpsyncError as error:
            _report(rank, epoch, op, start, type(error).__name__, str(error))
            epoch = epochs.newer_than(epoch)
            continue
        good = np.array_equal(x, expected(op, step, world))
        _report(rank, epoch, op, start, "ok" if good else "wrong", "" if good else f"step {step}")
        step += 1
    if client is not None:
        client.close()


def _report(rank: int, epoch: int, op: str, start: float, outcome: str, message: str) -> None:
    record = {
        "rank": rank,
        "epoch": epoch,
        "op": op,
        "start": start,
        "end": time.monotonic(),
        "outcome": outcome,
        "message": message[:300],
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    sock, r, w, k, t = sys.argv[1:6]
    run(sock, int(r), int(w), int(k), float(t))
