"""Reference backend speed on CPU: median GraphRunner.run() time per built-in model.

Run: python bench/reference_cpu.py [BUNDLE ...]   (writes bench/results/reference_cpu.json)
Without arguments: examples/mlp, examples/cnn and, when TVM is installed, every built-in model
compiled on the fly. The reference backend is an oracle, not a runtime; this shows what a
CPU-only pipeline test or `tvmpipe profile` costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from tvmpipe.bundle import Bundle, load_bundle
from tvmpipe.executor import GraphRunner, random_inputs

from stamp import stamp  # when, commit, machine: bench/perfpage.py reads them

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
BUILTINS = ("mlp", "cnn", "resnet18", "transformer")


def benchmark_bundles(paths: list[str]) -> list[Bundle]:
    """`paths` if given; else the built-in models: examples/<name> where present, the others
    compiled into a temporary directory when TVM is installed (about 30 s on 2 cores)."""
    if paths:
        return [load_bundle(p) for p in paths]
    found = {n: REPO / "examples" / n for n in BUILTINS if (REPO / "examples" / n / "bundle.json").is_file()}
    missing = [n for n in BUILTINS if n not in found]
    if missing:
        try:
            from tvmpipe.compiler.export import compile_model, require_tvm

            require_tvm()
        except Exception as exc:  # no compile extra: benchmark what exists
            print(f"(not compiling {', '.join(missing)}: {exc})")
        else:
            tmp = Path(tempfile.mkdtemp(prefix="tvmpipe-bench-"))
            for n in missing:
                found[n] = compile_model(n, tmp / n)
    return [load_bundle(found[n]) for n in BUILTINS if n in found]


def time_runs(fn, repeat: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="*")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for b in benchmark_bundles(args.bundles):
        r = GraphRunner(b)
        r.set_input(**random_inputs(b))
        times = time_runs(r.run, args.repeat)
        prof = r.profile(repeat=3)
        top = sorted(prof.nodes, key=lambda n: -n.time_us)[:3]
        rows.append({"model": b.name, "op_nodes": len(b.graph.op_nodes), "median_ms": statistics.median(times) * 1e3,
                     "min_ms": min(times) * 1e3, "slowest_nodes": [(n.name, ",".join(n.ops), round(n.time_us)) for n in top]})
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (timings scale with it)")
    print(f"{'model':<14} {'op nodes':>8} {'median ms':>10} {'min ms':>8}  slowest nodes (us)")
    for row in rows:
        slow = "; ".join(f"{name} [{ops}] {us}" for name, ops, us in row["slowest_nodes"])
        print(f"{row['model']:<14} {row['op_nodes']:>8} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f}  {slow}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "reference_cpu", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                     "python": platform.python_version(),
                                                     "load_average_1min": os.getloadavg()[0]},
           "repeat": args.repeat, "models": rows}
    (RESULTS / "reference_cpu.json").write_text(json.dumps(stamp(out), indent=1) + "\n")
    print(f"wrote {RESULTS / 'reference_cpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
