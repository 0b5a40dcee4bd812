"""Pure algorithms: schedules (lp, ring, mst, be), the cost model, the simulator and the tuner."""

from lpsync.algorithms.cost import LinkModel, closed_form, lp_chunks
from lpsync.algorithms.registry import ALGORITHMS, Algorithm, algorithms_for, generate
from lpsync.algorithms.schedule import Buf, Kind, Schedule
from lpsync.algorithms.simulate import simulate
from lpsync.algorithms.tuner import Choice, select

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Buf",
    "Choice",
    "Kind",
    "LinkModel",
    "Schedule",
    "algorithms_for",
    "closed_form",
    "generate",
    "lp_chunks",
    "select",
    "simulate",
]
