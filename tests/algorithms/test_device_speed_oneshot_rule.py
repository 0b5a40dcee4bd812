"""The tuner's device-only rule for the one-shot allreduce (lpsync.algorithms.oneshot) and
the device path's use of it (lpsync.daemon.collectives.local): chosen for allreduce up to
the threshold the device link model and the cap make, never above, never for other ops,
never when the client forced an algorithm; the host's choices are untouched."""

from __future__ import annotations

import pytest

from lpsync.algorithms.cost import LinkModel
from lpsync.algorithms.oneshot import ONESHOT, oneshot_max_bytes, oneshot_seconds, select_device
from lpsync.algorithms.tuner import select
from lpsync.daemon.collectives.local import DEVICE_LINK, LOCAL_LINK, ONESHOT_MAX_BYTES, device_oneshot
from lpsync.types import Collective

C = Collective


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_device_speed_oneshot_below_the_threshold_and_not_above(p: int) -> None:
    cap = ONESHOT_MAX_BYTES
    assert oneshot_max_bytes(p, DEVICE_LINK, cap) == cap  # the model puts its crossover past the cap
    for nbytes in (4, 4096, cap):
        choice = select_device(C.ALLREDUCE, nbytes, p, DEVICE_LINK, cap)
        assert choice.algorithm == ONESHOT and choice.chunks == 1
        assert choice.seconds == oneshot_seconds(p, nbytes, DEVICE_LINK)
        assert device_oneshot("", C.ALLREDUCE, p, nbytes, DEVICE_LINK)
    for nbytes in (cap + 4, 4 * cap):
        assert select_device(C.ALLREDUCE, nbytes, p, DEVICE_LINK, cap) == select(
            C.ALLREDUCE, nbytes, p, DEVICE_LINK
        )
        assert not device_oneshot("", C.ALLREDUCE, p, nbytes, DEVICE_LINK)


def test_device_speed_oneshot_only_unforced_allreduce_of_several() -> None:
    for op in (C.BROADCAST, C.REDUCE, C.ALLGATHER, C.REDUCE_SCATTER):
        assert select_device(op, 4096, 4, DEVICE_LINK, ONESHOT_MAX_BYTES) == select(op, 4096, 4, DEVICE_LINK)
    assert select_device(C.ALLREDUCE, 4096, 1, DEVICE_LINK, ONESHOT_MAX_BYTES).algorithm != ONESHOT
    for forced in ("lp", "ring", "mst", "be"):
        assert not device_oneshot(forced, C.ALLREDUCE, 4, 4096, DEVICE_LINK)


def test_device_speed_oneshot_threshold_comes_from_the_model() -> None:
    """Where a step costs nothing (alpha 0) the one-shot's (P-1)n pull loses to the ring's
    2(P-1)/P n for P > 2 at every size: the model, not the cap, says no. A costlier step
    moves its crossover up, a smaller cap bounds it."""
    free_steps = LinkModel.from_bandwidth(alpha=0.0, bandwidth=100e9, shared_nic=False)
    assert oneshot_max_bytes(4, free_steps, ONESHOT_MAX_BYTES) == 0
    cheap = LinkModel.from_bandwidth(alpha=1e-6, bandwidth=100e9, shared_nic=False)
    assert 0 < oneshot_max_bytes(4, cheap, ONESHOT_MAX_BYTES) < ONESHOT_MAX_BYTES
    assert oneshot_max_bytes(4, DEVICE_LINK, 4096) == 4096


def test_device_speed_oneshot_leaves_the_host_choices_alone() -> None:
    """select() never answers oneshot: the host paths ask it, not select_device."""
    for nbytes in (4, 4096, 1 << 20):
        for link in (LOCAL_LINK, DEVICE_LINK):
            assert select(C.ALLREDUCE, nbytes, 4, link).algorithm != ONESHOT
