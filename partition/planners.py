"""Planners: manual cuts, equal op counts, and the optimal bottleneck plan by dynamic programming.

The optimal planner minimises, over all K-stage plans whose stages fit their memory caps, the
largest stage cycle (compute / speed + link time of received bytes over that stage's link + the
runtime's per-frame costs, runtime.py); then, among plans within
`tolerance` of that optimum, it picks one moving the fewest bytes, because transfers are where a
real pipeline loses most against its model. Both passes are O(K n^2) on numpy arrays over
precomputed range tables (tables.py): a 700-op graph with K = 8 takes well under a second.
"""

from __future__ import annotations

import numpy as np

from tvmpipe.partition.devices import Link, format_bytes
from tvmpipe.partition.errors import PartitionError
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.plan import Plan, check_stage_count, plan_equal_ops
from tvmpipe.partition.predict import Prediction, attach, predict

STRATEGIES = ("manual", "equal", "optimal")
DEFAULT_TOLERANCE = 0.01


def stage_time_table(model: PipelineModel, speed: float, link: Link | None = None) -> np.ndarray:
    """(n+1, n+1) cycle of stage [i, j) at `speed` behind `link`; inf where i >= j."""
    t = model.tables
    n = t.n
    times = model.runtime.stage_cycle_us(t.compute / speed, (link or model.link).transfer_us(t.recv))
    idx = np.arange(n + 1)
    return np.where(idx[:, None] < idx[None, :], times, np.inf)


def plan_optimal(model: PipelineModel, k: int, tolerance: float = DEFAULT_TOLERANCE) -> Plan:
    """The K-stage plan with the smallest bottleneck (then fewest bytes moved within `tolerance`)."""
    n = model.num_ops
    check_stage_count(n, k)
    if tolerance < 0:
        raise PartitionError(f"tolerance must be >= 0, got {tolerance}")
    speeds, caps, links = model.stage_speeds(k), model.stage_caps(k), model.stage_links(k)
    memory = model.tables.memory
    by_device: dict[tuple[float, int | None, Link], np.ndarray] = {}  # alike devices and links share one table
    for key in zip(speeds, caps, links):
        if key not in by_device:
            speed, cap, link = key
            c = stage_time_table(model, speed, link)
            by_device[key] = c if cap is None else np.where(memory <= cap, c, np.inf)
    costs = [by_device[key] for key in zip(speeds, caps, links)]

    # pass 1: minimal bottleneck
    best = costs[0][0].copy()  # best[j]: bottleneck of stages 0..s covering ordinals [0, j)
    for s in range(1, k):
        best = np.maximum(best[:, None], costs[s]).min(axis=0)
    bottleneck = best[n]
    if not np.isfinite(bottleneck):
        raise PartitionError(_no_fit_message(model, k, caps))

    # pass 2: fewest bytes among plans whose every stage stays within the threshold
    limit = bottleneck * (1 + tolerance) + 1e-9 * max(bottleneck, 1.0)
    recv = model.tables.recv
    moved = np.where(costs[0][0] <= limit, recv[0], np.inf)
    choice = []
    for s in range(1, k):
        total = moved[:, None] + np.where(costs[s] <= limit, recv, np.inf)
        choice.append(total.argmin(axis=0))
        moved = total.min(axis=0)
    cuts = [n]  # walk back from the end: stage s starts where choice[s-1] says
    for s in range(k - 1, 0, -1):
        cuts.append(int(choice[s - 1][cuts[-1]]))
    return Plan.from_cuts(model.flow.graph, cuts[:0:-1], strategy="optimal")


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
    single = max(model.stage_memory(a, a + 1) for a in range(n))
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
                     tolerance: float = DEFAULT_TOLERANCE, requests: int | None = None) -> tuple[Plan, Prediction]:
    """Plan with `strategy`; the plan (its prediction recorded in `plan.predicted`) and the prediction.

    manual: `cuts` (op ordinals; `k`, if given, must be len(cuts)+1); equal: K equal op counts;
    optimal: plan_optimal.
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
    elif strategy == "equal":
        plan = plan_equal_ops(graph, k)
    elif strategy == "optimal":
        plan = plan_optimal(model, k, tolerance)
    else:
        raise PartitionError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    prediction = predict(model, plan, requests)
    return attach(plan, prediction), prediction
