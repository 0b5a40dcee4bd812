"""The scripts in examples/ run as their docstrings say: torchrun, 2 processes, against a
running daemon; each checks that its ranks agree and prints its last line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.harness import DaemonProcess, run_ranks
from tests.ports import free_ports
from tests.training.trainers import example_as_rank

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LAST_LINE = {
    "ddp_one_line": "2 ranks agree on",
    "horovod_style": "every rank holds the same",
    "jax_allreduce": "w = [",
    "numpy_allreduce": "max |w - true w|",
}


@pytest.mark.parametrize("example", sorted(LAST_LINE))
def test_example_runs_under_torchrun(daemon: DaemonProcess, example: str) -> None:
    if example.startswith("jax"):
        pytest.importorskip("jax")
    assert LAST_LINE[example] in _torchrun(daemon, example)


def test_the_moe_layer_trains_as_on_gloo(daemon: DaemonProcess) -> None:
    """Tokens move to their expert and back with uneven all_to_all_single: the losses
    equal gloo's bit for bit (nothing is reduced on the way but the router's 2-rank sum)."""
    args = ("--steps", "10")
    lines = {
        "lpsync": _last_line(_torchrun(daemon, "moe_all_to_all", *args)),
        "gloo": _last_line(_on_gloo("moe_all_to_all", *args)),
    }
    assert lines["lpsync"].startswith("lpsync: final loss of 2 ranks"), lines
    assert lines["lpsync"].split(" ranks ")[1] == lines["gloo"].split(" ranks ")[1], lines


def test_pipeline_stages_train_as_on_gloo(daemon: DaemonProcess) -> None:
    """torch.distributed.pipelining's GPipe and 1F1B over 3 stages (batch_isend_irecv of
    activations and gradients): every loss equals gloo's bit for bit. Three stages, not the
    docstring's four: the middle stage already receives from one peer and sends to the other
    in both directions; a fourth adds a second such stage and two torch processes (~10 CPU-s)."""
    args = ("--steps", "3")
    lines = {
        "lpsync": _last_line(_torchrun(daemon, "pipeline_parallel", *args, procs=3)),
        "gloo": _last_line(_on_gloo("pipeline_parallel", *args, procs=3)),
    }
    assert lines["lpsync"].startswith("lpsync losses: gpipe"), lines
    assert lines["lpsync"].split(" losses: ")[1] == lines["gloo"].split(" losses: ")[1], lines


def _last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


def _on_gloo(example: str, *args: str, procs: int = 2) -> str:
    """What the example printed on gloo, the reference: its ranks fork from the suite's
    server that has torch imported (run_ranks) and take torchrun's variables, instead of
    a torchrun of their own (its agent and every rank's import of torch: ~6 CPU-s)."""
    (port,) = free_ports(1)
    script = str(EXAMPLES / f"{example}.py")
    gloo = [*args, "--backend", "gloo"]
    printed = run_ranks(procs, example_as_rank, script, gloo, procs, port, timeout=240)
    return "".join(printed)


def _torchrun(daemon: DaemonProcess, example: str, *args: str, procs: int = 2) -> str:
    """Run examples/EXAMPLE.py under torchrun with ``procs`` processes; its stdout."""
    (port,) = free_ports(1)
    env = {
        **os.environ,
        "LPSYNC_SOCKET": daemon.socket,
        "LPSYNC_JOB": example,
        "OMP_NUM_THREADS": "1",
        "JAX_PLATFORMS": "cpu",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(procs),
            "--master-port",
            str(port),
            str(EXAMPLES / f"{example}.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout
