"""The client <-> daemon contract that is not in the .proto files, defined once here.

The daemon (package ``lpsync``) imports these names; the client never imports lpsync.
  * ``lpsync_client.wire.proto``: the generated gRPC modules (protos/generate.py writes
    them here, once);
  * DEFAULT_SOCKET: where both look for the control plane without LPSYNC_SOCKET/--socket;
  * the emulated device's handle layouts: what a client packs into a Register or a ready
    event and the daemon unpacks (lpsync.memory.emulated), and a device handle's UUID tail;
  * the sizes of each op's buffers (``blocks``), which both sides check;
  * ``lpsync_client.wire.pairs``: the names of point-to-point pair jobs;
  * futexes on shared words: lpsync_client.futex, used by both sides' interprocess events;
  * the error classes: lpsync_client.errors, which lpsync.errors re-exports.
The daemon imports no private client name (tests/daemon/unit/test_client_contract.py).
"""

from __future__ import annotations

import struct

DEFAULT_SOCKET = "/run/lpsync/lpsync.sock"

# An emulated device allocation's IPC handle: magic, exporter pid, fd in the exporter,
# inode, allocation bytes, device.
EMULATED_HANDLE = struct.Struct("<4sIIQQI")
EMULATED_MAGIC = b"LPEM"
# An emulated interprocess event's handle: magic, exporter pid, fd, inode of its 8-byte
# record (u32 records enqueued, u32 records completed: the futex word).
EMULATED_EVENT_HANDLE = struct.Struct("<4sIIQ")
EMULATED_EVENT_MAGIC = b"LPEV"

# A device handle may end with the 16-byte UUID of the GPU it lives on (tag + uuid): the
# daemon maps the allocation on the device of that UUID, whatever ordinal the client sees
# it under (CUDA_VISIBLE_DEVICES differs between processes under Slurm and Kubernetes).
DEVICE_UUID_TAG = b"UUID"
DEVICE_UUID_BYTES = 16


def with_device_uuid(handle: bytes, uuid: bytes) -> bytes:
    return handle + DEVICE_UUID_TAG + uuid


def split_device_uuid(handle: bytes) -> tuple[bytes, bytes | None]:
    """(the kind's handle, the device's UUID or None for a handle without one)."""
    n = len(DEVICE_UUID_TAG) + DEVICE_UUID_BYTES
    if len(handle) > n and handle[-n:].startswith(DEVICE_UUID_TAG):
        return handle[:-n], handle[-DEVICE_UUID_BYTES:]
    return handle, None


def device_uuid(ordinal: int) -> bytes:
    """The 16-byte UUID the CUDA driver gives GPU ``ordinal`` (cuDeviceGetUuid): what a
    client appends to a handle and the daemon matches its own GPUs against, read the same
    way on both sides."""
    from lpsync_client import _cuda  # ctypes and the driver, only where a GPU is asked of

    return _cuda.device_uuid(ordinal)


def emulated_uuid(device: int) -> bytes:
    """The UUID of emulated device ``device`` (the daemon's numbering: all devices)."""
    return b"LPSYNC-EMU-" + device.to_bytes(5, "little")


# The collectives whose buffers hold several count-element blocks ("count" is one rank's
# block, NCCL's sendcount/recvcount), and whose result or data lives at one root.
ROOTED_OPS = frozenset({"broadcast", "reduce", "gather", "scatter"})
OUT_OF_PLACE_ONLY = frozenset({"alltoall"})  # blocks move between ranks in both directions


def blocks(op: str, participants: int, rank: int, root: int) -> tuple[int, int]:
    """(input blocks, output blocks) of one participant's buffers, out of place; the sizes
    both the client and the daemon check. In place one buffer holds the larger side, and
    the smaller one is the participant's own block of it (or nothing)."""
    p, is_root = participants, rank == root
    if op == "barrier":
        return 0, 0
    if op == "allgather":
        return 1, p
    if op == "reduce_scatter":
        return p, 1
    if op == "gather":
        return 1, p if is_root else 0
    if op == "scatter":
        return p if is_root else 0, 1
    if op == "alltoall":
        return p, p
    return 1, 1
