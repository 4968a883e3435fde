"""A legacy deployment, graph.json + TVM's binary .params (tests/data/legacy, as published): with its
params file, `inspect` tells graph inputs from weights and shows the weight bytes of every node; a
params file that does not fit the graph is an error naming the file and the param.

Expected figures come from the two files directly (the raw JSON and the arrays), not from the
report's code."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.commands import assert_fits_100_columns, run_tvmpipe as tvmpipe
from tests.support.paths import LEGACY_GRAPH, LEGACY_PARAMS
from tvmpipe.bundle import BundleError, load_bundle
from tvmpipe.bundle.inspect import build_report, render_text
from tvmpipe.bundle.params import load_tvm_params, save_npz, save_tvm_params

WEIGHT_BYTES = 1_697_280  # the 145 float32 arrays of mnet25_macos.params


def _raw() -> tuple[dict, dict[str, np.ndarray]]:
    return json.loads(LEGACY_GRAPH.read_text()), load_tvm_params(LEGACY_PARAMS.read_bytes())


def _expected_weight_bytes(graph: dict, arrays: dict[str, np.ndarray]) -> dict[int, int]:
    """Per node: bytes of the distinct params it is (a param node) or reads (an op node)."""
    names = [n["name"] for n in graph["nodes"]]
    out = {}
    for i, n in enumerate(graph["nodes"]):
        read = {n["name"]} if n["op"] == "null" else {names[r[0]] for r in n["inputs"]}
        out[i] = sum(arrays[k].nbytes for k in read if k in arrays)
    return out



def test_the_params_file_tells_inputs_from_weights():
    graph, arrays = _raw()
    assert len(arrays) == 145 and sum(a.nbytes for a in arrays.values()) == WEIGHT_BYTES
    bundle = load_bundle(LEGACY_GRAPH, params=LEGACY_PARAMS)
    assert bundle.is_bare and bundle.knows_params and bundle.params_path == LEGACY_PARAMS
    nulls = [n["name"] for n in graph["nodes"] if n["op"] == "null"]
    assert bundle.input_names == [n for n in nulls if n not in arrays] == ["data"]
    assert bundle.param_names == [n for n in nulls if n in arrays]
    assert all(np.array_equal(bundle.params[k], arrays[k]) for k in arrays)

    r = build_report(bundle)
    assert r["kind"] == "graph" and r["inputs"] == [{"node": 0, "name": "data", "shape": [1, 3, 480, 640],
                                                    "dtype": "float32"}]
    assert r["params"] == {"file": str(LEGACY_PARAMS), "generated": None, "count": 145, "bytes": WEIGHT_BYTES}
    assert [n["kind"] for n in r["nodes"] if n["op"] == "null"] == ["input"] + ["param"] * 145
    assert {n["index"]: n["weight_bytes"] for n in r["nodes"]} == _expected_weight_bytes(graph, arrays)
    assert r["nodes"][4]["weight_bytes"] == 896  # p0 float32[1,1,3,3,3,8] + p1 float32[1,1,1,1,8]
    assert r["counts"]["kernel_launches"] is None and r["nodes"][4]["launches"] is None  # still no kernels


def test_an_npz_of_the_same_arrays_reads_the_same(tmp_path):
    npz = tmp_path / "weights.npz"
    save_npz(npz, load_tvm_params(LEGACY_PARAMS.read_bytes()))
    a, b = (build_report(load_bundle(LEGACY_GRAPH, params=f)) for f in (LEGACY_PARAMS, npz))
    assert a["params"].pop("file") == str(LEGACY_PARAMS) and b["params"].pop("file") == str(npz)
    assert a == b


def test_without_the_params_file_the_split_stays_unknown():
    r = build_report(load_bundle(LEGACY_GRAPH))
    assert r["inputs"] is None and r["params"]["count"] is None
    assert {n["kind"] for n in r["nodes"] if n["op"] == "null"} == {"null"}
    assert {n["weight_bytes"] for n in r["nodes"]} == {None}


def test_weight_bytes_of_a_bundle(tiny_bundle):
    r = build_report(load_bundle(tiny_bundle))
    assert [n["weight_bytes"] for n in r["nodes"]] == [0, 48, 12, 60, 0, 0]  # x, w, b, dense (w + b), reshape, scale


def test_text_shows_inputs_params_and_weights_per_node():
    text = render_text(build_report(load_bundle(LEGACY_GRAPH, params=LEGACY_PARAMS)))
    lines = text.splitlines()
    assert "  inputs       1: data float32[1,3,480,640]" in lines
    assert f"  params       145, 1.6 MiB, in {LEGACY_PARAMS}" in lines
    i = next(k for k, l in enumerate(lines) if l.startswith("4 "))
    assert lines[i + 1].strip() == "weights 896 B"
    assert lines[i - 2].split()[:3] == ["2", "p0", "(param)"] and lines[i - 4].split()[:3] == ["0", "data", "(input)"]
    assert_fits_100_columns(lines, LEGACY_GRAPH, LEGACY_PARAMS)


def test_cli_inspect_with_params(tmp_path):
    p = tvmpipe("inspect", "--json", str(LEGACY_GRAPH), "--params", str(LEGACY_PARAMS), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["params"]["bytes"] == WEIGHT_BYTES and [i["name"] for i in r["inputs"]] == ["data"]


def _write_params(path: Path, edit) -> Path:
    arrays = load_tvm_params(LEGACY_PARAMS.read_bytes())
    edit(arrays)
    path.write_bytes(save_tvm_params(arrays))
    return path


@pytest.mark.parametrize("name, edit, expected", [
    ("wrong_shape", lambda a: a.update(p0=np.zeros((1, 1, 3, 3, 3, 4), np.float32)),
     "param 'p0': is float32[1, 1, 3, 3, 3, 4] but node 2 expects float32[1, 1, 3, 3, 3, 8]"),
    ("wrong_dtype", lambda a: a.update(p1=a["p1"].astype(np.float16)),
     "param 'p1': is float16[1, 1, 1, 1, 8] but node 3 expects float32[1, 1, 1, 1, 8]"),
    ("unknown_name", lambda a: a.update(conv_weight=np.zeros(3, np.float32)),
     "param 'conv_weight': is not a param null node of graph.json"),
    ("op_node_name", lambda a: a.update(fused_layout_transform_34=np.zeros(3, np.float32)),
     "param 'fused_layout_transform_34': is not a param null node of graph.json"),
])
def test_params_that_do_not_fit_the_graph(tmp_path, name, edit, expected):
    bad = _write_params(tmp_path / f"{name}.params", edit)
    with pytest.raises(BundleError) as info:
        load_bundle(LEGACY_GRAPH, params=bad)
    assert [str(p) for p in info.value.problems] == [f"{bad}: {expected}"]
    p = tvmpipe("inspect", str(LEGACY_GRAPH), "--params", str(bad), cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.splitlines() == [f"tvmpipe inspect: error: 1 problem in bundle: {bad}: {expected}"]


def test_params_file_errors_name_the_file(tmp_path, tiny_bundle):
    junk = tmp_path / "junk.params"
    junk.write_bytes(b"not a param dict at all")
    truncated = tmp_path / "truncated.params"
    truncated.write_bytes(LEGACY_PARAMS.read_bytes()[:100_000])
    for path, expected in ((junk, "not a TVM param dict"), (truncated, "truncated"),
                           (tmp_path / "absent.params", "file not found")):
        with pytest.raises(BundleError, match=expected) as info:
            load_bundle(LEGACY_GRAPH, params=path)
        assert info.value.problems[0].file == str(path)
    with pytest.raises(BundleError, match="a params file goes with a bare graph.json") as info:
        load_bundle(tiny_bundle, params=LEGACY_PARAMS)
    assert info.value.problems[0].file == str(LEGACY_PARAMS)
