"""A one-node Slurm cluster of Debian's slurm-wlm and munge, for the real-Slurm lane.

Everything lives in one temporary directory: the munge key and socket, slurm.conf (ports
free now, SlurmUser root, no cgroups: proctrack/linuxproc, task/none; no accounting
database: jobcomp/filetxt, and jobs are read back with `scontrol show job`), state, spool
and logs. munged, slurmctld and slurmd run in the foreground as children of the test and
are stopped by SIGTERM at the end. Clients find the cluster through SLURM_CONF, which
sbatch passes on to the job's steps with the rest of the environment.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_ports

# The states of a job that has ended (`scontrol show job`); any other (PENDING, RUNNING,
# SIGNALING, COMPLETING, ...) is passing.
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE", "OUT_OF_MEMORY"}  # fmt: skip

CONF = """\
ClusterName=lpsynctest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=30
SlurmdDebug=verbose
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=lpsync Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmError(RuntimeError):
    """The cluster did not start or stop as it should (the message says which daemon)."""


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]  # the clients' environment: SLURM_CONF and no outer job's SLURM_*
    host: str
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    def command(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise SlurmError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, ExitCode, StartTime, ...)."""
        fields = self.command("scontrol", "show", "job", "--oneliner", str(job_id)).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """The job's fields once it has ended; SlurmError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] not in ENDED:
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} still {job['JobState']} after {timeout} s")
            time.sleep(0.5)
        return job

    def task_exits(self, job_id: int) -> dict[int, str]:
        """How each task of the job ended, by pid, as its slurmstepd logged it (SlurmdDebug
        verbose): "exit code 0", "Killed by signal 9", ..."""
        line = re.compile(rf"\[{job_id}\.\w+\] task \d+ \((\d+)\) exited\.? (?:with )?(.*?)\.?$")
        log = (self.root / "log" / "slurmd.log").read_text().splitlines()
        return {int(m[1]): m[2] for m in map(line.search, log) if m}

    def job_processes(self, job_id: int) -> list[str]:
        """Processes of this cluster's job ``job_id`` still alive: its slurmstepd, and any
        process whose environment names the job and this cluster's SLURM_CONF."""
        marks = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_CONF={self.env['SLURM_CONF']}".encode()}
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                stepd = cmdline.startswith(f"slurmstepd: [{job_id}.")
                if stepd or marks <= set((proc / "environ").read_bytes().split(b"\0")):
                    found.append(f"{proc.name}: {cmdline.strip()}")
        return found

    def stop(self) -> list[str]:
        """SIGTERM to slurmd, slurmctld and munged, in that order; the daemons that needed
        SIGKILL (none should)."""
        killed = []
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                killed.append(name)
        return killed


def _start(cluster: SlurmCluster, name: str, args: list[str]) -> None:
    log = (cluster.root / "log" / f"{name}.out").open("w")
    cluster.daemons[name] = subprocess.Popen(
        args, env=cluster.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
    )
    log.close()


def _until(cluster: SlurmCluster, what: str, ready, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [n for n, p in cluster.daemons.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-2000:] for p in (cluster.root / "log").glob("*") if p.is_file()}
            raise SlurmError(f"{what}: not within {timeout} s (exited: {dead}); logs: {logs}")
        time.sleep(0.2)


def _node_idle(cluster: SlurmCluster) -> bool:
    try:
        return cluster.command("sinfo", "--noheader", "--format=%T").strip() == "idle"
    except (SlurmError, subprocess.TimeoutExpired):
        return False


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd of a one-node cluster under ``root``, serving until the
    block ends; then stopped (SlurmError if one needed SIGKILL)."""
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True)
    (root / "munge").chmod(0o711)  # munged wants its socket's directory reachable, not writable
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (root / "plugstack.conf").touch()  # no SPANK plugins (not the host's /etc/slurm)
    host = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = free_ports(2)
    munge_socket = root / "munge" / "munge.socket.2"
    conf = root / "slurm.conf"
    conf.write_text(
        CONF.format(
            host=host,
            root=root,
            ctld_port=ctld_port,
            slurmd_port=slurmd_port,
            munge_socket=munge_socket,
            cpus=os.cpu_count() or 1,
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    cluster = SlurmCluster(root, {**env, "SLURM_CONF": str(conf)}, host)
    try:
        _start(
            cluster,
            "munged",
            ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
             f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/seed",
             f"--log-file={root}/log/munged.log"],
        )  # fmt: skip
        _until(cluster, "munged", munge_socket.exists)
        _start(cluster, "slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)])
        _start(cluster, "slurmd", ["slurmd", "-D", "-f", str(conf)])
        _until(cluster, "an idle node", lambda: _node_idle(cluster))
        yield cluster
    finally:
        killed = cluster.stop()
    if killed:
        raise SlurmError(f"{killed} did not stop on SIGTERM within 30 s")
