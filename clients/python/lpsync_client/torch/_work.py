"""The torch backend's work: one collective (or a coalesced set) issued as pieces, each an
lpsync collective it tracks; it completes, with lpsync's message on failure, once every
piece has."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from lpsync_client._pending import Latch
from lpsync_client.errors import CollectiveTimeoutError
from lpsync_client.torch._staging import Staged


def dist_error(op: str, error: BaseException) -> dist.DistBackendError:
    # A timeout says so in the words torch's other backends use (code matches on them).
    timed_out = "Timed out waiting for the other ranks: " if isinstance(error, CollectiveTimeoutError) else ""
    return dist.DistBackendError(f"lpsync {op} failed: {timed_out}{error}")


class LpsyncWork(dist.Work):
    """The handle of one collective (or a coalesced set): ``wait()`` blocks and raises
    DistBackendError with lpsync's message on failure; ``get_future()`` completes with the
    output tensors (what DDP's reducer expects) or that error."""

    def __init__(self, op: str, outputs: list[torch.Tensor], bound: float) -> None:
        super().__init__()
        self._op, self._outputs, self._bound = op, outputs, bound
        self._future: torch.futures.Future = torch.futures.Future()
        self._done = Latch()
        self._lock = threading.Condition()  # notified as pieces complete
        self._pending = 1  # released by seal(): no completion before every piece is in
        self._error: dist.DistBackendError | None = None
        self._on_success: list[Callable[[], object]] = []
        # Set once its tensors are final, before the future completes (whose callbacks may
        # issue the next collective on them: _order.py).
        self.finished = Latch()
        self.source: int | None = None  # recv from any source: the sender (group rank)

    def track(self, future: Future, finish: Callable[[], object], staging: Sequence[Staged] = ()) -> None:
        """Complete this work when ``future`` (an lpsync collective) is done: on success run
        ``finish`` (copies results out of staging), then give the staging back."""
        with self._lock:
            self._pending += 1

        def done(f: Future) -> None:
            error = f.exception()
            if error is None:
                try:
                    finish()
                except BaseException as failure:
                    error = failure
            for s in staging:
                s.give_back()
            self._piece_done(error)

        future.add_done_callback(done)

    def on_success(self, finish: Callable[[], object]) -> None:
        """Run ``finish`` once every piece succeeded, before the work completes."""
        self._on_success.append(finish)

    def wait_pieces(self, at_most: int) -> bool:
        """Block until at most ``at_most`` pieces are in flight; False once one failed
        (issue no more: the work reports the failure)."""
        with self._lock:
            if not self._lock.wait_for(
                lambda: self._pending - 1 <= at_most or self._error is not None, self._bound
            ):
                raise dist.DistBackendError(
                    f"lpsync {self._op}: a piece did not complete within {self._bound:g} s"
                )
            return self._error is None

    def seal(self) -> LpsyncWork:
        self._piece_done(None)
        return self

    def _piece_done(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = dist_error(self._op, error)
                self._error.__cause__ = error
            self._pending -= 1
            last = self._pending == 0
            self._lock.notify_all()
        if not last:
            return
        for finish in self._on_success if self._error is None else ():
            try:
                finish()
            except BaseException as failure:
                self._error = dist_error(self._op, failure)
                self._error.__cause__ = failure
                break
        self.finished.set()
        # The future first: whoever wait() releases may read get_future().value() at once.
        try:
            if self._error is not None:
                self._future.set_exception(self._error)
            else:
                self._future.set_result(self._outputs)
        finally:
            self._done.set()

    # -- torch's Work interface --------------------------------------------------------------
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        if not self._done.wait(seconds if seconds > 0 else self._bound):
            raise dist.DistBackendError(
                f"lpsync {self._op} did not complete within {seconds if seconds > 0 else self._bound:g} s"
            )
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._future.done()  # set before _done: true once get_future() completes

    def is_success(self) -> bool:
        return self._future.done() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """The sender of a recv from any source (torch's dist.recv(src=None) reads it)."""
        if self.source is None:
            raise dist.DistBackendError(f"lpsync {self._op}: no source rank (not a receive from any source)")
        return self.source


class DoneWork(dist.Work):
    """The handle of a synchronous op answered before it was returned (the backend's quick
    path, _quick.py): complete and successful; its future is made only if asked for."""

    def __init__(self, op: str, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._op, self._outputs = op, outputs
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            self._future.set_result(self._outputs)
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        pass

    def _source_rank(self) -> int:
        raise dist.DistBackendError(f"lpsync {self._op}: no source rank (not a receive from any source)")
