"""The event simulator against the closed forms, the cost model and the tuner."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lpsync.algorithms import (
    LinkModel,
    algorithms_for,
    closed_form,
    generate,
    lp_chunks,
    select,
    simulate,
)
from lpsync.algorithms.cost import DEFAULT_MIN_CHUNK_BYTES
from lpsync.algorithms.schedule import Buf, ScheduleBuilder
from lpsync.algorithms.tuner import TIE_MARGIN, chunks_for
from lpsync.errors import SimulationError
from lpsync.types import DATA_COLLECTIVES
from tests.collective_cases import C

ITEMSIZE = 4
LINK = LinkModel.from_bandwidth(alpha=5e-6, bandwidth=1.25e8)
SIZES_P = [2, 3, 4, 5, 8, 16]
# Element counts divisible by every P above and every chunk count below.
COUNTS = [16 * 9 * 5 * 7 * 4, 16 * 9 * 5 * 7 * 4 * 1000]


def simulated(op: C, algorithm: str, p: int, nbytes: int, link: LinkModel, chunks: int = 1) -> float:
    count = nbytes // ITEMSIZE
    if op in (C.ALLGATHER, C.REDUCE_SCATTER):
        count //= p  # nbytes is the whole P * count buffer
    return simulate(generate(op, algorithm, p, count, 0, chunks), ITEMSIZE, link).seconds


def assert_close(sim: float, model: float) -> None:
    assert sim == pytest.approx(model, rel=1e-9, abs=1e-15)


CLOSED_FORM_CASES = [
    (C.BROADCAST, "lp"),
    (C.REDUCE, "lp"),
    (C.ALLREDUCE, "lp"),
    (C.BROADCAST, "mst"),
    (C.REDUCE, "mst"),
    (C.ALLREDUCE, "mst"),
    (C.ALLREDUCE, "ring"),
    (C.ALLGATHER, "ring"),
    (C.REDUCE_SCATTER, "ring"),
    (C.BROADCAST, "be"),
    (C.REDUCE, "be"),
    (C.ALLREDUCE, "be"),
    (C.ALLGATHER, "be"),
    (C.REDUCE_SCATTER, "be"),
]


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize(
    ("op", "algorithm"), CLOSED_FORM_CASES, ids=[f"{op}-{a}" for op, a in CLOSED_FORM_CASES]
)
def test_simulator_matches_closed_form_one_nic(op: C, algorithm: str, count: int) -> None:
    nbytes = count * ITEMSIZE
    for p in SIZES_P:
        for chunks in (1, 2, 4, 7, 16) if algorithm == "lp" else (1,):
            sim = simulated(op, algorithm, p, nbytes, LINK, chunks)
            assert_close(sim, closed_form(op, algorithm, p, nbytes, LINK, chunks))


@pytest.mark.parametrize("count", COUNTS)
def test_lp_allreduce_with_a_link_per_neighbour(count: int) -> None:
    link = LinkModel(LINK.alpha, LINK.beta, shared_nic=False)
    nbytes = count * ITEMSIZE
    for p in SIZES_P:
        for chunks in (1, 2, 4, 7, 16):
            sim = simulated(C.ALLREDUCE, "lp", p, nbytes, link, chunks)
            assert_close(sim, closed_form(C.ALLREDUCE, "lp", p, nbytes, link, chunks))
    # Independent links make LP allreduce as fast as a broadcast, unlike one NIC.
    p, k, n = 8, 16, COUNTS[1] * ITEMSIZE
    assert simulated(C.ALLREDUCE, "lp", p, n, link, k) < simulated(C.ALLREDUCE, "lp", p, n, LINK, k)


def test_single_participant_costs_nothing() -> None:
    for op, algorithm in CLOSED_FORM_CASES:
        assert simulated(op, algorithm, 1, 4000, LINK, 3) == 0.0
        assert closed_form(op, algorithm, 1, 4000, LINK, 3) == 0.0


def test_bytes_per_participant() -> None:
    count = 1000
    s = generate(C.BROADCAST, "lp", 5, count, 2, 4)
    result = simulate(s, ITEMSIZE, LINK)
    # The chain 2 -> 3 -> 4 -> 0 -> 1: the tail only receives, the root only sends.
    assert result.out_bytes.tolist() == [4000, 0, 4000, 4000, 4000]
    assert result.in_bytes.tolist() == [4000, 4000, 0, 4000, 4000]


@pytest.mark.parametrize("p", [3, 4, 16, 64])
@pytest.mark.parametrize("nbytes", [1, 10**6, 2**30])
def test_lp_chunks_is_the_clamped_optimum(p: int, nbytes: int) -> None:
    k = lp_chunks(p, nbytes, LINK)
    most = max(1, nbytes // DEFAULT_MIN_CHUNK_BYTES)
    ideal = math.sqrt((p - 2) * nbytes * LINK.beta / LINK.alpha)
    assert k == min(most, max(1, round(ideal)))
    assert 1 <= k <= most
    assert lp_chunks(2, nbytes, LINK) == 1
    assert lp_chunks(p, 0, LINK) == 1
    # The closed form's optimum: k* is no worse than its neighbours (when unclamped).
    if 1 < k < most:
        t = [closed_form(C.BROADCAST, "lp", p, nbytes, LINK, j) for j in (k - 1, k, k + 1)]
        assert t[1] <= min(t[0], t[2]) * (1 + 1e-12)


GIB = 2**30


def lp_time(op: C, p: int) -> float:
    k = lp_chunks(p, GIB, LINK, DEFAULT_MIN_CHUNK_BYTES)
    return simulated(op, "lp", p, GIB, LINK, k)


@pytest.mark.parametrize("op", [C.BROADCAST, C.REDUCE])
def test_lp_time_is_flat_in_p_at_1gib(op: C) -> None:
    base = lp_time(op, 2)
    assert base == pytest.approx(LINK.alpha + GIB * LINK.beta, rel=1e-9)
    for p in (4, 8, 16, 32, 64):
        assert lp_time(op, p) / base < 1.1, p


@pytest.mark.parametrize("op", [C.BROADCAST, C.REDUCE])
def test_lp_beats_mst_by_log_p_and_be_by_two_at_1gib(op: C) -> None:
    for p in (4, 8, 16, 32, 64):
        lp = lp_time(op, p)
        mst = simulated(op, "mst", p, GIB, LINK)
        be = simulated(op, "be", p, GIB, LINK)
        assert mst / lp >= 0.9 * math.log2(p), p
        assert be / lp >= 0.9 * 2 * (p - 1) / p, p


def test_select_follows_the_model() -> None:
    small, large = 8, GIB
    assert select(C.BROADCAST, small, 16, LINK).algorithm == "mst"
    assert select(C.REDUCE, small, 16, LINK).algorithm == "mst"
    big_bcast = select(C.BROADCAST, large, 16, LINK)
    assert big_bcast.algorithm == "lp"
    assert big_bcast.chunks == lp_chunks(16, large, LINK)
    assert select(C.REDUCE, large, 16, LINK).algorithm == "lp"
    # One NIC per node: a middle LP node sends 2n, ring 2(P-1)/P n.
    assert select(C.ALLREDUCE, large, 12, LINK).algorithm == "ring"
    assert select(C.ALLREDUCE, large, 16, LINK).algorithm in ("ring", "be")
    # A link per neighbour: LP allreduce costs about n beta and wins.
    per_pair = LinkModel(LINK.alpha, LINK.beta, shared_nic=False)
    assert select(C.ALLREDUCE, large, 12, per_pair).algorithm == "lp"
    choice = select(C.ALLGATHER, large, 12, LINK)
    assert choice.algorithm in ("ring", "be")
    assert choice.seconds == pytest.approx(closed_form(C.ALLGATHER, choice.algorithm, 12, large, LINK))


@pytest.mark.parametrize("p", [2, 3, 8, 16])
@pytest.mark.parametrize("shared_nic", [False, True])
def test_lp_allreduce_chunks_minimise_its_closed_form(p: int, shared_nic: bool) -> None:
    """Allreduce's fill is 2P-3 steps (P-2 once a shared NIC binds), so even P=2 gets
    chunks: the reduce and the broadcast back then overlap."""
    link = LinkModel.from_bandwidth(alpha=LINK.alpha, bandwidth=1 / LINK.beta, shared_nic=shared_nic)
    nbytes = 64 << 20
    k = lp_chunks(p, nbytes, link, op=C.ALLREDUCE)
    times = {j: closed_form(C.ALLREDUCE, "lp", p, nbytes, link, j) for j in range(1, 4 * k)}
    best = min(times.values())
    assert k > 1
    assert times[k] <= best * 1.02, (k, min(times, key=times.__getitem__))


@pytest.mark.parametrize(
    ("alpha", "bandwidth"),
    [(100e-6, 100e9), (10e-6, 100e9), (30e-6, 8e9), (50e-6, 12.5e9), (5e-6, 1.25e8)],
)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_slices_cost_at_most_half_their_transfer_in_steps(
    alpha: float, bandwidth: float, p: int
) -> None:
    """Slices let a reduction overlap the next slice's transfer (the model leaves that
    out), but each is a step that costs alpha. On a link whose step costs more than
    moving half a MiB (a device step enqueued from Python: 100 us), 512-KiB slices made a
    32-MiB ring 96 steps a participant (10.8 ms on an H200, docs/benchmarks.md). In the
    simulator, which charges every message its alpha, the tuner's slices cost at most
    half the transfer again: 1.5x one slice a block."""
    link = LinkModel.from_bandwidth(alpha=alpha, bandwidth=bandwidth, shared_nic=False)
    for nbytes in (32 << 20, 256 << 20):
        slices = chunks_for("ring", p, nbytes, link, op=C.ALLREDUCE)
        sliced = simulated(C.ALLREDUCE, "ring", p, nbytes, link, slices)
        assert sliced <= 1.5 * simulated(C.ALLREDUCE, "ring", p, nbytes, link, 1), slices
        if 2 * alpha * bandwidth <= 512 * 1024:  # a cheap step: 512-KiB slices, as ever
            assert slices == min(32, nbytes // p // (512 * 1024))


def test_select_is_the_minimum_over_candidates_up_to_the_tie_margin() -> None:
    for op in DATA_COLLECTIVES:
        for nbytes in (8, 10**5, 10**8):
            for p in (2, 3, 8, 17):
                choice = select(op, nbytes, p, LINK)
                assert choice.algorithm in algorithms_for(op)
                predicted = {
                    name: closed_form(
                        op, name, p, nbytes, LINK, lp_chunks(p, nbytes, LINK, op=op) if name == "lp" else 1
                    )
                    for name in algorithms_for(op)
                }
                fastest = min(predicted.values())
                assert choice.seconds <= fastest * (1 + TIE_MARGIN)
                # Nothing earlier in registry order was within the margin too.
                earlier = algorithms_for(op)[: algorithms_for(op).index(choice.algorithm)]
                assert all(predicted[n] > fastest * (1 + TIE_MARGIN) for n in earlier)


def test_a_deadlocking_schedule_raises() -> None:
    # Both ranks wait for the other's message before sending theirs.
    b = ScheduleBuilder(C.BROADCAST, "deadlock", 2, 4)
    for rank in (0, 1):
        b.recv(0, rank, 1 - rank, Buf.OUT, 0, 4)
        b.send(1, rank, 1 - rank, Buf.OUT, 0, 4)
    with pytest.raises(SimulationError):
        simulate(b.build(), ITEMSIZE, LINK)


def test_eager_sends_do_not_deadlock() -> None:
    # Sends are asynchronous: both ranks sending first, then receiving, is fine.
    b = ScheduleBuilder(C.BROADCAST, "exchange", 2, 4)
    for rank in (0, 1):
        b.send(0, rank, 1 - rank, Buf.IN, 0, 4)
        b.recv(0, rank, 1 - rank, Buf.OUT, 0, 4)
    result = simulate(b.build(), ITEMSIZE, LINK)
    assert result.seconds == pytest.approx(LINK.alpha + 16 * LINK.beta, rel=1e-9)
    assert np.array_equal(result.out_bytes, [16, 16])


def test_empty_schedules_cost_nothing() -> None:
    for op, algorithm in CLOSED_FORM_CASES:
        for p in (2, 5, 17):
            result = simulate(generate(op, algorithm, p, 0, p - 1, 3), ITEMSIZE, LINK)
            assert result.seconds == 0.0
            assert not result.out_bytes.any() and not result.in_bytes.any()


def test_link_model_rejects_nonsense() -> None:
    from lpsync.errors import InvalidArgumentError

    for alpha, bandwidth, gamma in ((-1, 1e9, 0), (1e-6, 0, 0), (1e-6, 1e9, -1)):
        with pytest.raises(InvalidArgumentError):
            LinkModel.from_bandwidth(alpha, bandwidth, gamma)
    assert LinkModel.from_bandwidth(1e-6, 2e9).beta == pytest.approx(5e-10)


@pytest.mark.parametrize(
    ("op", "algorithm"), CLOSED_FORM_CASES, ids=[f"{op}-{a}" for op, a in CLOSED_FORM_CASES]
)
def test_simulator_matches_closed_form_every_p_and_root(op: C, algorithm: str) -> None:
    """Every P up to 17 (non-powers of two fall back to the ring in BE) and a middle root."""
    for p in range(2, 18):
        nbytes = p * 9 * 16 * 5 * 7 * ITEMSIZE  # divisible by P and the chunk counts
        count = nbytes // ITEMSIZE // (p if op in (C.ALLGATHER, C.REDUCE_SCATTER) else 1)
        for chunks in (1, 3, 16) if algorithm == "lp" else (1,):
            s = generate(op, algorithm, p, count, p // 2, chunks)
            assert_close(
                simulate(s, ITEMSIZE, LINK).seconds, closed_form(op, algorithm, p, nbytes, LINK, chunks)
            )


@pytest.mark.parametrize("op", [C.BROADCAST, C.REDUCE])
def test_lp_at_64mib_and_256_participants_matches_closed_form(op: C) -> None:
    """Where the pipeline fill shows (P-2 of P-2+k steps), the event times still agree."""
    p, nbytes = 256, 64 * 2**20
    k = lp_chunks(p, nbytes, LINK)
    s = generate(op, "lp", p, nbytes // ITEMSIZE, 0, k)
    sim = simulate(s, ITEMSIZE, LINK).seconds
    assert_close(sim, closed_form(op, "lp", p, nbytes, LINK, k))
    assert sim > 1.1 * (nbytes * LINK.beta)  # the fill is visible at this size
