"""lpsync.memory.cuda's own logic without a GPU: the module imported against a stand-in for
cupy's runtime that records each call and the thread it came from and returns the statuses
the CUDA documentation lists. What the runtime does with them is the GPU check's to see
(scripts/gpu_check.sh); here: which calls the kind makes, where, and what it does with
each answer.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
import types
from collections.abc import Iterator

import numpy as np
import pytest

from lpsync.errors import CollectiveTimeoutError, UnavailableError
from lpsync.memory.kind import Releaser
from lpsync.types import ReduceOp

READY, NOT_READY, ILLEGAL_ADDRESS = 0, 600, 700  # cudaSuccess, cudaErrorNotReady, cudaErrorIllegalAddress


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"cudaError {status}")
        self.status = status


class Runtime(types.ModuleType):
    """cupy.cuda.runtime's calls the tests reach; ``statuses``: what eventQuery answers in
    turn (an int is returned, an exception raised), as cupy does for either."""

    CUDARuntimeError = CUDARuntimeError

    def __init__(self) -> None:
        super().__init__("cupy.cuda.runtime")
        self.statuses: list = []
        self.calls: list[tuple[str, int, str, int | None]] = []  # (call, arg, thread, device)
        self._current = threading.local()
        # A GPU's events: pointer -> [records made, records the device completed]
        self.events: dict[int, list[int]] = {}
        self._gpu = threading.Condition()
        self.pointers = iter(range(1000, 1 << 30))

    def eventCreateWithFlags(self, flags: int) -> int:
        pointer = next(self.pointers)
        self.events[pointer] = [0, 0]
        return pointer

    def eventRecord(self, pointer: int, stream: int) -> None:
        with self._gpu:
            self.events[pointer][0] += 1

    def complete(self, pointer: int) -> None:
        """The device reached the event's latest record."""
        with self._gpu:
            self.events[pointer][1] = self.events[pointer][0]
            self._gpu.notify_all()

    def eventSynchronize(self, pointer: int) -> None:
        """Blocks until the latest record at call time completed (blocking sync)."""
        self._log("eventSynchronize", pointer)
        with self._gpu:
            target = self.events[pointer][0]
            if not self._gpu.wait_for(lambda: self.events[pointer][1] >= target, 30):
                raise CUDARuntimeError(ILLEGAL_ADDRESS)  # a hung test, not a GPU's answer

    def _log(self, name: str, arg: int) -> None:
        self.calls.append(
            (name, arg, threading.current_thread().name, getattr(self._current, "device", None))
        )

    def getDevice(self) -> int:  # cupy's names
        return getattr(self._current, "device", 0)

    def setDevice(self, device: int) -> None:
        self._current.device = device

    def eventQuery(self, pointer: int) -> int:
        self._log("eventQuery", pointer)
        if not self.statuses and pointer in self.events:  # an event of the stand-in GPU
            with self._gpu:
                made, done = self.events[pointer]
            return READY if done >= made else NOT_READY
        status = self.statuses.pop(0)
        if isinstance(status, BaseException):
            raise status
        return status

    def eventDestroy(self, pointer: int) -> None:
        self._log("eventDestroy", pointer)

    def free(self, pointer: int) -> None:
        self._log("free", pointer)

    def freeHost(self, pointer: int) -> None:
        self._log("freeHost", pointer)


@pytest.fixture
def cuda() -> Iterator[tuple[types.ModuleType, Runtime]]:
    """lpsync.memory.cuda bound to the stand-in; the real module state restored after."""
    runtime = Runtime()
    cupy, cupy_cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    cupy.cuda, cupy_cuda.runtime = cupy_cuda, runtime
    cupy.modules = []  # RawModules made (one source: every kernel)
    cupy.loaded = []  # (kernel, device): cupy loads a module's function into the current device
    cupy.launches = []  # (kernel, grid, block, args, stream, device)

    class RawKernel:
        def __init__(self, name: str) -> None:
            self.name = name
            cupy.loaded.append((name, runtime.getDevice()))

        def __call__(self, grid, block, args, stream=None) -> None:
            cupy.launches.append((self.name, grid, block, args, stream, runtime.getDevice()))

    class RawModule:
        def __init__(self, *, code: str) -> None:
            self.code = code
            cupy.modules.append(self)

        def get_function(self, name: str) -> RawKernel:
            assert f"KERNEL void {name}(" in self.code
            return RawKernel(name)

    cupy.RawModule = RawModule
    names = ("cupy", "cupy.cuda", "cupy.cuda.runtime", "lpsync.memory.cuda")
    saved = {name: sys.modules.pop(name, None) for name in names}
    sys.modules.update({"cupy": cupy, "cupy.cuda": cupy_cuda, "cupy.cuda.runtime": runtime})
    try:
        yield importlib.import_module("lpsync.memory.cuda"), runtime
    finally:
        for name in names:
            sys.modules.pop(name, None)
            if saved[name] is not None:
                sys.modules[name] = saved[name]


