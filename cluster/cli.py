"""`tvmpipe run` and `tvmpipe sweep`: run a bundle as a pipeline and check it, or sweep plans.

`tvmpipe run --stages 2 --local` with no bundle runs the built-in example (examples/mlp, shipped
as `tvmpipe.examples`) on an embedded loopback-only Ray cluster, checks every output against a
single-process GraphRunner run, and prints a per-stage table. Ray is imported only inside the
commands, so `tvmpipe --help` stays fast on machines without it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tvmpipe.bundle.errors import TvmpipeError
from tvmpipe.bundle.units import format_bytes

BUILTIN_EXAMPLE = "mlp"
BACKEND_CHOICES = ["auto", "reference", "cuda", "simulated"]


def register(subparsers: argparse._SubParsersAction) -> None:
    r = subparsers.add_parser(
        "run", help="run a bundle as a pipeline of stages and check it against a single-process run",
        description="Run BUNDLE (default: the built-in examples/mlp) as K pipeline stages on Ray actors (or "
                    "local processes), stream micro-batches through it, compare every output with a "
                    "single-process GraphRunner run, and print per-stage and overall numbers. Exits 1 when "
                    "an output differs.")
    r.add_argument("bundle", nargs="?", help=f"bundle directory (default: built-in example '{BUILTIN_EXAMPLE}')")
    r.add_argument("--stages", "-k", type=int, default=2, help="number of stages K (default 2)")
    r.add_argument("--plan", metavar="PLAN.json", help="plan from `tvmpipe partition -o` (overrides --stages)")
    r.add_argument("--strategy", choices=["equal", "optimal"], default="equal",
                   help="how to cut K stages without --plan (default equal op counts)")
    r.add_argument("--micro-batches", "-n", type=int, default=16, help="micro-batches to run (default 16)")
    r.add_argument("--inputs", metavar="IN.npz", help="graph inputs by name: the input's shape (used for every "
                   "micro-batch) or with a leading micro-batch axis (default: seeded random inputs)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs (micro-batch i uses seed+i)")
    r.add_argument("--save-outputs", metavar="OUT.npz", help="write outputs: output<k> with a micro-batch axis")
    r.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace and a Gantt PNG beside it")
    r.add_argument("--json", action="store_true", help="print a machine-readable summary instead of tables")
    add_cluster_args(r)
    r.set_defaults(func=run_command)

    s = subparsers.add_parser(
        "sweep", help="run plans for 1..K stages and report predicted against measured",
        description="Plan BUNDLE for every stage count in the range and strategy, run each plan, and write a "
                    "report (markdown, CSV, plots, plans, traces) of predicted against measured throughput, "
                    "latency and bubble. With --backend simulated and no --profile, stage times come from the "
                    "simulated backend's own model, so predictions and runs use the same op times.")
    s.add_argument("bundle", help="bundle directory")
    s.add_argument("--stages", "-k", default="1..4", help="stage counts, e.g. 1..4 or 3 (default 1..4)")
    s.add_argument("--strategies", default="equal,optimal", help="comma-separated: equal, optimal")
    s.add_argument("--micro-batches", "-n", default="auto", metavar="N|auto",
                   help="micro-batches per plan; 'auto' (default): enough for ~0.25 s of steady state at the "
                        "fastest rate the op times allow, 32 to 2000")
    s.add_argument("--profile", metavar="PROFILE.json", help="per-node times (`tvmpipe profile --json`) for the "
                   "planner, and for the simulated backend")
    s.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated backend: multiply every op time (make stages long against transport overhead)")
    s.add_argument("--runtime", default="auto", metavar="auto|none|COSTS.json",
                   help="runtime costs in predictions (receive, send, Stage.run, driver; docs/partition.md): 'auto' "
                        "(default) calibrates them with a 1-stage zero-compute run; 'none' predicts an ideal "
                        "runtime; a JSON file of RuntimeCosts fields pins them")
    s.add_argument("--rounds", type=int, default=3, help="measured runs per plan, reported as median and min-max "
                                                         "(default 3)")
    s.add_argument("--cluster", metavar="CLUSTER.json", help="what-if cluster (devices, speeds, memory, links; "
                   "docs/partition.md): with --backend simulated, plans are run by the event simulator, not on "
                   "this machine")
    s.add_argument("-o", "--output", required=True, metavar="REPORT_DIR", help="report directory")
    add_cluster_args(s)
    s.set_defaults(func=sweep_command)


RAY_CONNECT_ATTEMPTS = 3


def connect_ray(address: str, attempts: int = RAY_CONNECT_ATTEMPTS, pause_s: float = 1.0) -> None:
    """ray.init(address), retried when a ray:// server fails a client's start-up.

    Ray's client proxier starts a server process per client and then reads its command line. If
    that process has just exited, psutil raises ZombieProcess inside the proxier, and the client
    gets "Initialization failure from server". This happened under load, in our end-to-end tests.
    The next attempt gets a fresh server. Any other failure is reported at once.
    """
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            return
        except ConnectionError as exc:
            transient = address.startswith("ray://") and "Initialization failure from server" in str(exc)
            if not transient or attempt == attempts:
                tried = f" ({attempt} attempts)" if attempt > 1 else ""
                raise TvmpipeError(f"cannot connect to the Ray cluster at {address}{tried}: {exc} (a cluster with "
                                   "token auth needs RAY_AUTH_MODE=token and its token in this environment)") from None
            ray.shutdown()
            time.sleep(pause_s)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The cluster options shared by `tvmpipe run`, `tvmpipe sweep` and `python -m tvmpipe.job`."""
    g = p.add_argument_group("cluster")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true",
                       help="start an embedded single-node Ray cluster bound to 127.0.0.1 only")
    where.add_argument("--address", metavar="auto|ray://HOST:PORT", help="connect to an existing Ray cluster")
    where.add_argument("--processes", action="store_true",
                       help="run stage workers as plain local processes, without Ray")
    g.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="auto: cuda where there is a GPU, else reference")
    g.add_argument("--window", type=int, help="micro-batches in flight (default 2 x stages)")
    g.add_argument("--placement", default="PACK", choices=["PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"],
                   help="placement-group strategy (default PACK)")
    g.add_argument("--gpus-per-stage", type=float, help="GPUs per stage actor (default: 1, or a share when "
                   "stages outnumber GPUs; 0 off cuda)")
    g.add_argument("--cpus-per-stage", type=float, default=0.5, help="CPUs reserved per stage actor (default 0.5)")
    g.add_argument("--max-restarts", type=int, default=3, help="restarts per stage before the run fails")
    g.add_argument("--progress-timeout", type=float, default=60.0,
                   help="seconds without a completed micro-batch before workers are checked (default 60)")
    g.add_argument("--ray-temp-dir", help="--local: Ray's session directory (default: a fresh one, removed)")


