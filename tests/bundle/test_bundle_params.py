"""Parameters: TVM's binary .params format (read without TVM), .npz, and generated weights."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tests.support.bundle_edits import edit_json, rewrite
from tests.support.tiny_bundle import tiny_params
from tvmpipe.bundle import BundleError, load_bundle, read_graph
from tvmpipe.bundle.params import (NDARRAY_MAGIC, PARAM_LIST_MAGIC, generate_params, load_npz, load_params_file,
                                   load_tvm_params, save_tvm_params)

ARRAYS = {
    "conv_weight": np.arange(2 * 3 * 3 * 3, dtype=np.float32).reshape(2, 3, 3, 3),
    "half": np.array([1.5, -2.0], dtype=np.float16),
    "f64": np.array([[1e300]], dtype=np.float64),
    "i8": np.array([-128, 127], dtype=np.int8),
    "u8": np.array([0, 255], dtype=np.uint8),
    "i64": np.array([-(2**62)], dtype=np.int64),
    "u32": np.array([2**32 - 1], dtype=np.uint32),
    "mask": np.array([True, False, True]),
    "scalar": np.array(3.25, dtype=np.float32),
    "empty": np.zeros((0, 4), dtype=np.float32),
    "名前": np.ones(1, dtype=np.int32),
}


def test_tvm_params_round_trip():
    blob = save_tvm_params(ARRAYS)
    back = load_tvm_params(blob)
    assert list(back) == list(ARRAYS)
    for k, v in ARRAYS.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)


def test_tvm_params_layout_matches_save_param_dict():
    """Byte layout written by TVM's SaveParams (checked field by field, not via our own reader)."""
    blob = save_tvm_params({"w": np.array([1.0, 2.0], dtype=np.float32)})
    magic, reserved, n_names, name_len = struct.unpack_from("<QQQQ", blob)
    assert (magic, reserved, n_names, name_len) == (PARAM_LIST_MAGIC, 0, 1, 1) and blob[32:33] == b"w"
    n_arrays, arr_magic, arr_reserved, dev_type, dev_id, ndim = struct.unpack_from("<QQQiii", blob, 33)
    assert (n_arrays, arr_magic, arr_reserved, dev_type, dev_id, ndim) == (1, NDARRAY_MAGIC, 0, 1, 0, 1)
    code, bits, lanes, dim0, nbytes = struct.unpack_from("<BBHqq", blob, 33 + 36)
    assert (code, bits, lanes, dim0, nbytes) == (2, 32, 1, 2, 8)  # kDLFloat, 32 bits, 1 lane; shape (2,); 8 bytes
    assert np.frombuffer(blob[-8:], dtype=np.float32).tolist() == [1.0, 2.0] and len(blob) == 33 + 36 + 20 + 8


@pytest.mark.timeout(20)
def test_every_truncation_is_a_bundle_error():
    blob = save_tvm_params({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([7], dtype=np.int64)})
    for n in range(len(blob)):
        with pytest.raises(BundleError) as info:
            load_tvm_params(blob[:n], "x.params")
        assert str(info.value.problems[0]).startswith("x.params")


