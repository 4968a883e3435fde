"""The pure half of `tvmpipe sweep`: which plans a sweep runs and what each should do.

The cluster layer runs the plans and fills in `measured`; report.py turns the cases into tables and
plots. A stage count that cannot be planned (memory caps, too few op nodes) stays in the sweep as a
case with `error` set, so the report shows why a row is missing instead of silently dropping it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvmpipe.partition.errors import PartitionError
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.plan import Plan
from tvmpipe.partition.planners import DEFAULT_TOLERANCE, OptimalPlanner, plan_and_predict
from tvmpipe.partition.predict import Prediction
from tvmpipe.partition.simulate import SimulatedRun, simulate

SWEEP_STRATEGIES = ("equal", "optimal")


@dataclass
class Measured:
    """What the cluster measured for one plan (throughput in samples/s, latencies in microseconds).

    Over several rounds the figures are medians, and `*_range` the (min, max) over the rounds, so a
    report shows how far one run can be from the next on the same plan. `utilisation` is per stage
    (busy, bubble, idle) of the median round; `load` the 1-minute load average during the rounds;
    `source` says whether a real pipeline or the event simulator (simulate.py) produced the numbers.
    `cpu_us` is the CPU every stage process and the driver spent per micro-batch and `cores_busy` the
    cores they kept busy (medians over rounds; None where the workers' CPU cannot be read, e.g. on
    remote nodes): set beside the prediction's, they show whether a CPU-bound row missed because the
    work cost more CPU than calibrated or because the cores were not kept busy.
    """

    throughput: float
    latency_p50_us: float
    latency_p99_us: float
    bubble: float | None = None
    rounds: int = 1
    throughput_range: tuple[float, float] | None = None
    bubble_range: tuple[float, float] | None = None
    load: tuple[float, float] | None = None
    utilisation: list[tuple[float, float, float]] | None = None
    source: str = "pipeline"
    cpu_us: float | None = None
    cores_busy: float | None = None


@dataclass
class SweepCase:
    stages: int
    strategy: str
    plan: Plan | None
    prediction: Prediction | None
    error: str | None = None
    measured: Measured | None = None


def sweep_plans(model: PipelineModel, max_stages: int, strategies: tuple[str, ...] = SWEEP_STRATEGIES,
                min_stages: int = 1, tolerance: float = DEFAULT_TOLERANCE,
                requests: int | None = None) -> list[SweepCase]:
    """One case per (stage count in min..max, strategy), predictions attached, in that order."""
    if min_stages < 1 or max_stages < min_stages:
        raise PartitionError(f"a sweep needs 1 <= min stages <= max stages, got {min_stages}..{max_stages}")
    cases = []
    planner = OptimalPlanner(model, tolerance)  # one for every K: its tables and first pass are shared
    for k in range(min_stages, max_stages + 1):
        for strategy in strategies:
            try:
                plan, prediction = plan_and_predict(model, k, strategy, tolerance=tolerance, requests=requests,
                                                    planner=planner)
            except PartitionError as exc:
                cases.append(SweepCase(k, strategy, None, None, error=str(exc)))
                continue
            cases.append(SweepCase(k, strategy, plan, prediction))
    return cases


def simulate_cases(model: PipelineModel, cases: list[SweepCase], micro_batches: int) -> dict[int, SimulatedRun]:
    """Fill every planned case's `measured` from the event simulator (simulate.py); runs by id(case)."""
    runs = {}
    for case in cases:
        if case.plan is None:
            continue
        run = simulate(model, case.plan, micro_batches,
                       case.prediction if case.prediction and case.prediction.requests == micro_batches else None)
        case.measured = Measured(throughput=run.steady_throughput, latency_p50_us=run.latency_p50_us,
                                 latency_p99_us=run.latency_p99_us, bubble=run.bubble,
                                 utilisation=run.utilisation(), source="simulated")
        runs[id(case)] = run
    return runs
