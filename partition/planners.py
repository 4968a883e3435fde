"""Planners: manual cuts, equal op counts, and the optimal bottleneck plan by dynamic programming.

The optimal planner minimises, over all K-stage plans whose stages fit their memory caps, the
largest stage cycle (compute / speed + link time of received bytes over that stage's link + the
runtime's per-frame costs, runtime.py); then, among plans within
`tolerance` of that optimum, it picks one moving the fewest bytes, because transfers are where a
real pipeline loses most against its model. Both passes are O(K n^2) on numpy arrays over
precomputed range tables (range_tables.py): a 700-op graph with K = 8 takes well under a second.
"""

from __future__ import annotations

import numpy as np

from tvmpipe.partition.devices import Link, format_bytes
from tvmpipe.partition.errors import PartitionError
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.plan import Plan, check_stage_count, plan_equal_keeping_state, plan_equal_ops
from tvmpipe.partition.predict import Prediction, attach, predict

STRATEGIES = ("manual", "equal", "optimal")
DEFAULT_TOLERANCE = 0.01


def stage_time_table(model: PipelineModel, speed: float, link: Link | None = None) -> np.ndarray:
    """(n+1, n+1) cycle of stage [i, j) at `speed` behind `link`; inf where i >= j."""
    t = model.tables
    n = t.n
    rt = model.runtime
    times = rt.stage_cycle_us(t.compute / speed, (link or model.link).transfer_us(t.recv),
                              inline_out=rt.inline_frames(t.send))
    idx = np.arange(n + 1)
    return np.where(idx[:, None] < idx[None, :], times, np.inf)


def by_end(table: np.ndarray) -> np.ndarray:
    """`table[i, j]` re-indexed as `out[d, j] = table[j - d, j]` (the stage of d ops ending at j); inf for j < d.

    Row d holds every stage of length d, so a planner that knows no stage longer than w can be cheap
    enough reads rows 1..w only."""
    n1 = table.shape[0]
    d = np.arange(n1)[:, None]
    j = np.arange(n1)[None, :]
    return np.where(j >= d, table[np.clip(j - d, 0, None), j], np.inf)


