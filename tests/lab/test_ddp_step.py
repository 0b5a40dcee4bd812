"""``python -m lab.ddp_step``: DDP steps through the lpsync backend, the lpsync
hook on a gloo group, gloo, and no DDP, real ranks and a real daemon, in one run."""

from __future__ import annotations

import pytest

from tests.lab.modules import run_bench
from tests.ports import free_ports

pytest.importorskip("torch")


def test_every_variant_steps_and_its_ranks_agree() -> None:
    (port,) = free_ports(1)
    done = run_bench(
        "ddp_step",
        *("--procs", "2", "--steps", "2", "--warmup", "1", "--width", "32", "--depth", "1"),
        *("--port", str(port), "--timeout", "150"),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [r[0].strip() for r in rows] == [
        "backend `lpsync` (no hook)",
        "gloo group + lpsync DDP hook",
        "gloo",
        "no DDP (compute alone)",
    ], done.stdout
    for name, median, p90, _, agree in rows:
        # The bench compares every rank's parameters after its steps (DDP keeps them equal).
        assert agree.strip() == "yes" and float(median) > 0 and float(p90) > 0, (name, done.stdout)
    assert rows[2][3].strip() == "1.00x", done.stdout  # gloo against itself
