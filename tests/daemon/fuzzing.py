"""Requests for every RPC, generated from the proto's own descriptors (hypothesis), and a
pool of real sessions for them to hit. test_fuzz_control.py drives them at a daemon.

Values favour the edges (0, -1, 2**31, 2**63-1, NaN, ±inf, empty and 100 000-character
strings, 5 000-element repeated fields, enum numbers the proto does not define) and the
words the daemon knows (op, dtype, algorithm names). Session ids and buffer handles are
drawn as placeholders that the driver swaps for the pool's real ones, so that requests reach
past the "unknown session" check into sessions that exist.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from lpsync_client.wire.proto import lpsync_pb2 as pb
from lpsync_client.wire.proto import lpsync_pb2_grpc as pb_grpc

F = FieldDescriptor
SERVICE = pb.DESCRIPTOR.services_by_name["LpSync"]
MESSAGES = list(pb.DESCRIPTOR.message_types_by_name.values())
_RANGES = {
    F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_UINT32: (0, (1 << 32) - 1),
    F.TYPE_FIXED32: (0, (1 << 32) - 1),
    F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_UINT64: (0, (1 << 64) - 1),
    F.TYPE_FIXED64: (0, (1 << 64) - 1),
}
EDGE_INTS = (
    0,
    1,
    -1,
    2,
    3,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    (1 << 63) - 1,
    -(1 << 63),
    (1 << 64) - 1,
    4096,
    1 << 20,
)
EDGE_FLOATS = (0.0, -0.0, -1.0, 0.001, 0.2, math.nan, math.inf, -math.inf, 1e-300, 1e300, float(1 << 63))
WORDS = (
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "reduce_scatter",
    "gather",
    "scatter",
    "alltoall",
    "barrier",
    "float32",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int64",
    "sum",
    "avg",
    "max",
    "lp",
    "ring",
    "mst",
    "be",
    "direct",
    "cpu",
    "fz",
    "x" * 100_000,
    "\x00",
    "é" * 300,
    "a\nb",
    "",
)
# Placeholders the driver replaces with the pool's real sessions and handles.
SESSION_SLOTS = 3
SESSION_MARK = "$session"
HANDLE_MARK = (1 << 64) - 1000  # HANDLE_MARK + k: the pool's k-th handle


def _scalar(f: FieldDescriptor) -> st.SearchStrategy:
    if f.type == F.TYPE_STRING:
        words = st.sampled_from(WORDS) | st.text(max_size=24)
        if f.name == "session_id":
            return st.sampled_from([f"{SESSION_MARK}{i}" for i in range(SESSION_SLOTS)]) | words
        return words
    if f.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if f.type == F.TYPE_BOOL:
        return st.booleans()
    if f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.sampled_from(EDGE_FLOATS) | st.floats(allow_nan=True, allow_infinity=True)
    if f.type == F.TYPE_ENUM:  # proto3 enums are open: numbers it does not define too
        return st.sampled_from([v.number for v in f.enum_type.values]) | st.integers(
            -(1 << 31), (1 << 31) - 1
        )
    lo, hi = _RANGES[f.type]
    ints = st.sampled_from([v for v in EDGE_INTS if lo <= v <= hi]) | st.integers(lo, hi)
    if f.name == "handle":
        ints = st.integers(HANDLE_MARK, HANDLE_MARK + 7) | ints
    if f.name == "count" or f.name == "nbytes":
        ints = st.integers(0, 4096) | ints
    return ints


def message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict]:
    """Dicts of field values for ``descriptor`` (nested messages as dicts)."""
    fields: dict[str, st.SearchStrategy] = {}
    for f in descriptor.fields:
        if f.type == F.TYPE_MESSAGE:
            value = message(f.message_type, depth + 1) if depth < 3 else st.just({})
        else:
            value = _scalar(f)
        if f.is_repeated:
            short = st.lists(value, max_size=4)
            # 5000-long lists at the top level only, of numbers or of empty messages and
            # strings: long lists nested in long lists, or of 100 000-character strings,
            # multiply into gigabytes in the test process itself.
            filler = {
                F.TYPE_MESSAGE: st.just({}),
                F.TYPE_STRING: st.just(""),
                F.TYPE_BYTES: st.just(b""),
            }.get(f.type, value)
            value = short | filler.map(lambda v: [v] * 5000) if depth == 0 else short
        fields[f.name] = value
    return st.fixed_dictionaries({}, optional=fields)


def build(descriptor: Descriptor, values: dict):
    return message_factory.GetMessageClass(descriptor)(**values)


@dataclass
class Unary:
    method: str
    payload: bytes | dict  # dict: a message of the method's input type, placeholders in it
    cancel: bool  # the client cancels the call right after sending it


@dataclass
class Stream:
    opens: bool  # the first message opens a fresh session of its own
    messages: list[dict]
    stop: str  # "close": half-close and read to the end; "cancel": cancel after one reply


def _near(descriptor: Descriptor, base: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A request that is valid apart from the few fields hypothesis overrides."""
    return st.tuples(st.fixed_dictionaries(base), message(descriptor)).map(
        lambda pair: {**pair[0], **pair[1]}
    )


