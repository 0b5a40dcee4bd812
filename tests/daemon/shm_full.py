"""Run inside a mount namespace whose /dev/shm is a 4 MiB tmpfs (test_limits.py): a daemon
and a client that asks for more shared memory than the kernel has."""

from __future__ import annotations

import sys
from pathlib import Path

import lpsync_client
from tests.daemon.harness import DaemonProcess


def main(tmp: Path) -> None:
    daemon = DaemonProcess(tmp)
    try:
        with lpsync_client.connect(daemon.socket, job="full", rank=0, world_size=1) as c:
            x = c.zeros(3 << 18, "float32")  # 3 MiB of the 4
            try:
                y = c.empty(3 << 18, "float32")
            except lpsync_client.ResourceExhaustedError as error:
                print("RESOURCE_EXHAUSTED", error)
            else:  # sparse pages: the daemon's first write past the 4 MiB dies of SIGBUS
                c.allreduce(y, algorithm="direct")
            x[:] = 2
            c.allreduce(x, algorithm="direct")  # the daemon writes every page: no SIGBUS
            assert float(x[-1]) == 2.0
    finally:
        daemon.stop_and_check()
    print("STOPPED CLEANLY")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
