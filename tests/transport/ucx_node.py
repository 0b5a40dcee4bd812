"""One participant as a plain script, for running inside a cluster namespace:

    ip netns exec lpsync-n0 python -m tests.transport.ucx_node --rank 0 --peers 198.18.0.1:13337,...

Runs LP broadcast and LP allreduce over the UCX endpoint (UCX forced to TCP), checks
both against numpy itself and prints one JSON line: ok, and each op's seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from lpsync.algorithms import generate
from lpsync.engine.executor import Plan
from lpsync.reduction import Reduction
from lpsync.transport.addresses import parse_peers
from lpsync.transport.ucx import UcxEndpoint, UcxOptions
from lpsync.types import Collective, ReduceOp, dtype_of
from tests.collective_cases import assert_matches, reference
from tests.transport.ucx_worker import Case, case_inputs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--count", type=int, default=1 << 20)
    args = parser.parse_args()
    peers = tuple(parse_peers(args.peers))
    cases = [
        Case("broadcast", "lp", args.count, root=0, chunks=16, seed=1),
        Case("allreduce", "lp", args.count // 4, chunks=8, seed=2),
    ]
    report: dict[str, object] = {"rank": args.rank, "ok": True, "seconds": []}
    with UcxEndpoint.connect(UcxOptions(args.rank, peers, b"ns secret", tls="tcp")) as ep:
        for index, case in enumerate(cases):
            dtype, p = dtype_of(case.dtype), ep.size
            inputs = case_inputs(case, p)
            schedule = generate(Collective(case.op), case.algorithm, p, case.count, case.root, case.chunks)
            out = np.zeros(schedule.out_elements(args.rank), dtype)
            plan = Plan(schedule, args.rank, (inputs[args.rank], out), Reduction(ReduceOp.SUM, dtype, p))
            start = time.perf_counter()
            plan.run(ep, time.monotonic() + 60, tag_base=index << 32)
            report["seconds"].append(time.perf_counter() - start)  # type: ignore[union-attr]
            want = reference(Collective(case.op), ReduceOp.SUM, inputs, case.root, case.count)
            assert_matches(out, want[args.rank], f"{case}")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
