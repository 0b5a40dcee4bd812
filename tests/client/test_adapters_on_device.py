"""Every framework adapter on the device path, on the emulated device (issue 22, item 4): the
DDP hook, DistributedOptimizer's fused buckets, the ProcessGroup's calls (coalesced, and
every other op), lpsync_client.torch's calls and JAX leaves (bfloat16 included) run on
device buffers registered by IPC handle, with no host copy in the client. Real daemons
(--devices emulated:2, and a cpu one for the host path); the two ranks are threads, each
with its own client, on emulated devices 0 and 1. Torch tensors and JAX arrays in emulated
memory stand in for CUDA ones (lpsync_client.emulated.tensor; docs/gpu.md).

"No host copy" is shown three ways, per rank (``_Watch``): the client (and the pair
clients of its send/recv) registers no host memory, every collective it sends names
device registrations only, and no torch op in the rank's thread moves data between
emulated device memory and host memory. Results are checked against numpy."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

import lpsync_client
from lpsync_client import _device, emulated
from lpsync_client.wire.proto import lpsync_pb2 as pb
from tests.daemon.harness import DaemonProcess

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import lpsync_client.torch as lpt  # noqa: E402
from lpsync_client.torch.backend import ProcessGroupLpsync  # noqa: E402

LIMIT = 64 << 10  # --max-buffer-bytes: larger tensors go in pieces


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """One daemon serving two emulated devices, shared by this file (each test its own job)."""
    proc = DaemonProcess(
        tmp_path_factory.mktemp("emu"), "--devices", "emulated:2", "--max-buffer-bytes", str(LIMIT)
    )
    try:
        yield proc
    finally:
        proc.stop_and_check()


class _Watch:
    """What a client (and its send/recv pair clients) asks of its daemon: host-memory
    registrations, and the collectives whose buffers are not device registrations."""

    def __init__(self, client: lpsync_client.Client) -> None:
        self.host_registrations: list[int] = []  # their sizes
        self.host_collectives: list[tuple[str, str, int]] = []  # (op, dtype, count)
        self.device_collectives = 0
        self._watch(client)

    def _watch(self, client: lpsync_client.Client) -> None:
        call, send, open_pair = client._call, client._send, client._open_pair

        def _call(method, request, timeout=30.0):
            if isinstance(request, pb.RegisterRequest) and request.device in ("", "cpu"):
                self.host_registrations.append(request.nbytes)
            return call(method, request, timeout)

        def _send(message, hook):
            c = message.collective
            handles = [h for h in (c.input.handle, c.output.handle) if h]
            if handles and all(h in client._device for h in handles):
                self.device_collectives += 1
            elif handles:
                self.host_collectives.append((c.op, c.dtype, c.count))
            return send(message, hook)

        def _open_pair(*args, **kwargs):
            pair = open_pair(*args, **kwargs)
            self._watch(pair)
            return pair

        client._call, client._send, client._open_pair = _call, _send, _open_pair


_COPIES = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::stack"}
_thread = threading.local()


class _HostTraffic(TorchDispatchMode):
    """Torch copies (in this thread) between emulated device memory and host memory: what
    staging a device tensor through host memory takes. The test's own copies (inputs in,
    results out) are made under ``ours()``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and func._schema.name in _COPIES:
            places = {
                _device.emulated_span(t) is not None
                for t in tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor) and t.numel() and not t.is_sparse
            }
            if len(places) == 2:
                self.ops.append(str(func))
        return out


@contextlib.contextmanager
def ours():
    """The test's own copies: not counted."""
    traffic = getattr(_thread, "traffic", None)
    if traffic is not None:
        traffic.paused += 1
    try:
        yield
    finally:
        if traffic is not None:
            traffic.paused -= 1


def _ranks(socket: str, job: str, body, world: int = 2) -> list:
    """``body(client, rank)`` as the ranks of ``job``, one thread each; with each rank's
    _Watch and the host-touching torch ops of its thread: [(result, watch, ops)]. No
    device memory may be freed while the daemon maps it (issue 25, point 7)."""
    results: list = [None] * world
    errors: list = []
    freed_before = len(emulated.freed_while_mapped)

    def rank(r: int) -> None:
        try:
            with lpsync_client.connect(socket, job=job, rank=r, world_size=world, timeout=60) as client:
                watch = _Watch(client)
                with _HostTraffic() as traffic:
                    _thread.traffic = traffic
                    value = body(client, r)
                results[r] = (value, watch, traffic.ops)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert emulated.freed_while_mapped[freed_before:] == [], "freed while the daemon mapped it"
    return results


