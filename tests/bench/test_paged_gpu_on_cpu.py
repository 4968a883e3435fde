"""bench/paged_gpu.py (issue 53: the paged kernels' launch lists on a GPU) runs on the CPU up to the
device: kernels built, every launch's argument buffer packed and read back as its operands' pointers,
the oracle's results computed; without a GPU it says so and exits 0, so it cannot rot between GPU runs."""

from __future__ import annotations

import pytest

from tests.support.commands import run_bench

pytestmark = pytest.mark.tvm


def test_paged_gpu_bench_dry_run(tmp_path):
    pytest.importorskip("tvm")
    res = run_bench("paged_gpu.py", "--dry-run", out=tmp_path / "paged.json", timeout=300)
    assert res["launches"] == {c: {"paged_decode": 1, "paged_prefill": 1, "paged_append": 1}
                               for c in ("gqa4_fp16", "mha_fp32")}
    assert "checks" not in res  # nothing claimed without a device
