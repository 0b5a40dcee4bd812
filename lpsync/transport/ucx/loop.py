"""An asyncio event loop on a dedicated thread: the synchronous face of ucxx's async API.

ucxx binds UCX progress to the event loop that is running when the context, the
listener and the endpoints are created, so every ucxx call is made from coroutines
on this loop; callers on other threads submit them with ``submit`` (a
concurrent.futures.Future back) and never touch ucxx objects themselves.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from lpsync.errors import CollectiveTimeoutError

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # ucxx patches loop.close to cancel its progress tasks; it must run here,
            # on the loop's own thread, after run_forever has returned.
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            # getaddrinfo ran in the loop's default executor: join its threads too.
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result up to ``timeout`` seconds."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (CollectiveTimeoutError is one)
                raise
            future.cancel()
            raise CollectiveTimeoutError(f"UCX operation did not finish in {timeout:.1f} s") \
                from None

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
