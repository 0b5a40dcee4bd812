"""What each rank of the torch backend tests runs, in a spawned process: torch.distributed
on the ``lpsync`` backend beside a gloo group over the same ranks, on identical inputs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

R = dist.ReduceOp
DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


def init(
    rank: int, world: int, sockets: list[str], per_node: int, port: int, timeout: float = 60.0
) -> dist.ProcessGroup:
    """torchrun's environment for ``rank`` (node-major, ``per_node`` ranks on each daemon),
    the default group on lpsync, and a gloo group over every rank to compare with."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LPSYNC_SOCKET=sockets[rank // per_node],
    )
    import lpsync_client.torch  # noqa: F401 - registers "lpsync"

    dist.init_process_group("lpsync", timeout=timedelta(seconds=timeout))
    return dist.new_group(backend="gloo")


def _inputs(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Small integers (exact in every dtype, sums and products of four ranks included)."""
    g = torch.Generator().manual_seed(seed)
    low = 0 if dtype in (torch.uint8, torch.bool) else -3
    high = 2 if dtype == torch.bool else 4
    return torch.randint(low, high, shape, generator=g).to(dtype)


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a strided view (every other column of a wider tensor)."""
    wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def _same(failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
    try:
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            torch.testing.assert_close(got, want)
    except AssertionError as error:
        failures.append(f"{what}: {str(error)[:300]}")


class Both:
    """Run one operation on the lpsync group and on gloo, each on its own copy of the same
    inputs, sync or async (async: through wait() or get_future(), alternately)."""

    def __init__(self, gloo: dist.ProcessGroup, async_op: bool) -> None:
        self.gloo, self.async_op, self.n = gloo, async_op, 0

    def __call__(self, fn: Callable[..., object]) -> None:
        for group in (None, self.gloo):
            work = fn(group=group, async_op=self.async_op)
            if self.async_op:
                if isinstance(work, torch.futures.Future):  # all_reduce_coalesced's
                    work.wait()
                    continue
                if group is not None:  # gloo (some of its works have no future)
                    work.wait()
                    continue
                self.n += 1
                if self.n % 2:
                    assert work.wait() is True
                else:
                    assert isinstance(work.get_future().wait(), list)
                assert work.is_completed() and work.is_success()


def ops_against_gloo(rank: int, world: int, sockets: list[str], per_node: int, port: int) -> list[str]:
    gloo = init(rank, world, sockets, per_node, port)
    failures: list[str] = []
    for async_op in (False, True):
        both = Both(gloo, async_op)
        mode = "async" if async_op else "sync"
        for dtype in DTYPES:
            _one_dtype(failures, both, rank, world, dtype, f"{mode} {dtype}")
    _float_inputs(failures, gloo, rank, world)
    _objects(failures, gloo, rank, world)
    _point_to_point(failures, gloo, rank, world)
    _sparse(failures, gloo, rank, world)
    _coalesced(failures, gloo, rank, world)
    _subgroups(failures, rank, world)
    dist.destroy_process_group()
    return failures


def _one_dtype(failures: list[str], both: Both, rank: int, world: int, dtype: torch.dtype, tag: str) -> None:
    for shape, layout in (((5, 7), "contiguous"), ((5, 7), "strided"), ((0,), "empty")):
        _one_layout(failures, both, rank, world, dtype, tag, shape, layout)
    both(lambda group, async_op: dist.barrier(group=group, async_op=async_op))


def _one_layout(
    failures: list[str],
    both: Both,
    rank: int,
    world: int,
    dtype: torch.dtype,
    tag: str,
    shape: tuple[int, ...],
    layout: str,
) -> None:
    base = _inputs(rank * 1000 + len(shape), dtype, shape)

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        # Only lpsync gets the strided view: gloo's result on it is not a reference.
        a, b = base.clone(), base.clone()
        return (_noncontiguous(a), b) if layout == "strided" else (a, b)

    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    if dtype.is_floating_point:
        ops.append(R.AVG)
    for op in ops:
        a, b = pair()
        both(
            lambda group, async_op, op=op, a=a, b=b: dist.all_reduce(
                a if group is None else b, op=op, group=group, async_op=async_op
            )
        )
        _same(failures, f"{tag} {layout} all_reduce {op}", a, b, exact=op != R.AVG)
    a, b = pair()
    root = world - 1
    both(
        lambda group, async_op: dist.broadcast(
            a if group is None else b, group_src=root, group=group, async_op=async_op
        )
    )
    _same(failures, f"{tag} {layout} broadcast", a, b)
    a, b = pair()
    untouched = a.clone()
    both(
        lambda group, async_op: dist.reduce(
            a if group is None else b, group_dst=1, op=R.MAX, group=group, async_op=async_op
        )
    )
    if rank == 1:  # only the root's result is defined
        _same(failures, f"{tag} {layout} reduce", a, b)
    else:  # lpsync leaves the other ranks' tensors as they were
        _same(failures, f"{tag} {layout} reduce (non-root)", a, untouched)
    a, b = pair()
    outs = {k: [torch.full_like(a, 9) for _ in range(world)] for k in "ab"}
    both(
        lambda group, async_op: dist.all_gather(
            outs["a" if group is None else "b"], a if group is None else b, group=group, async_op=async_op
        )
    )
    for i in range(world):
        _same(failures, f"{tag} {layout} all_gather[{i}]", outs["a"][i], outs["b"][i])
    flat = {k: torch.zeros((world * shape[0], *shape[1:]), dtype=dtype) for k in "ab"}
    both(
        lambda group, async_op: dist.all_gather_single(
            flat["a" if group is None else "b"], a if group is None else b, group=group, async_op=async_op
        )
    )
    _same(failures, f"{tag} {layout} all_gather_single", flat["a"], flat["b"])
    ins = [_inputs(rank * 7 + i, dtype, shape) for i in range(world)]
    red = {k: torch.zeros(shape, dtype=dtype) for k in "ab"}
    both(
        lambda group, async_op: dist.reduce_scatter(
            red["a" if group is None else "b"], [t.clone() for t in ins], group=group, async_op=async_op
        )
    )
    _same(failures, f"{tag} {layout} reduce_scatter", red["a"], red["b"])
    whole = torch.cat(ins)
    both(
        lambda group, async_op: dist.reduce_scatter_single(
            red["a" if group is None else "b"], whole.clone(), op=R.MIN, group=group, async_op=async_op
        )
    )
    _same(failures, f"{tag} {layout} reduce_scatter_single", red["a"], red["b"])
    _data_movement(failures, both, rank, world, tag, layout, pair, ins)
    many = {k: [base.clone(), base.clone() * 2, base.clone()[:1]] for k in "ab"}
    if dtype != torch.bool and dtype.itemsize > 1:  # doubling stays exact
        both(
            lambda group, async_op: dist.all_reduce_coalesced(
                many["a" if group is None else "b"], group=group, async_op=async_op
            )
        )
        for x, y in zip(many["a"], many["b"], strict=True):
            _same(failures, f"{tag} {layout} all_reduce_coalesced", x, y)


def _data_movement(
    failures: list[str],
    both: Both,
    rank: int,
    world: int,
    tag: str,
    layout: str,
    pair: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ins: list[torch.Tensor],
) -> None:
    """gather, scatter, all_to_all and all_to_all_single (even and uneven splits)."""
    a, b = pair()
    shape = a.shape
    got = {k: [torch.full_like(ins[0], 9) for _ in range(world)] if rank == 0 else None for k in "ab"}
    both(
        lambda group, async_op: dist.gather(
            a if group is None else b,
            got["a" if group is None else "b"],
            group_dst=0,
            group=group,
            async_op=async_op,
        )
    )
    for i in range(world if rank == 0 else 0):
        _same(failures, f"{tag} {layout} gather[{i}]", got["a"][i], got["b"][i])
    a, b = pair()
    both(
        lambda group, async_op: dist.scatter(
            a if group is None else b,
            [t.clone() for t in ins] if rank == world - 1 else None,
            group_src=world - 1,
            group=group,
            async_op=async_op,
        )
    )
    _same(failures, f"{tag} {layout} scatter", a, b)
    lists = {k: [torch.full_like(ins[0], 9) for _ in range(world)] for k in "ab"}
    both(
        lambda group, async_op: dist.all_to_all(
            lists["a" if group is None else "b"], [t.clone() for t in ins], group=group, async_op=async_op
        )
    )
    for i in range(world):
        _same(failures, f"{tag} {layout} all_to_all[{i}]", lists["a"][i], lists["b"][i])
    whole = torch.cat(ins)
    single = {k: torch.full_like(whole, 9) for k in "ab"}
    both(
        lambda group, async_op: dist.all_to_all_single(
            single["a" if group is None else "b"], whole.clone(), group=group, async_op=async_op
        )
    )
    _same(failures, f"{tag} {layout} all_to_all_single", single["a"], single["b"])
    if len(shape) < 2:
        return

    # Uneven: rank i sends rows(i, j) rows to rank j (some none at all).
    def rows(i: int, j: int) -> int:
        return (i + 2 * j) % 3

    sent = [rows(rank, j) for j in range(world)]
    received = [rows(i, rank) for i in range(world)]
    src = _inputs(rank * 13 + 5, ins[0].dtype, (sum(sent), *shape[1:]))
    uneven = {k: torch.full((sum(received), *shape[1:]), 9, dtype=ins[0].dtype) for k in "ab"}
    both(
        lambda group, async_op: dist.all_to_all_single(
            uneven["a" if group is None else "b"],
            src.clone(),
            output_split_sizes=received,
            input_split_sizes=sent,
            group=group,
            async_op=async_op,
        )
    )
    _same(failures, f"{tag} {layout} all_to_all_single uneven", uneven["a"], uneven["b"])


def _sparse(failures: list[str], gloo: dist.ProcessGroup, rank: int, world: int) -> None:
    """A sparse (COO) all_reduce, overlapping and distinct indices and nnz per rank, and
    DDP over an nn.Embedding(sparse=True): gloo's coalesced result, bit for bit."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def coo() -> torch.Tensor:
        indices = torch.tensor([[rank, 3, 5 + rank, 9][: 2 + rank % 3], [0, 1, 2, 3][: 2 + rank % 3]])
        values = torch.arange(1.0, 3.0 + rank % 3) * (rank + 1)
        return torch.sparse_coo_tensor(indices, values, (12, 4))

    got = {}
    for name, group in (("lpsync", None), ("gloo", gloo)):
        got[name] = coo()
        dist.all_reduce(got[name], group=group)
    if not got["lpsync"].is_coalesced():
        failures.append("sparse all_reduce: the result is not coalesced")
    _same(failures, "sparse all_reduce (indices)", got["lpsync"].indices(), got["gloo"].coalesce().indices())
    _same(failures, "sparse all_reduce (values)", got["lpsync"].values(), got["gloo"].coalesce().values())
    weights = {}
    for name, group in (("lpsync", None), ("gloo", gloo)):
        torch.manual_seed(0)
        embedding = nn.Embedding(20, 3, sparse=True)
        model = DDP(embedding, process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.tensor([rank, 4, 7 + rank])).sum().backward()
        optimizer.step()
        weights[name] = embedding.weight.detach()
    _same(failures, "DDP over a sparse embedding", weights["lpsync"], weights["gloo"])


def _point_to_point(failures: list[str], gloo: dist.ProcessGroup, rank: int, world: int) -> None:
    """isend/irecv around a ring, batch_isend_irecv both ways, tags, a strided tensor and a
    send inside a sub-group, each compared with gloo's."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for name, group in (("lpsync", None), ("gloo", gloo)):
        got = torch.zeros(6, 3)
        out = torch.arange(18.0).reshape(6, 3) + 100 * rank
        works = [dist.isend(out, right, group=group, tag=4), dist.irecv(got, left, group=group, tag=4)]
        for w in works:
            w.wait()
        _same(failures, f"isend/irecv ring on {name}", got, torch.arange(18.0).reshape(6, 3) + 100 * left)
        both_ways = [torch.zeros(5, dtype=torch.int64) for _ in range(2)]
        ops = [
            dist.P2POp(dist.isend, torch.full((5,), rank, dtype=torch.int64), right, group),
            dist.P2POp(dist.isend, torch.full((5,), -rank, dtype=torch.int64), left, group),
            dist.P2POp(dist.irecv, both_ways[0], left, group),
            dist.P2POp(dist.irecv, both_ways[1], right, group),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        want = [torch.full((5,), left, dtype=torch.int64), torch.full((5,), -right, dtype=torch.int64)]
        for got_one, w in zip(both_ways, want, strict=True):
            _same(failures, f"batch_isend_irecv on {name}", got_one, w)
        # lpsync receives into a strided view (written back); gloo refuses one
        strided = torch.zeros(4, 6)[:, ::2] if group is None else torch.zeros(4, 3)
        if rank == 0:
            dist.send(torch.ones(4, 3) * 7, 1, group=group, tag=2)
        elif rank == 1:
            dist.recv(strided, 0, group=group, tag=2)
            _same(failures, f"send into a strided tensor on {name}", strided, torch.ones(4, 3) * 7)
        # recv from any source: every other rank sends to rank 0, which names each sender
        if rank == 0:
            senders = []
            for _ in range(world - 1):
                got_any = torch.zeros(2)
                senders.append(dist.recv(got_any, group=group, tag=6))
                want_any = torch.full((2,), senders[-1] * 1.5)
                _same(failures, f"recv from any source on {name}", got_any, want_any)
            if sorted(senders) != list(range(1, world)):
                failures.append(f"recv from any source on {name}: senders {senders}")
        else:
            dist.send(torch.full((2,), rank * 1.5), 0, group=group, tag=6)
    pair = dist.new_group([0, world - 1])  # group ranks 0 and 1: global 0 and world-1
    if rank in (0, world - 1):
        x = torch.full((3,), float(rank))
        if rank == 0:
            dist.send(x, world - 1, group=pair)
        else:
            dist.recv(x, 0, group=pair)
            _same(failures, "recv in a sub-group", x, torch.zeros(3))
        # From any source in the sub-group: torch maps its group rank back to the global one.
        y = torch.full((3,), float(rank))
        if rank == world - 1:
            dist.send(y, 0, group=pair, tag=3)
        else:
            sender = dist.recv(y, group=pair, tag=3)
            if sender != world - 1:
                failures.append(f"recv from any source in a sub-group: sender {sender}, not {world - 1}")
            _same(failures, "recv from any source in a sub-group", y, torch.full((3,), float(world - 1)))


def _objects(failures: list[str], gloo: dist.ProcessGroup, rank: int, world: int) -> None:
    """gather_object and scatter_object_list (pickles of uneven sizes, padded by torch)."""
    mine = {"rank": rank, "payload": "x" * (rank * 37 + 1)}
    for group in (None, gloo):
        got = [None] * world if rank == 0 else None
        dist.gather_object(mine, got, dst=0, group=group)
        if rank == 0 and got != [{"rank": r, "payload": "x" * (r * 37 + 1)} for r in range(world)]:
            failures.append(f"gather_object on {group or 'lpsync'}: {got}")
        out: list = [None]
        objs = [[r, "y" * (5 * r)] for r in range(world)] if rank == world - 1 else None
        dist.scatter_object_list(out, objs, src=world - 1, group=group)
        if out[0] != [rank, "y" * (5 * rank)]:
            failures.append(f"scatter_object_list on {group or 'lpsync'}: {out}")
    # all_gather_coalesced: outputs rank-major, inputs of different shapes.
    ins = [torch.full((2,), float(rank)), torch.full((3, 2), rank + 10.0)]
    got = {}
    for name, group in (("lpsync", None), ("gloo", gloo)):
        got[name] = [[torch.zeros_like(t) for t in ins] for _ in range(world)]
        dist.all_gather_coalesced(got[name], ins, group=group)
    for r in range(world):
        for j in range(len(ins)):
            _same(failures, f"all_gather_coalesced[{r}][{j}]", got["lpsync"][r][j], got["gloo"][r][j])


def _float_inputs(failures: list[str], gloo: dist.ProcessGroup, rank: int, world: int) -> None:
    """Random floats, a message of several chunks: equal to gloo within rounding."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(300_001, generator=g)
    a, b = x.clone(), x.clone()
    dist.all_reduce(a)
    dist.all_reduce(b, group=gloo)
    _same(failures, "float32 randn all_reduce", a, b, exact=False)
    a, b = x.clone(), x.clone()
    dist.all_reduce(a, op=R.AVG)
    dist.all_reduce(b, op=R.AVG, group=gloo)
    _same(failures, "float32 randn all_reduce AVG", a, b, exact=False)


def _coalesced(failures: list[str], gloo: dist.ProcessGroup, rank: int, world: int) -> None:
    """torch's coalescing manager (what FSDP1 and DDP's bucketing helpers use): its
    all_reduces go out as one allreduce_coalesced, its all_gather_into_tensors as one
    all_gather_single_coalesced."""
    results = []
    for group in (None, gloo):
        xs = [torch.full((n,), float(rank + n)) for n in (3, 5, 1)]
        outs = [torch.zeros(world * n) for n in (3, 5, 1)]
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for x in xs:
                dist.all_reduce(x, group=group)
        cm.wait()
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for x, out in zip(xs, outs, strict=True):
                dist.all_gather_into_tensor(out, x, group=group)
        cm.wait()
        results.append(xs + outs)
    for x, y in zip(*results, strict=True):
        _same(failures, "coalescing manager", x, y)


def _subgroups(failures: list[str], rank: int, world: int) -> None:
    """new_group on lpsync: its own job; ranks outside it are not part of it."""
    evens = list(range(0, world, 2))
    sub = dist.new_group(evens)
    sub_gloo = dist.new_group(evens, backend="gloo")
    if rank in evens:
        a = torch.full((4,), float(rank + 1))
        b = a.clone()
        w = dist.all_reduce(a, group=sub, async_op=True)
        dist.all_reduce(b, group=sub_gloo)
        w.wait()
        _same(failures, "subgroup all_reduce", a, b)
        c = torch.full((3,), float(rank))
        dist.broadcast(c, group_src=len(evens) - 1, group=sub)
        _same(failures, "subgroup broadcast", c, torch.full((3,), float(evens[-1])))
    # The default group still works after (and between) the subgroup's collectives.
    t = torch.ones(2)
    dist.all_reduce(t)
    _same(failures, "default group after subgroup", t, torch.full((2,), float(world)))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 3),
    )


def _train(model: torch.nn.Module, rank: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 10, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def ddp_against_gloo(
    rank: int, world: int, sockets: list[str], per_node: int, port: int, steps: int = 20
) -> float:
    """DDP without any hook on the lpsync group and on gloo, from different initial weights
    per rank (DDP broadcasts rank 0's); the largest parameter difference at the end."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = init(rank, world, sockets, per_node, port)
    ours = DDP(_model(seed=rank), bucket_cap_mb=0.001)  # several buckets
    theirs = DDP(_model(seed=rank), process_group=gloo, bucket_cap_mb=0.001)
    _train(ours, rank, steps)
    _train(theirs, rank, steps)
    diff = max(
        (p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters(), strict=True)
    )
    # Every rank ends with the same parameters (bitwise: lpsync is deterministic).
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], x) for x in gathered), "ranks diverged"
    dist.destroy_process_group()
    return diff