# ---- shared ------------------------------------------------------------------------------------------

def builtin_example(name: str = BUILTIN_EXAMPLE) -> Path:
    """The example bundle shipped inside the package (examples/<name> in a source checkout)."""
    path = Path(str(importlib.resources.files("tvmpipe.examples") / name))
    if not (path / "bundle.json").is_file():
        raise TvmpipeError(f"built-in example '{name}' is missing from this installation ({path})")
    return path


def pick_backend(requested: str, gpus: int) -> str:
    if requested != "auto":
        return requested
    return "cuda" if gpus > 0 else "reference"


@dataclass
class Cluster:
    """Where stage workers run, as Pipeline keyword arguments."""

    launcher: str
    host: str | None
    gpus: int
    ship_bundle: bool
    description: str


@contextlib.contextmanager
def open_cluster(args: argparse.Namespace, max_stages: int) -> Iterator[Cluster]:
    from tvmpipe.cluster.local import LOOPBACK, detect_gpus, local_ray

    if args.processes:
        yield Cluster("process", LOOPBACK, detect_gpus(), False, "local processes (no Ray)")
    elif args.local:
        gpus = detect_gpus()
        with local_ray(num_cpus=max(2.0, max_stages * args.cpus_per_stage), num_gpus=gpus, temp_dir=args.ray_temp_dir):
            yield Cluster("ray", LOOPBACK, gpus, False, f"local Ray on {LOOPBACK}")
    elif args.address:
        import ray

        connect_ray(args.address)
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            gpus = int(ray.cluster_resources().get("GPU", 0))
            yield Cluster("ray", None, gpus, len(nodes) > 1, f"Ray cluster {args.address} ({len(nodes)} node(s))")
        finally:
            ray.shutdown()
    else:
        raise TvmpipeError("say where to run: --local (embedded Ray on 127.0.0.1), --address auto|ray://HOST:PORT "
                           "(an existing cluster) or --processes (no Ray)")


