"""JAX integration: allreduce a pytree of arrays through the node's lpsync daemon, between
steps and outside ``jit`` (a collective is a side effect).

    import lpsync_client.jax as lpj
    grads = jax.grad(loss)(params, batch)
    grads = lpj.pmean(grads)                       # the average over every rank
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)

Leaves on a GPU, when the daemon serves cuda and JAX's allocator gives memory CUDA IPC
can export, take the device path: each is copied on
its GPU into a fresh buffer (JAX arrays are immutable; the copy is ours to write), which
the daemon reduces in place through CUDA IPC (registered per allocation span, released
when the copy is collected; ordered after XLA's work by ``block_until_ready``); the copies
are the results. Other leaves are read through DLPack (zero copy on CPU), packed into one
shared-memory buffer per dtype (one collective per dtype, not per leaf) and returned as
new arrays on the leaves' devices. JAX 0.11's GPU allocators (the default and
``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` alike, seen on an H200) give memory that CUDA
IPC cannot export: GPU leaves then take the host path too, said once in a warning. The
client attaches from the environment (RANK, WORLD_SIZE, LPSYNC_SOCKET, LPSYNC_JOB...)
unless ``client=`` is given.
"""

from __future__ import annotations

import warnings
from typing import Any

try:
    import jax
    import jax.numpy as jnp
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "lpsync_client.jax needs JAX, which is not installed: "
        "pip install 'lpsync-client[jax]' (or pip install 'jax[cpu]')"
    ) from error

import numpy as np

from lpsync_client import _adapt, _fused
from lpsync_client._cuda import NOT_EXPORTABLE
from lpsync_client._default import default_client, resolve, set_default_client
from lpsync_client._device import describe
from lpsync_client.client import Client
from lpsync_client.errors import InvalidArgumentError

_DEVICE_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int32", "int64", "uint8"})

__all__ = ["allreduce", "default_client", "pmean", "psum", "set_default_client"]


def _host(leaf: Any) -> np.ndarray:
    if (
        isinstance(leaf, jax.Array)
        and leaf.is_fully_addressable
        and all(d.platform == "cpu" for d in leaf.devices())
    ):
        try:
            # jax's stub declares __dlpack__(self) without the stream keyword that
            # ArrayImpl.__dlpack__ takes (and numpy's protocol asks for).
            return np.from_dlpack(leaf)  # type: ignore[arg-type]  # zero copy
        except (TypeError, ValueError, BufferError, RuntimeError):
            pass  # a layout DLPack cannot export: copy
    return np.asarray(jax.device_get(leaf))


def allreduce(
    tree: Any, op: str = "avg", *, client: Client | None = None, name: str = "", timeout: float | None = None
) -> Any:
    """A pytree like ``tree`` whose leaves are reduced over every rank (op: avg, sum, prod,
    min, max). Blocks; call it outside ``jit``. Every rank passes the same tree structure,
    shapes and dtypes.

    >>> total = lpj.allreduce({"w": jnp.ones(3)}, op="sum")
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    client = resolve(client)
    # Every rank flattens the same tree on the same kind of devices: the split agrees.
    on_gpu = [i for i, leaf in enumerate(leaves) if _gpu_leaf(client, leaf)]
    out: list[Any] = [None] * len(leaves)
    if on_gpu:
        copies = [jnp.array(leaves[i], copy=True) for i in on_gpu]
        _adapt.allreduce_arrays(client, copies, op, name=f"{name or 'jax'}/gpu", timeout=timeout)
        for i, leaf_copy in zip(on_gpu, copies, strict=True):
            out[i] = leaf_copy
    rest = [i for i in range(len(leaves)) if out[i] is None]
    reduced = (
        _fused.allreduce(client, [_host(leaves[i]) for i in rest], op, name=name or "jax", timeout=timeout)
        if rest
        else []
    )
    for i, result in zip(rest, reduced, strict=True):
        leaf = leaves[i]
        if isinstance(leaf, jax.Array):
            out[i] = jax.device_put(jnp.asarray(result), leaf.sharding)
        else:
            out[i] = jnp.asarray(result)
    return jax.tree_util.tree_unflatten(treedef, out)


def _gpu_leaf(client: Client, leaf: Any) -> bool:
    """A single-device GPU array of a dtype the daemon knows, on a daemon serving cuda."""
    if not isinstance(leaf, jax.Array) or not leaf.is_fully_addressable:
        return False
    devices = leaf.devices()
    if len(devices) != 1 or next(iter(devices)).platform != "gpu" or leaf.size == 0:
        return False
    if leaf.dtype.name not in _DEVICE_DTYPES:  # no __cuda_array_interface__ typestr (bfloat16)
        return False
    return "cuda" in _adapt.served_kinds(client) and _exportable(leaf)


_EXPORTABLE: list[bool] = []  # JAX's allocator decides for every array: asked once


def _exportable(leaf: Any) -> bool:
    """Whether JAX's GPU memory can go through CUDA IPC (the first GPU leaf tells)."""
    if not _EXPORTABLE:
        try:
            describe(leaf)
            _EXPORTABLE.append(True)
        except InvalidArgumentError as error:
            if str(error) != NOT_EXPORTABLE:
                raise
            _EXPORTABLE.append(False)
            warnings.warn(
                "JAX's GPU memory cannot be exported through CUDA IPC: lpsync_client.jax "
                "copies GPU leaves through host memory (slower, still correct)",
                RuntimeWarning,
                stacklevel=4,
            )
    return _EXPORTABLE[0]


def pmean(tree: Any, *, client: Client | None = None, timeout: float | None = None) -> Any:
    """The average of ``tree`` over every rank: what ``jax.lax.pmean`` gives inside pmap,
    for processes synchronised through lpsync (e.g. gradients before the update)."""
    return allreduce(tree, "avg", client=client, name="pmean", timeout=timeout)


def psum(tree: Any, *, client: Client | None = None, timeout: float | None = None) -> Any:
    """The sum of ``tree`` over every rank (``jax.lax.psum``'s counterpart)."""
    return allreduce(tree, "sum", client=client, name="psum", timeout=timeout)
