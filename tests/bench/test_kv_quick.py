"""bench/kv.py --quick (issue 53: a decode step's time against the tokens it holds, static against
paged, reference backend) runs here end to end and writes its result, so it cannot rot; the times
themselves are recorded from a full run (docs/paged-kv.md), not asserted on a shared CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tvm
ROOT = Path(__file__).resolve().parents[2]


def test_kv_bench_quick(tmp_path):
    pytest.importorskip("tvm")
    pytest.importorskip("transformers")
    out = tmp_path / "kv.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kv.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["step_ms"]) == {"static", "paged"}
    assert all(set(v) == {"64", "256"} and all(t > 0 for t in v.values()) for v in res["step_ms"].values())
    assert res["commit"] and res["tokens_held"] == 64
