"""lpsync_client.layout without daemons: the exchange through a store and the verdict every
rank reaches from the same table (tests/daemon/test_layout.py runs it with real daemons)."""

from __future__ import annotations

import threading

import pytest

from lpsync_client.errors import InvalidArgumentError, UnavailableError
from lpsync_client.layout import Hints, Node, discover, exchange, judge


def _entry(node: int, nodes: int = 2, cluster: str = "peers-a", hints: tuple[int, int] = (0, 0)) -> dict:
    return {
        "node": node,
        "nodes": nodes,
        "cluster": cluster,
        "local_rank": hints[0],
        "local_world_size": hints[1],
    }


class DictStore:
    """A store of one process, for threads: get waits until the key is set."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.changed = threading.Condition()
        self.gets = 0

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.data[key] = value
            self.changed.notify_all()

    def get(self, key: str) -> bytes:
        with self.changed:
            self.gets += 1
            assert self.changed.wait_for(lambda: key in self.data, timeout=10), key
            return self.data[key]


def _run_ranks(nodes: list[Node | Exception], hints: list[Hints] | None = None) -> list[object]:
    store, out = DictStore(), [None] * len(nodes)

    def rank(r: int) -> None:
        def ask() -> Node:
            answer = nodes[r]
            if isinstance(answer, Exception):
                raise answer
            return answer

        try:
            out[r] = discover(
                store, "lpsync/layout/j", "j", r, len(nodes), ask, (hints or [Hints()] * len(nodes))[r]
            )
        except Exception as error:
            out[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_every_rank_learns_the_same_map_of_any_shape() -> None:
    a = [Node(1, 2, "peers-a"), Node(0, 2, "peers-a"), Node(0, 2, "peers-a"), Node(0, 2, "peers-a")]
    assert _run_ranks(a) == [[1, 0, 0, 0]] * 4


def test_a_rank_whose_daemon_does_not_answer_fails_every_rank() -> None:
    out = _run_ranks([Node(0, 2, "peers-a"), UnavailableError("no lpsync daemon answers at /x.sock")])
    assert isinstance(out[1], UnavailableError) and "/x.sock" in str(out[1])
    assert isinstance(out[0], UnavailableError), out[0]
    assert "rank 1 could not ask its daemon which node it is: no lpsync daemon answers at /x.sock" in str(
        out[0]
    )


def test_rank_0_gathers_with_one_multi_get_where_the_store_has_it() -> None:
    class Multi(DictStore):
        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [self.data[k] for k in keys]

    store = Multi()
    store.set("p/1", b'{"node": 1}')
    table = exchange(store, "p", 0, 2, {"node": 0})
    assert table == [{"node": 0}, {"node": 1}] and store.gets == 0


@pytest.mark.parametrize(
    ("table", "words"),
    [
        (
            [_entry(0, 1, "host-a/1"), _entry(0, 1, "host-b/2")],
            [
                "2 different clusters",
                "rank 0 on node 0 of 1 of cluster host-a/1 (no peers)",
                "rank 1",
                "not peers",
            ],
        ),
        (
            [_entry(0, hints=(0, 2)), _entry(1, hints=(1, 2))],
            [
                "rank 0 has LOCAL_WORLD_SIZE=2, LOCAL_RANK=0, but node 0 serves rank 0 (so 1 and 0)",
                "rank 1 has LOCAL_WORLD_SIZE=2, LOCAL_RANK=1, but node 1 serves rank 1 (so 1 and 0)",
                "node 0: rank 0; node 1: rank 1",
            ],
        ),
        (
            # not node-major; hints as if it were
            [
                _entry(0, hints=(0, 2)),
                _entry(1, hints=(1, 2)),
                _entry(0, hints=(0, 2)),
                _entry(1, hints=(1, 2)),
            ],
            ["rank 1 has LOCAL_WORLD_SIZE=2, LOCAL_RANK=1, but node 1 serves ranks 1, 3 (so 2 and 0)"],
        ),
    ],
)
def test_contradictions_name_ranks_nodes_and_variables(table, words) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        judge(table, "j")
    for word in words:
        assert word in str(error.value), str(error.value)


def test_hints_that_agree_and_layouts_that_fit_are_accepted() -> None:
    table = [
        _entry(0, hints=(0, 3)),
        _entry(0, hints=(1, 3)),
        _entry(1, hints=(0, 1)),
        _entry(0, hints=(2, 3)),
    ]
    assert judge(table, "j") == [0, 0, 1, 0]
    assert judge([_entry(1, 3), _entry(1, 3)], "j") == [1, 1]  # one node, whichever
    assert judge([_entry(0, 3), _entry(2, 3)], "j") == [0, 2]  # any daemons (NodeLayout.cluster)
