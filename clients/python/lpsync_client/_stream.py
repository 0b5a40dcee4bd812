"""The Session stream: one bidirectional gRPC call per client, requests matched to
responses by request id.

Threads: the caller puts requests on a queue that gRPC's own thread drains into the
stream; one reader thread of ours takes responses off the stream and completes the
matching Future (running its completion hook first: the copy-out of staged buffers).
When the stream ends for any reason, every pending Future fails, so nothing waits
forever. Closing the request side tells the daemon this client is gone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc

from lpsync_client._pending import Call, Hook, PendingRequests
from lpsync_client.errors import LpsyncError, UnavailableError, from_rpc_error
from lpsync_client.wire.proto import lpsync_pb2 as pb


class SessionStream:
    def __init__(self, stub, session_id: str, metadata, open_timeout: float) -> None:
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._pending = PendingRequests("session stream")
        self._call = stub.Session(self._iterate(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="lpsync-client-stream", daemon=True)
        self._reader.start()
        opened = self.submit(
            pb.SessionRequest(open=pb.SessionOpen(session_id=session_id)), lambda response: response
        )
        opened.result(timeout=open_timeout)

    def submit(self, request: pb.SessionRequest, hook: Hook, foreground: bool = False) -> Call:
        """Send ``request``; the Future gets ``hook(response)`` or the hook's exception."""
        return self._pending.submit(request, hook, self._requests.put)

    def wake(self) -> None:
        """Nothing to do: this stream's reader reads every response."""

    def _iterate(self) -> Iterator[pb.SessionRequest]:
        while True:
            try:
                request = self._requests.get(timeout=1.0)
            except queue.Empty:
                if self._pending.closed:
                    return
                continue
            if request is None:
                return
            yield request

    def _read(self) -> None:
        error: LpsyncError = UnavailableError("the session stream ended")
        try:
            for response in self._call:
                self._pending.complete(response)
        except grpc.RpcError as rpc_error:
            if rpc_error.code() != grpc.StatusCode.CANCELLED:
                error = from_rpc_error(rpc_error)
        finally:
            self._pending.fail_all(error)

    def close(self, timeout: float = 5.0) -> None:
        """End the request side; the daemon then ends the session and the stream."""
        self._requests.put(None)
        self._reader.join(timeout)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(timeout)
