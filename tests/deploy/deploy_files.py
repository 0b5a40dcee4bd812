"""Shared pieces of the deploy/ checks: the artifacts, and the real tools that check them.

Debian's ``prometheus`` (prometheus, promtool) and ``docker-compose`` are found on PATH or,
when the tests run as root with apt (CI), installed once; otherwise the tests that need
them skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
sys.path.insert(0, str(ROOT / "tests" / "daemon"))  # harness: real daemons

_apt_lock = threading.Lock()
_apt_tried: dict[str, str] = {}  # package -> why it could not be installed ("" = done)


def tool(binary: str, package: str) -> str:
    """The path of ``binary``; installs Debian ``package`` for it when possible, else skips."""
    found = shutil.which(binary)
    if found:
        return found
    with _apt_lock:
        if package not in _apt_tried:
            _apt_tried[package] = _apt_install(package)
    found = shutil.which(binary)
    if not found:
        pytest.skip(
            f"{binary} (Debian package {package}) is not installed and could not be: "
            f"{_apt_tried[package] or 'installed, but the binary is missing'}"
        )
    return found


def _apt_install(package: str) -> str:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "not root or no apt-get: `apt-get install " + package + "` as root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
    ):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        except subprocess.TimeoutExpired:
            return f"{' '.join(argv)} timed out"
        if done.returncode != 0:
            return f"{' '.join(argv)} failed: {done.stderr.strip()[-500:]}"
    return ""


def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_resources() -> list[dict]:
    """Every resource the kustomization lists, in its order."""
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    resources = []
    for name in kustomization["resources"]:
        resources.extend(load_yaml_documents(DEPLOY / "k8s" / name))
    return resources


def k8s_resource(kind: str, name: str | None = None) -> dict:
    found = [
        r for r in k8s_resources() if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())