def fsdp_against_gloo(
    rank: int, world: int, sockets: list[str], per_node: int, port: int, steps: int = 10
) -> tuple[float, int]:
    """FSDP2 (fully_shard) on a mesh over the lpsync group and on one over gloo: the
    largest difference of the full parameters at the end, and how many collectives the
    lpsync run issued (FSDP's all-gathers and reduce-scatters)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    gloo = init(rank, world, sockets, per_node, port)
    client = dist.group.WORLD.client  # lpsync's: its sequence counts the collectives issued
    before = client._sequence
    results = []
    issued = 0
    for group in (dist.group.WORLD, gloo):
        mesh = DeviceMesh.from_group(group, "cpu")
        model = _model(seed=0)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, rank, steps)
        results.append([p.full_tensor().detach() for p in model.parameters()])
        issued = issued or client._sequence - before
    dist.destroy_process_group()
    return max((p - q).abs().max().item() for p, q in zip(*results, strict=True)), issued


def killed_rank(
    rank: int, world: int, sockets: list[str], per_node: int, port: int
) -> tuple[str, str, float]:
    """The last rank dies (os._exit) in the middle of a loop of all_reduces; the others
    report (exception type, message, seconds from their last success to the error)."""
    init(rank, world, sockets, per_node, port, timeout=120.0)
    t = torch.ones(1000)
    last = time.monotonic()
    try:
        for step in range(10_000):
            if rank == world - 1 and step == 20:
                os._exit(3)
            dist.all_reduce(t, op=R.MAX)
            last = time.monotonic()
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - last
    return "none", "", 0.0


def errors(rank: int, world: int, sockets: list[str], per_node: int, port: int) -> dict[str, str]:
    """Every refused operation's (type: message); the group still works after each."""
    init(rank, world, sockets, per_node, port, timeout=8.0)
    seen: dict[str, str] = {}
    t = torch.ones(4)
    attempts: dict[str, Callable[[], object]] = {
        "all_to_all of a short list": lambda: dist.all_to_all([t.clone()], [t.clone()]),
        "band": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=R.BAND),
        "premul_sum": lambda: dist.all_reduce(t, op=R.PREMUL_SUM(2.0)),
        "complex64 dtype": lambda: dist.broadcast(torch.ones(2, dtype=torch.cfloat), 0),
        "int16 dtype": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16)),
        "bool avg": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=R.AVG),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            seen[name] = "no error"
        except Exception as error:
            seen[name] = f"{type(error).__name__}: {error}"
        dist.barrier()  # nothing was left half-issued: the ranks still match
    # A mismatch (another count on the last rank) fails every rank at once.
    n = 6 if rank == world - 1 else 5
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(n))
        seen["mismatch"] = "no error"
    except Exception as error:
        seen["mismatch"] = f"{type(error).__name__}: {error}"
    seen["mismatch seconds"] = f"{time.monotonic() - started:.2f}"
    # A rank that never arrives: the others' wait() fails at the group's timeout.
    if rank == 0:
        time.sleep(8.0 + 6.0)  # past the others' timeout: they must not see it leave
    else:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3), async_op=True).wait()
            seen["timeout"] = "no error"
        except Exception as error:
            seen["timeout"] = f"{type(error).__name__}: {error}"
        seen["timeout seconds"] = f"{time.monotonic() - started:.2f}"
    dist.destroy_process_group()
    return seen


