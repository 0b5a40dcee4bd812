"""deploy/slurm/lpsync-train.sbatch run against stub srun/scontrol/lpsync/torchrun that
record what happens: daemons on every node, a wait until every one is healthy, the
trainers, and the daemons stopped at the end, on failure and on cancellation."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lpsync.cli import build_parser
from lpsync.daemon.control import config as daemon_config
from tests.deploy.deploy_files import DEPLOY

SCRIPT = DEPLOY / "slurm" / "lpsync-train.sbatch"
NODELIST, NODES = "node[01-02]", 2

# srun: runs its command once per node (SLURM_NODEID), in parallel, as srun does; passes
# SIGTERM on to every task; exits with the worst status.
SRUN = r"""
import os, signal, subprocess, sys
args = sys.argv[1:]
nodes = 1
while args and args[0].startswith("-"):
    option = args.pop(0)
    if option.startswith("--nodes="):
        nodes = int(option.split("=", 1)[1])
kill_on_bad_exit = "--kill-on-bad-exit=1" in sys.argv
tasks = {}
for n in range(nodes):
    task = subprocess.Popen(args, env={**os.environ, "SLURM_NODEID": str(n),
                                       "SLURMD_NODENAME": f"node0{n + 1}"})
    tasks[task.pid] = task
def forward(signum, frame=None):
    for t in tasks.values():
        if t.poll() is None:
            t.send_signal(signum)
signal.signal(signal.SIGTERM, forward)
worst = 0
for _ in range(nodes):
    pid, status = os.wait()
    rc = os.waitstatus_to_exitcode(status)
    tasks[pid].returncode = rc
    worst = max(worst, rc if rc >= 0 else 128 - rc)
    if rc != 0 and kill_on_bad_exit:  # --kill-on-bad-exit: one failed task ends the step
        forward(signal.SIGTERM)
sys.exit(worst)
"""

SCONTROL = r"""
import sys
from lpsync.daemon.peers.discovery import expand_nodelist
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\n".join(expand_nodelist(sys.argv[3])))
"""

# lpsync: `daemon` records its argv and waits for SIGTERM (STUB_DAEMON_FAIL_NODE exits 1
# at once instead); `health` fails its first call per node, then says whether that
# node's daemon runs. torchrun: records, sleeps STUB_TRAIN_SECONDS, exits STUB_TRAIN_RC.
COMMON = r"""
import json, os, signal, sys, time
def event(kind, **extra):
    line = json.dumps({"event": kind, "node": int(os.environ.get("SLURM_NODEID", -1)),
                       "t": time.monotonic(), **extra})
    with open(os.environ["STUB_EVENTS"], "a") as f:
        f.write(line + "\n")
node = os.environ["SLURM_NODEID"]
state = os.environ["STUB_STATE"]
"""

LPSYNC = (
    COMMON
    + r"""
if sys.argv[1] == "daemon":
    if os.environ.get("STUB_DAEMON_FAIL_NODE") == node:
        event("daemon-failed", argv=sys.argv[1:])
        sys.exit(1)
    stopped = []
    signal.signal(signal.SIGTERM, lambda s, f: stopped.append(s))
    event("daemon-start", argv=sys.argv[1:], env={k: v for k, v in os.environ.items()
                                                   if k.startswith(("SLURM_", "LPSYNC_"))})
    open(f"{state}/running-{node}", "w").close()
    while not stopped:
        signal.pause()
    os.unlink(f"{state}/running-{node}")
    event("daemon-stop")
    sys.exit(0)
if sys.argv[1] == "health":
    calls = f"{state}/health-calls-{node}"
    first = not os.path.exists(calls)
    open(calls, "a").close()
    ok = not first and os.path.exists(f"{state}/running-{node}")
    event("health", ok=ok, argv=sys.argv[1:])
    sys.exit(0 if ok else 1)
sys.exit(f"unexpected lpsync {sys.argv[1:]}")
"""
)

TORCHRUN = (
    COMMON
    + r"""
event("train-start", argv=sys.argv[1:], socket=os.environ.get("LPSYNC_SOCKET"),
      job=os.environ.get("LPSYNC_JOB"), secret=bool(os.environ.get("LPSYNC_SECRET")))
