"""One exception hierarchy for lpsync and its client: the client's (lpsync_client.errors).

The daemon raises the client's classes, so what it answers reaches a user as the same
class (each maps to one gRPC status code, ``.code``); the classes below are the daemon's
own, raised on this machine (configuration, the emulated cluster, the simulator) and
never answered over the wire.
"""

from __future__ import annotations

from lpsync_client.errors import (
    AbortedError,
    AlreadyExistsError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    LpsyncError,
    MismatchError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "ClusterError",
    "CollectiveTimeoutError",
    "ConfigError",
    "InvalidArgumentError",
    "LpsyncError",
    "MismatchError",
    "NotFoundError",
    "ResourceExhaustedError",
    "ScheduleError",
    "SimulationError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
]


class ConfigError(InvalidArgumentError):
    """Configuration that cannot work as given (a missing secret, a bad address list)."""


class ClusterError(LpsyncError):
    """The emulated cluster could not be built, found or torn down as asked."""

    code = "FAILED_PRECONDITION"


class SimulationError(LpsyncError):
    """A schedule could not be simulated (for example it deadlocks)."""

    code = "INTERNAL"


class ScheduleError(LpsyncError):
    """A generated schedule is malformed (unmatched messages, size mismatch)."""

    code = "INTERNAL"
