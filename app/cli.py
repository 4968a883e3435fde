"""`tvmpipe run`, `tvmpipe sweep` and `tvmpipe inspect`: parse the command line, call the application layer, print.

`tvmpipe run --stages 2 --local` with no bundle runs the built-in example (examples/mlp, shipped
as `tvmpipe.examples`) on an embedded loopback-only Ray cluster, checks every output against a
single-process GraphRunner run, and prints a per-stage table. Ray and the pipeline are imported
only inside the commands, so `tvmpipe --help` stays fast on machines without them.
"""

from __future__ import annotations

import argparse
import json
import sys

from tvmpipe.app.args import COUNT, POSITIVE, add_cluster_args, cluster_options, number
from tvmpipe.app.sources import BUILTIN_EXAMPLE
from tvmpipe.bundle.inspect import SCHEMA
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.core.units import format_bytes

DEFAULT_MICRO_BATCHES = 16


def count_or_auto(convert, minimum: float, what: str):
    """An argparse `type` for 'N|auto' options: 'auto', or a number checked by `number`."""
    parse = number(convert, minimum, what=f"{what} or 'auto'")

    def parse_or_auto(text: str):
        return text if text == "auto" else parse(text)

    return parse_or_auto


def register(subparsers: argparse._SubParsersAction) -> None:
    r = subparsers.add_parser(
        "run", help="run a bundle as a pipeline of stages and check it against a single-process run",
        description="Run BUNDLE (default: the built-in examples/mlp) as K pipeline stages on Ray actors (or "
                    "local processes), stream micro-batches through it, compare every output with a "
                    "single-process GraphRunner run, and print per-stage and overall numbers. Exits 1 when "
                    "an output differs.")
    r.add_argument("bundle", nargs="?", help=f"bundle directory, or a built-in example's name "
                                             f"(default: '{BUILTIN_EXAMPLE}')")
    r.add_argument("--stages", "-k", type=COUNT, default=2, help="number of stages K (default 2)")
    r.add_argument("--plan", metavar="PLAN.json", help="plan from `tvmpipe partition -o` (overrides --stages)")
    r.add_argument("--strategy", choices=["equal", "optimal"], default="equal",
                   help="how to cut K stages without --plan (default equal op counts)")
    r.add_argument("--micro-batches", "-n", type=COUNT, default=DEFAULT_MICRO_BATCHES,
                   help=f"micro-batches to run (default {DEFAULT_MICRO_BATCHES})")
    r.add_argument("--inputs", metavar="IN.npz", help="graph inputs by name: the input's shape (used for every "
                   "micro-batch) or with a leading micro-batch axis (default: seeded random inputs)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs (micro-batch i uses seed+i)")
    r.add_argument("--save-outputs", metavar="OUT.npz", help="write outputs: output<k> with a micro-batch axis, "
                   "and micro_batch (kept for the completed micro-batches when the run fails)")
    r.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace and a Gantt PNG beside it")
    r.add_argument("--json", action="store_true", help="print a machine-readable summary instead of tables")
    r.add_argument("--check", choices=["streamed", "full", "none"], default="streamed",
                   help="how outputs are checked against a single-process run: streamed (default) runs it one "
                        "stage at a time, holding one stage's weights; full holds the whole model; none skips it")
    add_cluster_args(r)
    r.set_defaults(func=run_command)

    s = subparsers.add_parser(
        "sweep", help="run plans for 1..K stages and report predicted against measured",
        description="Plan BUNDLE for every stage count in the range and strategy, run each plan, and write a "
                    "report (markdown, CSV, plots, plans, traces) of predicted against measured throughput, "
                    "latency and bubble. With --backend simulated and no --profile, stage times come from the "
                    "simulated backend's own model, so predictions and runs use the same op times.")
    s.add_argument("bundle", help="bundle directory")
    s.add_argument("--stages", "-k", type=stage_range, default="1..4",
                   help="stage counts, e.g. 1..4 or 3 (default 1..4)")
    s.add_argument("--strategies", type=strategies, default="equal,optimal",
                   help="comma-separated: equal, optimal")
    s.add_argument("--micro-batches", "-n", type=count_or_auto(int, 1, "a count"), default="auto", metavar="N|auto",
                   help="micro-batches per round of each plan; 'auto' (default): ~0.1 s at the 1-stage rate, "
                        "32 to 2000")
    s.add_argument("--profile", metavar="PROFILE.json", help="per-node times (`tvmpipe profile --json`) for the "
                   "planner, and for the simulated backend")
    s.add_argument("--time-scale", type=POSITIVE, default=1.0,
                   help="simulated backend: multiply every op time (make stages long against transport overhead)")
    s.add_argument("--runtime", default="auto", metavar="auto|none|COSTS.json",
                   help="runtime costs in predictions (receive, send, Stage.run, driver; docs/partition.md): 'auto' "
                        "(default) calibrates them with a 1-stage zero-compute run; 'none' predicts an ideal "
                        "runtime; a JSON file of RuntimeCosts fields pins them")
    s.add_argument("--rounds", type=count_or_auto(int, 1, "a count"), default="auto", metavar="N|auto",
                   help="measured rounds per plan, each paired with a calibration round, reported as median and "
                        "min-max; 'auto' (default): ~3 s of rounds at the 1-stage rate, 5 to 40")
    s.add_argument("--measure-links", action="store_true",
                   help="probe latency and bandwidth between the Ray cluster's nodes through the data plane "
                        "(cluster/linkprobe.py), write links.json into the report and charge boundary frames "
                        "with them (needs --local or --address)")
    s.add_argument("--cluster", metavar="CLUSTER.json", help="what-if cluster (devices, speeds, memory, links; "
                   "docs/partition.md): with --backend simulated, plans run in the event simulator, not here")
    s.add_argument("-o", "--output", required=True, metavar="REPORT_DIR", help="report directory")
    add_cluster_args(s)
    s.set_defaults(func=sweep_command)


