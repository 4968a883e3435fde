"""bench/paged_gpu.py (issue 53: the paged kernels' launch lists on a GPU) runs on the CPU up to the
device: kernels built, every launch's argument buffer packed and read back as its operands' pointers,
the oracle's results computed; without a GPU it says so and exits 0, so it cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tvm
ROOT = Path(__file__).resolve().parents[2]


def test_paged_gpu_bench_dry_run(tmp_path):
    pytest.importorskip("tvm")
    out = tmp_path / "paged.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "paged_gpu.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["launches"] == {c: {"paged_decode": 1, "paged_prefill": 1, "paged_append": 1}
                               for c in ("gqa4_fp16", "mha_fp32")}
    assert "checks" not in res  # nothing claimed without a device
