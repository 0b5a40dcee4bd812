"""Device buffers end to end on the emulated device: real daemons (--devices emulated:N),
client processes registering emulated device arrays, results checked against numpy."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

import lpsync_client
import tests.daemon.device_workers as device_workers
from lpsync.daemon.launch import DaemonStartError
from lpsync.types import DATA_COLLECTIVES, Collective, ReduceOp
from lpsync_client import emulated
from tests.collective_cases import (
    assert_matches,
    check_case_results,
    every_case,
    make_inputs,
    reference,
    rotating_cases,
)
from tests.daemon.harness import DaemonProcess, PeeredDaemons, helper_context, run_ranks


def _daemon(tmp_path: Path, devices: str) -> DaemonProcess:
    return DaemonProcess(tmp_path, "--devices", devices)


def _status(socket: str):
    with lpsync_client.connect(socket, job="status", rank=0, world_size=1) as client:
        return client.status()


def _device_rows(socket: str) -> dict[int, object]:
    return {d.index: d for d in _status(socket).devices}


def _threads(pid: int) -> tuple[int, int]:
    """(all threads, emulated stream threads) of a process."""
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # ended meanwhile
            names.append(Path(f"/proc/{pid}/task/{task}/comm").read_text().strip())
    return len(names), sum(n.startswith("lpsync-emu") for n in names)


@pytest.fixture
def emu(tmp_path: Path):
    proc = _daemon(tmp_path, "emulated:2")
    try:
        yield proc
    finally:
        proc.stop_and_check()


def test_every_op_dtype_in_and_out_of_place(emu):
    """Three processes, two of them sharing device 0: every op, dtype and reduce op (and
    empty buffers)."""
    world, count = 3, 67
    cases = every_case(world, count, root=1, seed=10)
    for op in DATA_COLLECTIVES:  # count 0: empty allocations register and run too
        cases.append((op.value, "float32", "sum", False, 0, 0, [b""] * world))
    results = run_ranks(world, device_workers.run_cases, emu.socket, world, [0, 1, 0], cases, timeout=240)
    check_case_results(cases, results, world, inputs_kept=True)
    # Every registration was released: nothing stays open, every open was closed.
    rows = _device_rows(emu.socket)
    assert all(r.open_allocations == 0 and r.registered_bytes == 0 for r in rows.values())
    assert all(r.ipc_opens == r.ipc_closes > 0 for r in rows.values())


def test_collective_is_ordered_after_the_clients_stream(emu):
    """The write sits 0.5 s on each client's stream; the allreduce must see it."""
    results = run_ranks(4, device_workers.ordered_after_stream, emu.socket, 4, 0.5)
    for values in results:
        assert values == [10.0, 10.0, 10.0]


def test_the_client_does_not_wait_on_the_host_for_its_stream(emu):
    """The request carries an interprocess event: the daemon's streams wait for the 1 s
    write still queued on each client's stream, the client does not."""
    results = run_ranks(2, device_workers.ordered_without_host_wait, emu.socket, 2, 1.0)
    for r in results:
        assert r["pending_at_submit"], "the client's event had completed before it submitted"
        assert r["submitted"] < 0.5, f"submitting took {r['submitted']:.2f} s"
        assert r["seen"] == [3.0, 3.0, 3.0]


def test_ipc_cache_opens_an_allocation_once(emu):
    with lpsync_client.connect(emu.socket, job="cache", rank=0, world_size=1) as client:
        alloc = emulated.Allocation(1 << 16, device=1)
        a, b = alloc.array(0, 100, "float32"), alloc.array(4096, 100, "float32")
        ha, hb = client.register(a), client.register(b)
        row = _device_rows(emu.socket)[1]
        assert (row.open_allocations, row.ipc_opens, row.registered_bytes) == (1, 1, 800)
        a.set(np.arange(100))
        client.allreduce(a)  # world of one: the data stays, through the device path
        assert a.get().tolist() == list(range(100))
        client.allreduce(a[10:20])  # inside a registration: no new one
        assert _device_rows(emu.socket)[1].ipc_opens == 1
        ha.release()
        row = _device_rows(emu.socket)[1]
        assert (row.open_allocations, row.ipc_closes) == (1, 0)
        hb.release()
        row = _device_rows(emu.socket)[1]
        assert (row.open_allocations, row.ipc_closes, row.registered_bytes) == (0, 1, 0)
        status = client.status()
    assert status.devices[1].links == "NV X"


