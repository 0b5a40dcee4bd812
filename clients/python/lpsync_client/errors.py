"""Typed exceptions mirroring the daemon's; each comes from one gRPC status code.

try:
    client.allreduce(x, timeout=5)
except lpsync_client.TimeoutError as error:   # a rank never arrived
    print(error)                               # names the missing ranks
except lpsync_client.AbortedError as error:    # a participant died
    print(error.buffer_state)                  # "INTACT" or "PARTIAL" (in place)
"""

from __future__ import annotations

import builtins

import grpc


class LpsyncError(Exception):
    """Root of every error the client raises on purpose.

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
    """Participants called the same collective with different parameters."""


class CollectiveTimeoutError(LpsyncError, builtins.TimeoutError):
    """A participant did not arrive (or the collective did not finish) in time."""

    code = "DEADLINE_EXCEEDED"


TimeoutError = CollectiveTimeoutError  # the short name users expect


class AbortedError(LpsyncError):
    """Another participant failed or left; the collective was abandoned."""

    code = "ABORTED"


class UnavailableError(LpsyncError):
    """The daemon cannot be reached, or is shutting down."""

    code = "UNAVAILABLE"


class NotFoundError(LpsyncError):
    """An unknown handle or session (released, detached, or never created)."""

    code = "NOT_FOUND"


class AlreadyExistsError(LpsyncError):
    """This (job, rank) is already attached to the daemon."""

    code = "ALREADY_EXISTS"


class ResourceExhaustedError(LpsyncError):
    """A buffer larger than the daemon allows, or shared memory is full."""

    code = "RESOURCE_EXHAUSTED"


class UnauthenticatedError(LpsyncError):
    """The daemon wants a token and got none, or a wrong one."""

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
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    trailers = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
    return from_status(
        code.name,
        details or code.name,
        trailers.get("lpsync-error", ""),
        trailers.get("lpsync-buffer-state", ""),
    )
