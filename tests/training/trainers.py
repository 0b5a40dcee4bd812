"""What the trainer processes of the training tests run (spawned: importable by name).

Every rank trains the same small CNN from the same seed on its own slice of a fixed
random data set; equal slices and mean losses make the gradient average of P ranks the
gradient of the combined batch, so every data-parallel run must end where one process
training on the combined batches ends."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lpsync_client
import lpsync_client.torch as lpt
from lab.ranks import torchrun_env

BATCH = 8  # per rank and step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def data(world: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of every step, rank-major within a step: step s, rank r holds
    rows (s * world + r) * BATCH onwards."""
    g = torch.Generator().manual_seed(1234)
    n = steps * world * BATCH
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def model() -> Net:
    torch.manual_seed(0)
    return Net()


def flat(m: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy().copy()


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def train(
    m: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, steps: int, after_step=None
) -> None:
    x, y = data(world, steps)
    for s in range(steps):
        rows = slice((s * world + rank) * BATCH, (s * world + rank + 1) * BATCH)
        opt.zero_grad()
        nn.functional.cross_entropy(m(x[rows]), y[rows]).backward()
        opt.step()
        if after_step is not None:
            after_step(s)


def single_process(world: int, steps: int) -> np.ndarray:
    """One process on the combined batch of ``world`` ranks: the BSP-SGD reference."""
    x, y = data(world, steps)
    m = model()
    opt = optimizer(m)
    for s in range(steps):
        rows = slice(s * world * BATCH, (s + 1) * world * BATCH)
        opt.zero_grad()
        nn.functional.cross_entropy(m(x[rows]), y[rows]).backward()
        opt.step()
    return flat(m)


def _attach(
    rank: int, world: int, sockets: list[str], per_node: int, job: str, port: int
) -> lpsync_client.Client:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return lpsync_client.connect(
        sockets[rank // per_node],
        job=job,
        rank=rank,
        world_size=world,
        local_rank=rank % per_node,
        local_world_size=per_node,
        timeout=30,
    )


def ddp_gloo_and_lpsync(
    rank: int, world: int, sockets: list[str], per_node: int, job: str, port: int, steps: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Train with DDP over gloo, then with DDP and the lpsync hook (small buckets: several
    per step, rebuilt after the first); both final parameter vectors and how many bucket
    buffers the hook replaced after DDP's rebuild."""
    client = _attach(rank, world, sockets, per_node, job, port)
    try:
        results = []
        state = lpt.hook_state(client)
        for use_lpsync in (False, True):
            m = DDP(model(), bucket_cap_mb=0.01)
            if use_lpsync:
                m.register_comm_hook(state, lpt.allreduce_hook)
            train(m, optimizer(m), rank, world, steps)
            results.append(flat(m.module))
        return results[0], results[1], state.replaced
    finally:
        client.close()
        dist.destroy_process_group()


def distributed_optimizer(
    rank: int, world: int, socket: str, job: str, steps: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """DistributedOptimizer (small buckets) against per-tensor allreduce by hand; both
    final parameter vectors and the number of buckets."""
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=30) as client:
        m = model()
        opt = lpt.DistributedOptimizer(optimizer(m), m.named_parameters(), bucket_bytes=20_000, client=client)
        train(m, opt, rank, world, steps)
        fused, buckets = flat(m), len(opt._lpsync_buckets)
        opt.remove_hooks()

        m = model()
        plain = optimizer(m)
        x, y = data(world, steps)
        for s in range(steps):
            rows = slice((s * world + rank) * BATCH, (s * world + rank + 1) * BATCH)
            plain.zero_grad()
            nn.functional.cross_entropy(m(x[rows]), y[rows]).backward()
            for p in m.parameters():
                lpt.allreduce_(p.grad, "avg", client=client)
            plain.step()
        return fused, flat(m), buckets


def broadcasts(rank: int, world: int, socket: str, job: str) -> tuple[np.ndarray, dict]:
    """Every rank starts from its own seed; after the broadcasts every rank holds rank 1's
    parameters, buffers and Adam state."""
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=30) as client:
        torch.manual_seed(100 + rank)
        m = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
        opt = torch.optim.Adam(m.parameters(), lr=0.01 * (rank + 1))
        if rank == 1:  # only the root has stepped: the others' state is empty
            for _ in range(3):
                opt.zero_grad()
                m(torch.randn(4, 5)).sum().backward()
                opt.step()
        before = torch.cat([t.reshape(-1).double() for t in m.state_dict().values()]).numpy()
        lpt.broadcast_parameters(m.state_dict(), root=1, client=client)
        lpt.broadcast_optimizer_state(opt, root=1, client=client)
        state = opt.state_dict()
        summary = {
            "before": before,
            "lr": state["param_groups"][0]["lr"],
            "steps": [float(s["step"]) for s in state["state"].values()],
            "exp_avg": np.concatenate([s["exp_avg"].reshape(-1).numpy() for s in state["state"].values()]),
        }
        everything = torch.cat([t.reshape(-1).double() for t in m.state_dict().values()])
        return everything.numpy(), summary


def killed_midway(rank: int, world: int, socket: str, job: str, port: int, victim: int) -> str:
    """DDP with the hook; ``victim`` dies (SIGKILL) after two steps. The others must fail
    with the daemon's error instead of hanging; returns their error text and the seconds
    it took."""
    client = _attach(rank, world, [socket], world, job, port)
    m = DDP(model(), bucket_cap_mb=0.01)
    m.register_comm_hook(lpt.hook_state(client), lpt.allreduce_hook)

    def maybe_die(step: int) -> None:
        if rank == victim and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    started = time.monotonic()
    try:
        train(m, optimizer(m), rank, world, 50, maybe_die)
    except Exception as error:  # what the training script sees
        return f"{time.monotonic() - started:.1f}s {type(error).__name__}: {error}"
    finally:
        client.close()
    return "no error"


def hook_does_not_block(rank: int, world: int, socket: str, job: str, port: int) -> tuple[float, float]:
    """Rank 1 starts its backward 2 s late. Rank 0's hook must hand each bucket over and
    return at once (its collectives wait in the daemon while backward goes on); only the
    end of rank 0's backward waits. Returns (seconds inside the hook, seconds of the
    late step) on rank 0."""
    client = _attach(rank, world, [socket], world, job, port)
    try:
        m = DDP(model(), bucket_cap_mb=0.01)
        inside = [0.0]

        def timed(state, bucket):  # no annotations: DDP checks them against its own
            started = time.perf_counter()
            try:
                return lpt.allreduce_hook(state, bucket)
            finally:
                inside[0] += time.perf_counter() - started

        m.register_comm_hook(lpt.hook_state(client), timed)
        opt = optimizer(m)
        x, y = data(world, 1)
        step_seconds = 0.0
        for step in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(
                m(x[rank * BATCH : (rank + 1) * BATCH]), y[rank * BATCH : (rank + 1) * BATCH]
            )
            if step == 2:
                inside[0] = 0.0
                if rank == 1:
                    time.sleep(2.0)
            started = time.perf_counter()
            loss.backward()
            if step == 2:
                step_seconds = time.perf_counter() - started
            opt.step()
        return inside[0], step_seconds
    finally:
        client.close()
        dist.destroy_process_group()


def example_as_rank(rank: int, script: str, args: list[str], world: int, port: int) -> str:
    """Run the example ``script`` in this process as torchrun's rank ``rank`` of ``world``
    on one node runs it (the variables torchrun sets that the process group reads, its
    argv); what it printed."""
    torchrun_env(rank, world, port)
    sys.argv = [script, *args]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(script, run_name="__main__")
    return printed.getvalue()
