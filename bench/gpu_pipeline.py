"""Pipelines on one GPU: K process-launched stages against the single-process run (issue 8).

    python bench/gpu_pipeline.py [BUNDLE ...] [--backend cuda] [--stages 1,2,3,4] [--graphs both]
                                 [--micro-batches 200] [--plan optimal] [--out FILE]

Without a GPU (no pycuda, driver or device) it prints why and exits 0, as bench/executor_gpu.py
does, so `make bench` passes on CPU machines; --require-gpu makes that exit 1 (bench/gpu_check.sh).

For each model and each K, a `Pipeline(..., launcher="process")`: K StageWorker child processes on
this machine (no Ray), all on GPU 0 with the cuda backend. For each it records

- exactness: every micro-batch's outputs against a single GraphRunner run of the same inputs in a
  worker-like process (app/oracle.py), byte for byte. Any difference fails the run;
- throughput (micro-batches/s over the timed run, and steady state between first and last
  completion), against the 1-stage pipeline and against the in-process GraphRunner loop;
- per stage: busy, bubble (fill + drain) and idle fractions, mean compute time (cluster/metrics.py),
  and the partition layer's prediction for the same plan.

Plans: `optimal` (default) profiles the model on the same backend in this process and plans with
the measured node times (partition.plan_optimal); `equal` splits op counts evenly. CUDA graphs:
`--graphs off|on|both` runs the stages (and the single-process oracle) without / with graph replay.
On one GPU the stages' kernels share the device (one context per process, time-sliced, no MPS), so
a pipeline can gain only by overlapping the host side (copies, Python, transport) with kernels.

Without arguments: examples/mlp, examples/cnn and .gpu/bundles/{resnet18,transformer} where present
(bench/gpu_prep.sh compiles those). `--backend reference` runs the same code on the CPU (a smoke
test of this script; its numbers mean nothing for a GPU). Results: bench/results/gpu_pipeline.json
for the cuda backend, else a temporary file unless --out is given; written after every model, so an
interrupted run keeps what it measured. Exit status 1 if any output differs or any run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gate import no_gpu_exit  # noqa: E402
from stamp import stamp  # noqa: E402  (when, commit, machine: bench/perfpage.py reads them)

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEFAULT_MODELS = ("examples/mlp", "examples/cnn", ".gpu/bundles/resnet18", ".gpu/bundles/transformer")


def gpu_info() -> dict[str, Any]:
    """nvidia-smi's view of GPU 0 (name, driver, memory), or why there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"error": "nvidia-smi not found"}
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"nvidia-smi: {exc}"}
    lines = [l.strip() for l in out.stdout.splitlines() if l.strip()]
    if out.returncode != 0 or not lines:
        return {"error": f"nvidia-smi exit {out.returncode}: {out.stderr.strip()[-300:]}"}
    name, driver, mem = (s.strip() for s in (lines[0].split(",") + ["", "", ""])[:3])
    return {"name": name, "driver": driver, "memory": mem, "count": len(lines)}


def make_batches(bundle, distinct: int) -> list[dict[str, np.ndarray]]:
    from tvmpipe.executor import random_inputs

    return [random_inputs(bundle, seed=1000 + i) for i in range(distinct)]


def runner_us(bundle, backend: str, opts: dict, batches: list, repeat: int) -> dict[str, float]:
    """Median and min time of one in-process GraphRunner.run() (the pipeline's single-GPU baseline)."""
    from tvmpipe.executor import GraphRunner

    with GraphRunner(bundle, backend=backend, **opts) as r:
        for mb in batches[:3]:  # warm-up (and the graph capture, with replay)
            r.run(**mb)
        times = []
        for i in range(repeat):
            mb = batches[i % len(batches)]
            t = time.perf_counter()
            r.run(**mb)
            times.append(time.perf_counter() - t)
    return {"median_us": statistics.median(times) * 1e6, "min_us": min(times) * 1e6, "repeat": repeat}


def node_profile(bundle, backend: str, repeat: int) -> dict[str, Any]:
    from tvmpipe.executor import GraphRunner, random_inputs

    with GraphRunner(bundle, backend=backend) as r:
        r.set_input(**random_inputs(bundle))
        return r.profile(repeat=repeat).to_json()


