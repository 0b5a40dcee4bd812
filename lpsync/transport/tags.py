"""Every layout of the peer plane's 64-bit message tags, in one place.

A tag names one message between two daemons' endpoints (a UCX tag's width; the TCP
transport frames it). The spaces are told apart by their top bits:

  collective (bit 63 clear): the routed endpoint folds sender and receiver in
  (lpsync.engine.routing), below a collective's message tag (lpsync.daemon.collectives):

      | 0 | job hash: 7 | sequence: 12 | step: 20 | sender: 12 | receiver: 12 |
        \\_____ message tag: MESSAGE_BITS (40), always < 2**39 _____/

  control (bit 63 set): the peer plane's own messages (lpsync.daemon.peers.plane), a
  kind of 7 bits and a value of 56:

      | 1 | kind: 7 | value: 56 |

    a collective's agreement (SPEC, VERDICT) carries the job's hash and the sequence:

      | 1 | kind: 7 | job hash: low 24 bits | sequence: low 32 bits |

  GOODBYE: every bit set (kind 127, which no kind below uses): a transport's farewell.
"""

from __future__ import annotations

import functools
import zlib

from lpsync.errors import InvalidArgumentError

# -- collectives -------------------------------------------------------------------------
STEP_BITS = 20  # messages per pair of one collective: a schedule's tags stay below 2**STEP_BITS
SEQUENCE_BITS = 12  # successive collectives of a job, modulo 4096
JOB_BITS = 7  # a job's hash, so that two jobs' collectives of one sequence stay apart
RANK_BITS = 12  # a participant's rank, as sender and as receiver
MESSAGE_BITS = 64 - 2 * RANK_BITS  # a message tag, above the two ranks
FOLD_SHIFT = 2 * RANK_BITS  # a folded tag is (message tag << FOLD_SHIFT) | pair_bits
MAX_PARTICIPANTS = 1 << RANK_BITS
_MAX_MESSAGE = 1 << MESSAGE_BITS


@functools.lru_cache(maxsize=1024)
def job_hash(name: str) -> int:
    """A job's name as a 32-bit number: what its messages' tags are made of."""
    return zlib.crc32(name.encode())


def tag_base(job: str, sequence: int) -> int:
    """The message tag of step 0 of a job's collective ``sequence``; its steps add to it."""
    hashed = job_hash(job) & ((1 << JOB_BITS) - 1)
    return (hashed << SEQUENCE_BITS | (sequence & ((1 << SEQUENCE_BITS) - 1))) << STEP_BITS


def fold(src: int, dst: int, tag: int) -> int:
    """The wire tag of message ``tag`` from participant ``src`` to ``dst``."""
    if tag >= _MAX_MESSAGE:
        raise InvalidArgumentError(f"message tag {tag} does not fit in {MESSAGE_BITS} bits")
    return (tag << FOLD_SHIFT) | (src << RANK_BITS) | dst


# -- control -----------------------------------------------------------------------------
CONTROL = 1 << 63
KIND_SHIFT = 56
CONTROL_VALUE = (1 << KIND_SHIFT) - 1  # the bits of a control tag that carry its value
# The peer plane's kinds (SPEC and VERDICT: a collective's agreement, agreement_tags; ATTACHED: the ranks
# each node serves, peers/attached.py; NOTE: any-source sends).
HEARTBEAT, PROBE, SPEC, VERDICT, HISTORY, TOLD, NOTE, ATTACHED = 1, 2, 3, 4, 5, 6, 7, 8
GOODBYE = (1 << 64) - 1  # kind 127: no kind above uses it


def control_tag(kind: int, value: int) -> int:
    """A peer-plane control tag: bit 63, the kind in bits 56..62, ``value`` below."""
    return CONTROL | (kind << KIND_SHIFT) | (value & CONTROL_VALUE)


def agreement_value(hashed_job: int, sequence: int) -> int:
    """The value of a collective's SPEC and VERDICT tags: the job's hash (``job_hash``)
    above the sequence's low 32 bits, cut to a control tag's value."""
    return ((hashed_job << 32) | (sequence & 0xFFFFFFFF)) & CONTROL_VALUE


_SPEC_TAG, _VERDICT_TAG = control_tag(SPEC, 0), control_tag(VERDICT, 0)


def agreement_tags(job: str, sequence: int) -> tuple[int, int]:
    """(summary tag, verdict tag) of a job's collective ``sequence``: control_tag(SPEC and
    VERDICT, agreement_value), written out (two calls less per collective). Computed once
    by the multi-node path and handed to the agreement."""
    value = agreement_value(job_hash(job), sequence)
    return _SPEC_TAG | value, _VERDICT_TAG | value
