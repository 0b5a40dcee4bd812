"""One exception hierarchy for lpsync; the daemon maps each class to a gRPC status code."""

from __future__ import annotations


class LpsyncError(Exception):
    """Root of every error lpsync raises on purpose."""

    code = "UNKNOWN"


class InvalidArgumentError(LpsyncError, ValueError):
    """A request that can never succeed as given (bad size, dtype, op or root)."""

    code = "INVALID_ARGUMENT"


class MismatchError(InvalidArgumentError):
    """Participants called the same collective with different op/count/dtype/root/reduce-op."""


class CollectiveTimeoutError(LpsyncError, TimeoutError):
    """A participant or a message did not arrive before the collective's timeout."""

    code = "DEADLINE_EXCEEDED"


class AbortedError(LpsyncError):
    """The collective was abandoned because another participant failed."""

    code = "ABORTED"


class UnavailableError(LpsyncError):
    """A peer (daemon or link) needed by the collective is gone."""

    code = "UNAVAILABLE"


class UnauthenticatedError(LpsyncError):
    """A peer without the cluster secret, or a client without the daemon's token."""

    code = "UNAUTHENTICATED"


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


class NotFoundError(LpsyncError):
    """A handle, session or job that the daemon does not know (or no longer knows)."""

    code = "NOT_FOUND"


class AlreadyExistsError(LpsyncError):
    """A second attach of a (job, rank) that is already attached."""

    code = "ALREADY_EXISTS"


class ResourceExhaustedError(LpsyncError):
    """A request beyond a limit: buffer size, per-session bytes, shared memory."""

    code = "RESOURCE_EXHAUSTED"


class UnimplementedError(LpsyncError):
    """A request this build cannot serve yet (another device kind, several nodes)."""

    code = "UNIMPLEMENTED"
