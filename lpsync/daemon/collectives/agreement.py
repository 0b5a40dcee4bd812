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
A small collective (small.py) adds its data, a Ride (ride.py): each message carries the
sender's folded part (up) or the result (down; for reduce and gather only towards the
root's node, the other subtrees take the verdict alone). The parts a node receives are
folded in one call (``_folded``), once all are in.

One entry, ``agree(side, link)``, for every branch of the multi-node path (path.py):
a node brings its summary, or the error that failed the call there (no mesh: announced
on the next; its armed run failed); the message tags come in with the Side, made once
above (lpsync.transport.tags.agreement_tags): this module imports nothing of transport.

Wire format of a message: two little-endian uint32 (header bytes, payload bytes), the
JSON header, the payload. Receive buffers are sized for the largest message a node may
legally send; a larger one (another node decided otherwise: mismatched collectives)
fails that node's part as a mismatch instead of breaking the mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import numpy as np

from lpsync.algorithms import LinkModel
from lpsync.daemon.collectives.matching import Job
from lpsync.daemon.collectives.ride import SMALL_MAX_BYTES, Ride
from lpsync.daemon.peers.plane import Link, PeerPlane
from lpsync.daemon.values import SPEC_FIELDS, Pending, Spec
from lpsync.errors import (
    AbortedError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    MismatchError,
    UnavailableError,
)

log = logging.getLogger("lpsync.daemon")

SUMMARY_BYTES = 4096  # one node's summary, JSON (a collective's name is most of it)
_RANKS_CHARS = 200  # a node's ranks in its summary ('ranks 0, 2-3'), cut beyond
_VERDICT_BYTES = 4096
_LENGTHS = struct.Struct("<II")  # the frame: header bytes, payload bytes
_FRAME = _LENGTHS.size
_VERDICT_MESSAGE = _VERDICT_BYTES + _FRAME + SMALL_MAX_BYTES  # the largest verdict message
_ERRORS = {
    "INVALID_ARGUMENT": MismatchError,
    "DEADLINE_EXCEEDED": CollectiveTimeoutError,
    "ABORTED": AbortedError,
}
# The segment sizes (bytes) a summary may offer for the hierarchical device pipeline.
_MIN_SEGMENT, _MAX_SEGMENT = 4096, 1 << 40
EXCHANGE_MAX_NODES = 2  # up to this many nodes, every node sends to every other


@dataclass(frozen=True)
class Verdict:
    model: LinkModel
    result: np.ndarray | None  # a small collective's result (ride.py); None otherwise
    use: tuple[str, int] | None = None  # node 0's (algorithm, chunks), learning.py
    trial: bool = False  # node 0 times this run
    # (node, sequence, seconds) of earlier trials, where the summaries were judged
    reports: tuple[tuple[int, int, float], ...] = ()
    # Every node's participants pass device buffers: the segment (bytes) of the
    # hierarchical pipeline (hierarchy.py), the smallest any node offered; 0: flat.
    segment: int = 0
    # Every node offered to run this collective armed (native_across.py): each node's
    # (host, port) for the engine's channels, and whether every node's are connected.
    native: tuple[tuple[str, int], ...] = ()
    native_ready: bool = False

    def carrying(self, result: np.ndarray | None) -> Verdict:
        """This verdict with a small collective's ``result`` (a go verdict is read once
        and shared; the result is this call's)."""
        return dataclasses.replace(self, result=result)


# -- the tree ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """A k-nomial tree over nodes 0..nodes-1 rooted at node 0 (radix 2: binomial; radix >=
    nodes: flat, node 0 the parent of all). A node's subtree is a contiguous run of nodes
    that starts with it; its children come in ascending order, each subtree after the
    previous one (so allgather blocks fold in rank order)."""

    nodes: int
    radix: int = 2

    def _place(self, node: int) -> int:
        """The place value of ``node``'s lowest nonzero base-radix digit (node > 0)."""
        place = 1
        while node % (place * self.radix) == 0:
            place *= self.radix
        return place

    def parent(self, node: int) -> int:
        place = self._place(node)
        return node - (node // place % self.radix) * place

    def subtree(self, node: int) -> int:
        return self.nodes if node == 0 else min(self._place(node), self.nodes - node)

    def children(self, node: int) -> list[int]:
        out: list[int]
        out, place = [], 1
        while place < self.subtree(node) and node + place < self.nodes:
            out.extend(node + j * place for j in range(1, self.radix) if node + j * place < self.nodes)
            place *= self.radix
        return out


@dataclass(frozen=True)
class _Shape:
    """One node's place in the tree, worked out once per (nodes, radix, node): a job
    repeats its collectives, and each one would otherwise walk the tree again."""

    kids: tuple[int, ...]
    parent: int  # -1 at node 0
    kid_bytes: tuple[int, ...]  # the largest message each kid may send up (its subtree's)
    ends: tuple[int, ...]  # each kid's subtree: nodes kid..end-1
    # pending.waiting_nodes before each kid's message is taken, then once all are in
    waiting: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=256)
