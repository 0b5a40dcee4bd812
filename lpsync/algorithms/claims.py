"""The LP paper's claims checked on simulated sweep rows (lpsync.algorithms.sweep): LP
flat in P, MST growing as log P, BE at up to twice LP's cost, at 1 GiB; LP's pipeline
fill at 64 MiB; the simulator against the closed forms. Used by ``lpsync claims`` and
``lpsync paper``."""

from __future__ import annotations

import math
from typing import Any

LARGE, MEDIUM = 1 << 30, 64 << 20  # where the claims are checked, and where the fill shows


def checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each claim at each point: measured value, bound, verdict."""
    at = {(r["op"], r["algorithm"], r["nodes"], r["bytes"]): r for r in rows}
    out: list[dict[str, Any]] = []
    for op in ("broadcast", "reduce"):
        nodes = sorted({r["nodes"] for r in rows if r["op"] == op})
        lp2 = at[(op, "lp", nodes[0], LARGE)]["seconds"]
        lp_top = at[(op, "lp", nodes[-1], LARGE)]["seconds"]
        out.append(
            {
                "op": op,
                "claim": f"LP flat in P: LP(P={nodes[-1]}) / LP(P={nodes[0]})",
                "nodes": nodes[-1],
                "value": lp_top / lp2,
                "bound": "<= 1.10",
                "ok": lp_top / lp2 <= 1.10,
            }
        )
        for p in (n for n in nodes if n >= 4):
            mst = at[(op, "mst", p, LARGE)]["x_lp"]
            be = at[(op, "be", p, LARGE)]["x_lp"]
            log_bound, be_bound = 0.9 * math.log2(p), 0.9 * 2 * (p - 1) / p
            out.append(
                {
                    "op": op,
                    "claim": "MST / LP >= 0.9 log2 P",
                    "nodes": p,
                    "value": mst,
                    "bound": f">= {log_bound:.3f}",
                    "ok": mst >= log_bound,
                }
            )
            out.append(
                {
                    "op": op,
                    "claim": "BE / LP >= 0.9 * 2(P-1)/P",
                    "nodes": p,
                    "value": be,
                    "bound": f">= {be_bound:.3f}",
                    "ok": be >= be_bound,
                }
            )
        fill = at[(op, "lp", nodes[-1], MEDIUM)]["seconds"] / at[(op, "lp", nodes[0], MEDIUM)]["seconds"]
        out.append(
            {
                "op": op,
                "claim": "64MiB: LP pipeline fill, LP(P_max) / LP(P_min)",
                "nodes": nodes[-1],
                "value": fill,
                "bound": "(reported)",
                "ok": True,
            }
        )
    worst = max(abs(r["seconds"] / r["model"] - 1) for r in rows if r["model"] > 0)
    out.append(
        {
            "op": "all",
            "claim": "simulated / closed form - 1, worst case",
            "nodes": "all",
            "value": worst,
            "bound": "<= 0.01",
            "ok": worst <= 0.01,
        }
    )
    return out