class OptimalPlanner:
    """The optimal planner for one model, for any number of stages: what does not depend on K is done once.

    Stage s runs on device s whatever K is, so the stage-cycle table of each distinct (speed, cap, link)
    and the first pass (the smallest bottleneck of stages 0..s over ops [0, j)) serve every K: a sweep
    over K = 1..64 runs that pass once to 64 instead of 64 times. The second pass (fewest bytes within
    the tolerance of K's bottleneck) is per K, but only over stages no longer than the longest stage
    whose cycle fits under that threshold (a few rows of `by_end` tables at large K), instead of all
    (n+1)^2 ranges. Both passes walk the same tables in the same order as the plain O(K n^2) DP and break
    ties the same way (the earliest start), so the plans are identical (tests check against brute force).
    """

    def __init__(self, model: PipelineModel, tolerance: float = DEFAULT_TOLERANCE):
        if tolerance < 0:
            raise PartitionError(f"tolerance must be >= 0, got {tolerance}")
        self.model, self.tolerance = model, tolerance
        n1 = model.num_ops + 1
        self._tables: dict[tuple[float, int | None, Link], tuple[np.ndarray, np.ndarray]] = {}
        self._keys: list[tuple[float, int | None, Link]] = []  # per stage s
        self._bests: list[np.ndarray] = []  # pass 1: bottleneck of stages 0..s over [0, j)
        self._recv = by_end(model.tables.recv)
        self._start = np.zeros(n1)
        self._start[1:] = np.inf  # before stage 0: only ops [0, 0) are covered, at no cost

    def _table(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """(by_end cycle table with caps applied, min over j of each row) of stage s's device."""
        key = self._keys[s]
        if key not in self._tables:
            speed, cap, link = key
            c = stage_time_table(self.model, speed, link)
            if cap is not None:
                c = np.where(self.model.tables.memory <= cap, c, np.inf)
            if self.model.tables.state is not None:  # a range holding part of a state pair is no stage
                c = np.where(np.isfinite(self.model.tables.state), c, np.inf)
            e = by_end(c)
            self._tables[key] = (e, e.min(axis=1))
        return self._tables[key]

    def _extend(self, k: int) -> None:
        m = self.model
        speeds, caps, links = m.stage_speeds(k), m.stage_caps(k), m.stage_links(k)
        while len(self._bests) < k:
            s = len(self._bests)
            self._keys.append((speeds[s], caps[s], links[s]))
            cost = self._table(s)[0]
            prev = self._bests[-1] if self._bests else self._start
            self._bests.append(_step(prev, cost, np.maximum)[0])

    def plan(self, k: int) -> Plan:
        """The K-stage plan with the smallest bottleneck (then fewest bytes moved within the tolerance)."""
        m = self.model
        n = m.num_ops
        check_stage_count(n, k)
        self._extend(k)
        bottleneck = self._bests[k - 1][n]
        if not np.isfinite(bottleneck):
            raise PartitionError(_no_fit_message(m, k, m.stage_caps(k)))
        limit = bottleneck * (1 + self.tolerance) + 1e-9 * max(bottleneck, 1.0)
        masked: dict[tuple[float, int | None, Link], np.ndarray] = {}
        moved, starts = self._start, []
        for s in range(k):
            key = self._keys[s]
            if key not in masked:
                cost, row_min = self._table(s)
                w = int(np.nonzero(row_min <= limit)[0].max())  # no stage longer than w fits under the limit
                masked[key] = np.where(cost[1:w + 1] <= limit, self._recv[1:w + 1], np.inf)
            moved, start = _step(moved, masked[key], np.add)
            starts.append(start)
        cuts = [n]  # walk back from the end: stage s starts where starts[s] says
        for s in range(k - 1, 0, -1):
            cuts.append(int(starts[s][cuts[-1]]))
        return Plan.from_cuts(m.flow.graph, cuts[:0:-1], strategy="optimal")


def _step(prev: np.ndarray, cost: np.ndarray, combine) -> tuple[np.ndarray, np.ndarray]:
    """One DP stage over `by_end` rows: for each end j, min over d of combine(prev[j - d], cost[d, j]);
    returns the minima and the arg-min starts j - d. `cost` is rows 0..w (row 0 all inf) or 1..w."""
    n1 = prev.shape[0]
    rows = cost[1:] if cost.shape[0] == n1 else cost  # rows d = 1..w
    w = rows.shape[0]
    padded = np.concatenate([np.full(w, np.inf), prev])
    # window r of padded is prev shifted by w - r: row d = w - r. Walk d from w down (earliest start first)
    shifted = np.lib.stride_tricks.sliding_window_view(padded, n1)[:w]
    total = combine(shifted, rows[::-1])
    pick = total.argmin(axis=0)
    best = total[pick, np.arange(n1)]
    return best, np.arange(n1) - (w - pick)


def plan_optimal(model: PipelineModel, k: int, tolerance: float = DEFAULT_TOLERANCE) -> Plan:
    """The K-stage plan with the smallest bottleneck (then fewest bytes moved within `tolerance`)."""
    return OptimalPlanner(model, tolerance).plan(k)


def _no_fit_message(model: PipelineModel, k: int, caps: list[int | None]) -> str:
    """Say by how much the caps are short: the plan minimising the largest memory/cap ratio."""
    memory = model.tables.memory
    n = model.num_ops
    idx = np.arange(n + 1)
    valid = idx[:, None] < idx[None, :]
    ratio = [np.where(valid, memory / (np.inf if c is None else c), np.inf) for c in caps]
    best = ratio[0][0].copy()
    for s in range(1, k):
        best = np.maximum(best[:, None], ratio[s]).min(axis=0)
    need = best[n]
    single = max((m for a in range(n) if np.isfinite(m := model.stage_memory(a, a + 1))), default=0)  # inside a state pair: inf
    cap_text = _fmt_caps(caps)
    return (f"no {k}-stage plan fits the memory caps ({cap_text}): the best plan needs {need:.2f}x the cap on its "
            f"fullest stage (the largest single op node alone needs {format_bytes(single)}); "
            f"use more stages or devices with more memory")


def _fmt_caps(caps: list[int | None]) -> str:
    shown = sorted({c for c in caps if c is not None})
    return ", ".join(format_bytes(c) for c in shown) + (" per device" if len(shown) == 1 else "")


def make_plan(model: PipelineModel, k: int | None, strategy: str, cuts: list[int] | None = None,
              tolerance: float = DEFAULT_TOLERANCE, requests: int | None = None) -> Plan:
    """Plan with `strategy` and record the prediction in `plan.predicted` (see plan_and_predict)."""
    return plan_and_predict(model, k, strategy, cuts, tolerance, requests)[0]


def plan_and_predict(model: PipelineModel, k: int | None, strategy: str, cuts: list[int] | None = None,
                     tolerance: float = DEFAULT_TOLERANCE, requests: int | None = None,
                     planner: OptimalPlanner | None = None) -> tuple[Plan, Prediction]:
    """Plan with `strategy`; the plan (its prediction recorded in `plan.predicted`) and the prediction.

    manual: `cuts` (op ordinals; `k`, if given, must be len(cuts)+1); equal: K equal op counts;
    optimal: `planner` (an OptimalPlanner of this model and tolerance, shared over a sweep's stage counts)
    or plan_optimal.
    """
    graph = model.flow.graph
    if strategy == "manual":
        if cuts is None:
            raise PartitionError("the manual strategy needs --cuts (op ordinals, e.g. --cuts 12,30)")
        if k is not None and k != len(cuts) + 1:
            raise PartitionError(f"--stages {k} disagrees with {len(cuts)} cut(s), which make {len(cuts) + 1} stages")
        plan = Plan.from_cuts(graph, list(cuts), strategy="manual")
    elif cuts is not None:
        raise PartitionError(f"--cuts only goes with --strategy manual, not {strategy!r}")
    elif k is None:
        raise PartitionError(f"the {strategy} strategy needs --stages K")
    elif strategy == "equal":  # a decode step's cuts keep every state pair whole
        plan = plan_equal_keeping_state(model.bundle, k) if model.bundle.state else plan_equal_ops(graph, k)
    elif strategy == "optimal":
        plan = planner.plan(k) if planner is not None else plan_optimal(model, k, tolerance)
    else:
        raise PartitionError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    prediction = predict(model, plan, requests)
    return attach(plan, prediction), prediction
