"""Plain-text tables and JSON lines, the two output formats of the CLI."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import IO, Any


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        if value == 0:
            return "0"
        magnitude = abs(value)
        return f"{value:.4g}" if 1e-3 <= magnitude < 1e6 else f"{value:.3e}"
    return str(value)


def write_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], out: IO[str]) -> None:
    cells = [[format_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    out.write("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)) + "\n")
    for r in cells:
        out.write("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) + "\n")


def write_json_lines(rows: Iterable[dict[str, Any]], out: IO[str]) -> None:
    for row in rows:
        out.write(json.dumps(row) + "\n")
