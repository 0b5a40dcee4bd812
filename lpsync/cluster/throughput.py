"""Measure a link of the emulated cluster with plain TCP: one sender, one receiver.

    ip netns exec lpsync-n1 python -m lpsync.cluster.throughput serve --port 5201
    ip netns exec lpsync-n0 python -m lpsync.cluster.throughput send --to 198.18.0.2:5201

The receiver prints one JSON line: bytes received, the seconds between the first and
the last byte, and their ratio. Every socket operation has a timeout.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

_BLOCK = 1 << 16


def serve(port: int, timeout: float = 30.0) -> dict[str, float]:
    with socket.create_server(("0.0.0.0", port)) as listener:
        listener.settimeout(timeout)
        print("ready", flush=True)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout)
            buf = bytearray(_BLOCK)
            total, first, last = 0, 0.0, 0.0
            while n := conn.recv_into(buf):
                last = time.perf_counter()
                if total == 0:
                    first = last
                total += n
    seconds = max(last - first, 1e-9)
    return {"bytes": total, "seconds": seconds, "bytes_per_second": total / seconds}


def send(host: str, port: int, seconds: float, timeout: float = 30.0) -> None:
    data = bytes(_BLOCK)
    with socket.create_connection((host, port), timeout=timeout) as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lpsync.cluster.throughput")
    actions = parser.add_subparsers(dest="action", required=True)
    s = actions.add_parser("serve")
    s.add_argument("--port", type=int, default=5201)
    c = actions.add_parser("send")
    c.add_argument("--to", required=True, help="HOST:PORT of the receiver")
    c.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args(argv)
    if args.action == "serve":
        json.dump(serve(args.port), sys.stdout)
        print()
    else:
        host, _, port = args.to.rpartition(":")
        send(host, int(port), args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
