"""Pipeline parallelism with torch.distributed.pipelining: a 4-layer MLP, one stage per
rank, trained with the GPipe and the 1F1B schedule; the activations and their gradients
move between stages with batch_isend_irecv on the process group's backend — `lpsync` or,
to compare, `gloo`.

    lpsync daemon --socket /tmp/lpsync.sock &
    LPSYNC_SOCKET=/tmp/lpsync.sock torchrun --nproc-per-node 4 examples/pipeline_parallel.py [--backend gloo]

The last stage prints each schedule's losses; the last line is the same bits on both
backends (nothing is reduced between stages: data only moves).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import lpsync_client.torch  # noqa: F401  (registers the "lpsync" backend)

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="lpsync", choices=["lpsync", "gloo"])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--microbatches", type=int, default=4)
args = parser.parse_args()

dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
last = rank == world - 1
g = torch.Generator().manual_seed(7)
inputs, targets = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)
report = []
for name, Schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
    torch.manual_seed(rank)  # each stage its own layer, the same on both backends
    layer = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    stage = PipelineStage(layer, rank, world, torch.device("cpu"))
    schedule = Schedule(stage, args.microbatches, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses: list[torch.Tensor] = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets, losses=step_losses)
        else:
            schedule.step()
        optimizer.step()
        losses += step_losses
    if last:
        report.append(f"{name} " + " ".join(f"{x.item():.9e}" for x in losses))
        print(f"{name}: loss {losses[0].item():.4f} -> {losses[-1].item():.4f}", flush=True)
dist.barrier()
if last:
    print(f"{args.backend} losses: " + " | ".join(report), flush=True)
dist.destroy_process_group()
