"""``lpsync paper``: every research question's evidence, measured and simulated, as
DIR/paper.md with its figures (lpsync.paper)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

_DESCRIPTION = """\
Answer the LP paper's five research questions in one report, DIR/paper.md, with PNG
figures under DIR/paper/ (each captioned with what was run, where, when and this command
line) and a section listing where measurement disagrees with the paper, and why:

  RQ1  LP's cost against P: LP, MST and BE simulated to 1024 participants at 1 GiB and
       64 MiB (`lpsync claims`); measured on --nodes emulated nodes with --cluster
  RQ2  effective bandwidth against message size, LP against BE broadcast and reduce,
       simulated and measured (8 emulated nodes, or a local daemon); with --cluster also
       LP against ring allreduce
  RQ3  one training step's gradient allreduces of alexnet, vgg16, resnet50, bert-base and
       gpt2, lpsync against gloo (`lpsync bench --model`), and the share of a step
  RQ4  the digits trained through lpsync, in one process and through gloo (`lpsync demo`):
       loss and accuracy per step, the largest parameter difference, step times
  RQ5  each network's message sizes with the tuner's pick and its gain over the best
       baseline

--quick: simulation and local measurements only, no root, a few minutes. --cluster (root):
RQ1-RQ3 on the emulated cluster (lpsync bench --cluster; ~20 minutes on two cores). One
progress line per step on stderr, and the total time at the end.
"""

MODELS = ("alexnet", "vgg16", "resnet50", "bert-base", "gpt2")
SIM_NODES = "2,4,8,16,64,256,1024"
SIZES = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "paper",
        help="the paper's research questions, measured and simulated, as paper.md with figures",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", default="out", metavar="DIR", help="write DIR/paper.md and DIR/paper/*.png (default out)"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help="simulation and local measurements only (no root; minutes)"
    )
    mode.add_argument(
        "--cluster", action="store_true", help="measure on the emulated cluster too (root; ~20 min)"
    )
    p.add_argument(
        "--nodes", default="2,4,8,16", help="RQ1: node counts measured with --cluster (default 2,4,8,16)"
    )
    p.add_argument(
        "--link", default="1gbit", help="RQ2/RQ3/RQ5: every node's NIC rate, as tc writes it (default 1gbit)"
    )
    hidden = argparse.SUPPRESS  # sizes of the run, for tests and small machines
    p.add_argument("--scaling-link", default="200mbit", help=hidden)
    p.add_argument("--scaling-bytes", default="16MiB", help=hidden)
    p.add_argument("--bandwidth-nodes", type=int, default=8, help=hidden)
    p.add_argument("--sim-nodes", default=SIM_NODES, help=hidden)
    p.add_argument("--sizes", default=SIZES, help=hidden)
    p.add_argument("--models", default=",".join(MODELS), help=hidden)
    p.add_argument("--procs", type=int, default=4, help=hidden)
    p.add_argument("--epochs", type=int, help=hidden)
    p.add_argument("--iters", type=int, help=hidden)
    p.add_argument("--demo-nodes", type=int, default=2, help=hidden)
    p.add_argument("--demo-per-node", type=int, default=2, help=hidden)
    p.add_argument("--peer-transport", default="tcp", help=hidden)
    p.set_defaults(func=run)


def options(args: argparse.Namespace):
    from lpsync.bench.models import MODELS as KNOWN
    from lpsync.cluster import parse_rate
    from lpsync.errors import InvalidArgumentError
    from lpsync.paper.context import PaperOptions
    from lpsync.units import parse_ints, parse_size, parse_sizes

    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if unknown := [m for m in models if m not in KNOWN]:
        raise InvalidArgumentError(f"--models {','.join(unknown)}: expected some of {', '.join(KNOWN)}")
    for flag, rate in (("--link", args.link), ("--scaling-link", args.scaling_link)):
        try:
            parse_rate(rate)
        except ValueError as error:
            raise InvalidArgumentError(f"{flag}: {error}") from None
    sim_nodes = tuple(parse_ints(args.sim_nodes, "--sim-nodes"))
    if len(sim_nodes) < 2 or min(sim_nodes) < 2 or not any(n >= 4 for n in sim_nodes):
        raise InvalidArgumentError("--sim-nodes needs two or more counts >= 2, one of them >= 4")
    nodes = tuple(parse_ints(args.nodes, "--nodes"))
    if len(nodes) < 2 or min(nodes) < 2:
        raise InvalidArgumentError("--nodes needs two or more node counts >= 2 (e.g. 2,4,8,16)")
    if args.procs < 2 or args.bandwidth_nodes < 2:
        raise InvalidArgumentError("--procs and --bandwidth-nodes must be >= 2")
    epochs = args.epochs or (3 if args.quick else 5)
    iters = args.iters or (5 if not (args.quick or args.cluster) else 3)
    if min(epochs, iters, args.demo_nodes, args.demo_per_node) < 1:
        raise InvalidArgumentError("--epochs, --iters, --demo-nodes and --demo-per-node must be >= 1")
    return PaperOptions(
        out=Path(args.out),
        quick=args.quick,
        cluster=args.cluster,
        nodes=nodes,
        link=args.link,
        scaling_link=args.scaling_link,
        scaling_bytes=parse_size(args.scaling_bytes),
        bandwidth_nodes=args.bandwidth_nodes,
        sim_nodes=sim_nodes,
        sizes=tuple(sorted(set(parse_sizes(args.sizes)))),
        models=models,
        procs=args.procs,
        epochs=epochs,
        demo_nodes=args.demo_nodes,
        demo_per_node=args.demo_per_node,
        iters=iters,
        transport=args.peer_transport,
        command="lpsync " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["paper"] else "lpsync paper",
    )


def steps(o) -> int:
    """How many progress steps the run takes (the step counter's denominator)."""
    rq1 = 1 + o.cluster
    rq2 = 1 + (2 if o.cluster else 4)
    return rq1 + rq2 + 1 + len(o.models) + 1 + 1


def run(args: argparse.Namespace) -> int:
    from lpsync.paper import (
        report,
        rq1_scaling,
        rq2_bandwidth,
        rq3_step_comm,
        rq4_convergence,
        rq5_message_mix,
    )
    from lpsync.paper.context import Run, progress

    o = options(args)
    if o.cluster:
        from lpsync.cluster import netns

        netns.require_root()  # before minutes of simulation, not after
    ctx = Run(o, steps(o))
    rq1 = rq1_scaling.run(ctx)
    rq2 = rq2_bandwidth.run(ctx)
    rq4 = rq4_convergence.run(ctx)  # first: RQ3 reads its step times
    rq3 = rq3_step_comm.run(ctx)
    rq5 = rq5_message_mix.run(ctx)  # last: it names what the daemons ran in RQ3
    ctx.begin("writing the report")
    ctx.end()
    path = report.write(ctx, [rq1, rq2, rq3, rq4, rq5])
    progress(f"wrote {path} and {len(list(ctx.figure_dir.glob('*.png')))} figures in {ctx.figure_dir}")
    progress(f"total {ctx.elapsed():.0f} s")
    print(path)
    return 0