def _kind(module: types.ModuleType):
    """A CudaKind without its constructor (which counts GPUs): what the calls need."""
    kind = object.__new__(module.CudaKind)
    kind.allowed = frozenset({0, 1})
    kind.releaser = Releaser("lpsync-cuda-release", module._use)
    kind._lock, kind.waiters, kind.handoffs = threading.Lock(), {}, 0
    return kind


def test_cuda_contract_an_event_status_other_than_ready_or_not_ready_fails(cuda):
    module, runtime = cuda
    runtime.statuses = [READY, NOT_READY, CUDARuntimeError(NOT_READY), ILLEGAL_ADDRESS]
    assert module.query(1) is True
    assert module.query(1) is False
    assert module.query(1) is False
    with pytest.raises(UnavailableError, match="700"):
        module.query(1)  # returned, not raised, by cupy: still an error
    runtime.statuses = [CUDARuntimeError(ILLEGAL_ADDRESS)]
    with pytest.raises(UnavailableError, match="700"):
        module.query(1)


def test_cuda_contract_wait_ready_fails_on_an_error_at_once_and_never_queries_a_closed_event(cuda):
    module, runtime = cuda
    kind = _kind(module)
    event = module.CudaIpcEvent(1, 4242)
    runtime.statuses = [NOT_READY, NOT_READY, ILLEGAL_ADDRESS]
    started = time.monotonic()
    with pytest.raises(UnavailableError):
        kind.wait_ready(event, time.monotonic() + 30)  # the first reading polled to the deadline
    assert time.monotonic() - started < 1.0
    runtime.statuses = [NOT_READY] * 100000
    with pytest.raises(CollectiveTimeoutError):
        kind.wait_ready(event, time.monotonic() + 0.05)  # not ready is no failure
    runtime.statuses = []
    kind.close_event(event)
    kind.close_event(event)  # once only: a second eventDestroy is a double free
    assert [c[0] for c in runtime.calls].count("eventDestroy") == 1
    queries = len(runtime.calls)
    with pytest.raises(UnavailableError, match="closed"):
        kind.wait_ready(event, time.monotonic() + 5)
    assert len(runtime.calls) == queries  # the destroyed handle was not queried


def test_cuda_contract_events_and_frees_end_on_the_releaser_with_their_device_current(cuda):
    module, runtime = cuda
    kind = _kind(module)
    try:

        def drop() -> None:  # an event and memory let go of on a thread with device 0 current
            event = module.CudaEvent(1, 77, kind._drop_event)
            kind.free(module.CudaMemory(1, 64, 555, "malloc"))
            kind.free(module.CudaMemory(-1, 64, 666, "host", context=1))
            del event

        thread = threading.Thread(target=drop, name="event-loop-stand-in")
        thread.start()
        thread.join(5)
        assert kind.releaser.flush(5)
        ends = [c for c in runtime.calls if c[0] in ("eventDestroy", "free", "freeHost")]
        assert sorted((name, arg) for name, arg, *_ in ends) == [
            ("eventDestroy", 77),
            ("free", 555),
            ("freeHost", 666),
        ]
        assert {(thread, device) for *_, thread, device in ends} == {("lpsync-cuda-release", 1)}
        explicit = module.CudaEvent(0, 88, kind._drop_event)
        kind.destroy_event(explicit)
        del explicit  # destroyed once, not again when dropped
        assert kind.releaser.flush(5)
        assert [c[:2] for c in runtime.calls if c[0] == "eventDestroy"] == [
            ("eventDestroy", 77),
            ("eventDestroy", 88),
        ]
    finally:
        kind.releaser.stop()


def test_cuda_contract_mig_instances_are_named_by_the_v2_uuid(monkeypatch):
    from lpsync_client import _cuda

    class Driver:
        """cuDeviceGet and the uuid calls: v1 gives every MIG instance its GPU's uuid."""

        def __init__(self, v2: bool) -> None:
            if v2:
                self.cuDeviceGetUuid_v2 = lambda out, device: self._fill(out, b"M" * 16)

        @staticmethod
        def _fill(out, value: bytes) -> int:
            out._obj.raw = value
            return 0

        def cuDeviceGet(self, out, ordinal: int) -> int:
            out._obj.value = ordinal
            return 0

        def cuDeviceGetUuid(self, out, device) -> int:
            return self._fill(out, b"G" * 16)

    monkeypatch.setattr(_cuda, "_driver", lambda: Driver(v2=True))
    assert _cuda.device_uuid(0) == b"M" * 16
    monkeypatch.setattr(_cuda, "_driver", lambda: Driver(v2=False))
    assert _cuda.device_uuid(0) == b"G" * 16  # a driver before CUDA 11.4: v1 is all there is


