"""``--devices``: which memory kind a daemon serves, parsed and opened.

  cpu | cpu:N          host shared memory only (the default)
  cuda:all | cuda:0,2  the node's GPUs through cupy (lpsync[cuda12] / lpsync[cuda13])
  emulated:N[,OPT...]  N host-emulated devices (CI); OPT sets the topology, default all
                       NVLink-class: ``slow=0-2+1-3`` PCIe-class pairs, ``host=1-2`` pairs
                       without peer access (staged through host memory), ``islands=K``
                       K NVLink islands of consecutive devices joined by PCIe; ``bw=B``
                       slows every copy to B bytes/s (tests that need copies to take time).
Parsing imports nothing; only ``open_kind`` for cuda imports cupy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from lpsync.errors import InvalidArgumentError
from lpsync.memory.kind import Link, MemoryKind, Topology


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "cpu", "cuda", "emulated"
    count: int = 0  # emulated: N
    indices: tuple[int, ...] = ()  # cuda: () means all
    topology: Topology | None = None  # emulated
    copy_bandwidth: float = 0.0  # emulated: bytes/s of every copy, 0: memcpy speed


def _pairs(text: str, n: int, what: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split("+"):
        m = re.fullmatch(r"(\d+)-(\d+)", item)
        if not m or int(m[1]) >= n or int(m[2]) >= n or m[1] == m[2]:
            raise InvalidArgumentError(
                f"--devices: {what}={text!r} needs pairs A-B of distinct devices below {n}, joined by '+'"
            )
        pairs.append((int(m[1]), int(m[2])))
    return pairs


def parse_devices(spec: str) -> DeviceSpec:
    text = spec.strip()
    if re.fullmatch(r"cpu(:\d+)?", text):
        return DeviceSpec("cpu")
    if text == "cuda:all":
        return DeviceSpec("cuda")
    m = re.fullmatch(r"cuda:(\d+(?:,\d+)*)", text)
    if m:
        indices = tuple(int(i) for i in m[1].split(","))
        if len(set(indices)) != len(indices):
            raise InvalidArgumentError(f"--devices {spec!r} names a GPU twice")
        return DeviceSpec("cuda", indices=indices)
    m = re.fullmatch(r"emulated:(\d+)((?:,[a-z]+=[0-9+\-]+)*)", text)
    if not m or not 1 <= int(m[1]) <= 64:
        raise InvalidArgumentError(
            f"--devices {spec!r}: expected cpu, cuda:all, cuda:0,1,... or emulated:N (1..64) "
            "with optional ,slow=A-B+..., ,host=A-B+..., ,islands=K, ,bw=BYTES_PER_S"
        )
    n = int(m[1])
    links = [[Link.SAME if a == b else Link.FAST for b in range(n)] for a in range(n)]
    bandwidth = 0.0
    for option in filter(None, m[2].split(",")):
        key, value = option.split("=", 1)
        if key == "bw":
            if not value.isdigit() or int(value) < 1:
                raise InvalidArgumentError(f"--devices: bw={value} must be bytes per second")
            bandwidth = float(value)
        elif key == "islands":
            k = int(value) if value.isdigit() else 0
            if not 1 <= k <= n:
                raise InvalidArgumentError(f"--devices: islands={value} must be 1..{n}")
            size = -(-n // k)
            for a in range(n):
                for b in range(n):
                    if a != b and a // size != b // size:
                        links[a][b] = Link.SLOW
        elif key in ("slow", "host"):
            for a, b in _pairs(value, n, key):
                links[a][b] = links[b][a] = Link.SLOW if key == "slow" else Link.HOST
        else:
            raise InvalidArgumentError(f"--devices: unknown emulated option {key!r}")
    return DeviceSpec(
        "emulated", count=n, topology=Topology(tuple(tuple(row) for row in links)), copy_bandwidth=bandwidth
    )


def open_kind(spec: DeviceSpec) -> MemoryKind | None:
    """The operations table for ``spec``; None for cpu (the host path needs none)."""
    if spec.kind == "cpu":
        return None
    if spec.kind == "emulated":
        from lpsync.memory.emulated import EmulatedKind

        # A kind's methods take its own Memory: the only memory it is ever given.
        return cast(MemoryKind, EmulatedKind(spec.count, spec.topology, spec.copy_bandwidth))
    from lpsync.memory.cuda import CudaKind  # imports cupy: only here

    return cast(MemoryKind, CudaKind(spec.indices))