def near_valid() -> st.SearchStrategy[Unary]:
    session = st.sampled_from([f"{SESSION_MARK}{i}" for i in range(SESSION_SLOTS)])
    handle = st.integers(HANDLE_MARK, HANDLE_MARK + 7)
    collective = _near(
        pb.CollectiveRequest.DESCRIPTOR,
        {
            "session_id": session,
            "sequence": st.integers(1, 64),
            "op": st.sampled_from(WORDS[:6]),
            "dtype": st.sampled_from(WORDS[6:12]),
            "count": st.integers(0, 64),
            "timeout": st.sampled_from([0.05, 0.2]),
            "algorithm": st.sampled_from(["", "lp", "ring", "mst", "be", "direct"]),
            "input": st.fixed_dictionaries({"handle": handle}),
        },
    )
    allocate = _near(pb.AllocateRequest.DESCRIPTOR, {"session_id": session, "nbytes": st.integers(0, 4096)})
    release = _near(pb.ReleaseRequest.DESCRIPTOR, {"session_id": session, "handle": handle})
    return (
        st.builds(Unary, st.just("Collective"), collective, _rarely())
        | st.builds(Unary, st.sampled_from(["Allocate", "Register"]), allocate, _rarely())
        | st.builds(Unary, st.just("Release"), release, _rarely())
    )


def _rarely() -> st.SearchStrategy[bool]:
    return st.integers(0, 4).map(lambda n: n == 0)


def cases() -> st.SearchStrategy:
    unary_methods = [m for m in SERVICE.methods if not m.client_streaming]
    typed = st.one_of(
        [st.builds(Unary, st.just(m.name), message(m.input_type), _rarely()) for m in unary_methods]
    )
    raw = st.builds(
        Unary, st.sampled_from([m.name for m in unary_methods]), st.binary(max_size=300), _rarely()
    )
    # Type confusion: a well-formed message of another type sent to a method.
    confused = st.builds(
        Unary,
        st.sampled_from([m.name for m in unary_methods]),
        st.sampled_from(MESSAGES).flatmap(
            lambda d: message(d).map(lambda v, d=d: build(d, v).SerializeToString())
        ),
        _rarely(),
    )
    stream = st.builds(
        Stream,
        st.booleans(),
        st.lists(message(pb.SessionRequest.DESCRIPTOR), max_size=6),
        st.sampled_from(["close", "cancel"]),
    )
    return st.one_of(typed, typed, near_valid(), near_valid(), raw, confused, stream)


def substitute(msg, sessions: list[str], handles: list[int]) -> None:
    """Swap the placeholders in ``msg`` (in place, recursively) for real ids and handles."""
    for f, value in msg.ListFields():
        if f.type == F.TYPE_MESSAGE:
            for sub in value if f.is_repeated else [value]:
                substitute(sub, sessions, handles)
        elif f.name == "session_id" and not f.is_repeated and value.startswith(SESSION_MARK) and sessions:
            slot = value[len(SESSION_MARK) :]
            setattr(msg, f.name, sessions[int(slot) % len(sessions)] if slot.isdigit() else value)
        elif f.name == "handle" and not f.is_repeated and HANDLE_MARK <= value < HANDLE_MARK + 8 and handles:
            setattr(msg, f.name, handles[(value - HANDLE_MARK) % len(handles)])


@dataclass
class Member:
    session_id: str
    handles: list[int]
    requests: queue.Queue = field(default_factory=queue.Queue)
    call: object = None
    drainer: threading.Thread | None = None


class Pool:
    """Real sessions for the fuzzer to hit: job fz-a (one rank) and job fz-b (two ranks),
    each with an open Session stream and two buffers. ``ensure`` rebuilds them whenever a
    fuzzed Detach or Release took something away."""

    JOBS = (("fz-a", 0, 1), ("fz-b", 0, 2), ("fz-b", 1, 2))

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = pb_grpc.LpSyncStub(channel)
        self.members: list[Member] = []

    @property
    def sessions(self) -> list[str]:
        return [m.session_id for m in self.members]

    @property
    def handles(self) -> list[int]:
        return [h for m in self.members for h in m.handles]

    def ensure(self) -> None:
        status = self.stub.Status(pb.StatusRequest(), timeout=10)
        have = {(b.session_id, b.handle) for b in status.buffers}
        alive = {s.session_id for s in status.sessions}
        if self.members and all(
            m.session_id in alive and all((m.session_id, h) in have for h in m.handles) for m in self.members
        ):
            return
        self.close()
        for job, rank, world in self.JOBS:
            sid = self.stub.Attach(
                pb.AttachRequest(job=job, rank=rank, world_size=world), timeout=10
            ).session_id
            member = Member(sid, [])
            member.requests.put(pb.SessionRequest(open=pb.SessionOpen(session_id=sid)))
            member.call = self.stub.Session(iter(member.requests.get, None))
            member.drainer = threading.Thread(target=_drain, args=(member.call,), daemon=True)
            member.drainer.start()
            member.handles = [
                self.stub.Allocate(pb.AllocateRequest(session_id=sid, nbytes=256), timeout=10).handle
                for _ in range(2)
            ]
            self.members.append(member)

    def close(self) -> None:
        for member in self.members:
            member.requests.put(None)
            member.call.cancel()
            member.drainer.join(10)
        self.members = []


def _drain(call) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass
