"""CuPy integration: allreduce a cupy array, or a pytree (dict/list/tuple) of them,
through the node's lpsync daemon, in place.

    import lpsync_client.cupy as lpc
    lpc.allreduce(grads, op="avg")          # every cupy array in grads now holds the average

When the daemon serves cuda (``--devices cuda:...``), each contiguous array is reduced
on the daemon's GPU streams through CUDA IPC, in place: registered once per allocation
span (released when the array is collected), ordered after cupy's current stream by an
interprocess event (no host wait), returned once the daemon finished. Otherwise arrays are
staged through host memory (one fused buffer per dtype) after a synchronize of the
current stream. The client attaches from the environment unless ``client=`` is given.
"""

from __future__ import annotations

from typing import Any

try:
    import cupy
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "lpsync_client.cupy needs CuPy, which is not installed: "
        "pip install 'lpsync-client[cupy]' (or the cupy-cuda12x / cupy-cuda13x "
        "wheel for your CUDA)"
    ) from error

from lpsync_client import _adapt, _fused
from lpsync_client._default import default_client, resolve, set_default_client
from lpsync_client.client import Client

__all__ = ["allreduce", "default_client", "pmean", "set_default_client"]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for key in tree for leaf in _leaves(tree[key])]
    if isinstance(tree, list | tuple):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


def allreduce(
    tree: Any, op: str = "avg", *, client: Client | None = None, name: str = "", timeout: float | None = None
) -> Any:
    """Reduce every cupy array of ``tree`` over every rank, in place; returns ``tree``.
    Every rank passes the same structure, shapes and dtypes.

    >>> lpc.allreduce(x, op="sum")
    """
    arrays = _leaves(tree)
    for a in arrays:
        if not isinstance(a, cupy.ndarray):
            raise TypeError(f"lpsync_client.cupy.allreduce takes cupy arrays, got {type(a)}")
    client = resolve(client)
    if arrays and all(a.flags.c_contiguous and _adapt.on_device_path(client, a) for a in arrays):
        _adapt.allreduce_arrays(client, arrays, op, name=name or "cupy", timeout=timeout)
        return tree
    cupy.cuda.get_current_stream().synchronize()  # the arrays' pending writes first
    hosts = [cupy.asnumpy(a) for a in arrays]
    reduced = _fused.allreduce(client, hosts, op, name=name or "cupy", timeout=timeout)
    for a, result in zip(arrays, reduced, strict=True):
        a.set(result)
    return tree


def pmean(tree: Any, *, client: Client | None = None, timeout: float | None = None) -> Any:
    """Average ``tree``'s arrays over every rank, in place."""
    return allreduce(tree, "avg", client=client, name="pmean", timeout=timeout)