def test_client_killed_while_registered_frees_everything(emu, tmp_path):
    threads = _threads(emu.pid)
    ctx = helper_context()
    for attempt in range(3):
        ready = tmp_path / f"ready{attempt}"
        proc = ctx.Process(target=device_workers.register_and_sleep, args=(attempt, emu.socket, str(ready)))
        proc.start()
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and proc.is_alive(), "the client did not register"
            time.sleep(0.05)
        row = _device_rows(emu.socket)[1]
        assert row.open_allocations == 1 and row.registered_bytes == 8000
        proc.kill()
        proc.join(10)
        deadline = time.monotonic() + 5  # DESIGN.md: buffers freed within 2 s
        while _device_rows(emu.socket)[1].open_allocations:
            assert time.monotonic() < deadline, "the dead client's allocation stayed open"
            time.sleep(0.05)
        row = _device_rows(emu.socket)[1]
        assert row.registered_bytes == 0 and row.ipc_opens == row.ipc_closes == attempt + 1
        if attempt == 0:
            threads = _threads(emu.pid)  # streams made by the first collective stay
    total, streams = _threads(emu.pid)
    assert streams == threads[1], "stream threads leaked per client"
    # The gRPC worker pool grows lazily up to its size (4): anything beyond is a leak.
    assert total <= threads[0] + 4, "daemon threads leaked per client"
    # The memfd of a dead client is gone with the last mapping: nothing in /dev/shm either
    # (stop_and_check of the fixture).


def test_device_buffer_errors(emu, tmp_path):
    with lpsync_client.connect(emu.socket, job="errors", rank=0, world_size=1) as client:
        good = emulated.zeros(10, "float32", device=0)
        # A device the daemon does not have.
        bad_device = emulated.zeros(10, "float32", device=5)
        with pytest.raises(lpsync_client.InvalidArgumentError, match="device 5"):
            client.register(bad_device)
        # A handle that is not one.
        from lpsync_client.wire.proto import lpsync_pb2 as pb

        for handle, error in (
            (b"nonsense", lpsync_client.InvalidArgumentError),
            (emulated.HANDLE.pack(emulated.MAGIC, 1, 999, 1, 40, 0), lpsync_client.NotFoundError),
        ):
            with pytest.raises(error):
                client._call(
                    client._stub.Register,
                    pb.RegisterRequest(
                        session_id=client.session_id,
                        nbytes=40,
                        device="emulated",
                        ipc_handle=handle,
                        allocation_bytes=40,
                    ),
                )
        # A span beyond its allocation, a kind the daemon does not serve.
        info = good.__lpsync_device__()
        for kwargs, match in (
            ({"nbytes": 80, "allocation_bytes": 40}, "does not fit"),
            ({"device": "cuda"}, "cannot be registered"),
        ):
            request = {
                "session_id": client.session_id,
                "nbytes": 40,
                "device": "emulated",
                "ipc_handle": info.handle,
                "allocation_bytes": 40,
                **kwargs,
            }
            with pytest.raises(lpsync_client.InvalidArgumentError, match=match):
                client._call(client._stub.Register, pb.RegisterRequest(**request))
        # Host input with a device output.
        with pytest.raises(lpsync_client.InvalidArgumentError, match="both"):
            client.allreduce(client.zeros(10), out=good)
        # The daemon keeps serving, and nothing stayed open.
        client.allreduce(good)
        client.release(good)
    rows = _device_rows(emu.socket)
    assert all(r.open_allocations == 0 for r in rows.values())


