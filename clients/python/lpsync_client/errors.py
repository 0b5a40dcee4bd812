"""lpsync's one exception hierarchy: the daemon raises these classes (lpsync.errors
re-exports them), and each travels as one gRPC status code back to the same class here.

try:
    client.allreduce(x, timeout=5)
except lpsync_client.TimeoutError as error:   # a rank never arrived
    print(error)                               # names the missing ranks
except lpsync_client.AbortedError as error:    # a participant died
    print(error.buffer_state)                  # "INTACT" or "PARTIAL" (in place)
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grpc itself only where a call failed: lpsync.errors imports this module
    import grpc


class LpsyncError(Exception):
    """Root of every error lpsync raises on purpose, in the client or the daemon.

    ``code`` is the gRPC status name; ``buffer_state`` says, for a failed in-place
    collective, whether the buffer is "INTACT" (not written) or "PARTIAL".
    """

    code = "UNKNOWN"

    def __init__(self, message: str, buffer_state: str = "") -> None:
        super().__init__(message)
        self.buffer_state = buffer_state


class InvalidArgumentError(LpsyncError, ValueError):
    """The request can never succeed as given (size, dtype, op, root, handle range)."""

    code = "INVALID_ARGUMENT"


class MismatchError(InvalidArgumentError):
    """Participants called the same collective with different op/count/dtype/root/reduce-op."""


class CollectiveTimeoutError(LpsyncError, builtins.TimeoutError):
    """A participant or a message did not arrive (or the collective did not finish) in time."""

    code = "DEADLINE_EXCEEDED"


TimeoutError = CollectiveTimeoutError  # the short name users expect


class AbortedError(LpsyncError):
    """Another participant failed or left; the collective was abandoned."""

    code = "ABORTED"


class UnavailableError(LpsyncError):
    """The daemon cannot be reached or is shutting down, or a peer (daemon or link) that a
    collective needs is gone."""

    code = "UNAVAILABLE"


class NotFoundError(LpsyncError):
    """An unknown handle, session or job (released, detached, or never created)."""

    code = "NOT_FOUND"


class AlreadyExistsError(LpsyncError):
    """This (job, rank) is already attached to the daemon."""

    code = "ALREADY_EXISTS"


class ResourceExhaustedError(LpsyncError):
    """A request beyond a limit: buffer size, per-session bytes, shared memory."""

    code = "RESOURCE_EXHAUSTED"


class UnauthenticatedError(LpsyncError):
    """A client without the daemon's token (none, or a wrong one), or a peer daemon without
    the cluster secret."""

    code = "UNAUTHENTICATED"


class UnimplementedError(LpsyncError):
    """The daemon cannot serve this yet (another device kind, several nodes)."""

    code = "UNIMPLEMENTED"


_BY_CODE: dict[str, type[LpsyncError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        CollectiveTimeoutError,
        AbortedError,
        UnavailableError,
        NotFoundError,
        AlreadyExistsError,
        ResourceExhaustedError,
        UnauthenticatedError,
        UnimplementedError,
    )
}
_BY_NAME = {cls.__name__: cls for cls in (*_BY_CODE.values(), MismatchError)}


def from_status(code: str, message: str, error_class: str = "", buffer_state: str = "") -> LpsyncError:
    """The exception for a status code name (and the daemon's class name, if known)."""
    cls = _BY_NAME.get(error_class) or _BY_CODE.get(code, LpsyncError)
    if cls is LpsyncError:
        message = f"{code}: {message}"
    return cls(message, buffer_state)


def from_rpc_error(error: grpc.RpcError) -> LpsyncError:
    code = error.code().name if hasattr(error, "code") else "UNKNOWN"
    details = error.details() if hasattr(error, "details") else str(error)
    trailers = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
    return from_status(
        code,
        details or code,
        trailers.get("lpsync-error", ""),
        trailers.get("lpsync-buffer-state", ""),
    )
