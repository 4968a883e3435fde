"""Compile every built-in model, an ONNX file and a torch.export program; check the bundles.

Tolerance of the numerical check (float32): |bundle - source| <= 5e-5 * max(1, max|source|)
+ 1e-4 * |source|, elementwise. Measured errors are 3-10x below that (summation order only).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support.compiled_models import BUILTINS, FILE_SOURCES

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm

ALL = BUILTINS + FILE_SOURCES
F32_RTOL, F32_ATOL_SCALE = 1e-4, 5e-5


@pytest.mark.parametrize("name", ALL)
def test_bundle_loads_and_cross_checks(compiled, name):
    from tvmpipe.bundle import load_bundle

    c = compiled(name)
    b = load_bundle(c.bundle_dir)
    g = b.graph
    assert b.manifest.target == {"kind": "cuda", "arch": "sm_90"}
    assert b.input_names == c.exported.inputs and len(b.input_names) == 1
    # every kernel-launching node has launches whose kernels kernels.cu defines, and an op program
    for nid in g.op_nodes:
        node = g.nodes[nid]
        if node.is_nop:
            assert b.ops_of(nid) is None and not b.launches_of(nid)
            continue
        launches = b.launches_of(nid)
        assert launches, node.label()
        for launch in launches:
            assert f"__global__ void __launch_bounds__({launch.threads}) {launch.kernel}(" in b.cuda_source
        prog = b.ops_of(nid)
        assert prog.num_inputs == len(node.inputs) and prog.num_outputs == node.num_outputs
    # null nodes: the input, then params matching their entries; names unique
    names = [n.name for n in g.nodes]
    assert len(names) == len(set(names))
    assert sorted(b.params) == sorted(n for n in (g.nodes[i].name for i in g.null_nodes) if n not in b.input_names)
    # the storage plan shares ids between op outputs whose lifetimes do not overlap
    no_reuse, with_reuse = g.activation_bytes()
    if len([n for n in g.op_nodes if not g.nodes[n].is_nop]) > 2:
        assert with_reuse < no_reuse
    assert all(e.device_type == 2 for e in g.entries)


def test_graph_json_is_relay_style(compiled):
    graph = json.loads((compiled("cnn").bundle_dir / "graph.json").read_text())
    op = next(n for n in graph["nodes"] if n["op"] == "tvm_op")
    assert set(op["attrs"]) == {"func_name", "num_inputs", "num_outputs", "flatten_data"}
    assert all(isinstance(v, str) for v in op["attrs"].values()) and op["attrs"]["flatten_data"] == "0"
    assert all(len(ref) == 3 for n in graph["nodes"] for ref in n["inputs"])
    assert graph["arg_nodes"] == [i for i, n in enumerate(graph["nodes"]) if n["op"] == "null"]
    assert set(graph["attrs"]) == {"shape", "dltype", "storage_id", "device_index"}
    nops = [n for n in graph["nodes"] if n.get("attrs", {}).get("func_name") == "__nop"]
    assert len(nops) == 1  # the flatten before the classifier is a copy-free reshape
    row = graph["node_row_ptr"]
    sid = graph["attrs"]["storage_id"][1]
    src = nops[0]["inputs"][0][0]
    assert sid[row[graph["nodes"].index(nops[0])]] == sid[row[src]]


@pytest.mark.parametrize("name", ALL)
def test_numerics_match_source_model(compiled, name):
    """Independent check: the bundle's graph + params on disk, executed with TVM's LLVM build of the
    unscheduled fused functions (storage plan included), vs the source model (torch / ONNX reference)."""
    from tvmpipe.compiler.cpucheck import compare

    c = compiled(name)
    out, _ = c.cpu_run()
    assert len(out) == 1
    compare(out[0], c.reference, rtol=F32_RTOL, atol_scale=F32_ATOL_SCALE)


def test_numerics_catch_a_wrong_param(compiled):
    """The check is not vacuous: perturbing one weight by 1% breaks it."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.cpucheck import CpuRunner, compare

    c = compiled("mlp")
    b = load_bundle(c.bundle_dir)
    params = dict(b.params)
    name = sorted(params)[0]
    params[name] = params[name] * 1.01
    out = CpuRunner.build(c.exported.unscheduled).run(b.graph, {"x": c.x}, params)
    with pytest.raises(AssertionError, match="differ beyond"):
        compare(out[0], c.reference, rtol=F32_RTOL, atol_scale=F32_ATOL_SCALE)


