"""deploy/slurm/lpsync-train.sbatch under a real Slurm (Debian's slurm-wlm 22.05 and munge,
a one-node cluster started by tests/deploy/slurm_cluster.py): the trainers of
examples/train_digits.py (2 ranks) through the job's lpsync daemon, run to the end, cancelled
with scancel in the middle, stopped by the time limit's warning, and failing. In each, the daemon
drains (its "shutting down" and "daemon stopped" lines) and its task exits 0 by
slurmstepd's record (not killed), it leaves no socket in the run directory and no segment in
/dev/shm, no process of the job is left, and Slurm records the job as COMPLETED (CANCELLED
for scancel, FAILED for failing trainers). The stub tests (test_slurm.py) keep what one node
cannot show: two nodes.

Runs only with LPSYNC_SLURM_E2E=1 (`make test-slurm`, which .ci/run calls); skips with the
reason where Slurm is not installed or does not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from lpsync.demo.job import Differences
from lpsync.memory.shm import leaked_segments
from tests.deploy.deploy_files import DEPLOY, ROOT, tool
from tests.deploy.slurm_cluster import ENDED, SlurmCluster, SlurmError, slurm_cluster
from tests.ports import free_ports

SCRIPT = DEPLOY / "slurm" / "lpsync-train.sbatch"
TRAIN = ROOT / "examples" / "train_digits.py"
RANKS = 2  # PROCS_PER_NODE on the one node

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.environ.get("LPSYNC_SLURM_E2E") != "1",
        reason="the real-Slurm lane runs with `make test-slurm` (LPSYNC_SLURM_E2E=1)",
    ),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    if os.geteuid() != 0:
        pytest.skip("the test cluster's munged and slurmd run as root")
    for binary in ("munged", "slurmctld", "slurmd", "sbatch"):
        tool(binary, "slurm-wlm munge")
    with contextlib.ExitStack() as stack:  # at the end: SlurmError if a daemon needed SIGKILL
        try:
            cluster = stack.enter_context(slurm_cluster(tmp_path_factory.mktemp("slurm")))
        except SlurmError as e:
            pytest.skip(f"Slurm does not start here: {e}")
        yield cluster


@dataclass
class Job:
    id: int
    output: Path  # the batch script's stdout and stderr, and so every step's
    run_dir: Path  # LPSYNC_RUN_DIR: the daemon's socket

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def daemon_log(self) -> list[dict]:
        """The daemon's JSON log records (they reach the job's output through srun)."""
        records = []
        for line in self.text().splitlines():
            if line.startswith('{"ts"'):
                records.append(json.loads(line))
        return records

    def daemon_pid(self) -> int:
        serving = [r["pid"] for r in self.daemon_log() if r["msg"] == "daemon serving"]
        assert len(serving) == 1, self.text()
        return serving[0]

    def epochs(self) -> list[str]:
        return re.findall(rf"^\[lpsync x{RANKS}\] epoch \d+:.*$", self.text(), re.M)


def submit(cluster: SlurmCluster, tmp_path: Path, *train_args: str, sbatch: tuple[str, ...] = ()) -> Job:
    """The sbatch script on the one node, as a user submits it (PROCS_PER_NODE=2), with ports
    free now (other tests share the machine) and the run directory under ``tmp_path``."""
    peer_port, metrics_port, master_port = free_ports(3)
    run_dir, output = tmp_path / "run", tmp_path / "job.out"
    env = {
        **cluster.env,
        "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}",  # lpsync, torchrun
        "PROCS_PER_NODE": str(RANKS),
        "LPSYNC_PEER_PORT": str(peer_port),
        "LPSYNC_METRICS_PORT": str(metrics_port),
        "MASTER_PORT": str(master_port),
        "LPSYNC_RUN_DIR": str(run_dir),
    }
    env.pop("LPSYNC_SECRET", None)  # the script draws one per job
    done = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", f"--output={output}", f"--chdir={ROOT}", *sbatch,
         str(SCRIPT), str(TRAIN), *train_args],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return Job(int(done.stdout.strip().split(";")[0]), output, run_dir)


def wait_for(what: str, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.5)


def assert_drained(cluster: SlurmCluster, job: Job, trainers: int = RANKS) -> None:
    """The daemon drained and exited by itself; nothing of the job is left."""
    log = job.daemon_log()
    messages = [r["msg"] for r in log]
    assert messages.count("shutting down: draining collectives") == 1, job.text()
    assert messages.count("daemon stopped") == 1, job.text()
    assert messages.index("shutting down: draining collectives") < messages.index("daemon stopped")
    for line in ("Killed", "did not end within"):
        assert line not in job.text(), job.text()
    # lpsync.sock and lpsync.sock.trigger removed; the daemon's segments unlinked.
    assert job.run_dir.is_dir() and not list(job.run_dir.iterdir())
    daemon = job.daemon_pid()
    assert not leaked_segments(daemon)
    # Its task ended by itself, with status 0: Slurm killed nothing (slurmstepd's record).
    assert cluster.task_exits(job.id).get(daemon) == "exit code 0", cluster.task_exits(job.id)
    # The daemon, the trainers and every process of the job are gone (slurmstepd may take
    # a moment after the job's end).
    attached = [r["pid"] for r in log if r["msg"] == "attached"]
    assert len(attached) == trainers, job.text()
    wait_for("the job's processes to end", lambda: not cluster.job_processes(job.id), 30)
    for pid in (daemon, *attached):
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} of job {job.id} is still alive"


def elapsed(fields: dict[str, str]) -> float:
    start, end = (datetime.fromisoformat(fields[k]) for k in ("StartTime", "EndTime"))
    return (end - start).total_seconds()


def test_a_training_run_completes_and_its_daemon_drains(cluster: SlurmCluster, tmp_path: Path) -> None:
    job = submit(cluster, tmp_path, "--epochs", "2", "--save", str(tmp_path / "slurm.npy"))
    # The demo's references: the same training in one process on the combined batch, and
    # the same ranks with DDP over gloo (what 2 ranks drift from one process by is the
    # training's own: lpsync.demo.job.Differences).
    (port,) = free_ports(1)
    for reference in (
        [str(TRAIN), "--single", "--world", str(RANKS)],
        ["-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-port", str(port),
         str(TRAIN), "--backend", "gloo"],
    ):  # fmt: skip
        name = "single" if "--single" in reference else "gloo"
        subprocess.run(
            [sys.executable, *reference, "--epochs", "2", "--save", str(tmp_path / f"{name}.npy")],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
    fields = cluster.wait_job(job.id, timeout=300)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), job.text()
    assert len(job.epochs()) == 2, job.text()
    saved = (np.load(tmp_path / f"{name}.npy") for name in ("slurm", "single", "gloo"))
    differences = Differences.between(*saved)
    assert differences.kept(), differences
    # Nothing but the script's own lines: the health wait's expected misses print no error.
    for noise in ("srun: error", "forcing job termination", "CANCELLED", "error:"):
        assert noise not in job.text(), job.text()
    assert "lpsync-daemons ended (srun status 0)" in job.text(), job.text()
    assert_drained(cluster, job)


def test_scancel_in_the_middle_cancels_the_job_and_the_daemon_drains(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    job = submit(cluster, tmp_path, "--epochs", "100000")
    wait_for(
        "the first epoch",
        lambda: job.epochs() or cluster.job(job.id)["JobState"] in ENDED,
        240,
    )
    assert job.epochs(), job.text()
    daemon = job.daemon_pid()
    assert leaked_segments(daemon), "the trainers' buffers: the daemon's segments in /dev/shm"
    cluster.command("scancel", str(job.id))
    fields = cluster.wait_job(job.id, timeout=90)
    assert fields["JobState"] == "CANCELLED", job.text()
    assert "lpsync-train: cancelled" in job.text()
    assert_drained(cluster, job)


def test_the_time_limit_stops_the_trainers_and_the_daemon_drains(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    # 3 minutes and the script's --signal=B:USR1@60: the warning comes 60 to 120 s in
    # (slurmctld sends it up to a minute early), when the trainers are running.
    job = submit(cluster, tmp_path, "--epochs", "100000", sbatch=("--time=3",))
    fields = cluster.wait_job(job.id, timeout=300)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), job.text()
    assert elapsed(fields) < 180, fields  # ended by the warning, before the limit
    text = job.text()
    assert "lpsync-train: the time limit is near: stopping" in text, text
    # Training was under way when the warning came (the trainers print on until stopped).
    assert job.epochs(), text
    assert text.index(job.epochs()[0]) < text.index("the time limit is near"), text
    assert "forcing job termination" not in text, text
    assert "lpsync-daemons ended (srun status 0)" in text, text
    assert_drained(cluster, job)


def test_failing_trainers_fail_the_job_and_the_daemon_drains(cluster: SlurmCluster, tmp_path: Path) -> None:
    job = submit(cluster, tmp_path, "--no-such-option")  # every rank exits 2 (argparse)
    fields = cluster.wait_job(job.id, timeout=300)
    text = job.text()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", fields
    assert "unrecognized arguments: --no-such-option" in text, text
    assert re.search(r"lpsync-train: the trainers ended \(srun status [1-9]", text), text
    assert "lpsync-daemons ended (srun status 0)" in text, text
    assert_drained(cluster, job, trainers=0)
