"""The floor under a collective answered through a futex: two processes wake each other in
turn over a word of shared memory, as a client and the native engine do (ctypes futexes,
lpsync_client.futex), and nothing else. ``python -m lab.wake_floor [--iters N]``
prints the median round trip (two wake-ups, two sleeps): no collective on this machine
that sleeps between its messages can be answered faster than that.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import statistics
import time

import numpy as np

from lpsync_client import futex


def _echo(buffer: mmap.mmap, iters: int) -> None:
    """The other side: wait for each odd value, answer with the next even one."""
    words = np.frombuffer(buffer, np.uint32)
    address = words.__array_interface__["data"][0]
    for i in range(iters):
        want = 2 * i + 1
        while int(words[0]) != want:
            futex.wait(address, int(words[0]), 1.0)
        words[0] = want + 1
        futex.wake(address)


def measure(iters: int) -> list[float]:
    buffer = mmap.mmap(-1, 4096)
    words = np.frombuffer(buffer, np.uint32)
    address = words.__array_interface__["data"][0]
    other = mp.get_context("fork").Process(target=_echo, args=(buffer, iters))
    other.start()
    times = []
    try:
        for i in range(iters):
            t = time.perf_counter()
            words[0] = 2 * i + 1
            futex.wake(address)
            want = 2 * i + 2
            while int(words[0]) != want:
                futex.wait(address, int(words[0]), 1.0)
            times.append(time.perf_counter() - t)
    finally:
        other.join(10)
    return times


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--iters", type=int, default=20000)
    args = parser.parse_args(argv)
    times = measure(args.iters)[args.iters // 10 :]
    print(
        f"futex round trip between two processes: median {statistics.median(times) * 1e6:.1f} us, "
        f"p10 {np.percentile(times, 10) * 1e6:.1f} us, p90 {np.percentile(times, 90) * 1e6:.1f} us "
        f"over {len(times)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
