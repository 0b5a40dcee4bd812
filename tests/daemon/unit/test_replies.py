"""A collective's result written as joined bytes (replies.result_bytes) parses to the
message that replies.result builds, for every kind of outcome and request id."""

from __future__ import annotations

import itertools

import pytest

from lpsync.daemon.control import replies
from lpsync.daemon.values import INTACT, PARTIAL, UNSPECIFIED, Outcome
from lpsync.errors import CollectiveTimeoutError, MismatchError
from lpsync_client.wire.proto import lpsync_pb2 as pb

_IDS = (0, 1, 127, 128, 300, 16383, 16384, (1 << 32) + 5, (1 << 64) - 1)
_OUTCOMES = [
    Outcome(),
    Outcome(algorithm="tree", chunks=1, seconds=0.00123),
    Outcome(algorithm="ring", chunks=4096, seconds=1e-9),
    Outcome(buffer_state=INTACT, algorithm="lp", chunks=7, seconds=123456.5),
    Outcome(buffer_state=PARTIAL, algorithm="exchange", chunks=1, seconds=0.0),
    Outcome(buffer_state=UNSPECIFIED, algorithm="é-unicode", chunks=(1 << 32) - 1, seconds=-0.0),
    Outcome(MismatchError("nodes disagree on count"), UNSPECIFIED),
    Outcome(CollectiveTimeoutError("rank 3 did not arrive"), PARTIAL, "ring", 3, 2.5),
]


@pytest.mark.parametrize(("rid", "outcome"), list(itertools.product(_IDS, _OUTCOMES)))
def test_the_joined_bytes_parse_to_the_built_reply(rid: int, outcome: Outcome) -> None:
    built = replies.result(rid, outcome)
    parsed = pb.SessionResponse.FromString(replies.result_bytes(rid, outcome))
    assert parsed == built
    assert parsed.WhichOneof("body") == "result"
    assert parsed.result.response.seconds == outcome.seconds  # the one field joined last


def test_a_success_is_not_serialized_through_the_message() -> None:
    """The point of it: a success is joined from cached parts (a failure is rare and goes
    through the message)."""
    replies.result_bytes(1, Outcome(algorithm="tree", chunks=1, seconds=0.5))
    before = replies._success.cache_info().hits
    replies.result_bytes(2, Outcome(algorithm="tree", chunks=1, seconds=0.25))
    assert replies._success.cache_info().hits == before + 1
