"""bench/gpu_pipeline.py runs end to end on the CPU (reference backend), so it cannot rot between GPU
runs (issue 12, defect 2: its single-process oracle call raised TypeError and nothing was measured)."""

from __future__ import annotations

from tests.support.commands import run_bench
from tests.support.paths import EXAMPLES_DIR


def test_gpu_pipeline_bench_smoke(tmp_path):
    res = run_bench("gpu_pipeline.py", str(EXAMPLES_DIR / "mlp"), "--backend", "reference", "--stages", "1,2",
                    "--micro-batches", "4", "--distinct", "2", "--runner-repeat", "3", "--plan", "equal",
                    out=tmp_path / "gp.json", timeout=300)
    runs = res["models"][0]["runs"][0]
    assert "error" not in runs, runs.get("error")
    assert [p["stages"] for p in runs["pipelines"]] == [1, 2]
    assert all(p["check"]["exact"] for p in runs["pipelines"]) and res["all_exact"]
