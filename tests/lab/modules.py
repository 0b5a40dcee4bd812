"""Running a lab module as its users do: ``python -m lab.<name> ...``."""

from __future__ import annotations

import subprocess
import sys

from tests.daemon.harness import ROOT


def run_bench(name: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -m lab.<name> *args`` from the repository, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", f"lab.{name}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
