"""The torch backend's one piece runner (lpsync_client/torch/_runner.py) under every op of
the process group, against numpy, without a daemon: P ranks in threads of this process,
each a ProcessGroupLpsync over a stand-in client whose collectives meet in memory (the
k-th collective of every rank is one; computed with numpy once all have come). The
staging budget is cut small, so every call runs as several pieces of uneven sizes, and
more pieces than PIECES_IN_FLIGHT."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from lpsync_client.errors import AbortedError, ResourceExhaustedError  # noqa: E402
from lpsync_client.torch._pieces import buffer_limit  # noqa: E402
from lpsync_client.torch.backend import ProcessGroupLpsync  # noqa: E402

P = 3
WAIT = 30.0  # seconds any rank waits for the others: a bug fails, never hangs
_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


class _World:
    """Where the stand-in clients' calls meet: collectives by issue order, messages by
    (source, destination, tag) in order."""

    def __init__(self, size: int, limit: int | None = None) -> None:
        self.size, self.limit = size, limit  # limit: the buffer bytes the "daemon" accepts
        self._lock = threading.Lock()
        self._calls: list[list[tuple[str, Any, dict, Future]]] = [[] for _ in range(size)]
        self._messages: dict[tuple[int, int, int], deque] = defaultdict(deque)
        self.pieces: list[tuple[int, str, int]] = []  # (rank, op, staged elements)

    def collective(self, rank: int, kind: str, x: Any, **kw: Any) -> Future:
        future: Future = Future()
        with self._lock:
            self._calls[rank].append((kind, x, kw, future))
            self.pieces.append((rank, kind, 0 if x is None else len(x)))
            k = len(self._calls[rank]) - 1
            if not all(len(calls) > k for calls in self._calls):
                return future
            met = [calls[k] for calls in self._calls]
        assert len({kind for kind, *_ in met}) == 1, f"ranks disagree on collective {k}: {met}"
        _compute(kind, [x for _, x, _, _ in met], [kw for _, _, kw, _ in met])
        for *_, f in met:
            f.set_result(None)
        return future

    def message(self, src: int, dst: int, tag: int, x: Any, sending: bool) -> Future:
        future: Future = Future()
        with self._lock:
            waiting = self._messages[(src, dst, tag)]
            if waiting and waiting[0][2] != sending:  # the other side is there: meet
                other, other_future, _ = waiting.popleft()
            else:
                waiting.append((x, future, sending))
                return future
        sent, received = (x, other) if sending else (other, x)
        assert len(sent) == len(received), "the two sides cut the message differently"
        received[:] = sent
        other_future.set_result(None)
        future.set_result(None)
        return future


def _compute(op: str, xs: list, kws: list[dict]) -> None:
    """Collective ``op`` over every rank's staging ``xs``, as the client's contract says."""
    p = len(xs)
    if op == "barrier":
        return
    reduce = _REDUCE.get(kws[0].get("op", "sum"))
    if op == "allreduce":
        total = reduce(np.stack(xs), axis=0)
        for x in xs:
            x[:] = total
    elif op == "broadcast":
        root = kws[0]["root"]
        for x in xs:
            x[:] = xs[root]
    elif op == "reduce":
        root = kws[0]["root"]
        xs[root][:] = reduce(np.stack(xs), axis=0)
    elif op == "allgather":  # in place: rank r's block at r*m
        m = len(xs[0]) // p
        whole = np.concatenate([x[r * m : (r + 1) * m] for r, x in enumerate(xs)])
        for x in xs:
            x[:] = whole
    elif op == "reduce_scatter":  # in place: rank r keeps block r of the reduction
        m = len(xs[0]) // p
        total = reduce(np.stack(xs), axis=0)
        for r, x in enumerate(xs):
            x[r * m : (r + 1) * m] = total[r * m : (r + 1) * m]
    elif op == "gather":  # the root's x holds p blocks, the others' one
        root = kws[0]["root"]
        m = len(xs[root]) // p
        for r, x in enumerate(xs):
            if r != root:
                xs[root][r * m : (r + 1) * m] = x
    elif op == "scatter":  # the others receive their block into x
        root = kws[0]["root"]
        m = len(xs[root]) // p
        for r, x in enumerate(xs):
            if r != root:
                x[:] = xs[root][r * m : (r + 1) * m]
    elif op == "alltoall":
        outs = [kw["out"] for kw in kws]
        m = len(xs[0]) // p
        for r, out in enumerate(outs):
            for i, x in enumerate(xs):
                out[i * m : (i + 1) * m] = x[r * m : (r + 1) * m]
    else:
        raise AssertionError(f"no such collective {op}")


class _Client:
    """What ProcessGroupLpsync asks of its client, for host tensors: shared memory is
    plain memory here, and every collective goes to the world."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.job = world, rank, "pieces"
        self.released = 0

    def empty(self, nbytes: int, dtype: str) -> np.ndarray:
        limit = self.world.limit
        if limit is not None and nbytes > limit:  # the daemon's words (lpsync_client.torch._pieces)
            raise ResourceExhaustedError(
                f"{nbytes} bytes exceeds the daemon's limit of {limit} bytes (--max-buffer-bytes)"
            )
        return np.empty(max(nbytes, 8), np.uint8)[:nbytes]  # a slice of its mapping, as the client's

    def release(self, array: Any) -> None:
        self.released += 1

    def answer_next_here(self, on: bool = True) -> None:
        pass

    def _async(op: str) -> Callable[..., Future]:  # (a method factory)
        def start(self: _Client, x: Any, **kw: Any) -> Future:
            kw.pop("timeout", None)
            return self.world.collective(self.rank, op, x, **kw)

        return start

    allreduce_async = _async("allreduce")
    broadcast_async = _async("broadcast")
    reduce_async = _async("reduce")
    allgather_async = _async("allgather")
    reduce_scatter_async = _async("reduce_scatter")
    gather_async = _async("gather")
    scatter_async = _async("scatter")
    alltoall_async = _async("alltoall")

    def barrier_async(self, timeout: float | None = None) -> Future:
        return self.world.collective(self.rank, "barrier", None)

    def allreduce(self, x: Any, op: str = "sum", timeout: float | None = None) -> Any:
        self.allreduce_async(x, op=op).result(WAIT)
        return x

    def send_async(self, x: Any, dst: int, tag: int = 0, timeout: float | None = None) -> Future:
        return self.world.message(self.rank, dst, tag, x, sending=True)

    def recv_async(self, x: Any, src: int, tag: int = 0, timeout: float | None = None) -> Future:
        return self.world.message(src, self.rank, tag, x, sending=False)


