"""The torch.distributed backend ``lpsync``: a process group whose collectives run through
the node's lpsync daemon, so that unchanged PyTorch code (DDP, FSDP, ``dist.*``) uses it.

    import lpsync_client.torch                  # registers the backend "lpsync"
    dist.init_process_group("lpsync")           # under torchrun; LPSYNC_SOCKET from env

Each process group (the default one and every ``new_group``) is its own lpsync job,
attached as (job, group rank, group size). Through the group's rendezvous store, group
rank 0 draws the job name (so concurrent runs and groups never collide) and the ranks
discover which node serves each (lpsync_client.layout: every rank asks its daemon, any
launcher, any numbering); torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE are only checked.

Tensors are staged through shared-memory arrays of the daemon (client.empty()), kept in
a pool by size and reused across calls, so a tensor reduced every step (a DDP bucket)
costs two memory copies and no registration after its first step. The staging copy is
what makes non-contiguous tensors and any device work: ``copy_`` does the strides.

Device tensors of a kind the daemon serves (CUDA; the emulated device in CI) never go
through host memory: contiguous ones within the buffer limit are passed as they are
(all_reduce, broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor, an even
all_to_all_single, send/recv), and every other call on them (coalesced groups, lists of
blocks, strided, bool or larger tensors) stages through flat buffers of the same device
instead: registered by IPC handle, pooled like the shared-memory ones, copied in and out
on the device. A call whose tensors are on several devices, or mix host and device
memory, stages through shared memory.

Tensors of any size: a tensor whose staging exceeds the daemon's buffer limit (learned
from its first refusal, lpsync_client.torch._pieces) or the staging budget runs as
several collectives over consecutive element ranges (allgather and reduce_scatter: the
same range of every rank's block), issued in order on every rank, at most
PIECES_IN_FLIGHT of one call at a time; one work completes when all have.

This module is the process group's face: torch's methods, their argument checks, and
each op written as one description of its pieces (a Piecewise: what is cut, the blocks
staged, what is copied in and out). The one runner of such pieces is _runner.py, the
staging pools _staging.py, the work _work.py. A small synchronous op on one contiguous
host tensor skips the pieces: _quick.py runs it on the caller's thread, armed.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import lpsync_client
from lpsync_client import _adapt
from lpsync_client._order import InFlight, Span, span
from lpsync_client.client import Client
from lpsync_client.errors import LpsyncError, ResourceExhaustedError
from lpsync_client.torch._client import Where, empty_on, on_device_path
from lpsync_client.torch._pieces import buffer_limit, learn
from lpsync_client.torch._quick import ANSWER_HERE_BYTES, Quick
from lpsync_client.torch._runner import PIECES_IN_FLIGHT as PIECES_IN_FLIGHT  # (the docstring names it)
from lpsync_client.torch._runner import Piecewise, Runner
from lpsync_client.torch._staging import DTYPES, DevicePool, Staged, StagingPool
from lpsync_client.torch._work import DoneWork, LpsyncWork, dist_error

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

BACKEND = "lpsync"
# Free staging bytes kept for reuse per process group; also the largest piece a tensor is
# staged in (a larger one is split). Set it alike on every rank: it decides the pieces.
STAGING_BYTES = int(os.environ.get("LPSYNC_TORCH_STAGING_BYTES", 1 << 30))
# Free device staging bytes kept for reuse per process group and device: GPU memory is
# scarcer than shared memory (the pieces are still cut by STAGING_BYTES).
DEVICE_STAGING_BYTES = int(os.environ.get("LPSYNC_TORCH_DEVICE_STAGING_BYTES", 64 << 20))

_OPS: dict[object, str] = {  # by RedOpType; looked up with whatever the caller passed
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.AVG: "avg",
}
# bool travels as uint8 0/1; its reductions are logical, as gloo's: sum and max are "or",
# prod and min are "and".
_BOOL_OPS = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


class UnsupportedOperationError(dist.DistBackendError, NotImplementedError):
    """The lpsync backend does not offer this torch.distributed operation."""


def _reduce_op(op: object) -> str:
    kind = getattr(op, "op", op)  # a ReduceOp instance or its RedOpType
    name = _OPS.get(kind)
    if name is None:
        raise ValueError(
            f"the lpsync backend does not support reduce op {kind} (supported: SUM, PRODUCT, MIN, MAX, AVG)"
        )
    return name


def _check(t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(
            f"the lpsync backend does not support dtype {t.dtype} (supported: "
            f"{', '.join(str(d) for d in DTYPES)})"
        )


def _op_for(dtype: torch.dtype, op: str) -> str:
    if dtype != torch.bool:
        return op
    if op not in _BOOL_OPS:
        raise ValueError(f"the lpsync backend does not support reduce op {op} on bool tensors")
    return _BOOL_OPS[op]


def _small(tensors: Iterable[torch.Tensor]) -> bool:
    return sum(t.numel() * t.element_size() for t in tensors) <= ANSWER_HERE_BYTES


def _spans(tensors: Iterable[torch.Tensor]) -> list[Span]:
    """The memory each tensor can touch, by device (_order.py). Sparse tensors are left
    out: their collectives are blocking."""
    return [
        span(
            str(t.device), t.data_ptr(), t.shape, [s * t.element_size() for s in t.stride()], t.element_size()
        )
        for t in tensors
        if not t.is_sparse and t.numel()
    ]


def _one(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"lpsync {op} takes one tensor per process, got {len(tensors)}")
    return tensors[0]


def _unsupported(op: str, why: str = "") -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"the lpsync backend does not support {op}{why}; lpsync offers all_reduce, "
        "broadcast, reduce, all_gather, reduce_scatter, gather, scatter, all_to_all and "
        f"barrier (create a gloo group with dist.new_group(backend='gloo') for {op})"
    )


class ProcessGroupLpsync(dist.ProcessGroup):
    """A torch.distributed process group over one lpsync job (see the module docstring).
    Made by torch through the registered creator, not by hand."""

    def __init__(self, client: Client, rank: int, size: int, timeout: float) -> None:
        # torch binds ProcessGroup(rank, size) as well; its stub lists only (store, rank, size).
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.client, self._timeout = client, timeout
        self._staging_bytes = STAGING_BYTES  # as set when the group was made
        self._pool = StagingPool(client, self._staging_bytes)
        self._device_pools: dict[Where, DevicePool] = {}  # made on first use per device
        self._in_flight = InFlight()  # what its staged collectives still touch
        self._runner = Runner(client, self._staging_bytes, self._stage)  # every op's pieces
        self._quick = Quick(client, self._pool, self._staging_bytes)  # small synchronous ops
        self._bound = 2 * timeout + 30  # the client's own bound on an unanswered collective
        self._closed = False
        self._group_name = cast("GroupName", "")  # GroupName is a NewType of str
        self._group_desc = ""

    def getBackendName(self) -> str:
        return BACKEND

    # torch's C++ ProcessGroup keeps the group's name and description in its backends, and
    # a Python group has none: keep them here (DeviceMesh, FSDP2 and c10d's registry ask).
    def _set_group_name(self, name: GroupName) -> None:
        self._group_name = name

    @property
    def group_name(self) -> GroupName:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupLpsync(job={self.client.job!r}, rank={self.rank()}, size={self.size()})"

    # -- plumbing ----------------------------------------------------------------------------
    def _stage(self, t: torch.Tensor, numel: int, where: Where | None = None) -> Staged:
        """Staging for ``numel`` elements of ``t``'s dtype: on device ``where`` (device
        tensors the daemon serves: _where), else in shared memory."""
        _check(t)
        pool = self._pool
        if where is not None and numel:  # (an empty one moves nothing: no device memory)
            pool = self._device_pools.get(where) or self._device_pools.setdefault(
                where, DevicePool(self.client, DEVICE_STAGING_BYTES, where)
            )
        return Staged(pool, t.dtype, numel)

    def _where(self, tensors: Iterable[torch.Tensor]) -> Where | None:
        """The device a call on ``tensors`` stages on: the one device they all live on when
        the daemon serves it; None (shared memory) for host tensors or several devices."""
        places = {on_device_path(self.client, t) for t in tensors if t.numel()}
        return places.pop() if len(places) == 1 else None

    def _run(
        self,
        op: str,
        outputs: list[torch.Tensor],
        pieces: Callable[[LpsyncWork], None],
        inputs: Sequence[torch.Tensor] = (),
        opts: Any = None,
    ) -> LpsyncWork:
        """Build a work and let ``pieces`` submit its collectives into it, once the group's
        earlier collectives on overlapping memory have finished (_order.py); errors raised
        while submitting leave the work's earlier pieces to finish and release staging.
        A small synchronous op (``opts.asyncOp`` False: torch waits for the work at once)
        has its collective answered on this thread (Client.answer_next_here)."""
        if self._closed:
            raise dist.DistBackendError(f"lpsync {op}: the process group was shut down")
        touched = _spans([*outputs, *inputs])
        self._in_flight.wait_before(touched, self._bound)
        work = LpsyncWork(op, outputs, self._bound)
        here = opts is not None and not opts.asyncOp and _small(outputs) and _small(inputs)
        if here:
            self.client.answer_next_here()
        try:
            pieces(work)
        except LpsyncError as error:
            self._in_flight.add(work.finished, touched)  # its issued pieces still run
            work.seal()
            raise dist_error(op, error) from error
        finally:
            if here:
                self.client.answer_next_here(False)
        self._in_flight.add(work.finished, touched)
        return work.seal()

    def _fits(self, opts: Any, tensors: Sequence[torch.Tensor], numel: int, dtype: torch.dtype) -> bool:
        """Whether a call takes the quick path (_quick.py): synchronous, small, host."""
        return not self._closed and self._quick.fits(opts, tensors, numel * dtype.itemsize)

    def _answer_here(
        self,
        op: str,
        tensors: Sequence[torch.Tensor],
        outputs: list[torch.Tensor],
        dtype: torch.dtype,
        numel: int,
        call: Callable[[torch.Tensor, Any], object],
    ) -> DoneWork | None:
        """Run a call that ``_fits`` on the quick path: after the group's earlier
        collectives on overlapping memory (as _run), ``call(flat, operand)`` on its staging;
        lpsync's errors raised as _run raises them. None where the daemon refused the
        staging as over its buffer limit, learned now (_pieces.learn): nothing was written,
        and the caller runs the op the general way, in pieces."""
        if not self._in_flight.idle():  # (spans cost more than the rest of a small call)
            self._in_flight.wait_before(_spans(tensors), self._bound)
        try:
            self._quick.run(dtype, numel, call)
        except ResourceExhaustedError as error:
            if learn(self.client, error):
                return None
            raise dist_error(op, error) from error
        except LpsyncError as error:
            raise dist_error(op, error) from error
        return DoneWork(op, outputs)

    def _flat_out(self, work: LpsyncWork, t: torch.Tensor, where: Where | None = None) -> torch.Tensor:
        """A flat view of ``t`` that pieces can write to; for a strided ``t``, a contiguous
        copy (on device ``where`` when given) that is written back once every piece has
        succeeded. Detached: the backend writes data as torch's C++ backends do, unseen by
        autograd (a pipeline stage receives into tensors that require grad)."""
        t = t.detach()
        if t.is_contiguous():
            return t.view(-1)
        flat = self._flat_in(t, where)
        work.on_success(lambda: t.copy_(flat.view(t.shape)))
        return flat

    @staticmethod
    def _flat_in(t: torch.Tensor, where: Where | None = None) -> torch.Tensor:
        """``t`` as a flat tensor to read from: a view, or a contiguous copy of a strided one
        (made on device ``where`` when given: an emulated tensor's own copies are host memory)."""
        t = t.detach()
        if t.is_contiguous() or where is None:
            return t.reshape(-1)
        flat = empty_on(where, t.numel(), t.dtype)
        flat.view(t.shape).copy_(t)
        return flat

    def _on_device(self, t: torch.Tensor, register: bool = True) -> bool:
        """Zero copies (docs/gpu.md): a contiguous device tensor of a dtype the daemon
        reduces, within its buffer limit, on a daemon serving its kind, registered here;
        the collective then runs on the tensor itself, after the current stream
        (interprocess event), done when the daemon finished. Pass the client ``t`` itself,
        not a view: the registration lives as long as ``t``, and the client holds what it
        was given until the collective completes. Other device tensors (strided,
        bool, larger) are staged in device buffers (_stage). ``register=False``: a message,
        which its pair job's session registers (lpsync_client._p2p)."""
        if not (t.dtype != torch.bool and t.is_contiguous() and on_device_path(self.client, t) is not None):
            return False
        limit = buffer_limit(self.client)
        if limit is not None and t.nbytes > limit:
            return False
        _check(t)
        if not register:
            return True
        try:
            _adapt.ensure_registered(self.client, t)  # the lasting object, not a detached view
        except ResourceExhaustedError as error:
            if learn(self.client, error):
                return False
            raise
        return True

    def _barrier_piece(self, work: LpsyncWork) -> None:
        """Zero elements: nothing to move, but the ranks still meet, so that the job's
        sequence numbers stay matched (and a mismatch is still reported)."""
        work.track(self.client.barrier_async(self._timeout), lambda: None)

    # -- the table: each op as a Piecewise (_runner.py) over flat views of its tensors ------
    def _allreduce_piece(self, work: LpsyncWork, tensors: Sequence[torch.Tensor], op: str) -> None:
        """Allreduce ``tensors`` (same dtype) as one flat message: coalescing is one call."""
        numel = sum(t.numel() for t in tensors)
        if numel == 0:
            return self._barrier_piece(work)
        op = _op_for(tensors[0].dtype, op)
        if len(tensors) == 1 and self._on_device(tensors[0]):
            work.track(
                self.client.allreduce_async(tensors[0], op=op, timeout=self._timeout),
                lambda: None,
            )
            return None
        _check(tensors[0])
        where = self._where(tensors)
        both = [(0, [self._flat_out(work, t, where) for t in tensors])]  # in place: one block
        self._runner.run(
            work,
            Piecewise(
                numel,
                tensors[0],
                lambda x, m: self.client.allreduce_async(x, op=op, timeout=self._timeout),
                ins=both,
                outs=both,
                where=where,
            ),
        )
        return None

    def _gather_piece(self, work: LpsyncWork, outputs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        """Allgather ``inp`` into ``outputs`` (one tensor per rank, each inp.numel())."""
        n, p = inp.numel(), self.size()
        if len(outputs) != p or any(o.numel() != n or o.dtype != inp.dtype for o in outputs):
            raise ValueError(f"all_gather needs {p} output tensors of {n} {inp.dtype} elements each")
        if n == 0:
            return self._barrier_piece(work)
        _check(inp)
        where = self._where([inp, *outputs])
        self._runner.run(
            work,
            Piecewise(
                n,
                inp,
                lambda x, m: self.client.allgather_async(x, timeout=self._timeout),
                ins=[(self.rank(), [self._flat_in(inp, where)])],
                outs=[(i, [self._flat_out(work, o, where)]) for i, o in enumerate(outputs)],
                blocks=p,
                where=where,
            ),
        )
        return None

    def _scatter_piece(
        self, work: LpsyncWork, out: torch.Tensor, inputs: Sequence[torch.Tensor], op: str
    ) -> None:
        """Reduce-scatter: rank r's ``out`` = reduction over ranks of their ``inputs[r]``."""
        n, p = out.numel(), self.size()
        if len(inputs) != p or any(i.numel() != n or i.dtype != out.dtype for i in inputs):
            raise ValueError(f"reduce_scatter needs {p} input tensors of {n} {out.dtype} elements each")
        if n == 0:
            return self._barrier_piece(work)
        op = _op_for(out.dtype, op)
        _check(out)
        where = self._where([out, *inputs])
        self._runner.run(
            work,
            Piecewise(
                n,
                out,
                lambda x, m: self.client.reduce_scatter_async(x, op=op, timeout=self._timeout),
                ins=[(i, [self._flat_in(t, where)]) for i, t in enumerate(inputs)],
                outs=[(self.rank(), [self._flat_out(work, out, where)])],
                blocks=p,
                where=where,
            ),
        )
        return None

    def _rooted_piece(self, work: LpsyncWork, kind: str, t: torch.Tensor, root: int, op: str = "") -> None:
        """broadcast or reduce in place on ``t``; only the receiving ranks copy back."""
        if not 0 <= root < self.size():
            raise ValueError(f"{kind} root {root} is not a rank of this group of {self.size()}")
        if t.numel() == 0:
            return self._barrier_piece(work)
        op = _op_for(t.dtype, op) if kind == "reduce" else op
        _check(t)

        def start(x: Any) -> Future:
            if kind == "broadcast":
                return self.client.broadcast_async(x, root=root, timeout=self._timeout)
            return self.client.reduce_async(x, root=root, op=op, timeout=self._timeout)

        if self._on_device(t):  # zero copies (a non-root's reduce buffer is left as it was)
            work.track(start(t), lambda: None)
            return None
        sends = kind == "reduce" or self.rank() == root
        receives = (kind == "broadcast") != (self.rank() == root)
        where = self._where([t])
        flat = [(0, [self._flat_out(work, t, where) if receives else self._flat_in(t, where)])]
        self._runner.run(
            work,
            Piecewise(
                t.numel(),
                t,
                lambda x, m: start(x),
                ins=flat if sends else (),
                outs=flat if receives else (),
                where=where,
            ),
        )
        return None

    # -- collectives (torch's ProcessGroup method names) -------------------------------------
    # allreduce, broadcast, reduce, allgather and reduce_scatter: torch's C++ dispatcher calls
    # them as (tensors, opts), while the .pyi overloads describe the Python-facing API, which
    # this backend does not serve: hence their type: ignore[override].
    def allreduce(  # type: ignore[override]  # (tensors, opts): see above
        self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> LpsyncWork | DoneWork:
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)
        if len(tensors) == 1 and self._fits(opts, tensors, tensors[0].numel(), tensors[0].dtype):
            t = tensors[0].detach().view(-1)
            reduce_op = _op_for(t.dtype, op)

            def call(flat: torch.Tensor, operand: Any) -> None:
                flat.copy_(t)
                self.client.allreduce(operand, op=reduce_op, timeout=self._timeout)
                t.copy_(flat)

            work = self._answer_here("all_reduce", tensors, tensors, t.dtype, t.numel(), call)
            if work is not None:
                return work

        def pieces(work: LpsyncWork) -> None:
            for t in tensors:
                if t.is_sparse:
                    self._sparse_allreduce(t, op)
                else:
                    self._allreduce_piece(work, [t], op)

        return self._run("all_reduce", tensors, pieces, opts=opts)

    def _sparse_allreduce(self, t: torch.Tensor, op: str) -> None:
        """A sparse (COO) sum, as gloo does it: every rank's indices and values are
        gathered (padded to the largest count of non-zeros) and summed into one coalesced
        tensor, which replaces ``t``'s contents. Blocking: the result is built here."""
        if op != "sum":
            raise ValueError(f"a sparse all_reduce sums only (got {op}), as gloo's")
        local = t.detach().coalesce()
        indices, values = local.indices(), local.values()
        p = self.size()
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(p)]
        self.allgather([counts], [torch.tensor([indices.shape[1]])]).wait()
        nnz = [int(c.item()) for c in counts]
        most = max(nnz)

        def gathered(x: torch.Tensor, dim: int) -> list[torch.Tensor]:
            """Every rank's ``x``, padded along ``dim`` to ``most`` and cut back."""
            pad = list(x.shape)
            pad[dim] = most - x.shape[dim]
            mine = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
            outs = [torch.empty_like(mine) for _ in range(p)]
            self.allgather([outs], [mine]).wait()
            return [o.narrow(dim, 0, n) for o, n in zip(outs, nnz, strict=True)]

        total = torch.sparse_coo_tensor(
            torch.cat(gathered(indices, 1), 1), torch.cat(gathered(values, 0), 0), t.shape
        ).coalesce()
        with torch.no_grad():  # into t itself: a sparse copy_ replaces its indices and values
            t.copy_(total)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> LpsyncWork:
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)

        def pieces(work: LpsyncWork) -> None:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:  # first-seen dtype order: the same on every rank
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                self._allreduce_piece(work, group, op)

        return self._run("all_reduce_coalesced", tensors, pieces)

    def broadcast(  # type: ignore[override]  # (tensors, opts): see above
        self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions | None = None
    ) -> LpsyncWork | DoneWork:
        root = opts.rootRank if opts is not None else 0
        quick = self._rooted_here("broadcast", tensors, root, "", opts)
        if quick is not None:
            return quick

        def pieces(work: LpsyncWork) -> None:
            for t in tensors:
                self._rooted_piece(work, "broadcast", t, root)

        return self._run("broadcast", tensors, pieces, opts=opts)

    def reduce(  # type: ignore[override]  # (tensors, opts): see above
        self, tensors: list[torch.Tensor], opts: dist.ReduceOptions | None = None
    ) -> LpsyncWork | DoneWork:
        root = opts.rootRank if opts is not None else 0
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)
        quick = self._rooted_here("reduce", tensors, root, op, opts)
        if quick is not None:
            return quick

        def pieces(work: LpsyncWork) -> None:
            for t in tensors:
                self._rooted_piece(work, "reduce", t, root, op)

        return self._run("reduce", tensors, pieces, opts=opts)

    def _rooted_here(
        self, kind: str, tensors: list[torch.Tensor], root: int, op: str, opts: Any
    ) -> DoneWork | None:
        """broadcast or reduce of one tensor on the quick path (_rooted_piece's copies:
        the sending ranks' in, the receiving ranks' out); None where it does not fit."""
        if len(tensors) != 1 or not 0 <= root < self.size():
            return None
        if not self._fits(opts, tensors, tensors[0].numel(), tensors[0].dtype):
            return None
        t = tensors[0].detach().view(-1)
        at_root = self.rank() == root
        sends, receives = kind == "reduce" or at_root, (kind == "broadcast") != at_root
        reduce_op = _op_for(t.dtype, op) if kind == "reduce" else ""

        def call(flat: torch.Tensor, operand: Any) -> None:
            if sends:
                flat.copy_(t)
            if kind == "broadcast":
                self.client.broadcast(operand, root=root, timeout=self._timeout)
            else:
                self.client.reduce(operand, root=root, op=reduce_op, timeout=self._timeout)
            if receives:
                t.copy_(flat)

        return self._answer_here(kind, tensors, tensors, t.dtype, t.numel(), call)

    def allgather(  # type: ignore[override]  # (tensors, opts): see above
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object = None
    ) -> LpsyncWork:
        def pieces(work: LpsyncWork) -> None:
            for outs, inp in zip(output_lists, inputs, strict=True):
                self._gather_piece(work, outs, inp)

        outputs = [o for outs in output_lists for o in outs]
        return self._run("all_gather", outputs, pieces, inputs, opts=opts)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None
    ) -> LpsyncWork:
        """``output_lists[r][j]``: rank r's tensor j (rank-major, as gloo takes them; inputs
        may differ in shape); allgather takes one list per input, of every rank's."""
        if len(output_lists) != self.size() or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(
                f"all_gather_coalesced needs {self.size()} output lists of {len(inputs)} tensors each"
            )
        per_input = [[output_lists[r][j] for r in range(self.size())] for j in range(len(inputs))]
        return self.allgather(per_input, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts=None) -> LpsyncWork | DoneWork:
        return self.all_gather_single_coalesced([output], [inp], opts)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts=None) -> LpsyncWork | DoneWork:
        return self.all_gather_single_coalesced([output], [inp], opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None
    ) -> LpsyncWork | DoneWork:
        p = self.size()
        if (
            len(outputs) == len(inputs) == 1
            and outputs[0].numel() == inputs[0].numel() * p
            and outputs[0].dtype == inputs[0].dtype
            and self._fits(opts, [outputs[0], inputs[0]], outputs[0].numel(), outputs[0].dtype)
        ):
            out, inp = outputs[0].detach().view(-1), inputs[0].detach().view(-1)
            mine = slice(self.rank() * inp.numel(), (self.rank() + 1) * inp.numel())

            def call(flat: torch.Tensor, operand: Any) -> None:
                flat[mine].copy_(inp)  # the staging holds every rank's block, in place
                self.client.allgather(operand, timeout=self._timeout)
                out.copy_(flat)

            work = self._answer_here(
                "all_gather_into_tensor", [*outputs, *inputs], outputs, out.dtype, out.numel(), call
            )
            if work is not None:
                return work

        def pieces(work: LpsyncWork) -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                if out.numel() != inp.numel() * self.size() or not out.is_contiguous():
                    raise ValueError(
                        f"all_gather_into_tensor needs a contiguous output of "
                        f"{inp.numel() * self.size()} elements (world size x input), got "
                        f"{out.numel()}"
                    )
                if inp.numel() and self._on_device(inp) and self._on_device(out):  # zero copies
                    future = self.client.allgather_async(inp, out=out, timeout=self._timeout)
                    work.track(future, lambda: None)
                    continue
                self._gather_piece(
                    work,
                    list(out.detach().reshape(-1).chunk(self.size())) if inp.numel() else [out] * self.size(),
                    inp,
                )

        return self._run("all_gather_into_tensor", outputs, pieces, inputs, opts=opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None
    ) -> LpsyncWork | DoneWork:
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter(  # type: ignore[override]  # (tensors, opts): see above
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: dist.ReduceScatterOptions | None = None,
    ) -> LpsyncWork:
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)

        def pieces(work: LpsyncWork) -> None:
            for out, inputs in zip(outputs, input_lists, strict=True):
                self._scatter_piece(work, out, inputs, op)

        inputs = [i for ins in input_lists for i in ins]
        return self._run("reduce_scatter", outputs, pieces, inputs, opts=opts)

    def _reduce_scatter_base(
        self, output: torch.Tensor, inp: torch.Tensor, opts=None
    ) -> LpsyncWork | DoneWork:
        return self.reduce_scatter_single_coalesced([output], [inp], opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts=None
    ) -> LpsyncWork | DoneWork:
        return self.reduce_scatter_single_coalesced([output], [inp], opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None
    ) -> LpsyncWork | DoneWork:
        op = _reduce_op(opts.reduceOp if opts is not None else ReduceOp.SUM)
        p = self.size()
        if (
            len(outputs) == len(inputs) == 1
            and inputs[0].numel() == outputs[0].numel() * p
            and outputs[0].dtype == inputs[0].dtype
            and self._fits(opts, [outputs[0], inputs[0]], inputs[0].numel(), inputs[0].dtype)
        ):
            out, inp = outputs[0].detach().view(-1), inputs[0].detach().view(-1)
            mine = slice(self.rank() * out.numel(), (self.rank() + 1) * out.numel())
            reduce_op = _op_for(out.dtype, op)

            def call(flat: torch.Tensor, operand: Any) -> None:
                flat.copy_(inp)  # the staging holds every rank's p blocks; this rank's comes back
                self.client.reduce_scatter(operand, op=reduce_op, timeout=self._timeout)
                out.copy_(flat[mine])

            work = self._answer_here(
                "reduce_scatter_tensor", [*outputs, *inputs], outputs, inp.dtype, inp.numel(), call
            )
            if work is not None:
                return work

        def pieces(work: LpsyncWork) -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                if inp.numel() != out.numel() * self.size():
                    raise ValueError(
                        f"reduce_scatter_tensor needs an input of {out.numel() * self.size()}"
                        f" elements (world size x output), got {inp.numel()}"
                    )
                if out.numel() and self._on_device(inp) and self._on_device(out):  # zero copies
                    future = self.client.reduce_scatter_async(inp, op=op, out=out, timeout=self._timeout)
                    work.track(future, lambda: None)
                    continue
                flat = self._flat_in(inp, self._where([inp, out]))
                blocks = list(flat.chunk(self.size())) if out.numel() else [inp] * self.size()
                self._scatter_piece(work, out, blocks, op)

        return self._run("reduce_scatter_tensor", outputs, pieces, inputs, opts=opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None
    ) -> LpsyncWork | DoneWork:
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def barrier(self, opts=None) -> LpsyncWork | DoneWork:
        if opts is not None and not opts.asyncOp and not self._closed:  # nothing to stage
            try:
                self.client.barrier(timeout=self._timeout)
            except LpsyncError as error:
                raise dist_error("barrier", error) from error
            return DoneWork("barrier", [])
        return self._run("barrier", [], self._barrier_piece, opts=opts)

    # -- what lpsync does not offer: a clear error, never a hang -----------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> LpsyncWork:  # type: ignore[override]
        t = _one(tensors, "send")
        return self._run("send", [], lambda work: self._p2p_piece(work, t, dst, tag, sending=True), [t])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> LpsyncWork:  # type: ignore[override]
        t = _one(tensors, "recv")
        return self._run("recv", [t], lambda work: self._p2p_piece(work, t, src, tag, sending=False))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> LpsyncWork:  # type: ignore[override]
        """recv(src=None): the daemon names the rank whose message comes next (the client's
        any-source receive); its pieces are then received from that rank."""
        t = _one(tensors, "recv")

        def pieces(work: LpsyncWork) -> None:
            def issue(source: int) -> None:
                work.source = source
                self._p2p_piece(work, t, source, tag, sending=False)

            work.track(self.client.any_source_async(tag, issue, self._timeout), lambda: None)

        return self._run("recv", [t], pieces)

    def _p2p_piece(self, work: LpsyncWork, t: torch.Tensor, peer: int, tag: int, sending: bool) -> None:
        """A message to or from ``peer`` (client.send/recv: a two-rank job per pair and tag),
        in pieces cut alike on both sides. It completes when the receiver has it."""
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(
                f"{'send to' if sending else 'recv from'} rank {peer}: not another rank of this group"
            )
        _check(t)
        move = self.client.send_async if sending else self.client.recv_async
        if t.numel() and self._on_device(t, register=False):  # registered by its pair's session
            try:
                future = move(t, peer, tag, timeout=self._timeout)
            except ResourceExhaustedError as error:  # over the daemon's limit: in pieces
                if not learn(self.client, error):
                    raise
            else:
                work.track(future, lambda: None)
                return
        where = self._where([t])
        flat = [(0, [self._flat_in(t, where) if sending else self._flat_out(work, t, where)])]
        # (Zero elements still meet: one empty piece, so that the pair's later messages stay
        # matched.)
        self._runner.run(
            work,
            Piecewise(
                t.numel(),
                t,
                lambda x, m: move(x, peer, tag, timeout=self._timeout),
                ins=flat if sending else (),
                outs=() if sending else flat,
                where=where,
            ),
        )

    def gather(  # type: ignore[override]  # (output lists, inputs, opts): see above
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts=None
    ) -> LpsyncWork:
        root = opts.rootRank if opts is not None else 0
        inp = _one(input_tensors, "gather")
        outs = list(output_tensors[0]) if self.rank() == root else []
        p, n = self.size(), inp.numel()
        if self.rank() == root and (
            len(outs) != p or any(o.numel() != n or o.dtype != inp.dtype for o in outs)
        ):
            raise ValueError(f"gather needs {p} output tensors of {n} {inp.dtype} elements each at the root")

        def pieces(work: LpsyncWork) -> None:
            if n == 0:
                return self._barrier_piece(work)
            _check(inp)
            where = self._where([inp, *outs])
            at_root = self.rank() == root
            self._runner.run(
                work,
                Piecewise(
                    n,
                    inp,
                    lambda x, m: self.client.gather_async(x, root=root, timeout=self._timeout),
                    ins=[(self.rank() if at_root else 0, [self._flat_in(inp, where)])],
                    outs=[(i, [self._flat_out(work, o, where)]) for i, o in enumerate(outs)],
                    blocks=p if at_root else 1,  # the root's: the whole output
                    cut_blocks=p,  # the same cuts on every rank: the root's staging sets them
                    where=where,
                ),
            )
            return None

        return self._run("gather", outs, pieces, [inp])

    def scatter(  # type: ignore[override]  # (outputs, input lists, opts): see above
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts=None
    ) -> LpsyncWork:
        root = opts.rootRank if opts is not None else 0
        out = _one(output_tensors, "scatter")
        ins = list(input_tensors[0]) if self.rank() == root else []
        p, n = self.size(), out.numel()
        if self.rank() == root and (
            len(ins) != p or any(i.numel() != n or i.dtype != out.dtype for i in ins)
        ):
            raise ValueError(f"scatter needs {p} input tensors of {n} {out.dtype} elements each at the root")

        def pieces(work: LpsyncWork) -> None:
            if n == 0:
                return self._barrier_piece(work)
            _check(out)
            where = self._where([out, *ins])
            at_root = self.rank() == root
            self._runner.run(
                work,
                Piecewise(
                    n,
                    out,
                    lambda x, m: self.client.scatter_async(x, root=root, timeout=self._timeout),
                    ins=[(i, [self._flat_in(t, where)]) for i, t in enumerate(ins)],
                    outs=[(self.rank() if at_root else 0, [self._flat_out(work, out, where)])],
                    blocks=p if at_root else 1,  # the root's: the whole input
                    cut_blocks=p,  # the same cuts on every rank: the root's staging sets them
                    where=where,
                ),
            )
            return None

        return self._run("scatter", [out], pieces, ins)

    def alltoall(  # type: ignore[override]  # (outputs, inputs, opts): see above
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts=None
    ) -> LpsyncWork:
        p = self.size()
        if len(output_tensors) != p or len(input_tensors) != p:
            raise ValueError(f"all_to_all needs {p} output and {p} input tensors")
        dtypes = {t.dtype for t in (*output_tensors, *input_tensors)}
        if len(dtypes) != 1:
            raise ValueError(f"all_to_all needs one dtype, got {sorted(map(str, dtypes))}")

        def pieces(work: LpsyncWork) -> None:
            where = self._where([*output_tensors, *input_tensors])
            outs = [self._flat_out(work, o, where) for o in output_tensors]
            ins = [self._flat_in(i, where) for i in input_tensors]
            self._alltoall_pieces(work, outs, ins, even=False, where=where)

        return self._run("all_to_all", list(output_tensors), pieces, input_tensors)

    def alltoall_base(  # type: ignore[override]  # (output, input, splits, opts): see above
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts=None,
    ) -> LpsyncWork:
        p = self.size()
        if output.dtype != inp.dtype:
            raise ValueError(f"all_to_all_single: output is {output.dtype}, input {inp.dtype}")
        even = not output_split_sizes and not input_split_sizes

        def rows(t: torch.Tensor, splits: list[int], what: str) -> list[int]:
            """Element offsets of the p blocks along dim 0 (torch's split sizes are rows)."""
            if not splits:
                if t.numel() % p:
                    raise ValueError(
                        f"all_to_all_single: the {what} of {t.numel()} elements is not {p} equal parts"
                    )
                return [t.numel() // p * i for i in range(p + 1)]
            per_row = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0
            if len(splits) != p or sum(splits) != (t.shape[0] if t.dim() else 0):
                raise ValueError(
                    f"all_to_all_single: {what} split sizes {splits} do not cut dim 0 into {p} parts"
                )
            return list(itertools.accumulate((s * per_row for s in splits), initial=0))

        out_at, in_at = rows(output, output_split_sizes, "output"), rows(inp, input_split_sizes, "input")

        def pieces(work: LpsyncWork) -> None:
            if even and output.numel() and self._on_device(inp) and self._on_device(output):  # zero copies
                work.track(
                    self.client.alltoall_async(inp, out=output, timeout=self._timeout),
                    lambda: None,
                )
                return
            where = self._where([output, inp])
            flat_out, flat_in = self._flat_out(work, output, where), self._flat_in(inp, where)
            outs = [flat_out[out_at[i] : out_at[i + 1]] for i in range(p)]
            ins = [flat_in[in_at[i] : in_at[i + 1]] for i in range(p)]
            self._alltoall_pieces(work, outs, ins, even=even, where=where)

        return self._run("all_to_all_single", [output], pieces, [inp])

    def _alltoall_pieces(
        self,
        work: LpsyncWork,
        outs: list[torch.Tensor],
        ins: list[torch.Tensor],
        even: bool,
        where: Where | None = None,
    ) -> None:
        """All-to-all of flat blocks: ins[j] goes to rank j, outs[i] comes from rank i.
        Uneven blocks are padded to the largest of the whole group (learned with one small
        allreduce of max: no rank knows what the others send each other), and each block's
        element range is cut into the same pieces on every rank."""
        p = self.size()
        block = max((t.numel() for t in (*outs, *ins)), default=0)
        if not even:
            longest = np.array([block], np.int64)
            self.client.allreduce(longest, op="max", timeout=self._timeout)
            block = int(longest[0])
        if block == 0:
            return self._barrier_piece(work)
        ref = ins[0] if ins else outs[0]
        _check(ref)

        self._runner.run(
            work,
            Piecewise(
                block,
                ref,
                # the staging: the input's p blocks, then the output's
                lambda x, m: self.client.alltoall_async(x[: m * p], out=x[m * p :], timeout=self._timeout),
                ins=[(j, [source]) for j, source in enumerate(ins)],
                outs=[(p + i, [o]) for i, o in enumerate(outs)],
                blocks=2 * p,
                where=where,
            ),
        )
        return None

    def all_to_all_single(self, *args, **kwargs):
        return self.alltoall_base(*args, **kwargs)

    def monitored_barrier(self, *args, **kwargs):
        raise _unsupported("monitored_barrier")

    # -- lifetime ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Detach from the daemon (destroy_process_group calls this); idempotent."""
        if not self._closed:
            self._closed = True
            self.client.close()

    def abort(self) -> None:
        self.shutdown()


def _hints(global_ranks: Sequence[int]) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) to check against the discovered layout: the
    launcher's, for the group of every rank; (0, 0), nothing to check, for a sub-group
    (they describe the whole world) or where the launcher set none."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", 0) or 0)
    if list(global_ranks) != list(range(world)) or not env.get("LOCAL_WORLD_SIZE"):
        return 0, 0
    return int(env.get("LOCAL_RANK", 0) or 0), int(env["LOCAL_WORLD_SIZE"])


