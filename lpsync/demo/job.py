"""Run the digits training three ways and compare: 4 trainers under torchrun with the
lpsync DDP hook (2 per node, each node's trainers on their node's daemon), one process on
the combined batch, and the same 4 trainers with DDP over gloo."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lpsync.daemon.launch import reaped
from lpsync.demo.local_cluster import DemoError, LocalCluster, clean_env, tail
from lpsync.transport.ports import free_ports

# The parameters of two trainings that differ only by float32 rounding: the order each
# bucket is summed in (the algorithm the daemons pick; gloo's ring) and the ranks' mean of
# means against one process's mean over the combined batch. The training amplifies that
# rounding, and by how much depends on the CPU's kernels and on the batch: the default run
# (4 ranks, 5 epochs) 6.3e-7 from one process on one machine (2026-12-07), 1.2e-5 on
# another (2026-12-08); 2 ranks of 16 samples 1.1e-3 after one epoch and 0.08 after two,
# gloo's as lpsync's (a combined batch of 32 trains on the edge of stability). A real error
# is far larger. At lr 0.1 the default run's grew to 0.26 (train_digits.py says why).
EQUIVALENCE_BOUND = 1e-4


@dataclass(frozen=True)
class Differences:
    """How far apart the three trainings ended, and how far lpsync's and gloo's per-step
    losses were in the first epoch (None where the reports are not at hand)."""

    lpsync_single: float  # the largest parameter difference, lpsync against one process
    gloo_single: float  # DDP over gloo against the same one process
    lpsync_gloo: float
    first_epoch_losses: float | None = None  # the largest gap of lpsync's and gloo's step losses
    final_loss_ratio: float | None = None  # lpsync's last epoch's loss over gloo's

    @classmethod
    def between(
        cls,
        lpsync: np.ndarray,
        single: np.ndarray,
        gloo: np.ndarray,
        reports: tuple[dict[str, Any], dict[str, Any]] | None = None,
    ) -> Differences:
        """``reports``: lpsync's and gloo's per-epoch reports (train_digits.py --report)."""

        def worst(a: np.ndarray, b: np.ndarray) -> float:
            return float(np.abs(a - b).max())

        losses: float | None = None
        ratio: float | None = None
        if reports is not None:
            mine, theirs = (report["epochs"] for report in reports)
            losses = worst(np.array(mine[0]["step_loss"]), np.array(theirs[0]["step_loss"]))
            ratio = mine[-1]["loss"] / theirs[-1]["loss"]
        return cls(worst(lpsync, single), worst(gloo, single), worst(lpsync, gloo), losses, ratio)

    def to_rounding(self) -> bool:
        """lpsync trained as DDP over gloo did, to rounding, and is no further from one
        process than gloo is. One process is the mathematical reference, but what any
        data-parallel float32 training drifts from it by is the training's own (gloo
        measures it), not the collectives'."""
        return (
            self.lpsync_gloo <= EQUIVALENCE_BOUND
            and self.lpsync_single <= self.gloo_single + EQUIVALENCE_BOUND
        )

    def kept(self) -> bool:
        """BSP-SGD's result is kept: to rounding, or lpsync's first epoch went step for step
        as gloo's (a wrongly reduced gradient shows on the next step's loss) and it ended as
        well. The tuner's first calls of a size try schedules that round differently from
        run to run, and now and then this training grows such a last-bit difference into a
        parameter difference of 1e-2 after the first epoch (docs/training.md)."""
        if self.to_rounding():
            return True
        if self.first_epoch_losses is None or self.final_loss_ratio is None:
            return False
        return self.first_epoch_losses <= EQUIVALENCE_BOUND and self.final_loss_ratio <= 1.1

    def explained(self) -> str:
        """The verdict in a sentence, with the figures it rests on."""
        if self.to_rounding():
            return f"equal to rounding (bound {EQUIVALENCE_BOUND:g})"
        losses = (
            f"the first epoch's step losses {self.first_epoch_losses:.1e} apart, the last epoch's "
            f"loss {self.final_loss_ratio:.3f}x gloo's"
            if self.first_epoch_losses is not None and self.final_loss_ratio is not None
            else "no step losses at hand"
        )
        if self.kept():
            return f"rounding grown by the training after the first epoch ({losses})"
        return (
            f"lpsync differs from gloo by {self.lpsync_gloo:.2e} and from one process by "
            f"{self.lpsync_single:.2e} (gloo: {self.gloo_single:.2e}; bound {EQUIVALENCE_BOUND:g}); {losses}"
        )


# seconds a launcher has to stop its trainers on SIGTERM, and then to go after SIGKILL
STOP_GRACE = 15.0
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


@dataclass(frozen=True)
class DemoOptions:
    nodes: int = 2
    per_node: int = 2  # trainers per node
    epochs: int = 5
    batch: int = 16  # samples per trainer and step
    lr: float = 0.05  # train_digits.py says why not 0.1
    script: Path = SCRIPT  # the training script (runs under torchrun)
    timeout: float = 600.0  # per training job
    keep: Path | None = None  # copy the daemons' and trainers' logs here


