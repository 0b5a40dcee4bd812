"""The native steady-state path: armed plans run in compiled code (lpsync/native/*.c).

Python keeps the policy: a collective runs once on the general path, its plan is
compiled into a flat program (program.py) and armed (armed.py); identical later calls
ring the job's doorbell page and the engine's thread runs the program and answers,
without the GIL. ``engine()`` is the compiled module, or None where it was not built
(``reason()`` says why); ``--native on`` refuses to start without it.
"""

from __future__ import annotations

import functools
from types import ModuleType

# A run's result (engine.h): the doorbell's reply code, and Engine.run's.
OK, FALLBACK, TIMEOUT, LOST, MISMATCH = range(5)


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        from lpsync.native import _engine  # type: ignore[attr-defined]
    except ImportError as error:
        return None, f"the native engine is not built ({error}); reinstall lpsync with a C compiler"
    return _engine, ""


def engine() -> ModuleType | None:
    return _load()[0]


def reason() -> str:
    """Why the engine is unavailable ('' where it is available)."""
    return _load()[1]
