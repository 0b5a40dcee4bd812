"""``lpsync demo``: the main job (lpsync.demo): a local two-node cluster trains a CNN on
scikit-learn's digits with BSP-SGD through the DDP hook, checks the result against one
process and times the steps beside DDP over gloo."""

from __future__ import annotations

import argparse
from pathlib import Path

_DESCRIPTION = """\
Start two lpsync daemons on this machine as two nodes (joined over loopback, a fresh cluster
secret), launch --per-node trainers per node with torchrun, and train a small CNN on
scikit-learn's digits (no download) with DDP whose gradients go through lpsync (the comm
hook). Rank 0 prints loss, test accuracy, step time and communication time per epoch.
Then the same training in one process on the combined batch (the largest parameter
difference: BSP-SGD's result is kept) and the same job with DDP over gloo (step times side
by side). Prints each daemon's metrics URL; stops everything it started, also on Ctrl-C.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the main job: BSP-SGD training through lpsync",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=2, help="daemons, one per node (default 2)")
    p.add_argument("--per-node", type=int, default=2, help="trainers per node (default 2)")
    p.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    p.add_argument("--batch", type=int, default=16, help="samples per trainer and step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9; default 0.05)")
    p.add_argument(
        "--script", type=Path, help="the training script (default examples/train_digits.py of the checkout)"
    )
    p.add_argument(
        "--keep-logs", type=Path, metavar="DIR", help="copy the daemons' and trainers' logs to DIR"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lpsync.demo.job import SCRIPT, DemoOptions
    from lpsync.demo.job import run as run_demo
    from lpsync.errors import InvalidArgumentError

    if args.nodes < 1 or args.per_node < 1 or args.epochs < 1 or args.batch < 1:
        raise InvalidArgumentError("--nodes, --per-node, --epochs and --batch must be >= 1")
    return run_demo(
        DemoOptions(
            args.nodes,
            args.per_node,
            args.epochs,
            args.batch,
            args.lr,
            args.script or SCRIPT,
            keep=args.keep_logs,
        )
    )
