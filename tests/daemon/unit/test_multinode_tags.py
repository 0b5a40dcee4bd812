"""Tag spaces of the peer plane (lpsync.transport.tags): collectives' folded tags never
meet control messages, and no control kind meets GOODBYE."""

from __future__ import annotations

import zlib

import pytest

from lpsync.transport.tags import (
    ATTACHED,
    CONTROL,
    GOODBYE,
    HEARTBEAT,
    HISTORY,
    MAX_PARTICIPANTS,
    MESSAGE_BITS,
    NOTE,
    PROBE,
    SPEC,
    TOLD,
    VERDICT,
    agreement_tags,
    control_tag,
    fold,
    tag_base,
)


def test_collective_tags_stay_below_the_control_space() -> None:
    biggest_step = (1 << 20) - 1
    for job in ("a", "train", "x" * 200):
        for sequence in (0, 1, 4095, 4096, 2**40 + 3):
            base = tag_base(job, sequence)
            assert base + biggest_step < 1 << 39 < 1 << MESSAGE_BITS
            folded = fold(MAX_PARTICIPANTS - 1, MAX_PARTICIPANTS - 1, base + biggest_step)
            assert folded < CONTROL


def test_successive_collectives_of_a_job_have_distinct_tag_bases() -> None:
    bases = [tag_base("train", s) for s in range(4096)]
    assert len(set(bases)) == 4096
    assert all(b % (1 << 20) == 0 for b in bases)  # the step tag fits below


def test_control_tags_set_bit_63_and_keep_kinds_apart() -> None:
    tags = {control_tag(kind, value) for kind in (HEARTBEAT, PROBE, SPEC) for value in (0, 1, (1 << 56) - 1)}
    assert len(tags) == 9
    assert all(t & CONTROL and t < 1 << 64 for t in tags)


def test_a_folded_tag_reads_back_as_its_fields() -> None:
    # Decoded by hand from the layout in lpsync.transport.tags' docstring.
    for src, dst, tag in ((0, 0, 0), (4095, 1, (1 << 39) - 1), (7, 4095, 123456)):
        folded = fold(src, dst, tag)
        assert (folded >> 24, (folded >> 12) & 0xFFF, folded & 0xFFF) == (tag, src, dst)


def test_every_control_kind_is_its_own_and_none_is_goodbye() -> None:
    kinds = (HEARTBEAT, PROBE, SPEC, VERDICT, HISTORY, TOLD, NOTE, ATTACHED)
    assert len(set(kinds)) == len(kinds) and all(0 < k < 127 for k in kinds)
    assert all(control_tag(k, (1 << 56) - 1) != GOODBYE for k in kinds)
    assert GOODBYE >> 56 == 0xFF  # bit 63 and kind 127


@pytest.mark.parametrize("job", ["", "a", "train", "x" * 200])
@pytest.mark.parametrize("sequence", [0, 1, 12345, 0xFFFFFFFF, 1 << 32, (1 << 40) + 7])
def test_a_collectives_agreement_tags_are_its_control_tags(job: str, sequence: int) -> None:
    # The layout of the docstring: the job's CRC-32 above the sequence's low 32 bits, cut to
    # a control value (56 bits), under the kinds SPEC (summaries) and VERDICT.
    value = ((zlib.crc32(job.encode()) << 32) | (sequence & 0xFFFFFFFF)) & ((1 << 56) - 1)
    summary, verdict = agreement_tags(job, sequence)
    assert (summary, verdict) == (control_tag(SPEC, value), control_tag(VERDICT, value))
    assert summary >> 56 == 0x80 | SPEC and verdict >> 56 == 0x80 | VERDICT