def stage_range(text: str) -> tuple[int, int]:
    """'K' or 'A..B' with 1 <= A <= B."""
    lo, _, hi = text.partition("..")
    try:
        lo_k, hi_k = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or A..B, e.g. 1..4, got {text!r}") from None
    if not 1 <= lo_k <= hi_k:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text!r}")
    return lo_k, hi_k


def strategies(text: str) -> tuple[str, ...]:
    from tvmpipe.partition.sweep import SWEEP_STRATEGIES

    names = tuple(s for s in text.split(",") if s)
    bad = [s for s in names if s not in SWEEP_STRATEGIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(SWEEP_STRATEGIES)}, "
                                         f"got {text!r}")
    return names


# ---- tvmpipe run -------------------------------------------------------------------------------------

def run_command(args: argparse.Namespace) -> int:
    from tvmpipe.app.connect import check_where
    from tvmpipe.app.run import PipelineRun, run_checked
    from tvmpipe.app.sources import check_forward_pass, choose_plan, micro_batches, resolve_bundle
    from tvmpipe.bundle import load_bundle

    options = cluster_options(args)
    check_where(options)
    path = resolve_bundle(args.bundle)
    bundle = load_bundle(path)
    check_forward_pass(bundle, "tvmpipe run")
    plan = choose_plan(bundle, args.plan, args.stages, args.strategy)
    batches = micro_batches(bundle, args.inputs, args.micro_batches, args.seed,
                            default_count=DEFAULT_MICRO_BATCHES, cycle=True)
    done = run_checked(PipelineRun(bundle, plan, batches, options), args.save_outputs, args.trace, args.check)
    run, m = done.run, done.metrics
    if args.json:
        print(json.dumps(done.summary(str(path)), indent=1))
        return 0 if not done.mismatches else 1
    print(f"tvmpipe run: {bundle.name} ({path}), {plan.num_stages} stage(s) ({plan.strategy}), backend {run.backend}, "
          f"{run.cluster.description}, {len(batches)} micro-batches, window {run.window}")
    print(m.table())
    print(f"throughput {m.throughput:.1f} micro-batches/s ({m.samples_per_s:.1f} samples/s; steady "
          f"state {m.steady_throughput:.1f}/s), latency p50 {m.latency_p50_ms:.3f} ms, "
          f"p99 {m.latency_p99_ms:.3f} ms, restarts {sum(m.restarts)}")
    if run.time_to_first_output is not None:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in run.startup_s.items())
        print(f"time to first output {run.time_to_first_output:.2f} s ({parts}); weights "
              f"{format_bytes(bundle.weight_bytes)} in all")
    for f in done.written:
        print(f"wrote {f}")
    print(f"checked: {done.checked}")
    if done.check == "none":
        print("outputs match single-process run: not checked")
        return 0
    verdict = "yes" if not done.mismatches else "NO"
    print(f"outputs match single-process run: {verdict} ({done.identical}/{len(batches)} micro-batches bit-identical)")
    for _, message in done.mismatches[:10]:
        print(f"  {message}", file=sys.stderr)
    return 0 if not done.mismatches else 1


