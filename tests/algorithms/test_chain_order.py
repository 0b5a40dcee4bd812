"""The chain over a node's devices: fewest slow-link crossings, checked against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lpsync.algorithms.chain_order import chain_order, crossings
from lpsync.daemon.collectives.local import device_chain
from lpsync.memory.devices import parse_devices
from lpsync.memory.kind import Link
from lpsync.types import Collective


def _links(spec: str) -> list[list[int]]:
    topology = parse_devices(spec).topology
    assert topology is not None
    return [[int(x) for x in row] for row in topology.links]


def test_islands_are_crossed_once():
    links = _links("emulated:4,islands=2")  # 0-1 and 2-3 NVLink, PCIe between
    devices = [0, 2, 1, 3]
    chain = chain_order(devices, links)
    slow_first = crossings(chain, devices, links)
    assert slow_first[0] == 1  # one PCIe crossing
    assert crossings(list(range(4)), devices, links)[0] == 3  # rank order crosses 3 times
    assert sorted(chain) == [0, 1, 2, 3]


def test_processes_sharing_a_device_sit_together():
    links = _links("emulated:3,slow=0-2")
    devices = [0, 1, 0, 2, 1, 0]
    chain = chain_order(devices, links)
    on = [devices[r] for r in chain]
    assert sum(a != b for a, b in itertools.pairwise(on)) == 2  # each device visited once
    assert crossings(chain, devices, links)[0] == 0  # 0-2 (PCIe) avoided: 0,1,2 or 2,1,0


def test_roots_head_and_end_the_chain():
    links = _links("emulated:4,islands=2")
    devices = [0, 2, 1, 3, 2]
    for root in range(5):
        assert chain_order(devices, links, first=root)[0] == root
        assert chain_order(devices, links, last=root)[-1] == root


def test_host_staged_links_are_avoided_first():
    links = _links("emulated:3,host=0-1,slow=1-2")
    devices = [0, 1, 2]
    chain = chain_order(devices, links)
    counts = crossings(chain, devices, links)  # (HOST, SLOW, FAST, SAME)
    assert counts[0] == 0


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 5))
    links = [[0] * n for _ in range(n)]
    for a, b in itertools.combinations(range(n), 2):
        links[a][b] = links[b][a] = int(rng.integers(Link.FAST, Link.HOST + 1))
    p = int(rng.integers(1, 7))
    devices = [int(d) for d in rng.integers(0, n, p)]
    first = int(rng.integers(0, p)) if seed % 3 == 1 else None
    last = int(rng.integers(0, p)) if seed % 3 == 2 else None
    chain = chain_order(devices, links, first, last)
    assert sorted(chain) == list(range(p))
    if first is not None:
        assert chain[0] == first
    if last is not None:
        assert chain[-1] == last
    best = min(
        crossings(perm, devices, links)
        for perm in itertools.permutations(range(p))
        if (first is None or perm[0] == first) and (last is None or perm[-1] == last)
    )
    assert crossings(chain, devices, links) == best
    assert chain_order(devices, links, first, last) == chain  # deterministic


def test_block_indexed_ops_keep_rank_order():
    topology = parse_devices("emulated:4,islands=2").topology
    for op in (Collective.ALLGATHER, Collective.REDUCE_SCATTER):
        assert device_chain(op, 0, [0, 2, 1, 3], topology) == [0, 1, 2, 3]
    assert device_chain(Collective.BROADCAST, 2, [0, 2, 1, 3], topology)[0] == 2
    assert device_chain(Collective.REDUCE, 1, [0, 2, 1, 3], topology)[-1] == 1
