"""The framework adapters' device path (lpsync_client._adapt) on the emulated device: the
dispatch decision, registrations cached per allocation span and released when the array
is collected or the client closes, results against numpy. The CUDA adapters themselves
(torch, cupy, jax on a GPU) are in tests/daemon/test_daemon_gpu.py (marker gpu)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest

import lpsync_client
from lpsync_client import _adapt, emulated
from tests.daemon.harness import DaemonProcess


@pytest.fixture
def emu(tmp_path: Path):
    where = tmp_path / "emu"  # apart from the cpu `daemon` fixture's socket
    where.mkdir()
    proc = DaemonProcess(where, "--devices", "emulated:2")
    try:
        yield proc
    finally:
        proc.stop_and_check()


def _rows(socket: str):
    with lpsync_client.connect(socket, job="look", rank=0, world_size=1) as client:
        return {d.index: d for d in client.status().devices}


def _two_ranks(socket: str, job: str, body) -> list:
    """Run ``body(client, rank)`` as ranks 0 and 1 of ``job`` in two threads."""
    results: list = [None, None]
    errors: list = []

    def rank(r: int) -> None:
        try:
            with lpsync_client.connect(socket, job=job, rank=r, world_size=2, timeout=60) as c:
                results[r] = body(c, r)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def test_dispatch_follows_the_array_and_the_daemon(emu, daemon):
    x = emulated.zeros(16, "float32", device=1)
    with lpsync_client.connect(emu.socket, job="d", rank=0, world_size=1) as client:
        assert _adapt.served_kinds(client) == {"emulated"}
        assert _adapt.on_device_path(client, x)
        assert not _adapt.on_device_path(client, np.zeros(16, np.float32))
    with lpsync_client.connect(daemon.socket, job="d", rank=0, world_size=1) as client:
        assert _adapt.served_kinds(client) == frozenset()  # a cpu daemon: stage instead
        assert not _adapt.on_device_path(client, x)
    assert _adapt.kind_of(x) == "emulated" and _adapt.kind_of(np.zeros(1)) is None


def test_registrations_are_cached_per_span_and_results_match_numpy(emu):
    rng = np.random.default_rng(2)
    values = [[rng.standard_normal(300).astype(np.float32), rng.integers(-9, 9, 77)] for _ in range(2)]

    def body(client, r):
        alloc = emulated.Allocation(1 << 16, device=r)
        a = alloc.array(0, 300, "float32")
        b = emulated.asarray(values[r][1].astype(np.int64), device=r)
        seen = []
        for step in range(3):
            a.set(values[r][0] * (step + 1))
            b.set(values[r][1])
            _adapt.allreduce_arrays(client, [a, b], "sum", name="grads")
            seen.append(client.device_registrations())
        # A sub-span of a registered span reuses its registration.
        _adapt.allreduce_arrays(client, [a[10:20]], "max", name="sub")
        seen.append(client.device_registrations())
        return a.get(), b.get(), seen

    results = _two_ranks(emu.socket, "adapt", body)
    want_a = (values[0][0] + values[1][0]) * 3
    want_b = values[0][1] + values[1][1]
    for a, b, seen in results:
        np.testing.assert_allclose(a, want_a, rtol=1e-5)
        assert (b == want_b).all()
        assert seen == [2, 2, 2, 2], "registered again instead of reusing the span"


def test_a_collected_array_releases_its_registration(emu):
    def body(client, r):
        counts = []
        for step in range(3):
            x = emulated.asarray(np.full(1000, r + 1.0, np.float32), device=r)
            _adapt.allreduce_arrays(client, [x], "sum", name=f"step{step}")
            assert x.get()[0] == 3.0
            counts.append(client.device_registrations())
            del x
            gc.collect()
        counts.append(client.device_registrations())  # the last one released too
        return counts

    for counts in _two_ranks(emu.socket, "collected", body):
        assert counts == [1, 1, 1, 0]
    rows = _rows(emu.socket)
    assert all(r.open_allocations == 0 and r.registered_bytes == 0 for r in rows.values())
    assert all(r.ipc_opens == r.ipc_closes for r in rows.values())


def test_a_closed_client_releases_what_it_holds(emu):
    keep = []

    def body(client, r):
        x = emulated.asarray(np.ones(500, np.float64), device=r)
        keep.append(x)  # alive past the client: only the close releases it
        _adapt.allreduce_arrays(client, [x], "sum")
        return x.get()[0]

    assert _two_ranks(emu.socket, "closing", body) == [2.0, 2.0]
    rows = _rows(emu.socket)
    assert all(r.open_allocations == 0 and r.registered_bytes == 0 for r in rows.values())


def test_a_weak_registration_cannot_be_passed_by_handle(emu):
    with lpsync_client.connect(emu.socket, job="weak", rank=0, world_size=1) as client:
        x = emulated.zeros(8, "float32", device=0)
        registered = client.register(x, hold=False)
        with pytest.raises(lpsync_client.InvalidArgumentError, match="pass the array itself"):
            client.allreduce(registered)
        client.allreduce(x)  # the array itself finds the registration
        assert client.device_registrations() == 1


class _Unreferenceable:
    """A device array type without weak references (as some C-extension arrays are)."""

    __slots__ = ("array",)

    def __init__(self, array: emulated.EmulatedArray) -> None:
        self.array = array

    def __lpsync_device__(self):
        return self.array.__lpsync_device__()

    def __lpsync_sync__(self) -> None:
        self.array.__lpsync_sync__()

    def __lpsync_ready__(self) -> bytes:
        return self.array.__lpsync_ready__()


def test_an_array_without_weak_references_is_released_after_its_collective(emu):
    def body(client, r):
        x = emulated.asarray(np.full(100, r + 1.0, np.float32), device=r)
        _adapt.allreduce_arrays(client, [_Unreferenceable(x)], "sum")
        return x.get()[0], client.device_registrations()

    assert _two_ranks(emu.socket, "unref", body) == [(3.0, 0), (3.0, 0)]
