"""The chaos run's record and its verdict: what was injected, what every trainer saw, and
the checks (no wrong result as OK, every failure within its bound, no hang, survivors
serving, rejoins, nothing left behind)."""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Bounds:
    """Seconds within which each kind of failure must be reported (docs/design.md's
    error table), plus ``slack`` for a loaded machine."""

    heartbeat_timeout: float
    timeout: float  # the collectives' own timeout: the outer bound
    rejoin: float
    slack: float = 2.0

    def for_error(self, kind: str) -> float:
        own = {"AbortedError": 2.0, "UnavailableError": self.heartbeat_timeout}.get(kind, self.timeout)
        return own + self.slack


@dataclass
class Record:
    bounds: Bounds
    events: list[float] = field(default_factory=list)  # every injection and release, sorted
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    reports: list[dict[str, Any]] = field(default_factory=list)
    rejoins: list[float] = field(default_factory=list)  # seconds from a release to all ranks OK
    rejoin_failures: list[str] = field(default_factory=list)
    health_checks: int = 0
    health_failures: list[str] = field(default_factory=list)
    exits: list[Any] = field(default_factory=list)  # netnodes.Exit of the final stop
    leaks: dict[str, list[str]] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)  # each fault: kind, where, when
    reclaimed: int = 0  # segments of SIGKILLed daemons that no one else removed

    def event(self, at: float) -> None:
        bisect.insort(self.events, at)

    def _since_cause(self, report: dict[str, Any]) -> float:
        """Seconds from the call's start, or the last fault event during it, to its end:
        a failure is owed to the latest change it saw."""
        i = bisect.bisect_right(self.events, report["end"])
        cause = max(report["start"], self.events[i - 1] if i else report["start"])
        return float(report["end"] - cause)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.reports if r["outcome"] == "ok"]
        wrong = [r for r in self.reports if r["outcome"] == "wrong"]
        errors = [r for r in self.reports if r["outcome"] not in ("ok", "wrong")]
        by_kind: dict[str, dict[str, Any]] = {}
        late: list[str] = []
        for r in errors:
            took = self._since_cause(r)
            k = by_kind.setdefault(
                r["outcome"],
                {
                    "count": 0,
                    "max_s": 0.0,
                    "bound_s": self.bounds.for_error(r["outcome"]),
                    "example": r["message"][:200],
                },
            )
            k["count"] += 1
            k["max_s"] = round(max(k["max_s"], took), 2)
            if took > self.bounds.for_error(r["outcome"]):
                late.append(f"rank {r['rank']} {r['outcome']} after {took:.1f} s: {r['message'][:160]}")
        hangs = [
            f"rank {r['rank']} {r['op']} took {self._since_cause(r):.1f} s"
            for r in ok
            if self._since_cause(r) > self.bounds.timeout + self.bounds.slack
        ]
        exits = [e.seconds for e in self.exits]
        checks = {
            "no wrong result delivered as OK": [
                f"rank {r['rank']} epoch {r['epoch']}: {r['message']}" for r in wrong
            ],
            "every failure within its bound": late,
            "no hang beyond the bound": hangs,
            "survivors keep serving": self.health_failures,
            "restarted daemons rejoin": self.rejoin_failures,
            "clean exits at the end (<= 5 s)": [
                f"node {e.node}: {e}" for e in self.exits if not e.clean or e.seconds > 5.0
            ],
            "nothing left behind": [f"{what}: {v}" for what, vs in self.leaks.items() for v in vs],
        }
        return {
            "faults": dict(sorted(self.faults.items())),
            "collectives_ok": len(ok),
            "wrong": len(wrong),
            "errors": dict(sorted(by_kind.items())),
            "max_time_to_error_s": max((k["max_s"] for k in by_kind.values()), default=0.0),
            "rejoins": len(self.rejoins),
            "max_rejoin_s": round(max(self.rejoins, default=0.0), 2),
            "health_checks": self.health_checks,
            "final_exit_max_s": round(max(exits, default=0.0), 2),
            "reclaimed_after_sigkill": self.reclaimed,
            "leaks": sum(len(v) for v in self.leaks.values()),
            "checks": {name: failures[:10] for name, failures in checks.items()},
            "passed": not any(checks.values()),
        }


def table(s: dict[str, Any], header: str) -> str:
    lines = [header, ""]
    lines.append("faults injected      " + ", ".join(f"{k} {v}" for k, v in s["faults"].items()))
    lines.append(
        f"collectives OK       {s['collectives_ok']} (every one checked against numpy; wrong: {s['wrong']})"
    )
    lines.append("errors by kind       kind                    count  max s to error  bound s")
    for kind, k in s["errors"].items():
        lines.append(
            f"                     {kind:<22} {k['count']:>6} {k['max_s']:>15.2f} {k['bound_s']:>8.1f}"
        )
    lines.append(f"max time to error    {s['max_time_to_error_s']:.2f} s")
    lines.append(
        f"rejoins              {s['rejoins']}, slowest {s['max_rejoin_s']:.1f} s "
        "(a collective of all ranks OK after the release)"
    )
    lines.append(f"survivor health      {s['health_checks']} checks of untouched daemons during faults")
    lines.append(f"final SIGTERM        every daemon out within {s['final_exit_max_s']:.2f} s")
    lines.append(
        f"leaks                {s['leaks']} "
        f"(shm of SIGKILLed daemons reclaimed by the run: {s['reclaimed_after_sigkill']})"
    )
    lines.append("")
    for name, failures in s["checks"].items():
        lines.append(
            f"{'ok  ' if not failures else 'FAIL'} {name}" + "".join(f"\n       {f}" for f in failures)
        )
    lines.append("PASS" if s["passed"] else "FAIL")
    return "\n".join(lines)
