"""`tvmpipe sweep`'s measuring half: run every planned case on the cluster and fill in what it
measured. Which plans to run and what each should do is the partition layer's (partition/sweep.py,
predict.py, report.py); the functions here only run pipelines and measure.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from tvmpipe.app.connect import open_cluster, pick_backend, pipeline_kwargs
from tvmpipe.app.options import ClusterOptions
from tvmpipe.bundle import Bundle
from tvmpipe.core import files
from tvmpipe.core.errors import TvmpipeError

CALIBRATION_MICRO_BATCHES = 500  # per zero-compute calibration round (a count of 74 read noise)
SWEEP_ROUND_S = 0.1  # 'auto' micro-batches per round: this long at the 1-stage rate
SWEEP_MEASURE_S = 3.0  # 'auto' rounds: this long measured per plan at the 1-stage rate ...
SWEEP_ROUNDS = (5, 40)  # ... within these bounds
AUTO = "auto"


def simulated_profile(bundle: Bundle, time_scale: float) -> dict[str, Any]:
    """Per-node times of the simulated backend's own model, as a profile both the planner and the
    simulated stages read, so a sweep compares the prediction with a run of the same op times."""
    from tvmpipe.executor import GraphRunner, random_inputs

    with GraphRunner(bundle, backend="simulated", time_scale=time_scale) as runner:
        return runner.profile(repeat=1, warmup=0, **random_inputs(bundle)).to_json()


@dataclass
class Calibrator:
    """The sweep's runtime costs (partition/runtime.py): calibrated ('auto'), 'none', or a JSON file of
    RuntimeCosts fields.

    'auto' keeps a 1-stage pipeline of this bundle open for the whole sweep and reads what its stage
    process and the driver spend per micro-batch. It runs the backend's own ops: on the reference backend
    a stage worker that pipelines runs them slower than the single-process profile (measured: ~15 % on
    examples/cnn, more when the machine is loaded), on the simulated backend a sleep overshoots under
    load, and only a run in a worker shows by how much (`compute_scale`). Other backends (cuda: no
    profile of its own) calibrate with every op time 0, which measures the runtime alone. A shared
    machine's speed swings by tens of percent within a second, so a plan's prediction takes the
    calibration rounds paired with its own rounds (`paired`), not the ones from the start of the sweep,
    which only choose the plans."""

    fixed: Any = None  # RuntimeCosts when not calibrated
    pipe: Any = None
    batches: list[dict[str, Any]] = field(default_factory=list)
    local: bool = True
    fields: dict[str, Any] = field(default_factory=dict)  # RuntimeCosts fields the run does not measure

    @property
    def calibrates(self) -> bool:
        return self.pipe is not None

    def measure(self, rounds: int = 1, warmup: int = 0) -> list[Any]:
        """`rounds` calibration rounds now (none without a calibration pipeline)."""
        from tvmpipe.cluster.experiment import measure_rounds

        return measure_rounds(self.pipe, self.batches, rounds, self.local, warmup) if self.pipe else []

    def paired(self, pipe: Any, batches: list[dict[str, Any]], rounds: int, local: bool, warmup: int = 0) -> tuple[list[Any], list[Any]]:
        """`rounds` rounds of `batches` through `pipe` (`local`: its workers are processes here), each paired with a calibration round run right
        before or after it (alternating, so neither side always runs first): (plan rounds, calibration rounds).

        Why pairs of short rounds: on the shared 2-core VM this was built on, the same 1-stage reference
        pipeline ran at 1300/s in one 0.1 s stretch and 2200/s in the next, in phases lasting from a tenth
        of a second to seconds. Three rounds of 0.6 s each, calibration before each, put a K = 1
        prediction between -12 % and +43 % of what it predicted (six tries); 15 alternating pairs of
        ~0.1 s, compared median to median, within 3 %; pooled over ten tries, 30 pairs give a spread
        (one standard deviation) of 2.6 %. A plan and the calibration it is predicted from must see the
        same stretches of the machine, so they take turns at the granularity of its noise."""
        from tvmpipe.cluster.experiment import measure_rounds

        measured: list[Any] = []
        alongside: list[Any] = []
        for r in range(rounds):
            first = warmup if r == 0 else 0
            if r % 2:
                measured += measure_rounds(pipe, batches, 1, local, first)
                alongside += self.measure()
            else:
                alongside += self.measure()
                measured += measure_rounds(pipe, batches, 1, local, first)
        return measured, alongside

    def match(self, bundle: Bundle, count: int) -> None:
        """Calibration rounds of `count` micro-batches when the calibration computes real ops: then a
        calibration round lasts as long as a round of the 1-stage plan, and a pair's two halves see the
        machine for equally long. A zero-compute calibration keeps CALIBRATION_MICRO_BATCHES."""
        from tvmpipe.executor.inputs import random_micro_batches

        if self.pipe is not None and self.fields.get("compute_us") is not None:
            self.batches = random_micro_batches(bundle, count, seed=1)

    def costs(self, rounds: list[Any]) -> Any:
        """RuntimeCosts from the median of `rounds`, or the fixed ones."""
        from tvmpipe.cluster.experiment import calibration_of

        if not self.pipe:
            return self.fixed
        return calibration_of(rounds).costs(**self.fields)


@contextlib.contextmanager
def open_calibrator(value: str, bundle: Bundle, backend: str, profile: Any, options: ClusterOptions,
                    cluster: Any, n: int) -> Iterator[Calibrator]:
    """A Calibrator (see there), its pipeline open inside the block."""
    import json

    from tvmpipe.cluster import Pipeline
    from tvmpipe.cluster.experiment import local_cores
    from tvmpipe.cluster.control.local import LOOPBACK
    from tvmpipe.cluster.wire.tcp import INLINE_BYTES
    from tvmpipe.executor.backend_simulated import SPIN_S
    from tvmpipe.executor.inputs import random_micro_batches
    from tvmpipe.partition import plan_equal_ops
    from tvmpipe.partition.errors import PartitionError
    from tvmpipe.partition.runtime import NO_RUNTIME, RuntimeCosts

    if value == "none":
        yield Calibrator(fixed=NO_RUNTIME)
        return
    if value != AUTO:
        try:
            fields = json.loads(Path(value).read_text())
            fixed = RuntimeCosts(**{**fields, "source": f"file {value}"})
        except PartitionError as exc:
            raise TvmpipeError(f"--runtime {value}: {exc}") from None
        except (OSError, ValueError, TypeError) as exc:
            raise TvmpipeError(f"--runtime {value}: cannot read runtime costs: {exc}") from None
        yield Calibrator(fixed=fixed)
        return
    local = cluster.host == LOOPBACK
    real_ops = backend in ("reference", "simulated") and isinstance(profile, dict)
    kw = pipeline_kwargs(options, cluster, backend if real_ops else "simulated", 1)
    kw["backend_opts"] = {"cost_profile": profile} if backend == "simulated" and real_ops else None
    if not real_ops:
        kw["backend_opts"] = {"time_scale": 0.0}
    extra: dict[str, Any] = {}
    if real_ops:  # Stage.run beyond its ops from the profile; the op-time scale from the run
        ops_us = sum(r["time_us"] for r in profile["nodes"])
        extra.update(compute_us=ops_us, run_us=max(0.0, profile.get("run_min_us", 0.0) - ops_us))
    cap = {"reference": None, "simulated": SPIN_S * 1e6}.get(backend, 0.0)
    extra.update(compute_cpu_cap_us=cap, cores=local_cores() if local else None, window=options.window,
                 inline_bytes=INLINE_BYTES, source="calibrated")
    with Pipeline(bundle, plan_equal_ops(bundle.graph, 1), **kw) as pipe:
        yield Calibrator(pipe=pipe, batches=random_micro_batches(bundle, n, seed=1), local=local, fields=extra)


def describe_costs(costs: Any) -> str:
    """One line of RuntimeCosts for the sweep's progress lines."""
    return (f"receive {costs.recv_us:.1f} us and send {costs.send_us:.1f} us per frame, Stage.run {costs.run_us:.1f} us, "
            f"driver {costs.driver_us:.1f} us" + (f", op times x{costs.compute_scale:.2f} in a worker"
                                                   if costs.compute_scale != 1.0 else "")
            + (f", CPU {100 * costs.cpu_share:.0f} % of the stage's wall time" if costs.cpu_share < 1 else "")
            + (f", {costs.cores} cores shared" if costs.cores else "")
            + (f" ({costs.cores_free:.2f} left by other processes)" if costs.cores and costs.cores_free is not None
               else ""))