def _on_device(results: list, host: tuple = ()) -> None:
    """No host copy on any rank: no host registration, no collective on host memory
    (but ``host``: metadata collectives the call makes on purpose), no torch op between
    host and device memory."""
    for r, (_, watch, ops) in enumerate(results):
        assert not ops, f"rank {r}: torch copied between host and device memory: {ops}"
        assert sorted(watch.host_collectives) == sorted(host), f"rank {r}: {watch.host_collectives}"
        assert all(n == 8 for n in watch.host_registrations) and (
            len(watch.host_registrations) == (1 if host else 0)
        ), f"rank {r} registered host memory: {watch.host_registrations}"
        assert watch.device_collectives > 0, f"rank {r}: nothing ran on the device"


def dev(values, dtype=None, device: int = 0) -> torch.Tensor:
    """``values`` in a fresh tensor in emulated device memory."""
    with ours():
        source = torch.as_tensor(np.asarray(values), dtype=dtype)
        t = emulated.tensor(source.numel(), source.dtype, device).view(source.shape)
        t.copy_(source)
    return t


def _np(t: torch.Tensor) -> np.ndarray:
    """A host copy to compare (bfloat16 as float32)."""
    with ours():
        return (t.float() if t.dtype == torch.bfloat16 else t).detach().clone().numpy()


# -- DDP's communication hook -----------------------------------------------------------------
class _Bucket:
    """What DDP hands the hook: the bucket's flat gradients and its index."""

    def __init__(self, index: int, gradients: torch.Tensor) -> None:
        self._index, self._gradients = index, gradients

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._gradients


