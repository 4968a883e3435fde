"""The reference backend against TVM's own CPU execution of the same fused functions
(compiler/cpucheck.py), on every built-in model, compiled on the fly.

Tolerance: |ref - tvm| <= 1e-5 * max(1, max|tvm|) + 1e-5 * |tvm| elementwise (cpucheck.compare):
both compute in float32 with different summation orders. The compiled bundles also go through
splits (bit-identical) and the fake-device launch check, since they are the real launch lists.
"""

from __future__ import annotations

import pytest

from tests.support.recording_device import check_stage_launches
from tvmpipe.executor import GraphRunner, Stage, feeds_by_entry, random_inputs

pytestmark = pytest.mark.tvm
pytest.importorskip("tvm")

MODELS = ["mlp", "cnn", pytest.param("resnet18", marks=pytest.mark.slow),
          pytest.param("transformer", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=MODELS)
def compiled(request, tmp_path_factory):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.export import export

    ex = export(request.param, seed=0)
    return ex, load_bundle(ex.write(tmp_path_factory.mktemp(request.param) / request.param))


def test_reference_matches_tvm_cpu(compiled):
    from tvmpipe.compiler.cpucheck import CpuRunner, compare

    ex, bundle = compiled
    inputs = random_inputs(bundle, seed=1)
    want = CpuRunner.build(ex.unscheduled).run(ex.graph, inputs, ex.params)
    r = GraphRunner(bundle)
    r.run(**inputs)
    assert r.get_num_outputs() == len(want)
    for i, w in enumerate(want):
        compare(r.get_output(i), w, rtol=1e-5, atol_scale=1e-5)


def test_compiled_splits_bit_identical(compiled):
    _, bundle = compiled
    n = len(bundle.graph.nodes)
    feeds = feeds_by_entry(bundle, random_inputs(bundle, seed=2))
    whole = Stage(bundle, 0, n).run(feeds)
    ops = bundle.graph.op_nodes
    for cut in sorted({ops[len(ops) // 4], ops[len(ops) // 2], ops[3 * len(ops) // 4]}):
        values = dict(feeds)
        for a, b in ((0, cut), (cut, n)):
            s = Stage(bundle, a, b)
            values.update(s.run({e: values[e] for e in s.program.feed_entries}))
        for h in bundle.graph.head_entries:
            assert values[h].tobytes() == whole[h].tobytes()


def test_compiled_launch_lists_on_fake_device(compiled, fake_cuda, monkeypatch):
    import os

    _, bundle = compiled
    monkeypatch.setenv("FAKE_PYCUDA_BUNDLES", os.pathsep.join([os.environ["FAKE_PYCUDA_BUNDLES"], str(bundle.path)]))
    n = len(bundle.graph.nodes)
    ops = bundle.graph.op_nodes
    check_stage_launches(bundle, 0, n)
    check_stage_launches(bundle, ops[len(ops) // 2], n)


@pytest.mark.parametrize("case", ["gather_elements", "gather_elements_neg_axis", "gather_nd", "gather_nd_batch",
                                  "take_wrap", "take_clip", "take_nan"])
def test_gather_ops_match_tvm_cpu(case):
    """The reference's gathers against TVM's legalized ops built for LLVM, on in-range indices
    (and, for take's wrap/clip/nan modes, out-of-range ones that the mode defines)."""
    import numpy as np
    import tvm
    from tvm import relax

    from tests.executor.test_reference_ops import apply

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    op, attrs, idx = {
        "gather_elements": ("gather_elements", {"axis": 1}, rng.integers(0, 3, (2, 5, 4))),
        "gather_elements_neg_axis": ("gather_elements", {"axis": -1}, rng.integers(0, 4, (1, 3, 6))),
        "gather_nd": ("gather_nd", {"batch_dims": 0}, np.stack([rng.integers(0, 2, (5,)), rng.integers(0, 3, (5,))], -1)),
        "gather_nd_batch": ("gather_nd", {"batch_dims": 1}, rng.integers(0, 3, (2, 4, 1))),
        "take_wrap": ("take", {"axis": 2, "mode": "wrap"}, np.array([[-1, 5], [2, -6]])),
        "take_clip": ("take", {"axis": 2, "mode": "clip"}, np.array([[-1, 5], [2, -6]])),
        "take_nan": ("take", {"axis": 2, "mode": "nan"}, np.array([[-1, 3], [2, 4]])),
    }[case]
    idx = idx.astype(np.int64)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(list(x.shape), "float32"))
    iv = relax.Var("i", relax.TensorType(list(idx.shape), "int64"))
    with bb.function("main", [xv, iv]):
        call = {"gather_elements": lambda: relax.op.gather_elements(xv, iv, attrs.get("axis", 0)),
                "gather_nd": lambda: relax.op.gather_nd(xv, iv, attrs.get("batch_dims", 0)),
                "take": lambda: relax.op.take(xv, iv, attrs.get("axis"), attrs.get("mode", "fast"))}[op]()
        bb.emit_func_output(bb.emit(call))
    mod = relax.transform.LegalizeOps()(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    want = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(idx)).numpy()
    got = apply(op, attrs, x, idx)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
