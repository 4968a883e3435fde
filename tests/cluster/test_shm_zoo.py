"""Shared memory and TCP give byte-identical outputs on the zoo subset too (issue 27): published
architectures compiled at test time (a CNN through ONNX, BERT and GPT-2 through torch.export) run
as K = 2 and 3 process pipelines with every data edge forced onto each path."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.pipeline_harness import assert_bit_identical, case

from tvmpipe.cluster.wire import shm
from tvmpipe.cluster.driver import Pipeline

pytest.importorskip("tvm")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]

SUBSET = [("mobilenet_v2", "onnx"), ("bert_mask", "pt2"), ("gpt2", "pt2")]


@pytest.fixture(scope="module")
def zoo_bundle(tmp_path_factory):
    from tvmpipe.compiler import zoo
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    def get(name: str, kind: str):
        work = tmp_path_factory.mktemp(f"{name}-{kind}")
        source, _, _ = zoo.export_model(zoo.get_zoo_model(name), kind, work, 0)
        return str(export(str(source), progress=Progress(stream=None), name=f"{name}-{kind}").write(Path(work) / "bundle"))

    return get


@pytest.mark.parametrize("name,kind", SUBSET, ids=[f"{n}-{k}" for n, k in SUBSET])
def test_zoo_models_are_byte_identical_over_shm_and_tcp(zoo_bundle, name, kind):
    bundle = zoo_bundle(name, kind)
    inputs, want = case(bundle, 4)
    for k in (2, 3):
        got = {}
        for transport in ("tcp", "shm"):
            with Pipeline(bundle, k, launcher="process", transport=transport) as pipe:
                got[transport] = pipe.run(inputs)
                paths = pipe.edge_paths()
                assert paths and set(paths.values()) == {transport}, paths
                run = pipe.run_id
            assert shm.segment_names(run) == []
        assert_bit_identical(got["tcp"], want)
        assert_bit_identical(got["shm"], want)