_incarnations: dict[str, int] = {}  # groups made per name in this process (see _job_name)


def _job_name(store: dist.Store, group_rank: int, group_id: str, timeout: float) -> str:
    """Group rank 0 draws the group's job name; the others read it from the group's store
    (torch prefixes the store per group). LPSYNC_JOB, if set, leads the name.

    The store can outlive the ranks: torchrun's static rendezvous keeps one agent store
    across elastic restarts, with no prefix per attempt. So the key names the attempt
    (TORCHELASTIC_RESTART_COUNT, the same on every worker of an attempt) and, for a group
    destroyed and made again in the same processes, the incarnation (every rank counts
    the same): no rank can read a previous attempt's name."""
    _incarnations[group_id] = n = _incarnations.get(group_id, 0) + 1
    key = f"lpsync/job/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{n}"
    if group_rank == 0:
        base = os.environ.get("LPSYNC_JOB") or "torch"
        name = f"{base}.{secrets.token_hex(4)}.{group_id or 'default'}"
        store.set(key, name)
        return name
    store.wait([key], timedelta(seconds=timeout))
    return store.get(key).decode()


def _create(opts, backend_options=None) -> ProcessGroupLpsync:
    """torch's creator (extended API): one lpsync job per process group."""
    rank, size = opts.group_rank, opts.group_size
    timeout = opts.timeout.total_seconds() if opts.timeout else 1800.0
    global_ranks = list(opts.global_ranks_in_group) or list(range(size))
    try:
        job = _job_name(opts.store, rank, str(opts.group_id), min(timeout, 600.0))
    except Exception as error:  # the store's own errors are already torch's kinds
        raise dist.DistBackendError(
            f"lpsync: could not agree on a job name through the rendezvous store: {error}"
        ) from error
    local_rank, local_size = _hints(global_ranks)
    try:
        # The group's ranks discover which node serves each through the group's store.
        client = lpsync_client.connect(
            job=job,
            rank=rank,
            world_size=size,
            local_rank=local_rank,
            local_world_size=local_size,
            timeout=timeout,
            store=opts.store,
        )
    except LpsyncError as error:
        raise dist.DistBackendError(
            f"lpsync: rank {rank} of group {opts.group_id!r} could not join its job on its daemon "
            f"(LPSYNC_SOCKET={os.environ.get('LPSYNC_SOCKET', lpsync_client.client.DEFAULT_SOCKET)}"
            f"): {error}"
        ) from error
    return ProcessGroupLpsync(client, rank, size, timeout)


def register() -> None:
    """Make ``init_process_group("lpsync")`` available (idempotent; importing
    lpsync_client.torch calls it). CUDA tensors are staged through host memory."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
