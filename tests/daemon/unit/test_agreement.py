"""The agreement's pure parts: the binomial tree, the message frame and the judge.
(The protocol itself runs across real daemons: tests/daemon/test_daemon_multinode.py.)"""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

from lpsync.daemon.collectives.agreement import (
    SUMMARY_BYTES,
    Tree,
    _judged,
    _shape,
    decode,
    encode,
    judge,
)
from lpsync.daemon.collectives.small import SMALL_MAX_BYTES
from lpsync.daemon.values import Later


def _depth(tree: Tree, node: int) -> int:
    return 0 if node == 0 else 1 + _depth(tree, tree.parent(node))


@pytest.mark.parametrize("radix", [2, 3, 4, 1000])
@pytest.mark.parametrize("nodes", [*range(1, 18), 31, 32, 33, 100])
def test_tree_covers_every_node_once_with_contiguous_subtrees(nodes: int, radix: int) -> None:
    tree = Tree(nodes, radix)
    seen = {0}
    for node in range(nodes):
        kids = tree.children(node)
        assert kids == sorted(kids)
        assert len(kids) <= (radix - 1) * max(1, math.ceil(math.log(max(nodes, 2), radix)))
        for kid in kids:
            assert tree.parent(kid) == node
            seen.add(kid)
        # A subtree is the node then its children's subtrees, end to end.
        end = node + 1
        for kid in kids:
            assert kid == end
            end += tree.subtree(kid)
        assert end == node + tree.subtree(node)
    assert seen == set(range(nodes))
    # Hops from node 0: at most ceil(log_radix P); a flat tree is one hop deep.
    depth = max(_depth(tree, node) for node in range(nodes))
    assert depth <= math.ceil(math.log(max(nodes, 2), radix) - 1e-9)
    assert depth == (nodes > 1) if radix >= nodes else depth >= 1 or nodes == 1


@pytest.mark.parametrize("radix", [2, 8])
@pytest.mark.parametrize("nodes", [3, 8, 13])
def test_a_nodes_cached_shape_is_its_place_in_the_tree(nodes: int, radix: int) -> None:
    tree = Tree(nodes, radix)
    for node in range(nodes):
        shape = _shape(nodes, radix, node)
        assert list(shape.kids) == tree.children(node)
        assert shape.parent == (tree.parent(node) if node else -1)
        # A kid's message may carry its whole subtree's summaries.
        assert [(b - SMALL_MAX_BYTES) // SUMMARY_BYTES for b in shape.kid_bytes] == [
            tree.subtree(k) for k in shape.kids
        ]
        # Not heard from: the rest of the subtree, kid by kid, then no one.
        expected, left = [], list(range(node + 1, node + tree.subtree(node)))
        for kid in tree.children(node):
            expected.append(tuple(left))
            left = [n for n in left if not kid <= n < kid + tree.subtree(kid)]
        assert list(shape.waiting) == [*expected, ()]


def test_frame_round_trips_header_and_payload() -> None:
    payload = np.arange(7, dtype=np.float64)
    message = encode({"summaries": [{"node": 3}]}, payload)
    buf = np.zeros(message.nbytes + 100, np.uint8)  # a receive buffer larger than the message
    buf[: message.nbytes] = message
    header, data = decode(buf)
    assert header == {"summaries": [{"node": 3}]}
    np.testing.assert_array_equal(data.view(np.float64), payload)
    header, data = decode(encode({"verdict": {}}))
    assert header == {"verdict": {}} and data.size == 0


def test_a_frame_longer_than_its_buffer_is_refused() -> None:
    message = encode({"x": 1}, np.zeros(10, np.uint8))
    with pytest.raises(ValueError):
        decode(message[:-3])


def _summary(node: int, **spec) -> dict:
    base = {
        "op": "allreduce",
        "dtype": "float32",
        "count": 4,
        "root": 0,
        "reduce_op": "sum",
        "algorithm": "",
        "name": "",
    }
    return {
        "node": node,
        "ranks": f"ranks {2 * node}-{2 * node + 1}",
        "spec": {**base, **spec},
        "alpha": 1e-4 * (node + 1),
        "beta": 1e-8 / (node + 1),
    }


