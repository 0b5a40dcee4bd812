"""One worker of the torch-suite runner: runs tests of ``tests.torch_suite.suite`` one after
the other on the BACKEND and WORLD_SIZE of its environment and appends one JSON line per
event to a results file (its stdout and stderr are the rank processes' chatter; the runner
sends them to a log).

    python -m tests.torch_suite.worker list RESULTS            # {"skips": {test: reason}}
    python -m tests.torch_suite.worker run RESULTS [--lift T,..] TEST...

``run`` writes ``{"start": test}`` before a test and ``{"test": ..., "outcome": passed |
failed | skipped, "seconds", "reason", "detail"}`` after it: a worker that dies mid-test
leaves its start line, and the runner counts that test as failed ("worker died").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
import unittest
from pathlib import Path

# A rank's traceback, as MultiProcessTestCase reports it: the last "Name: message" line of it.
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Timeout)\w*: .*)$")


def _reason(text: str) -> str:
    """The most telling line of a failure: the exception the first failing rank ended with
    (the last of a chain), else the last exception line, else the last line."""
    ranks = re.split(r"Process \d+ exited with error code \d+ and exception:\n", text)
    body = ranks[1] if len(ranks) > 1 else text
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    raised = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return (raised or lines or [""])[-1][:300]


def _write(results: Path, record: dict) -> None:
    with open(results, "a") as out:
        out.write(json.dumps(record) + "\n")


def run(results: Path, names: list[str], lifted: list[str]) -> None:
    from tests.torch_suite import suite

    suite.lift(lifted)
    for name in names:
        _write(results, {"start": name})
        t0 = time.monotonic()
        result = unittest.TestResult()
        try:
            suite.TestDistBackendWithSpawn(name).run(result)
        except BaseException:  # the runner must hear of it; the worker goes on
            result.errors.append((None, traceback.format_exc()))
        record = {"test": name, "seconds": round(time.monotonic() - t0, 2), "lifted": name in lifted}
        problems = [text for _, text in result.failures + result.errors]
        if problems:
            detail = "\n".join(problems)
            record.update(outcome="failed", reason=_reason(detail), detail=detail[-6000:])
        elif result.skipped:
            record.update(outcome="skipped", reason=str(result.skipped[0][1])[:300])
        elif result.expectedFailures or result.unexpectedSuccesses:
            record.update(outcome="failed", reason="marked expected failure in torch's suite")
        else:
            record.update(outcome="passed")
        _write(results, record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.torch_suite.worker")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list")
    listing.add_argument("results", type=Path)
    running = sub.add_parser("run")
    running.add_argument("results", type=Path)
    running.add_argument("--lift", default="")
    running.add_argument("tests", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "list":
        from tests.torch_suite import suite

        _write(args.results, {"tests": suite.test_names(), "skips": suite.decorator_skips()})
    else:
        run(args.results, args.tests, [t for t in args.lift.split(",") if t])
    return 0


if __name__ == "__main__":
    sys.exit(main())
