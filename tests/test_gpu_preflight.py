"""``scripts/gpu_check.sh --preflight`` in CI: what the GPU run needs, checked without a GPU.

A GPU is lent for minutes: the check must work the first time, offline, with the GPU
image's packages only. Building a virtualenv with exactly that package set takes more
than CI's few minutes (torch alone), so the preflight runs in this environment with every
distribution outside an explicit list refused at import (the image's, in gpu_check.sh,
plus gpu_wheels.sh's): the imports of every module a step runs, the options each step
passes, the collection of the gpu tests, and the device-path profile on the emulated
device. The test also makes the check fail for real (numpy taken off the list) and keeps
the two scripts' lists of wheels and the steps' time limits in step with the issue's
bounds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "gpu_check.sh"


def _preflight(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_OUT": str(out), **env}
    environ.pop("PYTHONPATH", None)
    command = ["bash", str(CHECK), "--preflight"]
    return subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)


def test_gpu_preflight_passes_with_the_image_packages_only(tmp_path: Path) -> None:
    done = _preflight(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["ok"] and result["mode"] == "preflight"
    assert [s["step"] for s in result["steps"]] == ["install", "preflight", "profile"]
    assert all(s["status"] == "ok" for s in result["steps"]), result["steps"]
    assert result["preflight"]["problems"] == []
    assert result["preflight"]["gpu_tests"] >= 10  # the gpu tests are found and collect
    profile = result["profile"]["steps"]
    assert {"record + synchronize (idle stream)", "run the plan: enqueue + wait"} <= set(profile)
    assert all(row["median_us"] > 0 for row in profile.values())
    assert "# lpsync GPU check (preflight)" in done.stdout  # the table, last


def test_gpu_preflight_fails_on_a_package_the_image_lacks_and_still_prints_the_table(tmp_path: Path) -> None:
    image = re.search(r'GPU_CHECK_IMAGE_PACKAGES:-"([^"]*)"', CHECK.read_text(), re.S)
    assert image is not None
    without_numpy = " ".join(p for p in image[1].replace("\\\n", " ").split() if p != "numpy")
    done = _preflight(tmp_path, GPU_CHECK_IMAGE_PACKAGES=without_numpy)
    assert done.returncode == 1
    result = json.loads((tmp_path / "result.json").read_text())
    assert not result["ok"]
    assert any("numpy" in problem for problem in result["preflight"]["problems"]), result["preflight"]
    assert any(r.startswith("numpy") for r in result["preflight"]["refused"])
    assert "verdict: FAIL" in done.stdout and "| preflight | failed (exit 1) |" in done.stdout


def test_gpu_preflight_wheels_and_time_limits_match_the_issue() -> None:
    check, wheels = CHECK.read_text(), (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    listed = re.search(r'GPU_CHECK_WHEEL_PACKAGES="([^"]*)"', check)
    fetched = re.findall(r'"([a-z-]+)==\$', wheels)
    assert listed is not None and sorted(listed[1].split()) == sorted(fetched)
    # The GPU run: every step's limit (plus the 2 s to kill one) within 6 minutes.
    body = check.split('if [ "$mode" = preflight ]; then', 1)
    install = re.search(r"^step install (\d+) ", check, re.M)
    preflight = re.search(r"^pre_limit=(\d+)", check, re.M)
    assert install is not None and preflight is not None
    gpu_run = [int(n) for n in re.findall(r"^\s*step [a-z_0-9]+ (\d+) ", body[1].split("else", 1)[1], re.M)]
    first = [int(install[1]), int(preflight[1])]  # both modes; the GPU run's preflight limit
    assert len(gpu_run) == 7
    assert sum(first) + sum(gpu_run) + 2 * (len(first) + len(gpu_run)) <= 360, (first, gpu_run)
