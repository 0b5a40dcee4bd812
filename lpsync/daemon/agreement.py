"""Cross-node agreement on one collective, and the data of small ones with it.

Every node of a job contributes a summary (its Spec and its link model, or the error
that failed the collective on that node); every node must end with the same verdict:
go, with the link model (the slowest of all), or fail with one error that names the
fields and ranks that differ (MismatchError) or the node that failed first.

Two shapes, both deterministic (every node computes or receives the same verdict):
  * exchange (2 nodes): each sends its summary to the other and judges both; one hop.
  * tree (3+ nodes): summaries go up a binomial tree to node 0, which judges them all and
    sends its verdict down the same tree: 2(P-1) messages in 2*ceil(log2 P) hops, where
    an all-to-all costs P(P-1) (56 at 8 nodes). On the 2-core emulated cluster CPU per
    message is what limits, so fewer messages win (docs/benchmarks.md).
A small collective (small.py) adds its data: each message carries the sender's folded
part (up) or the result (down).

Wire format of a message: two little-endian uint32 (header bytes, payload bytes), the
JSON header, the payload. Receive buffers are sized for the largest message a node may
legally send; a larger one (another node decided otherwise: mismatched collectives)
fails that node's part as a mismatch instead of breaking the mesh.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lpsync.algorithms import LinkModel
from lpsync.daemon.matching import Job, Pending, Spec
from lpsync.daemon.peer_plane import SPEC, VERDICT, Link, control_tag
from lpsync.daemon.small import SMALL_MAX_BYTES, SmallCollective
from lpsync.errors import (
    AbortedError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    MismatchError,
    UnavailableError,
)

SUMMARY_BYTES = 4096  # one node's summary, JSON (a collective's name is most of it)
_VERDICT_BYTES = 4096
_FRAME = 8
_FIELDS = ("op", "count", "dtype", "root", "reduce_op", "algorithm", "name")
_ERRORS = {"INVALID_ARGUMENT": MismatchError, "DEADLINE_EXCEEDED": CollectiveTimeoutError,
           "ABORTED": AbortedError}
EXCHANGE_MAX_NODES = 2  # up to this many nodes, every node sends to every other


@dataclass(frozen=True)
class Verdict:
    model: LinkModel
    result: np.ndarray | None  # a small collective's result (small.py); None otherwise


def job_hash(name: str) -> int:
    return zlib.crc32(name.encode())


# -- the tree ------------------------------------------------------------------------------

def parent(node: int) -> int:
    """Node ``node``'s parent in the binomial tree rooted at node 0 (node > 0)."""
    return node & (node - 1)


def children(node: int, nodes: int) -> list[int]:
    """Ascending; child c's subtree is the contiguous nodes c .. c + subtree(c) - 1."""
    low = node & -node if node else 1 << max(0, (nodes - 1).bit_length())
    out, step = [], 1
    while step < low and node + step < nodes:
        out.append(node + step)
        step <<= 1
    return out


def subtree(node: int, nodes: int) -> int:
    low = node & -node if node else nodes
    return min(low, nodes - node)


# -- messages ------------------------------------------------------------------------------

def encode(header: dict[str, Any], payload: np.ndarray | None = None) -> np.ndarray:
    raw = json.dumps(header).encode()
    data = b"" if payload is None else np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    out = np.empty(_FRAME + len(raw) + len(data), np.uint8)
    out[:_FRAME] = np.frombuffer(np.array([len(raw), len(data)], "<u4").tobytes(), np.uint8)
    out[_FRAME:_FRAME + len(raw)] = np.frombuffer(raw, np.uint8)
    if len(data):
        out[_FRAME + len(raw):] = data
    return out


