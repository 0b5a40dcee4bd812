"""Node 0's learning tuner (lpsync/daemon/collectives/learning.py), driven as collectives/path.py drives it.
(Across real daemons: tests/daemon/test_daemon_multinode.py.)"""

from __future__ import annotations

from lpsync.algorithms.tuner import Choice
from lpsync.daemon.collectives.learning import (
    MAX_CANDIDATES,
    MIN_VARIANT_CHUNK,
    NEAR,
    SHORTLIST,
    TRIALS,
    Learner,
    candidates,
)

KEY = ("broadcast", 1 << 18)
PREDICTED = [
    Choice("lp", 8, 0.010),
    Choice("mst", 1, 0.012),
    Choice("be", 1, 0.009),
    Choice("slow", 1, 0.009 * SHORTLIST * 1.01),
]
MEASURED = {"lp": 0.0115, "mst": 0.0096, "be": 0.0154}  # the model's order is wrong


def _run(learner: Learner, nodes: int, calls: int) -> list[tuple[str, bool]]:
    """``calls`` collectives of KEY: node 0 chooses, every node times its share and
    reports it with the next summary (node n takes MEASURED + n ms)."""
    seen, last = [], None
    for sequence in range(calls):
        if last is not None:
            for node in range(nodes):
                learner.report(node, last, MEASURED[seen[-1][0]] + node * 1e-3)
            last = None
        choice, trial = learner.choose(KEY, lambda: PREDICTED, sequence)  # a trial is handed out
        seen.append((choice.algorithm, trial))
        if trial:
            last = sequence
    return seen


def test_tries_the_shortlist_then_keeps_the_fastest_measured() -> None:
    learner = Learner(nodes=3)
    seen = _run(learner, 3, 3 * TRIALS + 5)
    trials = [a for a, trial in seen if trial]
    assert sorted(trials) == sorted(["lp", "mst", "be"] * TRIALS)  # "slow" not shortlisted
    assert [a for a, _ in seen[:3]] == ["be", "lp", "mst"]  # predicted fastest first
    assert all(not trial for _, trial in seen[3 * TRIALS :])
    assert [a for a, _ in seen[3 * TRIALS + 1 :]] == ["mst"] * 4  # measured, not predicted
    assert learner.learned(KEY) == PREDICTED[1]


def test_a_near_tie_goes_to_the_fewest_chunks() -> None:
    # LP with 16 chunks is fastest, by less than NEAR over 8 chunks (kept: fewer
    # messages); 4 chunks is slower by more than NEAR (not kept).
    predicted = [Choice("lp", 8, 0.50), Choice("lp", 4, 0.52), Choice("lp", 16, 0.49)]
    measured = {8: 0.566 * (1 + NEAR * 0.8), 4: 0.566 * (1 + NEAR * 1.5), 16: 0.566}
    learner = Learner(nodes=1)
    for sequence in range(3 * TRIALS):
        choice, trial = learner.choose(KEY, lambda: predicted, sequence)
        assert trial
        learner.report(0, sequence, measured[choice.chunks])
    assert learner.learned(KEY) == predicted[0]
    # Without the 8-chunk candidate, 16 chunks is the only one within reach.
    learner = Learner(nodes=1)
    for sequence in range(2 * TRIALS):
        choice, _ = learner.choose(KEY, lambda: predicted[1:], sequence)
        learner.report(0, sequence, measured[choice.chunks])
    assert learner.learned(KEY) == predicted[2]


def test_the_slowest_node_counts() -> None:
    learner = Learner(nodes=2)
    assert learner.choose(KEY, lambda: PREDICTED, 7) == (PREDICTED[2], True)  # trial 7
    learner.report(0, 7, 0.001)
    assert learner._pending  # node 1 has not reported yet
    learner.report(1, 7, 0.005)
    assert learner._sizes[KEY].times[("be", 1)] == [0.005]


def test_a_failed_trial_is_handed_out_again_and_unknown_reports_are_ignored() -> None:
    learner = Learner(nodes=2)
    first, trial = learner.choose(KEY, lambda: PREDICTED, 1)
    assert trial
    learner.abandon(1)
    learner.report(0, 1, 0.1)  # too late: ignored
    assert learner._sizes[KEY].issued[(first.algorithm, first.chunks)] == 0
    again, trial = learner.choose(KEY, lambda: PREDICTED, 2)
    assert trial and again == first


def test_one_candidate_in_reach_is_taken_without_trials() -> None:
    learner = Learner(nodes=4)
    choice, trial = learner.choose(
        ("allreduce", 4 << 20), lambda: [Choice("ring", 1, 1.0), Choice("mst", 1, 9.0)], 0
    )
    assert (choice.algorithm, trial) == ("ring", False)
    assert not learner._pending  # no trial handed out


def test_every_node_reports_its_latest_trial_once() -> None:
    learner = Learner(nodes=2)
    assert learner.take_last() is None
    learner.ran(4, 0.25)
    learner.ran(5, 0.5)
    assert learner.take_last() == (5, 0.5)
    assert learner.take_last() is None


def test_pipelined_candidates_come_with_half_and_twice_their_chunks() -> None:
    from lpsync.algorithms import LinkModel
    from lpsync.types import Collective

    link = LinkModel.from_bandwidth(alpha=100e-6, bandwidth=125e6, shared_nic=True)
    found = candidates(Collective.BROADCAST, 64 << 20, 8, link)
    lp = sorted(c.chunks for c in found if c.algorithm == "lp")
    assert len(lp) == 3 and lp[0] == lp[1] // 2 and lp[2] == 2 * lp[1]
    assert [c.chunks for c in found if c.algorithm == "mst"] == [1]  # not pipelined
    assert all((64 << 20) // c.chunks >= MIN_VARIANT_CHUNK for c in found)
    # The shortlist stays bounded whatever the model offers.
    learner = Learner(nodes=8)
    learner.choose(("broadcast", 64 << 20), lambda: found, 0)
    assert len(learner._sizes[("broadcast", 64 << 20)].shortlist) <= MAX_CANDIDATES