def pipeline_kwargs(args: argparse.Namespace, cluster: Cluster, backend: str, k: int) -> dict[str, Any]:
    from tvmpipe.cluster.launch import ProcessLauncher, Timeouts
    from tvmpipe.cluster.placement import Placement

    gpus = args.gpus_per_stage
    if gpus is None:
        gpus = 0.0 if backend != "cuda" else (1.0 if cluster.gpus >= k else cluster.gpus / k)
    if backend == "cuda" and cluster.gpus == 0:
        raise TvmpipeError("the cuda backend needs a GPU, and this cluster has none (use --backend reference)")
    timeouts = Timeouts(progress=args.progress_timeout)
    kw: dict[str, Any] = dict(backend=backend, window=args.window, launcher=cluster.launcher, host=cluster.host,
                              ship_bundle=cluster.ship_bundle, max_restarts=args.max_restarts, timeouts=timeouts)
    if cluster.launcher == "ray":
        kw["placement"] = Placement(strategy=args.placement, gpus=gpus, cpus=args.cpus_per_stage)
    elif backend == "cuda":  # processes: stage i on GPU i, round robin when stages outnumber GPUs
        kw["launcher"] = ProcessLauncher(timeouts, devices=[str(i) for i in range(cluster.gpus)])
    return kw


def micro_batches(bundle, args: argparse.Namespace) -> list[dict[str, np.ndarray]]:
    """--inputs (one micro-batch repeated, or its rows cycled to -n) or seeded random inputs."""
    from tvmpipe.executor.inputs import npz_micro_batches, random_micro_batches

    if not args.inputs:
        return random_micro_batches(bundle, args.micro_batches, args.seed)
    return npz_micro_batches(bundle, args.inputs, args.micro_batches, cycle=True)


