"""The client <-> daemon contract that is not in the .proto files, defined once here.

The daemon (package ``lpsync``) imports these names; the client never imports lpsync.
  * DEFAULT_SOCKET: where both look for the control plane without LPSYNC_SOCKET/--socket;
  * the emulated device's handle layouts: what a client packs into a Register or a ready
    event and the daemon unpacks (lpsync.memory.emulated);
  * futexes on shared words: lpsync_client.futex, used by both sides' interprocess events.
The error classes mirror the daemon's (lpsync.errors) by name and gRPC code; a test holds
the two hierarchies together (tests/client/test_wire.py).
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