# ---- tvmpipe sweep -----------------------------------------------------------------------------------

def sweep_command(args: argparse.Namespace) -> int:
    from tvmpipe.app.connect import check_where
    from tvmpipe.app.sources import check_forward_pass
    from tvmpipe.app.sweep import run_sweep
    from tvmpipe.bundle import load_bundle

    bundle = load_bundle(args.bundle)
    check_forward_pass(bundle, "tvmpipe sweep")
    say = lambda line: print(line, flush=True)  # noqa: E731
    if args.cluster:
        from tvmpipe.app.sweep import whatif_sweep

        if args.backend != "simulated":
            raise TvmpipeError("--cluster describes hardware this machine does not have: use it with "
                               "--backend simulated")
        cases, paths = whatif_sweep(bundle, args.output, args.cluster, stages=args.stages, strategies=args.strategies,
                                    micro_batches=args.micro_batches, profile=args.profile, say=say)
    else:
        options = cluster_options(args)
        check_where(options)
        if args.measure_links and options.processes:
            raise TvmpipeError("--measure-links probes the nodes of a Ray cluster: use it with --local or --address")
        cases, paths = run_sweep(bundle, args.output, options, stages=args.stages, strategies=args.strategies,
                                 micro_batches=args.micro_batches, profile=args.profile, time_scale=args.time_scale,
                                 runtime=args.runtime, rounds=args.rounds, measure_links=args.measure_links, say=say)
    for p in paths.values():
        print(f"wrote {p}")
    return 0 if any(c.measured for c in cases) else 1


# ---- inspect -------------------------------------------------------------------------------------

def _stages(bundle, args: argparse.Namespace) -> list[tuple[int, int]] | None:
    """The node ranges `inspect` is asked to show: a plan file's, or K equal-op stages, or None."""
    if args.plan:
        from tvmpipe.partition.plan import Plan

        return list(Plan.load(args.plan).stages)
    if args.stages:
        from tvmpipe.partition.plan import plan_equal_ops

        return list(plan_equal_ops(bundle.graph, args.stages).stages)
    return None


def register_inspect(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect", help="summarise a bundle or graph.json: nodes, kernels launched, fused ops",
        description="Show what a tvmpipe bundle (or a bare TVM graph.json) holds: a summary, then one row "
                    "per graph node with its inputs, outputs, storage id, the kernels it launches "
                    "(grid x block, shared memory) and the model ops fused into its function.")
    p.add_argument("path", help="bundle directory, its bundle.json, or a bare graph.json")
    p.add_argument("--params", metavar="FILE",
                   help="a bare graph.json's params file (.params as TVM <= 0.19 saved it, or .npz): "
                        "tells graph inputs from weights and shows the weight bytes of each node")
    p.add_argument("--json", action="store_true", help=f"print the report as JSON (schema {SCHEMA})")
    p.add_argument("--wide", action="store_true", help="do not shorten names to fit 100 columns")
    p.add_argument("--stages", "-k", type=int, metavar="K",
                   help="also show K stages (equal op counts, as `tvmpipe run --stages K` cuts) with the "
                        "weight bytes each loads")
    p.add_argument("--plan", metavar="PLAN.json", help="also show the stages of a plan (`tvmpipe partition -o`) "
                                                       "with the weight bytes each loads")
    p.set_defaults(func=inspect_command)


def inspect_command(args: argparse.Namespace) -> int:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.inspect import build_report, render_text, stage_weights

    bundle = load_bundle(args.path, params=args.params)
    report = build_report(bundle)
    stages = _stages(bundle, args)
    if stages is not None:
        report["stages"] = stage_weights(bundle, stages)
    text = json.dumps(report, indent=2) + "\n" if args.json else render_text(report, wide=args.wide)
    sys.stdout.write(text)
    return 0