def test_bad_ready_events_are_refused(emu, monkeypatch):
    """A collective's ready_event that is not an event handle, or names an event no process
    holds: INVALID_ARGUMENT / NOT_FOUND for that call, nothing kept open, the daemon serves on."""
    import lpsync_client._hot as client_module  # where a request's streams are ordered

    with lpsync_client.connect(emu.socket, job="bad-events", rank=0, world_size=1) as client:
        x = emulated.zeros(10, "float32", device=0)
        client.register(x)
        order = client_module.order_streams
        for handle, error, match in (
            (b"x" * 100, lpsync_client.InvalidArgumentError, "event handle"),
            (
                emulated.EVENT_HANDLE.pack(b"LPXX", os.getpid(), 3, 1),
                lpsync_client.InvalidArgumentError,
                "bad magic",
            ),
            (
                emulated.EVENT_HANDLE.pack(emulated.EVENT_MAGIC, 2**31, 3, 1),
                lpsync_client.NotFoundError,
                "exited",
            ),
        ):

            def garbage(request, operands, handle=handle):
                order(request, operands)
                request.ready_event = handle

            monkeypatch.setattr(client_module, "order_streams", garbage)
            with pytest.raises(error, match=match):
                client.allreduce(x)
        monkeypatch.setattr(client_module, "order_streams", order)
        x.host[:] = 2.0
        client.allreduce(x)  # world of one: unchanged, and the daemon still serves
        assert x.host.tolist() == [2.0] * 10
        client.release(x)
    assert all(r.open_allocations == 0 for r in _device_rows(emu.socket).values())


