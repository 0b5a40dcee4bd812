"""The doorbell: how a client repeats an armed collective without a request.

Wire contract between the client and the daemon's native engine (lpsync/native/engine.h
describes the same page; tests/native checks the two agree). The daemon answers a
collective whose plan it armed with Armed{page, plan, generation}; the same call again
rings: the client writes ``seq << 32 | generation << 8 | plan`` into its slot (its rank:
single-node jobs), bumps the bell word and wakes it, then sleeps on its slot's reply word
until the engine writes the sequence number there. The code beside it says OK (the data
is in place) or FALLBACK: the engine did not run it (a mismatch, a disarmed plan, a rank
that went the general way, a timeout, a stop), and the client sends the same request,
same sequence number, the general way, where the daemon says what went wrong with the
errors of docs/reliability.md.

Page: [0, 64) header (magic, version, slots); the bell, a u32, at 64; slot i at
128 + 64 * i: u64 ring at +0, u32 reply at +8, u32 code at +12.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from lpsync_client import futex
from lpsync_client._shm import Mapping

MAGIC, VERSION = 0x4C50444E, 1
HEADER_BYTES, BELL_OFFSET, SLOT_BYTES = 128, 64, 64
OK, FALLBACK = 0, 1
_WAIT_SLICE = 1.0  # seconds between checks that the daemon is still there


class Page:
    """One job's doorbell page, mapped by this client."""

    def __init__(self, name: str, slot: int) -> None:
        self.mapping = Mapping(name, HEADER_BYTES + SLOT_BYTES * (slot + 1))
        words = self.mapping.array.view(np.uint32)
        if int(words[0]) != MAGIC or int(words[1]) != VERSION or slot >= int(words[2]):
            self.mapping.close()
            raise ValueError(f"{name} is not a doorbell page of this version with slot {slot}")
        self._u32 = words
        self._u64 = self.mapping.array.view(np.uint64)
        base = self.mapping.base
        self._bell_index, self._bell = BELL_OFFSET // 4, base + BELL_OFFSET
        at = HEADER_BYTES + SLOT_BYTES * slot
        self._ring_index = at // 8
        self._reply_index, self._reply = (at + 8) // 4, base + at + 8

    def ring(self, seq: int, plan: int, generation: int, timeout: float, gone: Callable[[], bool]) -> int:
        """Ring for collective ``seq`` and wait for the answer: OK or FALLBACK (or another
        code the engine gave up with: the request says why). Raises TimeoutError after
        ``timeout`` seconds without one, or where ``gone()`` says the daemon's session
        ended meanwhile."""
        self.post(seq, plan, generation)
        return self.answer(seq, timeout, gone)

    def post(self, seq: int, plan: int, generation: int) -> None:
        """Ring for collective ``seq`` without waiting (one ring at a time per slot: the
        next only once this one is answered)."""
        seq &= 0xFFFFFFFF
        u32 = self._u32
        self._u64[self._ring_index] = (seq << 32) | ((generation & 0xFFFFFF) << 8) | (plan & 0xFF)
        bell = self._bell_index  # a lost increment still changes the word: the wake holds
        u32[bell] = (int(u32[bell]) + 1) & 0xFFFFFFFF
        futex.wake(self._bell)

    def answer(self, seq: int, timeout: float, gone: Callable[[], bool]) -> int:
        """Wait for the answer to the ring for ``seq`` (post)."""
        seq &= 0xFFFFFFFF
        u32 = self._u32
        reply = self._reply_index
        deadline = None
        while True:
            answered = int(u32[reply])
            if answered == seq:
                return int(u32[reply + 1])
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout
            elif now >= deadline or gone():
                raise TimeoutError(f"no answer to collective #{seq} within {timeout:g} s")
            futex.wait(self._reply, answered, min(_WAIT_SLICE, deadline - now))

    def close(self) -> None:
        self.mapping.close()