@pytest.mark.parametrize("name", ALL)
def test_nvcc_compiles_kernels_for_sm80_and_sm90(compiled, name, tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc not installed")
    src = compiled(name).bundle_dir / "kernels.cu"
    procs = {arch: subprocess.Popen([nvcc, "--cubin", f"-arch={arch}", "-w", "-o", str(tmp_path / f"{arch}.cubin"),
                                     str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for arch in ("sm_80", "sm_90")}  # two cores: compile both at once
    for arch, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"nvcc -arch={arch} failed:\n{err[-2000:]}"
        assert (tmp_path / f"{arch}.cubin").stat().st_size > 0


def test_mlp_has_the_five_fused_functions(compiled):
    ops = compiled("mlp").exported.ops["functions"]
    assert [[o["op"] for o in f["ops"]] for f in ops.values()] == [
        ["matmul", "add", "nn.relu"], ["matmul", "add", "nn.relu"], ["matmul", "add", "nn.relu"],
        ["matmul", "add"], ["nn.log_softmax"],
    ]
    first = next(iter(ops.values()))
    assert first["ops"][0]["input_shapes"] == [[1, 100], [100, 400]]
    assert first["ops"][0]["inputs"] == [{"arg": 0}, {"arg": 1}]
    assert first["outputs"] == [{"op": 2}]


def test_weight_names_survive_constant_folding(compiled):
    params = compiled("mlp").exported.params
    assert sorted(params) == sorted([f"p_fc{i}_weight_permute_dims" for i in range(1, 5)]
                                    + [f"p_fc{i}_bias" for i in range(1, 5)])
    assert params["p_fc1_weight_permute_dims"].shape == (100, 400)  # pre-transposed at compile time
    # batch norm folded into the bias-less conv of the torch.export model
    assert "p_conv_weight_multiply" in compiled("pt2").exported.params


def test_resnet18_folds_batch_norm_and_fuses_residuals(compiled):
    ex = compiled("resnet18").exported
    progs = ex.ops["functions"]
    all_ops = {o["op"] for f in progs.values() for o in f["ops"]}
    assert "nn.batch_norm" not in all_ops and "nn.conv2d" in all_ops
    assert any([o["op"] for o in f["ops"]] == ["nn.conv2d", "add", "add", "nn.relu"] for f in progs.values())
    conv = next(o for f in progs.values() for o in f["ops"] if o["op"] == "nn.conv2d")
    assert conv["attrs"]["strides"] == [2, 2] and conv["attrs"]["padding"] == [3, 3, 3, 3]
    assert conv["input_shapes"] == [[1, 3, 224, 224], [64, 3, 7, 7]]


def test_transformer_ops_and_multi_kernel_functions(compiled):
    ex = compiled("transformer").exported
    all_ops = {o["op"] for f in ex.ops["functions"].values() for o in f["ops"]}
    assert {"nn.layer_norm", "nn.gelu", "nn.softmax", "permute_dims", "matmul"} <= all_ops
    ln = next(o for f in ex.ops["functions"].values() for o in f["ops"] if o["op"] == "nn.layer_norm")
    assert ln["attrs"]["axes"] == [-1] and ln["attrs"]["epsilon"] == pytest.approx(1e-12)
    div = next(o for f in ex.ops["functions"].values() for o in f["ops"] if o["op"] == "divide")
    assert div["inputs"][1] == {"const": {"dtype": "float32", "shape": [], "data": [8.0]}}


def test_onnx_batch_from_symbolic_dimension(compiled):
    ex = compiled("onnx").exported
    assert ex.batch == 3 and ex.input_shapes == [(3, 3, 16, 16)] and ex.inputs == ["data"]
    assert ex.source["kind"] == "onnx" and len(ex.source["sha256"]) == 64
    all_ops = [o["op"] for f in ex.ops["functions"].values() for o in f["ops"]]
    assert {"sigmoid", "multiply", "concat", "nn.softmax"} <= set(all_ops)


def test_float16_bundle(tmp_path):
    """--dtype float16 converts inputs, weights and compute; numerics within fp16 tolerance."""
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.cpucheck import CpuRunner, compare
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.models import example_input
    from tvmpipe.compiler.progress import Progress

    ex = export("mlp", dtype="float16", batch=2, progress=Progress(stream=None))
    b = load_bundle(ex.write(tmp_path / "mlp16"))
    assert b.manifest.dtype == "float16" and b.manifest.batch == 2
    assert {e.dtype for e in b.graph.entries} == {"float16"}
    assert all(p.dtype == np.float16 for p in b.params.values())
    assert "#include <cuda_fp16.h>" in b.cuda_source
    x = example_input((2, 100), "float16", 1)
    out = CpuRunner.build(ex.unscheduled).run(b.graph, {"x": x}, b.params)[0]
    with torch.no_grad():
        ref = ex.torch_module(torch.from_numpy(x.astype(np.float32))).numpy()
    compare(out, ref, rtol=2e-2, atol_scale=2e-2)  # fp16 accumulation over K=2000


@pytest.mark.parametrize("name", ALL)
def test_op_programs_compute_what_the_functions_compute(compiled, name):
    """ops.json, evaluated in NumPy from docs/ops.md semantics, matches every fused function's
    CPU build on the node's real inputs: the op records, their attrs and arg mapping are right."""
    from tests.support.ops_interpreter import run_program

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.cpucheck import compare

    c = compiled(name)
    b = load_bundle(c.bundle_dir)
    g = b.graph
    _, record = c.cpu_run()
    checked = set()
    for nid in g.op_nodes:
        node = g.nodes[nid]
        if node.is_nop or node.func_name in checked:
            continue
        checked.add(node.func_name)
        args = [record[e] for e in g.input_entry_ids(nid)]
        expected = [record[e] for e in g.node_entry_ids(nid)]
        got = run_program(b.ops[node.func_name].to_json(), args)
        for gv, ev in zip(got, expected):
            compare(gv, ev, rtol=F32_RTOL, atol_scale=F32_ATOL_SCALE)
    assert checked == set(b.ops)


def test_tuple_producing_op_and_two_outputs(tmp_path):
    from tests.support import model_files
    from tests.support.ops_interpreter import run_program

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.cpucheck import CpuRunner, compare
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.models import example_input
    from tvmpipe.compiler.progress import Progress

    path = model_files.write_two_output_onnx(tmp_path / "two.onnx")
    ex = export(str(path), progress=Progress(stream=None))
    b = load_bundle(ex.write(tmp_path / "b"))
    assert len(b.graph.heads) == 2
    split_fn = next(f for f in b.ops.values() if "split" in f.op_names)
    assert split_fn.num_outputs == 2
    assert [r.to_json() for r in split_fn.outputs] == [{"op": 1}, {"op": 1, "index": 1}]
    x = example_input((2, 8), "float32", 3)
    record: dict[int, np.ndarray] = {}
    outs = CpuRunner.build(ex.unscheduled).run(b.graph, {"data": x}, b.params, keep=record)
    for got, want in zip(outs, model_files.onnx_reference(path, x)):
        compare(got, want, rtol=F32_RTOL, atol_scale=F32_ATOL_SCALE)
    nid = next(n for n in b.graph.op_nodes if b.graph.nodes[n].func_name == split_fn.name)
    got = run_program(split_fn.to_json(), [record[e] for e in b.graph.input_entry_ids(nid)])
    for g, e in zip(got, b.graph.node_entry_ids(nid)):
        compare(g, record[e], rtol=F32_RTOL, atol_scale=F32_ATOL_SCALE)
