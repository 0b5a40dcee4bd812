"""The profile's reading of py-spy's collapsed stacks (the sampling itself needs root,
ptrace and a cluster: docs/benchmarks.md at 623decd shows a run)."""

from __future__ import annotations

from lab.profile import top_frames


def test_self_and_inclusive_samples_are_counted_per_frame() -> None:
    raw = "\n".join(
        [
            "run (a.py:1);agree (b.py:2);send (c.py:3) 5",
            "run (a.py:1);agree (b.py:2);wait (c.py:9) 3",
            "run (a.py:1);reply (d.py:4) 2",
            "",
            "loop (e.py:1);recursive (e.py:2);recursive (e.py:2) 1",
        ]
    )
    total, own, within = top_frames(raw, count=3)
    assert total == 11
    assert own == [(5, "send (c.py:3)"), (3, "wait (c.py:9)"), (2, "reply (d.py:4)")]
    assert within[:2] == [(10, "run (a.py:1)"), (8, "agree (b.py:2)")]
    _, _, everything = top_frames(raw, count=10)
    assert (1, "recursive (e.py:2)") in everything  # counted once per stack, not per frame
