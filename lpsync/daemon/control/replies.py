"""The Session protocol's replies to a collective: a CollectiveResult in a SessionResponse.

Every collective ends in one, so a successful one on the trigger socket is written as
bytes directly (``result_bytes``): the serialized fields that repeat call after call
(code, buffer state, algorithm, chunks) are made once per kind and joined with the two
that change (the request id and the seconds). Protobuf parses a field that comes twice
by merging it (the language guide, "Encoding": last one wins for scalars, embedded
messages merge), so the joined bytes are the message ``result`` builds;
tests/daemon/unit/test_replies.py parses both and compares them.
"""

from __future__ import annotations

import functools
import struct

from lpsync.daemon.values import Outcome
from lpsync_client.wire.proto import lpsync_pb2 as pb

_STATE = {"INTACT": pb.INTACT, "PARTIAL": pb.PARTIAL, "": pb.BUFFER_STATE_UNSPECIFIED}
# SessionResponse.result (field 3, 11 bytes) { response (field 4, 9 bytes) { seconds
# (field 3, fixed64) } }: what follows is the double's 8 bytes.
_SECONDS = bytes((3 << 3 | 2, 11, 4 << 3 | 2, 9, 3 << 3 | 1))
_DOUBLE = struct.Struct("<d")
_REQUEST_ID = 1 << 3  # SessionResponse.request_id: field 1, a varint


def result(rid: int, outcome: Outcome) -> pb.SessionResponse:
    """The reply to request ``rid`` that ended with ``outcome``."""
    error = outcome.error
    body = pb.CollectiveResult(
        code="OK" if error is None else error.code,
        message="" if error is None else str(error),
        buffer_state=_STATE[outcome.buffer_state],
        error="" if error is None else type(error).__name__,
        response=pb.CollectiveResponse(
            algorithm=outcome.algorithm,
            chunks=outcome.chunks,
            seconds=outcome.seconds,
            armed=_armed(outcome.armed),
            done_event=outcome.done_event,
        ),
    )
    return pb.SessionResponse(request_id=rid, result=body)


def result_bytes(rid: int, outcome: Outcome) -> bytes:
    """``result(rid, outcome)`` serialized (a failure through ``result`` itself)."""
    if outcome.error is not None or outcome.done_event:
        return result(rid, outcome).SerializeToString()
    return b"".join(
        (
            _varint_field(_REQUEST_ID, rid),
            _success(outcome.algorithm, outcome.chunks, outcome.buffer_state, outcome.armed),
            _SECONDS,
            _DOUBLE.pack(outcome.seconds),
        )
    )


def with_id(response: pb.SessionResponse, rid: int) -> pb.SessionResponse:
    response.request_id = rid
    return response


def _armed(armed: tuple[str, int, int] | None) -> pb.Armed | None:
    if armed is None:
        return None
    page, plan, generation = armed
    return pb.Armed(page=page, plan=plan, generation=generation)


@functools.lru_cache(maxsize=256)
def _success(algorithm: str, chunks: int, state: str, armed: tuple[str, int, int] | None) -> bytes:
    """A successful result's fields but its seconds, serialized once per kind."""
    response = pb.CollectiveResponse(algorithm=algorithm, chunks=chunks, armed=_armed(armed))
    body = pb.CollectiveResult(code="OK", buffer_state=_STATE[state], response=response)
    return pb.SessionResponse(result=body).SerializeToString()


def _varint_field(tag: int, value: int) -> bytes:
    out = bytearray((tag,))
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
