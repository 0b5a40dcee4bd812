"""Names shared by every layer: collective ops, reduce ops and element types."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from enum import StrEnum

import numpy as np

from lpsync.errors import InvalidArgumentError

# Every op's buffer sizes, which ops have a root and which run out of place only: the
# client's contract (lpsync_client.wire), defined there once.
from lpsync_client.wire import OUT_OF_PLACE_ONLY, ROOTED_OPS, blocks

__all__ = [
    "BLOCKED",
    "DATA_COLLECTIVES",
    "DTYPES",
    "ITEMSIZE",
    "OUT_OF_PLACE_ONLY",
    "ROOTED_OPS",
    "Collective",
    "ReduceOp",
    "blocks",
    "dtype_name",
    "dtype_of",
    "parse_collective",
]


class Collective(StrEnum):
    ALLREDUCE = "allreduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALLGATHER = "allgather"
    REDUCE_SCATTER = "reduce_scatter"
    BARRIER = "barrier"  # moves no data: every participant arrives, then all leave
    GATHER = "gather"  # every rank's block into root's output, in rank order
    SCATTER = "scatter"  # block r of root's input to rank r
    ALLTOALL = "alltoall"  # block j of rank i's input to block i of rank j's output


# The collectives that move data: the ones with schedules, sizes and bandwidths.
DATA_COLLECTIVES = tuple(c for c in Collective if c is not Collective.BARRIER)
# The collectives whose size (as nccl-tests counts it) is P blocks of count elements.
BLOCKED = frozenset(
    {
        Collective.ALLGATHER,
        Collective.REDUCE_SCATTER,
        Collective.GATHER,
        Collective.SCATTER,
        Collective.ALLTOALL,
    }
)


class ReduceOp(StrEnum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


# A request's op and reduce op (strings, already checked) as members: a dict lookup, where
# ``Collective(name)`` runs the Enum machinery in Python (the daemon does it per collective).
COLLECTIVE_OF: dict[str, Collective] = {c.value: c for c in Collective}
REDUCE_OP_OF: dict[str, ReduceOp] = {r.value: r for r in ReduceOp}


# The element types of DESIGN.md; bfloat16 comes from ml_dtypes (numpy has none).
_NUMPY_TYPES = {
    name: np.dtype(name) for name in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8")
}
_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8")
# Bytes per element, by name, without importing ml_dtypes.
ITEMSIZE = {name: 2 if name == "bfloat16" else _NUMPY_TYPES[name].itemsize for name in _NAMES}


@functools.cache
def _bfloat16() -> np.dtype:
    import ml_dtypes  # its import is ~0.5 s of CPU: most of a CLI command's start-up

    return np.dtype(ml_dtypes.bfloat16)


class _Dtypes(Mapping[str, np.dtype]):
    """DTYPES: name -> numpy dtype; ml_dtypes is imported when bfloat16's is first read."""

    def __getitem__(self, name: str) -> np.dtype:
        if name == "bfloat16":
            return _bfloat16()
        return _NUMPY_TYPES[name]

    def __contains__(self, name: object) -> bool:
        return name in _NAMES

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)


DTYPES: Mapping[str, np.dtype] = _Dtypes()


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype for a DESIGN.md type name; InvalidArgumentError for anything else."""
    dtype = _NUMPY_TYPES.get(name)  # the common case: no Mapping method in Python
    if dtype is not None:
        return dtype
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: np.dtype) -> str:
    if dtype.name in _NUMPY_TYPES:
        return dtype.name
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise InvalidArgumentError(f"unsupported dtype {dtype}; expected one of {', '.join(DTYPES)}")


def parse_collective(name: str) -> Collective:
    try:
        return Collective(name)
    except ValueError:
        raise InvalidArgumentError(
            f"unknown collective {name!r}; expected one of {', '.join(c.value for c in Collective)}"
        ) from None
