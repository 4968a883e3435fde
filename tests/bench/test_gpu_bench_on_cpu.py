"""bench/gpu_pipeline.py runs end to end on the CPU (reference backend), so it cannot rot between GPU
runs (issue 12, defect 2: its single-process oracle call raised TypeError and nothing was measured)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_pipeline_bench_smoke(tmp_path):
    out = tmp_path / "gp.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_pipeline.py"), str(ROOT / "examples" / "mlp"),
                        "--backend", "reference", "--stages", "1,2", "--micro-batches", "4", "--distinct", "2",
                        "--runner-repeat", "3", "--plan", "equal", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    runs = res["models"][0]["runs"][0]
    assert "error" not in runs, runs.get("error")
    assert [p["stages"] for p in runs["pipelines"]] == [1, 2]
    assert all(p["check"]["exact"] for p in runs["pipelines"]) and res["all_exact"]
