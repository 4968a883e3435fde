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
