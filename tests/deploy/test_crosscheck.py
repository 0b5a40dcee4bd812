"""Every command line deploy/ runs parses with lpsync's own argument parser, and the
ports, paths and names agree between the daemons, the probes, the trainers and the
scrapers (compose, Kubernetes, the Dockerfile, Prometheus)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from lpsync.cli import build_parser
from lpsync.daemon.control import config as daemon_config
from lpsync.daemon.control.config import DaemonConfig
from lpsync.daemon.peers.discovery import from_dns
from tests.deploy.deploy_files import DEPLOY, ROOT, compose, k8s_resource


def parse(argv: list[str]) -> argparse.Namespace:
    """``lpsync ARGV...`` as the console script parses it (SystemExit on a bad flag)."""
    return build_parser().parse_args(argv)


def daemon_config_of(argv: list[str], environ: dict[str, str] | None = None) -> DaemonConfig:
    args = parse(argv)
    assert args.command == "daemon", argv
    return daemon_config.from_args(args, environ or {})


def health_socket(argv: list[str]) -> str:
    assert argv[0] == "lpsync", argv
    args = parse(argv[1:])
    assert args.command == "health", argv
    return args.socket


def test_the_parser_refuses_what_it_does_not_know() -> None:
    """The checks below can fail: an unknown flag or a bad value does not parse."""
    with pytest.raises(SystemExit):
        parse(["daemon", "--metrics-prot", "9750"])
    with pytest.raises(SystemExit):
        parse(["daemon", "--metrics-port", "many"])
    with pytest.raises(daemon_config.InvalidArgumentError):
        daemon_config_of(["daemon", "--listen", "0.0.0.0:1"])  # TCP without TLS


# -- docker-compose -------------------------------------------------------------------------
def _mounts(service: dict) -> dict[str, str]:
    """target path -> volume name."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def test_compose_daemons_trainers_and_scrapers_agree() -> None:
    c = compose()
    daemons = sorted(name for name in c["services"] if name.startswith("daemon"))
    trainers = sorted(name for name in c["services"] if name.startswith("trainer"))
    assert len(daemons) == len(trainers) == 2
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    secrets = c["secrets"]
    for rank, name in enumerate(daemons):
        service = c["services"][name]
        config = daemon_config_of(service["command"])
        assert config.node_rank == rank
        peers = config.peer_set()
        assert peers is not None and peers.node_rank == rank
        assert [p.host for p in peers.peers] == daemons, "peers by service name, rank order"
        assert {p.port for p in peers.peers} == {13337}
        secret = PurePosixPath(config.secret_file)
        assert secret.parent == PurePosixPath("/run/secrets") and secret.name in secrets
        assert secret.name in service["secrets"]
        assert f"{name}:{config.metrics_port}" in targets
        socket_dir = str(PurePosixPath(config.socket).parent)
        assert socket_dir in _mounts(service), "the socket is on the shared volume"
        health = service["healthcheck"]["test"]
        assert health[0] == "CMD" and health_socket(health[1:]) == config.socket
        # The node's trainer: same socket volume, same IPC (/dev/shm), same node rank.
        trainer = c["services"][trainers[rank]]
        assert _mounts(trainer)[socket_dir] == _mounts(service)[socket_dir]
        assert trainer["ipc"] == f"service:{name}"
        assert trainer["environment"]["LPSYNC_SOCKET"] == config.socket
        assert trainer["environment"]["LPSYNC_JOB"]
        torchrun = trainer["command"]
        assert torchrun[0] == "torchrun"
        assert torchrun[torchrun.index("--node-rank") + 1] == str(rank)
        assert torchrun[torchrun.index("--nnodes") + 1] == str(len(daemons))
        assert torchrun[-1] == "/opt/lpsync/examples/train_digits.py"
        assert set(trainer["depends_on"]) == set(daemons)
    assert len(targets) == len(daemons)
    assert (ROOT / c["secrets"]["lpsync-secret"]["file"]).is_file()
    grafana = c["services"]["grafana"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    datasource = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "lpsync.yml").read_text()
    )
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "lpsync.yml").read_text())
    dashboards = provider["providers"][0]["options"]["path"]
    assert f"./deploy/grafana/dashboards:{dashboards}:ro" in grafana["volumes"]
    prometheus = c["services"]["prometheus"]
    assert "./deploy/prometheus/rules:/etc/prometheus/rules:ro" in prometheus["volumes"]


# -- Dockerfile -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_command_and_healthcheck_parse(name: str) -> None:
    text = (DEPLOY / name).read_text()
    parser = DockerfileParser(fileobj=(DEPLOY / name).open("rb"))
    commands = [i["value"] for i in parser.structure if i["instruction"] == "CMD"]
    config = daemon_config_of(json.loads(commands[0]))  # the daemon stage comes first
    health = re.search(r"CMD (\[\"lpsync\", \"health\".*\])", text)
    assert health is not None
    assert health_socket(json.loads(health.group(1))) in (None, config.socket)
    assert f"LPSYNC_SOCKET={config.socket}" in text
    assert f"EXPOSE {config.peer_port} {config.metrics_port}" in text


