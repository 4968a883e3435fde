"""The safetensors weights file (bundle format 2): interop with the safetensors package, reads by
tensor with every byte counted, per-tensor checksums, truncation and corruption named, state pairs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support.pipeline_harness import mapped_file
from tests.support.tiny_bundle import tiny_params, write_tiny
from tvmpipe.bundle import BundleError, load_bundle
from tvmpipe.bundle.state import GenerationSpec, StatePair
from tvmpipe.bundle.weights import LazyParams, WeightsFile, WeightsWriter, save_safetensors


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
            "c": rng.standard_normal(9).astype(np.float16), "d": np.array([True, False])}


def test_written_file_loads_with_the_safetensors_package_and_back(tmp_path: Path):
    arrays = _arrays()
    save_safetensors(tmp_path / "w.safetensors", arrays)
    theirs = load_file(tmp_path / "w.safetensors")
    assert set(theirs) == set(arrays)
    for k in arrays:
        np.testing.assert_array_equal(theirs[k], arrays[k])
    save_file(arrays, str(tmp_path / "theirs.safetensors"))
    wf = WeightsFile(tmp_path / "theirs.safetensors")
    for k in arrays:
        np.testing.assert_array_equal(wf.read(k), arrays[k])


def test_bfloat16_is_two_bytes_a_value(tmp_path: Path):
    x = np.linspace(-2, 2, 12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    save_safetensors(tmp_path / "w.safetensors", {"x": x})
    wf = WeightsFile(tmp_path / "w.safetensors")
    assert wf.info("x").dtype == "bfloat16" and wf.info("x").nbytes == 24
    np.testing.assert_array_equal(wf.read("x"), x)


def test_reading_one_tensor_reads_only_its_bytes(tmp_path: Path):
    arrays = {f"t{i}": np.full((256, 256), i, np.float32) for i in range(4)}
    save_safetensors(tmp_path / "w.safetensors", arrays)
    wf = WeightsFile(tmp_path / "w.safetensors")
    header = wf.bytes_read
    lazy = LazyParams(wf, list(arrays))
    assert "t3" in lazy and len(lazy) == 4 and wf.bytes_read == header  # names cost nothing
    np.testing.assert_array_equal(lazy["t2"], arrays["t2"])
    assert wf.bytes_read - header == arrays["t2"].nbytes
    assert wf.reads == {"t2": arrays["t2"].nbytes}


def test_streamed_writer_holds_no_tensor_and_refuses_a_missing_one(tmp_path: Path):
    w = WeightsWriter(tmp_path / "w.safetensors", [("x", "float32", (2, 2)), ("y", "float32", (3,))])
    w.write("y", np.ones(3, np.float32))  # any order
    with pytest.raises(BundleError, match="tensor 'x'.*never written"):
        w.close()
    w = WeightsWriter(tmp_path / "w2.safetensors", [("x", "float32", (2, 2))])
    with pytest.raises(BundleError, match="tensor 'x'.*declared float32\\[2, 2\\]"):
        w.write("x", np.ones((2, 3), np.float32))
    w.abort()


def _st_bundle(tmp_path: Path, **kw) -> Path:
    return write_tiny(tmp_path / "tiny", params_format="safetensors", **kw)


def test_bundle_writes_safetensors_with_per_tensor_checksums(tmp_path: Path):
    b = _st_bundle(tmp_path)
    m = json.loads((b / "bundle.json").read_text())
    assert m["version"] == 2 and m["params"]["file"] == "params.safetensors"
    assert set(m["params"]["sha256"]) == {"w", "b"} and "params.safetensors" not in m["files"]
    loaded = load_bundle(b)
    assert isinstance(loaded.params, LazyParams) and loaded.params.file.bytes_read == loaded.params.file.header_bytes
    np.testing.assert_array_equal(loaded.params["w"], tiny_params()["w"])


def test_one_tensor_corrupted_is_named_when_read(tmp_path: Path):
    b = _st_bundle(tmp_path)
    wf = WeightsFile(b / "params.safetensors")
    at = wf.info("b").begin
    wf.close()
    data = bytearray((b / "params.safetensors").read_bytes())
    data[at] ^= 0xFF
    (b / "params.safetensors").write_bytes(bytes(data))
    bundle = load_bundle(b)  # the header is intact: loading reads no data
    np.testing.assert_array_equal(bundle.params["w"], tiny_params()["w"])  # other tensors still read
    with pytest.raises(BundleError) as info:
        bundle.params["b"]
    msg = str(info.value.problems[0])
    assert str(b / "params.safetensors") in msg and "tensor 'b'" in msg and "sha256" in msg


def test_truncated_weights_file_names_file_and_tensor(tmp_path: Path):
    b = _st_bundle(tmp_path)
    data = (b / "params.safetensors").read_bytes()
    (b / "params.safetensors").write_bytes(data[:-5])
    with pytest.raises(BundleError) as info:
        load_bundle(b)
    msg = "\n".join(map(str, info.value.problems))
    assert str(b / "params.safetensors") in msg and "truncated" in msg and "tensor '" in msg


def test_header_lies_are_refused(tmp_path: Path):
    b = _st_bundle(tmp_path)
    raw = (b / "params.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["w"]["data_offsets"] = [0, 4]  # claims fewer bytes than float32[4, 3]
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    new += b" " * (n - len(new))
    (b / "params.safetensors").write_bytes(raw[:8] + new[:n] + raw[8 + n:])
    with pytest.raises(BundleError, match="tensor 'w'.*data_offsets span 4 bytes"):
        load_bundle(b)


def test_npz_and_legacy_params_bundles_still_load(tmp_path: Path):
    npz = write_tiny(tmp_path / "npz")  # the test helper writes format-1-style .npz weights
    assert load_bundle(npz).params["w"].shape == (4, 3)
    m = json.loads((npz / "bundle.json").read_text())
    m["version"] = 1
    for k in ("state", "generation"):
        m.pop(k)
    (npz / "bundle.json").write_text(json.dumps(m))
    np.testing.assert_array_equal(load_bundle(npz).params["w"], tiny_params()["w"])


def test_state_pairs_round_trip_and_bad_pairs_are_named(tmp_path: Path):
    # the tiny graph has one input x float32[1, 4] and one output float32[3]: no pair can match it
    with pytest.raises(BundleError, match=r"state\[0\]: input 'x' is float32\[1, 4\] but output 0 is float32\[3\]"):
        _st_bundle(tmp_path, state=[StatePair("kv", "x", 0)])
    with pytest.raises(BundleError, match=r"state\[0\].output: head 4 does not exist"):
        _st_bundle(tmp_path, state=[StatePair("kv", "x", 4)])
    with pytest.raises(BundleError, match=r"generation.vocab_size"):
        _st_bundle(tmp_path, generation=GenerationSpec("x", "x", 0, 8, 5))
    # x is [1, 4]: four tokens a row, so a generation over it must say how many are real
    with pytest.raises(BundleError, match=r"generation.count: token input 'x' is \[1, 4\]: a step of several tokens"):
        _st_bundle(tmp_path, generation=GenerationSpec("x", "x", 0, 8, 3))


def test_zero_dim_tensors_round_trip(tmp_path):
    """A scalar constant (an fp16 epsilon, a folded mask value) is written as shape [], not [1]
    (np.ascontiguousarray makes a 0-d array 1-d, and the writer refused its own declared shape)."""
    import ml_dtypes

    from tvmpipe.bundle.weights import WeightsFile, save_safetensors

    params = {"s16": np.array(1.5, np.float16), "s32": np.array(-2.0, np.float32),
              "bf": np.array(3.0, ml_dtypes.bfloat16), "v": np.arange(3, dtype=np.float32)}
    sums = save_safetensors(tmp_path / "w.safetensors", params)
    f = WeightsFile(tmp_path / "w.safetensors", sums)
    for name, want in params.items():
        got = f.read(name)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("flip", [None, 0, 37, 199])
def test_a_tensor_read_in_pieces_is_verified_whole(tmp_path: Path, monkeypatch, flip):
    """load_into reads a large tensor piece by piece, each hashed on a helper thread while the next
    is read: the bytes land exactly, and a flipped byte in any piece (first, middle, last) is caught."""
    from tvmpipe.bundle import weights

    monkeypatch.setattr(weights, "READ_CHUNK", 64)  # 200 bytes: four pieces
    big = np.arange(50, dtype=np.float32)
    sums = save_safetensors(tmp_path / "w.safetensors", {"x": big, "y": np.ones(3, np.float32)})
    if flip is not None:
        data = bytearray((tmp_path / "w.safetensors").read_bytes())
        wf = WeightsFile(tmp_path / "w.safetensors")
        data[wf.info("x").begin + flip] ^= 0x01
        wf.close()
        (tmp_path / "w.safetensors").write_bytes(bytes(data))
    wf = WeightsFile(tmp_path / "w.safetensors", sums)
    out = np.zeros(50, np.float32)
    if flip is None:
        wf.load_into("x", out)
        np.testing.assert_array_equal(out, big)
        assert wf.reads["x"] == big.nbytes
        wf.load_into("x", out)  # verified once: the second read only copies
    else:
        with pytest.raises(BundleError, match="tensor 'x'.*sha256"):
            wf.load_into("x", out)
    wf.close()


def test_a_forked_child_verifies_weights_too(tmp_path: Path):
    """The hashing helper thread is not inherited by fork: a child that reads weights after its
    parent did must get its own (it hung before the at-fork reset)."""
    import os
    import signal

    sums = save_safetensors(tmp_path / "w.safetensors", {"x": np.arange(50, dtype=np.float32)})
    WeightsFile(tmp_path / "w.safetensors", sums).read("x")  # the parent's helper thread exists now
    pid = os.fork()
    if pid == 0:  # the child: read and verify, exit 0 on success (SIGALRM ends a hang)
        ok = False
        try:
            signal.alarm(20)
            ok = np.array_equal(WeightsFile(tmp_path / "w.safetensors", sums).read("x"), np.arange(50, dtype=np.float32))
        finally:
            os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_deferred_checksums_are_compared_at_settle(tmp_path: Path):
    """load_into(..., pending) returns once the bytes are in place; settle(pending) compares that
    list's checksums (a changed tensor is the usual one-line error naming it, raised there and not
    before) and no other caller's; a tensor settled once is never hashed again; and
    settle(pending, compare=False) only waits."""
    a, b = np.arange(50, dtype=np.float32), np.ones(30, np.float32)
    sums = save_safetensors(tmp_path / "w.safetensors", {"a": a, "b": b})
    wf = WeightsFile(tmp_path / "w.safetensors", {**sums, "b": "0" * 64})  # b's recorded sum is wrong
    out_a, out_b = np.zeros(50, np.float32), np.zeros(30, np.float32)
    mine, theirs = [], []
    wf.load_into("a", out_a, mine)
    wf.load_into("b", out_b, theirs)  # no error yet: nothing compared
    np.testing.assert_array_equal(out_a, a)
    wf.settle(mine)  # a is fine; b is another caller's
    assert mine == [] and [n for n, _ in theirs] == ["b"] and "a" in wf._verified
    with pytest.raises(BundleError, match=r"w\.safetensors.*tensor 'b'.*sha256 differs"):
        wf.settle(theirs)
    assert theirs == [] and "b" not in wf._verified
    wf.load_into("a", out_a, mine)
    assert mine == []  # verified once: copied, not hashed again
    wf.load_into("b", out_b, theirs)
    wf.settle(theirs, compare=False)  # a load that failed elsewhere: wait for the hashing, report nothing
    assert theirs == [] and "b" not in wf._verified
    wf.close()


def test_populated_bytes_are_zeroed_page_aligned_and_writable_on_either_path(monkeypatch):
    """core.memory.populated_bytes: madvise(MADV_POPULATE_WRITE) with the GIL released, or
    MAP_POPULATE where the kernel has no such call: the same zeroed, page-aligned, writable bytes."""
    from tvmpipe.core import memory

    for works in (True, False):
        if not works:
            monkeypatch.setattr(memory, "_populate", lambda m: False)
        buf = memory.populated_bytes(3 << 20)
        assert buf.size == 3 << 20 and buf.ctypes.data % 4096 == 0 and not buf.any()
        buf[::4096] = 7
        assert int(buf.sum()) == 7 * ((3 << 20) // 4096)


def test_mapped_tensors_are_the_files_pages_private_and_verified_at_settle(tmp_path: Path):
    """WeightsFile.map: each tensor is a view of the file's own pages (no copy), counted as read
    like a copy; a write changes this process's page, never the file; checksums are compared at
    settle(pending), a changed tensor named in one line; a tensor the file cut after it was opened
    is refused in one line, not mapped (touching it would kill the process with SIGBUS)."""
    rng = np.random.default_rng(1)
    arrays = {"w1": rng.standard_normal((64, 64)).astype(np.float32), "b1": rng.standard_normal(64).astype(np.float32),
              "w2": rng.standard_normal((64, 64)).astype(np.float32)}
    path = tmp_path / "w.safetensors"
    sums = save_safetensors(path, arrays)
    wf = WeightsFile(path, sums)
    pending: list = []
    views = wf.map(["w2", "b1", "w1"], pending)
    assert set(views) == {"w1", "b1", "w2"} and wf.reads == {"w1": 64 * 64 * 4, "b1": 64 * 4, "w2": 64 * 64 * 4}
    wf.settle(pending)
    for name, v in views.items():
        np.testing.assert_array_equal(v.view(np.float32).reshape(arrays[name].shape), arrays[name])
        assert mapped_file(v.ctypes.data) == str(path)
    before = path.read_bytes()
    views["w1"][:4] = 0  # copy-on-write: this process only
    assert path.read_bytes() == before and views["w1"][:4].tolist() == [0, 0, 0, 0]
    again = WeightsFile(path, sums).map(["w1"], pending)  # another reader sees the file, not the write
    wf.settle(pending)
    np.testing.assert_array_equal(again["w1"].view(np.float32).reshape(64, 64), arrays["w1"])

    bad = WeightsFile(path, {**sums, "b1": "0" * 64})
    views = bad.map(["w1", "b1", "w2"], pending)  # no error yet: the hash runs behind
    with pytest.raises(BundleError, match=r"w\.safetensors: tensor 'b1': sha256 differs"):
        bad.settle(pending)

    cut = WeightsFile(path, sums)
    last = max(cut.tensors.values(), key=lambda t: t.end)
    os.truncate(path, last.begin + 8)
    with pytest.raises(BundleError, match=rf"tensor '{last.name}': truncated: the file shrank after it was opened"):
        cut.map(list(cut.tensors), pending)
    assert pending == []


def test_tensors_at_unaligned_offsets_are_not_mapped(tmp_path: Path):
    """A float32 tensor after an odd-sized one sits at an offset NumPy cannot view aligned: map()
    leaves it to the caller's copy (load_into), and maps the rest."""
    arrays = {"a": np.ones(3, np.bool_), "b": np.arange(8, dtype=np.float32)}
    path = tmp_path / "odd.safetensors"
    sums = save_safetensors(path, arrays)
    wf = WeightsFile(path, sums)
    assert wf.info("b").begin % 4 == 3  # the file keeps the order given: no padding between tensors
    pending: list = []
    views = wf.map(["a", "b"], pending)
    wf.settle(pending)
    assert set(views) == {"a"} and "b" not in wf.reads