def test_judge_takes_the_slowest_link_when_all_agree() -> None:
    verdict = judge([_summary(n) for n in (2, 0, 1)], 5, "job")
    assert verdict == {"alpha": pytest.approx(3e-4), "beta": pytest.approx(1e-8)}


def _message(*summaries: dict) -> bytes:
    return json.dumps({"summaries": list(summaries)}).encode()


def test_node_0_judges_a_repeated_set_of_summaries_once_and_a_mismatch_every_time() -> None:
    # A job repeats its collectives: the same summary messages come call after call.
    raws = (_message(_summary(0)), _message(_summary(1), _summary(2)))
    judged = _judged(raws)
    assert judged is not None
    verdict, header, applied = judged
    assert verdict == judge([_summary(n) for n in range(3)], 9, "job")
    assert json.loads(header) == {"verdict": verdict}
    assert applied.model.alpha == verdict["alpha"] and applied.result is None
    assert _judged(raws) is judged  # not judged again
    # A mismatch is never taken from the cache: its message names the collective.
    assert _judged((_message(_summary(0)), _message(_summary(1, count=8)))) is None


def test_judge_names_fields_nodes_and_ranks_of_a_mismatch() -> None:
    verdict = judge([_summary(0), _summary(1, count=8), _summary(2, dtype="int32")], 7, "j")
    code, message = verdict["error"]
    assert code == "INVALID_ARGUMENT"
    assert "count, dtype" in message and "#7" in message
    assert "node 1 (ranks 2-3)=8" in message and "node 2 (ranks 4-5)='int32'" in message


def test_judge_names_the_daemons_of_a_job_on_any_nodes() -> None:
    # A job on daemons 3 and 5 numbers them 0 and 1 (NodeLayout.cluster); messages say 3 and 5.
    verdict = judge([_summary(0), _summary(1, count=8)], 2, "j", (3, 5).__getitem__)
    _, message = verdict["error"]
    assert "node 3 (ranks 0-1)" in message and "node 5 (ranks 2-3)=8" in message, message


def test_judge_reports_the_lowest_failed_node() -> None:
    failed = [
        _summary(0),
        {"node": 2, "ranks": "ranks 4-5", "error": ["ABORTED", "two"]},
        {"node": 1, "ranks": "ranks 2-3", "error": ["DEADLINE_EXCEEDED", "one"]},
    ]
    code, message = judge(failed, 1, "j")["error"]
    assert code == "DEADLINE_EXCEEDED" and message.endswith("one")


def test_judge_runs_hierarchically_only_when_every_node_offers_a_sane_segment() -> None:
    """Each node on device buffers offers its segment ("device"); the verdict carries the
    smallest. A node without an offer (host buffers), or an offer that is no whole number
    of bytes in range (a peer's bytes are input), keeps every node on the flat path."""

    def offering(node: int, device: object) -> dict:
        return {**_summary(node), "device": device}

    assert judge([offering(0, 1 << 20), offering(1, 1 << 16)], 1, "j")["device"] == 1 << 16
    assert "device" not in judge([offering(0, 1 << 20), _summary(1)], 1, "j")
    for bad in ("1048576", 1.5e6, -4096, 0, 1 << 50, None, [4096]):
        assert "device" not in judge([offering(0, 1 << 20), offering(1, bad)], 1, "j"), bad


def test_a_later_is_set_once_and_calls_its_callback_on_the_setting_thread() -> None:
    later: Later[int] = Later()
    seen: list[tuple[int, str]] = []
    later.then(lambda v: seen.append((v, threading.current_thread().name)))
    setter = threading.Thread(target=lambda: later.set(7), name="reader")
    setter.start()
    setter.join()
    assert seen == [(7, "reader")]
    assert later.set(8) is False  # the first value stays
    after: list[int] = []
    later.then(after.append)  # set already: called at once, with the first value
    assert after == [7] and seen == [(7, "reader")]
