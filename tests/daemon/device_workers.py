"""Client processes for the device tests (spawned: importable top-level functions)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import lpsync_client
from lpsync.types import ROOTED_OPS, Collective, blocks
from lpsync_client import emulated
from lpsync_client._convert import numpy_dtype
from tests.collective_cases import in_place_buffer


def _client(rank: int, socket: str, world: int, job: str) -> lpsync_client.Client:
    return lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=60)


def to_device(values: np.ndarray, device: int, dtype: str, framework: str):
    """``values`` as a device array of ``framework``: emulated, cupy or torch (CUDA); or
    as host memory (``host``: a numpy copy, for ranks of a node that passes host buffers)."""
    if framework == "host":
        return values.copy()
    if framework == "emulated":
        return emulated.asarray(values, device, dtype)
    if framework == "cupy":
        import cupy

        with cupy.cuda.Device(device):
            return cupy.asarray(values)
    import torch

    if dtype == "bfloat16":
        bits = torch.from_numpy(values.view(np.int16).copy())
        return bits.to(f"cuda:{device}").view(torch.bfloat16)
    return torch.from_numpy(values.copy()).to(f"cuda:{device}")


def to_host(array, framework: str) -> np.ndarray:
    if framework == "host":
        return array
    if framework == "emulated":
        return array.get()
    if framework == "cupy":
        import cupy

        return cupy.asnumpy(array)
    import torch

    if array.dtype == torch.bfloat16:
        return array.view(torch.int16).cpu().numpy()
    return array.cpu().numpy()


def _jax_sharing_a_gpu() -> None:
    """JAX takes 75% of the GPU at start by default: several processes cannot share it."""
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def run_cases(
    rank: int,
    socket: str,
    world: int,
    devices: list[int],
    cases: list[tuple],
    framework: str = "emulated",
    algorithm: str = "",
) -> list:
    """Each case: (op, dtype, reduce_op, in_place, root, count, inputs of every rank as bytes).
    Returns, per case, this rank's output bytes and its input buffer's bytes afterwards.
    ``framework`` makes the device arrays (bfloat16 goes through torch outside emulated);
    ``algorithm`` forces one (else the daemon's choice)."""
    results = []
    with _client(rank, socket, world, "devices") as client:
        device = devices[rank]
        for op, dtype, reduce_op, in_place, root, count, inputs in cases:
            dt = numpy_dtype(dtype)
            make = "torch" if dtype == "bfloat16" and framework == "cupy" else framework
            mine = np.frombuffer(inputs[rank], dt)
            c = Collective(op)
            n_in, n_out = blocks(op, world, rank, root)
            if in_place:
                x, out = (
                    to_device(in_place_buffer(c, rank, world, count, mine, root), device, dtype, make),
                    None,
                )
            else:
                # A scatter's non-root has no input, a gather's no output: None (the
                # client then receives into out, or sends x).
                x = to_device(mine, device, dtype, make) if n_in else None
                out = to_device(np.zeros(count * n_out, dt), device, dtype, make) if n_out else None
            kwargs = {"out": out}
            if algorithm:
                kwargs["algorithm"] = algorithm
            if op in ("allreduce", "reduce", "reduce_scatter"):
                kwargs["op"] = reduce_op
            if op in ROOTED_OPS:
                kwargs["root"] = root
            getattr(client, op)(x, **kwargs)
            target = x if out is None else out
            got = b"" if target is None or not n_out else to_host(target, make).tobytes()
            if in_place and n_out < n_in:  # this rank's block of the one buffer
                got = got[rank * count * dt.itemsize : (rank + 1) * count * dt.itemsize]
            results.append((got, b"" if x is None else to_host(x, make).tobytes()))
            for array in (x, out):
                if array is not None and framework != "host":  # host arrays were staged, not registered
                    client.release(array)
    return results


def ordered_after_stream(rank: int, socket: str, world: int, delay: float) -> list[float]:
    """A write queued on the current stream (after ``delay`` s) must be what is reduced."""
    with _client(rank, socket, world, "ordering") as client:
        x = emulated.zeros(1000, "float32", device=rank % 2)
        client.register(x)
        client.barrier()
        x.set_async(np.full(1000, rank + 1.0, np.float32), delay=delay)
        client.allreduce(x)
        return x.get()[:3].tolist()


def register_and_sleep(rank: int, socket: str, ready_file: str) -> None:
    """Register device buffers, say so, then wait to be killed (SIGKILL: no cleanup)."""
    client = lpsync_client.connect(socket, job=f"victim{rank}", rank=0, world_size=1)
    alloc = emulated.Allocation(1 << 20, device=1)
    client.register(alloc.array(0, 1000, "float32"))
    client.register(alloc.array(8192, 1000, "float32"))
    client.allreduce(alloc.array(0, 1000, "float32"))
    with open(ready_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def kill_self_after_register(socket: str, ready_file: str) -> None:
    register_and_sleep(0, socket, ready_file)
    os.kill(os.getpid(), signal.SIGKILL)


def run_cases_on_nodes(
    rank: int,
    sockets: list[str],
    per_node: int,
    world: int,
    devices: list[int],
    cases: list[tuple],
    framework: str = "emulated",
    algorithm: str = "",
) -> list:
    """run_cases for a multi-node job: node-major ranks, each on its node's daemon."""
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    return run_cases(rank, sockets[rank // per_node], world, devices, cases, framework, algorithm)


def under_another_ordinal(rank: int, socket: str, framework: str = "emulated") -> dict:
    """A client whose registrations name its GPU as device 7 (as a rank would under
    another CUDA_VISIBLE_DEVICES): the daemon must map it by the UUID the handle carries.
    Then a handle whose UUID names no GPU of the daemon: refused, not mapped somewhere."""
    import dataclasses

    import lpsync_client._operands as client_module  # where device arrays are described
    from lpsync_client.wire import split_device_uuid, with_device_uuid

    real = client_module.describe
    lie: dict[str, bytes | None] = {"uuid": None}

    def describe(x: object):
        operand = real(x)
        info = dataclasses.replace(operand.info, device=7)
        if lie["uuid"] is not None:
            handle, _ = split_device_uuid(info.handle)
            info = dataclasses.replace(info, handle=with_device_uuid(handle, lie["uuid"]))
        return dataclasses.replace(operand, info=info)

    client_module.describe = describe
    seen: dict = {}
    with _client(rank, socket, 1, "ordinals") as client:
        x = to_device(np.arange(5, dtype=np.float32), 0, "float32", framework)
        client.allreduce(x)
        seen["allreduce"] = to_host(x, framework).tolist()
        client.release(x)
        lie["uuid"] = bytes(16)  # no GPU has the nil UUID
        y = to_device(np.ones(5, dtype=np.float32), 0, "float32", framework)
        try:
            client.allreduce(y)
            seen["refused"] = ""
        except lpsync_client.InvalidArgumentError as error:
            seen["refused"] = str(error)
    return seen


def cupy_register_and_sleep(rank: int, socket: str, ready_file: str) -> None:
    """A cupy client that registers a sub-array, says so, and waits to be killed."""
    import cupy

    client = lpsync_client.connect(socket, job=f"gpu-victim{rank}", rank=0, world_size=1)
    block = cupy.zeros(1 << 20, cupy.float32)
    client.register(block[1024:2048])
    client.allreduce(block[1024:2048])
    with open(ready_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def cupy_ordered_after_stream(rank: int, socket: str, world: int) -> list[float]:
    """A slow kernel on a non-default current stream writes the values; the allreduce
    issued right after (no synchronize by the caller) must reduce what it wrote."""
    import cupy

    slow_fill = cupy.RawKernel(
        r"""
    extern "C" __global__ void slow_fill(float* x, long long n, float v, long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
             i += (long long)blockDim.x * gridDim.x) x[i] = v;
    }""",
        "slow_fill",
    )
    with _client(rank, socket, world, "gpu-ordering") as client:
        x = cupy.zeros(1 << 16, cupy.float32)
        client.register(x)
        client.barrier()
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            slow_fill(
                (64,), (256,), (x, np.int64(x.size), np.float32(rank + 1), np.int64(300_000_000))
            )  # ~0.2 s of spinning
            client.allreduce(x)
            return cupy.asnumpy(x[:3]).tolist()


def frameworks_register(rank: int, socket: str) -> dict[str, list]:
    """cupy, torch and JAX arrays (whichever are installed with CUDA) registered and reduced
    in a world of one; a sub-allocation of a torch caching-allocator block included."""
    seen: dict[str, list] = {}
    with lpsync_client.connect(socket, job="frameworks", rank=0, world_size=1) as client:
        try:
            import cupy

            x = cupy.arange(100, dtype=cupy.float32)
            client.allreduce(x, op="avg")
            seen["cupy"] = cupy.asnumpy(x[:3]).tolist()
        except ImportError:
            pass
        try:
            import torch

            if torch.cuda.is_available():
                big = torch.arange(4096, dtype=torch.float32, device="cuda")
                part = big[1000:1100]  # a sub-allocation: offset 4000 into the block
                client.register(part)
                client.allreduce(part)
                seen["torch"] = part[:3].cpu().tolist()
        except ImportError:
            pass
        try:
            _jax_sharing_a_gpu()
            import jax
            import jax.numpy as jnp

            if jax.default_backend() == "gpu":
                y = jnp.arange(10, dtype=jnp.float32) * 2
                try:
                    client.allreduce(y)  # in place on JAX's buffer: the daemon writes it
                    seen["jax"] = np.asarray(y)[:3].tolist()
                except lpsync_client.InvalidArgumentError as error:  # JAX 0.11: not exportable
                    seen["jax"] = str(error)
        except ImportError:
            pass
        seen["status"] = [(d.index, d.open_allocations, d.ipc_opens) for d in client.status().devices]
    return seen


def slow_allreduce(rank: int, socket: str, world: int, job: str, ready_file: str) -> str:
    """An allreduce over 8 MB on slow emulated links; rank 1 says when it has submitted."""
    with _client(rank, socket, world, job) as client:
        x = emulated.asarray(np.ones(2_000_000, np.float32), device=rank % 2)
        client.register(x)
        client.barrier()
        future = client.allreduce_async(x, algorithm="lp")
        if rank == 1:
            with open(ready_file, "w") as f:
                f.write("submitted")
            time.sleep(60)  # killed here, its collective running on the daemon's streams
        try:
            future.result(timeout=120)
            return "OK"
        except lpsync_client.LpsyncError as error:
            return type(error).__name__


def slow_allreduce_on_nodes(
    rank: int, sockets: list[str], per_node: int, world: int, job: str, ready_file: str
) -> str:
    """slow_allreduce for a multi-node job: node-major ranks, each on its node's daemon."""
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    return slow_allreduce(rank, sockets[rank // per_node], world, job, ready_file)


def ordered_without_host_wait(rank: int, socket: str, world: int, delay: float, per_node: int = 0) -> dict:
    """A slow write queued on the current stream, then an async allreduce: the request
    leaves before that write ran (the client's interprocess event had not completed, so
    nothing waited for it on the host), the daemon's streams wait for it, and work queued
    on the stream after the result sees the reduced values."""
    if per_node:
        os.environ["LOCAL_RANK"] = str(rank % per_node)
        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
        socket = socket[rank // per_node] if isinstance(socket, list) else socket
    with _client(rank, socket, world, f"no-host-wait{per_node}") as client:
        x = emulated.zeros(1000, "float32", device=rank % 2)
        client.register(x)
        client.barrier()
        event = emulated.ready_event(x.device)
        x.set_async(np.full(1000, rank + 1.0, np.float32), delay=delay)
        start = time.monotonic()
        future = client.allreduce_async(x)
        submitted = time.monotonic() - start
        pending_at_submit = event.completed < event.recorded
        future.result(timeout=60)
        seen: list[float] = []
        stream = emulated.current_stream(x.device)
        stream.enqueue(lambda: seen.extend(x.host[:3].tolist()))  # later work on the stream
        stream.synchronize(30)
        return {"submitted": submitted, "pending_at_submit": pending_at_submit, "seen": seen}


def gpu_adapters(rank: int, socket: str, world: int) -> dict:
    """The framework adapters on the device path: torch (allreduce_ and the ProcessGroup's
    allreduce through lpsync_client.torch ops), cupy and, where JAX sees a GPU, jax; each
    result against the sum of (rank + 1), and the registrations that the path made."""
    import cupy
    import torch

    import lpsync_client.cupy as lpc
    from lpsync_client.torch import _ops

    out: dict = {}
    with _client(rank, socket, world, "gpu-adapters") as client:
        t = torch.full((1 << 16,), rank + 1.0, device="cuda")
        _ops.allreduce_(t, op="sum", client=client)
        out["torch"] = t[:3].tolist()
        b = torch.full((4099,), rank + 1.0, device="cuda", dtype=torch.bfloat16)
        _ops.allreduce_(b, op="sum", client=client)
        out["torch_bf16"] = b[:3].float().tolist()
        tree = {"w": cupy.full(1000, rank + 1.0, cupy.float32), "b": [cupy.full(7, rank + 1, cupy.int64)]}
        lpc.allreduce(tree, op="sum", client=client)
        out["cupy"] = [float(tree["w"][0]), int(tree["b"][0][0])]
        out["registrations"] = client.device_registrations()
        try:
            _jax_sharing_a_gpu()
            import jax
            import jax.numpy as jnp

            import lpsync_client.jax as lpj

            gpu = [d for d in jax.devices() if d.platform == "gpu"]
        except Exception:
            gpu = []
        if gpu:
            x = jax.device_put(jnp.full(500, rank + 1.0, jnp.float32), gpu[0])
            out["jax"] = [float(v) for v in lpj.allreduce({"x": x}, op="sum", client=client)["x"][:3]]
    return out


def oneshot_ready_never_fires(rank: int, socket: str, world: int, hold: float) -> dict:
    """Rank 0's ready event is held back ``hold`` s (a write queued before it), past the
    collective's 1 s timeout: every rank hears the timeout's typed error. Then, the write
    done, the same small allreduce runs again (one-shot) and is right; the buffers are
    released (the daemon's status then shows nothing mapped)."""
    with _client(rank, socket, world, "oneshot-ready") as client:
        client.device_host_wait = True  # a timeout is answered where the daemon waits
        x = emulated.asarray(np.full(64, rank + 1.0, np.float32), device=0)
        client.register(x)
        client.barrier()
        if rank == 0:
            x.set_async(np.full(64, 1.0, np.float32), delay=hold)
        try:
            client.allreduce(x, timeout=1.0)
            first = "answered"
        except lpsync_client.LpsyncError as error:
            first = type(error).__name__
        emulated.current_stream(0).synchronize(hold + 30)  # the held write has landed
        x.set(np.full(64, rank + 1.0, np.float32))
        client.barrier()
        client.allreduce(x, timeout=30)
        second = x.get()[:2].tolist()
        client.release(x)
        client.barrier()
        return {"first": first, "second": second}
