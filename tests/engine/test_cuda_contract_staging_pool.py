"""The staging pool keeps unused device memory bounded by bytes, not only by count
(second reading, point 4): 32 buffers of 256 MiB would hold 8 GiB of a GPU; and what it
gives back is freed off the caller's thread (the kind's Releaser)."""

from __future__ import annotations

from lpsync.engine.device_group import StagingPool
from lpsync.memory.emulated import EmulatedKind


def test_cuda_contract_the_staging_pool_keeps_at_most_its_bytes():
    kind = EmulatedKind(1)
    pool = StagingPool(kind, keep=32, keep_bytes=3 << 20)
    try:
        taken = [pool.take(0, 1 << 20) for _ in range(5)]
        for memory in taken:
            pool.give(memory)
        assert pool.kept_bytes == 3 << 20  # three kept, two freed, though 32 would fit by count
        assert kind.releaser.flush(5)
        assert sum(1 for m in taken if m.array.nbytes == 0) == 2
        again = [pool.take(0, 1 << 20) for _ in range(3)]
        assert pool.allocated == 5 and pool.kept_bytes == 0  # the kept ones came back
        for memory in again:
            pool.give(memory)
        big = pool.take(0, 4 << 20)  # larger than the bound: never kept
        pool.give(big)
        assert pool.kept_bytes == 3 << 20
        assert kind.releaser.flush(5) and big.array.nbytes == 0
    finally:
        pool.close()
        kind.close_kind()
