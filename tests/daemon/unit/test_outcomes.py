"""The outcomes table that nodes tell each other on every new mesh (outcomes.py): merged
views, splits, bounds and bad input. (Across real daemons and a real cut:
tests/daemon/test_partitions.py.)"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lpsync.daemon.collectives import agreement, outcomes
from lpsync.daemon.collectives.outcomes import Outcomes, describe

NODES = (0, 1, 2)


def _told(table: Outcomes) -> np.ndarray:
    """The message as a receiver's buffer holds it: MAX_BYTES, zero-filled past the end."""
    message = table.message()
    buf = np.zeros(table.max_bytes, np.uint8)
    buf[: message.nbytes] = message
    return buf


def _views(tables: list[Outcomes]) -> list[list[tuple[str, int, dict[int, str]]]]:
    return [[(a.job, a.sequence, a.codes) for a in t.failed()] for t in tables]


def test_after_an_exchange_every_node_names_each_nodes_outcome_and_the_split(caplog) -> None:
    tables = [Outcomes(n) for n in NODES]
    # #7 finished on nodes 0 and 2 and failed on node 1 (cut while the data moved);
    # #8 failed on 0 and 2 (the mesh was down), node 1's ranks never issued it.
    for n, t in enumerate(tables):
        t.ran("train", 6, NODES, "OK")
        t.ran("train", 7, NODES, "UNAVAILABLE" if n == 1 else "OK")
        if n != 1:
            t.ran("train", 8, NODES, "UNAVAILABLE")
    assert [a.sequence for a in tables[0].failed()] == [8]  # before: node 0 knows its own only
    with caplog.at_level(logging.WARNING, "lpsync.daemon"):
        for me, t in enumerate(tables):
            t.heard({other: _told(o) for other, o in enumerate(tables) if other != me})
    views = _views(tables)
    assert views[0] == views[1] == views[2]
    assert views[0] == [
        ("train", 7, {0: "OK", 1: "UNAVAILABLE", 2: "OK"}),
        ("train", 8, {0: "UNAVAILABLE", 2: "UNAVAILABLE"}),
    ]
    seven, eight = tables[1].failed()
    assert seven.split() and not eight.split()
    assert seven.describe() == "OK on nodes 0, 2; UNAVAILABLE on node 1"
    assert eight.describe() == "UNAVAILABLE on nodes 0, 2; not heard from node 1"
    # Each node logs the split once, with every node's outcome.
    splits = [r.getMessage() for r in caplog.records if "finished on some nodes" in r.getMessage()]
    assert len(splits) == 3, splits
    assert all(
        "#7 of job 'train'" in m and m.endswith("OK on nodes 0, 2; UNAVAILABLE on node 1") for m in splits
    )


def test_a_node_tells_only_its_own_outcomes_and_only_of_jobs_it_is_in() -> None:
    a, b = Outcomes(0), Outcomes(1)
    b.ran("j", 1, (0, 1), "ABORTED")
    a.heard({1: _told(b)})
    # b tells again what it heard from a: nothing of a's; and a claim about a job b is
    # not in is ignored.
    a.ran("j", 1, (0, 1), "OK")
    b.heard({0: _told(a)})
    a.heard({1: _told(b)})
    assert [(x.sequence, x.codes) for x in a.failed()] == [(1, {0: "OK", 1: "ABORTED"})]
    stranger = agreement.encode({"outcomes": [["k", 3, [0, 2], "ABORTED"]]})
    a.heard({1: stranger})
    assert [x.job for x in a.failed()] == ["j"]


def test_a_restarted_job_of_the_same_name_starts_fresh_keys() -> None:
    a = Outcomes(0)
    a.ran("j", 1, (0, 1), "OK")
    a.heard({1: agreement.encode({"outcomes": [["j", 1, [0, 1], "UNAVAILABLE"]]})})
    assert a.failed()[0].split()
    a.ran("j", 1, (0, 1), "OK")  # sequence 1 again here: a new job of the same name
    assert a.failed() == []
    # Another layout under the same key is another job: not merged.
    a.heard({1: agreement.encode({"outcomes": [["j", 1, [1, 0], "UNAVAILABLE"]]})})
    assert a.failed() == []


@pytest.mark.parametrize(
    "message",
    [
        np.zeros(outcomes.MAX_BYTES, np.uint8),  # a peer that sent nothing readable
        agreement.encode(b"not json"),
        agreement.encode({"outcomes": [["j", "x", [0, 1], "OK"]]}),
        agreement.encode({"outcomes": [["j", 1]]}),
        agreement.encode({"something": 1}),
        np.frombuffer(b"\xff\xff\xff\x7f\x00\x00\x00\x00", np.uint8).copy(),  # a frame past the end
    ],
)
def test_an_unreadable_message_is_logged_and_ignored(message: np.ndarray, caplog) -> None:
    a = Outcomes(0)
    a.ran("j", 1, (0, 1), "UNAVAILABLE")
    with caplog.at_level(logging.WARNING, "lpsync.daemon"):
        assert a.heard({1: message}) == []
    assert [x.codes for x in a.failed()] == [{0: "UNAVAILABLE"}]
    assert any("unreadable outcomes from node 1" in r.getMessage() for r in caplog.records)


def test_tables_and_messages_stay_bounded() -> None:
    a = Outcomes(0)
    long = "j" * 3000  # names near the summary's limit: 64 of them exceed MAX_BYTES
    for seq in range(outcomes.KEPT + 100):
        a.ran(long, seq, (0, 1), "UNAVAILABLE")
    message = a.message()
    assert message.nbytes <= outcomes.MAX_BYTES
    header, _ = agreement.decode(message)
    told = [s for _, s, _, _ in header["outcomes"]]
    # The newest ones, in order, as many as fit.
    last = outcomes.KEPT + 99
    assert 0 < len(told) <= outcomes.TOLD and told == list(range(last - len(told) + 1, last + 1))
    assert len(a.failed(limit=0)) == 0 and len(a.failed(limit=10_000)) == outcomes.KEPT


def test_describe_groups_nodes_by_code() -> None:
    assert describe((0, 1, 2, 3), {0: "OK", 1: "UNAVAILABLE", 3: "OK"}) == (
        "OK on nodes 0, 3; UNAVAILABLE on node 1; not heard from node 2"
    )
    assert describe((4, 5), {4: "", 5: "ABORTED"}) == "not heard from node 4; ABORTED on node 5"