def uneven_group(rank: int, world: int, sockets: list[str], per_node: int, port: int) -> str:
    """new_group over ranks 0..world-2: on two nodes of two, an uneven layout (two ranks
    on node 0, one on node 1); each member all-reduces its rank in it and reports the sum."""
    init(rank, world, sockets, per_node, port)
    try:
        group = dist.new_group(list(range(world - 1)))
        outcome = "created"
        if rank < world - 1:
            t = torch.full((4,), float(rank))
            dist.all_reduce(t, group=group)
            outcome = f"sum {t[0].item()}"
    except dist.DistBackendError as error:
        outcome = f"DistBackendError: {error}"
    dist.barrier()  # the default group is unaffected
    dist.destroy_process_group()
    return outcome


def sync_ops_answered_here(rank: int, world: int, sockets: list[str], per_node: int, port: int) -> dict:
    """How many of each kind of call were answered on the calling thread (the client's
    Client._answer_now), and any wrong result: 20 each of synchronous all_reduce, broadcast,
    reduce, all_gather_into_tensor and reduce_scatter_tensor of a small tensor, 20
    synchronous barriers, 20 async all_reduces, 3 synchronous all_reduces of 2 MiB."""
    from lpsync_client.client import Client

    answered = [0]
    answer_now = Client._answer_now

    def counted(self, *args):
        here = answer_now(self, *args)
        answered[0] += here
        return here

    Client._answer_now = counted  # type: ignore[method-assign]  # this rank process only
    init(rank, world, sockets, per_node, port)
    counts, wrong = {}, []
    ranks = torch.arange(world, dtype=torch.float32)
    kinds = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier", "async", "large")
    for kind in kinds:
        answered[0] = 0
        for i in range(3 if kind == "large" else 20):
            t = torch.full((1 << 19,) if kind == "large" else (4,), float(rank + i))
            if kind == "broadcast":
                dist.broadcast(t, src=1)
                want = 1.0 + i
            elif kind == "reduce":
                dist.reduce(t, dst=0)
                want = float((ranks + i).sum()) if rank == 0 else float(rank + i)
            elif kind == "all_gather":  # every rank's block, in rank order
                out = torch.empty(world * 4)
                dist.all_gather_into_tensor(out, t)
                t, want = out - (ranks + i).repeat_interleave(4), 0.0
            elif kind == "reduce_scatter":
                t = torch.empty(4)
                dist.reduce_scatter_tensor(t, torch.full((world * 4,), float(rank + i)))
                want = float((ranks + i).sum())
            elif kind == "barrier":  # no result to check (the barrier tests check waiting)
                dist.barrier()
                continue
            elif kind == "async":
                dist.all_reduce(t, async_op=True).wait()
                want = float((ranks + i).sum())
            else:
                dist.all_reduce(t)
                want = float((ranks + i).sum())
            if not bool((t == want).all()):
                wrong.append(f"{kind} #{i}: {t[:4].tolist()} != {want}")
        counts[kind] = answered[0]
    dist.destroy_process_group()
    return {"answered": counts, "wrong": wrong}


