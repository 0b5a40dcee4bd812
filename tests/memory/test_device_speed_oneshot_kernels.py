"""The one-shot allreduce kernel (cuda_kernels: issue 47, item 3) and its emulated twin.

The kernel's source, compiled for the host with its host prelude (as the combine kernels
are, tests/memory/test_cuda_contract_kernels.py), is run through ctypes on inputs with
NaN, infinities, signed zeros, subnormals and wrapping integers; the emulated device's
``oneshot_async`` runs on the same inputs; both must be bitwise numpy reduced in rank
order (avg divided once). And both refuse the same buffers (kind.oneshot_refusal)."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from lpsync.errors import InvalidArgumentError
from lpsync.memory import cuda_kernels
from lpsync.memory.emulated import EmulatedKind
from lpsync.memory.kind import Link, Span, Topology, oneshot_refusal
from lpsync.reduction import Reduction
from lpsync.types import DTYPES, ReduceOp
from tests.memory.test_cuda_contract_kernels import CC, _inputs, _library, _pointer, _same

M = cuda_kernels.ONESHOT_MAX
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> ctypes.CDLL:
    if CC is None:
        pytest.skip("no C compiler to build the kernels for the host")
    return _library(str(tmp_path_factory.mktemp("oneshot")))


def _reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """numpy, rank 0 then 1, 2, ...: each step rounded in the dtype; avg divided once."""
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply}.get(op)
    ufunc = ufunc or (np.minimum if op is ReduceOp.MIN else np.maximum)
    acc = inputs[0].copy()
    with np.errstate(all="ignore"):
        for x in inputs[1:]:
            acc = ufunc(acc, x)
        if op is ReduceOp.AVG and len(inputs) > 1:
            if np.issubdtype(acc.dtype, np.integer):
                acc = np.floor_divide(acc, len(inputs))
            else:
                acc = np.divide(acc, np.asarray(len(inputs), dtype=acc.dtype))
    return acc


def _launch(
    kernels: ctypes.CDLL, op: ReduceOp, name: str, ins: list[np.ndarray], outs: list[np.ndarray]
) -> None:
    fn = getattr(kernels, cuda_kernels.oneshot_name(op, name))
    fn.argtypes = [ctypes.c_void_p] * (2 * M) + [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_longlong,
        ctypes.c_longlong,
    ]
    pointers = [_pointer(x) for x in ins] + [None] * (M - len(ins)) + [_pointer(x) for x in outs]
    pointers += [None] * (M - len(outs))
    divisor = len(ins) if op is ReduceOp.AVG else 0
    fn(*pointers, len(ins), len(outs), ins[0].size, divisor)


def _rank_inputs(name: str, op: ReduceOp, p: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(hash((name, op.value, p)) & 0xFFFF)
    arrays: list[np.ndarray] = []
    while len(arrays) < p:
        arrays += _inputs(DTYPES[name], n, rng)
    return [a.copy() for a in arrays[:p]]


@pytest.mark.parametrize("name", list(cuda_kernels.DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_device_speed_oneshot_kernel_is_numpy_in_rank_order(kernels, name: str, op: ReduceOp) -> None:
    n = 1 << 16 if DTYPES[name].itemsize == 2 else 5000
    for p in (1, 2, 3, 7, M):
        ins = _rank_inputs(name, op, p, n)
        want = _reference(ins, op)
        outs = [np.empty_like(ins[0]) for _ in range(min(p, 3))]
        _launch(kernels, op, name, ins, outs)
        for out in outs:
            _same(out, want)
        # In place: every output is its rank's input (the one-GPU in-place allreduce).
        _launch(kernels, op, name, ins, ins)
        for x in ins:
            _same(x, want)


@pytest.fixture
def kind():
    k = EmulatedKind(3, Topology.uniform(3).without_peer_access(0, 2))
    yield k
    k.close_kind()


def _spans(kind: EmulatedKind, device: int, arrays: list[np.ndarray], keep: list) -> list[Span]:
    spans = []
    for a in arrays:
        memory = kind.allocate(device, max(a.nbytes, 1))
        keep.append(memory)
        memory.array[: a.nbytes] = a.view(np.uint8)
        spans.append(Span(memory, 0, a.size, a.dtype))
    return spans


def _run(kind: EmulatedKind, device: int, reduction: Reduction, outs: list[Span], ins: list[Span]) -> None:
    stream = kind.stream(device)
    event = kind.event(device)
    kind.oneshot_async(reduction, outs, ins, stream)
    kind.record(event, stream)
    kind.synchronize(event, time.monotonic() + 30)
    kind.destroy_stream(stream)


@pytest.mark.parametrize("name", list(cuda_kernels.DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_device_speed_oneshot_emulated_twin_matches(kernels, kind, name: str, op: ReduceOp) -> None:
    """The twin against the same reference and the compiled kernel: inputs on devices 0
    and 1 (peers), outputs on device 1, and in place on one device."""
    n, p, keep = 3000, 5, []
    arrays = _rank_inputs(name, op, p, n)
    want = _reference(arrays, op)
    reduction = Reduction(op, DTYPES[name], p)
    ins = _spans(kind, 0, arrays[:2], keep) + _spans(kind, 1, arrays[2:], keep)
    outs = _spans(kind, 1, [np.zeros_like(arrays[0])] * 2, keep)
    _run(kind, 1, reduction, outs, ins)
    for out in outs:
        _same(kind.read(out), want)
    same = _spans(kind, 1, arrays, keep)
    _run(kind, 1, reduction, same, same)  # in place
    compiled = [np.empty_like(arrays[0])]
    _launch(kernels, op, name, arrays, compiled)
    for span in same:
        _same(kind.read(span), compiled[0])


def test_device_speed_oneshot_refusals_are_the_kernels(kind) -> None:
    """What the launch would get wrong is refused at the call, by the one rule both kinds
    apply: too many inputs, mixed counts or dtypes, outputs on another device, inputs over
    a link without peer access, partial overlaps, in place across launches."""
    keep: list = []
    f32 = np.zeros(64, np.float32)
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float32), 2)
    a, b = _spans(kind, 0, [f32, f32], keep)
    (far,) = _spans(kind, 2, [f32], keep)
    (short,) = _spans(kind, 0, [f32[:10]], keep)
    stream = kind.stream(0)
    shifted = Span(a.memory, 4, 60, a.dtype)
    cases = {
        "too many": ([b], [a] * (M + 1)),
        "count": ([b], [a, short]),
        "out elsewhere": ([far], [a]),
        "no peer": ([b], [a, far]),
        "partial overlap": ([shifted], [a, b]),
        "outputs overlap": ([b, b], [a]),
    }
    for what, (outs, ins) in cases.items():
        assert oneshot_refusal(outs, ins, reduction.dtype, 0, kind.topology) is not None, what
        with pytest.raises(InvalidArgumentError):
            kind.oneshot_async(reduction, outs, ins, stream)
    # Exactly an input: allowed for one launch, refused where another launch reads it.
    assert oneshot_refusal([a], [a, b], reduction.dtype, 0, kind.topology) is None
    assert oneshot_refusal([a], [a, b], reduction.dtype, 0, kind.topology, in_place=False) is not None
    kind.destroy_stream(stream)
    assert kind.topology.link(0, 2) == Link.HOST  # what 'no peer' relied on