def make_plans(bundle, ks: list[int], how: str, backend: str, micro_batches: int) -> tuple[dict[int, Any], dict]:
    """K -> Plan (with the partition layer's prediction attached), and notes on how they were made."""
    from tvmpipe.partition import PipelineModel, make_plan

    notes: dict[str, Any] = {"requested": how}
    model = None
    if how == "optimal":
        try:
            prof = node_profile(bundle, backend, repeat=20 if backend == "cuda" else 2)
            model = PipelineModel.build(bundle, cost="measured", profile=prof)
            notes.update(used="optimal", profile_run_us=prof.get("run_us"),
                         profile_kernel_us=prof.get("kernel_total_us"))
        except Exception as exc:  # noqa: BLE001 - fall back to equal op counts, and say so
            notes.update(used="equal", fallback_reason=f"{type(exc).__name__}: {exc}")
            how = "equal"
    if model is None:
        model = PipelineModel.build(bundle)  # analytic / uniform: only for the prediction
        notes.setdefault("used", "equal")
    plans = {}
    for k in ks:
        try:
            plans[k] = make_plan(model, k, how, requests=micro_batches)
        except Exception as exc:  # noqa: BLE001 - this K with equal op counts instead, and say so
            notes.setdefault("equal_instead", {})[k] = f"{type(exc).__name__}: {exc}"
            plans[k] = make_plan(model, k, "equal", requests=micro_batches)
    notes["cost_model"] = model.costs.source
    return plans, notes


