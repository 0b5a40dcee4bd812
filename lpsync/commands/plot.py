"""Draw simulated times against P and against message size (matplotlib, the `plot` extra)."""

from __future__ import annotations

from typing import Any

from lpsync.errors import InvalidArgumentError


def plot_points(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError("--plot needs matplotlib: pip install 'lpsync[plot]'") from None
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 4 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        mine = [r for r in rows if r["op"] == op]
        largest, widest = max(r["bytes"] for r in mine), max(r["nodes"] for r in mine)
        for name in dict.fromkeys(r["algorithm"] for r in mine):
            by_p = sorted(
                (r["nodes"], r["seconds"]) for r in mine if r["algorithm"] == name and r["bytes"] == largest
            )
            by_n = sorted(
                (r["bytes"], r["seconds"]) for r in mine if r["algorithm"] == name and r["nodes"] == widest
            )
            axes[i][0].plot(*zip(*by_p, strict=True), marker="o", label=name)
            axes[i][1].plot(*zip(*by_n, strict=True), marker="o", label=name)
        size = next(r["size"] for r in mine if r["bytes"] == largest)
        axes[i][0].set(
            title=f"{op}, {size}: time against participants",
            xscale="log",
            yscale="log",
            xlabel="participants P",
            ylabel="seconds",
        )
        axes[i][1].set(
            title=f"{op}, P={widest}: time against size",
            xscale="log",
            yscale="log",
            xlabel="bytes",
            ylabel="seconds",
        )
        for ax in axes[i]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
