"""The device-only one-shot allreduce's rule: when the tuner picks it over a schedule.

Not a schedule (the registry's algorithms are): one kernel per device reads every
participant's input and writes that device's outputs (lpsync.engine.oneshot). Only the
device path asks here (lpsync.daemon.collectives.local.on_devices); ``select`` and the
host paths are unchanged, which is why this rule stands apart from the tuner's.

Its cost on a link model: one step (alpha: the launch and its host-side cost) and every
device pulling the other P-1 inputs through its own port ((P-1) n beta, plus the P-1
reductions' gamma), where a ring or chain moves about 2(P-1)/P n per link but pays an
alpha per step. So it wins small messages and loses large ones on bandwidth; ``cap``
bounds it where the model has not been measured (docs/gpu.md).
"""

from __future__ import annotations

from lpsync.algorithms.cost import LinkModel
from lpsync.algorithms.tuner import Choice, select
from lpsync.types import Collective

ONESHOT = "oneshot"


def oneshot_seconds(participants: int, nbytes: int, link: LinkModel) -> float:
    """The model's time of one one-shot allreduce of ``nbytes`` over ``participants``."""
    if participants == 1:
        return 0.0
    return link.alpha + (participants - 1) * nbytes * (link.beta + link.gamma)


def select_device(op: Collective, nbytes: int, participants: int, link: LinkModel, cap: int) -> Choice:
    """The tuner's choice for device buffers: the one-shot allreduce (chunks 1) where the
    model predicts it no slower than ``select``'s pick and ``nbytes`` <= ``cap``; else
    ``select``'s pick. The same answer for the same arguments on every participant."""
    choice = select(op, nbytes, participants, link)
    if op is not Collective.ALLREDUCE or participants < 2 or nbytes > cap:
        return choice
    seconds = oneshot_seconds(participants, nbytes, link)
    return Choice(ONESHOT, 1, seconds) if seconds <= choice.seconds else choice


def oneshot_max_bytes(participants: int, link: LinkModel, cap: int) -> int:
    """The largest power-of-two size up to ``cap`` that ``select_device`` gives the
    one-shot allreduce (0: none): the threshold the model and the cap make."""
    best, size = 0, 1
    while size <= cap:
        if select_device(Collective.ALLREDUCE, size, participants, link, cap).algorithm == ONESHOT:
            best = size
        size *= 2
    return best
