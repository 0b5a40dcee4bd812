"""The device engine on the emulated device: every schedule compiled onto streams, checked
against numpy, over devices with NVLink-, PCIe- and host-staged links and shared devices."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.engine.device_group import DeviceContext, DeviceGroup
from lpsync.engine.group import layout
from lpsync.errors import InvalidArgumentError
from lpsync.memory import leaked_segments
from lpsync.memory.devices import parse_devices
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.host import HostKind
from lpsync.memory.kind import Span
from lpsync.reduction import Reduction
from lpsync.types import DTYPES, OUT_OF_PLACE_ONLY, Collective, ReduceOp
from tests.collective_cases import (
    OPS_ALGS,
    OPS_ALGS_IDS,
    REDUCING,
    assert_matches,
    in_place_buffer,
    make_inputs,
    out_elements,
    reference,
    roots_for,
)

C = Collective


@pytest.fixture
def context():
    spec = parse_devices("emulated:4,host=1-2,slow=0-3")
    ctx = DeviceContext(EmulatedKind(4, spec.topology))
    yield ctx
    ctx.close()
    ctx.kind.close_kind()


@pytest.fixture
def host_context():
    ctx = DeviceContext(HostKind())
    yield ctx
    ctx.close()
    assert not leaked_segments(os.getpid()), "the staging pool left shared memory behind"


def _span(kind, device: int, data: np.ndarray, keep: list) -> Span:
    memory = kind.allocate(device, max(data.nbytes, 1))
    keep.append(memory)
    memory.array[: data.nbytes] = data.view(np.uint8)
    return Span(memory, 0, data.size, data.dtype)


def run_on_devices(
    ctx: DeviceContext,
    op: C,
    algorithm: str,
    inputs: list[np.ndarray],
    devices: list[int],
    reduce_op: ReduceOp,
    root: int,
    chunks: int,
    in_place: bool,
    runs: int = 1,
    count: int = 37,
) -> list[np.ndarray]:
    p, kind = len(inputs), ctx.kind
    keep: list = []
    pairs = []
    for r, x in enumerate(inputs):
        if in_place:
            data = _span(kind, devices[r], in_place_buffer(op, r, p, count, x, root), keep)
            pairs.append(layout(op, r, p, count, data, True, root))  # type: ignore[arg-type]
        else:
            size = out_elements(op, p, count, r, root)
            pairs.append(
                (_span(kind, devices[r], x, keep), _span(kind, devices[r], np.zeros(size, x.dtype), keep))
            )
    schedule = generate(op, algorithm, p, count, root, chunks)
    reduction = Reduction(reduce_op, inputs[0].dtype, p) if op in REDUCING else None
    with DeviceGroup(ctx, schedule, pairs, reduction) as group:
        for _ in range(runs):
            group.run(time.monotonic() + 30)
    outs = [kind.read(out) for _, out in pairs]
    if not in_place:  # out-of-place inputs are never modified
        for (inp, _), x in zip(pairs, inputs, strict=True):
            assert kind.read(inp).tobytes() == x.tobytes()
    for memory in keep:
        kind.free(memory)
    return outs


LAYOUTS = {"own": [0, 1, 2, 3, 0, 1, 2], "shared": [0, 0, 3, 3, 0, 3, 0], "one": [2] * 7}


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("where", sorted(LAYOUTS))
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in"])
def test_every_schedule_on_devices(context, op, algorithm, p, where, in_place):
    rng = np.random.default_rng(p * 7 + len(where))
    reduce_op = ReduceOp.SUM
    if in_place and op in OUT_OF_PLACE_ONLY:
        pytest.skip(f"{op} runs out of place only")
    for root in roots_for(op, p):
        inputs = make_inputs(op, p, 37, np.dtype(np.float32), reduce_op, rng, root)
        outs = run_on_devices(
            context,
            op,
            algorithm,
            inputs,
            LAYOUTS[where][:p],
            reduce_op,
            root,
            3,
            in_place,
            runs=1 if in_place else 2,
        )
        for r, (got, want) in enumerate(zip(outs, reference(op, reduce_op, inputs, root, 37), strict=True)):
            if op is C.REDUCE and in_place and r != root:
                continue
            assert_matches(got, want, f"{op}/{algorithm} p={p} rank {r}")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("reduce_op", list(ReduceOp))
def test_every_dtype_and_reduce_op(context, dtype, reduce_op):
    rng = np.random.default_rng(3)
    inputs = make_inputs(C.ALLREDUCE, 4, 101, DTYPES[dtype], reduce_op, rng)
    outs = run_on_devices(context, C.ALLREDUCE, "lp", inputs, [0, 1, 2, 3], reduce_op, 0, 4, False, count=101)
    for r, (got, want) in enumerate(
        zip(outs, reference(C.ALLREDUCE, reduce_op, inputs, 0, 101), strict=True)
    ):
        assert_matches(got, want, f"{dtype} {reduce_op} rank {r}")
    assert len({o.tobytes() for o in outs}) == 1  # bitwise identical everywhere


def test_host_staged_link_uses_two_host_slots(context):
    """Devices 1 and 2 have no peer access: their messages go through two host slots."""
    rng = np.random.default_rng(0)
    inputs = make_inputs(C.BROADCAST, 2, 64, np.dtype(np.int32), ReduceOp.SUM, rng)
    before = context.pool.allocated
    outs = run_on_devices(context, C.BROADCAST, "lp", inputs, [1, 2], ReduceOp.SUM, 0, 8, False, count=64)
    assert all(o.tobytes() == inputs[0].tobytes() for o in outs)
    # staging of the receiver (none for broadcast) + 2 host slots on the 1->2 link
    assert context.pool.allocated - before == 2
    assert context.pool.outstanding == 0


def test_staging_pool_reuses_memory(context):
    rng = np.random.default_rng(1)
    inputs = make_inputs(C.ALLREDUCE, 3, 256, np.dtype(np.float64), ReduceOp.SUM, rng)
    run_on_devices(context, C.ALLREDUCE, "lp", inputs, [0, 1, 3], ReduceOp.SUM, 0, 4, False, count=256)
    first = context.pool.allocated
    for _ in range(3):
        run_on_devices(context, C.ALLREDUCE, "lp", inputs, [0, 1, 3], ReduceOp.SUM, 0, 4, False, count=256)
    assert context.pool.allocated == first > 0
    assert context.pool.outstanding == 0


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in"])
def test_the_host_kind_runs_the_same_plans(host_context, op, algorithm, in_place):
    """The host operations table (inline streams) under the same engine, 4 participants."""
    rng = np.random.default_rng(2)
    if in_place and op in OUT_OF_PLACE_ONLY:
        pytest.skip(f"{op} runs out of place only")
    for root in roots_for(op, 4):
        inputs = make_inputs(op, 4, 29, np.dtype(np.int32), ReduceOp.MAX, rng, root)
        outs = run_on_devices(
            host_context, op, algorithm, inputs, [0] * 4, ReduceOp.MAX, root, 3, in_place, count=29
        )
        for r, (got, want) in enumerate(
            zip(outs, reference(op, ReduceOp.MAX, inputs, root, 29), strict=True)
        ):
            if op is C.REDUCE and in_place and r != root:
                continue
            assert_matches(got, want, f"host {op}/{algorithm} rank {r}")
    assert not host_context.pool.outstanding


def test_host_kind_handles_open_by_name():
    kind = HostKind()
    memory = kind.allocate(0, 64)
    memory.array[:] = 9
    opened = kind.open(kind.export(memory), 0)
    assert opened.array.tolist() == [9] * 64
    kind.close(opened)
    kind.free(memory)
    with pytest.raises(InvalidArgumentError):
        kind.open(b"nonsense", 0)
