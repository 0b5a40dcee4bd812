"""The UCX side of the GPU path (docs/gpu.md, second reading), on emulated device memory
through real UCX endpoints in this process (UCX forced onto TCP over loopback):

* the progress thread posts device memory only with that device current (without it,
  the emulated device refuses, as UCX's cuda transports crash: nixl#2102);
* ``abort`` returns only once UCX let go of every buffer posted on the endpoint, so a
  failed collective's plans may free their memory then (the emulated device records a
  free under a posted transfer as a fault);
* ``--peer-device-path auto`` stages until the direct path passed the GPU check.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lpsync.errors import UnavailableError
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Span
from lpsync.transport import backends
from lpsync.transport.ucx import device_support as ds
from tests.transport.pairs import connected_pair

SECRET = b"test cluster secret"
# ucx_info -d of a GPU node (cuda_copy, cuda_ipc), as test_ucx_device_support reads it
GPU_NODE = ds.parse_ucx_info((Path(__file__).parent / "ucx_info" / "gpu_node.txt").read_text())


def pair() -> AbstractContextManager[tuple[Any, Any]]:
    pytest.importorskip("ucxx")
    return connected_pair(lambda options: backends.connect("ucx", options, tls="tcp"), SECRET, "lpsync-ucx")


def _wire(kind: EmulatedKind, device: int, nbytes: int) -> tuple[Any, Any]:
    memory = kind.allocate(device, nbytes)
    return memory, kind.wire(Span(memory, 0, nbytes, np.dtype(np.uint8)))


def test_cuda_contract_auto_stages_until_the_direct_path_passed_the_gpu_check():
    assert not ds.DIRECT_PATH_VALIDATED
    found = ds.decide("ucx", "cuda", "", lambda: GPU_NODE, lambda: "")
    assert found.path == ds.DEVICE  # what auto chose in the first reading
    chosen = ds.choose(ds.AUTO, "ucx", "cuda", "", lambda: GPU_NODE, lambda: "")
    assert chosen.path == ds.STAGED
    assert "until the direct path has passed scripts/gpu_check.sh" in chosen.reason
    assert found.reason in chosen.reason  # status still says what UCX offers
    asked = ds.choose(ds.DEVICE, "ucx", "cuda", "", lambda: GPU_NODE, lambda: "")
    assert asked.path == ds.DEVICE  # asking for it still gets it (the GPU check does)


def test_cuda_contract_the_progress_thread_posts_device_memory_with_its_device_current():
    kind = EmulatedKind(2)
    rng = np.random.default_rng(45)
    try:
        with pair() as (a, b):
            data = rng.integers(0, 255, 1 << 16, dtype=np.uint8)
            source, out_of = _wire(kind, 0, data.size)
            target, into = _wire(kind, 1, data.size)
            out_of[:] = data
            received = b.post_recv(0, 7, into)
            a.send(1, 7, out_of).wait(time.monotonic() + 10)
            received.wait(time.monotonic() + 10)
            assert (np.asarray(into) == data).all()
            assert source.posted == target.posted == 0  # every transfer's end was counted
            assert kind.faults == []
            # Strictness: the same post from a thread with no device current is refused
            # (on CUDA, a crash in UCX): what binding on the progress thread prevents.
            refused: list[BaseException] = []

            def post_unbound() -> None:
                try:
                    into.lpsync_post()
                except UnavailableError as error:
                    refused.append(error)

            fresh = threading.Thread(target=post_unbound)  # a thread starts with no device current
            fresh.start()
            fresh.join(10)
            assert refused and "no device current" in str(refused[0])
    finally:
        kind.close_kind()


def test_cuda_contract_abort_returns_once_ucx_let_go_of_the_posted_buffers():
    kind = EmulatedKind(1)
    try:
        with pair() as (a, b):
            memories, posted = [], []
            for tag in range(4):  # receives nobody will send: UCX holds them
                memory, into = _wire(kind, 0, 4096)
                memories.append(memory)
                posted.append(b.post_recv(0, 100 + tag, into))
            deadline = time.monotonic() + 10
            while sum(m.posted for m in memories) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)  # the progress thread posts them (a test's wait, bounded)
            assert sum(m.posted for m in memories) == 4
            # The progress thread busy for a while (a long progress call): an abort that
            # only posts the close returns before UCX let go of anything.
            b._runtime.progress.call(lambda: time.sleep(0.5))
            started = time.monotonic()
            b.abort(UnavailableError("the collective failed"))
            assert time.monotonic() - started < 10
            assert all(r.done() for r in posted)  # cancelled, not still writable
            assert all(m.posted == 0 for m in memories)
            for memory in memories:  # what a failed plan does next: free its staging
                kind.free(memory)
            assert kind.releaser.flush(5)
            assert kind.faults == []
            with pytest.raises(UnavailableError):
                posted[0].wait(time.monotonic() + 1)
            del a
    finally:
        kind.close_kind()
