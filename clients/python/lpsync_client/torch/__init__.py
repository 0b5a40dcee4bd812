"""PyTorch on lpsync: the torch.distributed backend ``lpsync``, a DDP communication hook,
Horovod-style calls and a fused-bucket DistributedOptimizer, all through the node's daemon.

    import lpsync_client.torch as lpt               # registers the backend "lpsync"
    dist.init_process_group("lpsync")               # any torch.distributed code, unchanged

    model = DistributedDataParallel(model)                          # or, on any process group:
    model.register_comm_hook(lpt.hook_state(), lpt.allreduce_hook)  # gradients through lpsync

    opt = lpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())       # or: no DDP at all
    lpt.broadcast_parameters(model.state_dict(), root=0)
    lpt.broadcast_optimizer_state(opt, root=0)

Every call attaches (once per process) from the environment as ``lpsync_client.connect()``
does (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, LPSYNC_SOCKET, LPSYNC_JOB), or uses
the ``client=`` given. CPU tensors go through shared memory; CUDA tensors are staged through
host memory (logged once).
"""

try:
    import torch as _torch  # noqa: F401 - fail here, with what to install
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "lpsync_client.torch needs PyTorch, which is not installed: "
        "pip install 'lpsync-client[torch]' (or pip install torch)"
    ) from error

from lpsync_client.torch._client import default_client, set_default_client
from lpsync_client.torch._hook import HookState, allreduce_hook, hook_state
from lpsync_client.torch._ops import (
    allreduce,
    allreduce_,
    broadcast,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from lpsync_client.torch._optimizer import DistributedOptimizer
from lpsync_client.torch.backend import BACKEND, ProcessGroupLpsync, register

register()

__all__ = [
    "BACKEND",
    "DistributedOptimizer",
    "HookState",
    "ProcessGroupLpsync",
    "allreduce",
    "allreduce_",
    "allreduce_hook",
    "broadcast",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "default_client",
    "hook_state",
    "register",
    "set_default_client",
]
