"""Mapping the daemon's shared-memory segments; the daemon creates and unlinks them."""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

SHM_DIR = "/dev/shm"


class Mapping:
    """One segment mapped into this process; ``array`` is its bytes (uint8)."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes = name, nbytes
        self._mmap: mmap.mmap | None = None
        if nbytes:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            try:
                self._mmap = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            self.array = np.frombuffer(self._mmap, np.uint8, nbytes)
        else:
            self.array = np.empty(0, np.uint8)
        self.base = self.array.__array_interface__["data"][0]

    def contains(self, address: int, nbytes: int) -> bool:
        return self.nbytes > 0 and self.base <= address and address + nbytes <= self.base + self.nbytes

    def close(self) -> None:
        """Unmap unless arrays still view the segment (then they keep it mapped)."""
        self.array = np.empty(0, np.uint8)
        if self._mmap is not None:
            # User arrays may still view it; then the mapping goes with them.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
