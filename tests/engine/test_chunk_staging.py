"""Chunk-wise staging of device spans across nodes (lpsync.engine.staging) on the emulated
device: every node runs its participants' plans over host mirrors while a ChunkStager per
participant copies chunks in and out on a stream; nodes talk over an inproc fabric of
nodes (tests/daemon/test_daemon_devices.py runs the same over real daemons and UCX)."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.engine.device_group import DeviceContext
from lpsync.engine.group import LocalGroup, layout
from lpsync.engine.routing import Placement
from lpsync.engine.staging import ChunkStager, HostMirrors, _add, _subtract
from lpsync.errors import AbortedError, CollectiveTimeoutError
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span
from lpsync.reduction import Reduction
from lpsync.transport.inproc import InprocFabric
from lpsync.types import Collective, ReduceOp
from tests.collective_cases import (
    OPS_ALGS,
    REDUCING,
    assert_matches,
    in_place_buffer,
    make_inputs,
    out_elements,
    reference,
)
from tests.cuda_contract import write_landed


class CountingKind(EmulatedKind):
    """Logs every staging copy: (direction, bytes, when it finished on its stream)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, int, float]] = []
        self.log_lock = threading.Lock()

    def copy_async(self, dst: Span, src: Span, stream) -> None:
        super().copy_async(dst, src, stream)
        direction = "d2h" if dst.device < 0 else "h2d" if src.device < 0 else "d2d"

        def landed() -> None:
            with self.log_lock:
                self.log.append((direction, dst.nbytes, time.monotonic()))

        stream.put(landed)


class LoggingEndpoint:
    """A node-level endpoint that notes when each remote send starts."""

    def __init__(self, inner, log: list) -> None:
        self._inner, self._log = inner, log
        self.rank, self.size = inner.rank, inner.size

    def send(self, peer, tag, data):
        self._log.append(time.monotonic())
        return self._inner.send(peer, tag, data)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def run_staged(
    kind: EmulatedKind,
    op: Collective,
    algorithm: str,
    per_node: tuple[int, ...],
    count: int,
    dtype,
    reduce_op: ReduceOp,
    in_place: bool,
    root: int = 0,
    chunks: int = 4,
    runs: int = 2,
    timeout: float = 30.0,
    absent_node: int | None = None,
):
    p = sum(per_node)
    schedule = generate(op, algorithm, p, count, root, chunks)
    rng = np.random.default_rng(p * 97 + count)
    inputs = make_inputs(op, p, count, np.dtype(dtype), reduce_op, rng)
    reduction = Reduction(reduce_op, np.dtype(dtype), p) if op in REDUCING else None
    context = DeviceContext(kind)
    network = InprocFabric(len(per_node))
    sends: list[float] = []
    spans, firsts = [], []
    for r, x in enumerate(inputs):  # each rank's buffers on device r % devices
        first = in_place_buffer(op, r, p, count, x) if in_place else x
        memory = kind.allocate(r % kind.devices, first.nbytes)
        data = Span(memory, 0, first.size, first.dtype)
        write_landed(kind, data, first)
        firsts.append(first)
        out = None
        if not in_place:
            n = out_elements(op, p, count)
            out = Span(kind.allocate(r % kind.devices, n * first.dtype.itemsize), 0, n, first.dtype)
            write_landed(kind, out, np.zeros(n, first.dtype))
        spans.append((data, out))
    errors: list[BaseException | None] = [None] * len(per_node)
    stagers_of: dict[int, list[ChunkStager]] = {}

    def node(n: int) -> None:
        placement = Placement.node_major(list(per_node), n)
        ranks = placement.local_ranks
        mirrors = HostMirrors(kind, [s for r in ranks for s in spans[r]])
        buffers = []
        for i, r in enumerate(ranks):
            data, out = mirrors.mirrors[2 * i], mirrors.mirrors[2 * i + 1]
            host = data.typed()
            buffers.append(layout(op, r, p, count, host, True) if out is None else (host, out.typed()))
        endpoint = LoggingEndpoint(network.endpoint(n), sends)
        try:
            with LocalGroup(schedule, buffers, reduction, placement, endpoint) as group:
                stagers = []
                for i, (plan, r) in enumerate(zip(group.plans, ranks, strict=True)):
                    mine = [m for m in mirrors.mirrors[2 * i : 2 * i + 2] if m is not None]
                    write_back = not (op is Collective.REDUCE and r != root)
                    stream = context.stream(spans[r][0].device, i, "stage")
                    plan.hooks = ChunkStager(kind, stream, plan, mine, write_back)
                    stagers.append(plan.hooks)
                stagers_of[n] = stagers
                for _ in range(runs):
                    for r in ranks:  # in place, a run overwrites its input: refill it
                        write_landed(kind, spans[r][0], firsts[r])
                    deadline = time.monotonic() + timeout
                    try:
                        for s in stagers:
                            s.start(deadline)
                        group.run(timeout, tag_base=5 << 24)
                        for s in stagers:
                            s.finish()
                    except BaseException:
                        for s in stagers:
                            s.drain(patience=30)
                        raise
        except BaseException as error:
            errors[n] = error
        finally:
            mirrors.close()

    threads = [threading.Thread(target=node, args=(n,)) for n in range(len(per_node)) if n != absent_node]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    assert not any(t.is_alive() for t in threads), "a node hung"
    results = [kind.read(out if out is not None else data) for data, out in spans]
    context.close()
    for data, out in spans:
        kind.free(data.memory)
        if out is not None:
            kind.free(out.memory)
    return inputs, results, errors, stagers_of, sends