def backend_profile(bundle: Bundle, backend: str, time_scale: float, bursts: int = 5) -> dict[str, Any] | None:
    """Op times of the backend the sweep runs on: the simulated backend's own model, or a reference
    profile where each node's time is its fastest over `bursts` profiles of 30 runs, 50 ms apart. One
    profile of a small model lasts ~10 ms, so on a shared machine one busy neighbour can slow all 30
    runs of it (measured: 330 vs 505 us for examples/cnn); bursts spread over ~0.3 s do not share that."""
    if backend == "simulated":
        return simulated_profile(bundle, time_scale)
    if backend != "reference":
        return None
    import time

    from tvmpipe.executor import GraphRunner, random_inputs

    profiles = []
    with GraphRunner(bundle, backend="reference") as runner:
        inputs = random_inputs(bundle)
        for i in range(bursts):
            if i:
                time.sleep(0.05)
            profiles.append(runner.profile(repeat=30, warmup=3, **inputs).to_json())
    prof = profiles[0]
    for row, *others in zip(prof["nodes"], *(p["nodes"] for p in profiles[1:])):
        row["time_us"] = min([row["min_us"]] + [o["min_us"] for o in others])
    prof["run_min_us"] = min(p.get("run_min_us", 0.0) for p in profiles)
    return prof


