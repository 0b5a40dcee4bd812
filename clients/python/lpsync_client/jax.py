"""JAX integration: allreduce a pytree of arrays through the node's lpsync daemon, between
steps and outside ``jit`` (a collective is a side effect).

    import lpsync_client.jax as lpj
    grads = jax.grad(loss)(params, batch)
    grads = lpj.pmean(grads)                       # the average over every rank
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)

Leaves are read through DLPack (zero copy on CPU), packed into one shared-memory buffer
per dtype (one collective per dtype, not per leaf) and returned as new arrays on the
leaves' devices. The client attaches from the environment (RANK, WORLD_SIZE, LPSYNC_SOCKET,
LPSYNC_JOB...) unless ``client=`` is given.
"""

from __future__ import annotations

from typing import Any

try:
    import jax
    import jax.numpy as jnp
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("lpsync_client.jax needs JAX, which is not installed: "
                      "pip install 'lpsync-client[jax]' (or pip install 'jax[cpu]')") from error

import numpy as np

from lpsync_client import _fused
from lpsync_client._default import default_client, resolve, set_default_client
from lpsync_client.client import Client

__all__ = ["allreduce", "default_client", "pmean", "psum", "set_default_client"]


def _host(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and leaf.is_fully_addressable and \
            all(d.platform == "cpu" for d in leaf.devices()):
        try:
            return np.from_dlpack(leaf)  # zero copy
        except (TypeError, ValueError, BufferError, RuntimeError):
            pass  # a layout DLPack cannot export: copy
    return np.asarray(jax.device_get(leaf))


def allreduce(tree: Any, op: str = "avg", *, client: Client | None = None, name: str = "",
              timeout: float | None = None) -> Any:
    """A pytree like ``tree`` whose leaves are reduced over every rank (op: avg, sum, prod,
    min, max). Blocks; call it outside ``jit``. Every rank passes the same tree structure,
    shapes and dtypes.

    >>> total = lpj.allreduce({"w": jnp.ones(3)}, op="sum")
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    hosts = [_host(leaf) for leaf in leaves]
    reduced = _fused.allreduce(resolve(client), hosts, op, name=name or "jax", timeout=timeout)
    out = []
    for leaf, result in zip(leaves, reduced, strict=True):
        if isinstance(leaf, jax.Array):
            out.append(jax.device_put(jnp.asarray(result), leaf.sharding))
        else:
            out.append(jnp.asarray(result))
    return jax.tree_util.tree_unflatten(treedef, out)


def pmean(tree: Any, *, client: Client | None = None, timeout: float | None = None) -> Any:
    """The average of ``tree`` over every rank: what ``jax.lax.pmean`` gives inside pmap,
    for processes synchronised through lpsync (e.g. gradients before the update)."""
    return allreduce(tree, "avg", client=client, name="pmean", timeout=timeout)


def psum(tree: Any, *, client: Client | None = None, timeout: float | None = None) -> Any:
    """The sum of ``tree`` over every rank (``jax.lax.psum``'s counterpart)."""
    return allreduce(tree, "sum", client=client, name="psum", timeout=timeout)