def test_hashes_start_on_the_lane_with_the_fewest_bytes_queued(monkeypatch):
    """BackgroundHash spreads hashes over its lanes by bytes still queued, not by count (a model's
    large weights and small biases alternate: counted, every weight landed on one lane); each hash
    stays on its lane, so its pieces are hashed in order."""
    import hashlib
    import threading

    from tvmpipe.bundle import weights
    from tvmpipe.bundle.weights import BackgroundHash

    monkeypatch.setattr(weights, "hash_lanes", lambda: 2)
    monkeypatch.setattr(BackgroundHash, "_lanes", [])
    monkeypatch.setattr(BackgroundHash, "_queued", [])
    BackgroundHash._enqueue(-1, 0)  # makes the lanes
    lanes = list(BackgroundHash._lanes)
    gate = threading.Event()
    for lane in lanes:
        lane.submit(gate.wait)  # nothing is hashed until the queue is set up: the order is exact
    rng = np.random.default_rng(5)
    big, small, mid = (rng.integers(0, 255, n, dtype=np.uint8) for n in (3 << 20, 1024, 2 << 20))
    hashes = [BackgroundHash() for _ in range(4)]
    for off in range(0, big.size, 1 << 20):
        hashes[0].update(big[off:off + (1 << 20)])
    hashes[1].update(small)
    hashes[2].update(mid)
    hashes[3].update(small)
    assert [h._lane for h in hashes] == [0, 1, 1, 1] and BackgroundHash._queued == [3 << 20, (2 << 20) + 2048]
    gate.set()
    assert [h.hexdigest() for h in hashes] == [hashlib.sha256(x).hexdigest() for x in (big, small, mid, small)]
    for lane in lanes:
        lane.submit(lambda: None).result()  # the done callbacks ran
    assert BackgroundHash._queued == [0, 0]
    for lane in lanes:
        lane.shutdown()


