"""``python -m lab.nccl``: NCCL through torch.distributed, the GPU check's baseline."""

from __future__ import annotations

import json

import pytest

from lab import nccl


def test_the_nccl_bench_says_why_it_cannot_run_without_gpus(tmp_path) -> None:
    """scripts/gpu_check.sh's NCCL line: on a machine without a GPU per rank it writes the
    reason and exits 0 (the machine is checked, not failed)."""
    if not nccl.skipped():
        pytest.skip("NCCL can run here: gpu_check.sh measures it")
    out = tmp_path / "nccl.json"
    assert nccl.main(["--sizes", "1MiB", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"skipped": nccl.skipped()}
