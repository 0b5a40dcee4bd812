"""The order of an LP chain over a node's devices: as few slow-link crossings as possible.

Pure: participants sit on devices, devices are joined by links of a cost class
(lpsync.memory.kind.Link: same device < NVLink < PCIe < through the host). A chain of
P participants crosses P-1 links; its cost is the tuple of how many links of each class
it crosses, slowest first, compared lexicographically: one PCIe crossing fewer beats any
number of NVLink crossings. Participants that share a device sit next to each other.
Devices are ordered exactly (every permutation) up to 8 of them, greedily beyond. The
exact search (8! orders on an 8-GPU node) runs once per (devices, links, first, last):
``device_order`` is memoized, bounded, since a daemon asks it on every collective.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

_EXACT = 8


def _cost(order: Sequence[int], links: Sequence[Sequence[int]]) -> tuple[int, ...]:
    worst = max((max(row) for row in links), default=0)
    counts = [0] * (worst + 1)
    for a, b in itertools.pairwise(order):
        counts[links[a][b]] += 1
    return tuple(reversed(counts))


def device_order(
    devices: Sequence[int], links: Sequence[Sequence[int]], first: int | None = None, last: int | None = None
) -> list[int]:
    """The distinct ``devices`` in chain order, starting at ``first`` / ending at ``last`` if given."""
    key = tuple(dict.fromkeys(devices))
    return list(_device_order(key, tuple(tuple(int(x) for x in row) for row in links), first, last))


@functools.lru_cache(maxsize=1024)  # a node has few device sets; entries are small
def _device_order(
    distinct: tuple[int, ...], links: tuple[tuple[int, ...], ...], first: int | None, last: int | None
) -> tuple[int, ...]:
    return tuple(_search(list(distinct), links, first, last))


def _search(
    distinct: list[int], links: Sequence[Sequence[int]], first: int | None, last: int | None
) -> list[int]:
    if len(distinct) <= _EXACT:
        best, best_cost = None, None
        for perm in itertools.permutations(distinct):
            if (first is not None and perm[0] != first) or (last is not None and perm[-1] != last):
                continue
            cost = _cost(perm, links)
            if best_cost is None or cost < best_cost:
                best, best_cost = list(perm), cost
        assert best is not None
        return best
    order = [first if first is not None else distinct[0]]
    left = [d for d in distinct if d not in order and d != last]
    while left:
        here = order[-1]
        nxt = min(left, key=lambda d: (links[here][d], d))
        order.append(nxt)
        left.remove(nxt)
    if last is not None and last not in order:
        order.append(last)
    return order


def chain_order(
    devices: Sequence[int], links: Sequence[Sequence[int]], first: int | None = None, last: int | None = None
) -> list[int]:
    """Participants (indices into ``devices``, the device of each) in chain order.

    ``first``/``last``: a participant that must head/end the chain (a broadcast's root, a
    reduce's root). Ties keep rank order, so the result is deterministic.
    """
    p = len(devices)
    if p == 0:
        return []
    pinned_first = devices[first] if first is not None else None
    pinned_last = devices[last] if last is not None else None
    if pinned_first is not None and pinned_first == pinned_last and len(set(devices)) > 1:
        pinned_last = None  # both roots on one device: only the head is pinned
    order = device_order(devices, links, pinned_first, pinned_last)
    chain: list[int] = []
    for device in order:
        group = [r for r in range(p) if devices[r] == device]
        if first is not None and first in group:
            group.remove(first)
            group.insert(0, first)
        if last is not None and last in group and last != first:
            group.remove(last)
            group.append(last)
        chain.extend(group)
    return chain


def crossings(
    chain: Sequence[int], devices: Sequence[int], links: Sequence[Sequence[int]]
) -> tuple[int, ...]:
    """How many links of each class ``chain`` crosses, slowest class first."""
    return _cost([devices[r] for r in chain], links)
