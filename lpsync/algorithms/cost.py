"""The alpha-beta-gamma cost model: link parameters, closed forms, LP's chunk count.

alpha: seconds per message; beta: seconds per byte on one link direction; gamma:
seconds per byte reduced. ``nbytes`` is always the whole buffer: the message of
broadcast/reduce/allreduce, the gathered output of allgather and the input of
reduce_scatter (nccl-tests' "size"). The closed forms are the textbook ones; the
simulator (simulate.py) times the actual schedules and the tests compare the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lpsync.algorithms.patterns import is_power_of_two
from lpsync.algorithms.schedule import ceil_log2
from lpsync.errors import InvalidArgumentError
from lpsync.types import BLOCKED, Collective

DEFAULT_MIN_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class LinkModel:
    alpha: float  # seconds per message
    beta: float  # seconds per byte, per link direction
    gamma: float = 0.0  # seconds per byte reduced
    # True: each participant has one full-duplex NIC, so all it receives shares one
    # in-port and all it sends one out-port (a cluster of nodes). False: every ordered
    # pair of participants has a link of its own (GPU chains over NVLink/PCIe).
    shared_nic: bool = True

    @classmethod
    def from_bandwidth(
        cls, alpha: float, bandwidth: float, gamma: float = 0.0, shared_nic: bool = True
    ) -> LinkModel:
        if alpha < 0 or bandwidth <= 0 or gamma < 0:
            raise InvalidArgumentError("alpha and gamma must be >= 0 and bandwidth > 0")
        return cls(alpha, 1.0 / bandwidth, gamma, shared_nic)

    @property
    def bandwidth(self) -> float:
        return 1.0 / self.beta


# Participants that are threads of one process moving chunks through shared memory
# (the executor over the inproc transport): a chunk hand-off costs ~150 us of thread
# wake-ups and GIL traffic on a 2-core machine, memory moves ~6 GB/s per stream, and
# each pair of participants has its own "link". Fitted from `python -m
# lab.executor --chunk-bytes 256KiB|1MiB|4MiB` (docs/benchmarks.md).
SHARED_MEMORY_LINK = LinkModel(alpha=150e-6, beta=1 / 6e9, gamma=0.0, shared_nic=False)


def lp_chunks(
    participants: int,
    nbytes: int,
    link: LinkModel,
    min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
    op: Collective | None = None,
) -> int:
    """k* = sqrt(F n (beta+gamma) / alpha), clamped to [1, n / min_chunk_bytes]: F is the
    pipeline's fill in steps, P-2 for broadcast and reduce; for allreduce 2P-3 (the
    reduce fills P-1 links, the broadcast drains them back: 1 at P=2, where chunking
    still overlaps the two directions), P-2 again once a shared NIC makes the middle
    nodes the bottleneck (closed form of _lp_allreduce)."""
    p = participants
    fill = p - 2
    if op is Collective.ALLREDUCE and not (link.shared_nic and p > 2):
        fill = 2 * p - 3
    most = max(1, nbytes // max(1, min_chunk_bytes))
    if fill <= 0 or nbytes == 0:
        return 1
    if link.alpha == 0:
        return most
    k = math.sqrt(fill * nbytes * (link.beta + link.gamma) / link.alpha)
    return int(min(most, max(1, round(k))))


RING_SLICE_BYTES = 512 * 1024  # a ring allreduce slice: about an LP chunk's size
RING_MAX_SLICES = 32


def ring_slices(participants: int, nbytes: int, link: LinkModel) -> int:
    """Slices per block of a ring allreduce: blocks of about RING_SLICE_BYTES, so that the
    reduction of one overlaps the transfer of the next (the alpha-beta model has no term
    for that overlap; the learning tuner times half and twice this count). Where a step
    costs more than moving half a MiB on ``link`` (a device step enqueued from Python), a
    slice carries at least 2 alpha / beta bytes, so that what each slice costs as a step
    stays within half its transfer (the closed form charges no alpha per slice)."""
    size = RING_SLICE_BYTES
    if link.beta > 0:  # a link of infinite bandwidth: any slice moves at once
        size = max(size, int(2 * link.alpha / link.beta))
    block = nbytes // max(1, participants)
    return int(min(RING_MAX_SLICES, max(1, block // size)))


def _scatter(p: int, n: float, link: LinkModel) -> float:
    return ceil_log2(p) * link.alpha + (p - 1) / p * n * link.beta


def _reduce_scatter(p: int, n: float, link: LinkModel, ring: bool) -> float:
    bytes_moved = (p - 1) / p * n
    messages = p - 1 if ring or not is_power_of_two(p) else ceil_log2(p)
    return messages * link.alpha + bytes_moved * (link.beta + link.gamma)


def _allgather(p: int, n: float, link: LinkModel, ring: bool) -> float:
    messages = p - 1 if ring or not is_power_of_two(p) else ceil_log2(p)
    return messages * link.alpha + (p - 1) / p * n * link.beta


def _lp(p: int, n: float, link: LinkModel, k: int, per_byte: float) -> float:
    return (p - 2 + k) * (link.alpha + n * per_byte / k)


def _lp_allreduce(p: int, n: float, link: LinkModel, k: int) -> float:
    step = link.alpha + n * link.beta / k
    steps = 2 * p - 3 + k  # reduce fills p-1 links, the broadcast drains p-1 links back
    if link.shared_nic and p > 2 and k > 2:
        # One NIC: a middle node's in-port carries each chunk twice (partial in, result
        # back), so once both directions flow it passes one chunk per two steps.
        steps = max(steps, 2 * (k + p - 2))
    return steps * step + (p - 1) * n * link.gamma / k


def closed_form(
    op: Collective, algorithm: str, participants: int, nbytes: int, link: LinkModel, chunks: int = 1
) -> float:
    """Predicted seconds of one collective (uniform blocks assumed)."""
    p, n, a, b, g = participants, float(nbytes), link.alpha, link.beta, link.gamma
    if p == 1:
        return 0.0
    L = ceil_log2(p)
    C = Collective
    table = {
        ("lp", C.BROADCAST): lambda: _lp(p, n, link, chunks, b),
        ("lp", C.REDUCE): lambda: _lp(p, n, link, chunks, b + g),
        ("lp", C.ALLREDUCE): lambda: _lp_allreduce(p, n, link, chunks),
        ("mst", C.BROADCAST): lambda: L * (a + n * b),
        ("mst", C.REDUCE): lambda: L * (a + n * (b + g)),
        ("mst", C.ALLREDUCE): lambda: L * (a + n * (b + g)) + L * (a + n * b),
        ("be", C.BROADCAST): lambda: _scatter(p, n, link) + _allgather(p, n, link, False),
        ("be", C.REDUCE): lambda: _reduce_scatter(p, n, link, False) + _scatter(p, n, link),
        ("be", C.ALLREDUCE): lambda: _reduce_scatter(p, n, link, False) + _allgather(p, n, link, False),
        ("be", C.ALLGATHER): lambda: _allgather(p, n, link, False),
        ("be", C.REDUCE_SCATTER): lambda: _reduce_scatter(p, n, link, False),
        ("ring", C.ALLREDUCE): lambda: _reduce_scatter(p, n, link, True) + _allgather(p, n, link, True),
        ("ring", C.ALLGATHER): lambda: _allgather(p, n, link, True),
        ("ring", C.REDUCE_SCATTER): lambda: _reduce_scatter(p, n, link, True),
        # n is the whole buffer (P blocks); (P-1) blocks cross the root's (or each) link.
        ("linear", C.GATHER): lambda: (p - 1) * a + (p - 1) / p * n * b,
        ("linear", C.SCATTER): lambda: (p - 1) * a + (p - 1) / p * n * b,
        ("pairwise", C.ALLTOALL): lambda: (p - 1) * a + (p - 1) / p * n * b,
    }
    try:
        return table[(algorithm, op)]()
    except KeyError:
        raise InvalidArgumentError(f"no cost model for {algorithm} {op}") from None


def algbw(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if seconds > 0 else math.inf


# nccl-tests' bus bandwidth factors (PERFORMANCE.md): busbw = algbw * factor.
def busbw_factor(op: Collective, participants: int) -> float:
    p = participants
    if op is Collective.ALLREDUCE:
        return 2 * (p - 1) / p
    if op in BLOCKED:
        return (p - 1) / p
    return 1.0