def sync_ops_armed(rank: int, world: int, sockets: list[str], per_node: int, port: int) -> dict:
    """30 calls each of synchronous all_reduce, broadcast, reduce, all_gather_into_tensor,
    reduce_scatter_tensor (float32 and int64, fresh values every call) and barrier: every
    result against numpy's over every rank's inputs and gloo's (bitwise), how many of this
    rank's calls its job's doorbell answered (Client._ring said OK), and the daemon's count
    of the job's collectives its engine answered (and sent back) around each kind."""
    from lpsync_client import doorbell
    from lpsync_client.client import Client

    rung = [0]
    ring = Client._ring

    def counted(self, *args):
        code = ring(self, *args)
        rung[0] += code == doorbell.OK
        return code

    Client._ring = counted  # type: ignore[method-assign]  # this rank process only
    gloo = init(rank, world, sockets, per_node, port)
    client = dist.group.WORLD.client  # lpsync's

    def engine() -> tuple[int, int]:
        dist.barrier(group=gloo)  # every rank's calls of the kind are done
        (job,) = [j for j in client.status().jobs if j.job == client.job]
        return job.native_answered, job.native_fallbacks

    def inputs(r: int, i: int, dtype: torch.dtype, n: int) -> np.ndarray:
        """Rank r's input of call i: small integers, exact in any summation order."""
        return (
            np.random.default_rng([r, i, n])
            .integers(-50, 50, n)
            .astype(torch.empty(0, dtype=dtype).numpy().dtype)
        )

    results: dict[str, tuple[int, int, int]] = {}
    wrong: list[str] = []
    n, calls = 5, 30
    for kind in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier"):
        for dtype in (torch.float32, torch.int64) if kind != "barrier" else (None,):
            tag = f"{kind} {dtype}"
            rung[0], (answered, sent_back) = 0, engine()
            for i in range(calls):
                if dtype is None:
                    dist.barrier()
                    continue
                size = n * world if kind == "reduce_scatter" else n
                every = [inputs(r, i, dtype, size) for r in range(world)]
                mine, total = every[rank], np.sum(every, axis=0)
                if kind == "all_reduce":
                    want, got, ref = total, torch.from_numpy(mine.copy()), torch.from_numpy(mine.copy())
                    dist.all_reduce(got)
                    dist.all_reduce(ref, group=gloo)
                elif kind in ("broadcast", "reduce"):
                    got, ref = torch.from_numpy(mine.copy()), torch.from_numpy(mine.copy())
                    if kind == "broadcast":
                        want = every[1]
                        dist.broadcast(got, src=1)
                        dist.broadcast(ref, src=1, group=gloo)
                    else:
                        want = total if rank == 0 else mine
                        dist.reduce(got, dst=0)
                        dist.reduce(ref, dst=0, group=gloo)
                elif kind == "all_gather":
                    want = np.concatenate(every)
                    got, ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
                    dist.all_gather_into_tensor(got, torch.from_numpy(mine))
                    dist.all_gather_into_tensor(ref, torch.from_numpy(mine), group=gloo)
                else:
                    want = total[rank * n : (rank + 1) * n]
                    got, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(got, torch.from_numpy(mine))
                    dist.reduce_scatter_tensor(ref, torch.from_numpy(mine), group=gloo)
                if kind == "reduce" and rank != 0:  # gloo leaves partial sums there; lpsync the input
                    ref = got
                if not (np.array_equal(got.numpy(), want) and torch.equal(got, ref)):
                    wrong.append(f"{tag} #{i}: {got.tolist()} != numpy {want.tolist()} / gloo {ref.tolist()}")
            after = engine()
            results[tag] = (rung[0], after[0] - answered, after[1] - sent_back)
    dist.destroy_process_group()
    return {"results": results, "wrong": wrong}
