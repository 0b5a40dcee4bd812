"""An ordinary DDP script; the line marked "lpsync" sends its gradients through the node's
lpsync daemon instead of the process group.

    lpsync daemon --socket /tmp/lpsync.sock &
    LPSYNC_SOCKET=/tmp/lpsync.sock torchrun --nproc-per-node 2 examples/ddp_one_line.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lpsync_client.torch as lpt

dist.init_process_group("gloo")  # DDP's own bookkeeping (initial broadcast, bucket order)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1)))
model.register_comm_hook(lpt.hook_state(), lpt.allreduce_hook)  # lpsync
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
true_w = torch.arange(20, dtype=torch.float32) / 20
for step in range(200):
    x = torch.randn(32, 20, generator=g)
    loss = nn.functional.mse_loss(model(x).squeeze(1), x @ true_w)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if rank == 0 and step % 50 == 49:
        print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)

# Every rank holds the same parameters (the gradients were averaged)
first = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
mean = lpt.allreduce(first, op="avg")
assert torch.equal(first, mean), "ranks diverged"
if rank == 0:
    print(f"{world} ranks agree on {first.numel()} parameters")
dist.destroy_process_group()
