"""On a GPU: the IPC path's copy bandwidth against a plain device-to-device copy.

Both copies run on one GPU through the cuda memory kind (lpsync.memory.cuda), on one
stream, timed by events: the D2D copy reads memory this process allocated; the IPC copy
reads an allocation another process exported (cudaIpcGetMemHandle) and this one opened
(cudaIpcOpenMemHandle) — the daemon's path. Bandwidth counts the bytes once.
    python -m lpsync.bench.ipc_copy [--mib 256] [--json FILE]
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

ROUNDS = 20


def _exporter(nbytes: int, device: int, conn) -> None:
    from lpsync.memory.cuda import CudaKind

    kind = CudaKind((device,))
    memory = kind.allocate(device, nbytes)
    conn.send(kind.export(memory))
    conn.recv()  # keep the allocation alive until the parent is done
    kind.free(memory)


def _time_copies(kind, dst, src, stream) -> float:
    kind.copy_async(dst, src, stream)  # warm-up
    start, end = kind.timing_event(stream.lpsync_device), kind.timing_event(stream.lpsync_device)
    kind.record(start, stream)
    for _ in range(ROUNDS):
        kind.copy_async(dst, src, stream)
    kind.record(end, stream)
    kind.synchronize(end, time.monotonic() + 120)
    from cupy.cuda import runtime

    return runtime.eventElapsedTime(start.ptr, end.ptr) / 1e3 / ROUNDS  # ms, timing events


def measure(nbytes: int, device: int = 0) -> dict[str, float]:

    from lpsync.memory.cuda import CudaKind
    from lpsync.memory.kind import Span

    kind = CudaKind((device,))

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exporter, args=(nbytes, device, child))
    proc.start()
    try:
        handle = parent.recv()
        opened = kind.open(handle, device)
        own, dst = kind.allocate(device, nbytes), kind.allocate(device, nbytes)
        u8 = np.dtype(np.uint8)
        stream = kind.stream(device)
        d2d = _time_copies(kind, Span(dst, 0, nbytes, u8), Span(own, 0, nbytes, u8), stream)
        ipc = _time_copies(kind, Span(dst, 0, nbytes, u8), Span(opened, 0, nbytes, u8), stream)
        kind.close(opened)
        kind.free(own)
        kind.free(dst)
    finally:
        parent.send("done")
        proc.join(30)
    return {
        "bytes": nbytes,
        "d2d_gbps": nbytes / d2d / 1e9,
        "ipc_gbps": nbytes / ipc / 1e9,
        "ipc_over_d2d": d2d / ipc,
    }


def report(result: dict[str, float]) -> str:
    return (
        f"# copy bandwidth on one GPU, {result['bytes'] / 2**20:.0f} MiB: device-to-device "
        f"{result['d2d_gbps']:.1f} GB/s, through CUDA IPC {result['ipc_gbps']:.1f} GB/s "
        f"({100 * result['ipc_over_d2d']:.0f}% of D2D)"
    )


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes copied, in MiB (default 256)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = measure(args.mib << 20)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":  # a module, so that spawned processes can import it
    main()
