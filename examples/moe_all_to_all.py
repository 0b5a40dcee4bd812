"""A mixture-of-experts layer with one expert per rank: tokens travel to their expert and
back with all_to_all_single (uneven splits, as a router makes them), on the process
group's backend — `lpsync` or, to compare, `gloo`.

    lpsync daemon --socket /tmp/lpsync.sock &
    LPSYNC_SOCKET=/tmp/lpsync.sock torchrun --nproc-per-node 2 examples/moe_all_to_all.py [--backend gloo]

Every rank routes its own tokens (top-1 of a replicated router, whose gradients are
averaged with all_reduce); each expert trains on the tokens routed to it from every rank.
The last line prints the final loss: the same bits on both backends.
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn
from torch import nn

import lpsync_client.torch  # noqa: F401  (registers the "lpsync" backend)

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="lpsync", choices=["lpsync", "gloo"])
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
router = nn.Linear(16, world)  # replicated: the same initial weights on every rank
torch.manual_seed(100 + rank)
expert = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))  # this rank's own
optimizer = torch.optim.SGD([*router.parameters(), *expert.parameters()], lr=0.1)
g = torch.Generator().manual_seed(rank)
target = torch.linspace(-1, 1, 16)

for step in range(args.steps):
    tokens = torch.randn(64, 16, generator=g)
    gates = torch.softmax(router(tokens), dim=1)
    weight, chosen = gates.max(dim=1)
    order = torch.argsort(chosen, stable=True)  # tokens grouped by their expert
    sent = torch.bincount(chosen, minlength=world)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)  # how many tokens each expert gets from each rank
    send_sizes, recv_sizes = sent.tolist(), received.tolist()
    arrived = dfn.all_to_all_single(torch.empty(sum(recv_sizes), 16), tokens[order], recv_sizes, send_sizes)
    processed = dfn.all_to_all_single(
        torch.empty(sum(send_sizes), 16), expert(arrived), send_sizes, recv_sizes
    )
    out = torch.empty_like(processed).index_copy(0, order, processed) * weight.unsqueeze(1)
    loss = ((out - tokens * target) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    for p in router.parameters():  # the replicated router: average its gradients
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world
    optimizer.step()
    if rank == 0 and step % 10 == 9:
        print(f"step {step + 1}: loss {loss.item():.6f}", flush=True)

losses = [torch.zeros(1) for _ in range(world)]
dist.all_gather(losses, loss.detach().reshape(1))
if rank == 0:
    print(f"{args.backend}: final loss of {world} ranks " + " ".join(f"{x.item():.9e}" for x in losses))
dist.destroy_process_group()
