"""A plan's flat program: the steps of a collective over its participants' buffers.

The direct path (collectives/direct.py) compiles what it does into a Program (copy,
combine, divide over byte ranges of the participants' views and a scratch buffer) and
runs it here with numpy: that is the reference (``--native off``). An armed plan runs the
same Program, encoded (``encode``), in the native engine (program.c), which checks every
range against the buffers once, when it is armed. One compiler, two executors: the
engine executes programs and never plans.

Buffers are numbered: 0 is the scratch (the reduction's accumulator), 1 + 2r the input
view of participant r and 2 + 2r its output view (the same memory in place).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from lpsync.native import engine as native_engine
from lpsync.reduction import Reduction
from lpsync.types import DTYPES, Collective, ReduceOp

COPY, COMBINE, DIVIDE = 1, 2, 3
# Messages between nodes (across.py compiles them; only the engine runs them, net.c):
# SEND a/a_off n bytes on channel b; RECV n bytes from channel b landed in the scratch at
# b_off, then copied to dst; RECV_COMBINE n elements landed at b_off, dst = a (op) landed.
# GO (channel b) opens a program, one per other node of the job: the round in which
# every node says it runs this plan for this seq before anything is written (engine.h).
SEND, RECV, RECV_COMBINE, GO = 4, 5, 6, 7
# A small collective's star (across.star): its GO round carries its data (engine.h).
UP_SEND, UP_RECV, DOWN_SEND, DOWN_RECV = 8, 9, 10, 11
NET = frozenset({SEND, RECV, RECV_COMBINE, GO, UP_SEND, UP_RECV, DOWN_SEND, DOWN_RECV})
# engine.h's enum lpn_dtype and lpn_redop.
DTYPE_CODES = {
    "float16": 1,
    "bfloat16": 2,
    "float32": 3,
    "float64": 4,
    "int8": 5,
    "int32": 6,
    "int64": 7,
    "uint8": 8,
}
REDOP_CODES = {ReduceOp.SUM: 1, ReduceOp.AVG: 1, ReduceOp.PROD: 2, ReduceOp.MIN: 3, ReduceOp.MAX: 4}
# numpy's min and max of floats differ by element type (and by machine) in the zero sign
# they give on a tie: the engine serves them where it gives this machine's numpy bits
# (_min_max_agree), and leaves them to numpy elsewhere.
_MIN_MAX = {REDOP_CODES[ReduceOp.MIN], REDOP_CODES[ReduceOp.MAX]}
_FLOATS = {DTYPE_CODES[name] for name in ("float16", "bfloat16", "float32", "float64")}
PROGRAM_MAGIC, VERSION = 0x504E504C, 1
MAX_OPS = 65536  # engine.h's LPN_MAX_OPS: the most steps a program may have
_HEADER = struct.Struct("<4I")
_OP = struct.Struct("<6I5Q")  # engine.h's lpn_op: 64 bytes


class Step(NamedTuple):
    kind: int
    dst: int  # buffer numbers (see the module's docstring)
    dst_off: int  # bytes
    a: int = 0
    a_off: int = 0
    b: int = 0
    b_off: int = 0
    n: int = 0  # bytes for COPY, SEND and RECV, elements for the others
    arg: int = 0  # a net op's message number on its channel (engine.h)


@dataclass
class Program:
    reduction: Reduction | None
    itemsize: int
    scratch: int  # bytes
    steps: list[Step] = field(default_factory=list)

    def copy(self, dst: int, dst_off: int, src: int, src_off: int, nbytes: int) -> None:
        self.steps.append(Step(COPY, dst, dst_off, src, src_off, n=nbytes))

    def combine(self, dst: int, a: int, b: int, elements: int, offset: int = 0) -> None:
        """dst = a (op) b over ``elements`` from byte ``offset`` of each."""
        self.steps.append(Step(COMBINE, dst, offset, a, offset, b, offset, elements))

    def close(self, wait: bool = True) -> None:
        """Nothing to free (the plan cache closes what it evicts): no threads, no memory
        but the scratch each run makes."""

    def run(self, views: list[np.ndarray]) -> None:
        """Run it with numpy over ``views`` (input, output of each participant)."""
        if any(s.kind in NET for s in self.steps):
            raise ValueError(
                "a program with messages runs in the engine only (its reference is the general path)"
            )
        raw = [np.empty(self.scratch, np.uint8)] + [v.view(np.uint8).reshape(-1) for v in views]
        typed = None
        if self.reduction is not None:
            dtype = self.reduction.dtype
            typed = [r.view(dtype) if r.size % dtype.itemsize == 0 else None for r in raw]
        for s in self.steps:
            if s.kind == COPY:
                np.copyto(raw[s.dst][s.dst_off : s.dst_off + s.n], raw[s.a][s.a_off : s.a_off + s.n])
                continue
            assert self.reduction is not None and typed is not None
            dst = _elements(typed, s.dst, s.dst_off, s.n)
            if s.kind == COMBINE:
                a, b = _elements(typed, s.a, s.a_off, s.n), _elements(typed, s.b, s.b_off, s.n)
                self.reduction.combine(a, b, dst)
            else:
                self.reduction.finalize(dst)


def _elements(typed: list[np.ndarray | None], buffer: int, offset: int, n: int) -> np.ndarray:
    """``n`` elements of a typed buffer from byte ``offset``."""
    view = typed[buffer]
    assert view is not None
    start = offset // view.itemsize
    return view[start : start + n]


def served(dtype: str, op: ReduceOp | None) -> bool:
    """Whether the engine runs a program over ``dtype`` reducing with ``op`` (None: one
    that only moves bytes, which it runs for any type)."""
    if op is None:
        return True
    code = DTYPE_CODES.get(dtype, 0)
    if REDOP_CODES[op] in _MIN_MAX and code in _FLOATS:
        return _min_max_agree(dtype)
    return bool(code)


@functools.cache
def _min_max_agree(dtype: str) -> bool:
    """Whether the engine's min and max of float ``dtype`` give numpy's bits here, over
    every pair of a table of NaNs (quiet and signalling, both signs, with payloads),
    signed zeros, infinities and numbers: kernels.c follows numpy's rules as read on x86;
    another machine's numpy (another SIMD) may tie or pick NaNs otherwise, and there
    numpy keeps them. Once per process and type."""
    module = native_engine()
    if module is None:
        return False
    values = _special_floats(np.dtype(DTYPES[dtype]))
    a, b = np.repeat(values, values.size), np.tile(values, values.size)
    for op in (ReduceOp.MIN, ReduceOp.MAX):
        want, got = np.empty_like(a), np.empty_like(a)
        with np.errstate(invalid="ignore"):
            Reduction(op, a.dtype, 2).combine(a, b, want)
        module.combine(got, a, b, DTYPE_CODES[dtype], REDOP_CODES[op])
        if want.tobytes() != got.tobytes():
            return False
    return True


def _special_floats(dtype: np.dtype) -> np.ndarray:
    """NaNs with several payloads (quiet and signalling, both signs), +-0, +-inf, the
    smallest subnormal and a few numbers, as ``dtype``."""
    bits = np.dtype(f"u{dtype.itemsize}")
    numbers = np.array([0.0, -0.0, 1.0, -1.0, 2.5, -7.0, np.inf, -np.inf], np.float64).astype(dtype)
    inf = int(numbers[6:7].view(bits)[0])
    sign = 1 << (8 * dtype.itemsize - 1)
    quiet = int(np.array([np.nan], np.float64).astype(dtype).view(bits)[0]) & ~inf & ~sign
    nans = [inf | quiet, sign | inf | quiet, inf | quiet | 1, inf | 1, sign | inf | (quiet >> 1) | 5]
    tiny = [1, sign | 1]  # the smallest subnormals
    return np.concatenate([numbers, np.array(nans + tiny, bits).view(dtype)])


def encode(program: Program, views: list[np.ndarray]) -> tuple[bytes, list[int], list[int]] | None:
    """(program bytes, addresses and sizes of the buffers but the scratch) for the engine;
    None where it does not serve the program's element type (``served``)."""
    dtype = redop = 0
    divisor = 1
    if program.reduction is not None:
        if not served(program.reduction.dtype.name, program.reduction.op):
            return None
        dtype = DTYPE_CODES[program.reduction.dtype.name]
        redop = REDOP_CODES[program.reduction.op]
        divisor = program.reduction.participants
    ops = b"".join(
        _OP.pack(
            s.kind,
            dtype,
            redop,
            s.dst,
            s.a,
            s.b,
            s.dst_off,
            s.a_off,
            s.b_off,
            s.n,
            s.arg if s.kind in NET else divisor,
        )
        for s in program.steps
    )
    sizes = [program.scratch] + [v.nbytes for v in views]
    header = _HEADER.pack(PROGRAM_MAGIC, VERSION, len(sizes), len(program.steps))
    bases = [v.__array_interface__["data"][0] for v in views]
    return header + struct.pack(f"<{len(sizes)}Q", *sizes) + ops, bases, sizes[1:]