def compare(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> list[tuple[int, str]]:
    """(micro-batch, what differs) for every output that is not bit-identical; empty when all are."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        for k, (a, b) in enumerate(zip(g, w)):
            if a.shape != b.shape or a.dtype != b.dtype:
                bad.append((i, f"micro-batch {i} output {k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"))
            elif not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
                diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                bad.append((i, f"micro-batch {i} output {k}: max abs difference {diff:.3g}"))
    for i in range(len(got), len(want)):
        bad.append((i, f"micro-batch {i}: no output"))
    return bad


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def stage_table(metrics) -> str:
    rows = [("stage", "nodes", "ops", "host", "busy %", "bubble %", "idle %", "ms/mb", "bytes out")]
    for s in metrics.stages:
        rows.append((str(s.stage), f"[{s.nodes[0]}, {s.nodes[1]})", str(s.ops), s.host or "-", _pct(s.busy),
                     _pct(s.bubble), _pct(s.idle), "-" if s.compute_ms_mean is None else f"{s.compute_ms_mean:.3f}",
                     _bytes(s.bytes_out)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


# ---- tvmpipe run -------------------------------------------------------------------------------------

def _plan(bundle, args: argparse.Namespace):
    from tvmpipe.partition import Plan, plan_equal_ops

    if args.plan:
        return Plan.load(args.plan)
    if args.strategy == "equal":
        return plan_equal_ops(bundle.graph, args.stages)
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.planners import make_plan

    return make_plan(PipelineModel.build(bundle), args.stages, "optimal")


def run_command(args: argparse.Namespace) -> int:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.cluster.metrics import compute_metrics
    from tvmpipe.cluster.reference import reference_outputs
    from tvmpipe.cluster.timeline import write_gantt, write_trace

    path = Path(args.bundle) if args.bundle else builtin_example()
    bundle = load_bundle(path)
    plan = _plan(bundle, args)
    batches = micro_batches(bundle, args)
    with open_cluster(args, plan.num_stages) as cluster:
        backend = pick_backend(args.backend, cluster.gpus)
        kw = pipeline_kwargs(args, cluster, backend, plan.num_stages)
        with Pipeline(bundle, plan, **kw) as pipe:
            outputs = pipe.run(batches)  # checks every micro-batch's inputs before any is sent
            rec = pipe.record()
            window = pipe.window
    metrics = compute_metrics(rec)
    want = reference_outputs(bundle.path, batches, backend)
    mismatches = compare(outputs, want)
    if args.save_outputs:
        np.savez(args.save_outputs, **{f"output{k}": np.stack([o[k] for o in outputs]) for k in range(len(outputs[0]))})
    trace_files = []
    if args.trace:
        title = f"{bundle.name}: {plan.num_stages} stages"
        trace_files = [str(write_trace(rec, args.trace)),
                       str(write_gantt(rec, Path(args.trace).with_suffix(".png"), title=title))]
    summary = {"bundle": str(path), "model": bundle.name, "stages": [list(s) for s in plan.stages],
               "strategy": plan.strategy, "backend": backend, "cluster": cluster.description,
               "micro_batches": len(batches), "window": window, "match": not mismatches,
               "mismatches": [m for _, m in mismatches[:20]], "metrics": metrics.to_json(), "trace": trace_files}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"tvmpipe run: {bundle.name} ({path}), {plan.num_stages} stage(s) ({plan.strategy}), backend {backend}, "
              f"{cluster.description}, {len(batches)} micro-batches, window {window}")
        print(stage_table(metrics))
        print(f"throughput {metrics.throughput:.1f} micro-batches/s ({metrics.samples_per_s:.1f} samples/s; steady "
              f"state {metrics.steady_throughput:.1f}/s), latency p50 {metrics.latency_p50_ms:.3f} ms, "
              f"p99 {metrics.latency_p99_ms:.3f} ms, restarts {sum(metrics.restarts)}")
        for f in trace_files:
            print(f"wrote {f}")
        verdict = "yes" if not mismatches else "NO"
        identical = len(batches) - len({i for i, _ in mismatches})
        print(f"outputs match single-process run: {verdict} ({identical}/{len(batches)} micro-batches bit-identical)")
        for _, m in mismatches[:10]:
            print(f"  {m}", file=sys.stderr)
    return 0 if not mismatches else 1


# ---- tvmpipe sweep -----------------------------------------------------------------------------------

def _stage_range(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("..")
        return (int(lo), int(hi)) if hi else (int(lo), int(lo))
    except ValueError:
        raise TvmpipeError(f"--stages {text!r}: expected K or A..B, e.g. 1..4") from None


def _key(case) -> str:
    return f"{case.strategy}-k{case.stages}"


def simulated_profile(bundle, time_scale: float) -> dict[str, Any]:
    """Per-node times of the simulated backend's own model, as a profile both the planner and the
    simulated stages read, so a sweep compares the prediction with a run of the same op times."""
    from tvmpipe.executor import GraphRunner, random_inputs

    with GraphRunner(bundle, backend="simulated", time_scale=time_scale) as runner:
        return runner.profile(repeat=1, warmup=0, **random_inputs(bundle)).to_json()


def _number_or_auto(value: str, flag: str, convert: Any, minimum: float, what: str) -> float:
    """An option that is a number or 'auto' (the caller handles 'auto'): checked, named on error."""
    try:
        number = convert(value)
    except ValueError:
        raise TvmpipeError(f"{flag} {value!r}: expected {what} or 'auto'") from None
    if number < minimum:
        raise TvmpipeError(f"{flag} must be >= {minimum}, got {number}")
    return number


def _runtime_costs(value: str, bundle: Any, backend: str, profile: Any, args: argparse.Namespace,
                   cluster: Cluster, n: int) -> Any:
    """RuntimeCosts for the sweep's predictions: calibrated ('auto'), none, or read from a JSON file."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.cluster.experiment import calibration_of, local_cores, measure_rounds
    from tvmpipe.cluster.local import LOOPBACK
    from tvmpipe.executor.backend_simulated import SPIN_S
    from tvmpipe.executor.inputs import random_micro_batches
    from tvmpipe.partition import plan_equal_ops
    from tvmpipe.partition.runtime import NO_RUNTIME, RuntimeCosts

    if value == "none":
        return NO_RUNTIME
    local = cluster.host == LOOPBACK
    cap = {"reference": None, "simulated": SPIN_S * 1e6}.get(backend, 0.0)
    if value != "auto":
        try:
            fields = json.loads(Path(value).read_text())
            return RuntimeCosts(**{**fields, "source": f"file {value}"})
        except (OSError, ValueError, TypeError) as exc:
            raise TvmpipeError(f"--runtime {value}: cannot read runtime costs: {exc}") from None
    kw = pipeline_kwargs(args, cluster, "simulated", 1)
    kw["backend_opts"] = {"time_scale": 0.0}
    with Pipeline(bundle, plan_equal_ops(bundle.graph, 1), **kw) as pipe:
        rounds = measure_rounds(pipe, random_micro_batches(bundle, n, seed=1), 3, local)
    run_us = None
    if isinstance(profile, dict) and backend == "reference":  # Stage.run beyond its ops, from the profile
        run_us = max(0.0, profile.get("run_min_us", 0.0) - sum(r["time_us"] for r in profile["nodes"]))
    extra = {"run_us": run_us} if run_us is not None else {}
    return calibration_of(rounds).costs(compute_cpu_cap_us=cap, cores=local_cores() if local else None,
                                        window=args.window, source="calibrated", **extra)


def backend_profile(bundle: Any, backend: str, time_scale: float) -> dict[str, Any] | None:
    """Op times of the backend the sweep runs on: the simulated backend's own model, or a reference
    profile where each node's time is its fastest of 30 runs (the machine may be shared: noise only adds)."""
    if backend == "simulated":
        return simulated_profile(bundle, time_scale)
    if backend != "reference":
        return None
    from tvmpipe.executor import GraphRunner, random_inputs

    with GraphRunner(bundle, backend="reference") as runner:
        prof = runner.profile(repeat=30, warmup=3, **random_inputs(bundle)).to_json()
    for row in prof["nodes"]:
        row["time_us"] = row["min_us"]
    return prof


SWEEP_STEADY_S = 0.25  # 'auto' micro-batch count: seconds of steady state at the fastest possible rate


def _sweep_micro_batches(value: str, model: Any, max_stages: int) -> int:
    """Micro-batches per sweep plan. A fixed count is wrong at both ends: 32 micro-batches of a
    sub-millisecond model are a few ms of steady state, all noise, while 2000 of a 35 ms model
    take a minute per plan. 'auto' aims at SWEEP_STEADY_S for the fastest plan the op times allow
    (K stages of the 1-stage rate, an upper bound), within 32..2000."""
    from tvmpipe.partition.planners import make_plan
    from tvmpipe.partition.predict import predict

    if value != "auto":
        return int(_number_or_auto(value, "--micro-batches", int, 1, "a count"))
    rate = predict(model, make_plan(model, 1, "equal", requests=1), 1).throughput
    return int(min(2000, max(32, rate * max_stages * SWEEP_STEADY_S)))


def sweep_command(args: argparse.Namespace) -> int:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.cluster.experiment import measure_rounds, spreads
    from tvmpipe.cluster.local import LOOPBACK
    from tvmpipe.cluster.timeline import gantt_spans, write_trace
    from tvmpipe.executor.inputs import random_micro_batches
    from tvmpipe.partition.cost import read_profile
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.report import write_report
    from tvmpipe.partition.sweep import Measured, sweep_plans

    bundle = load_bundle(args.bundle)
    lo, hi = _stage_range(args.stages)
    strategies = tuple(s for s in args.strategies.split(",") if s)
    if args.rounds < 1:
        raise TvmpipeError(f"--rounds must be >= 1, got {args.rounds}")
    if args.cluster:
        return whatif_sweep(args, bundle, lo, hi, strategies)
    out = Path(args.output)
    (out / "plans").mkdir(parents=True, exist_ok=True)
    (out / "traces").mkdir(exist_ok=True)
    best: tuple[float, Any] | None = None
    with open_cluster(args, hi) as cluster:
        backend = pick_backend(args.backend, cluster.gpus)
        profile = read_profile(args.profile) if args.profile else backend_profile(bundle, backend, args.time_scale)
        model = PipelineModel.build(bundle, profile=profile)
        n = _sweep_micro_batches(args.micro_batches, model, hi)
        batches = random_micro_batches(bundle, n, seed=0)
        print(f"{n} micro-batches per plan" + (" (auto)" if args.micro_batches == "auto" else "")
              + f", {args.rounds} round(s)", flush=True)
        runtime = _runtime_costs(args.runtime, bundle, backend, profile, args, cluster, min(n, 500))
        model = replace(model, runtime=runtime)
        print(f"runtime costs in predictions ({runtime.source}): receive {runtime.recv_us:.1f} us and send "
              f"{runtime.send_us:.1f} us per frame, Stage.run {runtime.run_us:.1f} us, driver {runtime.driver_us:.1f} us"
              + (f", {runtime.cores} cores shared" if runtime.cores else ""), flush=True)
        cases = sweep_plans(model, hi, strategies, min_stages=lo, requests=n)
        for case in cases:
            if case.plan is None:
                print(f"[{_key(case)}] not planned: {case.error.splitlines()[0]}", flush=True)
                continue
            case.plan.save(out / "plans" / f"{_key(case)}.json")
            kw = pipeline_kwargs(args, cluster, backend, len(case.plan.stages))
            if backend == "simulated":
                kw["backend_opts"] = {"cost_profile": profile}
            try:
                with Pipeline(bundle, case.plan, **kw) as pipe:
                    rounds = measure_rounds(pipe, batches, args.rounds, cluster.host == LOOPBACK)
            except TvmpipeError as exc:
                case.error = f"run failed: {exc}"
                print(f"[{_key(case)}] {case.error}", flush=True)
                continue
            sp = spreads(rounds)
            mid = sorted(rounds, key=lambda r: r.throughput)[len(rounds) // 2]
            m = mid.metrics
            case.measured = Measured(
                throughput=sp["throughput"].median, latency_p50_us=sp["latency_p50_us"].median,
                latency_p99_us=sp["latency_p99_us"].median, bubble=sp["bubble"].median, rounds=len(rounds),
                throughput_range=(sp["throughput"].lo, sp["throughput"].hi), bubble_range=(sp["bubble"].lo, sp["bubble"].hi),
                load=(sp["load"].lo, sp["load"].hi),
                utilisation=[(s.busy or 0.0, s.bubble or 0.0, s.idle or 0.0) for s in m.stages])
            write_trace(mid.record, out / "traces" / f"{_key(case)}.json")
            (out / "traces" / f"{_key(case)}.metrics.json").write_text(json.dumps(m.to_json(), indent=1))
            if best is None or case.measured.throughput > best[0]:
                best = (case.measured.throughput, mid.record, case)
            pred, meas = case.prediction.throughput, case.measured
            print(f"[{_key(case)}] predicted {pred:.1f}/s, measured {meas.throughput:.1f}/s "
                  f"({100 * (pred / meas.throughput - 1):+.1f}%; {meas.rounds} rounds {meas.throughput_range[0]:.1f}-"
                  f"{meas.throughput_range[1]:.1f}), bubble {100 * meas.bubble:.0f}% (predicted "
                  f"{100 * case.prediction.bubble:.0f}%), p50 {meas.latency_p50_us / 1e3:.2f} ms, load "
                  f"{meas.load[1]:.1f}" + (" [CPU-bound]" if case.prediction.cpu_bound else ""), flush=True)
    title = f"tvmpipe sweep: {bundle.name} ({backend})"
    timeline = [sp for sp in gantt_spans(best[1]) if sp[3] in best[1].done_times] if best else None
    paths = write_report(cases, out, title=title, timeline=timeline,
                         timeline_title=f"{_key(best[2])}, the fastest measured plan" if best else None,
                         runtime=model.runtime)
    for p in paths.values():
        print(f"wrote {p}")
    return 0 if any(c.measured for c in cases) else 1


def whatif_sweep(args: argparse.Namespace, bundle: Any, lo: int, hi: int, strategies: tuple[str, ...]) -> int:
    """`sweep --cluster`: plans for a described cluster, run by the event simulator (no processes)."""
    from tvmpipe.partition.cost import read_profile
    from tvmpipe.partition.hardware import load_cluster
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.report import write_report
    from tvmpipe.partition.sweep import simulate_cases, sweep_plans

    if args.backend != "simulated":
        raise TvmpipeError("--cluster describes hardware this machine does not have: use it with --backend simulated")
    cluster = load_cluster(args.cluster)
    speeds, caps, links = cluster.stages(min(hi, cluster.num_devices))
    model = PipelineModel.build(bundle, profile=read_profile(args.profile) if args.profile else None,
                                speeds=speeds, memory_caps=caps, links=links)
    n = 256 if args.micro_batches == "auto" else int(_number_or_auto(args.micro_batches, "--micro-batches", int, 1,
                                                                       "a count"))
    t0 = time.perf_counter()
    cases = sweep_plans(model, min(hi, cluster.num_devices), strategies, min_stages=lo, requests=n)
    runs = simulate_cases(model, cases, n)
    print(f"{cluster.describe()}\n{len(cases)} plans, {n} simulated micro-batches each, "
          f"{time.perf_counter() - t0:.2f} s", flush=True)
    for case in cases:
        if case.measured:
            print(f"[{_key(case)}] predicted {case.prediction.throughput:.1f}/s, simulated {case.measured.throughput:.1f}/s, "
                  f"bubble {100 * case.prediction.bubble:.1f}% (simulated {100 * case.measured.bubble:.1f}%)")
        else:
            print(f"[{_key(case)}] not planned: {(case.error or '').splitlines()[0]}")
    best = max((c for c in cases if c.measured), key=lambda c: c.measured.throughput, default=None)
    paths = write_report(cases, Path(args.output), title=f"what-if: {bundle.name} on {cluster.name}",
                         timeline=runs[id(best)].spans() if best else None, timeline_unit="us",
                         timeline_title=f"{_key(best)} (event simulation)" if best else None,
                         runtime=model.runtime, measured_label="simulated")
    for p in paths.values():
        print(f"wrote {p}")
    return 0 if best else 1
