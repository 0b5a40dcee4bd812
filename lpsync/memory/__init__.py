"""Memory kinds behind one operations table (kind.py): host shared memory (shm.py, and
host.py's table), the emulated device (emulated.py) and CUDA through cupy (cuda.py, imported
only for --devices cuda). devices.py parses --devices."""

from lpsync.memory.shm import PREFIX, SharedSegment, leaked_segments, reclaim_stale

__all__ = ["PREFIX", "SharedSegment", "leaked_segments", "reclaim_stale"]
