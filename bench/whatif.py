"""What-if benchmark: a 700-op transformer-shaped graph on described clusters (examples/clusters/),
K up to the cluster's devices (64 for a10-16x4), planned, predicted and run by the event simulator
through `tvmpipe sweep --backend simulated --cluster`. Target: each cluster's whole sweep in seconds.

Run: python bench/whatif.py [OUT_DIR]   (writes bench/results/whatif.json; reports under OUT_DIR,
default a temporary directory)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import synthetic_transformer  # noqa: E402
from stamp import stamp  # noqa: E402  (when, commit, machine: bench/perfpage.py reads them)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "whatif.json"
CLUSTERS = ["h100-2x4", "a10-4x4", "a10-16x4"]
TARGET_S = 10.0  # whole sweep per cluster, CLI start-up and plots included: "in seconds"


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="tvmpipe-whatif-"))
    out.mkdir(parents=True, exist_ok=True)
    graph, profile = synthetic_transformer(700)
    (out / "graph.json").write_text(json.dumps(graph))
    (out / "profile.json").write_text(json.dumps(profile))
    rows = []
    for name in CLUSTERS:
        spec = REPO / "examples" / "clusters" / f"{name}.json"
        devices = json.loads(spec.read_text())["nodes"][0]
        k = devices["devices"] * devices.get("count", 1)
        cmd = [sys.executable, "-m", "tvmpipe.cli", "sweep", str(out / "graph.json"), "--stages", f"1..{k}",
               "--strategies", "optimal", "--backend", "simulated", "--cluster", str(spec), "--profile",
               str(out / "profile.json"), "-o", str(out / name)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"{name}: {proc.stderr or proc.stdout}")
        with open(out / name / "sweep.csv") as f:
            import csv

            cases = list(csv.DictReader(f))
        best = max(cases, key=lambda r: float(r["pred_throughput"] or 0))
        worst = max(abs(float(r["meas_throughput"]) / float(r["pred_throughput"]) - 1) for r in cases)
        rows.append({"cluster": name, "max_stages": k, "sweep_s": wall, "under_target": wall < TARGET_S,
                     "best_k": int(best["stages"]), "best_throughput": float(best["pred_throughput"]),
                     "max_sim_vs_pred": worst})
        print(f"{name:>10}: K 1..{k:<2} in {wall:5.1f} s; best K = {best['stages']} at "
              f"{float(best['pred_throughput']):.0f}/s; simulated vs predicted within {100 * worst:.2f} %")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(stamp({"target_s": TARGET_S, "reports": str(out), "rows": rows}), indent=1) + "\n")
    print(f"reports under {out}; results in {RESULTS}")


if __name__ == "__main__":
    main()
