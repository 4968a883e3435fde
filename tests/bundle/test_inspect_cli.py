"""`tvmpipe inspect`: the report (the --json schema), its 100-column text rendering, and the command
run as users run it (a subprocess: exit status, stdout, no traceback on errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bundle_edits import edit_json
from tests.support.commands import assert_fits_100_columns, run_tvmpipe as tvmpipe
from tests.support.graph_edits import add_node, op_node, relay_style
from tests.support.paths import EXAMPLES_DIR
from tvmpipe.bundle import load_bundle, parse_graph
from tvmpipe.bundle.bundle import Bundle
from tvmpipe.bundle.inspect import SCHEMA, build_report, render_text

REPORT_KEYS = {"schema", "path", "kind", "model", "source", "target", "batch", "dtype", "tvm_version", "created_by",
               "params", "counts", "activation_bytes", "inputs", "outputs", "nodes", "state", "state_bytes_per_slot",
               "state_resident_bytes_per_slot", "generation", "weights"}
NODE_KEYS = {"index", "name", "op", "kind", "func_name", "inputs", "outputs", "launches", "workspaces", "ops",
             "weight_bytes"}



# ---- the report ----------------------------------------------------------------------------------

def test_report_of_a_bare_graph_says_what_it_cannot_know(fixtures_dir):
    r = build_report(load_bundle(fixtures_dir / "resnet18_nnvm.json"))
    assert set(r) == REPORT_KEYS and r["schema"] == SCHEMA and r["kind"] == "graph"
    assert r["counts"] == {"nodes": 71, "op_nodes": 25, "null_nodes": 46, "null_bytes": 47_344_544, "entries": 71,
                           "heads": 1, "storage_ids": 52, "functions": 23, "kernel_launches": None}
    assert r["activation_bytes"] == {"no_reuse": 10_749_760, "with_reuse": 4_925_248}
    assert r["inputs"] is None and r["params"] == {"file": None, "generated": None, "count": None, "bytes": None}
    assert r["outputs"] == [{"node": 70, "name": "softmax0", "index": 0, "entry": 70, "shape": [1, 1000], "dtype": "float32"}]
    conv = r["nodes"][3]
    assert set(conv) == NODE_KEYS
    assert conv["kind"] == "op" and conv["launches"] is None and conv["ops"] is None and conv["workspaces"] is None
    assert [i["node"] for i in conv["inputs"]] == [0, 1, 2]
    assert conv["outputs"] == [{"entry": 3, "shape": [1, 64, 112, 112], "dtype": "float32", "storage_id": 0,
                                "device_type": None, "storage_scope": None}]
    assert {n["kind"] for n in r["nodes"] if n["op"] == "null"} == {"null"}
    assert all(n["launches"] == [] for n in r["nodes"] if n["op"] == "null")


def test_report_of_the_tiny_bundle(tiny_bundle):
    r = build_report(load_bundle(tiny_bundle))
    assert r["kind"] == "bundle" and r["model"] == "tiny" and r["target"] == {"kind": "cuda", "arch": "sm_90"}
    assert r["counts"]["kernel_launches"] == 3 and r["counts"]["functions"] == 2
    assert r["params"] == {"file": "params.npz", "generated": None, "count": 2, "bytes": 60}
    assert r["inputs"] == [{"node": 0, "name": "x", "shape": [1, 4], "dtype": "float32"}]
    assert [n["kind"] for n in r["nodes"]] == ["input", "param", "param", "op", "nop", "op"]
    dense = r["nodes"][3]
    assert [(l["kernel"], l["grid"], l["block"], l["shared_mem"]) for l in dense["launches"]] == [
        ("dense_add_kernel", [1, 1, 1], [32, 1, 1], 0), ("dense_add_kernel_1", [1, 1, 1], [32, 1, 1], 0)]
    assert dense["launches"][1]["args"] == [{"workspace": 0}, {"arg": 3}, {"scalar": 3, "dtype": "int32"}]
    assert dense["workspaces"] == [{"nbytes": 12, "dtype": "float32", "shape": [3]}]
    assert [o["op"] for o in dense["ops"]] == ["matmul", "add", "nn.relu"]
    assert r["nodes"][4]["launches"] == [] and r["nodes"][4]["ops"] == []
    json.dumps(r)  # JSON-ready as it is


def test_generated_params_are_shown(tmp_path):
    from tests.support.tiny_bundle import write_tiny

    r = build_report(load_bundle(write_tiny(tmp_path / "gen", params=None, params_seed=11)))
    assert r["params"] == {"file": None, "generated": {"seed": 11}, "count": 2, "bytes": 60}
    assert "params       2, 60 B, generated on load from seed 11 (not stored in the bundle)" in render_text(r)


# ---- the text ------------------------------------------------------------------------------------

def _lines(text: str) -> list[str]:
    return text.splitlines()


@pytest.mark.parametrize("stem", ["dlr_4in2out_nnvm", "resnet18_nnvm", "wrn_fc_nnvm"])
def test_text_fits_100_columns(fixtures_dir, stem):
    text = render_text(build_report(load_bundle(fixtures_dir / f"{stem}.json")))
    assert_fits_100_columns(_lines(text), fixtures_dir / f"{stem}.json")
    assert "  kernels      unknown (bare graph.json)" in text
    assert "  params       unknown (bare graph.json)" in text


def test_text_rows_of_the_tiny_bundle(tiny_bundle):
    lines = _lines(render_text(build_report(load_bundle(tiny_bundle))))
    assert lines[0] == f"tiny  (bundle {tiny_bundle})"
    assert "  kernels      3 launch(es) per run from 2 function(s)" in lines
    assert "  inputs       1: x float32[1,4]" in lines
    i = next(k for k, l in enumerate(lines) if l.startswith("3 "))
    assert lines[i].split() == ["3", "dense_relu", "fused_dense_add_relu", "0,1,2", "float32[1,3]", "3"]
    assert lines[i + 1].split() == ["launch", "dense_add_kernel", "grid", "1x1x1", "block", "32x1x1", "smem", "0"]
    assert lines[i + 2].split() == ["launch", "dense_add_kernel_1", "grid", "1x1x1", "block", "32x1x1", "smem", "0"]
    assert lines[i + 3].strip() == "workspaces 12 B"
    assert lines[i + 4].strip() == "ops    matmul, add, nn.relu"
    assert lines[i + 5].strip() == "weights 60 B"  # w and b
    assert lines[i + 6].split()[:3] == ["4", "reshape", "__nop"]
    assert lines[i + 7].strip() == "no launch: __nop output aliases its input's storage"
    assert lines[i - 3].split() == ["0", "x", "(input)", "float32[1,4]", "0"]
    assert_fits_100_columns(lines, tiny_bundle)


def _relay_bundle(graph_json) -> Bundle:
    """A bare Relay-style graph with long tvmgen names, a 2-output split and a __copy across devices."""
    g = relay_style(graph_json("dlr_4in2out_nnvm"))
    long = "tvmgen_default_fused_nn_conv2d_add_nn_relu_nn_max_pool2d_layout_transform_1"
    g["nodes"][2]["attrs"]["func_name"] = long
    split = add_node(g, op_node("split_into_two_halves_of_the_first_sum", "tvmgen_default_fused_split",
                                [[2, 0, 0]], num_outputs=2), [([1], "float32", 6), ([1], "float32", 7)])
    copy = add_node(g, op_node("to_cpu", "__copy", [[split, 1, 0]]), [([1], "float32", 8)])
    g["attrs"]["device_index"] = ["list_int", [2] * 8 + [1]]
    g["heads"] = [[copy, 0, 0]]
    return Bundle(path=Path("relay.json"), graph=parse_graph(g))


def test_long_names_are_shortened_in_the_middle_and_kept_with_wide(graph_json):
    r = build_report(_relay_bundle(graph_json))
    narrow, wide = _lines(render_text(r)), _lines(render_text(r, wide=True))
    assert_fits_100_columns(narrow, "relay.json")
    assert max(map(len, wide[1:])) > 100
    cell = next(l for l in narrow if l.startswith("2 ")).split()[2]
    assert len(cell) == 30 and cell.startswith("tvmgen_") and "..." in cell
    assert cell.endswith("layout_transform_1")  # the distinguishing end survives
    assert any("tvmgen_default_fused_nn_conv2d_add_nn_relu_nn_max_pool2d_layout_transform_1" in l for l in wide)
    assert any("split_into_two_halves_of_the_first_sum" in l for l in wide)


def test_multi_output_and_copy_rows(graph_json):
    lines = _lines(render_text(build_report(_relay_bundle(graph_json))))
    i = next(k for k, l in enumerate(lines) if l.startswith("6 "))
    assert lines[i].split()[-2:] == ["float32[1]", "6@cuda"]
    assert lines[i + 1].split() == ["float32[1]", "7@cuda"]  # the split's second output, under the first
    assert lines[i + 2].split()[:4] == ["7", "to_cpu", "__copy", "6:1"]
    assert lines[i + 2].split()[-1] == "8@cpu"
    assert lines[i + 3].strip() == "no kernel: __copy copies across devices"


# ---- the command ---------------------------------------------------------------------------------

def test_cli_on_a_fixture(fixtures_dir, tmp_path):
    p = tvmpipe("inspect", str(fixtures_dir / "resnet18_nnvm.json"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    lines = p.stdout.splitlines()
    assert lines[0].startswith("resnet18_nnvm  (bare graph.json ")
    assert "  nodes        71: 25 op, 46 null" in lines
    assert any(l.split() == ["69", "dense0", "fuse_dense", "66,67,68", "float32[1,1000]", "4"] for l in lines)
    assert_fits_100_columns(lines, fixtures_dir / "resnet18_nnvm.json")


def test_cli_json(fixtures_dir, tiny_bundle, tmp_path):
    for path, counts in ((fixtures_dir / "dlr_4in2out_nnvm.json", (6, 2, 2, 6, None)),
                         (tiny_bundle, (6, 3, 1, 6, 3))):
        p = tvmpipe("inspect", "--json", str(path), cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        r = json.loads(p.stdout)
        c = r["counts"]
        assert (c["nodes"], c["op_nodes"], c["heads"], c["entries"], c["kernel_launches"]) == counts
        assert set(r) == REPORT_KEYS and r["schema"] == SCHEMA


def test_cli_on_the_tiny_bundle(tiny_bundle, tmp_path):
    p = tvmpipe("inspect", str(tiny_bundle / "bundle.json"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "launch dense_add_kernel_1  grid 1x1x1  block 32x1x1  smem 0" in p.stdout
    assert "ops    matmul, add, nn.relu" in p.stdout


def test_cli_errors_are_one_paragraph_without_traceback(tiny_bundle, fixtures_dir, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text((fixtures_dir / "dlr_4in2out_nnvm.json").read_text()[:300])
    edit_json(tiny_bundle, "kernels.json", lambda k: k["functions"]["fused_multiply"]["launches"][0].update(kernel="gone"))
    for path, expected in ((broken, "not valid JSON"), (tiny_bundle, "kernel 'gone' is not defined in kernels.cu"),
                           (tmp_path / "absent", "no such bundle directory or graph.json file")):
        p = tvmpipe("inspect", str(path), cwd=tmp_path)
        assert p.returncode != 0
        assert "Traceback" not in p.stderr and p.stdout == ""
        assert p.stderr.startswith("tvmpipe inspect: error: 1 problem in ") and p.stderr.count("\n") == 1
        assert expected in p.stderr and str(path) in p.stderr
        assert "\n\n" not in p.stderr.strip()


def test_cli_on_examples_mlp(tmp_path):
    p = tvmpipe("inspect", str(EXAMPLES_DIR / "mlp"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "launch " in p.stdout and "ops    " in p.stdout
    r = json.loads(tvmpipe("inspect", "--json", str(EXAMPLES_DIR / "mlp"), cwd=tmp_path).stdout)
    assert r["kind"] == "bundle" and r["counts"]["kernel_launches"] >= r["counts"]["functions"] >= 1
