"""matplotlib for the report: a headless backend, and every figure saved the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lpsync.errors import InvalidArgumentError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOURS = {"lp": "tab:blue", "mst": "tab:orange", "be": "tab:green", "ring": "tab:red", "direct": "tab:gray"}


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError("lpsync paper draws with matplotlib: pip install 'lpsync[plot]'") from None
    return plt


def save(fig: Any, path: Path) -> None:
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    with open(path, "rb") as f:
        if f.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
            raise InvalidArgumentError(f"{path} is not a PNG")


def colour(algorithm: str) -> str:
    return COLOURS.get(algorithm, "black")


def size_axis(ax: Any) -> None:
    """A log2 axis of message sizes labelled 4K, 1M, 1G."""
    from matplotlib.ticker import FuncFormatter

    from lpsync.units import format_size

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(x).replace("iB", "")))
