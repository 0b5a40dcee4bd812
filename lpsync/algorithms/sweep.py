"""Simulated sweeps: every (op, P, size, algorithm) point through the schedule
simulator, LP's chunk count chosen as the tuner would (or searched), with the closed
form and the ratio to LP beside each. Used by ``lpsync simulate``, ``lpsync claims`` and
``lpsync paper``."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from lpsync.algorithms.cost import (
    DEFAULT_MIN_CHUNK_BYTES,
    LinkModel,
    algbw,
    busbw_factor,
    closed_form,
    lp_chunks,
)
from lpsync.algorithms.registry import ALGORITHMS, algorithms_for, generate
from lpsync.algorithms.simulate import simulate
from lpsync.algorithms.tuner import chunks_for
from lpsync.errors import InvalidArgumentError
from lpsync.types import BLOCKED, Collective
from lpsync.units import format_size


def sweep(
    ops: list[Collective],
    wanted: list[str],
    nodes: list[int],
    sizes: list[int],
    dtype: np.dtype,
    link: LinkModel,
    chunks: str = "auto",
    min_chunk: int = DEFAULT_MIN_CHUNK_BYTES,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One simulated row per (op, P, size, algorithm), with x_lp filled in; ``wanted``
    empty: every algorithm that offers the op."""
    rows: list[dict[str, Any]] = []
    for op in ops:
        algos = [a for a in wanted if a in algorithms_for(op)] if wanted else algorithms_for(op)
        for name in wanted:
            if name not in algos:
                print(f"note: {name} has no {op}; skipped", file=sys.stderr)
        for p in nodes:
            for size in sizes:
                blocks = p if op in BLOCKED else 1
                count = size // dtype.itemsize // blocks
                nbytes = count * blocks * dtype.itemsize
                for name in algos:
                    if progress:
                        print(
                            f"\r{op} {name} P={p} {format_size(nbytes)} ...",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                    rows.append(_point(op, name, p, count, nbytes, dtype.itemsize, link, chunks, min_chunk))
    if progress:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    _add_ratios(rows)
    return rows


def _point(
    op: Collective,
    name: str,
    p: int,
    count: int,
    nbytes: int,
    itemsize: int,
    link: LinkModel,
    chunks_mode: str,
    min_chunk: int,
) -> dict[str, Any]:
    schedule_args: dict[str, Any] = {"op": op, "algorithm": name, "participants": p, "count": count}
    chunks = 1
    if ALGORITHMS[name].pipelined:
        chunks = _choose_chunks(chunks_mode, schedule_args, itemsize, link, nbytes, min_chunk)
    schedule = generate(chunks=chunks, **schedule_args)
    result = simulate(schedule, itemsize, link)
    bw = algbw(nbytes, result.seconds)
    return {
        "op": str(op),
        "algorithm": name,
        "nodes": p,
        "bytes": nbytes,
        "size": format_size(nbytes),
        "chunks": schedule.chunks,
        "seconds": result.seconds,
        "model": closed_form(op, name, p, nbytes, link, schedule.chunks),
        "algbw": bw,
        "busbw": bw * busbw_factor(op, p),
    }


def _choose_chunks(
    mode: str, schedule_args: dict[str, Any], itemsize: int, link: LinkModel, nbytes: int, min_chunk: int
) -> int:
    p = schedule_args["participants"]
    if mode == "auto":
        return chunks_for(schedule_args["algorithm"], p, nbytes, link, min_chunk, schedule_args["op"])
    if mode != "search":
        try:
            k = int(mode)
        except ValueError:
            raise InvalidArgumentError(f"--chunks must be auto, search or a number, got {mode!r}") from None
        if k < 1:
            raise InvalidArgumentError("--chunks must be >= 1")
        return k
    guess = lp_chunks(p, nbytes, link, min_chunk, schedule_args["op"])
    most = max(1, nbytes // max(1, min_chunk))
    candidates = sorted({max(1, min(most, round(guess * f))) for f in (0.25, 0.5, 1, 2, 4)})
    timed = [(simulate(generate(chunks=k, **schedule_args), itemsize, link).seconds, k) for k in candidates]
    return min(timed)[1]


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    lp = {(r["op"], r["nodes"], r["bytes"]): r["seconds"] for r in rows if r["algorithm"] == "lp"}
    for row in rows:
        base = lp.get((row["op"], row["nodes"], row["bytes"]))
        row["x_lp"] = row["seconds"] / base if base else None
