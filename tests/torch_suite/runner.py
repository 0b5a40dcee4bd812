"""PyTorch's own distributed tests against lpsync and gloo (`make torch-suite`).

Runs torch's ``DistributedTest`` suite (``torch.testing._internal.distributed.
distributed_test``, shipped in the torch wheel; what torch's test/distributed/
test_distributed_spawn.py runs) with BACKEND=gloo and BACKEND=lpsync on the same tests and
world sizes, and prints the tests that pass on gloo but not on lpsync. Those are compared
with the checked-in list (tests/torch_suite/known_gaps.toml, each with its reason): a test
that newly fails on lpsync is a regression (exit 1); a listed test that now passes is
reported, so the list can shrink.

How it runs: one local lpsync daemon for the whole run (its own socket and log in the
output folder; LPSYNC_SOCKET for every lpsync rank); workers
(``python -m tests.torch_suite.worker``), each on one backend and world size, run tests one
after the other, every test spawning WORLD_SIZE rank processes exactly as torch's own run
does (file:// rendezvous, a fresh process group per test). lpsync is made acceptable to the
suite as a plugin backend (tests/torch_suite/suite.py). A test that a decorator skips only
because it names gloo (``require_backend_is_available({"gloo"})``, ``BACKEND != "gloo"``)
is "lifted": its body runs on lpsync, and it counts.

Outcomes per test: passed; failed (an assertion, a rank's exception, a timeout, a killed
worker: the reason is the first rank's exception); skipped (a decorator, no GPU, world
size). Everything lands in the output folder: results.json, the daemon's log, each
worker's log (the ranks' output).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KNOWN = Path(__file__).with_name("known_gaps.toml")
BACKENDS = ("gloo", "lpsync")

# The selection `pytest tests/torch_suite` runs (<= 3 min on 2 cores, both backends, world
# size 2): every kind of collective lpsync offers, on the default group and a new one, async
# and complex, DDP, tests lifted from gloo-only decorators, and two known gaps so that the
# comparison itself is exercised.
QUICK = (
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_product",
    "test_all_reduce_full_group_max",
    "test_all_reduce_sum_complex",
    "test_all_reduce_coalesced_sum",  # lifted
    "test_broadcast_full_group",
    "test_reduce_full_group_min",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_all_gather_object_subgroup",
    "test_gather_full_group",
    "test_scatter",
    "test_send_recv_with_tag",
    "test_batch_isend_irecv_gloo",  # lifted
    "test_barrier_full_group",
    "test_get_future",  # lifted
    "test_DistributedDataParallelCPU",
    "test_static_graph_api_cpu",
    "test_ddp_create_graph",
    "test_send_recv_any_source",
    "test_barrier_timeout_full_group",  # lifted: a barrier that times out, in torch's words
)


@dataclass
class Result:
    backend: str
    world_size: int
    test: str
    outcome: str  # passed | failed | skipped
    seconds: float = 0.0
    reason: str = ""
    lifted: bool = False
    detail: str = ""
    reruns: int = 0

    @property
    def key(self) -> tuple[str, int, str]:
        return self.backend, self.world_size, self.test


@dataclass
class Shard:
    backend: str
    world_size: int
    tests: list[str]
    lifted: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- the list


@dataclass
class Gap:
    reason: str
    world_sizes: tuple[int, ...] = ()  # empty: every world size

    def applies(self, world_size: int) -> bool:
        return not self.world_sizes or world_size in self.world_sizes


def load_known(path: Path) -> dict[str, Gap]:
    """The checked-in list: ``test = "reason"`` or ``test = {reason = "...", world_sizes =
    [3]}`` under ``[gaps]``."""
    data = tomllib.loads(path.read_text())
    known = {}
    for test, entry in data.get("gaps", {}).items():
        if isinstance(entry, str):
            known[test] = Gap(entry)
        else:
            known[test] = Gap(entry["reason"], tuple(entry.get("world_sizes", ())))
        if not known[test].reason.strip():
            raise ValueError(f"{path}: {test} has no reason")
    return known


@dataclass
class Comparison:
    gaps: list[tuple[Result, Result]]  # (gloo, lpsync): passes on gloo, not on lpsync
    expected: list[tuple[Result, Gap]]
    regressions: list[Result]  # lpsync results that newly fail
    now_pass: list[tuple[Result, Gap]]  # listed, and lpsync passed
    unjudged: list[str]  # listed tests this run could not judge (not run, or gloo did not pass)


def compare(results: list[Result], known: dict[str, Gap]) -> Comparison:
    by_key = {r.key: r for r in results}
    gaps, expected, regressions, now_pass = [], [], [], []
    judged: set[tuple[str, int]] = set()
    for gloo in sorted(results, key=lambda r: (r.world_size, r.test)):
        if gloo.backend != "gloo" or gloo.outcome != "passed":
            continue
        lp = by_key.get(("lpsync", gloo.world_size, gloo.test))
        if lp is None:
            continue
        judged.add((gloo.test, gloo.world_size))
        gap = known.get(gloo.test)
        listed = gap is not None and gap.applies(gloo.world_size)
        if lp.outcome == "passed":
            if listed:
                assert gap is not None
                now_pass.append((lp, gap))
            continue
        gaps.append((gloo, lp))
        if listed:
            assert gap is not None
            expected.append((lp, gap))
        else:
            regressions.append(lp)
    world_sizes = sorted({r.world_size for r in results})
    unjudged = [
        t
        for t, gap in sorted(known.items())
        if not any((t, ws) in judged for ws in world_sizes if gap.applies(ws))
    ]
    return Comparison(gaps, expected, regressions, now_pass, unjudged)


# ---------------------------------------------------------------------------- running


class Runner:
    def __init__(self, args: argparse.Namespace, out: Path, socket: str | None) -> None:
        self.args, self.out, self.socket = args, out, socket
        self.seq = 0
        self.done = 0
        self.total = 0

    def env(self, backend: str, world_size: int) -> dict[str, str]:
        from lpsync.daemon import launch
        from lpsync.transport.ports import free_ports

        env = launch.clean_env()
        work = Path(tempfile.mkdtemp(prefix="init-", dir=self.out / "tmp"))
        env.update(
            BACKEND=backend,
            WORLD_SIZE=str(world_size),
            # The suite's decorators read INIT_METHOD at import (file:// enables the
            # barrier-timeout tests); each test's setUp points it at its own file.
            INIT_METHOD=f"file://{work}/shared_init_file",
            TEMP_DIR=str(work),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_ports(1)[0]),
            DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(self.args.timeout),
            PYTORCH_PRINT_REPRO_ON_FAILURE="0",
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            TORCH_SUITE_START_METHOD=self.args.start_method,
        )
        if backend == "lpsync" and self.socket:
            env["LPSYNC_SOCKET"] = self.socket
        return env

    def _files(self, tag: str) -> tuple[Path, Path]:
        self.seq += 1
        stem = self.out / "workers" / f"{self.seq:03d}-{tag}"
        return stem.with_suffix(".jsonl"), stem.with_suffix(".log")

    def listing(self, backend: str, world_size: int) -> subprocess.Popen:
        results, log = self._files(f"list-{backend}-{world_size}")
        with open(log, "w") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.torch_suite.worker", "list", str(results)],
                cwd=ROOT,
                env=self.env(backend, world_size),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        proc.results, proc.log = results, log  # type: ignore[attr-defined]
        return proc

    def list_all(self, world_sizes: list[int]) -> dict[tuple[str, int], dict]:
        procs = {(b, ws): self.listing(b, ws) for b in BACKENDS for ws in world_sizes}
        listed = {}
        for key, proc in procs.items():
            proc.wait()
            lines = proc.results.read_text().splitlines() if proc.results.exists() else []  # type: ignore[attr-defined]
            if proc.returncode != 0 or not lines:
                tail = proc.log.read_text()[-3000:]  # type: ignore[attr-defined]
                raise SystemExit(f"torch-suite: could not list torch's suite for {key}:\n{tail}")
            listed[key] = json.loads(lines[-1])
        return listed

    def run(self, shards: list[Shard]) -> list[Result]:
        """Run every shard, ``--jobs`` workers at a time; one Result per test."""
        queue = list(shards)
        running: list[dict] = []
        results: list[Result] = []
        try:
            self._loop(queue, running, results)
        finally:  # interrupted: no worker (nor its ranks) outlives the runner
            for w in running:
                if w["proc"].poll() is None:
                    os.killpg(w["proc"].pid, signal.SIGKILL)
                    w["proc"].wait()
        return results

    def _loop(self, queue: list[Shard], running: list[dict], results: list[Result]) -> None:
        while queue or running:
            while queue and len(running) < self.args.jobs:
                running.append(self._start(queue.pop(0)))
            time.sleep(0.2)
            for w in list(running):
                self._collect(w, results)
                finished = w["proc"].poll() is not None
                stuck = time.monotonic() - w["since"] > self.args.timeout + self.args.grace
                if not finished and not stuck:
                    continue
                if stuck:
                    os.killpg(w["proc"].pid, signal.SIGKILL)
                    w["proc"].wait()
                self._collect(w, results)
                running.remove(w)
                if w["current"] is not None:  # died or hung in a test: that test failed
                    why = (
                        f"no result within {self.args.timeout + self.args.grace} s: worker killed"
                        if stuck
                        else f"the worker exited ({w['proc'].returncode}) during the test"
                    )
                    self._record(
                        w,
                        Result(
                            w["shard"].backend,
                            w["shard"].world_size,
                            w["current"],
                            "failed",
                            time.monotonic() - w["since"],
                            why,
                        ),
                        results,
                    )
                rest = [t for t in w["shard"].tests if t not in w["seen"]]
                if not w["seen"]:  # it never started a test: it cannot, say so for each
                    tail = w["log"].read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                    for test in rest:
                        self._record(
                            w,
                            Result(
                                w["shard"].backend,
                                w["shard"].world_size,
                                test,
                                "failed",
                                reason=f"the worker could not start: {tail[0][:200]}",
                            ),
                            results,
                        )
                elif rest:
                    queue.insert(0, Shard(w["shard"].backend, w["shard"].world_size, rest, w["shard"].lifted))

    def _start(self, shard: Shard) -> dict:
        results, log = self._files(f"{shard.backend}-{shard.world_size}")
        cmd = [sys.executable, "-m", "tests.torch_suite.worker", "run", str(results)]
        if shard.lifted:
            cmd += ["--lift", ",".join(t for t in shard.lifted if t in shard.tests)]
        with open(log, "w") as sink:
            proc = subprocess.Popen(
                [*cmd, *shard.tests],
                cwd=ROOT,
                env=self.env(shard.backend, shard.world_size),
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its ranks too: killed as one group when stuck
            )
        return {
            "shard": shard,
            "proc": proc,
            "results": results,
            "log": log,
            "offset": 0,
            "current": None,
            "since": time.monotonic(),
            "seen": set(),
        }

    def _collect(self, w: dict, results: list[Result]) -> None:
        if not w["results"].exists():
            return
        with open(w["results"]) as f:
            f.seek(w["offset"])
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        w["offset"] += len(complete.encode())
        for line in complete.splitlines():
            record = json.loads(line)
            if "start" in record:
                w["current"], w["since"] = record["start"], time.monotonic()
                w["seen"].add(record["start"])
                continue
            w["current"] = None
            shard = w["shard"]
            self._record(
                w,
                Result(
                    shard.backend,
                    shard.world_size,
                    record["test"],
                    record["outcome"],
                    record["seconds"],
                    record.get("reason", ""),
                    record.get("lifted", False),
                    record.get("detail", ""),
                ),
                results,
            )

    def _record(self, w: dict | None, result: Result, results: list[Result]) -> None:
        if w is not None:
            w["current"] = None
            result.detail = result.detail or ""
            if result.outcome == "failed" and not result.detail:
                result.detail = f"(see {w['log']})"
        results.append(result)
        self.done += 1
        self.progress(result)

    def progress(self, r: Result) -> None:
        width = len(str(self.total))
        mark = {"passed": "passed", "failed": "FAILED", "skipped": "skipped"}[r.outcome]
        lifted = " (lifted)" if r.lifted else ""
        why = f": {r.reason}" if r.reason and r.outcome != "passed" else ""
        timing = f" {r.seconds:.1f} s" if r.seconds else ""
        print(
            f"[{self.done:>{width}}/{self.total}] {r.backend:<6} ws={r.world_size} {mark:<7} "
            f"{r.test}{lifted}{timing}{why}"[:240],
            flush=True,
        )


def select(names: list[str], args: argparse.Namespace) -> list[str]:
    chosen = list(names)
    if args.quick:
        chosen = [n for n in chosen if n in QUICK]
    if args.tests:
        wanted = {t.strip() for t in args.tests.split(",") if t.strip()}
        unknown = wanted - set(names)
        if unknown:
            raise SystemExit(f"torch-suite: not tests of torch's suite: {', '.join(sorted(unknown))}")
        chosen = [n for n in chosen if n in wanted]
    if args.k:
        chosen = [n for n in chosen if any(re.search(pattern, n) for pattern in args.k)]
    for pattern in args.exclude:
        chosen = [n for n in chosen if not re.search(pattern, n)]
    return chosen


def shards_for(backend: str, ws: int, tests: list[str], lifted: list[str], size: int) -> list[Shard]:
    return [Shard(backend, ws, tests[i : i + size], lifted) for i in range(0, len(tests), size)]


def interleave(groups: list[list[Shard]]) -> list[Shard]:
    """Round-robin over the (backend, world size) groups: a slow group does not leave the
    end of the run to one worker."""
    order: list[Shard] = []
    for i in range(max((len(g) for g in groups), default=0)):
        order += [g[i] for g in groups if i < len(g)]
    return order


# ---------------------------------------------------------------------------- report


def summary(results: list[Result], world_sizes: list[int], backends: list[str]) -> list[str]:
    lines = ["== counts (tests of torch's DistributedTest suite)"]
    lines.append(f"{'backend':<8} {'ws':>3} {'passed':>7} {'failed':>7} {'skipped':>8} {'lifted':>7}")
    for backend in backends:
        for ws in world_sizes:
            mine = [r for r in results if r.backend == backend and r.world_size == ws]
            c = Counter(r.outcome for r in mine)
            lifted = sum(r.lifted for r in mine)
            lines.append(
                f"{backend:<8} {ws:>3} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8} {lifted:>7}"
            )
    return lines


def report(cmp: Comparison, known: dict[str, Gap]) -> list[str]:
    lines = [f"== passes on gloo, not on lpsync: {len(cmp.gaps)} (test, world size)"]
    for _, lp in cmp.gaps:
        gap = known.get(lp.test)
        tag = "listed" if gap is not None and gap.applies(lp.world_size) else "NEW"
        lines.append(f"  {tag:<6} ws={lp.world_size} {lp.test} [{lp.outcome}]: {lp.reason}")
    if cmp.now_pass:
        lines.append(
            f"== listed in {KNOWN.name} but passing on lpsync now (shrink the list): {len(cmp.now_pass)}"
        )
        for lp, gap in cmp.now_pass:
            lines.append(f"  ws={lp.world_size} {lp.test}  (listed: {gap.reason})")
    if cmp.regressions:
        lines.append(f"== REGRESSIONS (pass on gloo, fail on lpsync, not listed): {len(cmp.regressions)}")
        for lp in cmp.regressions:
            lines.append(f"  ws={lp.world_size} {lp.test}: {lp.reason}")
    lines.append(
        f"== against the list: {len(cmp.expected)} expected gap(s), {len(cmp.regressions)} regression(s), "
        f"{len(cmp.now_pass)} now passing, {len(cmp.unjudged)} listed test(s) not judged by this run"
    )
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.torch_suite.runner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  python -m tests.torch_suite.runner                      # everything, world sizes 2 and 3\n"
            "  python -m tests.torch_suite.runner --quick --world-sizes 2   # what pytest runs\n"
            "  python -m tests.torch_suite.runner -k all_reduce -k barrier --world-sizes 3\n"
            "  python -m tests.torch_suite.runner --tests test_send_recv --backends lpsync\n"
            "exit status: 0, or 1 when a test passes on gloo and fails on lpsync without being\n"
            "listed (a regression) or the daemon did not stop cleanly; 2 on bad arguments."
        ),
    )
    parser.add_argument("--world-sizes", default="2,3", help="comma-separated (default 2,3)")
    parser.add_argument(
        "--backends",
        default="gloo,lpsync",
        help="gloo,lpsync (default); one of them runs without the comparison",
    )
    parser.add_argument(
        "-k",
        action="append",
        default=[],
        metavar="REGEX",
        help="only tests whose name matches one of these (repeatable)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="REGEX",
        help="leave out tests whose name matches (repeatable)",
    )
    parser.add_argument("--tests", default="", help="comma-separated test names (test_all_reduce_sum,...)")
    parser.add_argument(
        "--quick", action="store_true", help=f"the pytest selection ({len(QUICK)} tests: {', '.join(QUICK)})"
    )
    parser.add_argument(
        "--start-method",
        choices=("forkserver", "spawn"),
        default="forkserver",
        help="how a test starts its ranks: forkserver (default; forked from a process that "
        "imported torch's suite once) or spawn (torch's own: a fresh interpreter per rank, "
        "~3.5 CPU-seconds each)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="workers at once (default 2)")
    parser.add_argument("--shard", type=int, default=16, help="tests per worker process (default 16)")
    parser.add_argument(
        "--timeout",
        type=int,
        default=180,
        help="seconds one test may take before torch's harness kills its ranks (default 180)",
    )
    parser.add_argument(
        "--grace",
        type=int,
        default=60,
        help="seconds past --timeout before a silent worker is killed (default 60)",
    )
    parser.add_argument(
        "--reruns",
        type=int,
        default=1,
        help="re-run a would-be regression this many times before calling it one (default 1)",
    )
    parser.add_argument(
        "--known", type=Path, default=KNOWN, help=f"the list (default {KNOWN.relative_to(ROOT)})"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for results.json and the logs (default: a new folder under out/torch-suite)",
    )
    parser.add_argument("--details", action="store_true", help="print each gap's failure text")
    args = parser.parse_args(argv)
    args.world_sizes = sorted({int(w) for w in args.world_sizes.split(",") if w.strip()})
    args.backends = [b for b in BACKENDS if b in {x.strip() for x in args.backends.split(",")}]
    if not args.backends or any(ws < 2 for ws in args.world_sizes):
        parser.error("need a backend of gloo,lpsync and world sizes >= 2")
    return args


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)  # stop the workers and the daemon first
    try:
        return _main(args)
    except KeyboardInterrupt as why:
        print(f"torch-suite: interrupted ({why or 'Ctrl-C'}); workers and daemon stopped", flush=True)
        return 130


def _main(args: argparse.Namespace) -> int:
    known = load_known(args.known)
    started = time.monotonic()
    out = args.out or ROOT / "out" / "torch-suite" / time.strftime("%Y%m%d-%H%M%S")
    (out / "workers").mkdir(parents=True, exist_ok=True)
    (out / "tmp").mkdir(exist_ok=True)
    print(f"torch-suite: output in {out}", flush=True)

    daemon = None
    sockdir = tempfile.mkdtemp(prefix="lpsync-torch-suite-")  # short: a Unix socket path
    socket = os.path.join(sockdir, "lpsync.sock")
    try:
        if "lpsync" in args.backends:
            from lpsync.daemon import launch

            daemon = launch.Daemon(
                socket, log=out / "daemon.log", env=launch.clean_env(), cwd=ROOT, start_new_session=True
            )
            print(
                f"torch-suite: lpsync daemon {daemon.pid} serving {socket} (log {out / 'daemon.log'})",
                flush=True,
            )
        runner = Runner(args, out, socket)
        listed = runner.list_all(args.world_sizes)
        names = select(listed[("gloo", args.world_sizes[0])]["tests"], args)
        if not names:
            raise SystemExit("torch-suite: the selection is empty")
        results, groups = [], []
        for backend in args.backends:
            for ws in args.world_sizes:
                skips = listed[(backend, ws)]["skips"]
                gloo_skips = listed[("gloo", ws)]["skips"]
                lifted = [n for n in names if backend == "lpsync" and n in skips and n not in gloo_skips]
                for n in names:
                    if n in skips and n not in lifted:
                        results.append(Result(backend, ws, n, "skipped", reason=skips[n]))
                run = [n for n in names if n not in skips or n in lifted]
                groups.append(shards_for(backend, ws, run, lifted, args.shard))
        runner.total = len(args.backends) * len(args.world_sizes) * len(names)
        print(
            f"torch-suite: {len(names)} tests x {'/'.join(args.backends)} x world sizes "
            f"{'/'.join(map(str, args.world_sizes))}; {len(results)} skipped by decorators, "
            f"{runner.total - len(results)} to run, {args.jobs} at a time",
            flush=True,
        )
        runner.done = len(results)
        results += runner.run(interleave(groups))

        if set(args.backends) == set(BACKENDS):
            for attempt in range(args.reruns):
                suspects = compare(results, known).regressions
                if not suspects:
                    break
                print(
                    f"torch-suite: re-running {len(suspects)} would-be regression(s), attempt {attempt + 1}",
                    flush=True,
                )
                runner.total += len(suspects)
                regroup = []
                for ws in args.world_sizes:
                    tests = [r.test for r in suspects if r.world_size == ws]
                    lifted = [r.test for r in suspects if r.world_size == ws and r.lifted]
                    regroup.append(shards_for("lpsync", ws, tests, lifted, args.shard))
                again = runner.run(interleave(regroup))
                fresh = {r.key: r for r in again}
                for i, r in enumerate(results):
                    if r.key in fresh:
                        fresh[r.key].reruns = r.reruns + 1
                        results[i] = fresh[r.key]
    finally:
        rc: int | str | None = None
        left: list[str] = []
        if daemon is not None:
            try:
                rc = daemon.stop()
            except Exception as error:  # it did not stop in time: stop() killed it
                rc = repr(error)
            left = sorted(p.name for p in Path("/dev/shm").glob(f"lpsync-{daemon.pid}-*"))
        shutil.rmtree(sockdir, ignore_errors=True)

    results.sort(key=lambda r: (r.backend, r.world_size, r.test))
    (out / "results.json").write_text(json.dumps([r.__dict__ for r in results], indent=1) + "\n")
    print("\n".join(summary(results, args.world_sizes, args.backends)))
    status = 0
    if set(args.backends) == set(BACKENDS):
        cmp = compare(results, known)
        print("\n".join(report(cmp, known)))
        if args.details:
            for _, lp in cmp.gaps:
                print(f"---- ws={lp.world_size} {lp.test}\n{lp.detail}")
        status = 1 if cmp.regressions else 0
    else:
        print("== no comparison: it needs both backends")
    if daemon is not None:
        clean = rc == 0 and not left
        print(
            f"== lpsync daemon: exit {rc}, shared memory left: {left or 'none'}"
            + ("" if clean else "  (UNCLEAN)")
        )
        status = status or (0 if clean else 1)
    print(f"== {time.monotonic() - started:.0f} s; results in {out / 'results.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