def direct(
    op: Collective,
    root: int,
    pairs: list[tuple[np.ndarray, np.ndarray]],
    reduction: Reduction | None,
    count: int,
) -> Program:
    """The direct path's program: one thread reduces every view and writes every output.
    Deterministic: views are reduced in rank order, so every participant and every run
    get the same bits. Inputs of out-of-place collectives are only read; a non-root's
    buffer of reduce is never written."""

    def inp(r: int) -> int:
        return 1 + 2 * r

    def out(r: int) -> int:
        return 2 + 2 * r

    first = pairs[0][0]
    itemsize = first.dtype.itemsize
    block = count * itemsize
    program = Program(reduction, itemsize, 0)
    if op is Collective.BROADCAST:
        source = pairs[root][0]
        for r, (_, o) in enumerate(pairs):
            if o is not source and not _same(o, source):
                program.copy(out(r), 0, inp(root), 0, source.nbytes)
        return program
    if op in (Collective.ALLGATHER, Collective.GATHER):
        for r, (_, o) in enumerate(pairs):
            if op is Collective.GATHER and r != root:
                continue
            for q, (i, _) in enumerate(pairs):
                if not np.shares_memory(o[q * count : (q + 1) * count], i):
                    program.copy(out(r), q * block, inp(q), 0, block)
        return program
    if op is Collective.SCATTER:
        source = pairs[root][0]
        for r, (_, o) in enumerate(pairs):
            if not np.shares_memory(source[r * count : (r + 1) * count], o):
                program.copy(out(r), 0, inp(root), r * block, block)
        return program
    if op is Collective.ALLTOALL:  # out of place only: no output overlaps an input
        for r in range(len(pairs)):
            for q in range(len(pairs)):
                program.copy(out(r), q * block, inp(q), r * block, block)
        return program
    assert reduction is not None
    # Reduce into the scratch first: in place, the inputs are also the outputs. Each range
    # of the scratch is written and read at one start (reduce_scatter: a group of steps
    # per block), so that the engine may run the program tile by tile (engine.h).
    program.scratch = first.nbytes
    if op is Collective.REDUCE_SCATTER:
        for r in range(len(pairs)):
            _reduce(program, len(pairs), r * block, count, reduction)
            program.copy(out(r), 0, 0, r * block, block)
        return program
    _reduce(program, len(pairs), 0, first.size, reduction)
    targets = range(len(pairs)) if op is Collective.ALLREDUCE else [root]
    for r in targets:
        program.copy(out(r), 0, 0, 0, first.nbytes)
    return program


def _reduce(program: Program, participants: int, offset: int, elements: int, reduction: Reduction) -> None:
    """scratch[offset:] = every input's [offset:] reduced in rank order (then averaged)."""
    program.copy(0, offset, 1, offset, elements * program.itemsize)
    for r in range(1, participants):
        program.combine(0, 0, 1 + 2 * r, elements, offset)
    if reduction.op is ReduceOp.AVG and reduction.participants > 1:
        program.steps.append(Step(DIVIDE, 0, offset, n=elements))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """The same memory (an in-place root's input and output views)."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes


def flatten(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """The views in buffer-number order (1 + 2r, 2 + 2r)."""
    return [v for pair in pairs for v in pair]
