"""Host POSIX shared-memory segments: create, attach, close, unlink.

Every segment is named ``lpsync-<daemon pid>-<n>-<random>`` so a leak check can list
them in /dev/shm. Ownership: the daemon creates and unlinks every segment (clients
only attach), so one process decides when a name disappears. Unlinking removes the
name at once; the memory itself lives until the last mapping is dropped, so a
collective still running over a released buffer finishes safely.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
from pathlib import Path

import numpy as np

from lpsync.errors import NotFoundError, ResourceExhaustedError

PREFIX = "lpsync-"
SHM_DIR = Path("/dev/shm")
_counter = itertools.count(1)


class SharedSegment:
    """One mapped segment; ``array`` is its bytes as a writable uint8 numpy array."""

    def __init__(self, name: str, nbytes: int, mapping: mmap.mmap | None) -> None:
        self.name, self.nbytes = name, nbytes
        self._mmap = mapping
        # mmap cannot map 0 bytes; an empty buffer has an empty array and no mapping.
        self.array = (
            np.frombuffer(mapping, np.uint8, nbytes) if mapping is not None else np.empty(0, np.uint8)
        )

    @classmethod
    def create(cls, nbytes: int, mode: int = 0o660) -> SharedSegment:
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        except OSError as error:  # EMFILE, ENOSPC: a limit, not a bug
            raise ResourceExhaustedError(
                f"cannot create a {nbytes}-byte shared-memory segment: {error}"
            ) from error
        try:
            os.fchmod(fd, mode)  # the umask must not narrow who may attach
            mapping = None
            if nbytes:
                os.ftruncate(fd, nbytes)
                # Reserve the pages now: a sparse segment on a full /dev/shm would only fail
                # at the first write, with SIGBUS, killing whoever writes (the daemon).
                os.posix_fallocate(fd, 0, nbytes)
                mapping = mmap.mmap(fd, nbytes)
        except OSError as error:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ResourceExhaustedError(
                f"cannot create a {nbytes}-byte shared-memory segment: {error}"
            ) from error
        os.close(fd)
        return cls(name, nbytes, mapping)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> SharedSegment:
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise NotFoundError(f"shared-memory segment {name} does not exist") from None
        try:
            mapping = mmap.mmap(fd, nbytes) if nbytes else None
        finally:
            os.close(fd)
        return cls(name, nbytes, mapping)

    def unlink(self) -> None:
        """Remove the name; mappings (ours included) stay valid until dropped."""
        (SHM_DIR / self.name).unlink(missing_ok=True)

    def close(self) -> None:
        """Drop our mapping once no view of it is left; views keep it alive otherwise."""
        mapping, self._mmap = self._mmap, None
        self.array = np.empty(0, np.uint8)
        if mapping is not None:
            # A running collective may still hold a view; then GC unmaps it later.
            with contextlib.suppress(BufferError):
                mapping.close()


def leaked_segments(pid: int | None = None) -> list[str]:
    """Names of lpsync segments in /dev/shm (of the daemon ``pid`` if given)."""
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}-"
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}*"))


def reclaim_stale() -> list[str]:
    """Unlink the segments of lpsync daemons that are no longer running (a daemon killed
    with SIGKILL cannot clean up after itself). A live pid is left alone, whoever it is."""
    reclaimed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            reclaimed.append(path.name)
        except PermissionError:
            pass  # alive, another user's
    return sorted(reclaimed)
