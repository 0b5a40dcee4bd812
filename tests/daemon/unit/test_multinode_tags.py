"""Tag spaces of the peer plane: collectives' folded tags never meet control messages."""

from __future__ import annotations

from lpsync.daemon.collectives.planning import tag_base
from lpsync.daemon.peers.plane import CONTROL, HEARTBEAT, PROBE, SPEC, control_tag
from lpsync.engine.routing import MAX_PARTICIPANTS, TAG_BITS, fold


def test_collective_tags_stay_below_the_control_space() -> None:
    biggest_step = (1 << 20) - 1
    for job in ("a", "train", "x" * 200):
        for sequence in (0, 1, 4095, 4096, 2**40 + 3):
            base = tag_base(job, sequence)
            assert base + biggest_step < 1 << 39 < 1 << TAG_BITS
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
