"""The CUDA kind's one-shot launch (cuda.py ``oneshot_async``) against the stand-in cupy of
tests/memory/test_cuda_contract_cuda_kind.py (no GPU here): the kernel compiled at start
with the others, one launch on the plan's stream with its device current, the pointers by
value in rank order (unused ones null), avg's divisor, and the same refusals as the
emulated twin (kind.oneshot_refusal, and a pair refused for too many peers)."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from lpsync.errors import InvalidArgumentError
from lpsync.memory import cuda_kernels
from lpsync.memory.kind import Span, Topology
from lpsync.reduction import Reduction
from lpsync.types import DTYPES, ReduceOp
from tests.memory.test_cuda_contract_cuda_kind import _kind, cuda  # noqa: F401 (the fixture)

M = cuda_kernels.ONESHOT_MAX


def _ready_kind(module):
    kind = _kind(module)
    kind._kernels, kind._module, kind._compiling = {}, None, threading.Lock()
    kind.topology = Topology.uniform(2)
    kind.peer_refused = set()
    kind.warm()
    return kind


def test_device_speed_oneshot_cuda_launch(cuda) -> None:  # noqa: F811
    module, _ = cuda
    cupy = __import__("sys").modules["cupy"]
    kind = _ready_kind(module)
    assert ("lpsync_oneshot_f32_sum", 1) in cupy.loaded  # compiled and loaded at start
    loaded = len(cupy.loaded)
    stream = types.SimpleNamespace(ptr=77, lpsync_device=1)
    near, far = (types.SimpleNamespace(device=d, address=(d + 1) << 40) for d in (1, 0))
    dtype = DTYPES["float16"]
    ins = [Span(near, 0, 1000, dtype), Span(far, 4096, 1000, dtype), Span(near, 8192, 1000, dtype)]
    outs = [Span(near, 16384, 1000, dtype), ins[0]]  # one apart, one in place
    del cupy.launches[:]
    kind.oneshot_async(Reduction(ReduceOp.AVG, dtype, 3), outs, ins, stream)
    ((name, grid, block, args, on, device),) = cupy.launches
    assert name == "lpsync_oneshot_f16_sum" and on is stream and device == 1
    assert grid == (4,) and block == (256,)
    want = [s.lo for s in ins] + [0] * (M - 3) + [s.lo for s in outs] + [0] * (M - 2) + [3, 2, 1000, 3]
    assert list(args) == want
    assert all(isinstance(a, np.integer) for a in args)
    del cupy.launches[:]
    kind.oneshot_async(Reduction(ReduceOp.MIN, dtype, 3), outs, ins, stream)
    assert cupy.launches[0][0] == "lpsync_oneshot_f16_min" and cupy.launches[0][3][-1] == 0  # no division
    assert len(cupy.loaded) == loaded  # nothing compiled inside a collective
    # Refused as the twin refuses: a partial overlap; a peer refused for too many peers.
    del cupy.launches[:]
    with pytest.raises(InvalidArgumentError, match="overlaps an input"):
        kind.oneshot_async(Reduction(ReduceOp.SUM, dtype, 3), [Span(near, 2, 1000, dtype)], ins, stream)
    kind.peer_refused.add((1, 0))
    with pytest.raises(InvalidArgumentError, match="too many peers"):
        kind.oneshot_async(Reduction(ReduceOp.SUM, dtype, 3), outs[:1], ins, stream)
    assert not cupy.launches
