"""Plans built once and reused: a job's LocalGroups (and device mirrors) by key.

Plan once, run many (Gloo's constructors, UCC's init/invoke): a collective's schedule,
chunk views, transports and threads are built the first time its (spec, algorithm,
buffers) is seen and reused by every later call with the same key. Keys end with the
(session id, handle) pairs of the buffers, so that a released buffer's plans go with it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from lpsync.daemon.values import Arrival, Spec
from lpsync.engine.group import LocalGroup

_CACHE_SIZE = 8  # plans per job; the least recently used beyond it are closed
# Scratch held by a job's cached plans (a plan's ``nbytes``: TMP and receive slots). The
# tuner's trials build a plan per candidate: at 64 MiB each held ~64 MiB more for as long
# as it stayed cached. Beyond this the least recently used go, the newest always stays.
_CACHE_BYTES = 256 << 20


def plan_key(spec: Spec, schedule: tuple, arrivals: Sequence[Arrival], *extra: object) -> tuple:
    """A plan's key, made here only: the spec, the schedule (algorithm, chunks, ...), where
    each participant's buffers are (same handle, other offset: another plan), anything
    else the plan is bound to (``extra``: a mesh generation, mirrors), and last the
    buffers' (session id, handle) pairs, so that ``forget`` finds a released buffer's."""
    return (
        spec,
        schedule,
        tuple((_where(a.data), _where(a.out)) for a in arrivals),
        *extra,
        tuple(h for a in arrivals for h in a.handles),
    )


def _where(buffer: object) -> int:
    """A buffer's address: a host view's data pointer, a device span's lo, 0 for none."""
    if buffer is None:
        return 0
    if isinstance(buffer, np.ndarray):
        return buffer.__array_interface__["data"][0]
    return buffer.lo  # type: ignore[attr-defined]  # a Span


class ClosedWhenIdle:
    """A plan whose runs span several calls into it (hierarchy.py, packed.py: a segment
    at a time): ``close`` while a run is under way (the job ended, a buffer was released,
    the cache evicted it) takes effect when that run ends, so a client that dies mid-run
    costs its collective nothing (its mappings stay busy meanwhile) instead of failing
    this node's part half-way while the other nodes wait for it."""

    def __init__(self) -> None:
        self._use = threading.Lock()
        self._runs = 0
        self._closing: bool | None = None  # the pending close's ``wait``, once asked

    def acquire(self) -> None:
        with self._use:
            self._runs += 1

    def release(self) -> None:
        with self._use:
            self._runs -= 1
            closing = self._closing if self._runs == 0 else None
        if closing is not None:
            self._close(closing)

    def close(self, wait: bool = True) -> None:
        with self._use:
            self._closing = wait
            idle = self._runs == 0
        if idle:
            self._close(wait)

    def _close(self, wait: bool) -> None:
        raise NotImplementedError


class GroupCache:
    """LocalGroups of one job, least recently used evicted (their threads shut down)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: OrderedDict[tuple, LocalGroup] = OrderedDict()
        # Multi-node device collectives: host mirrors of device spans (collectives/staging.py),
        # keyed by the spans' addresses and, last, their handles (so ``forget`` finds them).
        self.staging: OrderedDict[tuple, Any] = OrderedDict()

    def mirrors(self, key: tuple, make):
        """The mirrors under ``key``, made on first use; the least recently used beyond
        _CACHE_SIZE are closed (they free themselves once no run uses them)."""
        with self._lock:
            found = self.staging.get(key)
            if found is not None:
                self.staging.move_to_end(key)
                return found
        made = make()
        with self._lock:
            self.staging[key] = made
            evicted = [self.staging.popitem(last=False)[1] for _ in range(len(self.staging) - _CACHE_SIZE)]
        for old in evicted:
            old.close()
        return made

    def get(self, key: tuple, build):
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                self._groups.move_to_end(key)
                return group
        group = build()
        evicted = []
        with self._lock:
            self._groups[key] = group
            held = sum(_nbytes(g) for g in self._groups.values())
            while len(self._groups) > _CACHE_SIZE or (held > _CACHE_BYTES and len(self._groups) > 1):
                old = self._groups.popitem(last=False)[1]
                held -= _nbytes(old)
                evicted.append(old)
        for old in evicted:
            old.close(wait=False)
        return group

    def held_bytes(self) -> int:
        """The scratch the cached plans hold now."""
        with self._lock:
            return sum(_nbytes(g) for g in self._groups.values())

    def drop_others(self, key: tuple) -> None:
        """Close the plans of ``key``'s collective on the same buffers (its spec, where each
        participant's buffers are): once a collective is armed, its general-path plans (the
        tuner's trials among them) only hold memory; a fallback builds its plan again."""
        with self._lock:
            same = [k for k in self._groups if k[0] == key[0] and k[2] == key[2]]
            groups = [self._groups.pop(k) for k in same]
        for group in groups:
            group.close(wait=False)

    def forget(self, session_id: str, handle: int) -> None:
        """Drop the groups bound to a released buffer, so its memory can be unmapped."""
        with self._lock:
            stale = [k for k in self._groups if (session_id, handle) in k[-1]]
            groups = [self._groups.pop(k) for k in stale]
            mirrors = [self.staging.pop(k) for k in list(self.staging) if (session_id, handle) in k[-1]]
        for group in groups:
            group.close(wait=False)  # may run on the event loop: never wait for a schedule
        for mirror in mirrors:
            mirror.close()  # frees once the run using it ended

    def close(self) -> None:
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
            mirrors = list(self.staging.values())
            self.staging.clear()
        for group in groups:
            group.close(wait=False)
        for mirror in mirrors:
            mirror.close()


def _nbytes(plan: object) -> int:
    """The scratch a cached plan holds; plans that do not say (one-node direct programs,
    the hierarchy's and packed segments' own bounded pools) count nothing here."""
    return int(getattr(plan, "nbytes", 0))
