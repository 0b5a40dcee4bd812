"""``lpsync bench``: the nccl-tests table for a local daemon, or for daemons in an emulated
cluster (--cluster), optionally beside gloo."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lpsync.bench import OPS
from lpsync.errors import InvalidArgumentError, LpsyncError

_DESCRIPTION = """\
Measure collectives through lpsync daemons and print nccl-tests' table: size, count,
type, redop, root, time, algbw, busbw (nccl-tests' formulas) and #wrong (elements that
differ from numpy's answer after a final verified iteration). Progress goes to stderr.
As in nccl-tests, a size is the whole buffer of P blocks for allgather, reduce_scatter,
gather, scatter and alltoall, and count one rank's block; gather and scatter are rooted
at rank 0 (in place there), alltoall runs out of place (a second buffer).

Local (default): starts a daemon (unless --socket names a running one) and --procs client
processes on this machine.

--cluster (root): for each node count in --nodes, builds an emulated cluster (network
namespaces at 198.18.0.x, a tbf-shaped full-duplex NIC of --link per node), starts one
daemon per namespace (peers = every node's address, the --peer-transport, a fresh random
cluster secret) and --procs-per-node client processes per namespace (node-major ranks, as
torchrun numbers them), runs every --op x --bytes x --algorithm, then tears everything
down, also on failure and Ctrl-C. Besides the table it prints the wire limit (bytes /
link rate: an ideal pipeline's time through one NIC) and each time's ratio to it; cpu:
the CPU seconds every node process (ranks; daemons for lpsync) spent on the timed
collectives per GB of message (nbytes x iters; the barriers' CPU measured alone and
subtracted); dmn/rank: CPU us per call of the mean daemon / rank, dsw/rsw: their context
switches per call (each a sleep and a wake-up, what a small collective's CPU is mostly
made of); under each op, the fixed cost of every lpsync point: its median iteration
split into the daemon's stages (arriving, queued, agreeing across nodes, running) and the
client's share; with several node counts, "vs Nn": each time / the same point's on the
fewest nodes. --json prints one object per line per point (op, algorithm, ran, nodes,
bytes, seconds, wire_seconds, x_wire, cpu_s_per_gb, fixed_cost, x_vs_nodes, ...). Time =
median over iterations of the slowest rank; each timed iteration follows a barrier.
Example (8 nodes: ~2 min):

  lpsync bench --cluster --nodes 2,8 --link 1gbit --op broadcast --algorithm lp,be,mst \\
      --bytes 64MiB --compare gloo

Flat in P, 2 to 16 nodes (~5 min): lpsync bench --cluster --nodes 2,4,8,16 \\
      --link 200mbit --op broadcast,reduce --algorithm lp --bytes 64MiB

--model NAME (alexnet, vgg16, resnet50, bert-base, gpt2) replays one training step's
gradient allreduces of that network: every parameter tensor, then DDP's 25 MiB buckets,
all of a step in flight at once; locally, across --local-nodes daemons on loopback, or
with --cluster (across nodes lpsync first runs 13 untimed steps: the tuner's trials of
each size, learning.py). Example: lpsync bench --model resnet50 --procs 4 --compare gloo
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure collectives through daemons (nccl-tests table)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--op",
        default="allreduce",
        help=f"one of {', '.join(OPS)}; with --cluster a comma list (default allreduce)",
    )
    parser.add_argument(
        "--bytes",
        help="sizes: 64MiB, 4:256MiB (doubling) or a comma list (default 4:256MiB; with --cluster 64MiB)",
    )
    parser.add_argument(
        "--algorithm",
        help="force lp, ring, mst, be, linear (gather, scatter), pairwise (alltoall) "
        "(or direct: local only); auto is the tuner's pick (the default); with --cluster a "
        "comma list",
    )
    parser.add_argument(
        "--iters",
        type=int,
        help="timed iterations per point (default: by size, 10..1000; with --cluster 200 up "
        "to 1 MiB, down to 5 from 64 MiB)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="untimed iterations first (default 5; with --cluster 1, and 13 "
        "more for auto: node 0's trials of a size's first calls)",
    )
    parser.add_argument(
        "--compare", choices=["gloo"], help="also run torch.distributed's gloo backend on the same sizes"
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="replay one training step's gradient allreduces of a real network "
        "(alexnet, vgg16, resnet50, bert-base, gpt2): every parameter "
        "tensor, and DDP's 25 MiB buckets (local daemon only)",
    )
    parser.add_argument(
        "--peer-device-path",
        choices=("auto", "staged", "device"),
        help="with --local-nodes: how the daemons carry device chunks between them (their "
        "--peer-device-path; docs/gpu.md); device with --memory cuda also runs the peer "
        "plane on UCX with its cuda transports (UCX_TLS tcp,cuda_copy,cuda_ipc)",
    )
    parser.add_argument(
        "--local-nodes",
        type=int,
        metavar="N",
        help="N daemons on this machine joined by the peer plane on loopback (a fresh "
        "secret), --procs split among them node-major (with --memory cuda or emulated: "
        "the hierarchical device pipeline across daemons)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON (with --cluster: one object per line per point)"
    )
    local = parser.add_argument_group("local daemon")
    local.add_argument("--procs", type=int, help="client processes (ranks; default 2)")
    local.add_argument("--socket", help="use the daemon on this socket if one is serving")
    local.add_argument(
        "--native",
        help="the started daemons' --native: auto, on or off; a comma list (on,off) runs the "
        "sweep once per value, a daemon each, and prints each size's median time side by "
        "side with the ratio to the last value (the baseline); with --cluster each value on "
        "a fresh cluster, its points labelled",
    )
    local.add_argument(
        "--memory",
        choices=["host", "emulated", "cuda"],
        help="where the ranks' buffers live: host shared memory (default), "
        "emulated devices or GPUs (rank r on device r mod N; the daemon "
        "started with --devices to match)",
    )
    local.add_argument(
        "--devices",
        help="the started daemon's --devices (default: to match "
        "--memory: cpu, emulated:min(procs,4), cuda:all)",
    )
    local.add_argument(
        "--trigger",
        choices=["auto", "grpc", "socket"],
        help="send collectives on the daemon's trigger socket, on the gRPC "
        "Session stream, or auto (the client's default: the socket if "
        "offered)",
    )
    cluster = parser.add_argument_group("emulated cluster (needs root)")
    cluster.add_argument(
        "--cluster", action="store_true", help="run daemons and clients inside an emulated cluster"
    )
    cluster.add_argument("--nodes", help="node counts, a comma list: 2,8 (each 2..254)")
    cluster.add_argument(
        "--link", help="every node's NIC rate, each direction, as tc writes it: 1gbit, 100mbit"
    )
    cluster.add_argument(
        "--procs-per-node", type=int, default=1, help="client processes per node (default 1)"
    )
    cluster.add_argument(
        "--prefix",
        default="lpbench",
        help="namespace names PREFIX-n0.. (default lpbench); "
        "`lpsync cluster down --prefix P` removes a leftover",
    )
    cluster.add_argument(
        "--peer-transport",
        metavar="T,...",
        help="the daemons' transport between nodes: auto (default: what a daemon's own "
        "--peer-transport auto picks here, UCX where the node has an RDMA device, else "
        "TCP), ucx, tcp, or ucx,tcp to run every lpsync point on each in turn, each on a "
        "fresh emulated cluster (tcp points are labelled @tcp)",
    )
    cluster.add_argument(
        "--logs",
        metavar="DIR",
        help="keep the daemons' and ranks' logs in DIR/<N>nodes/ (default: "
        "removed; the tail of a failed process's log is printed)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.peer_device_path and (args.model or args.cluster):
            raise InvalidArgumentError("--peer-device-path goes with --local-nodes, not --model or --cluster")
        if args.model:
            return run_model(args)
        return run_cluster(args) if args.cluster else run_local(args)
    except LpsyncError as error:
        print(f"lpsync bench: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1  # bad arguments vs. a failed run


def run_model(args: argparse.Namespace) -> int:
    from lpsync.bench import model_step
    from lpsync.bench.models import tensors
    from lpsync.errors import InvalidArgumentError

    fixed = [
        flag
        for flag, value in (
            ("--bytes", args.bytes),
            ("--algorithm", args.algorithm),
            ("--trigger", args.trigger),
        )
        if value is not None
    ]
    if fixed or args.op != "allreduce":
        raise InvalidArgumentError(
            f"{', '.join(fixed) or '--op'}: --model replays the model's "
            "own allreduces (the tuner picks each message's algorithm)"
        )
    tensors(args.model)  # an unknown name fails before anything starts
    if args.cluster:
        return run_model_cluster(args)
    nodes = args.local_nodes or 1
    options = model_step.ModelOptions(
        args.model,
        (2 * nodes) if args.procs is None else args.procs,
        args.iters or 5,
        1 if args.warmup is None else args.warmup,
        args.compare,
        args.socket,
        nodes,
    )
    if options.procs < 1 or options.iters < 1 or nodes < 1:
        raise InvalidArgumentError("--procs, --iters and --local-nodes must be >= 1")
    if options.procs % nodes:
        raise InvalidArgumentError(f"--procs {options.procs} must be a multiple of --local-nodes {nodes}")
    if nodes > 1 and args.socket:
        raise InvalidArgumentError("--local-nodes starts its own daemons: drop --socket")
    print(model_step.report(options, model_step.run(options), args.json))
    return 0


def run_model_cluster(args: argparse.Namespace) -> int:
    """--model --cluster: the replay on the emulated cluster; the table's algorithm column
    names the message mix, JSON's ``ran`` the algorithms the daemons ran."""
    import dataclasses

    from lpsync.bench import cluster, cluster_report
    from lpsync.bench.model_step import messages
    from lpsync.errors import InvalidArgumentError

    if args.local_nodes is not None:
        raise InvalidArgumentError("--local-nodes and --cluster: pick one")
    step_bytes = 4 * sum(messages(args.model)["per-tensor"])
    args.bytes = str(step_bytes)
    options = dataclasses.replace(cluster_options(args), model=args.model)
    args.bytes = None
    show = cluster_report.emit(args.json)
    wrong = 0
    for points in cluster.run(options):
        show(points)
        wrong += sum(p.wrong for p in points)
    if wrong:
        cluster.progress(f"{wrong} wrong elements: results differ from numpy's")
        return 1
    return 0


def run_local(args: argparse.Namespace) -> int:
    from lpsync.bench import runner
    from lpsync.errors import InvalidArgumentError
    from lpsync.units import parse_sizes

    given = [
        f"--{name.replace('_', '-')}"
        for name in ("nodes", "link", "procs_per_node")
        if getattr(args, name) not in (None, 1)
    ]
    if given:
        raise InvalidArgumentError(f"{', '.join(given)} need --cluster")
    if args.op not in OPS:
        raise InvalidArgumentError(
            f"--op {args.op!r}: expected one of {', '.join(OPS)} (comma lists need --cluster)"
        )
    if args.algorithm and "," in args.algorithm:
        raise InvalidArgumentError(
            f"--algorithm {args.algorithm!r}: one algorithm (comma lists need --cluster)"
        )
    options = runner.Options(
        args.op,
        parse_sizes(args.bytes or "4:256MiB"),
        2 if args.procs is None else args.procs,
        None if args.algorithm == "auto" else args.algorithm,  # auto: the tuner, as with --cluster
        args.iters or 0,
        5 if args.warmup is None else args.warmup,
        args.compare,
        args.socket,
        trigger=args.trigger or "auto",
        memory=args.memory or "host",
        devices=args.devices or "",
        local_nodes=args.local_nodes or 1,
        peer_device_path=args.peer_device_path or "",
    )
    if options.peer_device_path and options.local_nodes < 2:
        raise InvalidArgumentError("--peer-device-path goes with --local-nodes (2 or more daemons)")
    if options.procs < 1 or options.local_nodes < 1:
        raise InvalidArgumentError("--procs and --local-nodes must be >= 1")
    if options.procs % options.local_nodes:
        raise InvalidArgumentError(
            f"--procs {options.procs} must be a multiple of --local-nodes {options.local_nodes}"
        )
    if options.local_nodes > 1 and args.socket:
        raise InvalidArgumentError("--local-nodes starts its own daemons: drop --socket")
    if options.op == "sendrecv" and (options.algorithm or options.procs < 2):
        raise InvalidArgumentError(
            "--op sendrecv is point-to-point (no --algorithm) and needs --procs of 2 or more"
        )
    if options.memory != "host" and options.algorithm == "direct":
        raise InvalidArgumentError("--algorithm direct serves host memory only")
    natives = [v.strip() for v in (args.native or "").split(",") if v.strip()]
    if any(v not in ("auto", "on", "off") for v in natives):
        raise InvalidArgumentError(f"--native {args.native!r}: expected auto, on or off (a comma list)")
    if natives and args.socket:
        raise InvalidArgumentError("--native sets the started daemon's flag: drop --socket")
    if len(natives) > 1:
        return _native_side_by_side(options, natives, args.json)
    if natives:
        options = dataclasses.replace(options, native=natives[0])
    rows = runner.run(options)
    if options.memory != "host" and not args.json:
        print(
            f"# memory: {options.memory} (daemon --devices {options.device_flag()}, rank r on "
            f"device r mod {options.device_count()})"
        )
    print(runner.report(options, rows, args.json))
    if options.memory == "cuda" and not args.json:
        from lpsync.bench import ipc_copy

        print(ipc_copy.report(ipc_copy.measure(max(options.sizes))))
    return 0


def _native_side_by_side(options, natives: list[str], as_json: bool) -> int:
    """The sweep once per --native value (a daemon each, in turn), each table printed, then
    every size's median with the ratio to the last value's."""
    from lpsync.bench import runner

    medians: dict[str, dict[int, float]] = {}
    for native in natives:
        rows = runner.run(dataclasses.replace(options, native=native))
        print(f"# --native {native}")
        print(runner.report(dataclasses.replace(options, native=native), rows, as_json))
        medians[native] = {row.nbytes: row.median() for row in rows["lpsync"]}
    base = natives[-1]
    print(f"# median time per call (us), --native {' vs '.join(natives)}; ratio: each / {base}")
    for nbytes in sorted(medians[base]):
        cells = "  ".join(f"{v}: {medians[v][nbytes] * 1e6:9.1f}" for v in natives)
        ratios = "  ".join(f"{medians[v][nbytes] / medians[base][nbytes]:.2f}x" for v in natives[:-1])
        print(f"{nbytes:>12}  {cells}  {ratios}")
    return 0


def cluster_options(args: argparse.Namespace):
    """The --cluster options from the flags; InvalidArgumentError names the bad flag."""
    from lpsync.bench.cluster import ClusterOptions
    from lpsync.bench.cluster_report import AUTO
    from lpsync.cluster import parse_rate
    from lpsync.errors import InvalidArgumentError
    from lpsync.units import parse_ints, parse_sizes

    local = [
        flag
        for flag, value in (
            ("--procs", args.procs),
            ("--socket", args.socket),
            ("--trigger", args.trigger),
            ("--memory", args.memory),
            ("--devices", args.devices),
        )
        if value is not None
    ]
    if local:
        raise InvalidArgumentError(
            f"{', '.join(local)}: local-daemon flags; with --cluster use --procs-per-node"
        )
    if not args.nodes or not args.link:
        raise InvalidArgumentError("--cluster needs --nodes (e.g. 2,8) and --link (e.g. 1gbit)")

    def items(text: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))

    return ClusterOptions(
        nodes=tuple(parse_ints(args.nodes, "--nodes")),
        rate_bits=parse_rate(args.link),
        ops=items(args.op),
        algorithms=items(args.algorithm or AUTO),
        sizes=tuple(parse_sizes(args.bytes or "64MiB")),
        procs_per_node=args.procs_per_node,
        warmup=1 if args.warmup is None else args.warmup,
        iters=args.iters,
        compare=args.compare,
        prefix=args.prefix,
        logs=args.logs,
        transports=items(args.peer_transport or "auto"),
        natives=items(args.native or "auto"),
    )


def run_cluster(args: argparse.Namespace) -> int:
    from lpsync.bench import cluster, cluster_report

    options = cluster_options(args)
    for note in options.skipped():
        cluster.progress(f"skipped: {note}")
    show = cluster_report.emit(args.json)
    everything = []
    for points in cluster.run(options):
        show(points)
        everything += points
    if not args.json and (lines := cluster_report.scaling(everything)):
        print("\n".join(["# scaling with the node count:", *lines]), flush=True)
    if wrong := sum(p.wrong for p in everything):
        cluster.progress(f"{wrong} wrong elements: results differ from numpy's")
        return 1
    return 0
