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

from tests.support.pipeline_harness import mapped_file
from tests.support.synthetic_bundles import write_dense_stack
from tvmpipe.bundle import BundleError, load_bundle
from tvmpipe.bundle.weights import DATA_ALIGN
from tvmpipe.cluster.control.shipping import build_shipment, stage_param_names, unpack
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
        assert 8 < slice_header <= DATA_ALIGN and slice_header % DATA_ALIGN == 0  # the data starts on a page
        assert ship.nbytes == small + slice_header + own
        made = unpack(ship, f"test{i}")
        try:
            got = load_bundle(made.path, partial_weights=True)
            stage = Stage(got, start, end, backend="reference")
            want = Stage(load_bundle(stack), start, end, backend="reference")
            feed = random_feed(want.program, 1)
            for e, v in want.run(feed).items():
                assert np.array_equal(stage.run(feed)[e], v)
            other = next(n for n in bundle.param_names if n not in names)
            with pytest.raises(BundleError, match=f"'{other}'.*not in the file .*slice"):
                got.params[other]
        finally:
            made.lease.release()


def test_a_corrupt_tensor_in_a_shipped_slice_is_named(stack: Path, tmp_path: Path):
    bundle = load_bundle(stack)
    ship = build_shipment(bundle, [(0, 4)], [0])
    ship.weights = ship.weights.copy()
    ship.weights[-1] ^= 0xFF  # the last byte of the slice's last tensor
    ship.key = "corrupt-" + ship.key
    made = unpack(ship, "test")
    try:
        got = load_bundle(made.path, partial_weights=True)
        last = ship.tensors[-1]
        with pytest.raises(BundleError) as err:
            Stage(got, 0, 4, backend="reference")
        msg = str(err.value)
        assert "params.safetensors" in msg and f"'{last}'" in msg and "sha256" in msg
        assert len(err.value.problems) == 1, msg  # one line: the file and the tensor
    finally:
        made.lease.release()


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
        assert own < st.shipped_bytes == shipped[i] <= small + own + DATA_ALIGN, "its weights + small files, nothing else"
        assert own < st.weights_read <= own + DATA_ALIGN, "it read its own tensors (and the slice's header) only"


@pytest.fixture
def fake_stack(monkeypatch, tmp_path, stack):
    """The strict fake pycuda, computing the dense stack's kernels."""
    import sys

    from tests.support.fake_cuda import activate

    activate(monkeypatch, tmp_path / "cubins", [stack])
    import pycuda.driver as drv

    monkeypatch.setattr(drv, "stats", {"pinned_allocs": [], "htod": []})
    yield drv
    for name in [m for m in sys.modules if m == "pycuda" or m.startswith("pycuda.")]:
        del sys.modules[name]


@pytest.mark.parametrize("lanes", [1, 3])
def test_cuda_uploads_from_the_file_through_bounded_pinned_staging(fake_stack, stack: Path, monkeypatch, lanes):
    """2 x staging_bytes of page-locked memory in all, as one buffer pair per hash lane (the pairs
    take turns chunk by chunk, one tensor each, so that many checksums run at once)."""
    import tvmpipe.executor.backend_cuda as backend_cuda

    monkeypatch.setattr(backend_cuda, "hash_lanes", lambda: lanes)
    drv = fake_stack
    staging = 2000  # a w tensor is 4096 bytes: 3 or more chunks a tensor, every buffer reused
    bundle = load_bundle(stack)
    start, end = plan_equal_ops(bundle.graph, 2).stages[1]
    names, own = _own_bytes(bundle, start, end)
    pairs = min(lanes, len(names))
    chunk = staging // pairs
    dsts, htod = [], drv.memcpy_htod_async
    monkeypatch.setattr(drv, "memcpy_htod_async", lambda dst, src, stream=None: (dsts.append(int(dst)), htod(dst, src, stream))[1])
    stage = Stage(bundle, start, end, backend="cuda", staging_bytes=staging)
    built = {k: list(v) for k, v in drv.stats.items()}  # what the build did
    bases = sorted((stage.backend.ptr[e], n) for n, e in stage.program.param_entries.items())
    order = [max((b for b in bases if b[0] <= d), default=(None, None))[1] for d in dsts]
    assert len(set(order[:pairs])) == pairs, f"the first copies go to {pairs} different tensor(s) in turn: {order}"
    feeds = {e: v for e, v in random_feed(stage.program, 2).items()}
    ref = Stage(load_bundle(stack), start, end, backend="reference")
    for e, v in ref.run(feeds).items():
        np.testing.assert_allclose(stage.run(feeds)[e], v, rtol=1e-5, atol=1e-6)
    io_bytes = sum(stage.program.entry_specs[e].nbytes for e in stage.program.feed_entries + stage.program.send_entries)
    assert built["pinned_allocs"].count(chunk) >= 2 * pairs
    assert sum(built["pinned_allocs"]) == 2 * pairs * chunk + io_bytes, "the staging pairs and the I/O buffers, nothing else"
    assert 2 * pairs * chunk <= 2 * staging
    params = [c for c in built["htod"]]
    assert all(src == "pinned" and how == "async" and n <= chunk for src, n, how in params), params
    assert sum(n for _, n, _ in params) == own and len(params) > len(names), "every weight byte once, in chunks"
    wf = bundle.params.file
    assert set(wf.reads) == set(names) and wf.bytes_read == _header_bytes(stack / "params.safetensors") + own
    assert not bundle.params._cache, "no host copy of the weights was kept"
    assert not drv.violations
    stage.close()


