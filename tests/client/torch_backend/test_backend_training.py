"""Unmodified DDP (no hook) and FSDP2 on the ``lpsync`` backend train to gloo's result;
a script run through the runner under torchrun uses lpsync without importing it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.client.torch_backend.torch_workers import ddp_against_gloo, fsdp_against_gloo
from tests.daemon.harness import ROOT, run_ranks
from tests.ports import free_ports


def test_ddp_without_hook_equals_gloo_through_one_daemon(daemon) -> None:
    diffs = run_ranks(2, ddp_against_gloo, 2, [daemon.socket], 2, free_ports(1)[0], timeout=180)
    assert max(diffs) <= 1e-5, diffs


def test_ddp_without_hook_equals_gloo_through_two_daemons(two_nodes) -> None:
    diffs = run_ranks(4, ddp_against_gloo, 4, two_nodes.sockets, 2, free_ports(1)[0], timeout=240)
    assert max(diffs) <= 1e-5, diffs


def test_fsdp2_equals_gloo(daemon) -> None:
    results = run_ranks(2, fsdp_against_gloo, 2, [daemon.socket], 2, free_ports(1)[0], timeout=180)
    assert max(diff for diff, _ in results) <= 1e-5, results
    # 10 steps of 3 FSDP units with parameters: an all-gather forward, one backward and a
    # reduce-scatter each, all on lpsync.
    assert all(issued >= 10 * 3 * 3 for _, issued in results), results


SCRIPT = """
import argparse, os, torch, torch.distributed as dist
parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="gloo")
args = parser.parse_args()
dist.init_process_group(args.backend)
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print(f"rank {dist.get_rank()} backend {dist.get_backend()} sum {t.tolist()} "
      f"main {__name__} argv {os.path.basename(__import__('sys').argv[0])}")
dist.destroy_process_group()
"""


def test_runner_under_torchrun_runs_an_unmodified_script(daemon, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {
        **os.environ,
        "LPSYNC_SOCKET": daemon.socket,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "clients" / "python"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_ports(1)[0]),
            "-m",
            "lpsync_client.torch.run",
            str(script),
            "--backend",
            "lpsync",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank} backend lpsync sum [3.0, 3.0, 3.0] main __main__ argv train.py" in done.stdout, (
            done.stdout + done.stderr
        )


def test_runner_without_arguments_prints_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lpsync_client.torch.run"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "usage:" in done.stderr
