"""JAX integration: allreduce a pytree of arrays through the node's lpsync daemon, between
steps and outside ``jit`` (a collective is a side effect).

    import lpsync_client.jax as lpj
    grads = jax.grad(loss)(params, batch)
    grads = lpj.pmean(grads)                       # the average over every rank
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)

Leaves on a GPU, when the daemon serves cuda and JAX's allocator gives memory CUDA IPC
can export, take the device path: each is copied on its GPU into a fresh buffer (JAX
arrays are immutable; the copy is ours to write), which the daemon reduces in place
through CUDA IPC (registered for the call; ordered after XLA's work by
``block_until_ready``); the copies are the results. bfloat16 included: its
``__cuda_array_interface__`` has no typestr, so the copy is described by its pointer.
Other leaves are read through DLPack (zero copy on CPU), packed into one shared-memory
buffer per dtype (one collective per dtype, not per leaf) and returned as new arrays on
the leaves' devices. JAX 0.11's GPU allocators (the default and
``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` alike, seen on an H200) give memory that CUDA
IPC cannot export: GPU leaves then take the host path too, said once in a warning.

On the emulated device (CI, ``--devices emulated:N``) a device leaf is a CPU array whose
buffer lies in lpsync_client.emulated memory (imported through DLPack): its fresh copy
is emulated memory too, and the result is imported from it through DLPack again; only
bfloat16 results are one XLA copy out of it (numpy's DLPack has no bfloat16).

The client attaches from the environment (RANK, WORLD_SIZE, LPSYNC_SOCKET, LPSYNC_JOB...)
unless ``client=`` is given. Across nodes nothing more is needed (no LOCAL_WORLD_SIZE, no
store): the daemons find which node serves each rank (docs/multinode.md).
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

from lpsync_client import _adapt, _fused, emulated
from lpsync_client._convert import DTYPES
from lpsync_client._cuda import NOT_EXPORTABLE
from lpsync_client._default import default_client, resolve, set_default_client
from lpsync_client._device import cuda_span
from lpsync_client.client import Client
from lpsync_client.emulated import DeviceArrayInfo
from lpsync_client.errors import InvalidArgumentError

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
    kinds = [_device_kind(client, leaf) for leaf in leaves]
    on_device = [i for i, kind in enumerate(kinds) if kind is not None]
    out: list[Any] = [None] * len(leaves)
    if on_device:
        copies = [_DeviceCopy(leaves[i], kinds[i] == "cuda") for i in on_device]
        operands = [c.operand for c in copies]
        _adapt.allreduce_arrays(client, operands, op, name=f"{name or 'jax'}/gpu", timeout=timeout)
        for i, leaf_copy in zip(on_device, copies, strict=True):
            out[i] = leaf_copy.result()
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


def _device_kind(client: Client, leaf: Any) -> str | None:
    """The device memory kind of a single-device leaf of a dtype the daemon knows, when
    the daemon serves it: "cuda" (a GPU leaf whose memory can be exported) or "emulated"
    (a CPU leaf in emulated device memory); None for the host path."""
    if not isinstance(leaf, jax.Array) or not leaf.is_fully_addressable or leaf.size == 0:
        return None
    devices = leaf.devices()
    if len(devices) != 1 or leaf.dtype.name not in DTYPES:
        return None
    platform = next(iter(devices)).platform
    if platform == "gpu":
        kind = "cuda"
    elif platform == "cpu" and emulated.in_use() and _emulated_span(leaf) is not None:
        kind = "emulated"
    else:
        return None
    if kind not in _adapt.served_kinds(client):
        return None
    return kind if kind == "emulated" or _exportable(leaf) else None


def _emulated_span(leaf: Any) -> tuple[emulated.Allocation, int] | None:
    leaf.block_until_ready()  # (XLA's CPU work is asynchronous too)
    return emulated.find(leaf.unsafe_buffer_pointer(), leaf.nbytes)


class _DeviceCopy:
    """A fresh copy of a device leaf on its device, which the daemon reduces in place:
    ``operand`` is what the client registers, ``result()`` the reduced leaf."""

    def __init__(self, leaf: Any, cuda: bool) -> None:
        self.leaf = leaf
        self.operand: object
        self.fresh: Any = None  # on a GPU: the copy, a JAX array
        self.emulated: emulated.EmulatedArray | None = None  # or the copy in emulated memory
        if cuda:
            self.fresh = jnp.array(leaf, copy=True)
            self.operand = _Bfloat16(self.fresh) if leaf.dtype == jnp.bfloat16 else self.fresh
            return
        found = _emulated_span(leaf)
        assert found is not None
        allocation, offset = found
        source = allocation.array(offset, leaf.size, leaf.dtype.name)
        self.operand = self.emulated = emulated.empty(leaf.size, leaf.dtype.name, allocation.device)
        self.emulated.host[...] = source.host  # device to device (both emulated memory)

    def result(self) -> Any:
        if self.emulated is None:
            return self.fresh
        bits = self.leaf.dtype == jnp.bfloat16
        view = emulated.held_view(self.emulated)  # keeps the memory as long as the array
        view = view.view(np.uint16 if bits else self.emulated.dtype).reshape(self.leaf.shape)
        imported = jax.dlpack.from_dlpack(view)  # zero copy: the reduced buffer itself
        return jax.lax.bitcast_convert_type(imported, jnp.bfloat16) if bits else imported


class _Bfloat16:
    """A bfloat16 GPU array as a device buffer: described by its pointer, since its
    ``__cuda_array_interface__`` has no typestr for bfloat16. Held for the call (no
    weak reference: JAX's memory cannot be held apart from the array)."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __lpsync_device__(self) -> DeviceArrayInfo:
        a = self.array
        return cuda_span(a.unsafe_buffer_pointer(), a.nbytes, a.size, "bfloat16", _noop, a).info

    def __lpsync_sync__(self) -> None:
        self.array.block_until_ready()


_EXPORTABLE: list[bool] = []  # JAX's allocator decides for every array: asked once


def _exportable(leaf: Any) -> bool:
    """Whether JAX's GPU memory can go through CUDA IPC (the first GPU leaf tells)."""
    if not _EXPORTABLE:
        try:
            cuda_span(leaf.unsafe_buffer_pointer(), leaf.nbytes, leaf.size, leaf.dtype.name, _noop, leaf)
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


def _noop() -> None:
    pass


def pmean(tree: Any, *, client: Client | None = None, timeout: float | None = None) -> Any:
    """The average of ``tree`` over every rank: what ``jax.lax.pmean`` gives inside pmap,
    for processes synchronised through lpsync (e.g. gradients before the update)."""
    return allreduce(tree, "avg", client=client, name="pmean", timeout=timeout)


def psum(tree: Any, *, client: Client | None = None, timeout: float | None = None) -> Any:
    """The sum of ``tree`` over every rank (``jax.lax.psum``'s counterpart)."""
    return allreduce(tree, "sum", client=client, name="psum", timeout=timeout)
