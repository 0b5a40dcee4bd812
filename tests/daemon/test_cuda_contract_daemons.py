"""Daemons on the emulated device made as strict as CUDA (issue 25, points 6 and 7), with
real client processes."""

from __future__ import annotations

import gc
import os
import time
import warnings
import weakref
from pathlib import Path

import numpy as np

import lpsync_client
from lpsync_client import emulated
from lpsync_client.errors import InvalidArgumentError
from tests.daemon.harness import DaemonProcess, PeeredDaemons, run_ranks

COUNT = 8192  # 32 KiB of float32: at most 64 KiB, so the data rides the cross-node agreement


def _small_across_nodes(rank: int, sockets: list[str]) -> list[float]:
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
    with lpsync_client.connect(
        sockets[rank], job="small-landed", rank=rank, world_size=2, timeout=60
    ) as client:
        x = emulated.asarray(np.full(COUNT, rank + 1.0, np.float32))
        client.allreduce(x)
        seen = x.host.copy()  # the memory itself, the moment the daemon answered
        return [float(seen.min()), float(seen.max())]


def test_cuda_contract_a_small_cross_node_result_has_landed_when_answered(tmp_path: Path):
    """A collective small enough to ride the agreement is answered only once its result is
    in the clients' device memory (point 6). The emulated devices copy at 200 kB/s, and a
    pageable host-to-device write (kind.write, cudaMemcpy) lands after it returned, as on
    CUDA: answering after one, the client read its own input."""
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:1,bw=200000")
    try:
        for seen in run_ranks(2, _small_across_nodes, daemons.sockets, timeout=120):
            assert seen == [3.0, 3.0], f"the answer came before the result landed: min, max {seen}"
    finally:
        daemons.stop_and_check()


def _hold_false_outlives_its_array(rank: int, socket: str) -> dict:
    """A framework adapter's registration (hold=False) of an array that then goes, as a
    gradient does under zero_grad(set_to_none=True)."""
    with lpsync_client.connect(socket, job="hold-false", rank=rank, world_size=2, timeout=60) as client:
        x = emulated.asarray(np.full(1000, rank + 1.0, np.float32))
        allocation = weakref.ref(x.allocation)
        client.register(x, hold=False)
        client.allreduce(x)
        result = x.get()
        del x
        gc.collect()
        # Released by the client's reaper thread, with no further call of ours: the memory
        # goes back only after that (a set_to_none gradient is not held into the next step).
        deadline = time.monotonic() + 10
        while allocation() is not None and time.monotonic() < deadline:
            time.sleep(0.005)
        return {
            "result": float(result.min()),
            "freed_promptly": allocation() is None,
            "left": client.device_registrations(),
            "freed_while_mapped": list(emulated.freed_while_mapped),
        }


def test_cuda_contract_a_hold_false_registration_keeps_its_memory_until_released(tmp_path: Path):
    """hold=False must not let the array's memory go back to the allocator (which may
    cudaFree its segment: empty_cache, an OOM retry, free_all_blocks) while the daemon maps
    it (point 7): the registration holds the allocation, not the array, until its release
    has been answered (the emulated device reports a free while mapped), and the client's
    reaper thread releases it as soon as the array went."""
    daemon = DaemonProcess(tmp_path, "--devices", "emulated:1")
    try:
        for r in run_ranks(2, _hold_false_outlives_its_array, daemon.socket, timeout=120):
            assert r["result"] == 3.0
            assert r["freed_while_mapped"] == [], "the memory was freed while the daemon mapped it"
            assert r["freed_promptly"], "the registration kept its memory after the array went"
            assert r["left"] == 0
    finally:
        daemon.stop_and_check()


def _freed_under_the_daemon(rank: int, socket: str) -> dict:
    with lpsync_client.connect(socket, job="freed", rank=rank, world_size=2, timeout=60) as client:
        x = emulated.asarray(np.full(1000, rank + 1.0, np.float32))
        h = client.register(x)
        client.allreduce(h)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x.allocation.free()  # cudaFree while the daemon maps it: undefined on CUDA
        try:
            client.allreduce(h)
            refused = ""
        except InvalidArgumentError as error:
            refused = str(error)
        return {
            "warned": [str(w.message) for w in caught],
            "listed": list(emulated.freed_while_mapped),
            "refused": refused,
        }


def test_cuda_contract_memory_freed_while_the_daemon_maps_it_is_reported(tmp_path: Path):
    """The emulated device does not tolerate a free under the daemon's mapping: the client's
    free is reported (a warning, freed_while_mapped) and the daemon refuses the next
    collective on that mapping, INVALID_ARGUMENT naming what happened."""
    daemon = DaemonProcess(tmp_path, "--devices", "emulated:1")
    try:
        for r in run_ranks(2, _freed_under_the_daemon, daemon.socket, timeout=120):
            assert any("freed while a daemon maps them" in w for w in r["warned"]), r
            assert len(r["listed"]) == 1, r
            assert "freed a device allocation while this daemon still maps it" in r["refused"], r
    finally:
        daemon.stop_and_check()
