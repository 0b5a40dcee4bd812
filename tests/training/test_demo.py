"""``lpsync demo`` end to end (one epoch): two daemons, torchrun trainers, the one-process
and gloo comparisons; and Ctrl-C in the middle of training leaves nothing behind."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from lpsync.demo.job import EQUIVALENCE_BOUND, Differences
from tests.installed import skip_unless_installed

skip_unless_installed("ucxx", "sklearn")

ROOT = Path(__file__).resolve().parents[2]
DEMO = [sys.executable, "-m", "lpsync.cli", "demo", "--epochs", "1"]


def _leftovers(tmp: str) -> list[str]:
    """Processes (daemons, launchers, trainers) whose command line names the demo's
    directory, and the directory itself if it is still there."""
    found = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left = [line for line in found.splitlines() if tmp in line]
    return left + ([tmp] if Path(tmp).exists() else [])


def _directory(output: str) -> str:
    match = re.search(r"socket (/\S+)/node0\.sock", output)
    assert match, output
    return match.group(1)


def test_demo_trains_and_compares() -> None:
    done = subprocess.run(DEMO, capture_output=True, text=True, timeout=400, cwd=ROOT, check=False)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "[lpsync x4] epoch 1" in out and "[gloo x4] epoch 1" in out and "[single]" in out
    # the three differences printed, and the verdict the exit code rests on
    assert re.search(r"lpsync x4 vs one process: \S+ +\(gloo vs one process: \S+; lpsync vs gloo: \S+\)", out)
    assert re.search(r"^   (equal to rounding|rounding grown by the training)", out, re.M), out
    assert out.count("/metrics") >= 4, out  # each daemon's URL, at start and at the end
    loss = float(re.search(r"\[lpsync x4\] epoch 1: loss (\S+)", out).group(1))
    assert loss < 2.3, out  # below ln(10): it learns
    time.sleep(1)
    assert not _leftovers(_directory(out))


def test_demo_interrupted_cleans_up(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            DEMO,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 120
        while "DDP with the lpsync comm hook" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(2)  # the launchers are starting their trainers
        proc.send_signal(signal.SIGINT)
        # 130 from the demo's own handling; now and then (2 of 8 fresh-clone runs on
        # 2026-12-08, also with SIGINT ignored once handled) it dies of SIGINT (-2) after
        # printing "interrupted": a second interrupt of unknown origin (the note).
        # Either way it stopped on the interrupt, and what it leaves is checked below.
        assert proc.wait(60) in (130, -signal.SIGINT), log.read_text()
        assert "lpsync demo: interrupted" in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    time.sleep(1)
    assert not _leftovers(_directory(log.read_text())), log.read_text()


LAUNCHER = """
import subprocess, sys, time
trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(trainer.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_stopping_reaps_a_launcher_whose_wait_lock_an_interrupt_left_held() -> None:
    """CI saw this: Ctrl-C landed inside Popen.wait just after it took its lock, every later
    wait on that launcher timed out, and the demo exited 1 instead of 130. The stop must reap
    it anyway and reach the trainer in its own session."""
    from lpsync.demo.job import _stop_all

    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    trainer = int(launcher.stdout.readline())
    assert launcher._waitpid_lock.acquire(False)  # as the interrupted wait left it
    started = time.monotonic()
    _stop_all([launcher])
    assert launcher.returncode == -signal.SIGTERM
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while _alive(trainer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(trainer)
    launcher.stdout.close()


def test_demo_reports_a_failing_trainer(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('trainer starting', file=sys.stderr)\nsys.exit(3)\n")
    done = subprocess.run(
        [*DEMO, "--script", str(script)], capture_output=True, text=True, timeout=200, cwd=ROOT
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the lpsync training failed" in done.stderr and "trainer starting" in done.stderr, done.stderr
    assert not _leftovers(_directory(done.stdout))


def test_the_verdict_tells_grown_rounding_from_a_wrong_average() -> None:
    """Equal to rounding; a first epoch step for step as gloo's that later drifted apart
    (the tuner's schedules round differently, the training grows it); and what a wrong
    average gives: its first epoch's losses part at once."""
    b = EQUIVALENCE_BOUND
    assert Differences(1e-5, 1e-5, 3e-7).kept()
    assert Differences(3e-2, 1e-5, 3e-2).kept() is False  # no step losses at hand: no leniency
    drifted = Differences(3e-2, 1e-5, 3e-2, first_epoch_losses=2e-7, final_loss_ratio=1.01)
    assert drifted.kept() and not drifted.to_rounding()
    assert "rounding grown by the training" in drifted.explained()
    wrong = Differences(3e-2, 1e-5, 3e-2, first_epoch_losses=4e-3, final_loss_ratio=1.01)
    assert not wrong.kept() and "lpsync differs from gloo by 3.00e-02" in wrong.explained()
    assert not Differences(3e-2, 1e-5, 3e-2, first_epoch_losses=b / 2, final_loss_ratio=1.5).kept()
    assert not Differences(1e-5, 1e-7, 1e-5 + 2 * b).kept()  # further from one process than gloo