def _on_every_rank(call: Callable[[ProcessGroupLpsync, int], Any], world: _World, staging: int) -> list:
    """``call(group, rank)`` on P threads, one group each; their results by rank."""
    groups = []
    for rank in range(world.size):
        pg = ProcessGroupLpsync(_Client(world, rank), rank, world.size, WAIT)  # type: ignore[arg-type]
        pg._runner.staging_bytes = staging
        groups.append(pg)
    results: list[Any] = [None] * world.size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = call(groups[rank], rank)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def _data(rank: int, n: int, salt: int = 0) -> torch.Tensor:
    """Distinct values per rank, element and salt (exact in float64)."""
    return torch.arange(n, dtype=torch.float64) * 10 + rank * 1000 + salt * 100000


def _opts(kind: Any, **fields: Any) -> Any:
    opts = kind()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


# float64 staging of 144 bytes: pieces of 18 elements (one block), 6 (P blocks), 3 (2P).
STAGING = 8 * 2 * P * 3


def _pieces(world: _World, op: str, rank: int = 0) -> list[int]:
    """The staged elements of each of ``rank``'s collectives ``op``, in issue order."""
    return [n for r, o, n in world.pieces if o == op and r == rank]


def test_allreduce_and_coalesced_tensors_of_uneven_sizes_across_pieces() -> None:
    world = _World(P)
    sizes = [7, 40, 1, 13]  # 61 elements: pieces 18, 18, 18, 7, cutting across tensors

    def call(pg: ProcessGroupLpsync, rank: int) -> list[torch.Tensor]:
        tensors = [_data(rank, n, i) for i, n in enumerate(sizes)]
        pg.allreduce_coalesced(
            tensors, _opts(dist.AllreduceCoalescedOptions, reduceOp=dist.ReduceOp.SUM)
        ).wait()
        strided = _data(rank, 40).view(8, 5).t()  # not contiguous: copied back after the pieces
        pg.allreduce([strided], _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.MAX)).wait()
        return [*tensors, strided]

    results = _on_every_rank(call, world, STAGING)
    for i, n in enumerate(sizes):
        want = np.sum([_data(r, n, i).numpy() for r in range(P)], axis=0)
        for got in results:
            np.testing.assert_array_equal(got[i].numpy(), want)
    want = np.max([_data(r, 40).numpy().reshape(8, 5).T for r in range(P)], axis=0)
    for got in results:
        np.testing.assert_array_equal(got[-1].numpy(), want)
    assert _pieces(world, "allreduce") == [18, 18, 18, 7, 18, 18, 4]