def _shape(nodes: int, radix: int, node: int) -> _Shape:
    tree = Tree(nodes, radix)
    kids = tuple(tree.children(node))
    end = node + tree.subtree(node)
    waiting = (*(tuple(range(kid, end)) for kid in kids), ())
    return _Shape(
        kids,
        tree.parent(node) if node else -1,
        tuple(SUMMARY_BYTES * tree.subtree(kid) + _FRAME + SMALL_MAX_BYTES for kid in kids),
        tuple(kid + tree.subtree(kid) for kid in kids),
        waiting,
    )


# -- messages ------------------------------------------------------------------------------


def encode(header: dict[str, Any] | bytes, payload: np.ndarray | None = None) -> np.ndarray:
    """A message: ``header`` as JSON (or already serialized) and the payload's bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    # One join of bytes: a few C calls where filling an array took eight numpy calls (a
    # small collective's messages are mostly header). Read-only: it is only ever sent.
    data = b"" if payload is None else np.ascontiguousarray(payload).tobytes()
    return np.frombuffer(b"".join((_LENGTHS.pack(len(raw), len(data)), raw, data)), np.uint8)


def decode(buf: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """(header, payload bytes) of a received message."""
    raw, payload = _split(buf)
    return json.loads(raw), payload


def _split(buf: np.ndarray) -> tuple[bytes, np.ndarray]:
    """(the header's JSON bytes, the payload bytes) of a received message."""
    head, size = _LENGTHS.unpack_from(buf)  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on Python 3.12+ only
    if _FRAME + head + size > buf.nbytes:
        raise ValueError("a message shorter than its frame says")
    return buf[_FRAME : _FRAME + head].tobytes(), buf[_FRAME + head : _FRAME + head + size]


@functools.lru_cache(maxsize=256)
def _parsed(raw: bytes) -> dict[str, Any]:
    """An agreement header parsed once: a job repeats its collectives, so the same
    summaries and verdicts come byte for byte call after call. Shared: read, never change."""
    return json.loads(raw)


@functools.lru_cache(maxsize=256)
def _judged(raws: tuple[bytes, ...]) -> tuple[dict[str, Any], bytes, Verdict] | None:
    """Node 0's go verdict on the summary messages ``raws`` (its own first, then each
    child's, as they came), its header and what it applies to, judged once per distinct
    set; None where the nodes disagree or failed (the error names the collective: judged
    every time)."""
    summaries = [s for raw in raws for s in _parsed(raw)["summaries"]]
    verdict = judge(summaries, 0, "")
    if "error" in verdict:
        return None
    return verdict, json.dumps({"verdict": verdict}).encode(), _apply(verdict, None, summaries)


@dataclass(frozen=True)
class Summary:
    """One node's summary (read-only) and the header of a message that carries it alone
    (what a node without children sends), serialized once."""

    fields: dict[str, Any]
    alone: bytes

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Summary:
        return cls(fields, json.dumps({"summaries": [fields]}).encode())


def _go_summary(job: Job, spec: Spec, link: Link, extras: tuple[tuple[str, Any], ...] = ()) -> Summary:
    """This node's summary of ``spec`` (cached: a job repeats its collectives); ``extras``
    are learning.py's fields ("use", "trial", "last") and hierarchy.py's ("device"), hashable."""
    assert job.layout is not None and link.model is not None
    return _summary(spec, job.layout.node, _ranks(job), link.model.alpha, link.model.beta, extras)


def _ranks(job: Job) -> str:
    """This node's ranks of ``job`` as error messages name them ('ranks 0, 2-3'; any set,
    since a job's ranks need not be node-major: NodeLayout.local_text); bounded, for the
    summary's size."""
    assert job.layout is not None
    text = job.layout.local_text
    return text if len(text) <= _RANKS_CHARS else text[:_RANKS_CHARS] + "..."


@functools.lru_cache(maxsize=256)
def _summary(
    spec: Spec, node: int, ranks: str, alpha: float, beta: float, extras: tuple[tuple[str, Any], ...]
) -> Summary:
    mine = Summary.of(
        {"node": node, "ranks": ranks, "spec": spec._asdict(), "alpha": alpha, "beta": beta, **dict(extras)}
    )
    if len(mine.alone) > SUMMARY_BYTES:
        raise InvalidArgumentError(f"collective name too long ({len(spec.name)} characters)")
    return mine


def failure_summary(job: Job, error: LpsyncError) -> Summary:
    """A summary that carries the error that failed the collective on this node."""
    assert job.layout is not None
    ranks = _ranks(job)
    message = f"node {job.layout.node} ({ranks}): {error}"[: SUMMARY_BYTES // 2]
    return Summary.of({"node": job.layout.node, "ranks": ranks, "error": [error.code, message]})


def announce(job: Job, sequence: int, tags: tuple[int, int], link: Link, failure: Summary) -> None:
    """This node failed collective ``sequence`` without a mesh (failure_summary): on
    the next one, send what the nodes that run it there wait for from this node, so
    that they fail it at once instead of timing out: the summary to its tree parent
    (or, in an exchange, to the other node) and an error verdict to its children.
    Sent, never waited for (a wait that times out would break the mesh); where no one
    waits, the message lies unread until this mesh generation closes."""
    assert job.layout is not None
    nodes, node = job.layout.nodes, job.layout.node
    up, down = tags
    if nodes <= EXCHANGE_MAX_NODES:
        for other in range(nodes):
            if other != node:
                link.endpoint.send(other, up, encode(failure.alone))
        return
    tree = Tree(nodes, link.agreement_radix)
    if node:
        link.endpoint.send(tree.parent(node), up, encode(failure.alone))
    code, message = failure.fields["error"]
    verdict = encode(
        {
            "verdict": {
                "error": [
                    code,
                    f"collective #{sequence} of job {job.name!r} failed on another node: {message}",
                ]
            }
        }
    )
    for kid in tree.children(node):
        link.endpoint.send(kid, down, verdict)


# -- judging -------------------------------------------------------------------------------


def judge(
    summaries: list[dict[str, Any]], sequence: int, job: str, daemon: Callable[[int], int] = int
) -> dict[str, Any]:
    """The verdict on every node's summary: {"error": [code, message]} or {"alpha", "beta"}.
    ``daemon`` names a job's node as the daemon of --peers it is (NodeLayout.daemon)."""
    by_node = {s["node"]: s for s in summaries}
    nodes = sorted(by_node)
    failed = [n for n in nodes if "error" in by_node[n]]
    if failed:
        code, message = by_node[failed[0]]["error"]
        return {"error": [code, f"collective #{sequence} of job {job!r} failed on another node: {message}"]}
    specs = {n: by_node[n]["spec"] for n in nodes}
    first = specs[nodes[0]]
    same = all(spec == first for spec in specs.values())
    fields = [] if same else [f for f in SPEC_FIELDS if len({json.dumps(specs[n][f]) for n in nodes}) > 1]
    if fields:

        def who(n: int) -> str:
            return f"node {daemon(n)} ({by_node[n]['ranks']})"

        detail = "; ".join(f"{f}: " + ", ".join(f"{who(n)}={specs[n][f]!r}" for n in nodes) for f in fields)
        message = f"collective #{sequence} of job {job!r}: nodes disagree on {', '.join(fields)} ({detail})"
        return {"error": ["INVALID_ARGUMENT", message[: _VERDICT_BYTES - 100]]}
    verdict = {
        "alpha": max(by_node[n]["alpha"] for n in nodes),
        "beta": max(by_node[n]["beta"] for n in nodes),
    }
    offered = [by_node[n].get("device", 0) for n in nodes]
    # A peer's summary is input: only a whole number of bytes in range runs hierarchically.
    if all(type(b) is int and _MIN_SEGMENT <= b <= _MAX_SEGMENT for b in offered):
        verdict["device"] = min(offered)
    offers: list[Any] = [o for o in (by_node[n].get("native") for n in nodes) if _native_offer(o)]
    if len(offers) == len(nodes):  # every node may run it armed
        verdict["native"] = {"at": [[o[0], o[1]] for o in offers], "ready": all(o[2] for o in offers)}
    first = by_node[nodes[0]]
    if "use" in first:  # node 0 decides the schedule for all (learning.py)
        verdict["use"], verdict["trial"] = first["use"], first.get("trial", False)
    return verdict


def _native_offer(offer: Any) -> bool:
    """A peer's summary is input: [host, port, channels ready] or nothing."""
    return (
        isinstance(offer, (list, tuple))
        and len(offer) == 3
        and isinstance(offer[0], str)
        and 0 < len(offer[0]) <= 255
        and type(offer[1]) is int
        and 0 < offer[1] < 65536
        and type(offer[2]) is bool
    )


def reports(summaries: list[dict[str, Any]]) -> tuple[tuple[int, int, float], ...]:
    """Every (node, sequence, seconds) of an earlier trial the summaries carry."""
    return tuple((s["node"], *s["last"]) for s in summaries if "last" in s)


def _apply(
    verdict: dict[str, Any], result: np.ndarray | None, summaries: list[dict[str, Any]] | None = None
) -> Verdict:
    if "error" in verdict:
        raise _error(verdict)
    use = verdict.get("use")
    native = verdict.get("native") or {"at": [], "ready": False}
    return Verdict(
        LinkModel(alpha=verdict["alpha"], beta=verdict["beta"], shared_nic=True),
        result,
        None if use is None else (str(use[0]), int(use[1])),
        bool(verdict.get("trial", False)),
        reports(summaries or []),
        int(verdict.get("device", 0)),
        tuple((str(host), int(port)) for host, port in native["at"]),
        bool(native["ready"]),
    )


def _error(verdict: dict[str, Any]) -> LpsyncError:
    """The error an error verdict names, as every node raises it."""
    code, message = verdict["error"]
    return _ERRORS.get(code, UnavailableError)(message)


@functools.lru_cache(maxsize=256)
def _go(raw: bytes) -> Verdict:
    """A go verdict from its message header, read once: call after call it is the same."""
    return _apply(_parsed(raw)["verdict"], None)


@functools.lru_cache(maxsize=256)
def _same_data(mine: bytes, theirs: bytes) -> bool:
    """Whether the parts under the summaries of message header ``theirs`` may be folded
    with ours (same collective); headers, as their summaries repeat call after call."""
    spec = _parsed(mine)["summaries"][0].get("spec")
    return spec is not None and all(s.get("spec") == spec for s in _parsed(theirs)["summaries"])


# -- the protocol --------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """This node's side of one collective's agreement, whichever branch of the multi-node
    path (path.py) comes to it: what this node brings (its Spec and offers, or the error
    that failed the call here), the collective riding it, and how long it waits."""

    job: Job
    pending: Pending
    tags: tuple[int, int]  # (summary tag, verdict tag): transport/tags.agreement_tags
    deadline: float
    spec: Spec | None = None  # what this node's ranks called (None where ``error`` is set)
    # learning.py's fields ("use", "trial", "last"), hierarchy.py's ("device"),
    # native_across.py's ("native"): hashable, the summary is cached
    offers: tuple[tuple[str, Any], ...] = ()
    error: LpsyncError | None = None  # the call failed on this node: every node fails it
    ride: Ride | None = None  # the collective whose data rides (small.py, ride.py)
    # Where it may finish where the verdict lands (a leaf's reader): called there, once,
    # with the Verdict or the error (finish.py's)
    landed: Callable[[Verdict | Exception], None] | None = None


def agree(side: Side, link: Link | PeerPlane) -> Verdict | None:
    """The agree stage: this node's part in ``side``'s agreement and the verdict that
    every node reaches alike, raised where it is an error. The one entry for every
    branch of the multi-node path:
      - a go side: the Verdict (carrying the result of a collective that rides it), or,
        where ``side.landed`` is given and this node is a leaf that can (agree_later),
        None: the verdict's reader hands it to ``side.landed``;
      - a failed side (``side.error``): its summary carries the error, so that the nodes
        that run the call fail it at once instead of timing out; raises ``side.error``
        after its part (whatever the verdict: it names this error or an earlier node's).
        ``link`` is the plane where there is no mesh: the failure is announced on the
        next one (sent, never waited for)."""
    if side.error is not None:
        _fail(side, link, side.error)
    assert isinstance(link, Link) and side.spec is not None
    mine = _go_summary(side.job, side.spec, link, side.offers)
    if side.landed is not None and agree_later(side, link, mine):
        return None
    return _agree(side.job, side.pending, link, side.deadline, mine, side.ride, side.tags)


def _fail(side: Side, link: Link | PeerPlane, error: LpsyncError) -> NoReturn:
    """A failed side's part: agreed (bounded by its deadline) or, without a mesh, owed."""
    job, pending, tags = side.job, side.pending, side.tags
    assert job.layout is not None
    failure = failure_summary(job, error)
    if isinstance(link, Link):
        with contextlib.suppress(LpsyncError):
            _agree(job, pending, link, side.deadline, failure, None, tags)
    else:
        cluster, sequence = job.layout.cluster, pending.sequence
        link.owe(side.deadline, lambda now: announce(job, sequence, tags, now.for_job(cluster), failure))
    raise error


def _agree(
    job: Job,
    pending: Pending,
    link: Link,
    deadline: float,
    mine: Summary,
    ride: Ride | None,
    tags: tuple[int, int],
) -> Verdict:
    """Run this node's side of the agreement; raises the verdict's error on every node
    alike. ``mine`` is this node's summary (_go_summary() or failure_summary());
    ``ride`` carries a small collective's data (its result comes back in the Verdict)."""
    assert job.layout is not None
    nodes = job.layout.nodes
    up, down = tags
    part = ride.part if ride is not None and "error" not in mine.fields else None
    if nodes <= EXCHANGE_MAX_NODES:
        return _exchange(job, pending, link, deadline, mine, ride, part, up)
    return _tree(job, pending, link, deadline, mine, ride, part, up, down)


class _Incoming:
    """A message from ``peer``, its receive posted at once (so that the progress thread
    takes every message of this node's part in one go)."""

    __slots__ = ("buf", "peer", "raw", "request")

    def __init__(self, link: Link, peer: int, tag: int, size: int) -> None:
        self.peer, self.buf = peer, np.empty(size, np.uint8)
        self.raw = b""  # the header's bytes, once taken
        self.request = link.endpoint.post_recv(peer, tag, self.buf)

    def take(self, deadline: float) -> tuple[dict[str, Any], np.ndarray, np.ndarray] | str:
        """(header, payload, the whole message), or why it could not be read (a mismatch,
        as text)."""
        assert self.request is not None  # the peer plane's endpoints always post
        try:
            self.request.wait(deadline)
        except InvalidArgumentError:
            return _too_large(self.peer)
        got = _read(self.peer, self.buf)
        if isinstance(got, str):
            return got
        self.raw = got[0]
        return got[1:]


def _read(peer: int, buf: np.ndarray) -> tuple[bytes, dict[str, Any], np.ndarray, np.ndarray] | str:
    """(the header's bytes, the header, payload, the whole message) of a message from
    ``peer`` that landed in ``buf``, or why it cannot be read (a mismatch, as text)."""
    try:
        raw, payload = _split(buf)
        header = _parsed(raw)
    except ValueError as error:
        return _unreadable(peer, error)
    return raw, header, payload, buf[: _FRAME + sum(_LENGTHS.unpack_from(buf))]  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on Python 3.12+ only


def _unreadable(peer: int, error: ValueError) -> str:
    return f"node {peer} sent an unreadable agreement message ({error})"


def _too_large(peer: int) -> str:
    # Larger than any legal message: another collective.
    return (
        f"node {peer} sent a larger agreement message than this collective allows (the nodes "
        "run different collectives)"
    )


def agree_later(side: Side, link: Link, mine: Summary) -> bool:
    """_agree() on a leaf of the tree whose connection to its parent takes callbacks (a
    Channel: the TCP backend's, whose reader calls back, and UCX's, whose progress thread
    does): send the summary with this node's part and leave the verdict to the thread that
    receives it, so that the collective finishes there and no thread is woken to learn of
    it. That thread calls ``side.landed`` once with the Verdict, or the error _agree()
    would raise: the verdict's, or the mesh's when it breaks or the deadline passes (the
    heartbeat watchdog expires the wait; whichever comes first). False where this node is
    not such a leaf: call _agree(). ``side.ride``: the collective riding the agreement;
    None for a barrier (the agreement is all of it)."""
    job, pending, deadline, ride, hand = side.job, side.pending, side.deadline, side.ride, side.landed
    assert job.layout is not None and hand is not None
    nodes, node = job.layout.nodes, job.layout.node
    if node == 0 or nodes <= EXCHANGE_MAX_NODES:
        return False
    shape = _shape(nodes, link.agreement_radix, node)
    channel_of = getattr(link.endpoint, "channel", None)
    channel = None if shape.kids or channel_of is None else channel_of(shape.parent)
    if channel is None:
        return False
    up, down = side.tags
    once = threading.Lock()  # the reader and the watchdog may both come: the first hands it on
    buf = np.empty(_VERDICT_MESSAGE, np.uint8)
    posted: list[Any] = []  # the verdict's receive, once posted

    def failed(request: Any) -> LpsyncError | None:
        """The error a wait for ``request`` raises (the mesh's when it broke; a timeout
        breaks it), or None."""
        try:
            channel.wait(request, deadline, "the agreement's verdict")
        except InvalidArgumentError:
            return _error({"error": ["INVALID_ARGUMENT", _too_large(shape.parent)]})
        except LpsyncError as error:
            return error
        return None

    def landed(request: Any) -> None:  # on the reader; at once where the post failed
        link.unwatch(key)
        try:
            error = failed(request) if request.error is not None else None
            value: Verdict | Exception = error or _leaf_verdict(shape.parent, buf, ride)
        except Exception as unexpected:  # a malformed verdict: what _agree() would raise
            value = unexpected
        try:
            if once.acquire(blocking=False):
                hand(value)  # the collective finishes here
        except Exception:  # the reader serves the whole connection: it must go on
            log.exception("finishing a collective on its verdict's reader failed")

    def expire() -> None:  # on the watchdog, past the deadline
        if posted and (error := failed(posted[0])) is not None and once.acquire(blocking=False):
            hand(error)

    key = link.watch(deadline, expire)
    pending.waiting_nodes = (0,)
    message = encode(mine.alone, ride.part if ride else None)
    # Both on the connection's channel: a send that fails (the mesh broke) fails the
    # posted receive too, which reports it through ``landed``.
    posted.append(channel.post((down << channel.shift) | channel.recv_bits, buf, landed))
    channel.send((up << channel.shift) | channel.send_bits, message, None)
    return True


def _leaf_verdict(parent: int, buf: np.ndarray, ride: Ride | None) -> Verdict | LpsyncError:
    """What _tree makes of a leaf's verdict message in ``buf``: the go verdict carrying
    the result, or the verdict's error."""
    try:
        raw, payload = _split(buf)
        verdict = _parsed(raw)["verdict"]
    except ValueError as error:
        return _error({"error": ["INVALID_ARGUMENT", _unreadable(parent, error)]})
    if "error" in verdict:
        return _error(verdict)
    return _go(raw).carrying(_as(ride, payload) if ride is not None else None)


def _exchange(
    job: Job,
    pending: Pending,
    link: Link,
    deadline: float,
    mine: Summary,
    ride: Ride | None,
    part: np.ndarray | None,
    tag: int,
) -> Verdict:
    assert job.layout is not None
    nodes, node = job.layout.nodes, job.layout.node
    out = encode(mine.alone, part)
    others = [n for n in range(nodes) if n != node]
    incoming = [_Incoming(link, n, tag, SUMMARY_BYTES + _FRAME + SMALL_MAX_BYTES) for n in others]
    sends = [link.endpoint.send(n, tag, out) for n in others]
    summaries, parts = [mine.fields], {node: part}
    pending.waiting_nodes = tuple(others)  # for `lpsync status` and the stall warning
    for i, (n, message) in enumerate(zip(others, incoming, strict=True)):
        got = message.take(deadline)
        if isinstance(got, str):
            summaries.append({"node": n, "ranks": "ranks unknown", "error": ["INVALID_ARGUMENT", got]})
        else:
            header, payload, _ = got
            summaries.extend(header["summaries"])
            parts[n] = payload
        pending.waiting_nodes = tuple(others[i + 1 :])
    for request in sends:
        request.wait(deadline)
    judged = _judged_from(mine, incoming)  # every node judges: the same go verdict
    verdict = judge(summaries, pending.sequence, job.name, job.layout.daemon) if judged is None else judged[0]
    result = None
    if ride is not None and "error" not in verdict:
        # A go verdict: every node sent its part (this one's too, no error here).
        result = _folded(ride, [cast(np.ndarray, parts[n]) for n in range(nodes)], True)
    if judged is None:
        return _apply(verdict, result, summaries)
    return judged[2].carrying(result)


def _judged_from(mine: Summary, incoming: list[_Incoming]) -> tuple[dict[str, Any], bytes, Verdict] | None:
    """_judged on this node's summary and the messages taken; None where a take failed
    (its raw is b"": judged in full, with the failure)."""
    raws = (mine.alone, *[m.raw for m in incoming])
    return _judged(raws) if all(raws) else None


def _as(ride: Ride, part: np.ndarray) -> np.ndarray:
    return part if part.dtype == ride.dtype else part.view(ride.dtype)


def _folded(ride: Ride, parts: list[np.ndarray], finish: bool) -> np.ndarray:
    """The parts a node has (its own, then each received one, in node order) folded into
    what it sends on; ``finish``: the result (ride.py). The one place the agreement
    hands a ride its data, whichever shape (exchange, tree)."""
    for i, part in enumerate(parts):
        parts[i] = _as(ride, part)
    return ride.folded(parts, finish)


def _tree(
    job: Job,
    pending: Pending,
    link: Link,
    deadline: float,
    mine: Summary,
    ride: Ride | None,
    part: np.ndarray | None,
    up: int,
    down: int,
) -> Verdict:
    assert job.layout is not None
    node = job.layout.node
    shape = _shape(job.layout.nodes, link.agreement_radix, node)
    kids = shape.kids
    incoming = [_Incoming(link, kid, up, size) for kid, size in zip(kids, shape.kid_bytes, strict=True)]
    verdict_in = _Incoming(link, shape.parent, down, _VERDICT_MESSAGE) if node else None
    summaries = [mine.fields]
    # This node's part and each kid's, folded once all are in; None: nothing to fold
    # (no ride, this node failed, or a kid sent what cannot be folded).
    parts = None if part is None else [part]
    header: dict[str, Any] | bytes  # a received header, then the one sent up
    message: _Incoming | np.ndarray  # a kid's message, then the one sent down
    pending.waiting_nodes = shape.waiting[0]
    for i, (kid, message) in enumerate(zip(kids, incoming, strict=True)):
        got = message.take(deadline)
        if isinstance(got, str):
            summaries.append({"node": kid, "ranks": "ranks unknown", "error": ["INVALID_ARGUMENT", got]})
            parts = None
            continue
        header, payload, _ = got
        theirs = header["summaries"]
        summaries.extend(theirs)
        if parts is not None and _same_data(mine.alone, message.raw):
            parts.append(payload)
        else:  # another collective's data cannot be folded: the verdict will be a mismatch
            parts = None
        pending.waiting_nodes = shape.waiting[i + 1]
    base = None  # the go verdict read once (_judged, _go), where there is one
    if node == 0:
        judged = _judged_from(mine, incoming)
        if judged is not None:
            verdict, said, base = judged
        else:
            verdict, said = judge(summaries, pending.sequence, job.name, job.layout.daemon), None
        result = None
        if ride is not None and "error" not in verdict:
            assert parts is not None  # every node agreed, so every node sent its part
            result = _folded(ride, parts, True)
        message = encode(said or {"verdict": verdict}, result)
    else:
        header = mine.alone if not kids else {"summaries": summaries}
        acc = _folded(ride, parts, False) if ride is not None and parts is not None else None
        sent = link.endpoint.send(shape.parent, up, encode(header, acc))
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
            result = _as(ride, payload) if ride is not None and "error" not in verdict else None
    messages = [message] * len(kids)
    if kids and ride is not None and result is not None and result.size and not ride.everywhere:
        # Reduce and gather: the result only down the subtree of the root's node; the
        # others take the verdict alone (on 8 nodes, 1 of node 0's 7 copies of it).
        there = job.layout.node_of[ride.root]
        bare = encode(verdict_in.raw if verdict_in is not None else said or {"verdict": verdict})
        messages = [
            message if kid <= there < end else bare for kid, end in zip(kids, shape.ends, strict=True)
        ]
    for request in [link.endpoint.send(kid, down, m) for kid, m in zip(kids, messages, strict=True)]:
        request.wait(deadline)
    pending.waiting_nodes = ()
    if base is None:
        if node == 0 or "error" in verdict or verdict_in is None:
            return _apply(verdict, result, summaries if node == 0 else None)
        base = _go(verdict_in.raw)
    return base.carrying(result)
