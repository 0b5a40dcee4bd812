"""The names of point-to-point pair jobs: what a client attaches and the daemon recognises.

A message from rank a to rank b with tag t of job j travels as a broadcast in the two-rank
job ``j/p2p/a>b/t`` (lpsync_client._p2p). The daemon reads the name back to place the pair
where the main job's ranks are and to answer any-source probes
(lpsync/daemon/control/any_source.py).
"""

from __future__ import annotations

import re

MAX_TAG = 1 << 31  # torch's tags are int32
_PAIR = re.compile(r"(?P<job>.+)/p2p/(?P<src>\d+)>(?P<dst>\d+)/(?P<tag>\d+)")


def pair_job(job: str, src: int, dst: int, tag: int) -> str:
    """The two-rank job of messages from ``src`` to ``dst`` with ``tag`` in ``job``."""
    return f"{job}/p2p/{src}>{dst}/{tag}"


def parse_pair(name: str) -> tuple[str, int, int, int] | None:
    """(job, src, dst, tag) of a pair job's name; None for any other job."""
    m = _PAIR.fullmatch(name)
    return None if m is None else (m["job"], int(m["src"]), int(m["dst"]), int(m["tag"]))