def say(text: str) -> None:
    print(text, flush=True)


class _Interrupted(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C: everything started is stopped on the way out."""


def run(options: DemoOptions) -> int:
    if not options.script.exists():
        raise DemoError(f"the training script {options.script} is missing (pass --script)")
    tmp = Path(tempfile.mkdtemp(prefix="lpsync-demo-"))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    cluster: LocalCluster | None = None
    try:
        say(f"== starting {options.nodes} lpsync daemons (peers over loopback, a fresh secret)")
        cluster = LocalCluster(tmp, options.nodes)
        for node in cluster.nodes:
            say(f"   node {node.rank}: socket {node.socket}, metrics {node.metrics_url}")
        world = options.nodes * options.per_node
        say(
            f"== BSP-SGD on the digits: {world} trainers ({options.per_node} per node, "
            f"torchrun), DDP with the lpsync comm hook"
        )
        lpsync = _torchrun(options, cluster, tmp, "lpsync")
        say(f"== the same training in one process on the combined batch ({world} x {options.batch})")
        single = _single(options, tmp, world)
        say(f"== the same {world} trainers, DDP over gloo")
        gloo = _torchrun(options, cluster, tmp, "gloo")
        differences = _summary(lpsync, single, gloo, cluster)
        if not differences.kept():
            say(f"FAILED: {differences.explained()}")
            return 1
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if cluster is not None:
            cluster.stop()
        if options.keep is not None:
            shutil.copytree(
                tmp, options.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock*", "*.secret")
            )
        shutil.rmtree(tmp, ignore_errors=True)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise _Interrupted()


def _digits(options: DemoOptions, tmp: Path) -> list[str]:
    """The bundled script's ``--digits``: the dataset loaded here once and saved for every
    trainer, which then skips scikit-learn's import (~1 CPU-s each, 9 trainers). Another
    --script is given the flags it was documented to take, no more."""
    if options.script != SCRIPT:
        return []
    saved = tmp / "digits.npz"
    if not saved.exists():
        try:
            from sklearn.datasets import load_digits  # type: ignore[import-untyped]
        except ImportError:
            raise DemoError("the digits come from scikit-learn: pip install -e '.[torch]'") from None
        data = load_digits()
        np.savez(saved, images=data.images, target=data.target)
    return ["--digits", str(saved)]


def _trainer_args(options: DemoOptions, tmp: Path, tag: str) -> list[str]:
    return [
        str(options.script),
        "--epochs",
        str(options.epochs),
        "--batch",
        str(options.batch),
        "--lr",
        str(options.lr),
        "--save",
        str(tmp / f"{tag}.npy"),
        "--report",
        str(tmp / f"{tag}.json"),
        *_digits(options, tmp),
    ]


def _torchrun(options: DemoOptions, cluster: LocalCluster, tmp: Path, backend: str) -> dict[str, Any]:
    (port,) = free_ports(1)
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for node in cluster.nodes:
            env = {
                **clean_env(),
                "LPSYNC_SOCKET": node.socket,
                "LPSYNC_JOB": f"digits-{backend}",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
            log = tmp / f"{backend}-node{node.rank}.log"
            with open(log, "wb") as err:
                procs.append(
                    (
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "torch.distributed.run",
                                "--nnodes",
                                str(options.nodes),
                                "--node-rank",
                                str(node.rank),
                                "--nproc-per-node",
                                str(options.per_node),
                                "--master-addr",
                                "127.0.0.1",
                                "--master-port",
                                str(port),
                                "--log-dir",
                                str(log.with_suffix("")),
                                "--redirects",
                                "2",
                                *_trainer_args(options, tmp, backend),
                                "--backend",
                                backend,
                            ],
                            # rank 0 (node 0) prints the epochs to our stdout; the rest goes to logs
                            stdout=None if node.rank == 0 else err,
                            stderr=err,
                            env=env,
                            start_new_session=True,
                        ),
                        log,
                    )
                )
        _wait(procs, cluster, options.timeout, f"the {backend} training")
    finally:
        _stop_all([proc for proc, _ in procs])
    return _result(tmp, backend)


def _single(options: DemoOptions, tmp: Path, world: int) -> dict[str, Any]:
    log = tmp / "single.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, *_trainer_args(options, tmp, "single"), "--single", "--world", str(world)],
            stderr=err,
            env={**clean_env(), "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
    try:
        _wait([(proc, log)], None, options.timeout, "the one-process training")
    finally:
        _stop_all([proc])
    return _result(tmp, "single")


def _wait(
    procs: list[tuple[subprocess.Popen[bytes], Path]], cluster: LocalCluster | None, timeout: float, what: str
) -> None:
    """Block until every process has exited 0; the first failure (or a dead daemon) ends
    the wait with the logs' tails."""
    deadline = time.monotonic() + timeout
    for proc, log in procs:
        while True:
            try:
                rc = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if cluster is not None:
                    cluster.check()
                failed = [(p, lg) for p, lg in procs if p.poll() not in (None, 0)]
                if failed:
                    proc, log = failed[0]
                    rc = proc.returncode
                    break
                if time.monotonic() > deadline:
                    raise DemoError(f"{what} did not finish within {timeout:g} s") from None
        if rc != 0:
            raise DemoError(f"{what} failed (exit {rc}):\n{_trainer_errors(log)}")


def _trainer_errors(log: Path) -> str:
    """The trainers' own stderr (torchrun --log-dir: <log without .log>/<run>/attempt_N/
    <local rank>/stderr.log), else the launcher's log."""
    found = []
    for err in sorted(log.with_suffix("").glob("**/stderr.log")):
        text = tail(err, 15).strip()
        if text:
            found.append(f"-- {err.relative_to(log.parent)}:\n{text}")
    return "\n".join(found) if found else tail(log)


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop launchers and their trainers, all at once, without raising: this runs on the way
    out of an interrupt too, whose exit code must survive it.

    torchrun starts each trainer in a session of its own, so a signal to the launcher's
    group does not reach them; they are found first, as the launcher's descendants. SIGTERM
    lets torchrun stop its trainers itself; what is left after the grace gets SIGKILL."""
    running = [proc for proc in procs if not reaped(proc)]
    trainers = [pid for proc in running for pid in _descendants(proc.pid)]
    for proc in running:
        _signal_group(proc.pid, signal.SIGTERM)
    _wait_all(running, STOP_GRACE)
    for proc in procs:  # the launcher's group: what it started in its own session
        _signal_group(proc.pid, signal.SIGKILL)
    for pid in trainers:  # each a session leader under torchrun; a plain child otherwise
        _signal_group(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for proc in _wait_all(running, STOP_GRACE):
        print(f"lpsync demo: launcher {proc.pid} did not exit after SIGKILL", file=sys.stderr)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _wait_all(procs: list[subprocess.Popen[bytes]], seconds: float) -> list[subprocess.Popen[bytes]]:
    """Wait for the processes within one shared deadline; returns those still running."""
    deadline = time.monotonic() + seconds
    left = [proc for proc in procs if not reaped(proc)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [proc for proc in left if not reaped(proc)]
    return left


def _descendants(root: int) -> list[int]:
    """Every live process below ``root``, from /proc/*/stat (/proc/PID/task/*/children
    needs CONFIG_PROC_CHILDREN, which the CI machines' kernel lacks)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the command name (field 2) may hold spaces and parentheses: split after its last ")"
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _result(tmp: Path, tag: str) -> dict[str, Any]:
    report = json.loads((tmp / f"{tag}.json").read_text())
    report["params"] = np.load(tmp / f"{tag}.npy")
    return report


def _summary(
    lpsync: dict[str, Any], single: dict[str, Any], gloo: dict[str, Any], cluster: LocalCluster
) -> Differences:
    """Print the comparison; returns the differences."""
    n = lpsync["params"].size
    differences = Differences.between(lpsync["params"], single["params"], gloo["params"], (lpsync, gloo))
    say("")
    say("== results")
    say(f"RQ4, BSP-SGD's result kept: largest parameter difference over {n} parameters")
    say(
        f"   lpsync x{lpsync['world']} vs one process: {differences.lpsync_single:.2e}   "
        f"(gloo vs one process: {differences.gloo_single:.2e}; lpsync vs gloo: {differences.lpsync_gloo:.2e})"
    )
    say(f"   {differences.explained()}")
    say("RQ3, step time (median per epoch; comm = the buckets' collectives in flight, overlapping backward)")
    say(
        f"   {'epoch':>5}  {'lpsync step':>11}  {'lpsync comm':>11}  {'gloo step':>9}  "
        f"{'gloo comm':>9}  {'loss':>7}  {'accuracy':>8}"
    )
    for lp, gl in zip(lpsync["epochs"], gloo["epochs"], strict=True):
        say(
            f"   {lp['epoch']:>5}  {lp['step_ms']:>8.2f} ms  {lp['comm_ms']:>8.2f} ms  "
            f"{gl['step_ms']:>6.2f} ms  {gl['comm_ms']:>6.2f} ms  {lp['loss']:>7.4f}  "
            f"{100 * lp['accuracy']:>7.1f}%"
        )
    first, last = lpsync["epochs"][0], lpsync["epochs"][-1]
    say(
        f"converged: loss {first['loss']:.3f} -> {last['loss']:.3f}, test accuracy "
        f"{100 * last['accuracy']:.1f}%"
    )
    say("metrics: " + ", ".join(node.metrics_url for node in cluster.nodes))
    return differences
