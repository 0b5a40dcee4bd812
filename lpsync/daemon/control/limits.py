"""Every request value is checked here before anything is sized, indexed or allocated from it.

One module, so that the bounds live in one place (docs/reliability.md lists them): the
servicer calls ``check_attach`` / ``check_bytes`` / ``check_collective`` first and only then
touches sessions, jobs or shared memory. A violation is InvalidArgumentError (the value can
never be right) or ResourceExhaustedError (a configured limit is reached), and its message
names the field, the value and the limit with the flag that sets it.

Invariant: daemon state grows with what attached or registered (sessions, buffers, arrived
collectives), never with a number a request claims (a world size, a count, a sequence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lpsync.algorithms.registry import DIRECT
from lpsync.errors import InvalidArgumentError, ResourceExhaustedError
from lpsync.types import BLOCKED, DTYPES, ITEMSIZE, ROOTED_OPS, Collective, ReduceOp

OPS = frozenset(c.value for c in Collective)
REDUCE_OPS = frozenset(r.value for r in ReduceOp)
# Linux's PID_MAX_LIMIT (2**22): no process id is larger.
MAX_PID = 1 << 22
# Longest wait a collective may ask for; beyond it a timeout is a typo, not a plan.
MAX_TIMEOUT = 7 * 86400.0
# Session ids are 32 hex digits (secrets.token_hex(16)); anything far longer is garbage.
MAX_SESSION_ID = 64
# Names of enums carried as strings (op, dtype, reduce_op, algorithm, device).
MAX_KEYWORD = 32


@dataclass(frozen=True)
class Limits:
    """The daemon's bounds: DaemonConfig.limits() fills them from the config's fields of
    the same names (where their defaults and flags --max-… live)."""

    max_world_size: int  # ranks of one job
    max_sessions: int  # attached processes on this daemon
    max_buffer_bytes: int  # one Allocate/Register
    max_session_bytes: int  # bytes one session holds in buffers
    max_total_bytes: int  # bytes all sessions together hold
    max_session_buffers: int  # buffers one session holds (each is a mapping)
    max_name_length: int  # job and collective names, in UTF-8 bytes
    max_pending: int  # collectives of one job waiting for participants
    max_queued: int  # replies a Session stream holds for a client not reading

    def validate(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"setting {name} must be positive, got {getattr(self, name)}")


def _invalid(field: str, value: object, rule: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{field} {_show(value)} {rule}")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}…({len(text)} characters)"


def check_name(
    field: str, value: str, limits: Limits, *, required: bool = False, flag: str = "--max-name-length"
) -> None:
    """Job and collective names: printable, at most ``max_name_length`` UTF-8 bytes."""
    if not value:
        if required:
            raise InvalidArgumentError(f"{field} is empty; it is required")
        return
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limits.max_name_length:
        raise InvalidArgumentError(
            f"{field} of {size} bytes exceeds the limit of {limits.max_name_length} ({flag})"
        )
    if not value.isprintable():
        raise _invalid(field, value, "contains control or non-printable characters")


def check_keyword(field: str, value: str, allowed) -> None:
    """A string that names one of a fixed set (op, dtype, reduce op, algorithm)."""
    if value not in allowed:
        shown = value if len(value) <= MAX_KEYWORD else value[:MAX_KEYWORD] + "…"
        raise InvalidArgumentError(f"{field} {shown!r} is not one of {', '.join(sorted(allowed))}")


def check_session_id(value: str) -> None:
    if len(value) > MAX_SESSION_ID:
        raise InvalidArgumentError(
            f"session_id of {len(value)} characters is not a session id (at most {MAX_SESSION_ID})"
        )


def check_attach(
    job: str, rank: int, world_size: int, local_rank: int, local_world_size: int, pid: int, limits: Limits
) -> None:
    check_name("job", job, limits, required=True)
    if not 1 <= world_size <= limits.max_world_size:
        raise _invalid("world_size", world_size, f"is outside 1..{limits.max_world_size} (--max-world-size)")
    if rank >= world_size:
        raise InvalidArgumentError(f"rank {rank} is not in a world of size {world_size}")
    if local_world_size > world_size:
        raise InvalidArgumentError(f"local_world_size {local_world_size} exceeds world_size {world_size}")
    if local_world_size and local_rank >= local_world_size:
        raise InvalidArgumentError(
            f"local_rank {local_rank} is not below local_world_size {local_world_size}"
        )
    if not local_world_size and local_rank > rank:
        raise InvalidArgumentError(
            f"local_rank {local_rank} exceeds rank {rank} (and no local_world_size is set)"
        )
    if pid > MAX_PID:
        raise _invalid("pid", pid, f"is not a process id (at most {MAX_PID})")


def check_rank_nodes(rank_nodes, world_size: int, nodes: int) -> None:
    """A discovered layout (AttachRequest.rank_nodes): no entries, or one node per rank, each
    a node of this daemon's cluster. Call after check_attach (world_size is bounded), before
    anything is built from it."""
    if not rank_nodes:
        return
    if len(rank_nodes) != world_size:
        raise InvalidArgumentError(
            f"rank_nodes has {len(rank_nodes)} entries for a world of size {world_size}: give "
            "the node of every rank, or none"
        )
    top = max(rank_nodes)
    if top >= nodes:
        raise InvalidArgumentError(
            f"rank_nodes puts rank {list(rank_nodes).index(top)} on node {top}, but this daemon's "
            f"cluster has {nodes} node(s)"
            + (" (it has no peers: --peers, --peers-dns or --peers-slurm)" if nodes == 1 else " (--peers)")
        )


def check_local_world(job: str, local_ranks: int, limits: Limits) -> None:
    """The ranks of a job this daemon must serve all attach here: more than the session
    limit could never complete."""
    if local_ranks > limits.max_sessions:
        raise ResourceExhaustedError(
            f"job {job!r} needs {local_ranks} ranks attached to this daemon, more than its "
            f"limit of {limits.max_sessions} sessions (--max-sessions)"
        )


def check_bytes(field: str, nbytes: int, limits: Limits) -> None:
    if nbytes < 0:
        raise _invalid(field, nbytes, "is negative; a buffer size must be >= 0 bytes")
    if nbytes > limits.max_buffer_bytes:
        raise ResourceExhaustedError(
            f"{field} {nbytes}: a buffer exceeds the daemon's limit of "
            f"{limits.max_buffer_bytes} bytes (--max-buffer-bytes)"
        )


def check_timeout(timeout: float) -> None:
    """0 means the daemon's default; otherwise finite, positive, at most MAX_TIMEOUT."""
    if timeout == 0:
        return
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
        raise _invalid(
            "timeout", timeout, f"must be 0 (the default) or between 0 and {MAX_TIMEOUT:g} seconds"
        )


