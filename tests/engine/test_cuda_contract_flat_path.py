"""The flat path of a multi-node job whose nodes mix host and device buffers (second
reading, "the mixed host/device flat path mirrors whole buffers"), on the emulated device:
every participant runs its part of the one pipeline on its own device spans through
BouncedBuffers (lpsync.engine.buffers: a few pinned slots for what travels), instead of
host mirrors as large as its buffers. Nodes talk over an inproc fabric of nodes that
posts receives ahead (a network's behaviour), local peers lend their bytes."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.engine.buffers import BouncedBuffers
from lpsync.engine.device_group import DeviceContext
from lpsync.engine.group import LocalGroup, layout
from lpsync.engine.routing import Placement
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
from tests.engine.test_executor_posting import PostingInproc


class CountingKind(EmulatedKind):
    """Counts pinned host memory allocated (cudaHostAlloc's) and what each copy moves."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host_bytes = 0
        self.copies: dict[str, int] = {"d2h": 0, "h2d": 0, "d2d": 0}
        self._count = threading.Lock()

    def allocate_host(self, nbytes: int, device: int | None = None):
        with self._count:
            self.host_bytes += nbytes
        return super().allocate_host(nbytes, device)

    def copy_async(self, dst: Span, src: Span, stream) -> None:
        direction = "d2h" if dst.device < 0 else "h2d" if src.device < 0 else "d2d"
        with self._count:
            self.copies[direction] += dst.nbytes
        super().copy_async(dst, src, stream)


def run_flat(
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
    budget: int = 8 << 20,
):
    """Every node's participants on device spans, one pipeline over the nodes; returns
    (inputs, results, errors per node, the largest message in bytes)."""
    p = sum(per_node)
    schedule = generate(op, algorithm, p, count, root, chunks)
    rng = np.random.default_rng(p * 97 + count)
    inputs = make_inputs(op, p, count, np.dtype(dtype), reduce_op, rng)
    reduction = Reduction(reduce_op, np.dtype(dtype), p) if op in REDUCING else None
    context = DeviceContext(kind)
    network = InprocFabric(len(per_node))
    spans, firsts = [], []
    for r, x in enumerate(inputs):  # each rank's buffers on device r % devices
        first = in_place_buffer(op, r, p, count, x) if in_place else x
        data = Span(kind.allocate(r % kind.devices, first.nbytes), 0, first.size, first.dtype)
        write_landed(kind, data, first)
        firsts.append(first)
        out = None
        if not in_place:
            n = out_elements(op, p, count)
            out = Span(kind.allocate(r % kind.devices, n * first.dtype.itemsize), 0, n, first.dtype)
            write_landed(kind, out, np.zeros(n, first.dtype))
        spans.append((data, out))
    errors: list[BaseException | None] = [None] * len(per_node)

    def node(n: int) -> None:
        placement = Placement.node_major(list(per_node), n)
        ranks = placement.local_ranks
        views = [
            layout(op, r, p, count, spans[r][0], True) if spans[r][1] is None else spans[r] for r in ranks
        ]
        devices = [spans[r][0].device for r in ranks]
        memory = [
            BouncedBuffers(kind, d, kind.stream(d), kind.event(d), context.pool, budget) for d in devices
        ]
        try:
            with LocalGroup(
                schedule, views, reduction, placement, PostingInproc(network, n), memory
            ) as group:
                for _ in range(runs):
                    for r in ranks:  # in place, a run overwrites its input: refill it
                        write_landed(kind, spans[r][0], firsts[r])
                    try:
                        group.run(timeout, tag_base=5 << 24)
                    except BaseException:
                        for m in memory:
                            m.drain(patience=30)
                        raise
        except BaseException as error:
            errors[n] = error
        finally:
            for m in memory:
                m.close()
                kind.destroy_stream(m.stream)

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
    itemsize = np.dtype(dtype).itemsize
    largest = max(hi - lo for r in range(p) for _, _, _, lo, hi, *_ in schedule.program(r)) * itemsize
    return inputs, results, errors, largest


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
@pytest.mark.parametrize("budget", [8 << 20, 1], ids=["roomy", "one-slot-each"])
def test_cuda_contract_every_op_crosses_nodes_from_device_spans(op, algorithm, in_place, budget) -> None:
    """Against numpy; with one receive slot and one send slot per participant too (a send
    then waits for the previous one: no schedule may deadlock on it)."""
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
            inputs, results, errors, _ = run_flat(
                kind,
                op,
                algorithm,
                (2, 1, 2),
                301,
                dtype,
                reduce_op,
                in_place,
                root=root,
                chunks=3,
                budget=budget,
            )
            assert errors == [None, None, None]
            what = f"{op} {algorithm} {np.dtype(dtype)} {reduce_op}"
            _check(op, reduce_op, inputs, results, root, 301, in_place, what)
    finally:
        kind.close_kind()


def test_cuda_contract_the_flat_path_holds_slots_not_buffers() -> None:
    """4 MiB float32 per rank, two nodes of two ranks, 32 chunks: each participant's
    pinned host memory is its receive window and send slots, within its budget (1 MiB
    here) in slots of the largest message, where host mirrors took both of its buffers
    whole (8 MiB); every byte sent still leaves the device once. A budget below two
    messages still runs, one receive slot and one send slot each."""
    count, chunks, runs = 1 << 20, 32, 2
    for budget in (1 << 20, 1):
        kind = CountingKind(2)
        try:
            inputs, results, errors, largest = run_flat(
                kind,
                Collective.ALLREDUCE,
                "ring",
                (2, 2),
                count,
                np.float32,
                ReduceOp.SUM,
                False,
                chunks=chunks,
                runs=runs,
                budget=budget,
            )
            assert errors == [None, None]
            _check(Collective.ALLREDUCE, ReduceOp.SUM, inputs, results, 0, count, False, "allreduce")
            buffer, per_participant = count * 4, kind.host_bytes / 4
            slot = 1 << max(12, (largest - 1).bit_length())  # the staging pool's size classes
            assert per_participant <= max(2 * budget, 2 * slot), f"{per_participant} bytes"
            assert per_participant <= 2 * buffer / 16
            assert kind.copies["d2h"] == runs * 4 * buffer * 3 // 2  # ring: 2(P-1)/P of it sent
        finally:
            kind.close_kind()


def test_cuda_contract_a_missing_node_times_out_and_nothing_leaks() -> None:
    before = set(threading.enumerate())
    kind = EmulatedKind(2)
    try:
        _, _, errors, _ = run_flat(
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
    finally:
        kind.close_kind()
    deadline = time.monotonic() + 5
    while [t for t in set(threading.enumerate()) - before if t.is_alive()] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()], "threads leaked"
