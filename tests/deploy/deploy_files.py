"""Shared pieces of the deploy/ checks: the artifacts, and the real tools that check them.

Debian's ``prometheus`` (prometheus, promtool) and ``docker-compose`` are found on PATH
(.ci/run installs them before the suite); where they are absent the tests that need them
skip and say why.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def tool(binary: str, package: str) -> str:
    """The path of ``binary``, else skip saying which Debian package has it. Tests install
    nothing: .ci/run installs the packages before the suite (`apt-get install prometheus
    docker-compose` on a machine of your own)."""
    found = shutil.which(binary)
    if not found:
        pytest.skip(f"{binary} is not installed: apt-get install {package} (.ci/run does, before the suite)")
    return found


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
