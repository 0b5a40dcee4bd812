"""Reductions: sum, prod, min, max and avg over the DESIGN.md dtypes, on numpy views.

A reduction combines two spans elementwise into a third (numpy releases the GIL, so
participants' threads reduce in parallel). avg is a sum whose fully reduced chunks
are divided by the participant count once, where the schedule marks them final, so
every participant receives the same divided bits. Integer avg rounds toward minus
infinity (floor division); integer sum and prod wrap around as numpy's do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lpsync.types import ReduceOp

_UFUNCS: dict[ReduceOp, Callable[..., np.ndarray]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


@dataclass(frozen=True)
class Reduction:
    op: ReduceOp
    dtype: np.dtype
    participants: int

    def combine(self, acc: np.ndarray, incoming: np.ndarray, out: np.ndarray) -> None:
        """out = acc (op) incoming; out may be acc itself."""
        _UFUNCS[self.op](acc, incoming, out=out)

    def finalize(self, span: np.ndarray) -> None:
        """Turn a fully reduced span into the result (only avg changes anything)."""
        if self.op is not ReduceOp.AVG or self.participants == 1:
            return
        if np.issubdtype(self.dtype, np.integer):
            np.floor_divide(span, self.participants, out=span)
        else:
            np.divide(span, np.asarray(self.participants, dtype=self.dtype), out=span)
