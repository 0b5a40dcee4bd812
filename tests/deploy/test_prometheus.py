"""A real Prometheus (Debian's package) scrapes two real daemons that serve collectives:
every series the rules and the dashboard name is one the daemons export, every alert and
dashboard expression evaluates in Prometheus, and the peer-down alert fires when a peer
daemon is killed."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import lpsync_client
from lpsync.daemon import launch
from lpsync.memory import reclaim_stale
from lpsync_client.errors import CollectiveTimeoutError
from tests.daemon.harness import DaemonProcess, shm_segments
from tests.deploy.deploy_files import DEPLOY, tool
from tests.ports import free_ports

SECRET = "deploy-test-secret"
HEARTBEAT = 3.0
RULES = DEPLOY / "prometheus" / "rules" / "lpsync.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "lpsync.json"


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def _until(what: str, probe: Callable[[], object], timeout: float = 60.0):
    """Poll ``probe`` (a scrape or a query: each call blocks on I/O) until truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


class Prometheus:
    def __init__(self, tmp: Path, targets: list[str]) -> None:
        binary = tool("prometheus", "prometheus")
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "lpsync", "static_configs": [{"targets": targets}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        self._log = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        _until("Prometheus to be ready", self._ready, 60)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            return "Ready" in _get(f"{self.url}/-/ready", 2)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        try:
            body = _get(f"{self.url}/api/v1/{path}?{query}")
        except urllib.error.HTTPError as error:  # 400/422: the expression is wrong
            body = error.read().decode()
        return json.loads(body)

    def query(self, expr: str) -> list[dict]:
        reply = self.api("query", query=expr)
        assert reply["status"] == "success", f"{expr}: {reply}"
        return reply["data"]["result"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def _concrete(expr: str) -> str:
    """A dashboard expression with Grafana's variables filled in."""
    return expr.replace('"$instance"', '".*"').replace("$__rate_interval", "1m")


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\blpsync_[a-z_]+", expr))


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Iterator[dict]:
    """Two peered daemons with metrics, traffic on them, and Prometheus scraping both."""
    tmp = tmp_path_factory.mktemp("prometheus")
    peer_ports, metric_ports = free_ports(2), free_ports(2)
    peers = ",".join(f"127.0.0.1:{p}" for p in peer_ports)
    daemons: list[DaemonProcess] = []
    clients: list[lpsync_client.Client] = []
    prometheus = None
    try:
        for node in range(2):
            where = tmp / f"node{node}"
            where.mkdir()
            daemons.append(
                DaemonProcess(
                    where,
                    "--peers",
                    peers,
                    "--node-rank",
                    str(node),
                    "--metrics-port",
                    str(metric_ports[node]),
                    "--heartbeat-timeout",
                    str(HEARTBEAT),
                    env={"LPSYNC_SECRET": SECRET},
                )
            )
        # Collectives of several sizes on both daemons (single-node jobs: the histogram,
        # bytes and busbw series), one that times out (the error counter) and one left
        # waiting for a rank that never comes (a job with outstanding work).
        for node, daemon in enumerate(daemons):
            with lpsync_client.connect(daemon.socket, job=f"ok{node}", rank=0, world_size=1) as client:
                for n in (16, 4096, 1 << 18):
                    x = client.zeros(n)
                    x[:] = np.arange(n, dtype=np.float32)
                    client.allreduce(x)
                    assert np.array_equal(x, np.arange(n, dtype=np.float32))
                    client.broadcast(x)
                    client.release(x)
        late = lpsync_client.connect(daemons[0].socket, job="late", rank=0, world_size=2, local_world_size=2)
        clients.append(late)
        with pytest.raises(CollectiveTimeoutError):
            late.allreduce(late.zeros(8), timeout=0.5)
        waiting = lpsync_client.connect(
            daemons[0].socket, job="waiting", rank=0, world_size=2, local_world_size=2
        )
        clients.append(waiting)
        # Its rank 1 attaches and never calls: the collective waits for it in matching (a
        # rank attached nowhere would fail it after the daemons' 30 s bound, placing.py).
        clients.append(
            lpsync_client.connect(
                daemons[0].socket, job="waiting", rank=1, world_size=2, local_rank=1, local_world_size=2
            )
        )
        pending = waiting.allreduce_async(waiting.zeros(8), timeout=300)
        targets = [f"127.0.0.1:{p}" for p in metric_ports]
        prometheus = Prometheus(tmp, targets)
        _until(
            "both daemons' peer meshes", lambda: len(prometheus.query("lpsync_peers_connected == 1")) == 2, 60
        )
        # A rate needs two samples: wait for three scrapes of each daemon.
        _until(
            "three scrapes of both daemons",
            lambda: prometheus.query("count(count_over_time(lpsync_sessions[1m]) >= 3) == 2"),
            30,
        )
        scraped = [_get(f"http://{t}/metrics") for t in targets]
        yield {"prometheus": prometheus, "daemons": daemons, "targets": targets, "scraped": scraped}
        assert not pending.done(), "the waiting collective waited throughout"
    finally:
        for client in clients:
            client.close()
        if prometheus is not None:
            prometheus.stop()
        codes = launch.stop_together(daemons)  # a killed one: only reaped
        reclaim_stale()  # what the killed daemon could not unlink
        assert codes[0] == 0 and not shm_segments(daemons[0].pid), daemons[0].log.read_text()


def test_every_series_named_in_rules_and_dashboard_is_exported(observed) -> None:
    exported = {
        sample.name
        for text in observed["scraped"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    used = set()
    for rule in _rules():
        used |= _names(rule["expr"])
    for expr in _dashboard_exprs():
        used |= _names(expr)
    assert len(used) >= 15
    missing = sorted(used - exported)
    assert not missing, f"named in deploy/ but not exported by the daemon: {missing}"


def test_histogram_buckets_span_10us_to_minutes(observed) -> None:
    bounds = {
        float(s.labels["le"])
        for text in observed["scraped"]
        for f in text_string_to_metric_families(text)
        if f.name == "lpsync_collective_seconds"
        for s in f.samples
        if s.name.endswith("_bucket")
    }
    assert min(bounds) <= 1e-5 and max(b for b in bounds if b != float("inf")) >= 300
    finite = sorted(b for b in bounds if b != float("inf"))
    assert max(b / a for a, b in itertools.pairwise(finite)) <= 2.5 + 1e-9
    sizes = {r["metric"]["size"] for r in observed["prometheus"].query("lpsync_collective_seconds_count")}
    assert {"<=4KiB", "<=1MiB"} <= sizes


def test_every_alert_and_dashboard_expression_evaluates(observed) -> None:
    prometheus = observed["prometheus"]
    for rule in _rules():
        prometheus.query(rule["expr"])  # asserts success
    for expr in _dashboard_exprs():
        assert prometheus.query(_concrete(expr)), f"no data for dashboard query {expr}"


def test_the_job_series_show_outstanding_work_and_errors(observed) -> None:
    prometheus = observed["prometheus"]
    waiting = prometheus.query('lpsync_job_pending_collectives{job_name="waiting"}')
    assert [float(r["value"][1]) for r in waiting] == [1.0]
    assert prometheus.query('lpsync_job_last_progress_timestamp_seconds{job_name="waiting"} > time() - 600')
    errors = prometheus.query('lpsync_collective_errors_total{code="DEADLINE_EXCEEDED"}')
    assert [r["metric"]["op"] for r in errors] == ["allreduce"]
    # The stalled-job rule's expression with a threshold of 0 s: the waiting job matches.
    stalled = next(r for r in _rules() if r["alert"] == "LpsyncJobStalled")["expr"]
    assert "> 600" in stalled
    matched = prometheus.query(stalled.replace("> 600", "> 0"))
    assert {r["metric"]["job_name"] for r in matched} == {"waiting"}
    limit = prometheus.query("lpsync_session_bytes_limit")
    assert {float(r["value"][1]) for r in limit} == {float(1 << 35)}
    assert not prometheus.query(
        next(r for r in _rules() if r["alert"] == "LpsyncSessionNearBufferLimit")["expr"]
    )


def test_peer_down_fires_when_a_peer_daemon_is_killed(observed) -> None:
    """Runs last in this module: it kills node 1."""
    prometheus, daemons = observed["prometheus"], observed["daemons"]
    rule = next(r for r in _rules() if r["alert"] == "LpsyncPeerDown")
    assert not prometheus.query(rule["expr"]), "no peer is down yet"
    daemons[1].proc.kill()
    daemons[1].proc.wait(10)
    survivor = observed["targets"][0]
    fired = _until("the peer-down expression", lambda: prometheus.query(rule["expr"]), HEARTBEAT + 30)
    assert [r["metric"]["instance"] for r in fired] == [survivor]
    down = next(r for r in _rules() if r["alert"] == "LpsyncDaemonDown")
    assert [
        r["metric"]["instance"]
        for r in _until("the daemon-down expression", lambda: prometheus.query(down["expr"]), 30)
    ] == [observed["targets"][1]]

    def firing() -> list[dict]:
        alerts = prometheus.api("alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "LpsyncPeerDown" and a["state"] == "firing"]

    seconds = float(rule["for"].rstrip("s"))
    alerts = _until("LpsyncPeerDown to fire", firing, seconds + 30)
    assert alerts[0]["labels"]["instance"] == survivor