def test_a_device_named_under_another_ordinal_is_mapped_by_its_uuid(emu):
    """The client's ordinal is made to lie (7): the UUID in the handle decides; an unknown
    UUID is refused by name (test_daemon_gpu.py runs the same on a GPU)."""
    (seen,) = run_ranks(1, device_workers.under_another_ordinal, emu.socket)
    assert seen["allreduce"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert "does not serve" in seen["refused"] and "device 7" in seen["refused"], seen


def test_cpu_daemon_refuses_device_buffers(daemon):
    with lpsync_client.connect(daemon.socket, job="cpu", rank=0, world_size=1) as client:
        with pytest.raises(lpsync_client.InvalidArgumentError, match="--devices"):
            client.register(emulated.zeros(4, "float32"))
        assert not client.status().devices


def test_bad_devices_flag_is_refused(tmp_path):
    with pytest.raises(DaemonStartError, match="emulated:N"):
        _daemon(tmp_path, "gpu:7")


def test_host_staged_topology_end_to_end(tmp_path):
    """No peer access between devices 0 and 1: chunks go through host slots."""
    proc = _daemon(tmp_path, "emulated:2,host=0-1")
    try:
        world, count = 2, 300_000
        rng = np.random.default_rng(5)
        inputs = make_inputs(Collective.ALLREDUCE, world, count, np.dtype(np.float32), ReduceOp.SUM, rng)
        cases = [("allreduce", "float32", "sum", False, 0, count, [x.tobytes() for x in inputs])]
        results = run_ranks(world, device_workers.run_cases, proc.socket, world, [0, 1], cases)
        want = reference(Collective.ALLREDUCE, ReduceOp.SUM, inputs, 0, count)
        for rank in range(world):
            assert_matches(np.frombuffer(results[rank][0][0], np.float32), want[rank], "rank")
        assert _status(proc.socket).devices[0].links == "X HOST"
    finally:
        proc.stop_and_check()


def test_device_buffers_across_two_nodes(tmp_path):
    """Two daemons with emulated devices joined by the peer plane: device spans are staged
    through host memory across nodes; every op, in and out of place."""
    pytest.importorskip("ucxx")
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2")
    try:
        world, count = 4, 1001
        # Several dtypes and reduce ops, rotating over the cases (one daemon pair for all).
        kinds = [
            ("float64", "sum"),
            ("float32", "max"),
            ("int32", "sum"),
            ("bfloat16", "avg"),
            ("float16", "min"),
            ("int64", "prod"),
        ]
        cases = rotating_cases(world, count, kinds, root=3, seed=8)
        results = run_ranks(
            world,
            device_workers.run_cases_on_nodes,
            daemons.sockets,
            2,
            world,
            [0, 1, 1, 0],
            cases,
            timeout=120,
        )
        check_case_results(cases, results, world)
        # Across nodes too, the staging streams wait on the clients' interprocess events.
        for r in run_ranks(2, device_workers.ordered_without_host_wait, daemons.sockets, 2, 1.0, 1):
            assert r["pending_at_submit"] and r["submitted"] < 0.5
            assert r["seen"] == [3.0, 3.0, 3.0]
    finally:
        daemons.stop_and_check()


def test_a_client_killed_mid_cross_node_collective_leaks_nothing(tmp_path):
    """Rank 1 (node 1) dies while its 8 MB are being staged chunk by chunk on slow
    emulated copies: both daemons close every IPC mapping once their staging streams
    drained, keep no extra threads, and serve a correct collective afterwards."""
    pytest.importorskip("ucxx")
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:2,bw=10000000")
    try:
        world, count = 2, 1000
        rng = np.random.default_rng(5)

        def allreduce_is_correct(what: str) -> None:
            inputs = make_inputs(Collective.ALLREDUCE, world, count, np.dtype(np.float32), ReduceOp.SUM, rng)
            cases = [("allreduce", "float32", "sum", True, 0, count, [x.tobytes() for x in inputs])]
            results = run_ranks(
                world,
                device_workers.run_cases_on_nodes,
                daemons.sockets,
                1,
                world,
                [0, 1],
                cases,
                timeout=120,
            )
            want = reference(Collective.ALLREDUCE, ReduceOp.SUM, inputs, 0, count)
            for rank in range(world):
                assert_matches(np.frombuffer(results[rank][0][0], np.float32), want[rank], what)

        allreduce_is_correct("before")  # makes the staging streams, which stay
        pids = [d.pid for d in daemons.daemons]
        threads = [_threads(pid) for pid in pids]
        ctx = helper_context()
        ready = tmp_path / "submitted"
        ranks = [
            ctx.Process(
                target=device_workers.slow_allreduce_on_nodes,
                args=(r, daemons.sockets, 1, world, "slow-x", str(ready)),
            )
            for r in range(world)
        ]
        for p in ranks:
            p.start()
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "rank 1 did not submit"
            time.sleep(0.02)
        time.sleep(0.3)  # chunks are on the staging streams now (8 MB at 10 MB/s)
        ranks[1].kill()
        ranks[1].join(10)
        ranks[0].join(120)
        assert ranks[0].exitcode == 0
        deadline = time.monotonic() + 60
        for socket in daemons.sockets:
            while any(r.open_allocations for r in _device_rows(socket).values()):
                assert time.monotonic() < deadline, "allocations stayed open after the drain"
                time.sleep(0.1)
            assert all(r.ipc_opens == r.ipc_closes for r in _device_rows(socket).values())
        for pid, (total, streams) in zip(pids, threads, strict=True):
            now_total, now_streams = _threads(pid)
            assert now_streams == streams, "stream threads leaked"
            assert now_total <= total + 4, "daemon threads leaked"
        allreduce_is_correct("after")
    finally:
        daemons.stop_and_check()


def test_status_and_metrics_show_devices(tmp_path):
    import subprocess
    import sys
    import urllib.request

    from tests.ports import free_ports

    port = free_ports(1)[0]
    proc = DaemonProcess(tmp_path, "--devices", "emulated:3,islands=3", "--metrics-port", str(port))
    try:
        with lpsync_client.connect(proc.socket, job="seen", rank=0, world_size=1) as client:
            x = emulated.zeros(256, "float64", device=2)
            client.register(x)
            text = subprocess.run(
                [sys.executable, "-m", "lpsync.cli", "status", "--socket", proc.socket],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout
            lines = [line.split() for line in text.splitlines()]
            assert ["emulated:2", "2048", "B", "1", "1", "0", "PCIe", "PCIe", "X"] in lines
            assert any(row[1:5] == ["2048", "B", "device", "emulated:2"] for row in lines)
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert 'lpsync_device_registered_bytes{device="emulated:2"} 2048.0' in metrics
            assert 'lpsync_device_registered_bytes{device="emulated:0"} 0.0' in metrics
    finally:
        proc.stop_and_check()


def test_a_client_killed_mid_collective_is_closed_only_after_the_streams_drain(tmp_path):
    """Closing an IPC mapping under running copies would fault a CUDA context; on the
    emulated device it would poison the streams. The close waits for them; afterwards the
    same devices serve a new job."""
    proc = _daemon(tmp_path, "emulated:2,bw=10000000")  # 10 MB/s: 8 MB copies take ~1 s
    try:
        ctx = helper_context()
        ready = tmp_path / "submitted"
        ranks = [
            ctx.Process(target=device_workers.slow_allreduce, args=(r, proc.socket, 2, "slow", str(ready)))
            for r in range(2)
        ]
        for p in ranks:
            p.start()
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "rank 1 did not submit"
            time.sleep(0.02)
        time.sleep(0.3)  # the collective is on the streams now
        ranks[1].kill()
        ranks[1].join(10)
        ranks[0].join(60)
        assert ranks[0].exitcode == 0
        deadline = time.monotonic() + 30
        while any(r.open_allocations for r in _device_rows(proc.socket).values()):
            assert time.monotonic() < deadline, "allocations stayed open after the drain"
            time.sleep(0.1)
        rows = _device_rows(proc.socket)
        assert all(r.ipc_opens == r.ipc_closes for r in rows.values())
        # The streams are healthy: a new job on both devices is correct.
        world, count = 2, 1000
        rng = np.random.default_rng(4)
        inputs = make_inputs(Collective.ALLREDUCE, world, count, np.dtype(np.float32), ReduceOp.SUM, rng)
        cases = [("allreduce", "float32", "sum", True, 0, count, [x.tobytes() for x in inputs])]
        results = run_ranks(world, device_workers.run_cases, proc.socket, world, [0, 1], cases)
        want = reference(Collective.ALLREDUCE, ReduceOp.SUM, inputs, 0, count)
        for rank in range(world):
            assert_matches(np.frombuffer(results[rank][0][0], np.float32), want[rank], "after")
    finally:
        proc.stop_and_check()


def test_cuda_contract_a_buffer_released_while_its_collective_waits_stays_mapped(emu):
    """Rank 0 releases its device buffer right after its collective arrived, before rank 1
    does: the mapping stays open until the collective is answered (busy from arrival,
    issue 25 point 5), the collective runs on it, and it closes before the reply (so the
    client may free the memory once answered). It used to close at the Release and the
    run was refused ("released ... before it ran"); later it closed just after the reply."""
    with (
        lpsync_client.connect(emu.socket, job="rel", rank=0, world_size=2, timeout=30) as c0,
        lpsync_client.connect(emu.socket, job="rel", rank=1, world_size=2, timeout=30) as c1,
    ):
        x, y = emulated.zeros(64, "float32", device=0), emulated.zeros(64, "float32", device=1)
        x.set(np.arange(64, dtype=np.float32))
        y.set(np.full(64, 10, np.float32))
        hx, hy = c0.register(x), c1.register(y)
        pending = c0.allreduce_async(hx)
        time.sleep(0.2)  # rank 0's collective is waiting for rank 1
        hx.release()
        assert _device_rows(emu.socket)[0].ipc_closes == 0, "closed under a pending collective"
        c1.allreduce(hy)
        pending.result(timeout=30)
        # Closed before the reply: the client may free its memory as soon as it has it.
        assert not x.allocation.mapped_elsewhere(), "the reply came before the mapping closed"
        assert x.get().tolist() == (np.arange(64) + 10).tolist()
        assert y.get().tolist() == (np.arange(64) + 10).tolist()
        row = _device_rows(emu.socket)[0]
        assert (row.open_allocations, row.ipc_closes) == (0, 1)
        hy.release()