def test_ddp_hook_reduces_device_buckets_in_place(emu):
    """Buckets on the device are averaged in DDP's own bucket tensor (registered once,
    kept across steps, replaced when DDP rebuilds), a bucket over the buffer limit in
    pieces of a device buffer; bfloat16 too."""
    sizes = (1000, LIMIT // 4 + 100, 333)  # the middle one: two pieces (over the buffer limit)
    dtypes = (torch.float32, torch.float32, torch.bfloat16)

    def grads(r: int, step: int, i: int) -> np.ndarray:
        return np.arange(sizes[i], dtype=np.float32) % 97 + 10 * r + step

    def body(client, r):
        state = lpt.hook_state(client)
        buckets = [
            dev(np.zeros(n, np.float32), dtype=d, device=r) for n, d in zip(sizes, dtypes, strict=True)
        ]
        seen = []
        for step in range(3):
            if step == 2:  # DDP rebuilt bucket 0: another tensor of another size
                buckets[0] = dev(np.zeros(sizes[0] + 8, np.float32), device=r)
            futures = []
            for i, b in enumerate(buckets):
                with ours():  # autograd's writes
                    b.copy_(torch.from_numpy(np.resize(grads(r, step, i), b.numel())).to(b.dtype))
                futures.append(lpt.allreduce_hook(state, _Bucket(i, b)))
            out = [f.wait() for f in futures]
            assert all(o is b for o, b in zip(out, buckets, strict=True)), "not in DDP's own tensor"
            seen.append(([_np(b) for b in buckets], client.device_registrations()))
        replaced, collectives = state.replaced, state.take_stats()[1]
        state.release()
        return seen, replaced, collectives, client.device_registrations()

    results = _ranks(emu.socket, "hook", body)
    _on_device(results)
    for (seen, replaced, collectives, left), _, _ in results:
        for step, (values, registrations) in enumerate(seen):
            for i, got in enumerate(values):
                want = (np.resize(grads(0, step, i), got.size) + np.resize(grads(1, step, i), got.size)) / 2
                np.testing.assert_array_equal(got, want, err_msg=f"step {step} bucket {i}")
            # buckets 0 and 2 in place, bucket 1 as two device pieces: 4, the same every step
            assert registrations == 4, f"step {step}: {registrations} registrations"
        assert replaced == 1 and collectives == 3 * 3
        assert left == 0, "the hook's release left registrations behind"


# -- DistributedOptimizer -------------------------------------------------------------------
def test_distributed_optimizer_fuses_gradients_on_the_device(emu):
    """Parameters (and their gradients) in device memory: the fused buckets are device
    buffers, gradients copied in and out on the device; a bucket over the buffer limit
    in device pieces. The averaged gradients and the step match numpy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(120, 160), torch.nn.Linear(160, 4))
    initial = [p.detach().clone() for p in model.parameters()]
    inputs = [torch.randn(8, 120, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]

    def body(client, r):
        local = torch.nn.Sequential(torch.nn.Linear(120, 160), torch.nn.Linear(160, 4))
        for p, p0 in zip(local.parameters(), initial, strict=True):
            p.data = dev(p0, device=r)
            p.grad = dev(torch.zeros_like(p0), device=r)  # backward accumulates into it
        # 160x120 floats (75 KiB) is over the limit: a bucket of its own, in two pieces.
        opt = lpt.DistributedOptimizer(
            torch.optim.SGD(local.parameters(), lr=0.5),
            local.named_parameters(),
            bucket_bytes=4 << 10,
            client=client,
        )
        # The hooks copy each gradient into its bucket as backward accumulates it.
        local(inputs[r]).pow(2).sum().backward()
        opt.step()
        return [_np(p.grad) for p in local.parameters()], [_np(p) for p in local.parameters()]

    results = _ranks(emu.socket, "optimizer", body)
    _on_device(results)
    want = []
    for r in (0, 1):
        reference = torch.nn.Sequential(torch.nn.Linear(120, 160), torch.nn.Linear(160, 4))
        for p, p0 in zip(reference.parameters(), initial, strict=True):
            p.data = p0.clone()
        reference(inputs[r]).pow(2).sum().backward()
        want.append([p.grad.numpy() for p in reference.parameters()])
    for (grads, params), _, _ in results:
        for i, (g, p) in enumerate(zip(grads, params, strict=True)):
            average = (want[0][i] + want[1][i]) / 2
            np.testing.assert_allclose(g, average, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(p, initial[i].numpy() - 0.5 * average, rtol=1e-5, atol=1e-6)


# -- the torch.distributed backend ------------------------------------------------------------
def _opts(kind, **fields):
    opts = kind()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX


def _backend_ops(pg: ProcessGroupLpsync, r: int) -> dict[str, list[np.ndarray]]:
    """Every op of the backend on rank ``r``'s device tensors; what each left, by name."""
    out: dict[str, list[np.ndarray]] = {}

    def run(name: str, work, *tensors: torch.Tensor) -> None:
        work.wait()
        out[name] = [_np(t) for t in tensors]

    d = r  # this rank's emulated device
    x = dev(np.arange(1000, dtype=np.float32) + r, device=d)
    run("allreduce", pg.allreduce([x], _opts(dist.AllreduceOptions, reduceOp=SUM)), x)
    big = dev(np.arange(LIMIT // 4 + 50, dtype=np.float32) % 101 + r, device=d)  # over the limit
    run("allreduce_big", pg.allreduce([big], _opts(dist.AllreduceOptions, reduceOp=SUM)), big)
    strided = dev(np.arange(48, dtype=np.float32).reshape(8, 6) * (r + 1), device=d).t()
    run("allreduce_strided", pg.allreduce([strided], _opts(dist.AllreduceOptions, reduceOp=MAX)), strided)
    flags = dev(np.array([True, False, r == 1, False]), device=d)
    run("allreduce_bool", pg.allreduce([flags], _opts(dist.AllreduceOptions, reduceOp=SUM)), flags)
    group = [
        dev(np.arange(300, dtype=np.float32) + r, device=d),
        dev(np.arange(77, dtype=np.float32) % 50 + r, dtype=torch.bfloat16, device=d),
        dev(np.arange(9, dtype=np.int64) * (r + 2), device=d),
        dev(np.full(5, 2.0 + r, np.float32), device=d),
    ]
    run(
        "coalesced",
        pg.allreduce_coalesced(group, _opts(dist.AllreduceCoalescedOptions, reduceOp=SUM)),
        *group,
    )
    b = dev(np.full(33, 1.0 + r, np.float64), device=d)
    run("broadcast", pg.broadcast([b], _opts(dist.BroadcastOptions, rootRank=1)), b)
    m = dev(np.arange(20, dtype=np.int32) * (1 - 2 * r), device=d)
    run("reduce", pg.reduce([m], _opts(dist.ReduceOptions, rootRank=0, reduceOp=MAX)), m)
    outs = [dev(np.zeros(10, np.float32), device=d) for _ in range(2)]
    run("allgather", pg.allgather([outs], [dev(np.full(10, 5.0 + r, np.float32), device=d)]), *outs)
    whole = dev(np.zeros(20, np.int64), device=d)
    run(
        "allgather_base",
        pg._allgather_base(whole, dev(np.arange(10, dtype=np.int64) + 100 * r, device=d)),
        whole,
    )
    part = dev(np.zeros(7, np.float32), device=d)
    ins = [dev(np.full(7, 10.0 * r + j, np.float32), device=d) for j in range(2)]
    run(
        "reduce_scatter",
        pg.reduce_scatter([part], [ins], _opts(dist.ReduceScatterOptions, reduceOp=SUM)),
        part,
    )
    part2 = dev(np.zeros(7, np.float32), device=d)
    source = dev(np.arange(14, dtype=np.float32) * (r + 1), device=d)
    run(
        "reduce_scatter_base",
        pg._reduce_scatter_base(part2, source, _opts(dist.ReduceScatterOptions, reduceOp=SUM)),
        part2,
    )
    gathered = [dev(np.zeros(6, np.float32), device=d) for _ in range(2)] if r == 1 else []
    run(
        "gather",
        pg.gather(
            [gathered],
            [dev(np.full(6, 3.0 + r, np.float32), device=d)],
            _opts(dist.GatherOptions, rootRank=1),
        ),
        *gathered,
    )
    got = dev(np.zeros(4, np.float32), device=d)
    pieces = [dev(np.full(4, 7.0 + j, np.float32), device=d) for j in range(2)] if r == 0 else []
    run("scatter", pg.scatter([got], [pieces], _opts(dist.ScatterOptions, rootRank=0)), got)
    sends = [dev(np.full(j + 1 + r, 10.0 * r + j, np.float32), device=d) for j in range(2)]  # uneven
    receives = [dev(np.zeros(r + 1 + i, np.float32), device=d) for i in range(2)]
    run("alltoall", pg.alltoall(receives, sends), *receives)
    even = dev(np.zeros(4, np.float32), device=d)
    run(
        "alltoall_base",
        pg.alltoall_base(even, dev(np.arange(4, dtype=np.float32) + 10 * r, device=d), [], []),
        even,
    )
    message = dev(np.arange(12, dtype=np.float32) + 0.5 if r == 0 else np.zeros(12, np.float32), device=d)
    work = pg.send([message], 1, 3) if r == 0 else pg.recv([message], 0, 3)
    run("send_recv", work, message)
    anyone = dev(np.full(5, 9.0, np.float32) if r == 1 else np.zeros(5, np.float32), device=d)
    work = pg.recv_anysource([anyone], 4) if r == 0 else pg.send([anyone], 0, 4)
    run("recv_any", work, anyone)
    return out


def _backend_expected(r: int) -> dict[str, list[np.ndarray]]:
    a = np.arange
    strided = np.maximum(a(48, dtype=np.float32).reshape(8, 6), 2 * a(48, dtype=np.float32).reshape(8, 6)).T
    return {
        "allreduce": [2 * a(1000, dtype=np.float32) + 1],
        "allreduce_big": [2 * (a(LIMIT // 4 + 50, dtype=np.float32) % 101) + 1],
        "allreduce_strided": [strided],
        "allreduce_bool": [np.array([True, False, True, False])],
        "coalesced": [
            2 * a(300, dtype=np.float32) + 1,
            2 * (a(77, dtype=np.float32) % 50) + 1,
            a(9, dtype=np.int64) * 5,
            np.full(5, 5.0, np.float32),
        ],
        "broadcast": [np.full(33, 2.0)],
        "reduce": [a(20, dtype=np.int32) if r == 0 else a(20, dtype=np.int32) * (1 - 2 * r)],
        "allgather": [np.full(10, 5.0, np.float32), np.full(10, 6.0, np.float32)],
        "allgather_base": [np.concatenate([a(10), a(10) + 100])],
        "reduce_scatter": [np.full(7, 10.0 + 2 * r, np.float32)],
        "reduce_scatter_base": [a(7 * r, 7 * r + 7, dtype=np.float32) * 3],
        "gather": [np.full(6, 3.0, np.float32), np.full(6, 4.0, np.float32)] if r == 1 else [],
        "scatter": [np.full(4, 7.0 + r, np.float32)],
        "alltoall": [np.full(r + 1 + i, 10.0 * i + r, np.float32) for i in range(2)],
        "alltoall_base": [np.concatenate([a(2 * r, 2 * r + 2), a(2 * r, 2 * r + 2) + 10]).astype(np.float32)],
        "send_recv": [a(12, dtype=np.float32) + 0.5],
        "recv_any": [np.full(5, 9.0, np.float32)],
    }


def test_process_group_runs_every_op_on_device_buffers(emu):
    """The backend's ops on device tensors: contiguous ones in place, the rest (coalesced
    groups, strided, bool, over the buffer limit, lists of blocks, send/recv) staged in
    pooled device buffers. The only host collective is the one uneven all_to_all makes on
    purpose (the largest block: 8 bytes of metadata)."""

    def body(client, r):
        pg = ProcessGroupLpsync(client, r, 2, 60.0)
        first = _backend_ops(pg, r)
        again = _backend_ops(pg, r)  # the pooled device buffers and registrations are reused
        return first, again, client.device_registrations()

    results = _ranks(emu.socket, "backend", body)
    _on_device(results, host=[("allreduce", "int64", 1)] * 2)
    for r, ((first, again, registrations), _, _) in enumerate(results):
        want = _backend_expected(r)
        for seen in (first, again):
            assert seen.keys() == want.keys()
            for name, values in want.items():
                assert len(seen[name]) == len(values), name
                for got, expected in zip(seen[name], values, strict=True):
                    np.testing.assert_array_equal(got, expected, err_msg=f"rank {r}: {name}")
        assert registrations < 40, f"rank {r}: {registrations} registrations kept: not reused"


def test_torch_calls_run_on_device_buffers(emu):
    """lpsync_client.torch's own calls: allreduce_ (in place, and a strided tensor through a
    contiguous copy on its device), broadcast (bool too) and broadcast_parameters (one fused
    buffer per dtype, built on the device)."""

    def body(client, r):
        x = dev(np.arange(500, dtype=np.float32) * (r + 1), device=r)
        lpt.allreduce_(x, op="sum", client=client)
        strided = dev(np.arange(24, dtype=np.float64).reshape(4, 6) + r, device=r)[:, ::2]
        lpt.allreduce_(strided, op="max", client=client)
        flags = dev(np.array([r == 0, True, False]), device=r)
        lpt.broadcast(flags, root=0, client=client)
        model = {
            "w": dev(np.full((3, 4), 1.0 + r, np.float32), device=r),
            "b": dev(np.full(4, 2.0 + r, np.float32), device=r),
            "steps": dev(np.array([10 + r]), device=r),
        }
        lpt.broadcast_parameters(model, root=1, client=client)
        return _np(x), _np(strided), _np(flags), {k: _np(v) for k, v in model.items()}

    results = _ranks(emu.socket, "ops", body)
    _on_device(results)
    for (x, strided, flags, model), _, _ in results:
        np.testing.assert_array_equal(x, np.arange(500, dtype=np.float32) * 3)
        np.testing.assert_array_equal(strided, (np.arange(24, dtype=np.float64).reshape(4, 6) + 1)[:, ::2])
        assert flags.tolist() == [True, True, False]
        np.testing.assert_array_equal(model["w"], np.full((3, 4), 2.0, np.float32))
        np.testing.assert_array_equal(model["b"], np.full(4, 3.0, np.float32))
        assert model["steps"].tolist() == [11]


# -- JAX ----------------------------------------------------------------------------------------
def test_jax_leaves_on_the_device_bfloat16_included(emu):
    """JAX leaves in device memory (imported from emulated memory through DLPack, as a GPU
    array is in GPU memory) are copied on their device and reduced there, bfloat16 too;
    the leaves stay as they were, and the results are the reduced device buffers. (No host
    leaves here: their fused buffers are one per process, and these ranks are threads.)"""
    jax = pytest.importorskip("jax")
    lpj = pytest.importorskip("lpsync_client.jax")

    def leaf(values, dtype, device: int):
        return jax.dlpack.from_dlpack(dev(values, dtype=dtype, device=device))  # zero copy

    def body(client, r):
        tree = {
            "w": leaf(np.arange(100, dtype=np.float32).reshape(2, 50) + r, torch.float32, r),
            "b": leaf(np.arange(77, dtype=np.float32) % 60 + r, torch.bfloat16, r),
            "n": [leaf(np.arange(9, dtype=np.int32) * (r + 2), torch.int32, r)],  # (JAX's int: 32 bits)
        }
        summed = lpj.allreduce(tree, op="sum", client=client)
        mean = lpj.pmean({"w": tree["w"]}, client=client)
        in_device_memory = [
            emulated.find(x.unsafe_buffer_pointer(), x.nbytes) is not None
            for x in (summed["w"], summed["n"][0])
        ]
        as_np = {k: np.asarray(v, dtype=np.float64) for k, v in (("w", summed["w"]), ("b", summed["b"]))}
        return (
            as_np,
            np.asarray(summed["n"][0]),
            np.asarray(mean["w"]),
            np.asarray(tree["w"]),
            in_device_memory,
        )

    results = _ranks(emu.socket, "jax", body)
    _on_device(results)
    w = np.arange(100, dtype=np.float32).reshape(2, 50)
    for r, ((summed, n, mean, kept, in_device_memory), _, _) in enumerate(results):
        np.testing.assert_array_equal(summed["w"], 2 * w + 1)
        np.testing.assert_array_equal(summed["b"], 2 * (np.arange(77) % 60) + 1)
        np.testing.assert_array_equal(n, np.arange(9, dtype=np.int32) * 5)
        np.testing.assert_array_equal(mean, w + 0.5)
        np.testing.assert_array_equal(kept, w + r)  # JAX arrays are immutable: untouched
        assert in_device_memory == [True, True], "a result left the device"


def test_jax_bfloat16_gpu_arrays_are_described_by_pointer(monkeypatch):
    """A bfloat16 GPU array has no __cuda_array_interface__ typestr: the JAX adapter
    describes its copy by pointer, as the allocation's IPC handle plus offset (the CUDA
    driver is a recording stand-in here)."""
    pytest.importorskip("jax")
    lpj = pytest.importorskip("lpsync_client.jax")
    from lpsync_client import _cuda
    from tests.client.test_cuda_contract_client import _Driver

    fake = _Driver()
    monkeypatch.setattr(_cuda, "_driver", lambda: fake)
    monkeypatch.setattr(_cuda, "_cache", {})

    class GpuArray:  # what _Bfloat16 reads of a JAX GPU array
        size, nbytes = 300, 600

        def unsafe_buffer_pointer(self) -> int:
            return 0x10040

        def block_until_ready(self) -> None:
            self.ready = True

    array = GpuArray()
    operand = _device.describe(lpj._Bfloat16(array))
    info = operand.info
    assert (info.kind, info.dtype, info.count, info.nbytes, info.offset) == (
        "cuda",
        "bfloat16",
        300,
        600,
        0x40,
    )
    assert info.allocation_bytes == 1 << 20 and info.handle.endswith(b"GPU-UUID-0123456")
    assert operand.order() == b"" and array.ready  # XLA's work waited for on the host


# -- off the device path ------------------------------------------------------------------------
def test_a_daemon_without_devices_stages_device_tensors_through_host_memory(daemon):
    """A daemon serving no devices: the same calls on device tensors stage through shared
    memory instead (and are still right)."""

    def body(client, r):
        x = dev(np.arange(100, dtype=np.float32) + r, device=r)
        lpt.allreduce_(x, op="sum", client=client)
        state = lpt.hook_state(client)
        bucket = dev(np.full(50, 1.0 + r, np.float32), device=r)
        halves = dev(np.full(30, 1.0 + r, np.float32), dtype=torch.bfloat16, device=r)
        lpt.allreduce_hook(state, _Bucket(0, bucket)).wait()
        lpt.allreduce_hook(state, _Bucket(1, halves)).wait()
        state.release()
        pg = ProcessGroupLpsync(client, r, 2, 60.0)
        group = [dev(np.full(4, 1.0 + r, np.float32), device=r), dev(np.arange(3) + r, device=r)]
        pg.allreduce_coalesced(group, _opts(dist.AllreduceCoalescedOptions, reduceOp=SUM)).wait()
        return _np(x), _np(bucket), _np(halves), [_np(t) for t in group]

    results = _ranks(daemon.socket, "host", body)
    for (x, bucket, halves, group), watch, _ in results:
        assert watch.device_collectives == 0 and watch.host_collectives
        np.testing.assert_array_equal(x, 2 * np.arange(100, dtype=np.float32) + 1)
        np.testing.assert_array_equal(bucket, np.full(50, 1.5, np.float32))
        np.testing.assert_array_equal(halves, np.full(30, 1.5, np.float32))
        np.testing.assert_array_equal(group[0], np.full(4, 3.0, np.float32))
        np.testing.assert_array_equal(group[1], 2 * np.arange(3) + 1)
