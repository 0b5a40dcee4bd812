"""The daemon reaches the client only through its public names (CONTRIBUTING.md, layout
rules): every module under lpsync/ is read with ``ast`` and none may import a private
client name (``lpsync_client._x``, ``from lpsync_client... import _x``) or reach one as an
attribute (``lpsync_client._x.y``). The contract the daemon shares with the client lives in
``lpsync_client.wire`` (with ``.proto`` and ``.pairs``), ``lpsync_client.futex`` and
``lpsync_client.errors``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lpsync

PACKAGE = Path(lpsync.__file__).parent
CLIENT = "lpsync_client"


def _private(dotted: str) -> bool:
    """Whether a dotted client name has a private part (``__init__``-style dunders are not)."""
    parts = dotted.split(".")
    return parts[0] == CLIENT and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of an attribute chain on a name; None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of each private client name that ``source`` imports or reaches."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [
                (node.lineno, f"{node.module}.{a.name}")
                for a in node.names
                if _private(f"{node.module}.{a.name}")
            ]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None and _private(dotted):
                found.append((node.lineno, dotted))
    return found


def _uses(source: str) -> list[tuple[int, str]]:
    # Every attribute of a chain is visited (``a._b.c`` and ``a._b``): keep each line's
    # longest name.
    best: dict[int, str] = {}
    for line, name in private_uses(source):
        if len(name) > len(best.get(line, "")):
            best[line] = name
    return sorted(best.items())


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import lpsync_client._p2p", ["lpsync_client._p2p"]),
        ("import lpsync_client.wire._x as x", ["lpsync_client.wire._x"]),
        ("from lpsync_client._cuda import device_uuid", ["lpsync_client._cuda.device_uuid"]),
        ("from lpsync_client import _adapt, wire", ["lpsync_client._adapt"]),
        ("from lpsync_client.wire import _helper", ["lpsync_client.wire._helper"]),
        ("import lpsync_client\nlpsync_client._convert.numpy_dtype", ["lpsync_client._convert.numpy_dtype"]),
        ("import lpsync_client\nf = lpsync_client._default", ["lpsync_client._default"]),
        ("def f():\n    from lpsync_client._p2p import parse_pair", ["lpsync_client._p2p.parse_pair"]),
        ("import lpsync_client.wire\nfrom lpsync_client.wire.pairs import parse_pair", []),
        ("from lpsync_client.wire.proto import lpsync_pb2 as pb\nimport lpsync_client.__init__", []),
        ("from lpsync._internal import x\nfrom . import _y", []),  # not the client's
    ],
)
def test_the_check_finds_each_form_of_a_private_name(source: str, expected: list[str]) -> None:
    assert [name for _, name in _uses(source)] == expected


def test_no_daemon_module_uses_a_private_client_name() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 100  # the whole package, not an empty glob
    offences = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in modules
        for line, name in _uses(path.read_text())
    ]
    assert not offences, "private client names (use lpsync_client.wire or make it public):\n" + "\n".join(
        offences
    )
