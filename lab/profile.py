"""Where a daemon's CPU goes for one benchmark point: ``python -m lab.profile``.

Runs ``lpsync bench --cluster ...`` (the arguments after ``--``), waits until the daemon
of ``--node`` serves and the timed loop is under way, then samples that daemon with
py-spy (``pip install 'lpsync[profile]'``) twice: the threads holding the GIL (Python's
own work) and every thread not idle (blocking calls included), after reading the
process's user and system CPU from /proc over a window of the same length, unsampled.
Prints the top frames by self and inclusive samples; the raw stacks (py-spy's collapsed
format, for flamegraph.pl or speedscope) go to --out. Needs root (the emulated cluster) and ptrace rights.

    sudo python -m lab.profile --node 3 --seconds 10 -- \\
        --nodes 8 --link 1gbit --op allreduce --algorithm auto --bytes 4 --iters 5000
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

_START_TIMEOUT = 180.0  # seconds for the cluster and its daemons to come up


def top_frames(raw: str, count: int = 20) -> tuple[int, list[tuple[int, str]], list[tuple[int, str]]]:
    """(samples, the ``count`` frames with most self samples, and most inclusive ones) of
    py-spy's collapsed stacks: one ``frame;frame;...;leaf N`` line per stack."""
    own: collections.Counter[str] = collections.Counter()
    within: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, _, samples = line.rpartition(" ")
        n = int(samples)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            within[frame] += n
    flip = lambda counter: [(n, frame) for frame, n in counter.most_common(count)]  # noqa: E731
    return total, flip(own), flip(within)


def _daemon_pid(node: int, deadline: float, bench: subprocess.Popen) -> int:
    pattern = f"lpsync.cli daemon .*--node-rank {node} "
    while time.monotonic() < deadline:
        if bench.poll() is not None:
            raise SystemExit(f"lpsync bench exited ({bench.returncode}) before node {node}'s daemon served")
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        ours = [int(pid) for pid in found if _descends(int(pid), bench.pid)]  # not another run's
        if ours:
            return ours[0]
        time.sleep(0.5)
    raise SystemExit(f"no daemon of node {node} within {_START_TIMEOUT:.0f} s")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return False


def _cpu_ticks(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])  # utime, stime (clock ticks)


def _record(py_spy: str, pid: int, seconds: float, out: Path, gil: bool) -> str:
    argv = [py_spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "250", "-f", "raw"]
    # --nonblocking: read the stacks without pausing the daemon (fewer, noisier samples).
    argv += ["-o", str(out), "--nonblocking", *(["--gil"] if gil else [])]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=seconds + 60)
    return out.read_text()


def _print(title: str, raw: str, count: int) -> None:
    total, own, within = top_frames(raw, count)
    print(f"# {title}: {total} samples")
    print("#   self  inclusive frame")
    names = dict.fromkeys([f for _, f in own] + [f for _, f in within])
    own_d, within_d = {f: n for n, f in own}, {f: n for n, f in within}
    for frame in names:
        print(f"  {own_d.get(frame, 0):6d} {within_d.get(frame, 0):9d} {frame}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.profile",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--node", type=int, default=1, help="whose daemon to sample (default 1)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per sampling (default 10)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after it serves (default 10)")
    parser.add_argument("--top", type=int, default=20, help="frames shown per table (default 20)")
    parser.add_argument("--out", type=Path, default=Path("out/profile"), help="raw stacks go here")
    parser.add_argument(
        "bench", nargs=argparse.REMAINDER, help="-- then the arguments of lpsync bench --cluster"
    )
    args = parser.parse_args(argv)
    bench_args = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        parser.error("py-spy is not installed: pip install 'lpsync[profile]'")
    args.out.mkdir(parents=True, exist_ok=True)
    bench = subprocess.Popen(
        [sys.executable, "-m", "lpsync.cli", "bench", "--cluster", *bench_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pid = _daemon_pid(args.node, time.monotonic() + _START_TIMEOUT, bench)
        time.sleep(args.settle)
        # The CPU split first, unsampled: sampling itself costs the sampled process.
        before, began = _cpu_ticks(pid), time.monotonic()
        time.sleep(args.seconds)
        after, spent = _cpu_ticks(pid), time.monotonic() - began
        tick = os.sysconf("SC_CLK_TCK")
        user, system = ((b - a) / tick for a, b in zip(before, after, strict=True))
        print(
            f"# daemon of node {args.node} (pid {pid}) over {spent:.1f} s, unsampled: user "
            f"{user:.2f} s, system {system:.2f} s ({(user + system) / spent:.0%} of a core)"
        )
        gil = _record(py_spy, pid, args.seconds, args.out / f"node{args.node}-gil.txt", gil=True)
        busy = _record(py_spy, pid, args.seconds, args.out / f"node{args.node}-threads.txt", gil=False)
        _print("threads holding the GIL (Python work)", gil, args.top)
        _print("threads not idle (blocking calls included)", busy, args.top)
        print(f"# raw stacks: {args.out}")
    finally:
        if bench.poll() is None:
            bench.send_signal(signal.SIGINT)  # the bench tears its cluster down on Ctrl-C
        output, _ = bench.communicate(timeout=300)
        sys.stderr.write(output[-3000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