def decode(buf: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """(header, payload bytes) of a received message."""
    head, size = (int(x) for x in buf[:_FRAME].view("<u4"))
    if _FRAME + head + size > buf.nbytes:
        raise ValueError("a message shorter than its frame says")
    header = json.loads(buf[_FRAME:_FRAME + head].tobytes())
    return header, buf[_FRAME + head:_FRAME + head + size]


def summary(job: Job, spec: Spec, link: Link) -> dict[str, Any]:
    assert job.layout is not None and link.model is not None
    ranks = job.local_ranks
    mine = {"node": job.layout.node, "ranks": [ranks[0], ranks[-1]], "spec": asdict(spec),
            "alpha": link.model.alpha, "beta": link.model.beta}
    if len(json.dumps(mine)) > SUMMARY_BYTES:
        raise InvalidArgumentError(f"collective name too long ({len(spec.name)} characters)")
    return mine


def failure_summary(job: Job, error: LpsyncError) -> dict[str, Any]:
    """A summary that carries the error that failed the collective on this node."""
    assert job.layout is not None
    lo, hi = job.local_ranks[0], job.local_ranks[-1]
    message = f"node {job.layout.node} (ranks {lo}-{hi}): {error}"[:SUMMARY_BYTES // 2]
    return {"node": job.layout.node, "ranks": [lo, hi], "error": [error.code, message]}


def _tags(job_hash: int, sequence: int) -> tuple[int, int]:
    value = (job_hash << 32) | (sequence & 0xFFFFFFFF)
    return control_tag(SPEC, value), control_tag(VERDICT, value)


# -- judging -------------------------------------------------------------------------------

def judge(summaries: list[dict[str, Any]], sequence: int, job: str) -> dict[str, Any]:
    """The verdict on every node's summary: {"error": [code, message]} or {"alpha", "beta"}."""
    by_node = {s["node"]: s for s in summaries}
    nodes = sorted(by_node)
    failed = [n for n in nodes if "error" in by_node[n]]
    if failed:
        code, message = by_node[failed[0]]["error"]
        return {"error": [code, f"collective #{sequence} of job {job!r} failed on another "
                                f"node: {message}"]}
    specs = {n: by_node[n]["spec"] for n in nodes}
    fields = [f for f in _FIELDS if len({json.dumps(specs[n][f]) for n in nodes}) > 1]
    if fields:
        def who(n: int) -> str:
            lo, hi = by_node[n]["ranks"]
            return f"node {n} (ranks {lo}-{hi})"
        detail = "; ".join(f"{f}: " + ", ".join(f"{who(n)}={specs[n][f]!r}" for n in nodes)
                           for f in fields)
        message = (f"collective #{sequence} of job {job!r}: nodes disagree on "
                   f"{', '.join(fields)} ({detail})")
        return {"error": ["INVALID_ARGUMENT", message[:_VERDICT_BYTES - 100]]}
    return {"alpha": max(by_node[n]["alpha"] for n in nodes),
            "beta": max(by_node[n]["beta"] for n in nodes)}


def _apply(verdict: dict[str, Any], result: np.ndarray | None) -> Verdict:
    if "error" in verdict:
        code, message = verdict["error"]
        raise _ERRORS.get(code, UnavailableError)(message)
    return Verdict(LinkModel(alpha=verdict["alpha"], beta=verdict["beta"], shared_nic=True),
                   result)


def _same_data(mine: dict[str, Any], theirs: list[dict[str, Any]]) -> bool:
    """Whether the parts of ``theirs`` may be folded with ours (same collective)."""
    spec = mine.get("spec")
    return spec is not None and all(s.get("spec") == spec for s in theirs)


# -- the protocol --------------------------------------------------------------------------

def agree(job: Job, pending: Pending, link: Link, deadline: float, mine: dict[str, Any],
          small: SmallCollective | None = None) -> Verdict:
    """Run this node's side of the agreement; raises the verdict's error on every node
    alike. ``mine`` is this node's summary (summary() or failure_summary());
    ``small`` carries a small collective's data (its result comes back in the Verdict)."""
    assert job.layout is not None
    nodes = job.layout.nodes
    up, down = _tags(job_hash(job.name), pending.sequence)
    part = small.part() if small is not None and "error" not in mine else None
    if nodes <= EXCHANGE_MAX_NODES:
        return _exchange(job, pending, link, deadline, mine, small, part, up)
    return _tree(job, pending, link, deadline, mine, small, part, up, down)


class _Incoming:
    """A message from ``peer``, its receive posted at once (so that the progress thread
    takes every message of this node's part in one go)."""

    def __init__(self, link: Link, peer: int, tag: int, size: int) -> None:
        self.peer, self.buf = peer, np.empty(size, np.uint8)
        self.request = link.endpoint.post_recv(peer, tag, self.buf)

    def take(self, deadline: float) -> tuple[dict[str, Any], np.ndarray, np.ndarray] | str:
        """(header, payload, the whole message), or why it could not be read (a mismatch,
        as text)."""
        try:
            self.request.wait(deadline)
            header, payload = decode(self.buf)
        except InvalidArgumentError:  # larger than any legal message: another collective
            return (f"node {self.peer} sent a larger agreement message than this collective "
                    "allows (the nodes run different collectives)")
        except ValueError as error:
            return f"node {self.peer} sent an unreadable agreement message ({error})"
        return header, payload, self.buf[:_FRAME + int(self.buf[:_FRAME].view("<u4").sum())]


def _exchange(job: Job, pending: Pending, link: Link, deadline: float, mine: dict[str, Any],
              small: SmallCollective | None, part: np.ndarray | None, tag: int) -> Verdict:
    assert job.layout is not None
    nodes, node = job.layout.nodes, job.layout.node
    out = encode({"summaries": [mine]}, part)
    others = [n for n in range(nodes) if n != node]
    incoming = [_Incoming(link, n, tag, SUMMARY_BYTES + _FRAME + SMALL_MAX_BYTES)
                for n in others]
    sends = [link.endpoint.send(n, tag, out) for n in others]
    summaries, parts = [mine], {node: part}
    pending.waiting_nodes = tuple(others)  # for `lpsync status` and the stall warning
    for i, (n, message) in enumerate(zip(others, incoming, strict=True)):
        got = message.take(deadline)
        if isinstance(got, str):
            summaries.append({"node": n, "ranks": [-1, -1], "error": ["INVALID_ARGUMENT", got]})
        else:
            header, payload, _ = got
            summaries.extend(header["summaries"])
            parts[n] = payload
        pending.waiting_nodes = tuple(others[i + 1:])
    for request in sends:
        request.wait(deadline)
    verdict = judge(summaries, pending.sequence, job.name)
    result = None
    if small is not None and "error" not in verdict:
        acc = _as(small, parts[0])
        for n in range(1, nodes):
            acc = small.fold(acc, _as(small, parts[n]))
        result = small.finish(acc)
    return _apply(verdict, result)


def _as(small: SmallCollective, part: np.ndarray) -> np.ndarray:
    return part if part.dtype == small.dtype else part.view(small.dtype)


def _tree(job: Job, pending: Pending, link: Link, deadline: float, mine: dict[str, Any],
          small: SmallCollective | None, part: np.ndarray | None, up: int, down: int
          ) -> Verdict:
    assert job.layout is not None
    nodes, node = job.layout.nodes, job.layout.node
    kids = children(node, nodes)
    incoming = [_Incoming(link, kid, up, SUMMARY_BYTES * subtree(kid, nodes) + _FRAME
                          + SMALL_MAX_BYTES) for kid in kids]
    verdict_in = (_Incoming(link, parent(node), down, _VERDICT_BYTES + _FRAME + SMALL_MAX_BYTES)
                  if node else None)
    summaries, acc = [mine], part
    pending.waiting_nodes = tuple(range(node + 1, node + subtree(node, nodes)))
    for kid, message in zip(kids, incoming, strict=True):
        got = message.take(deadline)
        if isinstance(got, str):
            summaries.append({"node": kid, "ranks": [-1, -1],
                              "error": ["INVALID_ARGUMENT", got]})
            acc = None
            continue
        header, payload, _ = got
        theirs = header["summaries"]
        summaries.extend(theirs)
        if acc is not None:
            assert small is not None
            # Another collective's data cannot be folded: the verdict will be a mismatch.
            acc = small.fold(acc, _as(small, payload)) if _same_data(mine, theirs) else None
        pending.waiting_nodes = tuple(range(kid + subtree(kid, nodes),
                                            node + subtree(node, nodes)))
    if node == 0:
        verdict = judge(summaries, pending.sequence, job.name)
        result = None
        if small is not None and "error" not in verdict:
            assert acc is not None  # every node agreed, so every node sent its part
            result = small.finish(acc)
        message = encode({"verdict": verdict}, result)
    else:
        sent = link.endpoint.send(parent(node), up, encode({"summaries": summaries}, acc))
        pending.waiting_nodes = (0,)
        assert verdict_in is not None
        got = verdict_in.take(deadline)
        sent.wait(deadline)
        if isinstance(got, str):
            # Our parent ran another collective; tell our subtree so that it fails too.
            verdict, result = {"error": ["INVALID_ARGUMENT", got]}, None
            message = encode({"verdict": verdict})
        else:
            header, payload, message = got  # forwarded as it came
            verdict = header["verdict"]
            result = _as(small, payload) if small is not None and "error" not in verdict else None
    for request in [link.endpoint.send(kid, down, message) for kid in kids]:
        request.wait(deadline)
    pending.waiting_nodes = ()
    return _apply(verdict, result)
