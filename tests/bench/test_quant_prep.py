"""The GPU kit's int4 decode steps (issue 52), prepared on the CPU: bench/real_bundles.py
`--quantize-models` compiles a model's `--quantize int4` steps beside its float16 ones, leaves the
packed fields out with the weights (generated on the GPU host: codes 0, random scales), and
`materialize` writes them so the reference backend steps the bundle; decode_real's
`int4_over_fp16` pairs each int4 bundle with the float16 one of the same model, context and batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tvm")
pytest.importorskip("gguf")
pytestmark = pytest.mark.tvm

ROOT = Path(__file__).resolve().parents[2]


def test_real_bundles_prepares_int4_steps_that_materialize_and_step(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import decode_real
        import real_bundles

        real = tmp_path / "real"
        prep = real_bundles.prepare(real, ["tiny"], [(16, 1)], tmp_path / "ckpt", children=False,
                                    quantized=("tiny",))
        from tvmpipe.bundle import load_bundle
        from tvmpipe.bundle.params import load_npz
        from tvmpipe.executor.decode_loop import DecodeLoop

        q = real / "tiny-int4" / "T16_b1"
        b = load_bundle(q)
        packed = real_bundles.packed_params(b.manifest.source)
        assert b.manifest.dtype == "float16" and b.manifest.source["quantize"]["scheme"] == "int4" and packed
        consts = load_npz(q.with_name(q.name + real_bundles.CONSTANTS))
        assert not packed & set(consts)  # the codes and scales are generated there, not carried
        fp16 = prep["models"]["tiny"]["bundles"]
        assert fp16["T16_b1_int4"]["weights_left_out_bytes"] < 0.4 * fp16["T16_b1"]["weights_left_out_bytes"]
        path = real_bundles.materialize(q, tmp_path / "w" / q.name, {})
        loop = DecodeLoop(path)
        assert np.isfinite(loop.step([1])).all() and np.isfinite(loop.step([2])).all()
        loop.runner.close()
        assert set(real_bundles.bundles_in(real)) == {"tiny", "tiny-int4"}
        run = lambda tps: {"batch": 1, "max_context": 16, "weight_bytes": 100, "runs": [  # noqa: E731
            {"stages": 1, "in_flight": 1, "tokens_per_s": tps}]}
        got = decode_real.int4_over_fp16({"models": {"tiny": {"bundles": {"T16_b1": run(100.0)}},
                                                     "tiny-int4": {"bundles": {"T16_b1": run(260.0)}}}})
        assert [r["ratio"] for r in got["rows"]] == [2.6] and got["met"] is True
        assert decode_real.int4_over_fp16({"models": {"tiny": {"bundles": {"T16_b1": run(100.0)}}}}) is None
    finally:
        sys.path.remove(str(ROOT / "bench"))
