"""Executor benchmark: an allreduce over P in-process participants against plain numpy.

The baseline performs, in one thread, exactly the elementwise work the schedule
contains — as many numpy adds (3 arrays) and copies (2 arrays) over the whole
buffer as the schedule's RECV_REDUCE and RECV/COPY ops add up to — so the ratio
``speed`` = baseline seconds / executor seconds isolates the executor's overhead
(and its gain from running participants on several cores). Runs alternate between
the two to share the machine's noise; medians are reported.

    python -m lab.executor --procs 4 --bytes 64MiB --algorithm lp,ring
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from lpsync.algorithms import Kind, Schedule, generate
from lpsync.algorithms.cost import SHARED_MEMORY_LINK, algbw, lp_chunks
from lpsync.engine.group import LocalGroup, layout
from lpsync.reduction import Reduction
from lpsync.report import write_json_lines, write_table
from lpsync.types import Collective, ReduceOp, dtype_of
from lpsync.units import format_size, parse_size

COLUMNS = ("algorithm", "procs", "size", "chunks", "executor_s", "baseline_s", "speed", "algbw", "wrong")


def elementwise_work(schedule: Schedule) -> tuple[int, int]:
    """(elements reduced, elements copied) over all participants."""
    kind, length = schedule.ops["kind"], schedule.ops["hi"] - schedule.ops["lo"]
    reduced = int(length[kind == Kind.RECV_REDUCE].sum())
    copied = int(length[(kind == Kind.RECV) | (kind == Kind.COPY)].sum())
    return reduced, copied


def baseline(count: int, dtype: np.dtype, reduced: int, copied: int) -> float:
    """Seconds for the same adds and copies over whole buffers in one thread."""
    a, b, c = (np.ones(count, dtype) for _ in range(3))
    started = time.perf_counter()
    whole, part = divmod(reduced, count)
    for _ in range(whole):
        np.add(a, b, out=c)
    np.add(a[:part], b[:part], out=c[:part])
    whole, part = divmod(copied, count)
    for _ in range(whole):
        np.copyto(c, a)
    np.copyto(c[:part], a[:part])
    return time.perf_counter() - started


def measure(
    algorithm: str, procs: int, nbytes: int, dtype: np.dtype, chunks: int, repeat: int
) -> dict[str, object]:
    count = nbytes // dtype.itemsize
    schedule = generate(Collective.ALLREDUCE, algorithm, procs, count, chunks=chunks)
    rng = np.random.default_rng(1)
    inputs = [rng.integers(-8, 8, count).astype(dtype) for _ in range(procs)]
    buffers = [layout(Collective.ALLREDUCE, r, procs, count, x, in_place=False) for r, x in enumerate(inputs)]
    reduced, copied = elementwise_work(schedule)
    ours, theirs = [], []
    with LocalGroup(schedule, buffers, Reduction(ReduceOp.SUM, dtype, procs)) as group:
        group.run(timeout=60)  # warm up: page in every buffer once
        for _ in range(repeat):
            theirs.append(baseline(count, dtype, reduced, copied))
            started = time.perf_counter()
            group.run(timeout=60)
            ours.append(time.perf_counter() - started)
    expected = np.sum(inputs, axis=0, dtype=dtype)
    wrong = sum(int(np.count_nonzero(out != expected)) for _, out in buffers)
    executor_s, baseline_s = statistics.median(ours), statistics.median(theirs)
    return {
        "algorithm": algorithm,
        "procs": procs,
        "bytes": nbytes,
        "size": format_size(nbytes),
        "chunks": schedule.chunks,
        "executor_s": executor_s,
        "baseline_s": baseline_s,
        "speed": baseline_s / executor_s,
        "algbw": algbw(nbytes, executor_s),
        "wrong": wrong,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.executor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--procs", type=int, default=4, help="participants (threads), default 4")
    parser.add_argument("--bytes", default="64MiB", help="buffer size (default 64MiB)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--algorithm", default="lp", help="comma list (default lp)")
    parser.add_argument(
        "--chunk-bytes",
        default=None,
        help="LP chunk size (default: the tuner's k* for the shared-memory link "
        "model, lpsync.algorithms.cost.SHARED_MEMORY_LINK)",
    )
    parser.add_argument("--repeat", type=int, default=9, help="timed runs each (default 9)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    dtype, nbytes = dtype_of(args.dtype), parse_size(args.bytes)
    if args.chunk_bytes is None:
        chunks = lp_chunks(args.procs, nbytes, SHARED_MEMORY_LINK)
    else:
        chunks = max(1, nbytes // max(1, parse_size(args.chunk_bytes)))
    rows = [
        measure(a.strip(), args.procs, nbytes, dtype, chunks, args.repeat) for a in args.algorithm.split(",")
    ]
    if args.json:
        write_json_lines(rows, sys.stdout)
    else:
        write_table(rows, COLUMNS, sys.stdout)
        print(f"# median of {args.repeat}; speed = baseline_s / executor_s (>= 0.5 is the target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
