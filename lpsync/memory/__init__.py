"""Buffers the daemon shares with its clients: host shared memory now, CUDA IPC later."""

from lpsync.memory.shm import PREFIX, SharedSegment, leaked_segments, reclaim_stale

__all__ = ["PREFIX", "SharedSegment", "leaked_segments", "reclaim_stale"]