def _check(op, reduce_op, inputs, results, root, count, in_place, what) -> None:
    p = len(inputs)
    want = reference(op, reduce_op, inputs, root, count)
    for r in range(p):
        got = results[r]
        if in_place and op is Collective.REDUCE_SCATTER:
            got = got[r * count : (r + 1) * count]
        if op is Collective.REDUCE and r != root:
            original = in_place_buffer(op, r, p, count, inputs[r]) if in_place else None
            if original is not None:  # a non-root's buffer of reduce is left as it was
                assert got.tobytes() == original.tobytes(), f"{what} rank {r} was written"
            continue
        assert_matches(got, want[r], f"{what} rank {r}")


CASES = [(op, alg) for op, alg in OPS_ALGS if alg in ("lp", "ring", "be")]


@pytest.mark.parametrize(("op", "algorithm"), CASES, ids=[f"{o}-{a}" for o, a in CASES])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "inplace"])
def test_every_op_across_nodes_from_device_spans(op, algorithm, in_place) -> None:
    kind = EmulatedKind(2)
    try:
        for dtype, reduce_op in (
            (np.float32, ReduceOp.SUM),
            (np.int64, ReduceOp.MAX),
            (ml_dtypes.bfloat16, ReduceOp.AVG),
            (np.float64, ReduceOp.PROD),
        ):
            if op not in REDUCING and reduce_op is not ReduceOp.SUM:
                reduce_op = ReduceOp.SUM
            root = 2 if op in (Collective.BROADCAST, Collective.REDUCE) else 0
            inputs, results, errors, _, _ = run_staged(
                kind, op, algorithm, (2, 1, 2), 301, dtype, reduce_op, in_place, root=root, chunks=3
            )
            assert errors == [None, None, None]
            _check(
                op,
                reduce_op,
                inputs,
                results,
                root,
                301,
                in_place,
                f"{op} {algorithm} {np.dtype(dtype)} {reduce_op}",
            )
    finally:
        kind.close_kind()


