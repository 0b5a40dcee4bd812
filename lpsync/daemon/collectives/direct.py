"""The direct path: one thread reduces every participant's view and writes every output.

For local host buffers up to DIRECT_MAX_BYTES (and ``algorithm="direct"``): the last
participant's thread does it all in one pass, with no thread hand-offs, which is what
keeps a 4-byte allreduce close to a bare round trip. Deterministic: views are reduced in
rank order, so every participant and every run get the same bits. Invariants: inputs of
out-of-place collectives are only read; a non-root's buffer of reduce is never written.
"""

from __future__ import annotations

import numpy as np

from lpsync.reduction import Reduction
from lpsync.types import Collective

# Measured (docs/benchmarks.md, 4 ranks on 2 cores): one thread reducing every view beats
# the thread-per-participant schedules up to 2 MiB; be/lp win from 4 MiB on.
DIRECT_MAX_BYTES = 2 * 1024 * 1024


def run(
    op: Collective,
    root: int,
    buffers: list[tuple[np.ndarray, np.ndarray]],
    reduction: Reduction | None,
    count: int,
) -> None:
    if op is Collective.BROADCAST:
        source = buffers[root][0]
        for _, out in buffers:
            if out is not source:
                np.copyto(out, source)
        return
    if op in (Collective.ALLGATHER, Collective.GATHER):
        for r, (_, out) in enumerate(buffers):
            if op is Collective.GATHER and r != root:
                continue
            for q, (inp, _) in enumerate(buffers):
                block = out[q * count : (q + 1) * count]
                if not np.shares_memory(block, inp):
                    np.copyto(block, inp)
        return
    if op is Collective.SCATTER:
        source = buffers[root][0]
        for r, (_, out) in enumerate(buffers):
            block = source[r * count : (r + 1) * count]
            if not np.shares_memory(block, out):
                np.copyto(out, block)
        return
    if op is Collective.ALLTOALL:  # out of place only: no output overlaps an input
        for r, (_, out) in enumerate(buffers):
            for q, (inp, _) in enumerate(buffers):
                np.copyto(out[q * count : (q + 1) * count], inp[r * count : (r + 1) * count])
        return
    assert reduction is not None
    # Reduce into a scratch array first: in place, the inputs are also the outputs.
    acc = buffers[0][0].copy()
    for inp, _ in buffers[1:]:
        reduction.combine(acc, inp, acc)
    reduction.finalize(acc)
    if op is Collective.ALLREDUCE:
        for _, out in buffers:
            np.copyto(out, acc)
    elif op is Collective.REDUCE:
        np.copyto(buffers[root][1], acc)
    else:  # reduce_scatter
        for rank, (_, out) in enumerate(buffers):
            np.copyto(out, acc[rank * count : (rank + 1) * count])
