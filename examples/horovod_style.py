"""Horovod-style data parallelism through lpsync, without DDP or a process group:
broadcast the initial state from rank 0, wrap the optimizer, train.

    lpsync daemon --socket /tmp/lpsync.sock &
    LPSYNC_SOCKET=/tmp/lpsync.sock torchrun --nproc-per-node 2 examples/horovod_style.py
"""

import os

import torch
from torch import nn

import lpsync_client.torch as lpt

rank = int(os.environ["RANK"])
torch.manual_seed(rank)  # different on purpose: broadcast_parameters fixes it
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

lpt.broadcast_parameters(model.state_dict(), root=0)
lpt.broadcast_optimizer_state(optimizer, root=0)
optimizer = lpt.DistributedOptimizer(optimizer, model.named_parameters())  # fused buckets

g = torch.Generator().manual_seed(100 + rank)
true_w = torch.arange(20, dtype=torch.float32) / 20
for step in range(200):
    x = torch.randn(32, 20, generator=g)
    loss = nn.functional.mse_loss(model(x).squeeze(1), x @ true_w)
    optimizer.zero_grad()
    loss.backward()  # each bucket is averaged as soon as its gradients are ready
    optimizer.step()  # waits for the buckets, then Adam's step
    if step % 50 == 49:
        average = lpt.allreduce(loss.detach(), op="avg")
        if rank == 0:
            print(f"step {step + 1}: loss over all ranks {average.item():.4f}", flush=True)

params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
assert torch.equal(params, lpt.allreduce(params, op="max")), "ranks diverged"
if rank == 0:
    print("every rank holds the same parameters")
