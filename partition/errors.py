"""Errors the partitioner raises on purpose; the CLI prints them without a traceback."""

from __future__ import annotations

from tvmpipe.bundle.errors import Problem, ProblemsError
from tvmpipe.core.errors import TvmpipeError


class PartitionError(TvmpipeError):
    """A partition request that cannot be met: more stages than op nodes, memory caps nothing fits,
    cut positions out of range, a profile for another graph."""


class PlanError(ProblemsError):
    """A plan that does not fit its graph; lists every problem so a hand-written plan is fixed in one go."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems, "plan")
