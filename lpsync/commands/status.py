"""``lpsync status``: sessions, buffers and recent collectives of a running daemon."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lpsync.daemon.config import DEFAULT_SOCKET


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show a daemon's sessions and collectives")
    parser.add_argument("--socket", help="daemon socket (env LPSYNC_SOCKET; default "
                                         f"{DEFAULT_SOCKET})")
    parser.add_argument("--recent", type=int, default=20, help="recent collectives to show")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--token-file", help="bearer token, if the daemon wants one")
    parser.set_defaults(func=run)


def fetch(socket: str, recent: int = 20, token: str = "", timeout: float = 5.0):
    import grpc

    from lpsync._proto import lpsync_pb2 as pb
    from lpsync._proto import lpsync_pb2_grpc as pb_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = pb_grpc.LpSyncStub(channel)
        return stub.Status(pb.StatusRequest(recent=recent), timeout=timeout, metadata=metadata)


def run(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    socket = args.socket or os.environ.get("LPSYNC_SOCKET") or DEFAULT_SOCKET
    token = Path(args.token_file).read_text().strip() if args.token_file else ""
    try:
        status = fetch(socket, args.recent, token)
    except grpc.RpcError as error:
        print(f"lpsync status: cannot reach the daemon at {socket}: {error.details()}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True), indent=2))
        return 0
    print(f"lpsync daemon {status.version} on {socket}, up {status.uptime_seconds:.0f} s")
    print(f"\nsessions ({len(status.sessions)})")
    print(f"  {'job':<16} {'rank':>4} {'world':>5} {'pid':>8} {'buffers':>7} {'bytes':>12}"
          "  session")
    for s in status.sessions:
        print(f"  {s.job:<16} {s.rank:>4} {s.world_size:>5} {s.pid:>8} {s.buffers:>7} "
              f"{s.registered_bytes:>12}  {s.session_id[:12]}")
    if status.devices:
        print(f"\ndevices ({len(status.devices)})")
        print(f"  {'device':<12} {'registered':>12} {'open allocs':>11} {'ipc opens':>9} "
              f"{'closes':>6}  links")
        for d in status.devices:
            print(f"  {d.name:<12} {d.registered_bytes:>10} B {d.open_allocations:>11} "
                  f"{d.ipc_opens:>9} {d.ipc_closes:>6}  {d.links}")
    print(f"\nbuffers ({len(status.buffers)})")
    for b in status.buffers:
        kind = "device" if b.device else "registered" if b.staged else "allocated"
        print(f"  {b.handle:>6} {b.nbytes:>12} B  {kind:<10} {b.device or b.shm_name}  "
              f"(session {b.session_id[:12]})")
    print(f"\nrecent collectives ({len(status.recent)})")
    print(f"  {'job':<16} {'seq':>6} {'op':<14} {'dtype':<8} {'count':>10} {'algorithm':<9} "
          f"{'latency':>10}  {'code':<18} finished")
    for c in status.recent:
        when = time.strftime("%H:%M:%S", time.localtime(c.finished_at))
        print(f"  {c.job:<16} {c.sequence:>6} {c.op:<14} {c.dtype:<8} {c.count:>10} "
              f"{c.algorithm:<9} {c.seconds * 1e6:>8.1f}us  {c.code:<18} {when}")
    return 0