def _patch(blob: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


ONE = save_tvm_params({"w": np.array([1.0, 2.0], dtype=np.float32)})
ARRAY = 33 + 8  # offset of the first NDArray magic: after header (24), name length (8) + "w", array count (8)
CORRUPT = [
    ("bad-magic", _patch(ONE, 0, "<Q", 1), "bad magic number"),
    ("too-many-names", _patch(ONE, 16, "<Q", 2**40), "claims 1099511627776 names"),
    ("names-vs-arrays", _patch(ONE, 33, "<Q", 2), "has 1 names but 2 arrays"),
    ("bad-array-magic", _patch(ONE, ARRAY, "<Q", 0), "array 'w': bad NDArray magic number"),
    ("ndim-implausible", _patch(ONE, ARRAY + 24, "<i", 99), "implausible ndim 99"),
    ("vector-dtype", _patch(ONE, ARRAY + 30, "<H", 4), "unsupported dtype (code 2, bits 32, lanes 4)"),
    ("bfloat16", _patch(_patch(ONE, ARRAY + 28, "<B", 4), ARRAY + 29, "<B", 16), "unsupported dtype (code 4, bits 16"),
    ("negative-dim", _patch(ONE, ARRAY + 32, "<q", -2), "negative dimension"),
    ("size-mismatch", _patch(ONE, ARRAY + 40, "<q", 12), "data size 12 does not match shape (2,)"),
    ("huge-size", _patch(_patch(ONE, ARRAY + 32, "<q", 2**40), ARRAY + 40, "<q", 2**42), "truncated"),
    ("trailing-bytes", ONE + b"\0", "1 trailing bytes"),
    ("bad-utf8-name", ONE[:32] + b"\xff" + ONE[33:], "name 0: not valid UTF-8"),
]


@pytest.mark.parametrize("blob,message", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_corrupt_params_are_bundle_errors(blob, message):
    with pytest.raises(BundleError, match="x.params") as info:
        load_tvm_params(blob, "x.params")
    assert message in str(info.value)


def test_npz_and_dispatch_by_suffix(tmp_path):
    np.savez(tmp_path / "p.npz", **{"w": np.ones(2, np.float32)})
    (tmp_path / "p.params").write_bytes(ONE)
    assert list(load_params_file(tmp_path / "p.npz")) == ["w"]
    assert load_params_file(tmp_path / "p.params")["w"].tolist() == [1.0, 2.0]
    np.save(tmp_path / "bare.npy", np.ones(2))
    (tmp_path / "bare.npz").write_bytes((tmp_path / "bare.npy").read_bytes())
    with pytest.raises(BundleError, match="a single .npy array"):
        load_npz(tmp_path / "bare.npz")
    with pytest.raises(BundleError, match="file not found"):
        load_params_file(tmp_path / "absent.params")


def _npy(shape: str, data: bytes) -> bytes:
    header = ("{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % shape).ljust(117) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + data


@pytest.mark.parametrize("members,message", [
    ({"w.npy": _npy("(1000000000000,)", b"\0" * 16)}, "not a readable .npz archive"),  # numpy would allocate 4 TB
    ({"w.npy": _npy("(2,)", b"\0" * 8), "notes.txt": b"hello"}, "member 'notes.txt': is not a .npy array"),
], ids=["header-claims-4TB", "non-npy-member"])
def test_crafted_npz_archives(tmp_path, members, message):
    import zipfile

    with zipfile.ZipFile(tmp_path / "p.npz", "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    with pytest.raises(BundleError, match=message):
        load_npz(tmp_path / "p.npz")


def test_bundle_with_tvm_params_file(tiny_bundle):
    params = tiny_params()
    rewrite(tiny_bundle, "params.params", save_tvm_params(params))
    edit_json(tiny_bundle, "bundle.json", lambda m: m["params"].update(file="params.params"))
    b = load_bundle(tiny_bundle)
    np.testing.assert_array_equal(b.params["w"], params["w"])
    rewrite(tiny_bundle, "params.params", save_tvm_params({"w": params["w"], "b": params["b"][:2]}))
    with pytest.raises(BundleError, match=r"params.params: param 'b': is float32\[2\] but node 2 expects float32\[3\]"):
        load_bundle(tiny_bundle)
    rewrite(tiny_bundle, "params.params", save_tvm_params(params)[:-3])
    with pytest.raises(BundleError, match="params.params: byte .*: truncated"):
        load_bundle(tiny_bundle)


# ---- generated weights ---------------------------------------------------------------------------

def test_generated_params_are_deterministic(fixtures_dir):
    g = read_graph(fixtures_dir / "wrn_fc_nnvm.json")
    names = [g.nodes[i].name for i in g.null_nodes[1:]]  # all but the data input
    a, b = generate_params(g, names, seed=3), generate_params(g, names, seed=3)
    assert list(a) == names
    for n in names:
        e = g.entry_of(n)
        assert a[n].shape == e.shape and a[n].dtype == np.float32
        np.testing.assert_array_equal(a[n], b[n])
    other = generate_params(g, names, seed=4)
    assert not np.array_equal(a[names[0]], other[names[0]])
    # each tensor depends only on (seed, name): a subset gives the same arrays
    np.testing.assert_array_equal(generate_params(g, names[2:3], seed=3)[names[2]], a[names[2]])
    # scaled by fan-in so deep stacks stay O(1): the dense weight is [10, 80]
    assert 0.8 / np.sqrt(80) < a["1"].std() < 1.2 / np.sqrt(80)


def test_generated_integer_params_are_zero(graph_json):
    from tvmpipe.bundle import parse_graph

    g = graph_json("dlr_4in2out_nnvm")
    g["attrs"].pop("dtype")
    g["attrs"]["dltype"][1][0] = "int64"
    out = generate_params(parse_graph(g), ["data1", "data2"], seed=0)
    assert out["data1"].dtype == np.int64 and not out["data1"].any()
    assert out["data2"].dtype == np.float32 and out["data2"].any()


def test_generated_bfloat16_params_and_inputs_are_random_floats(graph_json):
    """bfloat16 (ml_dtypes: NumPy kind 'V', not 'f') is drawn like the other floats: a bf16 bundle
    shipped without weights gets weights, not zeros, and its random inputs are normal draws, not 0/1."""
    from tvmpipe.bundle import parse_graph
    from tvmpipe.bundle.dtypes import np_dtype
    from tvmpipe.bundle.graph import EntrySpec
    from tvmpipe.executor.inputs import random_array

    g = graph_json("dlr_4in2out_nnvm")
    g["attrs"].pop("dtype")
    g["attrs"]["dltype"][1][0] = "bfloat16"
    out = generate_params(parse_graph(g), ["data1", "data2"], seed=0)
    w = out["data1"].astype(np.float32)  # 2 values: before, zeros
    assert out["data1"].dtype == np_dtype("bfloat16") and w.std() > 0 and not set(w.tolist()) <= {0.0, 1.0}
    x = random_array(EntrySpec((64,), "bfloat16"), seed=0, key="x").astype(np.float32)
    assert (x < 0).any() and len(np.unique(x)) > 2  # before: integers 0 and 1
