"""An 8-GPU node: the chain order's exhaustive search (8! orders) runs once per device
set and topology, not on every collective (docs/gpu.md, second reading, point 3)."""

from __future__ import annotations

import time

from lpsync.algorithms import chain_order as co
from lpsync.memory.kind import Link


def _dgx_like() -> list[list[int]]:
    """Two NVLink islands of four joined by PCIe: the order matters."""
    return [
        [Link.SAME if a == b else Link.FAST if a // 4 == b // 4 else Link.SLOW for b in range(8)]
        for a in range(8)
    ]


def test_cuda_contract_the_exhaustive_chain_search_runs_once_per_topology():
    co._device_order.cache_clear()
    links = _dgx_like()
    devices = [5, 1, 6, 2, 7, 3, 4, 0]
    started = time.perf_counter()
    first = co.chain_order(devices, links)
    searched = time.perf_counter() - started
    assert co.crossings(first, devices, links)[0] == 1  # slowest class first: one PCIe hop
    started = time.perf_counter()
    for _ in range(100):
        assert co.chain_order(devices, links) == first
    again = (time.perf_counter() - started) / 100
    info = co._device_order.cache_info()
    assert (info.misses, info.hits) == (1, 100)
    assert again < searched / 10, (again, searched)
    # Another root is another question: searched once more, then remembered.
    assert co.chain_order(devices, links, first=3)[0] == 3
    assert co._device_order.cache_info().misses == 2
    # Other links (a pair refused peer access) are another topology.
    links[0][1] = links[1][0] = Link.HOST
    co.chain_order(devices, links)
    assert co._device_order.cache_info().misses == 3
