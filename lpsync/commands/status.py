"""``lpsync status``: sessions, buffers, recent collectives and each job's flight recorder
(what its unfinished collectives wait for, and its last collectives stage by stage)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lpsync.daemon import launch
from lpsync_client import DEFAULT_SOCKET


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show a daemon's sessions and collectives")
    parser.add_argument("--socket", help=f"daemon socket (env LPSYNC_SOCKET; default {DEFAULT_SOCKET})")
    parser.add_argument("--recent", type=int, default=20, help="recent collectives to show")
    parser.add_argument(
        "--history",
        type=int,
        default=5,
        metavar="N",
        help="per job, the last N collectives of its flight recorder with "
        "each rank's arrival and each stage's time (0: all kept)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--token-file", help="bearer token, if the daemon wants one")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    socket = args.socket or os.environ.get("LPSYNC_SOCKET") or DEFAULT_SOCKET
    token = Path(args.token_file).read_text().strip() if args.token_file else ""
    try:
        status = launch.status(socket, args.recent, token, history=args.history)
    except grpc.RpcError as error:
        print(f"lpsync status: cannot reach the daemon at {socket}: {error.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                MessageToDict(
                    status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
                ),
                indent=2,
            )
        )
        return 0
    print(f"lpsync daemon {status.version} on {socket}, up {status.uptime_seconds:.0f} s")
    _print_peer_plane(status.peer_plane)
    print(f"\nsessions ({len(status.sessions)})")
    print(f"  {'job':<16} {'rank':>4} {'world':>5} {'pid':>8} {'buffers':>7} {'bytes':>12}  session")
    for s in status.sessions:
        print(
            f"  {s.job:<16} {s.rank:>4} {s.world_size:>5} {s.pid:>8} {s.buffers:>7} "
            f"{s.registered_bytes:>12}  {s.session_id[:12]}"
        )
    if status.devices:
        print(f"\ndevices ({len(status.devices)})")
        print(
            f"  {'device':<12} {'registered':>12} {'open allocs':>11} {'ipc opens':>9} {'closes':>6}  links"
        )
        for d in status.devices:
            print(
                f"  {d.name:<12} {d.registered_bytes:>10} B {d.open_allocations:>11} "
                f"{d.ipc_opens:>9} {d.ipc_closes:>6}  {d.links}"
            )
    print(f"\nbuffers ({len(status.buffers)})")
    for b in status.buffers:
        kind = "device" if b.device else "registered" if b.staged else "allocated"
        print(
            f"  {b.handle:>6} {b.nbytes:>12} B  {kind:<10} {b.device or b.shm_name}  "
            f"(session {b.session_id[:12]})"
        )
    print(f"\nrecent collectives ({len(status.recent)})")
    print(
        f"  {'job':<16} {'seq':>6} {'op':<14} {'dtype':<8} {'count':>10} {'algorithm':<9} "
        f"{'latency':>10}  {'code':<18} finished"
    )
    for c in status.recent:
        when = time.strftime("%H:%M:%S", time.localtime(c.finished_at))
        print(
            f"  {c.job:<16} {c.sequence:>6} {c.op:<14} {c.dtype:<8} {c.count:>10} "
            f"{c.algorithm:<9} {c.seconds * 1e6:>8.1f}us  {c.code:<18} {when}"
        )
    if status.failed_across:
        _print_failed_across(status.failed_across)
    print(f"\njobs ({len(status.jobs)})")
    for job in status.jobs:
        _print_job(job)
    return 0


def ranges(ranks) -> str:
    """0,1,2,3,5 -> '0-3, 5'."""
    out: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r - 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out) or "-"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms"


def _print_peer_plane(peer) -> None:
    """The peer plane's choices at the daemon's start: transport and device path, and why."""
    if not peer.transport:
        print("peer plane: none (a single node)")
        return
    print(f"peer transport: {peer.transport} ({peer.transport_reason})")
    if peer.tcp_congestion:
        print(f"peer sockets' TCP congestion control: {peer.tcp_congestion} ({peer.tcp_congestion_reason})")
    if peer.ucx_tls_reason:
        print(f"UCX_TLS: {peer.ucx_tls or 'UCX chooses'} ({peer.ucx_tls_reason})")
    via = f" via {', '.join(peer.device_transports)}" if peer.device_transports else ""
    gdr = " + GPUDirect RDMA" if peer.gpudirect_rdma else ""
    print(f"peer device path: {peer.device_path}{via}{gdr} ({peer.device_reason})")


def _print_failed_across(failed) -> None:
    from lpsync.daemon.collectives.outcomes import describe

    print(f"\ncollectives that failed on some node ({len(failed)}; as the nodes told at their last mesh-up)")
    for f in failed:
        codes = {n.node: n.code for n in f.nodes}
        flag = "  SPLIT: finished on some nodes, failed on others (buffers differ)" if f.split else ""
        print(f"  {f.job} #{f.sequence}: {describe(list(codes), codes)}{flag}")


def _waits_for(w, attached) -> str:
    """What a waiting collective waits for, by where each rank is: ranks of other nodes
    are attached there (agreeing: their nodes not heard from), not missing."""
    if w.stage == "attaching":  # control/placing.py: the job's layout is not settled yet
        return f"ranks {ranges(w.missing_ranks)} not attached to any node yet"
    if w.missing_nodes:
        return (
            f"ranks {ranges(w.missing_ranks)} attached to node(s) {ranges(w.missing_nodes)}, not heard from"
        )
    absent = [r for r in w.missing_ranks if r not in attached]
    text = f"missing ranks {ranges(w.missing_ranks)}"
    return text + (f" ({ranges(absent)} not attached)" if absent else "")


def _print_job(job) -> None:
    where = f"node {job.node} of {job.nodes}, " if job.nodes > 1 else ""
    print(f"  {job.job}: world {job.world_size}, {where}attached ranks {ranges(job.attached)}")
    if job.path:
        native = (
            f": {job.armed_plans} plan(s) armed, {job.native_answered} answered by the engine "
            f"({job.native_fallbacks} sent back to Python)"
            if job.path == "native"
            else ""
        )
        print(f"    path: {job.path}{native}")
    for w in job.waiting:
        flag = "  STALLED" if w.stalled else ""
        print(
            f"    waiting #{w.sequence} {w.op} {w.stage} for {w.waiting_seconds:.1f} s{flag}: "
            f"{_waits_for(w, job.attached)} (arrived {ranges(w.arrived)})"
        )
    for a in job.receiving_any:
        print(
            f"    waiting: rank {a.rank} receives from any source (tag {a.tag}) for "
            f"{a.waiting_seconds:.1f} s: no rank has sent it a message yet"
        )
    for r in job.history:
        stages = ", ".join(f"{s.stage} {_ms(s.seconds)}" for s in r.stages)
        arrivals = ", ".join(f"{a.rank}+{_ms(a.after_seconds)}" for a in r.arrivals)
        error = f"  {r.message}" if r.message else ""
        print(
            f"    #{r.sequence} {r.op} {r.dtype}x{r.count} {r.algorithm or '-'} {r.code} "
            f"{_ms(r.total_seconds)} [{stages}] arrivals [{arrivals}]{error}"
        )
