"""The torch backend's one way to run an op over pieces: cut its elements into consecutive
ranges (the same cuts on every rank, _pieces.bounds), and for each range stage in, issue
the lpsync collective on the staging, and stage out once it succeeded; the work tracks
every piece and completes when all have.

What differs between ops is data, a ``Piecewise``: how many elements are cut, how many
blocks of a piece's length the staging holds, which flat tensors are copied into which
block before the collective and out of which block after it, and the collective to start.
The backend (backend.py) writes one per call; nothing here knows an op by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from lpsync_client.client import Client
from lpsync_client.errors import ResourceExhaustedError
from lpsync_client.torch._client import Where
from lpsync_client.torch._pieces import bounds, buffer_limit, learn
from lpsync_client.torch._staging import Staged
from lpsync_client.torch._work import LpsyncWork

# Pieces of one call in flight at once (the next waits for the oldest): bounds the staging
# and the daemon buffers a huge tensor holds.
PIECES_IN_FLIGHT = 4

# (block of the staging, flat tensors laid end to end along the cut elements)
Blocks = Sequence[tuple[int, Sequence[torch.Tensor]]]
# (part of a tensor, its place in the staging): one piece's copies, in or out
Copies = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Piecewise:
    """One op over the element ranges [a, b) of ``total``. A piece's staging holds
    ``blocks`` blocks of b - a elements each; elements [a, b) of the tensors of ``ins``
    are copied into their block before ``start`` and those of ``outs`` out of theirs once
    it succeeded (a tensor shorter than b gives what it has: the rest of its block is
    padding). ``outs`` may be ``ins`` itself (in place: sliced once for both)."""

    total: int  # elements cut into pieces (per block)
    like: torch.Tensor  # the staging's dtype is this tensor's
    start: Callable[[Any, int], Future]  # (the staging as the client takes it, b - a) -> collective
    ins: Blocks = ()
    outs: Blocks = ()
    blocks: int = 1  # blocks of this rank's staging
    # Blocks per cut element that size the pieces, when another rank stages more (a
    # rooted op's root): every rank must cut alike. 0: ``blocks``.
    cut_blocks: int = 0
    where: Where | None = None  # the staging's device; None: shared memory


def _copies(blocks: Blocks, firsts: list[list[int]], staging: torch.Tensor, a: int, b: int) -> Copies:
    """The parts of ``blocks``' tensors over elements [a, b), each with its place in the
    staging (block k of b - a elements starts at k * (b - a))."""
    m, pairs = b - a, []
    for (k, tensors), starts in zip(blocks, firsts, strict=True):
        for t, first in zip(tensors, starts, strict=False):
            lo, hi = max(a, first), min(b, first + t.numel())
            if lo < hi:
                pairs.append((t[lo - first : hi - first], staging[k * m + lo - a : k * m + hi - a]))
    return pairs


def _starts(blocks: Blocks) -> list[list[int]]:
    return [list(itertools.accumulate((t.numel() for t in tensors), initial=0)) for _, tensors in blocks]


class Runner:
    """Runs ``Piecewise`` ops for one process group: ``stage(like, numel, where)`` gives a
    piece its staging (the group's pools); a piece is at most ``staging_bytes``, and the
    daemon's buffer limit once learned (_pieces.learn)."""

    def __init__(
        self, client: Client, staging_bytes: int, stage: Callable[[torch.Tensor, int, Where | None], Staged]
    ) -> None:
        self.client, self.staging_bytes, self._stage = client, staging_bytes, stage

    def run(self, work: LpsyncWork, op: Piecewise) -> None:
        """Issue ``op``'s pieces into ``work``, in order (zero elements: one empty piece,
        which still meets its peers)."""
        ins_at, outs_at = _starts(op.ins), _starts(op.outs)

        def issue(a: int, b: int) -> None:
            staged = self._stage(op.like, (b - a) * op.blocks, op.where)
            into = _copies(op.ins, ins_at, staged.flat, a, b)
            back = into if op.outs is op.ins else _copies(op.outs, outs_at, staged.flat, a, b)

            def fill() -> None:
                for t, view in into:
                    view.copy_(t)

            def finish() -> None:
                for t, view in back:
                    t.copy_(view)

            self.launch(work, staged, fill, lambda x: op.start(x, b - a), finish)

        if op.total == 0:
            issue(0, 0)
            return
        self.split(work, op.total, op.like.element_size() * (op.cut_blocks or op.blocks), issue)

    def split(self, work: LpsyncWork, total: int, unit: int, issue: Callable[[int, int], None]) -> None:
        """``issue(start, stop)`` for consecutive element ranges covering [0, total), in the
        same order on every rank, each within the piece size (``unit``: staging bytes per
        element of a range): the daemon's buffer limit once known, and the staging budget.
        Waits while PIECES_IN_FLIGHT of the work's pieces are in flight; stops once one
        failed. A first piece refused as larger than the daemon's buffers (only a first one
        can be: the others are no larger) teaches the limit, and the ranges are cut again:
        nothing was issued, and every rank of that daemon learns the same."""
        limit = buffer_limit(self.client)
        piece = self.staging_bytes if limit is None else min(limit, self.staging_bytes)
        issued = False
        try:
            for start, stop in bounds(total, piece // unit):
                if not work.wait_pieces(PIECES_IN_FLIGHT - 1):
                    return
                issue(start, stop)
                issued = True
        except ResourceExhaustedError as error:
            if issued or not learn(self.client, error):
                raise
            self.split(work, total, unit, issue)

    @staticmethod
    def launch(
        work: LpsyncWork,
        staged: Staged,
        fill: Callable[[], object],
        start: Callable[[Any], Future],
        finish: Callable[[], object],
    ) -> None:
        """Copy in (``fill``), start the collective on the staging and let ``work`` track
        it; the staging goes back to the pool if either step fails."""
        try:
            fill()
            future = start(staged.operand)
        except BaseException:
            staged.pool.release(staged.raw)
            raise
        work.track(future, finish, (staged,))