def test_a_mapping_never_shows_another_tensors_bytes(tmp_path: Path):
    """A mapping shows whole pages, so map() maps a tensor only where its first and last page hold
    nothing but tensors asked for (or the header, or the end of the file); the rest is left to the
    caller's copy. No mapped page of this process then holds a byte of a tensor not asked for.
    The writer starts the data on a page, so page-sized tensors all map."""
    import mmap

    page = mmap.PAGESIZE
    arrays = {"a": np.arange(25, dtype=np.float32), "b": np.arange(2048, dtype=np.float32),
              "c": np.arange(2048, dtype=np.float32), "d": np.arange(25, dtype=np.float32)}
    path = tmp_path / "w.safetensors"
    sums = save_safetensors(path, arrays)
    wf = WeightsFile(path, sums)
    assert wf.info("a").begin % page == 0  # the data starts on a page
    spans = {n: (t.begin, t.end) for n, t in wf.tensors.items()}

    def mapped_spans(names):
        pending: list = []
        views = wf.map(names, pending)
        wf.settle(pending)
        for name, v in views.items():  # the pages behind each view hold only tensors in `names`
            assert v.ctypes.data % page == spans[name][0] % page  # mapped from a page of the file
            lo = spans[name][0] - spans[name][0] % page
            hi = -(-spans[name][1] // page) * page
            assert all(e <= lo or b >= hi for n, (b, e) in spans.items() if n not in names), (name, names)
        return set(views)

    assert mapped_spans(["b", "c"]) == set()  # b's first page holds a, c's last page holds d
    assert mapped_spans(["a", "b", "c"]) == {"a", "b"}  # a's page starts at the header's end
    assert mapped_spans(["b", "c", "d"]) == {"c", "d"}  # d's last page ends past the end of the file
    assert mapped_spans(["a", "b", "c", "d"]) == {"a", "b", "c", "d"}

    sized = {f"w{i}": np.full(1024 * (i + 1), i, np.float32) for i in range(4)}  # whole pages each
    wf = WeightsFile(tmp_path / "pages.safetensors", save_safetensors(tmp_path / "pages.safetensors", sized))
    pending = []
    assert set(wf.map(["w1", "w2"], pending)) == {"w1", "w2"}  # one stage's share of page-sized weights
    wf.settle(pending)
