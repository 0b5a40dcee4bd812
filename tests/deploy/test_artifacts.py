"""deploy/ checked by the real tools, offline: promtool, docker-compose, the Kubernetes
schemas (kubernetes-validate), bash, the Dockerfile parser; and the generated dashboard
is what its builder makes today."""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.deploy.deploy_files import DEPLOY, ROOT, k8s_resources, tool

K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests promise to work on


def _run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=120)


def test_promtool_checks_config_and_rules(tmp_path: Path) -> None:
    promtool = tool("promtool", "prometheus")
    # The compose config names rule files by their in-container path: check a copy
    # pointing at the repository's rules (the same file Prometheus loads there).
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    config["rule_files"] = [str(DEPLOY / "prometheus" / "rules" / "*.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    done = _run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 rules found" in done.stdout + done.stderr
    done = _run(promtool, "check", "rules", *map(str, (DEPLOY / "prometheus" / "rules").glob("*.yml")))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: a rule with a bad expression does not pass."""
    promtool = tool("promtool", "prometheus")
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "lpsync.yml").read_text())
    rules["groups"][0]["rules"][0]["expr"] = 'up{job="lpsync" == 0'
    (tmp_path / "bad.yml").write_text(yaml.safe_dump(rules))
    assert _run(promtool, "check", "rules", str(tmp_path / "bad.yml")).returncode != 0


def test_docker_compose_config_passes() -> None:
    compose = tool("docker-compose", "docker-compose")
    done = _run(compose, "-f", "docker-compose.yml", "config", "--quiet")
    assert done.returncode == 0, done.stderr
    services = _run(compose, "-f", "docker-compose.yml", "config", "--services").stdout.split()
    assert sorted(services) == ["daemon0", "daemon1", "grafana", "prometheus", "trainer0", "trainer1"]


def test_docker_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    compose = tool("docker-compose", "docker-compose")
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    data["services"]["daemon0"]["volumes"] = ["not-a-declared-volume:/run/lpsync"]
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(data))
    assert _run(compose, "-f", str(broken), "config", "--quiet", cwd=tmp_path).returncode != 0


def _validate(resource: dict) -> None:
    kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    "resource",
    [r for r in k8s_resources() if r["apiVersion"] != "monitoring.coreos.com/v1"],
    ids=lambda r: f"{r['kind']}/{r['metadata']['name']}",
)
def test_kubernetes_manifests_validate_against_the_schemas(resource: dict) -> None:
    _validate(resource)


def test_kubernetes_validation_catches_mistakes() -> None:
    daemonset = next(r for r in k8s_resources() if r["kind"] == "DaemonSet")
    typo = copy.deepcopy(daemonset)
    typo["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)
    wrong_type = copy.deepcopy(daemonset)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(wrong_type)


def test_podmonitor_shape() -> None:
    """No schema for the operator's CRDs offline: check the fields it reads."""
    monitor = next(r for r in k8s_resources() if r["kind"] == "PodMonitor")
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
    assert spec["selector"]["matchLabels"]
    for endpoint in spec["podMetricsEndpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "relabelings", "scheme"}


def test_slurm_script_is_valid_bash() -> None:
    done = _run("bash", "-n", str(DEPLOY / "slurm" / "lpsync-train.sbatch"))
    assert done.returncode == 0, done.stderr


def _dockerfiles() -> list[Path]:
    return [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]


@pytest.mark.parametrize("path", _dockerfiles(), ids=lambda p: p.name)
def test_dockerfile_copies_what_exists_and_runs_unprivileged(path: Path) -> None:
    parser = DockerfileParser(fileobj=path.open("rb"))
    ignore = (ROOT / ".dockerignore").read_text().split()
    stages = [i for i in parser.structure if i["instruction"] == "FROM"]
    assert len(stages) >= 2, "multi-stage: build and runtime"
    for instruction in parser.structure:
        if instruction["instruction"] == "COPY" and "--from=" not in instruction["value"]:
            *sources, _ = instruction["value"].split()
            for source in sources:
                # examples/ (train_digits.py) comes from another branch of the project
                assert source == "examples" or (ROOT / source).exists(), (
                    f"{path.name}: COPY {source}: no such path"
                )
                assert f"!{source.rstrip('/')}/" in ignore or f"!{source}" in ignore, (
                    f"{path.name}: COPY {source} but .dockerignore excludes it"
                )
    users = [i["value"] for i in parser.structure if i["instruction"] == "USER"]
    assert users and users[-1] != "root" and not users[-1].startswith("0")


def test_dashboard_json_is_what_the_builder_makes() -> None:
    spec = importlib.util.spec_from_file_location("lpsync_dashboard", DEPLOY / "grafana" / "dashboard.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    committed = (DEPLOY / "grafana" / "dashboards" / "lpsync.json").read_text()
    assert builder.render() == committed, (
        "deploy/grafana/dashboards/lpsync.json is stale: run python deploy/grafana/dashboard.py"
    )
    ids = [p["id"] for p in builder.build()["panels"]]
    assert len(ids) == len(set(ids))


def test_dockerfile_extras_exist() -> None:
    """The extras the images install (`.[cuda12]`) are the project's own."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    used = {path.name: re.findall(r'"\.\[([a-z0-9,]+)\]"', path.read_text()) for path in _dockerfiles()}
    assert used["Dockerfile.cuda"] == ["cuda12"]
    for name, found in used.items():
        for extra in found:
            assert set(extra.split(",")) <= extras, f"{name}: unknown extra {extra}"


def test_rules_wrap_into_a_prometheusrule_as_docs_say(tmp_path: Path) -> None:
    """docs/deploy.md's shell line that turns the rules into the operator's PrometheusRule."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    line = next(block for block in re.findall(r"```\n(.*?)```", docs, re.S) if "PrometheusRule" in block)
    command = line.replace("| kubectl apply -f -", "").strip()
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert done.returncode == 0, done.stderr
    resource = yaml.safe_load(done.stdout)
    assert resource["kind"] == "PrometheusRule"
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "lpsync.yml").read_text())
    assert resource["spec"] == rules
