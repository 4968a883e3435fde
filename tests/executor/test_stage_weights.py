"""Each stage reads, is shipped and uploads exactly its own weights (issue 25, runtime side).

The model is generated here (a small dense stack with safetensors weights); byte counts come from
the weights reader (`WeightsFile.bytes_read` / `reads`), the launchers' shipment sizes and the
strict fake driver's record of page-locked allocations and host-to-device copies.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from tests.support.synthetic_bundles import write_dense_stack
from tvmpipe.bundle import BundleError, load_bundle
from tvmpipe.cluster.shipping import build_shipment, stage_param_names, unpack
from tvmpipe.executor import Stage
from tvmpipe.executor.inputs import random_feed
from tvmpipe.partition import plan_equal_ops


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Path:
    return write_dense_stack(tmp_path_factory.mktemp("stack") / "stack", layers=6, width=32)


def _own_bytes(bundle, start, end) -> tuple[list[str], int]:
    names = stage_param_names(bundle, start, end)
    return names, sum(bundle.param_nbytes(n) for n in names)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_stage_reads_exactly_its_own_tensors(stack: Path, k: int):
    plan = plan_equal_ops(load_bundle(stack).graph, k)
    header = _header_bytes(stack / "params.safetensors")
    for start, end in plan.stages:
        bundle = load_bundle(stack)  # a fresh reader, as in a stage process
        stage = Stage(bundle, start, end, backend="reference")
        wf = bundle.params.file
        names, own = _own_bytes(bundle, start, end)
        assert names and set(names) == set(stage.program.param_names)
        assert set(wf.reads) == set(names), "a stage read another stage's tensors"
        assert all(wf.reads[n] == bundle.param_nbytes(n) for n in names), "each tensor read once"
        assert wf.bytes_read == header + own
        assert not bundle.params._cache, "no second (cached) copy of the weights"
        stage.run(random_feed(stage.program, 0))
        assert wf.bytes_read == header + own, "running reads no weights"


def test_a_shipment_carries_only_its_stages_weights(stack: Path, tmp_path: Path):
    bundle = load_bundle(stack)
    plan = plan_equal_ops(bundle.graph, 3)
    small = sum(p.stat().st_size for p in stack.iterdir() if p.name != "params.safetensors")
    for i, (start, end) in enumerate(plan.stages):
        src = load_bundle(stack)
        ship = build_shipment(src, [(start, end)], [i])
        names, own = _own_bytes(bundle, start, end)
        assert list(ship.tensors) == names
        assert set(src.params.file.reads) == set(names), "building a shipment reads only its tensors"
        slice_header = ship.weight_bytes - own
        assert 8 < slice_header < 4096
        assert ship.nbytes == small + slice_header + own
        path, partial, made = unpack(ship, f"test{i}")
        try:
            got = load_bundle(path, partial_weights=True)
            stage = Stage(got, start, end, backend="reference")
            want = Stage(load_bundle(stack), start, end, backend="reference")
            feed = random_feed(want.program, 1)
            for e, v in want.run(feed).items():
                assert np.array_equal(stage.run(feed)[e], v)
            other = next(n for n in bundle.param_names if n not in names)
            with pytest.raises(BundleError, match=f"'{other}'.*not in the file .*slice"):
                got.params[other]
        finally:
            if made:
                import shutil
                shutil.rmtree(made)


def test_a_corrupt_tensor_in_a_shipped_slice_is_named(stack: Path, tmp_path: Path):
    bundle = load_bundle(stack)
    ship = build_shipment(bundle, [(0, 4)], [0])
    ship.weights = ship.weights.copy()
    ship.weights[-1] ^= 0xFF  # the last byte of the slice's last tensor
    ship.key = "corrupt-" + ship.key
    path, _, made = unpack(ship, "test")
    try:
        got = load_bundle(path, partial_weights=True)
        last = ship.tensors[-1]
        with pytest.raises(BundleError) as err:
            Stage(got, 0, 4, backend="reference")
        msg = str(err.value)
        assert "params.safetensors" in msg and f"'{last}'" in msg and "sha256" in msg
        assert len(err.value.problems) == 1, msg  # one line: the file and the tensor
    finally:
        import shutil
        shutil.rmtree(made)


def test_process_launcher_ships_each_stage_its_own_weights(stack: Path):
    from tvmpipe.app.oracle import compare, reference_outputs
    from tvmpipe.cluster import Pipeline
    from tvmpipe.executor.inputs import random_micro_batches

    bundle = load_bundle(stack)
    plan = plan_equal_ops(bundle.graph, 3)
    small = sum(p.stat().st_size for p in stack.iterdir() if p.name != "params.safetensors")
    batches = random_micro_batches(bundle, 4, 0)
    with Pipeline(bundle, plan, launcher="process", ship_bundle=True) as pipe:
        for b in batches:
            pipe.submit(b)
        outs = [pipe.get() for _ in batches]
        stats = pipe.launcher.call_all("stats")
        shipped = dict(pipe.launcher.shipped)
    assert not compare(outs, reference_outputs(stack, batches))
    for i, (start, end) in enumerate(plan.stages):
        _, own = _own_bytes(bundle, start, end)
        st = stats[i]
        assert st.weight_bytes == own
        assert own < st.shipped_bytes == shipped[i] < small + own + 4096, "its weights + small files, nothing else"
        assert own < st.weights_read < own + 4096, "it read its own tensors (and the slice's header) only"