def test_the_fake_catches_a_staging_buffer_refilled_too_early(fake_stack, stack: Path, monkeypatch):
    """Proof the test above means something: without waiting on the buffer's event, the next chunk
    overwrites bytes a pending copy has not read yet, and the strict fake says so."""
    drv = fake_stack
    monkeypatch.setattr(drv.Event, "synchronize", lambda self: self)
    bundle = load_bundle(stack)
    with pytest.raises(Exception, match="changed while a host-to-device copy from it was pending"):
        Stage(bundle, 0, 4, backend="cuda", staging_bytes=1000)


def test_a_corrupt_tensor_is_named_on_the_staged_upload(fake_stack, stack: Path, tmp_path: Path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(stack, bad)
    with open(bad / "params.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    bundle = load_bundle(bad)
    last_name = max(bundle.params.file.tensors.values(), key=lambda t: t.end).name
    start = next(i for i, n in enumerate(bundle.graph.nodes) if n.name == last_name)
    with pytest.raises(BundleError, match=f"params.safetensors: tensor '{last_name}': sha256 differs"):
        Stage(bundle, start + 1, len(bundle.graph.nodes), backend="cuda", staging_bytes=1000)


def test_a_corrupt_tensor_is_named_before_a_reference_stage_runs(stack: Path, tmp_path: Path):
    """The reference backend reads every weight before comparing any checksum (the hashing overlaps
    the next reads): a changed byte in the first tensor is still the one-line error naming it, and
    no stage is built."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(stack, bad)
    first = min(load_bundle(stack).params.file.tensors.values(), key=lambda t: t.begin)
    with open(bad / "params.safetensors", "r+b") as f:
        f.seek(first.begin)
        b = f.read(1)
        f.seek(first.begin)
        f.write(bytes([b[0] ^ 1]))
    bundle = load_bundle(bad)
    with pytest.raises(BundleError, match=f"params.safetensors: tensor '{first.name}': sha256 differs"):
        Stage(bundle, 0, len(bundle.graph.nodes), backend="reference")


def test_bundles_without_safetensors_weights_are_shipped_whole():
    """Generated (or .npz / .params) weights cannot be read by tensor: every file goes, as before."""
    from tests.support.paths import EXAMPLES_DIR
    from tvmpipe.app.oracle import compare, reference_outputs
    from tvmpipe.cluster import Pipeline
    from tvmpipe.executor.inputs import random_micro_batches

    path = EXAMPLES_DIR / "mlp"
    whole = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    batches = random_micro_batches(load_bundle(path), 2, 0)
    with Pipeline(path, 2, launcher="process", ship_bundle=True) as pipe:
        for b in batches:
            pipe.submit(b)
        outs = [pipe.get() for _ in batches]
        shipped = dict(pipe.launcher.shipped)
    assert shipped == {0: whole, 1: whole}
    assert not compare(outs, reference_outputs(path, batches))


def test_a_reference_stage_computes_on_the_weights_files_pages(tmp_path: Path):
    """The reference backend maps its weights instead of copying them into fresh memory: with
    page-sized tensors (a 1024-wide stack: 4 MiB weights, 4 KiB biases) every param's storage is
    the weights file's page-cache pages (shared by the stages of one node), and the outputs are the
    same as with the weights held in memory (a bundle whose params are a dict)."""
    import dataclasses

    stack = write_dense_stack(tmp_path / "wide", layers=4, width=1024)
    bundle = load_bundle(stack)
    plan = plan_equal_ops(bundle.graph, 2)
    start, end = plan.stages[1]
    stage = Stage(bundle, start, end, backend="reference")
    views = stage.backend.views
    params = stage.program.param_entries
    assert params and all(mapped_file(views[e].ctypes.data) == str(stack / "params.safetensors") for e in params.values())
    in_memory = dataclasses.replace(load_bundle(stack), params={n: load_bundle(stack).params[n] for n in params})
    copied = Stage(in_memory, start, end, backend="reference")
    assert all(mapped_file(copied.backend.views[e].ctypes.data) is None for e in params.values())
    feed = random_feed(stage.program, 0)
    out, want = stage.run(feed), copied.run(feed)
    assert out.keys() == want.keys() and all(np.array_equal(out[k], want[k]) for k in out)


def test_weights_a_filesystem_cannot_map_are_read_instead(stack: Path, monkeypatch):
    """Where mmap fails (a filesystem without it), the reference backend reads the same tensors
    into its slots: the same outputs, each tensor still read (and counted) once."""
    from tvmpipe.bundle import weights

    mapped = Stage(load_bundle(stack), 0, len(load_bundle(stack).graph.nodes), backend="reference")

    def no_mmap(*args, **kwargs):
        raise OSError(19, "No such device")

    with monkeypatch.context() as patch:
        patch.setattr(weights.mmap, "mmap", no_mmap)
        bundle = load_bundle(stack)
        read = Stage(bundle, 0, len(bundle.graph.nodes), backend="reference")
    params = read.program.param_entries
    assert all(mapped_file(read.backend.views[e].ctypes.data) is None for e in params.values())
    assert all(bundle.params.file.reads[n] == bundle.param_nbytes(n) for n in params)
    feed = random_feed(read.program, 0)
    out, want = read.run(feed), mapped.run(feed)
    assert out.keys() == want.keys() and all(np.array_equal(out[k], want[k]) for k in out)


@pytest.mark.parametrize("streamed", [True, False], ids=["weights-slice", "whole-files"])
def test_a_shipment_carries_the_bundles_tokenizer_directory(stack: Path, tmp_path: Path, streamed: bool):
    """A compiled checkpoint's bundle holds its tokenizer files in tokenizer/ (bundle.json
    `tokenizer`, checksummed in `files`): a node's copy must hold them too, or it does not load."""
    import hashlib
    import json
    import shutil

    from tokenizers import Tokenizer, models

    from tvmpipe.cluster.control.shipping import whole_files

    src = tmp_path / "with_tokenizer"
    shutil.copytree(stack, src)
    (src / "tokenizer").mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(src / "tokenizer" / "tokenizer.json"))
    doc = json.loads((src / "bundle.json").read_text())
    doc["tokenizer"] = "tokenizer"
    doc["files"]["tokenizer/tokenizer.json"] = hashlib.sha256((src / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    (src / "bundle.json").write_text(json.dumps(doc))
    ship = build_shipment(load_bundle(src), [(0, 4)], [0]) if streamed else whole_files(src)
    made = unpack(ship, "tok")
    try:
        got = load_bundle(made.path, partial_weights=streamed)
        assert got.tokenizer_dir is not None
        assert (got.tokenizer_dir / "tokenizer.json").read_bytes() == (src / "tokenizer" / "tokenizer.json").read_bytes()
    finally:
        made.lease.release()
    with pytest.raises(ValueError, match="not inside the bundle"):
        unpack({"../escape.json": b"{}", "graph.json": b"{}"}, "bad")
