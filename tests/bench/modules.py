"""Running a benchmark module as its users do: ``python -m lpsync.bench.<name> ...``."""

from __future__ import annotations

import subprocess
import sys

from tests.daemon.harness import ROOT


def run_bench(name: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -m lpsync.bench.<name> *args`` from the repository, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", f"lpsync.bench.{name}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