signal.signal(signal.SIGTERM, lambda s, f: (event("train-term"), sys.exit(143)))
time.sleep(float(os.environ.get("STUB_TRAIN_SECONDS", "0")))
rc = int(os.environ.get("STUB_TRAIN_RC", "0"))
event("train-end", rc=rc)
sys.exit(rc)
"""
)


@pytest.fixture
def slurm(tmp_path: Path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("lpsync", LPSYNC), ("torchrun", TORCHRUN)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    events = tmp_path / "events.jsonl"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_EVENTS": str(events),
        "STUB_STATE": str(state),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": NODELIST,
        "SLURM_JOB_NUM_NODES": str(NODES),
        "LPSYNC_RUN_DIR": str(tmp_path / "run"),
    }
    env.pop("LPSYNC_SECRET", None)

    started: list[subprocess.Popen] = []

    def start(**extra: str) -> subprocess.Popen:
        # A session of its own: whatever the script leaves behind can be killed as a group.
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), "train.py", "--epochs", "1"],
            env={**env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    def read() -> list[dict]:
        if not events.exists():
            return []
        return [json.loads(line) for line in events.read_text().splitlines()]

    yield start, read
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group outlives the script on a failure
        proc.wait(10)
    leftover = [p.name for p in state.glob("running-*")]
    assert not leftover, f"stub daemons still running: {leftover}"


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _first(events: list[dict], kind: str) -> float:
    return min(e["t"] for e in events if e["event"] == kind)


def _last(events: list[dict], kind: str) -> float:
    return max(e["t"] for e in events if e["event"] == kind)


def _nodes(events: list[dict], kind: str) -> list[int]:
    return sorted(e["node"] for e in events if e["event"] == kind)


def test_daemons_then_health_then_trainers_then_stop(slurm) -> None:
    start, read = slurm
    rc, err = _finish(start())
    events = read()
    assert rc == 0, err
    assert _nodes(events, "daemon-start") == list(range(NODES))
    assert _nodes(events, "train-start") == list(range(NODES))
    assert _nodes(events, "daemon-stop") == list(range(NODES))
    # The wait: a failed health round, then one where every node answered.
    assert any(not e["ok"] for e in events if e["event"] == "health")
    healthy = [e for e in events if e["event"] == "health" and e["ok"]]
    assert sorted(e["node"] for e in healthy) == list(range(NODES))
    assert _last(events, "daemon-start") < _first(events, "train-start")
    assert max(e["t"] for e in healthy) < _first(events, "train-start")
    assert _last(events, "train-end") < _first(events, "daemon-stop")

    # Every daemon's command line is lpsync's own, and under this node's Slurm variables
    # it finds every node as a peer, itself at SLURM_NODEID.
    for e in (e for e in events if e["event"] == "daemon-start"):
        args = build_parser().parse_args(e["argv"])
        config = daemon_config.from_args(args, e["env"])
        peers = config.peer_set(e["env"])
        assert peers is not None and peers.node_rank == e["node"]
        assert [str(p) for p in peers.peers] == ["node01:13337", "node02:13337"]
        assert config.socket == e["env"]["LPSYNC_SOCKET"]
        assert config.metrics_port == 9750
    for e in (e for e in events if e["event"] == "health"):
        assert e["argv"][e["argv"].index("--socket") + 1] == config.socket
    for e in (e for e in events if e["event"] == "train-start"):
        argv = e["argv"]
        assert argv[argv.index("--node-rank") + 1] == str(e["node"])
        assert argv[argv.index("--nnodes") + 1] == str(NODES)
        assert argv[argv.index("--master-addr") + 1] == "node01"
        assert argv[-3:] == ["train.py", "--epochs", "1"]
        assert e["socket"] == config.socket and e["job"] == "slurm-4242" and e["secret"]


def test_a_failing_trainer_fails_the_job_and_stops_the_daemons(slurm) -> None:
    start, read = slurm
    rc, err = _finish(start(STUB_TRAIN_RC="3"))
    events = read()
    assert rc != 0, err  # srun's status: 3, or the signal that ended the other node's task
    assert {e["rc"] for e in events if e["event"] == "train-end"} == {3}
    assert _nodes(events, "daemon-stop") == list(range(NODES))


def test_cancellation_stops_trainers_and_daemons(slurm) -> None:
    start, read = slurm
    proc = start(STUB_TRAIN_SECONDS="120")
    deadline = time.monotonic() + 60
    while len(_nodes(read(), "train-start")) < NODES:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    cancelled = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # what scancel (or the time limit's warning) sends
    rc, err = _finish(proc, timeout=30)
    events = read()
    assert rc == 143, err
    assert "cancelled" in err
    assert time.monotonic() - cancelled < 20
    assert _nodes(events, "train-term") == list(range(NODES))
    assert _nodes(events, "daemon-stop") == list(range(NODES))
    assert not [e for e in events if e["event"] == "train-end"]


def test_a_daemon_that_does_not_start_fails_the_job_before_training(slurm) -> None:
    start, read = slurm
    rc, err = _finish(start(STUB_DAEMON_FAIL_NODE="1"))
    events = read()
    assert rc == 1 and "a daemon exited before serving" in err, err
    assert not _nodes(events, "train-start")
    # Node 0's daemon is stopped by --kill-on-bad-exit, possibly before it even started
    # (then SIGTERM ends it at once): every daemon that started was stopped.
    assert _nodes(events, "daemon-stop") == _nodes(events, "daemon-start")
    assert set(_nodes(events, "daemon-start")) <= {0}