def compare(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> dict[str, Any]:
    """Byte equality of every output of every micro-batch; want[i % len(want)] is micro-batch i's."""
    bad, worst = [], 0.0
    for i, outs in enumerate(got):
        ref = want[i % len(want)]
        if len(outs) != len(ref):
            bad.append(i)
            continue
        for a, b in zip(outs, ref):
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                bad.append(i)
                if a.shape == b.shape and a.dtype.kind == "f" and b.dtype.kind == "f":
                    worst = max(worst, float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
                break
    return {"exact": not bad, "micro_batches": len(got), "mismatched": len(bad),
            "first_mismatch": bad[0] if bad else None,
            "max_abs_diff": worst}


def timed_metrics(pipe, first: int, n: int) -> dict[str, Any]:
    """cluster metrics over micro-batches [first, first+n) only (the warm-up ones are left out)."""
    from tvmpipe.cluster.metrics import compute_metrics

    rec = pipe.record()
    keep = range(first, first + n)
    rec = dataclasses.replace(rec, submit_times={s: rec.submit_times[s] for s in keep if s in rec.submit_times},
                              done_times={s: rec.done_times[s] for s in keep if s in rec.done_times})
    m = compute_metrics(rec)
    stages = [{"stage": s.stage, "nodes": list(s.nodes), "ops": s.ops, "micro_batches": s.micro_batches,
               "compute_ms_mean": s.compute_ms_mean, "busy": s.busy, "bubble": s.bubble, "idle": s.idle,
               "build_s": s.build_s} for s in m.stages]
    return {"throughput": m.throughput, "steady_throughput": m.steady_throughput, "samples_per_s": m.samples_per_s,
            "wall_s": m.wall_s, "latency_p50_ms": m.latency_p50_ms, "latency_p99_ms": m.latency_p99_ms,
            "mean_idle_fraction": m.bubble, "per_stage": stages, "restarts": m.restarts, "errors": m.errors}


def run_pipeline(bundle, plan, backend: str, opts: dict, batches: list, n: int,
                 window: int | None) -> tuple[dict, list]:
    from tvmpipe.cluster.driver import Pipeline

    t0 = time.perf_counter()
    with Pipeline(bundle, plan, backend=backend, backend_opts=opts, launcher="process", window=window) as pipe:
        start_s = time.perf_counter() - t0
        warm = min(len(batches), 2 * pipe.window)
        pipe.run(batches[:warm])
        first = warm
        todo = [batches[i % len(batches)] for i in range(n)]
        t1 = time.perf_counter()
        outs = pipe.run(todo)
        run_s = time.perf_counter() - t1
        row = timed_metrics(pipe, first, n)
        row.update(window=pipe.window, start_s=start_s, run_s=run_s, driver_throughput=n / run_s)
    return row, outs


def bench_model(path: Path, args, graphs_modes: list[bool], result: dict) -> bool:
    """Everything for one model; appends to result["models"] as it goes. False if anything failed."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.app.oracle import reference_outputs

    b = load_bundle(path)
    n_ops = len(b.graph.op_nodes)
    ks = [k for k in args.stages if k <= n_ops]
    row: dict[str, Any] = {"model": b.name, "path": str(path), "op_nodes": n_ops,
                           "batch": b.manifest.batch if b.manifest else None,
                           "stages_skipped": [k for k in args.stages if k > n_ops], "runs": []}
    result["models"].append(row)
    ok = True
    batches = make_batches(b, min(args.distinct, args.micro_batches))
    try:
        plans, row["planning"] = make_plans(b, ks, args.plan, args.backend, args.micro_batches)
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"planning: {type(exc).__name__}: {exc}"
        print(f"  {b.name}: planning failed: {exc}", flush=True)
        return False
    for graphs in graphs_modes:
        opts = {"graphs": True} if graphs else {}
        mode = {"graphs": graphs}
        try:
            want = reference_outputs(path, batches, backend=args.backend, backend_opts=opts)
            mode["single_process"] = runner_us(b, args.backend, opts, batches, args.runner_repeat)
        except Exception as exc:  # noqa: BLE001 - no oracle: nothing below can be checked
            mode["error"] = f"single process: {type(exc).__name__}: {exc}"
            row["runs"].append(mode)
            print(f"  {b.name} graphs={graphs}: single-process run failed: {exc}", flush=True)
            ok = False
            continue
        mode["pipelines"] = []
        row["runs"].append(mode)
        for k in ks:
            plan = plans[k]
            entry: dict[str, Any] = {"stages": k, "plan": [list(s) for s in plan.stages],
                                     "predicted": {key: plan.predicted.get(key) for key in
                                                   ("throughput", "bubble", "bottleneck_us", "stage_time_us")}}
            try:
                measured, outs = run_pipeline(b, plan, args.backend, opts, batches, args.micro_batches, args.window)
                entry.update(measured)
                entry["check"] = compare(outs, want)
                ok &= entry["check"]["exact"]
            except Exception as exc:  # noqa: BLE001
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc()[-2000:]
                ok = False
            mode["pipelines"].append(entry)
            one = next((p for p in mode["pipelines"] if p["stages"] == 1 and "throughput" in p), None)
            if one and "throughput" in entry:
                entry["speedup_vs_1_stage"] = entry["throughput"] / one["throughput"]
            if "throughput" in entry:
                per_mb = mode["single_process"]["median_us"] * 1e-6
                entry["vs_in_process_runner"] = entry["throughput"] * per_mb
            if "check" in entry:
                status = "exact" if entry["check"]["exact"] else "MISMATCH"
            else:
                status = f"FAILED: {entry['error']}"
            thr = f"{entry['throughput']:.1f} mb/s" if "throughput" in entry else "-"
            print(f"  {b.name} graphs={graphs} K={k}: {thr}  {status}", flush=True)
    return ok


def print_table(result: dict) -> None:
    print(f"\n{result['device'].get('name') or result['backend']}  (backend {result['backend']}, "
          f"{result['micro_batches']} micro-batches per run)")
    print(f"{'model':<13}{'graphs':>7}{'K':>3}{'mb/s':>10}{'steady':>10}{'x K=1':>7}{'x runner':>9}{'idle':>6}"
          f"  per-stage busy/bubble/idle  exact")
    for m in result["models"]:
        for mode in m["runs"]:
            for p in mode.get("pipelines", []):
                if "throughput" not in p:
                    print(f"{m['model']:<13}{str(mode['graphs']):>7}{p['stages']:>3}  failed: {p.get('error')}")
                    continue
                st = " ".join(f"{s['busy']:.2f}/{s['bubble']:.2f}/{s['idle']:.2f}"
                              for s in p["per_stage"] if s["busy"] is not None)
                print(f"{m['model']:<13}{str(mode['graphs']):>7}{p['stages']:>3}{p['throughput']:>10.1f}"
                      f"{p['steady_throughput']:>10.1f}{p.get('speedup_vs_1_stage', float('nan')):>7.2f}"
                      f"{p['vs_in_process_runner']:>9.2f}{p['mean_idle_fraction'] or 0:>6.2f}"
                      f"  {st}  {p['check']['exact']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="*", help="bundle directories (default: the built-in models present)")
    ap.add_argument("--backend", default="cuda", help="stage backend (cuda; reference for a CPU smoke run)")
    ap.add_argument("--stages", default="1,2,3,4", help="stage counts to run, comma-separated (default 1,2,3,4)")
    ap.add_argument("--graphs", choices=["off", "on", "both"], default=None,
                    help="CUDA-graph replay in the stages (default: both on cuda, off elsewhere)")
    ap.add_argument("--micro-batches", type=int, default=200, help="timed micro-batches per pipeline (default 200)")
    ap.add_argument("--distinct", type=int, default=32, help="distinct inputs, cycled (default 32)")
    ap.add_argument("--window", type=int, default=None, help="micro-batches in flight (default 2*K)")
    ap.add_argument("--plan", choices=["optimal", "equal"], default="optimal")
    ap.add_argument("--runner-repeat", type=int, default=100, help="timed in-process GraphRunner runs (default 100)")
    ap.add_argument("--out", default=None, help="result JSON (default: see above)")
    ap.add_argument("--require-gpu", action="store_true",
                    help="with --backend cuda: fail (exit 1) without a GPU instead of skipping (exit 0)")
    args = ap.parse_args()
    args.stages = sorted({int(s) for s in args.stages.split(",") if s.strip()})
    if not args.stages or min(args.stages) < 1 or args.micro_batches < 1 or args.distinct < 1:
        ap.error("stages, micro-batches and distinct must be positive")
    graphs = args.graphs or ("both" if args.backend == "cuda" else "off")
    if graphs != "off" and args.backend != "cuda":
        ap.error("--graphs on/both needs --backend cuda")
    modes = {"off": [False], "on": [True], "both": [False, True]}[graphs]
    if args.backend == "cuda" and (status := no_gpu_exit("gpu_pipeline", args.require_gpu)) is not None:
        return status
    paths = [Path(p) for p in args.bundles] or [REPO / p for p in DEFAULT_MODELS
                                                 if (REPO / p / "bundle.json").is_file()]
    if args.out:
        out = Path(args.out)
    elif args.backend == "cuda":
        out = RESULTS / "gpu_pipeline.json"
    else:
        out = Path(tempfile.gettempdir()) / f"gpu_pipeline_{args.backend}.json"

    result: dict[str, Any] = {
        "benchmark": "gpu_pipeline", "backend": args.backend, "launcher": "process",
        "device": (gpu_info() if args.backend == "cuda"
                   else {"name": None, "note": f"{args.backend} backend on the CPU"}),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": args.stages, "graphs": graphs, "plan": args.plan,
        "micro_batches": args.micro_batches, "distinct_inputs": args.distinct, "window": args.window or "2*K",
        "models": [], "complete": False}
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(stamp(result), indent=1, default=str) + "\n")

    ok = True
    if not paths:
        result["error"] = "no bundles found"
        ok = False
    for p in paths:
        print(f"{p}:", flush=True)
        try:
            ok &= bench_model(p, args, modes, result)
        except Exception as exc:  # noqa: BLE001 - one model's failure must not hide the others
            result["models"].append({"path": str(p), "error": f"{type(exc).__name__}: {exc}",
                                     "traceback": traceback.format_exc()[-2000:]})
            print(f"  failed: {exc}", flush=True)
            ok = False
        save()
    result["complete"] = True
    result["all_exact"] = ok
    save()
    print_table(result)
    print(f"wrote {out}")
    if not ok:
        print("gpu_pipeline: some run failed or differed from the single-process run (see the JSON)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