@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_and_reduce(root: int) -> None:
    world = _World(P)

    def call(pg: ProcessGroupLpsync, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, r = _data(rank, 41), _data(rank, 41, 1)
        pg.broadcast([b], _opts(dist.BroadcastOptions, rootRank=root)).wait()
        pg.reduce([r], _opts(dist.ReduceOptions, rootRank=root, reduceOp=dist.ReduceOp.SUM)).wait()
        return b, r

    results = _on_every_rank(call, world, STAGING)
    total = np.sum([_data(r, 41, 1).numpy() for r in range(P)], axis=0)
    for rank, (b, r) in enumerate(results):
        np.testing.assert_array_equal(b.numpy(), _data(root, 41).numpy())
        # a non-root's reduce buffer is left as it was
        np.testing.assert_array_equal(r.numpy(), total if rank == root else _data(rank, 41, 1).numpy())
    assert _pieces(world, "broadcast") == [18, 18, 5]


def test_allgather_lists_and_into_one_tensor() -> None:
    world = _World(P)
    n = 13  # pieces of 6, 6, 1 elements per rank's block

    def call(pg: ProcessGroupLpsync, rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        outs = [torch.empty(n, dtype=torch.float64) for _ in range(P)]
        pg.allgather([outs], [_data(rank, n)]).wait()
        whole = torch.empty(P * n, dtype=torch.float64)
        pg._allgather_base(whole, _data(rank, n, 1)).wait()
        return outs, whole

    for outs, whole in _on_every_rank(call, world, STAGING):
        for r in range(P):
            np.testing.assert_array_equal(outs[r].numpy(), _data(r, n).numpy())
        np.testing.assert_array_equal(
            whole.numpy(), np.concatenate([_data(r, n, 1).numpy() for r in range(P)])
        )
    assert _pieces(world, "allgather") == [6 * P, 6 * P, P] * 2


def test_reduce_scatter_lists_and_from_one_tensor() -> None:
    world = _World(P)
    n = 13

    def call(pg: ProcessGroupLpsync, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = torch.empty(n, dtype=torch.float64)
        ins = [_data(rank, n, j) for j in range(P)]
        pg.reduce_scatter([mine], [ins], _opts(dist.ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)).wait()
        block = torch.empty(n, dtype=torch.float64)
        opts = _opts(dist.ReduceScatterOptions, reduceOp=dist.ReduceOp.MIN)
        pg._reduce_scatter_base(block, _data(rank, P * n), opts).wait()
        return mine, block

    for rank, (mine, block) in enumerate(_on_every_rank(call, world, STAGING)):
        np.testing.assert_array_equal(
            mine.numpy(), np.sum([_data(r, n, rank).numpy() for r in range(P)], axis=0)
        )
        lowest = np.min([_data(r, P * n).numpy() for r in range(P)], axis=0)
        np.testing.assert_array_equal(block.numpy(), lowest[rank * n : (rank + 1) * n])
    assert _pieces(world, "reduce_scatter") == [6 * P, 6 * P, P] * 2


@pytest.mark.parametrize("root", [0, 1])
def test_gather_and_scatter_cut_alike_at_the_root_and_elsewhere(root: int) -> None:
    world = _World(P)
    n = 13

    def call(pg: ProcessGroupLpsync, rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        outs = [torch.empty(n, dtype=torch.float64) for _ in range(P)] if rank == root else []
        pg.gather([outs], [_data(rank, n)], _opts(dist.GatherOptions, rootRank=root)).wait()
        mine = torch.empty(n, dtype=torch.float64)
        ins = [_data(rank, n, j) for j in range(P)] if rank == root else []
        pg.scatter([mine], [ins], _opts(dist.ScatterOptions, rootRank=root)).wait()
        return outs, mine

    for rank, (outs, mine) in enumerate(_on_every_rank(call, world, STAGING)):
        if rank == root:
            for r in range(P):
                np.testing.assert_array_equal(outs[r].numpy(), _data(r, n).numpy())
        np.testing.assert_array_equal(mine.numpy(), _data(root, n, rank).numpy())
    # the root stages P blocks, the others one: the same 6, 6, 1 cuts
    for rank in range(P):
        cuts = [6 * P, 6 * P, P] if rank == root else [6, 6, 1]
        assert _pieces(world, "gather", rank) == cuts


def test_alltoall_uneven_blocks_and_even_single() -> None:
    world = _World(P)

    def size(i: int, j: int) -> int:  # rank i sends rank j this many elements (one is 0)
        return (3 * i + 2 * j + 1) % 8

    def call(pg: ProcessGroupLpsync, rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        ins = [_data(rank, size(rank, j), j) for j in range(P)]
        outs = [torch.empty(size(i, rank), dtype=torch.float64) for i in range(P)]
        pg.alltoall(outs, ins).wait()
        whole = torch.empty(P * 7, dtype=torch.float64)
        pg.alltoall_base(whole, _data(rank, P * 7), [], []).wait()
        return outs, whole

    for rank, (outs, whole) in enumerate(_on_every_rank(call, world, STAGING)):
        for i in range(P):
            np.testing.assert_array_equal(outs[i].numpy(), _data(i, size(i, rank), rank).numpy())
        want = np.concatenate([_data(i, P * 7).numpy()[rank * 7 : (rank + 1) * 7] for i in range(P)])
        np.testing.assert_array_equal(whole.numpy(), want)
    # uneven: padded to the largest block (7), then 3, 3, 1 per block; even: 7 too (the
    # collective's x is the staging's first half: P blocks)
    assert [n // P for n in _pieces(world, "alltoall")] == [3, 3, 1] * 2


def test_send_and_recv_in_pieces_and_an_empty_message() -> None:
    world = _World(2)

    def call(pg: ProcessGroupLpsync, rank: int) -> list[torch.Tensor]:
        if rank == 0:
            pg.send([_data(0, 41)], 1, 5).wait()
            pg.send([torch.empty(0, dtype=torch.float64)], 1, 5).wait()
            return []
        got, empty = torch.empty(41, dtype=torch.float64), torch.empty(0, dtype=torch.float64)
        pg.recv([got], 0, 5).wait()
        pg.recv([empty], 0, 5).wait()
        return [got, empty]

    got, empty = _on_every_rank(call, world, STAGING)[1]
    np.testing.assert_array_equal(got.numpy(), _data(0, 41).numpy())
    assert empty.numel() == 0


def test_a_refused_first_piece_teaches_the_limit_and_is_cut_again() -> None:
    """The stand-in daemon refuses staging over 64 bytes: the first piece is cut again
    into 8-element pieces, and the result is still right."""
    world = _World(P, limit=64)

    def call(pg: ProcessGroupLpsync, rank: int) -> tuple[torch.Tensor, int | None]:
        t = _data(rank, 20)
        pg.allreduce([t], _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.SUM)).wait()
        return t, buffer_limit(pg.client)  # type: ignore[arg-type]

    want = np.sum([_data(r, 20).numpy() for r in range(P)], axis=0)
    for t, limit in _on_every_rank(call, world, 1 << 20):
        np.testing.assert_array_equal(t.numpy(), want)
        assert limit == 64
    assert _pieces(world, "allreduce") == [8, 8, 4]


def test_a_failed_piece_fails_the_work_and_issues_no_more() -> None:
    """A piece's collective fails: the work raises DistBackendError with its message, and
    the pieces after it are not issued."""
    world = _World(1)

    class Failing(_Client):
        def allreduce_async(self, x: Any, **kw: Any) -> Future:
            future: Future = Future()
            self.world.pieces.append((0, "allreduce", len(x)))
            future.set_exception(AbortedError("the job was aborted"))
            return future

    pg = ProcessGroupLpsync(Failing(world, 0), 0, 1, WAIT)  # type: ignore[arg-type]
    pg._runner.staging_bytes = 8
    work = pg.allreduce([torch.ones(100, dtype=torch.float64)], _opts(dist.AllreduceOptions))
    with pytest.raises(dist.DistBackendError, match="lpsync all_reduce failed: the job was aborted"):
        work.wait()
    # (its future failed at once: the next piece was never issued; 100 were to come)
    assert len(_pieces(world, "allreduce")) == 1
