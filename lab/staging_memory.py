"""``python -m lab.staging_memory``: how much host memory each daemon takes to
run one allreduce on device buffers across two daemons (docs/benchmarks.md, "Device
buffers across nodes").

Two daemons joined on loopback, ``--devices emulated:2`` each (plus any daemon flags given
after ``--``), two ranks per daemon; the daemons' anonymous resident memory (RssAnon: host
memory; emulated device memory is a memfd, counted apart) is sampled every 10 ms during
the allreduce and its growth over a warmed-up baseline printed with the time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from lpsync.units import format_size, parse_size

_NODES, _PER_NODE = 2, 2


def _rank(rank: int, socket: str, count: int, queue, gates: list) -> None:
    import lpsync_client
    from lpsync_client import emulated

    world = _NODES * _PER_NODE
    with lpsync_client.connect(
        socket, job="staging-memory", rank=rank, world_size=world, timeout=600,
        local_rank=rank % _PER_NODE, local_world_size=_PER_NODE,
    ) as client:  # fmt: skip
        for n, gate in zip((1 << 16, count), gates, strict=True):  # a warm-up, then the measured one
            x = emulated.asarray(np.full(n, rank + 1, np.float32), rank % 2, "float32")
            client.register(x)
            client.barrier()
            queue.put(("ready", rank, 0.0, True))
            if rank == 0:
                gate.wait(600)  # the parent took its baseline
            client.barrier()
            start = time.monotonic()
            client.allreduce(x, timeout=600)
            seconds = time.monotonic() - start
            ok = bool((x.get() == world * (world + 1) / 2).all())
            client.release(x)
            queue.put(("done", rank, seconds, ok))


def _anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise LookupError(f"no RssAnon for {pid}")


def measure(nbytes: int, flags: list[str]) -> dict:
    from lpsync.demo.local_cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="lpsync-staging-") as tmp:
        cluster = LocalCluster(Path(tmp), _NODES, ("--devices", "emulated:2", *flags))
        try:
            pids = [node.daemon.pid for node in cluster.nodes]
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            gates = [ctx.Event(), ctx.Event()]
            procs = [
                ctx.Process(
                    target=_rank, args=(r, cluster.nodes[r // _PER_NODE].socket, nbytes // 4, queue, gates)
                )
                for r in range(_NODES * _PER_NODE)
            ]
            for p in procs:
                p.start()
            results: list[tuple[float, bool]] = []
            for gate in gates:
                for _ in procs:
                    assert queue.get(timeout=600)[0] == "ready"
                base = [_anon_kib(pid) for pid in pids]
                peak, stop = list(base), threading.Event()

                def sample(peak: list[int] = peak, stop: threading.Event = stop) -> None:
                    while not stop.wait(0.01):
                        for i, pid in enumerate(pids):
                            peak[i] = max(peak[i], _anon_kib(pid))

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                gate.set()
                results = [queue.get(timeout=600)[2:] for _ in procs]
                stop.set()
                sampler.join()
            for p in procs:
                p.join(60)
        finally:
            cluster.stop()
    return {
        "bytes": nbytes,
        "growth_mib": [(top - low) / 1024 for top, low in zip(peak, base, strict=True)],
        "seconds": [s for s, _ in results],
        "ok": all(ok for _, ok in results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.staging_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", default="256MiB", help="the allreduce's size per rank (default 256MiB)")
    parser.add_argument("flags", nargs="*", help="more daemon flags, after --")
    args = parser.parse_args(argv)
    got = measure(parse_size(args.bytes), args.flags)
    print(
        f"allreduce of {format_size(got['bytes'])} on emulated devices, 2 daemons x 2 ranks "
        f"{' '.join(args.flags)}: host memory growth per daemon "
        + ", ".join(f"{g:.0f} MiB" for g in got["growth_mib"])
        + f"; {max(got['seconds']):.2f} s; results {'correct' if got['ok'] else 'WRONG'}"
    )
    return 0 if got["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
