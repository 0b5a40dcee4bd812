"""The Session stream: one bidirectional gRPC call per client, requests matched to
responses by request id.

Threads: the caller puts requests on a queue that gRPC's own thread drains into the
stream; one reader thread of ours takes responses off the stream and completes the
matching Future (running its completion hook first: the copy-out of staged buffers).
When the stream ends for any reason, every pending Future fails, so nothing waits
forever. Closing the request side tells the daemon this client is gone.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import grpc

from lpsync_client._proto import lpsync_pb2 as pb
from lpsync_client.errors import LpsyncError, UnavailableError, from_rpc_error

Hook = Callable[[pb.SessionResponse], object]


class SessionStream:
    def __init__(self, stub, session_id: str, metadata, open_timeout: float) -> None:
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._pending: dict[int, tuple[Future, Hook]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._error: LpsyncError | None = None
        self._call = stub.Session(self._iterate(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="lpsync-client-stream",
                                        daemon=True)
        self._reader.start()
        opened = self.submit(pb.SessionRequest(open=pb.SessionOpen(session_id=session_id)),
                             lambda response: response)
        opened.result(timeout=open_timeout)

    def submit(self, request: pb.SessionRequest, hook: Hook) -> Future:
        """Send ``request``; the Future gets ``hook(response)`` or the hook's exception."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise self._error or UnavailableError("the session stream is closed")
            rid = next(self._ids)
            self._pending[rid] = (future, hook)
        request.request_id = rid
        self._requests.put(request)
        return future

    def _iterate(self) -> Iterator[pb.SessionRequest]:
        while True:
            try:
                request = self._requests.get(timeout=1.0)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if request is None:
                return
            yield request

    def _read(self) -> None:
        error: LpsyncError = UnavailableError("the session stream ended")
        try:
            for response in self._call:
                with self._lock:
                    entry = self._pending.pop(response.request_id, None)
                if entry is None:
                    continue
                future, hook = entry
                try:
                    future.set_result(hook(response))
                except BaseException as failure:  # the hook's error belongs to the caller
                    future.set_exception(failure)
        except grpc.RpcError as rpc_error:
            if rpc_error.code() != grpc.StatusCode.CANCELLED:
                error = from_rpc_error(rpc_error)
        finally:
            with self._lock:
                self._closed = True
                self._error = error
                pending = list(self._pending.values())
                self._pending.clear()
            for future, _ in pending:
                future.set_exception(error)

    def close(self, timeout: float = 5.0) -> None:
        """End the request side; the daemon then ends the session and the stream."""
        self._requests.put(None)
        self._reader.join(timeout)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(timeout)
