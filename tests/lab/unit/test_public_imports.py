"""The lab and the product's drivers use the daemon as a user's program does: through public
names only (lab/__init__.py). Read from the sources with ``ast``, so that an import inside
a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# The lab, and the product's programs that drive daemons from outside: the bench harness
# and the chaos run.
CHECKED = ("lab", "lpsync/bench", "lpsync/chaos")
OURS = ("lpsync", "lpsync_client", "lab")
LAUNCHER = "lpsync.daemon.launch"  # how every program starts and probes a daemon
# Breaches known and accepted for now: none. One listed here that has gone fails too.
KNOWN: dict[str, set[str]] = {}


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of every module and name imported: ``from a.b import c`` gives
    ``a.b.c``, since c may be a module or a name of a.b."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: the checked code names its modules whole
                out.append((node.lineno, "." * node.level + (node.module or "")))
                continue
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def breach(name: str) -> str | None:
    """Why ``name`` is not a public name of ours to import (None: it is, or not ours)."""
    if name.startswith("."):
        return "a relative import"
    parts = name.split(".")
    if parts[0] not in OURS:
        return None
    if any(p.startswith("_") for p in parts):
        return "a private name"
    if parts[:2] == ["lpsync", "daemon"] and len(parts) > 2 and ".".join(parts[:3]) != LAUNCHER:
        return "a daemon internal (only lpsync.daemon.launch is public)"
    return None


def sources() -> list[Path]:
    files = sorted(p for where in CHECKED for p in (ROOT / where).rglob("*.py"))
    assert len(files) > 20, files  # the folders are where this test thinks they are
    return files


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_only_public_names(path: Path) -> None:
    where = str(path.relative_to(ROOT))
    known = KNOWN.get(where, set())
    names = imported(ast.parse(path.read_text(), where))
    found = [f"{where}:{line}: {name}: {why}" for line, name in names if (why := breach(name))]
    assert not [f for f in found if f.split(": ")[1] not in known], "\n".join(found)
    assert known <= {name for _, name in names}, f"{where}: no longer imports {known}: drop it from KNOWN"


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("from lpsync.daemon.collectives.learning import TRIALS", "a daemon internal"),
        ("import lpsync.daemon.control.server", "a daemon internal"),
        ("from lpsync.daemon import values", "a daemon internal"),
        ("def f():\n    from lpsync_client._p2p import Pair", "a private name"),
        ("from lpsync.bench.runner import _pct", "a private name"),
        ("from lpsync._proto import lpsync_pb2", "a private name"),
        ("from . import worker", "a relative import"),
    ],
)
def test_a_breach_is_found(source: str, why: str) -> None:
    reasons = [breach(name) for _, name in imported(ast.parse(source))]
    assert any(r and r.startswith(why) for r in reasons), reasons


@pytest.mark.parametrize(
    "source",
    [
        "from lpsync.daemon import launch",
        "from lpsync.daemon.launch import serving",
        "import lpsync_client.torch",
        "from lpsync.bench.cpu import CpuMeter",
        "from lab.loopback_cpu import measure",
        "import numpy._core",  # not ours: numpy's business
        "from __future__ import annotations",
    ],
)
def test_public_names_pass(source: str) -> None:
    names = imported(ast.parse(source))
    assert names and all(breach(name) is None for _, name in names), names
