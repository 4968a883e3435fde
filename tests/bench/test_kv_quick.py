"""bench/kv.py --quick (issue 53: a decode step's time against the tokens it holds, static against
paged, reference backend) runs here end to end and writes its result, so it cannot rot; the times
themselves are recorded from a full run (docs/paged-kv.md), not asserted on a shared CPU."""

from __future__ import annotations

import pytest

from tests.support.commands import run_bench

pytestmark = pytest.mark.tvm


def test_kv_bench_quick(tmp_path):
    pytest.importorskip("tvm")
    pytest.importorskip("transformers")
    res = run_bench("kv.py", "--quick", out=tmp_path / "kv.json")
    assert set(res["step_ms"]) == {"static", "paged"}
    assert all(set(v) == {"64", "256"} and all(t > 0 for t in v.values()) for v in res["step_ms"].values())
    assert res["commit"] and res["tokens_held"] == 64
