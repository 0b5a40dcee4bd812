"""Failures on the ``lpsync`` backend surface as torch.distributed errors carrying lpsync's
message, at once or within their bound, never as a hang: a killed rank, a mismatch, a rank
that never arrives, an operation lpsync does not offer, no daemon to attach to."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

from tests.client.torch_backend.torch_workers import errors, killed_rank
from tests.daemon.harness import ROOT, run_ranks
from tests.ports import free_ports

# A lost rank as the daemon names it: "rank N", or among "lost rank(s) 1 (detached), N (...)".
LOST = r"\brank(\(s\))? (\d+ \([^)]*\), )*{rank}\b"


def test_a_killed_rank_fails_the_others_with_an_error(daemon) -> None:
    results = run_ranks(3, killed_rank, 3, [daemon.socket], 3, free_ports(1)[0], timeout=120, dies=(2,))
    for kind, message, seconds in results[:2]:
        assert kind == "DistBackendError", (kind, message)
        # Named either way the daemon words it (tests/training/test_torch_training.py):
        # "rank 2 ... left" where the collective was waiting, "lost rank(s) 2 (...)" where
        # it arrived after the loss (an armed float max falls back to the general path).
        assert re.search(LOST.format(rank=2), message), message
        assert seconds < 10.0, (seconds, message)  # the daemon's bound: 2 s


def test_a_killed_rank_fails_the_others_across_two_daemons(two_nodes) -> None:
    results = run_ranks(4, killed_rank, 4, two_nodes.sockets, 2, free_ports(1)[0], timeout=120, dies=(3,))
    for kind, message, seconds in results[:3]:
        assert kind == "DistBackendError", (kind, message)
        assert re.search(LOST.format(rank=3), message), message
        assert seconds < 15.0, (seconds, message)


def test_refused_operations_mismatch_and_timeout(daemon) -> None:
    results = run_ranks(2, errors, 2, [daemon.socket], 2, free_ports(1)[0], timeout=120)
    for rank, seen in enumerate(results):
        short = seen["all_to_all of a short list"]
        assert short.startswith("ValueError") and f"needs {len(results)} output" in short, short
        assert "BAND" in seen["band"] and seen["band"].startswith("ValueError"), seen["band"]
        assert "PREMUL_SUM" in seen["premul_sum"], seen["premul_sum"]
        assert "int16" in seen["int16 dtype"], seen["int16 dtype"]
        assert "bool" in seen["bool avg"], seen["bool avg"]
        # complex tensors: torch passes their real view for broadcast, which is supported
        assert seen["complex64 dtype"] in ("no error",) or "complex" in seen["complex64 dtype"]
        assert seen["mismatch"].startswith("DistBackendError: lpsync all_reduce failed"), seen
        assert "count" in seen["mismatch"], seen["mismatch"]
        assert float(seen["mismatch seconds"]) < 5.0, seen
        if rank == 1:
            assert seen["timeout"].startswith("DistBackendError"), seen["timeout"]
            assert "rank(s) 0 did not arrive" in seen["timeout"], seen["timeout"]
            assert 7.0 <= float(seen["timeout seconds"]) < 14.0, seen


def test_no_daemon_is_an_error_at_init(tmp_path) -> None:
    script = textwrap.dedent("""
        import torch.distributed as dist, lpsync_client.torch
        try:
            dist.init_process_group("lpsync", store=dist.HashStore(), rank=0, world_size=1)
        except dist.DistBackendError as error:
            print("error:", error)
    """)
    env = {
        **os.environ,
        "LPSYNC_SOCKET": str(tmp_path / "nobody.sock"),
        "LPSYNC_CONNECT_TIMEOUT": "2",  # the backend attaches through connect(): not 10 s
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients" / "python")]),
    }
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90, env=env)
    assert "error: lpsync: rank 0" in done.stdout, done.stdout + done.stderr
    assert "nobody.sock" in done.stdout and "no lpsync daemon answers" in done.stdout


ELASTIC = """
import os, torch, torch.distributed as dist
import lpsync_client.torch
dist.init_process_group("lpsync")
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if attempt == 0 and rank == 1:
    os._exit(7)  # a crashed worker: torchrun restarts the group
dist.all_reduce(t)
print(f"attempt {attempt} rank {rank} ok {t.tolist()}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_restarts_a_failed_group_on_lpsync(daemon, tmp_path) -> None:
    """torchrun's elastic restart: a worker dies, the group is restarted, the second
    attempt makes a fresh lpsync job (its own store prefix) and completes."""
    script = tmp_path / "elastic.py"
    script.write_text(textwrap.dedent(ELASTIC))
    env = {
        **os.environ,
        "LPSYNC_SOCKET": daemon.socket,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients" / "python")]),
    }
    out = tmp_path / "torchrun.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1",
                "--monitor-interval",
                "0.5",
                "--master-port",
                str(free_ports(1)[0]),
                str(script),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )  # its workers too are ended below if it hangs
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            raise AssertionError(
                f"torchrun did not finish:\n{out.read_text()[-6000:]}\n"
                f"daemon:\n{daemon.log.read_text()[-3000:]}"
            ) from None
    done = subprocess.CompletedProcess(proc.args, rc, out.read_text(), "")
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    for rank in (0, 1):
        assert f"attempt 1 rank {rank} ok [4.0, 4.0, 4.0, 4.0]" in done.stdout, done.stdout
    assert "attempt 0 rank 1 ok" not in done.stdout
