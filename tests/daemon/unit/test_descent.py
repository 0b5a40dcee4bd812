"""The daemon's layers descend (lpsync/daemon/__init__.py): no module under
lpsync/daemon/collectives imports lpsync.daemon.control, at run time or for type checks.
A Job reaches the control layer only through the one runner it is handed
(matching.JobRunner, collectives/conductor.py). Every module is read with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import lpsync.daemon.collectives

COLLECTIVES = Path(lpsync.daemon.collectives.__file__).parent
CONTROL = "lpsync.daemon.control"


def _absolute(module: str | None, level: int, package: str) -> str:
    """The dotted name a (possibly relative) ``from`` import names, inside ``package``."""
    if level == 0:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*base, module] if module else base)


def control_imports(source: str, package: str = "lpsync.daemon.collectives") -> list[tuple[int, str]]:
    """(line, name) of each import of the control layer in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n == CONTROL or n.startswith(CONTROL + ".")]
    return found


def test_the_check_sees_every_form_of_import() -> None:
    assert control_imports("import lpsync.daemon.control.metrics\n") == [(1, "lpsync.daemon.control.metrics")]
    assert control_imports("from lpsync.daemon.control import metrics\n")
    assert control_imports("from lpsync.daemon import control\n")
    assert control_imports("from ..control.state import DaemonState\n")
    assert control_imports("if TYPE_CHECKING:\n    from lpsync.daemon.control.sessions import Session\n")
    assert not control_imports("from lpsync.daemon.collectives import path\nimport lpsync.daemon.values\n")
    assert not control_imports("from lpsync.daemon import controls\n")


def test_no_collectives_module_imports_the_control_layer() -> None:
    modules = sorted(COLLECTIVES.rglob("*.py"))
    assert len(modules) > 10 and COLLECTIVES / "conductor.py" in modules
    found = {
        str(m.relative_to(COLLECTIVES)): uses
        for m in modules
        if (uses := control_imports(m.read_text(), "lpsync.daemon.collectives"))
    }
    assert found == {}, f"collectives import the control layer: {found}"
