"""The device engine against CUDA's rules (issue 25, points 1, 4, 8, 11, 13), on the emulated
device made as strict as CUDA, and where one process can do it on a real GPU (``gpu``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.engine.device_group import DeviceContext, DeviceGroup
from lpsync.engine.staging import HostMirrors
from lpsync.errors import CollectiveTimeoutError, InvalidArgumentError
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Link, Span, Topology
from lpsync.reduction import Reduction
from lpsync.types import Collective, ReduceOp
from lpsync_client import emulated as client_emulated
from lpsync_client.wire import split_device_uuid
from tests.cuda_contract import gpus, kinds, make_kind, span_of


def _allreduce(context: DeviceContext, devices: list[int], keep: list, count: int = 1000) -> tuple:
    """An LP allreduce over one float32 buffer per entry of ``devices``: (group, spans, want)."""
    kind, p = context.kind, len(devices)
    inputs = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(p)]
    spans = [span_of(kind, d, x, keep) for d, x in zip(devices, inputs, strict=True)]
    schedule = generate(Collective.ALLREDUCE, "lp", p, count, 0, 4)
    group = DeviceGroup(
        context, schedule, [(s, s) for s in spans], Reduction(ReduceOp.SUM, np.dtype(np.float32), p)
    )
    return group, spans, sum(inputs)


@pytest.mark.parametrize("name", kinds(need=2))
def test_cuda_contract_an_event_belongs_to_its_device(name):
    """cudaEventRecord needs the event and the stream in one context (point 1)."""
    kind = make_kind(name, 2)
    try:
        event, stream = kind.event(0), kind.stream(1)
        with pytest.raises(InvalidArgumentError, match=r"device|GPU"):
            kind.record(event, stream)
        mine = kind.event(1)
        kind.record(mine, stream)
        kind.synchronize(mine, time.monotonic() + 10)
    finally:
        kind.close_kind()


@pytest.mark.parametrize("name", kinds(need=2))
def test_cuda_contract_a_plan_off_device_0_records_on_its_own_devices(name):
    """Every event of a plan is made on the device of the stream it is recorded on (point
    1): a plan over devices other than 0 runs (it failed at its first record)."""
    kind = make_kind(name, 4 if name == "emulated" else 2)
    devices = [1, 2, 3, 1] if name == "emulated" else [1, 1]
    context, keep = DeviceContext(kind), []
    try:
        group, spans, want = _allreduce(context, devices, keep)
        group.run(time.monotonic() + 30)
        for span in spans:
            np.testing.assert_array_equal(kind.read(span), want)
        group.close()
    finally:
        context.close()
        for memory in keep:
            kind.free(memory)
        kind.close_kind()


def test_cuda_contract_a_dead_clients_event_does_not_block_the_shared_streams():
    """A client event that never completes (its process hung or died mid-kernel) times
    out its own collective only: the streams, shared by every job, never wait on it, so
    the next collective on the same streams runs (point 4)."""
    kind = EmulatedKind(1)
    context, keep = DeviceContext(kind), []
    blocker = threading.Event()
    client_stream, client_event = client_emulated.Stream(0), client_emulated.IpcEvent()
    try:
        client_stream.enqueue(lambda: blocker.wait(60))  # a kernel that never ends
        client_event.record(client_stream)
        ready = kind.open_event(client_event.handle, 0)
        group, spans, want = _allreduce(context, [0, 0], keep)
        with pytest.raises(CollectiveTimeoutError):
            group.run(time.monotonic() + 0.5, [ready, None])
        start = time.monotonic()
        group.run(time.monotonic() + 10)  # another job's turn on the same streams
        assert time.monotonic() - start < 5
        np.testing.assert_array_equal(kind.read(spans[0]), want)
        kind.close_event(ready)
        group.close()
    finally:
        blocker.set()
        context.close()
        for memory in keep:
            kind.free(memory)
        kind.close_kind()


def test_cuda_contract_a_failed_run_drains_before_it_raises():
    """The timeout is answered only once the streams stopped writing into the clients'
    memory (point 8): when ``run`` raises, every stream has reached its final record."""
    kind = EmulatedKind(2, copy_bandwidth=2e6)  # 2 MB/s: 400 kB of peer copies take ~0.2 s
    context, keep = DeviceContext(kind), []
    try:
        group, _, _ = _allreduce(context, [0, 1], keep, count=100_000)
        with pytest.raises(CollectiveTimeoutError):
            group.run(time.monotonic() + 0.02)
        assert all(e.completed == e.recorded for e in group.finals), "raised while the streams ran"
        assert context.pool.outstanding == len(group._held)  # nothing went back under the streams
        group.close()
    finally:
        context.close()
        for memory in keep:
            kind.free(memory)
        kind.close_kind()


def test_cuda_contract_peer_access_once_per_pair_and_too_many_peers_go_through_host():
    """cudaErrorTooManyPeers (a device past 8 peers over PCIe) turns the pair into a
    host-staged link instead of failing the plan, and peer access is enabled once per
    pair, not per plan (point 13)."""
    kind = EmulatedKind(4, max_peers=1)
    context, keep = DeviceContext(kind), []
    try:
        group, spans, want = _allreduce(context, [0, 1, 2, 3], keep)
        group.run(time.monotonic() + 30)
        for span in spans:
            np.testing.assert_array_equal(kind.read(span), want)
        assert kind.peer_refused, "the emulated device refused no pair"
        for a, b in kind.peer_refused:
            assert context.topology.link(a, b) is Link.HOST
        enables = kind.peer_enables
        again, _, _ = _allreduce(context, [0, 1, 2, 3], keep)
        assert kind.peer_enables == enables
        group.close()
        again.close()
    finally:
        context.close()
        for memory in keep:
            kind.free(memory)
        kind.close_kind()


def _off_device_0(kind, context: DeviceContext, keep: list, devices: tuple[int, ...] = (1, 2, 2, 1)) -> None:
    """What a daemon does on devices 1 and 2 only: an allreduce over a host-staged pair
    (pinned host slots), an opened client allocation, host mirrors of device spans (the
    cross-node stage and small collectives), events, synchronize and free."""
    group, spans, want = _allreduce(context, list(devices), keep)
    group.run(time.monotonic() + 30)
    for span in spans:
        np.testing.assert_array_equal(kind.read(span), want)
    group.close()
    mirrors = HostMirrors(kind, [spans[0], None, spans[1], None])
    for mirror in mirrors.mirrors:
        if mirror is not None:
            on = mirror.device.device
            stream, event = context.stream(on, 0, "small"), kind.event(on)
            host = Span(mirror.host, 0, mirror.device.count, mirror.device.dtype)
            kind.copy_async(host, mirror.device, stream)
            kind.record(event, stream)
            kind.synchronize(event, time.monotonic() + 30)
    mirrors.close()


def test_cuda_contract_a_daemon_off_device_0_makes_no_context_there():
    """A daemon serving other GPUs must make no context on GPU 0 (point 11: ~300-500 MB):
    every operation names the device it runs on, pinned host memory included (CUDA
    allocates it in the current device's context, device 0 in a thread that set none)."""
    topology = Topology(
        (
            (Link.SAME, Link.FAST, Link.FAST),
            (Link.FAST, Link.SAME, Link.HOST),
            (Link.FAST, Link.HOST, Link.SAME),
        )
    )
    kind = EmulatedKind(3, topology)
    context, keep = DeviceContext(kind), []
    allocation = client_emulated.Allocation(4096, 1)
    try:
        opened = kind.open(split_device_uuid(allocation.ipc_handle())[0], 1)
        _off_device_0(kind, context, keep)
        kind.close(opened)
        assert context.pool.allocated, "no staging memory was taken: the test covers nothing"
        assert kind.contexts == [0, 1, 1], f"contexts made per device: {kind.contexts}"
    finally:
        context.close()
        for memory in keep:
            kind.free(memory)
        kind.close_kind()
        allocation.free()


_NO_CONTEXT_ON_0 = """
import ctypes, time
import numpy as np
from lpsync.memory.cuda import CudaKind
from lpsync.engine.device_group import DeviceContext
from tests.engine.test_cuda_contract_engine import _off_device_0
kind = CudaKind((1,))
context, keep = DeviceContext(kind), []
_off_device_0(kind, context, keep, (1, 1, 1))
context.close()
for memory in keep:
    kind.free(memory)
cuda = ctypes.CDLL("libcuda.so.1")
flags, active = ctypes.c_uint(), ctypes.c_int()
assert cuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
print("ACTIVE", active.value)
"""


@pytest.mark.gpu
@pytest.mark.skipif(gpus()[0] < 2, reason=gpus()[1] or f"needs 2 GPUs, {gpus()[0]} visible")
def test_cuda_contract_a_daemon_off_device_0_makes_no_context_there_on_gpus():
    """The same on GPU 1 in a fresh process; GPU 0's primary context stays inactive."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _NO_CONTEXT_ON_0], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "ACTIVE 0" in done.stdout, done.stdout
