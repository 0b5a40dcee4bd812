"""Skip a test module whose processes need an optional package, without importing it here.

``pytest.importorskip`` imports the package in every worker that collects the module, and
each of the suite's workers collects every module: scikit-learn costs ~1.3 CPU-s a worker,
matplotlib ~0.4, for tests whose subprocesses (``lpsync demo``, ``lpsync paper``) are the
only ones to use them."""

from __future__ import annotations

import importlib.util

import pytest


def skip_unless_installed(*packages: str) -> None:
    """Skip the calling module (at its top level) unless every package can be imported."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (not installed)", allow_module_level=True)
