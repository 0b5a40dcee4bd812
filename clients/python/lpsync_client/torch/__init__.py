"""lpsync_client.torch: PyTorch on lpsync. Importing it registers the torch.distributed
backend ``lpsync``: ``dist.init_process_group("lpsync")``."""

try:
    import torch  # noqa: F401
except ImportError as error:  # the client itself needs only numpy and grpcio
    raise ImportError("lpsync_client.torch needs PyTorch: pip install torch "
                      "(or 'lpsync-client[torch]')") from error

from lpsync_client.torch.backend import BACKEND, ProcessGroupLpsync, register

register()

__all__ = ["BACKEND", "ProcessGroupLpsync", "register"]
