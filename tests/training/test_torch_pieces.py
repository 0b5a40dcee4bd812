"""Tensors of any size (issue 19): through a daemon whose buffers hold at most 1 MiB
(--max-buffer-bytes), 4 MiB tensors, 12 MiB gathers and a 4 MiB DDP bucket run as several
collectives each, and end bitwise where gloo ends on the same inputs.

One run of three real rank processes does everything (torch's start is most of the time):
the backend's operations on the default lpsync group (the limit learned from the daemon's
first refusal) and on a group whose staging budget is smaller than the daemon's limit, then
one DDP step over gloo, over the lpsync backend, with the lpsync hook, and one
DistributedOptimizer step, on a model whose gradients average exactly."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lab.ranks import torchrun_env
from tests.daemon.harness import DaemonProcess, run_ranks
from tests.ports import free_ports

LIMIT = 1 << 20  # the daemon's --max-buffer-bytes
WORLD = 3
R = dist.ReduceOp


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    daemon = DaemonProcess(tmp_path_factory.mktemp("pieces"), "--max-buffer-bytes", str(LIMIT))
    try:
        (port,) = free_ports(1)
        yield run_ranks(WORLD, ranks, WORLD, daemon.socket, port, timeout=120)
    finally:
        daemon.stop_and_check()


def test_backend_ops_in_pieces_equal_gloo(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["refused"], f"rank {rank}: the daemon took a buffer over its limit"
        assert out["learned"] == LIMIT, f"rank {rank}: the backend did not learn the daemon's limit"
        assert not out["ops"], f"rank {rank}:\n" + "\n".join(out["ops"])


def test_pieces_cut_by_the_staging_budget_equal_gloo(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        # Pieces of 256 KiB: the daemon never refused one, so this group learned nothing.
        assert out["staged_learned"] is None
        assert not out["staged_ops"], f"rank {rank}:\n" + "\n".join(out["staged_ops"])


def test_ddp_step_with_a_bucket_over_the_limit_equals_gloo(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["moved"] > 1000, "the step moved (almost) nothing"
        for path in ("backend", "hook", "optimizer"):
            assert out[path] == 0, f"rank {rank}: {out[path]} parameters differ from gloo's through {path}"
        assert out["hook_pieces"] == 5, "the hook's 4 MiB bucket in 1 MiB pieces"
        assert out["optimizer_pieces"] == 5, "the optimizer's 4 MiB bucket in 1 MiB pieces"
        assert out["digest"] == results[0]["digest"], "ranks disagree"


# -- what each rank runs (spawned) ---------------------------------------------------------


def ranks(rank: int, world: int, socket: str, port: int) -> dict:
    torchrun_env(rank, world, port, socket)
    import lpsync_client
    import lpsync_client.torch as lpt
    from lpsync_client.errors import ResourceExhaustedError
    from lpsync_client.torch import backend
    from lpsync_client.torch._pieces import buffer_limit

    dist.init_process_group("lpsync", timeout=timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    out: dict = {"ops": _ops(rank, world, None, gloo)}
    out["learned"] = buffer_limit(dist.group.WORLD.client)  # type: ignore[union-attr]  # lpsync's group
    budget, backend.STAGING_BYTES = backend.STAGING_BYTES, 256 << 10
    try:
        small = dist.new_group(backend="lpsync")
    finally:
        backend.STAGING_BYTES = budget
    out["staged_ops"] = _ops(rank, world, small, gloo)
    out["staged_learned"] = buffer_limit(small.client)  # type: ignore[union-attr]

    client = lpsync_client.connect(socket, job=f"pieces-hook-{port}", rank=rank, world_size=world, timeout=60)
    try:
        client.empty(4 << 20, "uint8")
        out["refused"] = False
    except ResourceExhaustedError:
        out["refused"] = True
    # The parameters after one step, compared here bit for bit (the test gets counts).
    reference = _ddp_step(DDP(_model(), process_group=gloo), rank)
    out["moved"] = int((_flat(_model()) != reference).sum())
    out["digest"] = hashlib.sha256(reference.tobytes()).hexdigest()

    def differ(params: np.ndarray) -> int:
        return int((params.view(np.uint32) != reference.view(np.uint32)).sum())

    out["backend"] = differ(_ddp_step(DDP(_model()), rank))
    hooked = DDP(_model(), process_group=gloo)
    state = lpt.hook_state(client)
    hooked.register_comm_hook(state, lpt.allreduce_hook)
    out["hook"] = differ(_ddp_step(hooked, rank))
    out["hook_pieces"] = max(len(b.pieces) for b in state._buffers.values())
    m = _model()
    opt = lpt.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.5), m.named_parameters(), client=client
    )
    _inputs_step(m, opt, rank)
    out["optimizer"] = differ(_flat(m))
    out["optimizer_pieces"] = max(len(b.buffer.pieces) for b in opt._lpsync_buckets)  # type: ignore[attr-defined]
    client.close()
    dist.destroy_process_group()
    return out


def _ints(
    seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, high: int = 1000
) -> torch.Tensor:
    """Small integers: sums of three ranks are exact in any order, so gloo's result is the
    one right answer bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-high, high, shape, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _ops(rank: int, world: int, group: dist.ProcessGroup | None, gloo: dist.ProcessGroup) -> list[str]:
    """Every splitting operation on ``group`` (None: the default lpsync group) and on gloo,
    on the same inputs; what differs."""
    failures: list[str] = []

    def same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(_bits(got), _bits(want)):
            bad = (got != want).nonzero()
            failures.append(f"{what}: {len(bad)} elements differ, first at {bad[:1].tolist()}")

    def both(what: str, make, run, contiguous=None) -> None:
        """``run(tensors, group)`` on lpsync and on gloo, each on its own ``make()`` (gloo
        on ``contiguous()`` where given: its results on strided tensors are no reference)."""
        mine, theirs = make(), (contiguous or make)()
        run(mine, group)
        run(theirs, gloo)
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            same(f"{what}[{i}]", a, b)

    n = (4 << 20) // 4  # 4 MiB of float32
    both("all_reduce", lambda: [_ints(rank, (n,))], lambda t, g: dist.all_reduce(t[0], group=g))

    def strided() -> list[torch.Tensor]:
        wide = torch.zeros(1024, 2048)
        view = wide[:, ::2]
        view.copy_(_ints(rank + 10, (1024, 1024)))
        return [view]

    both(
        "all_reduce strided async",
        strided,
        lambda t, g: dist.all_reduce(t[0], op=R.MAX, group=g, async_op=True).wait(),
        lambda: [_ints(rank + 10, (1024, 1024))],
    )
    both(
        "all_reduce bfloat16",
        lambda: [_ints(rank + 20, (2 * n,), torch.bfloat16, high=3)],
        lambda t, g: dist.all_reduce(t[0], group=g),
    )
    both(
        "all_reduce_coalesced",
        lambda: [_ints(rank + 30, (300_001,)), _ints(rank + 31, (500_000,))],
        lambda t, g: dist.all_reduce_coalesced(t, group=g),
    )
    both(
        "broadcast",
        lambda: [_ints(rank + 40, (n,))],
        lambda t, g: dist.broadcast(t[0], group_src=1, group=g),
    )
    mine, theirs = _ints(rank + 50, (n,)), _ints(rank + 50, (n,))
    dist.reduce(mine, group_dst=2, group=group)
    dist.reduce(theirs, group_dst=2, group=gloo)
    same("reduce", mine, theirs if rank == 2 else _ints(rank + 50, (n,)))  # others keep theirs
    inp = torch.randn(n, generator=torch.Generator().manual_seed(rank + 60))  # copies: any values
    both(
        "all_gather_into_tensor async",
        lambda: [torch.full((world * n,), 7.0)],
        lambda t, g: dist.all_gather_into_tensor(t[0], inp, group=g, async_op=True).get_future().wait(),
    )
    both(
        "all_gather",
        lambda: [torch.full((300_001,), 7.0) for _ in range(world)],
        lambda t, g: dist.all_gather(t, inp[:300_001], group=g),
    )
    whole = _ints(rank + 70, (world * 400_000,))
    both(
        "reduce_scatter_tensor",
        lambda: [torch.zeros(400_000)],
        lambda t, g: dist.reduce_scatter_tensor(t[0], whole, op=R.MIN, group=g),
    )
    blocks = list(_ints(rank + 80, (world * 300_001,)).chunk(world))
    both(
        "reduce_scatter",
        lambda: [torch.zeros(300_001)],
        lambda t, g: dist.reduce_scatter(t[0], [b.clone() for b in blocks], group=g),
    )
    return failures


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1024, 1024)  # a 4 MiB weight: a DDP bucket of its own, over the limit


def _flat(m: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy().copy()


def _inputs_step(m: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    """One SGD step on a batch of 3 whose inputs are multiples of 3: every gradient is an
    integer multiple of 3, so its average over 3 ranks is exact whether each rank divides
    first (DDP over gloo) or the daemon divides the sum (avg)."""
    x = 3 * _ints(rank + 90, (3, 1024), high=3)
    opt.zero_grad()
    m(x).sum().backward()
    opt.step()


def _ddp_step(m: DDP, rank: int) -> np.ndarray:
    _inputs_step(m, torch.optim.SGD(m.parameters(), lr=0.5), rank)
    return _flat(m.module)