def test_chunks_are_copied_once_each_and_overlap_the_sends() -> None:
    """Every input byte crosses D2H exactly once per run, one chunk per copy; the first
    chunk goes on the wire long before the last one is off the device; the result goes back
    chunk by chunk (more than one H2D, every result byte once)."""
    count, chunks = 1 << 16, 8  # 256 KiB of float32 per rank, 32 KiB chunks
    kind = CountingKind(2, copy_bandwidth=1 << 20)  # 1 MiB/s: a chunk's copy takes ~30 ms
    try:
        inputs, results, errors, stagers, sends = run_staged(
            kind,
            Collective.ALLREDUCE,
            "lp",
            (1, 1),
            count,
            np.float32,
            ReduceOp.SUM,
            False,
            chunks=chunks,
            runs=1,
            timeout=60,
        )
        assert errors == [None, None]
        _check(Collective.ALLREDUCE, ReduceOp.SUM, inputs, results, 0, count, False, "allreduce")
        d2h = [(n, t) for d, n, t in kind.log if d == "d2h"]
        h2d = [(n, t) for d, n, t in kind.log if d == "h2d"]
        nbytes = count * 4
        assert sum(n for n, _ in d2h) == 2 * nbytes  # two ranks, each input once
        assert len(d2h) == 2 * chunks and all(n == nbytes // chunks for n, _ in d2h)
        assert sum(n for n, _ in h2d) == 2 * nbytes and len(h2d) >= 2 * chunks
        assert all(len(s.loads) == chunks for ss in stagers.values() for s in ss)
        last_d2h = max(t for _, t in d2h)
        assert min(sends) < last_d2h - 0.05, "the first chunk waited for the whole buffer"
        first_h2d = min(t for _, t in h2d)
        assert first_h2d < last_d2h + 0.2 or first_h2d < max(sends), (
            "results went back only after the pipeline ended"
        )
    finally:
        kind.close_kind()


def test_a_missing_node_times_out_and_the_streams_drain() -> None:
    before = set(threading.enumerate())
    kind = EmulatedKind(2)
    try:
        _, _, errors, stagers, _ = run_staged(
            kind,
            Collective.ALLREDUCE,
            "lp",
            (1, 1, 1),
            4096,
            np.float32,
            ReduceOp.SUM,
            False,
            runs=1,
            timeout=1.0,
            absent_node=2,
        )
        assert all(isinstance(e, (CollectiveTimeoutError, AbortedError)) for e in errors[:2])
        assert all(s._waited >= -1 for ss in stagers.values() for s in ss)
    finally:
        kind.close_kind()
    time.sleep(0.2)
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()], "threads leaked"


def test_interval_helpers_against_a_byte_map() -> None:
    rng = np.random.default_rng(3)
    covered: list[tuple[int, int]] = []
    seen = np.zeros(200, bool)
    for _ in range(300):
        lo = int(rng.integers(0, 199))
        hi = int(rng.integers(lo + 1, 200))
        pieces = _subtract(lo, hi, covered)
        mask = np.zeros(200, bool)
        for a, b in pieces:
            assert not mask[a:b].any()
            mask[a:b] = True
        want = np.zeros(200, bool)
        want[lo:hi] = ~seen[lo:hi]
        assert (mask == want).all()
        _add(lo, hi, covered)
        seen[lo:hi] = True
        assert all(a < b for a, b in covered)
        assert all(covered[i][1] < covered[i + 1][0] for i in range(len(covered) - 1))


def test_mirrors_are_kept_per_buffer_set_and_freed_once_idle() -> None:
    """GroupCache keeps the mirrors of the last 8 buffer sets of a job; eviction, a released
    buffer (forget) and the job's end close them; a run in progress defers the free."""
    from lpsync.daemon.collectives.plans import GroupCache

    freed: list[int] = []

    class Kind(EmulatedKind):
        def free(self, memory) -> None:
            freed.append(memory.nbytes)
            super().free(memory)

    kind = Kind(1)
    span = Span(kind.allocate(0, 64), 0, 16, np.dtype(np.float32))
    cache = GroupCache()
    made = [cache.mirrors(((i,), (("s", i),)), lambda: HostMirrors(kind, [span, None])) for i in range(9)]
    assert len({m.serial for m in made}) == 9
    assert freed == [64]  # the oldest was evicted
    assert cache.mirrors(((8,), (("s", 8),)), lambda: None) is made[8]  # reused
    made[5].acquire()  # a run is using it
    cache.forget("s", 5)
    assert freed == [64] and made[5].mirrors  # deferred
    made[5].release()
    assert freed == [64, 64] and not made[5].mirrors
    cache.close()
    assert len(freed) == 9
    kind.free(span.memory)
