"""The daemon's layers descend (lpsync/daemon/__init__.py): no module under
lpsync/daemon/collectives imports lpsync.daemon.control, at run time or for type checks.
A Job reaches the control layer only through the one runner it is handed
(matching.JobRunner, collectives/conductor.py). The multi-node path (collectives/path.py)
has one agree stage: agreement.agree is called from path.py alone, once by every branch
of _across_nodes (the protocol's other parts, agree_later and announce, from nowhere
outside agreement.py), and the agreement takes its tags from there (it imports nothing
of lpsync.transport). Every module is read with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import lpsync
import lpsync.daemon.collectives

PACKAGE = Path(lpsync.__file__).parent
COLLECTIVES = Path(lpsync.daemon.collectives.__file__).parent
CONTROL = "lpsync.daemon.control"
AGREEMENT = "lpsync.daemon.collectives.agreement"
PROTOCOL = frozenset({"agree", "agree_later", "announce"})  # agreement.py's sides of a round


def _absolute(module: str | None, level: int, package: str) -> str:
    """The dotted name a (possibly relative) ``from`` import names, inside ``package``."""
    if level == 0:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*base, module] if module else base)


def control_imports(source: str, package: str = "lpsync.daemon.collectives") -> list[tuple[int, str]]:
    """(line, name) of each import of the control layer in ``source``."""
    return imports_of(CONTROL, source, package)


def imports_of(layer: str, source: str, package: str) -> list[tuple[int, str]]:
    """(line, name) of each import of ``layer`` (a dotted name, or anything under it) in
    ``source``, a module of ``package``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n == layer or n.startswith(layer + ".")]
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


def agree_calls(source: str, package: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of each call of the agreement's protocol (PROTOCOL) in
    ``source``: as ``agreement.agree(...)``, or a name imported from the module (``from
    ... import agree``)."""
    tree = ast.parse(source)
    bare = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and _absolute(node.module, node.level, package) == AGREEMENT
        for a in node.names
        if a.name in PROTOCOL
    }
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        name = getattr(function, "name", "<module>")
        for node in ast.walk(function):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                called = f.value.id == "agreement" and f.attr in PROTOCOL
            else:
                called = isinstance(f, ast.Name) and f.id in bare
            if called:
                found.append((node.lineno, name))
    # A call is inside its module and every function around it (ast.walk goes outside
    # in): name each once, by the innermost function.
    innermost: dict[int, str] = {}
    for line, name in found:
        if name != "<module>" or line not in innermost:
            innermost[line] = name
    return sorted(innermost.items())


def test_the_agree_check_sees_every_form_of_call() -> None:
    package = "lpsync.daemon.collectives"
    assert agree_calls("def f():\n    agreement.agree(side, link)\n", package) == [(2, "f")]
    assert agree_calls("from .agreement import agree as a\ndef g():\n    a(s, l)\n", package) == [(3, "g")]
    assert agree_calls("from lpsync.daemon.collectives.agreement import agree\nagree(s, l)\n", package) == [
        (2, "<module>")
    ]
    assert agree_calls("def f():\n    x = 1\n    agreement.announce(j, s, t, l, f)\n", package) == [(3, "f")]
    assert not agree_calls("def f():\n    other.agree(side)\n    agreement.judge(x)\n", package)


def test_the_multinode_path_has_one_agree_stage() -> None:
    calls = {}
    for module in sorted(PACKAGE.rglob("*.py")):
        dotted = ".".join(module.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = dotted if module.name == "__init__.py" else dotted.rpartition(".")[0]
        if found := agree_calls(module.read_text(), package):
            calls[str(module.relative_to(PACKAGE))] = [name for _, name in found]
    # _across_nodes: every branch (no mesh, an armed run failed, a ride later or now, the
    # general path) through one call; notify_failure: a call failed before it ran.
    assert calls == {"daemon/collectives/path.py": ["_across_nodes", "notify_failure"]}


def test_the_agreement_takes_its_tags_from_above() -> None:
    source = (COLLECTIVES / "agreement.py").read_text()
    assert imports_of("lpsync.transport", source, "lpsync.daemon.collectives") == []
    assert imports_of("lpsync.transport", "from lpsync.transport.tags import SPEC\n", "x") == [
        (1, "lpsync.transport.tags"),
        (1, "lpsync.transport.tags.SPEC"),
    ]


def _importers(name: str) -> set[str]:
    """The modules under lpsync/ (paths relative to it) that import ``name``."""
    found = set()
    for module in sorted(PACKAGE.rglob("*.py")):
        dotted = ".".join(module.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = dotted if module.name == "__init__.py" else dotted.rpartition(".")[0]
        if imports_of(name, module.read_text(), package):
            found.add(str(module.relative_to(PACKAGE)))
    return found


def test_armed_plans_are_looked_at_before_the_agreement_after_it_and_after_a_run() -> None:
    # path.py: native_across.before; finish.py: native_across.after (a ride armed, or a
    # failure's channels dropped); runners.py: after_run, the pipeline's.
    assert _importers("lpsync.daemon.collectives.native_across") == {
        "daemon/collectives/path.py",
        "daemon/collectives/finish.py",
        "daemon/collectives/runners.py",
    }
    calls = {
        (node.func.attr, function.name)
        for function in ast.walk(ast.parse((COLLECTIVES / "finish.py").read_text()))
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "native_across"
    }
    assert calls == {("after", "_after")}  # one call, from one function of the finish stage


def test_a_rides_data_is_folded_by_the_agreement_and_written_by_the_finish() -> None:
    # The agreement hands a Ride its parts (ride.py) and knows nothing of small.py (which
    # decides what rides and makes each node's part); nor of values.Later: a verdict
    # that lands on a reader goes to a plain callback (Side.landed).
    agreement = (COLLECTIVES / "agreement.py").read_text()
    package = "lpsync.daemon.collectives"
    assert imports_of("lpsync.daemon.collectives.small", agreement, package) == []
    assert imports_of("lpsync.daemon.collectives.ride", agreement, package)
    assert imports_of("lpsync.daemon.values.Later", agreement, package) == []
    assert _importers("lpsync.daemon.collectives.ride") == {
        "daemon/collectives/agreement.py",
        "daemon/collectives/finish.py",
        "daemon/collectives/native_across.py",  # for type checks: a Ride's views are armed
        "daemon/collectives/small.py",
    }


def test_a_jobs_learner_is_made_by_the_job() -> None:
    made = {}
    for module in sorted(PACKAGE.rglob("*.py")):
        calls = [
            node.lineno
            for node in ast.walk(ast.parse(module.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Learner"
        ]
        if calls:
            made[str(module.relative_to(PACKAGE))] = len(calls)
    assert made == {"daemon/collectives/matching.py": 2}  # made with the job, or its new layout
