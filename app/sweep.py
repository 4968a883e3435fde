"""`tvmpipe sweep`'s measuring half: run every planned case on the cluster and fill in what it
measured. Which plans to run and what each should do is the partition layer's (partition/sweep.py,
predict.py, report.py); the functions here only run pipelines and measure.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from tvmpipe.app.connect import open_cluster, pick_backend, pipeline_kwargs
from tvmpipe.app.options import ClusterOptions
from tvmpipe.bundle import Bundle
from tvmpipe.core import files
from tvmpipe.core.errors import TvmpipeError

SWEEP_STEADY_S = 0.25  # 'auto' micro-batch count: seconds of steady state at the fastest possible rate
AUTO = "auto"


def simulated_profile(bundle: Bundle, time_scale: float) -> dict[str, Any]:
    """Per-node times of the simulated backend's own model, as a profile both the planner and the
    simulated stages read, so a sweep compares the prediction with a run of the same op times."""
    from tvmpipe.executor import GraphRunner, random_inputs

    with GraphRunner(bundle, backend="simulated", time_scale=time_scale) as runner:
        return runner.profile(repeat=1, warmup=0, **random_inputs(bundle)).to_json()


def frame_overhead(value: float | str, model: Any, run_plan: Callable[[Any], Any], micro_batches: int) -> float:
    """Microseconds the runtime adds per received frame (wake-up, decode, send), beyond op time.

    The cost models know op times only; on small stages the transport dominates and predictions
    would be off several-fold. 'auto' measures it once: the 1-stage plan's measured time per
    micro-batch minus its predicted time (its only frame is the driver's input frame).
    """
    from tvmpipe.cluster.metrics import compute_metrics
    from tvmpipe.partition.planners import make_plan
    from tvmpipe.partition.predict import predict

    if value != AUTO:
        return float(value)
    plan = make_plan(model, 1, "equal", requests=micro_batches)
    m = compute_metrics(run_plan(plan))
    measured_us = 1e6 / (m.steady_throughput * m.batch)
    predicted_us = 1e6 / predict(model, plan, micro_batches).throughput
    return max(0.0, measured_us - predicted_us)


def sweep_micro_batches(value: int | str, model: Any, max_stages: int) -> int:
    """Micro-batches per sweep plan. A fixed count is wrong at both ends: 32 micro-batches of a
    sub-millisecond model are a few ms of steady state, all noise, while 2000 of a 35 ms model
    take a minute per plan. 'auto' aims at SWEEP_STEADY_S for the fastest plan the op times allow
    (K stages of the 1-stage rate, an upper bound), within 32..2000."""
    from tvmpipe.partition.planners import make_plan
    from tvmpipe.partition.predict import predict

    if value != AUTO:
        return int(value)
    rate = predict(model, make_plan(model, 1, "equal", requests=1), 1).throughput
    return int(min(2000, max(32, rate * max_stages * SWEEP_STEADY_S)))


def case_key(case: Any) -> str:
    return f"{case.strategy}-k{case.stages}"


def prepare_report_dir(out: str | Path) -> Path:
    """The report directory with its plans/ and traces/, created before any cluster is opened."""
    out = Path(out)
    try:
        (out / "plans").mkdir(parents=True, exist_ok=True)
        (out / "traces").mkdir(exist_ok=True)
    except OSError as exc:
        raise files.OutputError(f"-o {out}: cannot create the report directory: {exc.strerror or exc}") from None
    return out


def run_sweep(bundle: Bundle, out: str | Path, options: ClusterOptions, *, stages: tuple[int, int],
              strategies: tuple[str, ...], micro_batches: int | str = AUTO, profile: str | None = None,
              time_scale: float = 1.0, frame_overhead_us: float | str = AUTO,
              say: Callable[[str], None] = lambda line: None) -> tuple[list[Any], dict[str, Path]]:
    """Plan `bundle` for every stage count in `stages` (lo, hi) and strategy, run each plan, and
    write the report under `out`. `say` receives one line per step as it happens. Returns the
    cases (a case that could not be planned or run has `error` set) and the report's files."""
    from tvmpipe.cluster import Pipeline
    from tvmpipe.cluster.metrics import compute_metrics
    from tvmpipe.cluster.timeline import gantt_spans, write_trace
    from tvmpipe.executor.inputs import random_micro_batches
    from tvmpipe.partition.cost import read_profile
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.report import write_report
    from tvmpipe.partition.sweep import Measured, sweep_plans

    lo, hi = stages
    out = prepare_report_dir(out)
    best: tuple[float, Any] | None = None
    with open_cluster(options, hi) as cluster:
        backend = pick_backend(options.backend, cluster.gpus)
        prof = read_profile(profile) if profile else None
        if prof is None and backend == "simulated":
            prof = simulated_profile(bundle, time_scale)
        model = PipelineModel.build(bundle, profile=prof)
        n = sweep_micro_batches(micro_batches, model, hi)
        batches = random_micro_batches(bundle, n, seed=0)
        say(f"{n} micro-batches per plan" + (" (auto)" if micro_batches == AUTO else ""))

        def run_plan(plan: Any) -> Any:
            kw = pipeline_kwargs(options, cluster, backend, len(plan.stages))
            if backend == "simulated":
                kw["backend_opts"] = {"cost_profile": prof}
            with Pipeline(bundle, plan, **kw) as pipe:
                pipe.run(batches)
                return pipe.record()

        overhead = frame_overhead(frame_overhead_us, model, run_plan, n)
        model = replace(model, link=replace(model.link, latency_us=overhead))
        say(f"per-frame runtime overhead in predictions: {overhead:.1f} us"
            + (" (measured: 1-stage run vs its prediction)" if frame_overhead_us == AUTO else ""))
        cases = sweep_plans(model, hi, strategies, min_stages=lo, requests=n)
        for case in cases:
            key = case_key(case)
            if case.plan is None:
                say(f"[{key}] not planned: {case.error.splitlines()[0]}")
                continue
            case.plan.save(out / "plans" / f"{key}.json")
            try:
                rec = run_plan(case.plan)
            except TvmpipeError as exc:
                case.error = f"run failed: {exc}"
                say(f"[{key}] {case.error}")
                continue
            m = compute_metrics(rec)
            case.measured = Measured(throughput=m.steady_throughput * m.batch, latency_p50_us=m.latency_p50_ms * 1e3,
                                     latency_p99_us=m.latency_p99_ms * 1e3, bubble=m.bubble)
            write_trace(rec, out / "traces" / f"{key}.json")
            files.write_json(out / "traces" / f"{key}.metrics.json", m.to_json())
            if best is None or case.measured.throughput > best[0]:
                best = (case.measured.throughput, rec)
            pred, meas = case.prediction.throughput, case.measured.throughput
            say(f"[{key}] predicted {pred:.1f}/s, measured {meas:.1f}/s ({100 * (meas / pred - 1):+.1f}%), "
                f"p50 {m.latency_p50_ms:.2f} ms, p99 {m.latency_p99_ms:.2f} ms, bubble {100 * (m.bubble or 0):.0f}% "
                f"(predicted {100 * case.prediction.bubble:.0f}%)")
    paths = write_report(cases, out, title=f"tvmpipe sweep: {bundle.name} ({backend}; predictions include "
                                           f"{overhead:.1f} us runtime overhead per received frame)",
                         timeline=gantt_spans(best[1]) if best else None)
    return cases, paths