def one_stage_rate(model: Any) -> float:
    """Micro-batches/s the model predicts for the whole graph on one stage."""
    from tvmpipe.partition.planners import make_plan
    from tvmpipe.partition.predict import predict

    return predict(model, make_plan(model, 1, "equal", requests=1), 1).throughput


def sweep_micro_batches(value: int | str, model: Any) -> int:
    """Micro-batches per round of a sweep plan. A fixed count is wrong at both ends: 32 micro-batches
    of a sub-millisecond model are a few ms, all noise, while 2000 of a 35 ms model take a minute.
    'auto' aims at SWEEP_ROUND_S at the 1-stage rate (model: with the calibrated runtime costs), within
    32..2000: rounds short enough to pair with calibration rounds at the machine's noise (Calibrator.paired)."""
    if value != AUTO:
        return int(value)
    return int(min(2000, max(32, one_stage_rate(model) * SWEEP_ROUND_S)))


def sweep_rounds(value: int | str, model: Any, micro_batches: int) -> int:
    """Rounds per sweep plan. 'auto': SWEEP_MEASURE_S of measuring at the 1-stage rate, within
    SWEEP_ROUNDS: with 'auto' micro-batches, 30 rounds of ~0.1 s (Calibrator.paired says why so many)."""
    if value != AUTO:
        return int(value)
    lo, hi = SWEEP_ROUNDS
    return int(min(hi, max(lo, round(SWEEP_MEASURE_S * one_stage_rate(model) / micro_batches))))


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
              time_scale: float = 1.0, runtime: str = AUTO, rounds: int | str = AUTO, measure_links: bool = False,
              say: Callable[[str], None] = lambda line: None) -> tuple[list[Any], dict[str, Path]]:
    """Plan `bundle` for every stage count in `stages` (lo, hi) and strategy, run each plan `rounds`
    times (each paired with a calibration round: Calibrator.paired), and write the report under `out`. `measure_links`: probe the Ray cluster's links first
    (cluster/linkprobe.py), keep them in links.json and charge boundary frames with them. `say` receives one line per step as it happens. Returns
    the cases (a case that could not be planned or run has `error` set) and the report's files."""

    from tvmpipe.cluster import Pipeline
    from tvmpipe.cluster.experiment import WARMUP_MICRO_BATCHES, spreads
    from tvmpipe.cluster.control.local import LOOPBACK
    from tvmpipe.cluster.timeline import gantt_spans, write_trace
    from tvmpipe.executor.inputs import random_micro_batches
    from tvmpipe.partition.cost import read_profile
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.predict import attach, predict
    from tvmpipe.partition.report import fastest, noise_lines, write_report
    from tvmpipe.partition.sweep import Measured, sweep_plans

    if rounds != AUTO and int(rounds) < 1:
        raise TvmpipeError(f"--rounds must be >= 1, got {rounds}")
    lo, hi = stages
    out = prepare_report_dir(out)
    records: dict[str, Any] = {}  # per case: the record of its median round, for the report's Gantt chart
    with open_cluster(options, hi + 1) as cluster:  # + 1: the calibration pipeline stays open
        backend = pick_backend(options.backend, cluster.gpus)
        prof = read_profile(profile) if profile else backend_profile(bundle, backend, time_scale)
        links = None
        if measure_links:
            from tvmpipe.cluster.linkprobe import measure_links as probe, summarize

            links = summarize(probe())
            files.write_json(out / "links.json", links.to_json())
            say(f"links measured through the data plane: {links.describe()}")
        across = links is not None and links.network is not None and options.placement in ("SPREAD", "STRICT_SPREAD")
        model = PipelineModel.build(bundle, profile=prof, **({"link": links.model_link(across)} if links else {}))
        if links:
            say(f"boundary frames charged {model.link.latency_us:.0f} us + bytes at {model.link.bandwidth / 1e9:.2f} GB/s "
                + ("(stages spread over nodes: the network beyond loopback)" if across else "(stages on one node: loopback)"))
        local = cluster.host == LOOPBACK
        with open_calibrator(runtime, bundle, backend, prof, options, cluster, CALIBRATION_MICRO_BATCHES) as cal:
            costs = cal.costs(cal.measure(3, WARMUP_MICRO_BATCHES))
            model = replace(model, runtime=costs)
            say(f"runtime costs for planning ({costs.source}): {describe_costs(costs)}"
                + ("; each plan is predicted from calibration rounds paired with its own" if cal.calibrates else ""))
            n = sweep_micro_batches(micro_batches, model)
            n_rounds = sweep_rounds(rounds, model, n)
            batches = random_micro_batches(bundle, n, seed=0)
            cal.match(bundle, n)
            say(f"{n} micro-batches per round" + (" (auto)" if micro_batches == AUTO else "")
                + f", {n_rounds} round(s) per plan" + (" (auto)" if rounds == AUTO else ""))
            cases = sweep_plans(model, hi, strategies, min_stages=lo, requests=n)
            for case in cases:
                key = case_key(case)
                if case.plan is None:
                    say(f"[{key}] not planned: {case.error.splitlines()[0]}")
                    continue
                case.plan.save(out / "plans" / f"{key}.json")
                kw = pipeline_kwargs(options, cluster, backend, len(case.plan.stages))
                if backend == "simulated":
                    kw["backend_opts"] = {"cost_profile": prof}
                try:
                    with Pipeline(bundle, case.plan, **kw) as pipe:
                        measured, alongside = cal.paired(pipe, batches, n_rounds, local, WARMUP_MICRO_BATCHES)
                except TvmpipeError as exc:
                    case.error = f"run failed: {exc}"
                    say(f"[{key}] {case.error}")
                    continue
                if alongside:  # the prediction from what the runtime cost while this plan ran
                    here = cal.costs(alongside)
                    case.prediction = predict(replace(model, runtime=here), case.plan, n)
                    attach(case.plan, case.prediction).predicted["runtime"] = here.to_json()
                    case.plan.save(out / "plans" / f"{key}.json")
                sp = spreads(measured)
                mid = sorted(measured, key=lambda r: r.throughput)[len(measured) // 2]
                m = mid.metrics
                case.measured = Measured(
                    throughput=sp["throughput"].median, latency_p50_us=sp["latency_p50_us"].median,
                    latency_p99_us=sp["latency_p99_us"].median, bubble=sp["bubble"].median, rounds=len(measured),
                    throughput_range=(sp["throughput"].lo, sp["throughput"].hi),
                    bubble_range=(sp["bubble"].lo, sp["bubble"].hi), load=(sp["load"].lo, sp["load"].hi),
                    utilisation=[(s.busy or 0.0, s.bubble or 0.0, s.idle or 0.0) for s in m.stages],
                    cpu_us=sp["cpu_us"].median if "cpu_us" in sp else None,
                    cores_busy=sp["cores_busy"].median if "cores_busy" in sp else None)
                write_trace(mid.record, out / "traces" / f"{key}.json")
                files.write_json(out / "traces" / f"{key}.metrics.json", m.to_json())
                records[key] = mid.record
                pred, meas = case.prediction.throughput, case.measured
                say(f"[{key}] predicted {pred:.1f}/s, measured {meas.throughput:.1f}/s "
                    f"({100 * (pred / meas.throughput - 1):+.1f}%; {meas.rounds} rounds {meas.throughput_range[0]:.1f}-"
                    f"{meas.throughput_range[1]:.1f}), bubble {100 * meas.bubble:.0f}% (predicted "
                    f"{100 * case.prediction.bubble:.0f}%), p50 {meas.latency_p50_us / 1e3:.2f} ms, load "
                    f"{meas.load[1]:.1f}" + (f", CPU {meas.cpu_us:.0f} us per micro-batch (predicted "
                                             f"{case.prediction.cpu_us:.0f})" if meas.cpu_us is not None else "")
                    + (" [CPU-bound]" if case.prediction.cpu_bound else "")
                    + (f"; runtime alongside: {describe_costs(here)}" if alongside else ""))
    for line in noise_lines(cases):
        say(line)
    best = fastest(cases)
    rec = records[case_key(best)] if best else None
    timeline = [sp for sp in gantt_spans(rec) if sp[3] in rec.done_times] if rec else None
    paths = write_report(cases, out, title=f"tvmpipe sweep: {bundle.name} ({backend})", timeline=timeline,
                         timeline_title=f"{case_key(best)}, the fastest measured plan" if best else None,
                         runtime=model.runtime,
                         notes=[f"Links (measured, links.json): {links.describe()}; boundary frames charged "
                                f"{model.link.latency_us:.0f} us + bytes at {model.link.bandwidth / 1e9:.2f} GB/s."]
                         if links else None)
    if links:
        paths["links"] = out / "links.json"
    return cases, paths


def whatif_sweep(bundle: Bundle, out: str | Path, cluster_file: str, *, stages: tuple[int, int],
                 strategies: tuple[str, ...], micro_batches: int | str = AUTO, profile: str | None = None,
                 say: Callable[[str], None] = lambda line: None) -> tuple[list[Any], dict[str, Path]]:
    """`sweep --backend simulated --cluster FILE`: plans for a described cluster, run by the event
    simulator (partition/simulate.py), no processes started."""
    import time

    from tvmpipe.partition.cost import read_profile
    from tvmpipe.partition.hardware import load_cluster
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.report import fastest, write_report
    from tvmpipe.partition.sweep import simulate_cases, sweep_plans

    lo, hi = stages
    spec = load_cluster(cluster_file)
    speeds, caps, links = spec.stages(min(hi, spec.num_devices))
    model = PipelineModel.build(bundle, profile=read_profile(profile) if profile else None,
                                speeds=speeds, memory_caps=caps, links=links)
    n = 256 if micro_batches == AUTO else int(micro_batches)
    t0 = time.perf_counter()
    cases = sweep_plans(model, min(hi, spec.num_devices), strategies, min_stages=lo, requests=n)
    runs = simulate_cases(model, cases, n)
    say(f"{spec.describe()}\n{len(cases)} plans, {n} simulated micro-batches each, {time.perf_counter() - t0:.2f} s")
    for case in cases:
        if case.measured:
            say(f"[{case_key(case)}] predicted {case.prediction.throughput:.1f}/s, simulated "
                f"{case.measured.throughput:.1f}/s, bubble {100 * case.prediction.bubble:.1f}% (simulated "
                f"{100 * case.measured.bubble:.1f}%)")
        else:
            say(f"[{case_key(case)}] not planned: {(case.error or '').splitlines()[0]}")
    best = fastest(cases)
    paths = write_report(cases, Path(out), title=f"what-if: {bundle.name} on {spec.name}",
                         timeline=runs[id(best)].spans() if best else None, timeline_unit="us",
                         timeline_title=f"{case_key(best)} (event simulation)" if best else None,
                         runtime=model.runtime, measured_label="simulated")
    return cases, paths