# -- Kubernetes -----------------------------------------------------------------------------
def _container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name)


def _mount_sources(pod: dict, container: dict) -> dict[str, dict]:
    """mount path -> the volume it mounts."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def test_kubernetes_daemonset_service_job_and_monitor_agree(tmp_path: Path) -> None:
    namespace = k8s_resource("Namespace")["metadata"]["name"]
    configmap = k8s_resource("ConfigMap", "lpsync-config")
    daemonset = k8s_resource("DaemonSet")
    service = k8s_resource("Service", "lpsync-peers")
    job = k8s_resource("Job")
    monitor = k8s_resource("PodMonitor")
    secret = k8s_resource("Secret", "lpsync-secret")
    pod = daemonset["spec"]["template"]["spec"]
    daemon = _container(pod, "lpsync")

    # The daemon's command line with the ConfigMap's TOML, as the pod would read it.
    mounts = _mount_sources(pod, daemon)
    args = daemon["args"]
    config_path = PurePosixPath(args[args.index("--config") + 1])
    volume = mounts[str(config_path.parent)]["configMap"]
    assert volume["name"] == configmap["metadata"]["name"]
    key = next(i["key"] for i in volume["items"] if i["path"] == config_path.name)
    toml = tmp_path / "lpsync.toml"
    toml.write_text(configmap["data"][key])
    argv = [a if a != str(config_path) else str(toml) for a in args]
    config = daemon_config_of(argv)

    # Peers: the headless Service's DNS name and peer port.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    dns = f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    assert config.peers_dns == f"{dns}:{config.peer_port}"
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports == {"peer": config.peer_port, "metrics": config.metrics_port}
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert k8s_resource("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= set(ports)
    wait = _container(pod, "wait-for-peers")
    assert dns in wait["command"][-1]
    nodes_ref = wait["env"][0]["valueFrom"]["configMapKeyRef"]
    assert int(configmap["data"][nodes_ref["key"]]) >= 1

    # The secret comes from the Secret's key through LPSYNC_SECRET.
    env = {e["name"]: e for e in daemon["env"]}
    ref = env["LPSYNC_SECRET"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]

    # Probes: `lpsync health` on the daemon's own socket.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert health_socket(daemon[probe]["exec"]["command"]) == config.socket, probe

    # Socket and shared memory: host paths the trainers mount at the same places.
    socket_dir = str(PurePosixPath(config.socket).parent)
    assert mounts[socket_dir]["hostPath"]["path"] == socket_dir
    assert mounts["/dev/shm"]["hostPath"]["path"] == "/dev/shm"
    prepare = _container(pod, "prepare-host")
    assert socket_dir in prepare["command"][-1]
    train_pod = job["spec"]["template"]["spec"]
    trainer = train_pod["containers"][0]
    train_mounts = _mount_sources(train_pod, trainer)
    assert train_mounts[socket_dir]["hostPath"]["path"] == socket_dir
    assert train_mounts["/dev/shm"]["hostPath"]["path"] == "/dev/shm"
    train_env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert train_env["LPSYNC_SOCKET"] == config.socket and train_env["LPSYNC_JOB"]
    assert pod["securityContext"]["runAsGroup"] in train_pod["securityContext"]["supplementalGroups"]
    script = trainer["command"][-1]
    assert dns in script and "/opt/lpsync/examples/train_digits.py" in script
    assert (
        job["spec"]["parallelism"] == job["spec"]["completions"] == int(configmap["data"][nodes_ref["key"]])
    )
    assert train_pod["nodeSelector"] == pod["nodeSelector"]


def test_kubernetes_trainer_script_derives_the_daemons_node_order(tmp_path: Path) -> None:
    """The Job's shell computes node rank and master as the daemon orders --peers-dns
    (numerically sorted addresses): run it with stub getent and torchrun."""
    addresses = ["10.0.0.10", "10.0.0.9", "10.0.1.2"]
    (tmp_path / "getent").write_text(
        "#!/bin/sh\n"
        + "".join(
            f"echo '{a}       STREAM {sys_name}'\n" for a, sys_name in zip(addresses, "abc", strict=True)
        )
    )
    (tmp_path / "torchrun").write_text('#!/bin/sh\necho "$@"\n')
    for stub in ("getent", "torchrun"):
        (tmp_path / stub).chmod(0o755)
    trainer = k8s_resource("Job")["spec"]["template"]["spec"]["containers"][0]
    for host in addresses:
        env = {
            **os.environ,
            "PATH": f"{tmp_path}:{os.environ['PATH']}",
            "HOST_IP": host,
            "GPUS_PER_NODE": "1",
        }
        done = subprocess.run(trainer["command"], capture_output=True, text=True, env=env, timeout=30)
        assert done.returncode == 0, done.stderr
        argv = shlex.split(done.stdout)
        expected = from_dns(
            "lpsync-peers:13337", None, lambda name, port: addresses, lambda h, host=host: h == host
        )
        assert argv[argv.index("--node-rank") + 1] == str(expected.node_rank)
        assert argv[argv.index("--master-addr") + 1] == expected.peers[0].host
        assert argv[argv.index("--nnodes") + 1] == str(len(addresses))
