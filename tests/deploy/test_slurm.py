"""deploy/slurm/lpsync-train.sbatch on two nodes, against stub srun/squeue/scancel/scontrol/
lpsync/torchrun that record what happens: a daemon on every node (its peers and node rank
from that node's Slurm variables), a wait until every one is healthy, the trainers on every
node, and every daemon stopped at the end; a daemon that fails on one node fails the job
before training; daemons that ignore their stop signal are cancelled after the stop
timeout. The real Slurm of test_slurm_real.py has one node and a daemon that does stop,
so these run here; everything else (the stop through Slurm's signals, scancel, the time
limit, failing trainers) runs there.

The stubs follow real Slurm where the script depends on it: srun answers SIGTERM by
killing its tasks (SIGKILL), so a step is stopped by `scancel --signal` on its tasks."""

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

# srun: runs its command once per node (SLURM_NODEID), in parallel, as one step of the job
# (STUB_STATE/step-N: its name and task pids, for squeue and scancel); answers SIGTERM by
# killing its tasks, as real srun does ("forcing job termination"); exits with the worst
# status.
SRUN = r"""
import json, os, signal, subprocess, sys, time
args = sys.argv[1:]
nodes, name = 1, "srun"
while args and args[0].startswith("-"):
    option = args.pop(0)
    if option.startswith("--nodes="):
        nodes = int(option.split("=", 1)[1])
    if option.startswith("--job-name="):
        name = option.split("=", 1)[1]
kill_on_bad_exit = "--kill-on-bad-exit=1" in sys.argv
state = os.environ["STUB_STATE"]
step = 0
while True:  # the job's next step id
    try:
        os.close(os.open(f"{state}/step-{step}.claim", os.O_CREAT | os.O_EXCL))
        break
    except FileExistsError:
        step += 1
tasks = {}
def kill(signum=None, frame=None):
    if signum is not None:
        print("srun: forcing job termination", file=sys.stderr)
    for t in tasks.values():
        if t.poll() is None:
            t.kill()
signal.signal(signal.SIGTERM, kill)
for n in range(nodes):
    task = subprocess.Popen(args, env={**os.environ, "SLURM_NODEID": str(n), "SLURM_STEP_ID": str(step),
                                       "SLURMD_NODENAME": f"node0{n + 1}"})
    tasks[task.pid] = task
with open(f"{state}/step-{step}.tmp", "w") as f:
    json.dump({"name": name, "pids": list(tasks)}, f)
os.rename(f"{state}/step-{step}.tmp", f"{state}/step-{step}")
worst = 0
ended = set()
# Each task's end through Popen (kill() polls them too: an os.wait() here raced it and found
# its child reaped already), checked every 50 ms.
while len(ended) < len(tasks):
    for pid, t in tasks.items():
        if pid in ended or t.poll() is None:
            continue
        ended.add(pid)
        rc = t.returncode
        worst = max(worst, rc if rc >= 0 else 128 - rc)
        if rc != 0 and kill_on_bad_exit:  # --kill-on-bad-exit: one failed task ends the step
            for other in tasks.values():
                if other.poll() is None:
                    other.send_signal(signal.SIGTERM)
    time.sleep(0.05)
os.unlink(f"{state}/step-{step}")
sys.exit(worst)
"""

# squeue --steps: the live steps as JOBID.STEP NAME; scancel [--signal=SIG] JOBID.STEP...:
# the signal (default KILL) to every task of those steps.
SQUEUE = r"""
import json, os, re
state = os.environ["STUB_STATE"]
for name in sorted(os.listdir(state)):
    if re.fullmatch(r"step-\d+", name):  # not .claim (an id taken) nor .tmp (being written)
        with open(f"{state}/{name}") as f:
            print(f"{os.environ['SLURM_JOB_ID']}.{name[5:]}", json.load(f)["name"])
"""

SCANCEL = r"""
import json, os, signal, sys
args = sys.argv[1:]
signum = signal.SIGKILL
if args[0].startswith("--signal="):
    signum = signal.Signals["SIG" + args.pop(0).split("=", 1)[1]]
for step in args:
    with open(os.environ["STUB_STATE"] + "/step-" + step.split(".")[1]) as f:
        for pid in json.load(f)["pids"]:
            os.kill(pid, signum)
"""

SCONTROL = r"""
import sys
from lpsync.daemon.peers.discovery import expand_nodelist
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\n".join(expand_nodelist(sys.argv[3])))
"""

# lpsync: `daemon` records its argv and waits for SIGTERM or SIGINT (STUB_DAEMON_FAIL_NODE
# exits 1 at once instead; STUB_DAEMON_HANG ignores both); `health` fails its first call
# per node, then says whether that node's daemon runs. torchrun: records and exits 0.
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
    for signum in (signal.SIGTERM, signal.SIGINT):  # STUB_DAEMON_HANG: a daemon that never stops
        hang = os.environ.get("STUB_DAEMON_HANG") == "1"
        signal.signal(signum, signal.SIG_IGN if hang else lambda s, f: stopped.append(s))
    event("daemon-start", argv=sys.argv[1:], pid=os.getpid(),
          env={k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "LPSYNC_"))})
    open(f"{state}/running-{node}", "w").close()
    while not stopped:
        signal.pause()
    os.unlink(f"{state}/running-{node}")
    event("daemon-stop", signal=stopped[0])
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
event("train-end")
"""
)


@pytest.fixture
def slurm(tmp_path: Path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    stubs = {"srun": SRUN, "squeue": SQUEUE, "scancel": SCANCEL, "scontrol": SCONTROL}
    for name, body in {**stubs, "lpsync": LPSYNC, "torchrun": TORCHRUN}.items():
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
    # Stopped through Slurm (scancel --signal=INT on the daemons' step), not through srun,
    # whose SIGTERM would have killed them.
    assert {e["signal"] for e in events if e["event"] == "daemon-stop"} == {signal.SIGINT}
    assert "forcing job termination" not in err
    assert "lpsync-daemons ended (srun status 0)" in err, err

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


def test_daemons_that_do_not_stop_are_cancelled_after_the_stop_timeout(slurm, tmp_path: Path) -> None:
    start, read = slurm
    began = time.monotonic()
    rc, err = _finish(start(STUB_DAEMON_HANG="1", LPSYNC_STOP_TIMEOUT="2"))
    events = read()
    assert rc == 0, err  # the trainers' status
    assert "lpsync-daemons did not end within 2 s of SIGINT: cancelling it" in err, err
    assert "lpsync-daemons ended (srun status 137)" in err, err  # SIGKILL from scancel
    assert time.monotonic() - began < 30
    assert not _nodes(events, "daemon-stop")
    for e in (e for e in events if e["event"] == "daemon-start"):
        assert not Path(f"/proc/{e['pid']}").exists(), f"daemon on node {e['node']} still alive"
    for marker in (tmp_path / "state").glob("running-*"):
        marker.unlink()  # left by the killed stubs (the fixture checks for live ones)