def check_collective(request, world_size: int, limits: Limits, algorithms) -> None:
    """The fields of a CollectiveRequest that need no buffer to check (the spans are
    checked against their buffers by SessionTable.view)."""
    # Per collective: each helper (it raises, naming the field) only where the value is
    # not plainly valid.
    if request.op not in OPS:
        check_keyword("op", request.op, OPS)
    if request.timeout:
        check_timeout(request.timeout)
    if request.name:
        check_name("name", request.name, limits)
    if request.op == Collective.BARRIER:
        return
    if request.dtype not in ITEMSIZE:
        check_keyword("dtype", request.dtype, DTYPES)
    itemsize = ITEMSIZE[request.dtype]
    blocks = world_size if request.op in BLOCKED else 1  # the largest buffer of any rank
    if request.count < 0:
        raise _invalid("count", request.count, "is negative")
    if request.count * itemsize * blocks > limits.max_buffer_bytes:
        raise _invalid(
            "count",
            request.count,
            f"of {request.dtype} spans more than a buffer may hold "
            f"({limits.max_buffer_bytes} bytes, --max-buffer-bytes)",
        )
    if request.op in ROOTED_OPS and request.root >= world_size:
        raise InvalidArgumentError(f"root {request.root} is not a rank of a world of {world_size}")
    if request.reduce_op and request.reduce_op not in REDUCE_OPS:
        check_keyword("reduce_op", request.reduce_op, REDUCE_OPS)
    if request.algorithm:
        check_keyword("algorithm", request.algorithm, {*algorithms, DIRECT})
    for field in ("input", "output"):
        offset = getattr(request, field).offset
        if not 0 <= offset <= limits.max_buffer_bytes:
            raise _invalid(
                f"{field}.offset", offset, f"is outside 0..{limits.max_buffer_bytes} (--max-buffer-bytes)"
            )