def test_cuda_contract_every_kernel_is_compiled_at_start_and_reduces_on_raw_pointers(cuda):
    """Second reading, point 10 (issue 47, item 4): the first collective of each (op,
    dtype, device) compiled its kernel inside its deadline, and each reduction built three
    cupy arrays. Now every served dtype and op is compiled and loaded on every device by
    ``warm`` (what the constructor starts), and a reduction is launched on raw pointers,
    on the plan's stream: the stand-in cupy has no ndarray, so building one would fail."""
    from lpsync.memory import cuda_kernels
    from lpsync.memory.kind import Span
    from lpsync.reduction import Reduction
    from lpsync.types import DTYPES

    module, _ = cuda
    cupy = sys.modules["cupy"]
    kind = _kind(module)
    kind._kernels, kind._module, kind._compiling = {}, None, threading.Lock()
    kind.warm()
    assert len(cupy.modules) == 1  # one source, compiled once (cupy caches it per device)
    assert sorted(cupy.loaded) == sorted((n, d) for n in cuda_kernels.names() for d in (0, 1))
    loaded = len(cupy.loaded)
    stream = types.SimpleNamespace(ptr=77, lpsync_device=1)
    memory = types.SimpleNamespace(device=1, address=1 << 40)
    for name in ("float16", "bfloat16", "float32", "int8"):
        dtype = DTYPES[name]
        acc, incoming, out = (Span(memory, k * 4096, 1000, dtype) for k in range(3))
        del cupy.launches[:]
        kind.reduce_async(Reduction(ReduceOp.AVG, dtype, 4), out, acc, incoming, True, stream)
        (combine, *_, s1, d1), (divide, *_, s2, d2) = cupy.launches
        want = cuda_kernels.DTYPES[name][0]
        assert (combine, divide) == (f"lpsync_combine_{want}_sum", f"lpsync_divide_{want}")
        assert s1 is s2 is stream and d1 == d2 == 1  # on the plan's stream, its device current
        assert cupy.launches[0][3] == (acc.lo, incoming.lo, out.lo, 1000)
        assert cupy.launches[1][3] == (out.lo, 1000, 4)
        assert all(isinstance(a, np.integer) for a in cupy.launches[0][3] + cupy.launches[1][3])
    del cupy.launches[:]
    kind.reduce_async(Reduction(ReduceOp.MAX, np.dtype(np.float64), 4), out, acc, incoming, True, stream)
    assert [launch[0] for launch in cupy.launches] == ["lpsync_combine_f64_max"]  # no division
    assert len(cupy.loaded) == loaded  # nothing compiled or loaded inside a collective


def test_cuda_contract_many_concurrent_host_waits_neither_queue_nor_time_out(cuda):
    """300 host waits at once on 20 streams whose work completes in reverse order (second
    reading, point 5). The first reading's helpers (4, then 256 threads) queued waits past
    their count behind waits on streams that finish last: they returned a second late, or
    timed out. Here each stream's waiter wakes its waits as that stream completes them;
    from the second wait on an event, its record reaches the waiter as it is made, so a
    wait is one wake-up."""
    module, runtime = cuda
    kind = _kind(module)
    streams = [types.SimpleNamespace(ptr=10 + i, lpsync_device=i % 2) for i in range(20)]
    events = {id(s): [kind.event(s.lpsync_device) for _ in range(15)] for s in streams}
    try:
        for attempt in range(2):
            for stream in streams:
                for event in events[id(stream)]:
                    kind.record(event, stream)
            handed = kind.handoffs
            woke: dict[int, float] = {}
            failed: list[BaseException] = []

            def wait(event, woke: dict[int, float], failed: list[BaseException]) -> None:
                try:
                    kind.synchronize(event, time.monotonic() + 10)
                    woke[event.ptr] = time.monotonic()
                except BaseException as error:
                    failed.append(error)

            waits = [
                threading.Thread(target=wait, args=(e, woke, failed)) for s in streams for e in events[id(s)]
            ]
            for thread in waits:
                thread.start()
            time.sleep(0.2)  # every wait is pending
            done: dict[int, float] = {}
            for stream in reversed(streams):  # the last waits' streams finish first
                for event in events[id(stream)]:
                    runtime.complete(event.ptr)
                    done[event.ptr] = time.monotonic()
                time.sleep(0.02 if attempt else 0.25)
            for thread in waits:
                thread.join(15)
            assert not failed, failed[:3]
            late = max(woke[p] - done[p] for p in done)
            assert late < 0.4, f"a wait returned {late:.2f} s after its event completed"
            if attempt:  # the records were handed to the waiters as they were made
                assert kind.handoffs == handed
        names = [t.name for t in threading.enumerate() if t.name.startswith("lpsync-cuda-wait")]
        assert len(names) == len(streams)  # one waiter per stream, not one per wait
    finally:
        for stream in streams:
            waiter = kind.waiters.pop(id(stream), None)
            if waiter is not None:
                waiter.stop()
        kind.releaser.stop()
