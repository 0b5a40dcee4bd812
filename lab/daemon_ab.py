"""The daemons' CPU per call, this tree against another revision, side by side:
``python -m lab.daemon_ab --base REV [--head REV]``.

Checks REV out into a temporary git worktree (``--head``: that revision too, in place of
this tree, to check an earlier change against its own base) and runs
``lab.loopback_cpu`` in each tree in turn, ``--pairs`` times (the base first in
odd pairs, the other first in even ones), then removes the worktrees. Each run starts in
its own tree's directory with that tree on ``PYTHONPATH``: ``python -m`` puts the
current directory first on ``sys.path``, so a daemon started from this tree's directory
would run this tree's code whatever ``PYTHONPATH`` says (CONTRIBUTING.md, "Benchmarks").
Before the pairs, each tree's interpreter is asked where ``lpsync`` and
``lpsync_client`` come from; a tree that would not import its own code is refused.

Per pair it prints node 0's CPU per call, the median leaf's, the mean per daemon and the
mean rank's, for both trees, and the ratios this / base. The rank's code is the client's:
where both trees share it, the rank's CPU moves only with the machine's load, so the
daemons' CPU divided by the rank's, compared between the trees, takes most of that load
out (the "per rank" ratios). The last line gives the medians over the pairs.

    python -m lab.daemon_ab --base HEAD~1 [--pairs 4] [--nodes 8] [--iters 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lab.loopback_cpu import add_point_arguments

HERE = Path(__file__).resolve().parents[1]  # this tree's root
# node, time, daemon CPU, rank CPU per call; then context switches (not printed before 2026-12-06)
_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)(?:\s+[\d.]+\s+[\d.]+)?\s*$")


@dataclass(frozen=True)
class Run:
    """One loopback_cpu run, per call in microseconds."""

    node0: float
    leaf: float  # the median over nodes 1.. (node 0 itself where it is alone)
    mean: float  # per daemon
    rank: float  # per rank, mean
    time: float  # node 0's rank's time per call

    @classmethod
    def parse(cls, output: str) -> Run:
        rows = [
            tuple(float(v) for v in m.groups()) for line in output.splitlines() if (m := _ROW.match(line))
        ]
        if not rows:
            raise ValueError(f"no rows in loopback_cpu's output:\n{output[-2000:]}")
        daemons = [r[2] for r in rows]
        return cls(
            node0=daemons[0],
            leaf=statistics.median(daemons[1:] or daemons),
            mean=statistics.mean(daemons),
            rank=statistics.mean(r[3] for r in rows),
            time=rows[0][1],
        )


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(tree), str(tree / "clients" / "python")))}


def check_imports(tree: Path) -> None:
    """SystemExit unless a process started in ``tree`` imports lpsync and lpsync_client
    from ``tree``."""
    probe = "import lpsync, lpsync_client; print(lpsync.__file__); print(lpsync_client.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=120
    )
    files = done.stdout.split()
    if (
        done.returncode != 0
        or len(files) != 2
        or not all(Path(f).resolve().is_relative_to(tree) for f in files)
    ):
        raise SystemExit(f"a process in {tree} does not import its own lpsync: {done.stdout}{done.stderr}")


def bench_module(tree: Path) -> str:
    """The loopback bench of ``tree``: lab/ since the lab left the package, before that
    lpsync/bench/ (the same flags and rows), so that a base from before the move runs."""
    return "lab.loopback_cpu" if (tree / "lab" / "loopback_cpu.py").exists() else "lpsync.bench.loopback_cpu"


def run_once(tree: Path, bench_args: list[str], timeout: float) -> Run:
    done = subprocess.run(
        [sys.executable, "-m", bench_module(tree), *bench_args],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise SystemExit(f"loopback_cpu failed in {tree} ({done.returncode}):\n{done.stderr[-3000:]}")
    return Run.parse(done.stdout)


@contextlib.contextmanager
def worktree(revision: str | None) -> Iterator[Path]:
    """``revision`` checked out in a temporary worktree of this repository, removed after;
    None: this tree itself."""
    if revision is None:
        yield HERE
        return
    with tempfile.TemporaryDirectory(prefix="lpsync-ab-") as where:
        path = Path(where) / "tree"
        added = subprocess.run(
            ["git", "-C", str(HERE), "worktree", "add", "--detach", str(path), revision],
            capture_output=True,
            text=True,
        )
        if added.returncode != 0:
            raise SystemExit(f"git worktree add {revision} failed: {added.stderr.strip()}")
        try:
            yield path.resolve()
        finally:
            subprocess.run(
                ["git", "-C", str(HERE), "worktree", "remove", "--force", str(path)], capture_output=True
            )


def _ratios(base: Run, this: Run) -> tuple[float, float, float, float, float]:
    """this / base: node 0, the median leaf, the mean daemon; the mean daemon and the
    median leaf per rank CPU."""
    return (
        this.node0 / base.node0,
        this.leaf / base.leaf,
        this.mean / base.mean,
        (this.mean / this.rank) / (base.mean / base.rank),
        (this.leaf / this.rank) / (base.leaf / base.rank),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.daemon_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare with (git rev)")
    parser.add_argument(
        "--head", help="the revision compared with the base (git rev; default: this tree, as it is)"
    )
    parser.add_argument("--pairs", type=int, default=4, help="alternating pairs of runs (default 4)")
    add_point_arguments(parser, nodes=8, iters=2000)
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.nodes < 1 or args.iters < 1:
        parser.error("--pairs, --nodes and --iters must be >= 1")
    bench = ["--nodes", str(args.nodes), "--iters", str(args.iters), "--bytes", str(args.bytes)]
    bench += ["--peer-transport", args.peer_transport]
    timeout = 600 + args.iters * 0.05
    with worktree(args.base) as base_tree, worktree(args.head) as this_tree:
        for tree in (base_tree, this_tree):
            check_imports(tree)
        other = f"{args.head} ({this_tree})" if args.head else f"this tree ({this_tree})"
        print(f"# base {args.base} ({base_tree}) against {other}; loopback_cpu {' '.join(bench)}")
        print(
            "# CPU per call (us), base / this: node 0, median leaf, mean daemon, mean rank; then this / base"
        )
        print(
            "# pair  node0          leaf           mean           rank         |  node0  leaf  mean"
            "  mean/rank  leaf/rank"
        )
        ratios = []
        for pair in range(1, args.pairs + 1):
            order = [(base_tree, "base"), (this_tree, "this")]
            if pair % 2 == 0:
                order.reverse()
            runs = {name: run_once(tree, bench, timeout) for tree, name in order}
            base, this = runs["base"], runs["this"]
            r = _ratios(base, this)
            ratios.append(r)
            print(
                f"{pair:6d}  {base.node0:5.0f} / {this.node0:5.0f}  {base.leaf:5.0f} / {this.leaf:5.0f}  "
                f"{base.mean:5.0f} / {this.mean:5.0f}  {base.rank:4.0f} / {this.rank:4.0f}  |  "
                f"{r[0]:5.2f} {r[1]:5.2f} {r[2]:5.2f}  {r[3]:9.2f}  {r[4]:9.2f}",
                flush=True,
            )
    medians = [statistics.median(column) for column in zip(*ratios, strict=True)]
    print(
        f"# median this / base over {args.pairs} pair(s): node 0 {medians[0]:.2f}, leaf {medians[1]:.2f}, "
        f"mean {medians[2]:.2f}; per rank CPU: mean {medians[3]:.2f}, leaf {medians[4]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
