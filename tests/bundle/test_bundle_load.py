"""load_bundle / write_bundle on small hand-made bundles: every way the files can disagree is
caught, named by file and function/node/field, and reported together in one BundleError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tests.support.bundle_edits import edit_json, rewrite
from tests.support.tiny_bundle import TINY_CU, tiny_kernels, tiny_params, write_tiny
from tvmpipe.bundle import BundleError, load_bundle
from tvmpipe.bundle.params import save_npz

F32 = np.float32


def _kernels(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda b: edit_json(b, "kernels.json", fn)


def _ops(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda b: edit_json(b, "ops.json", fn)


def _manifest(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda b: edit_json(b, "bundle.json", fn)


def _params(**arrays: np.ndarray) -> Callable[[Path], None]:
    def edit(b: Path) -> None:
        save_npz(b / "params.npz", arrays)
        rewrite(b, "params.npz", (b / "params.npz").read_bytes())
    return edit


def _launch(fn_name: str, i: int) -> Callable[[dict], dict]:
    return lambda k: k["functions"][fn_name]["launches"][i]


DENSE, MUL = "fused_dense_add_relu", "fused_multiply"
W, B = tiny_params()["w"], tiny_params()["b"]

# (id, how to break the tiny bundle, [(file the problem names, substring of the problem)])
BREAKS = [
    ("no-launches-for-func", _kernels(lambda k: k["functions"].pop(MUL)),
     [("graph.json", "node 5 'scale', attrs.func_name: function 'fused_multiply' has no launch list in kernels.json")]),
    ("no-ops-for-func", _ops(lambda o: o["functions"].pop(DENSE)),
     [("graph.json", "node 3 'dense_relu', attrs.func_name: function 'fused_dense_add_relu' has no op list in ops.json")]),
    ("empty-launch-list", _kernels(lambda k: k["functions"][MUL].update(launches=[])),
     [("kernels.json", "function 'fused_multiply', launches: missing or empty")]),
    ("kernel-not-in-cu", _kernels(lambda k: _launch(DENSE, 1)(k).update(kernel="dense_add_kernel_2")),
     [("kernels.json", "function 'fused_dense_add_relu', launches[1].kernel: kernel 'dense_add_kernel_2' is not defined in kernels.cu")]),
    ("cu-lost-a-kernel", lambda b: rewrite(b, "kernels.cu", TINY_CU.replace("void __launch_bounds__(32) scale_kernel(", "void scale_kernel_v1(")),
     [("kernels.json", "function 'fused_multiply', launches[0].kernel: kernel 'scale_kernel' is not defined in kernels.cu")]),
    ("arg-out-of-range", _kernels(lambda k: _launch(MUL, 0)(k)["args"].__setitem__(1, {"arg": 2})),
     [("kernels.json", "function 'fused_multiply', launches[0].args[1]: argument 2 is out of range: node 5 'scale' passes 2 arguments")]),
    ("workspace-out-of-range", _kernels(lambda k: _launch(DENSE, 0)(k)["args"].__setitem__(3, {"workspace": 1})),
     [("kernels.json", "function 'fused_dense_add_relu', launches[0].args[3]: workspace 1 is out of range (function has 1 workspaces)")]),
    ("negative-arg", _kernels(lambda k: _launch(MUL, 0)(k)["args"].__setitem__(0, {"arg": -1})),
     [("kernels.json", "launches[0].args[0]: arg index must be a non-negative integer")]),
    ("scalar-overflows-int32", _kernels(lambda k: _launch(DENSE, 1)(k)["args"].__setitem__(2, {"scalar": 2**31, "dtype": "int32"})),
     [("kernels.json", "function 'fused_dense_add_relu', launches[1].args[2]: scalar needs a dtype")]),
    ("grid-over-cuda-limit", _kernels(lambda k: _launch(MUL, 0)(k).update(grid=[1, 70000, 1])),
     [("kernels.json", "function 'fused_multiply', launches[0].grid: [1, 70000, 1] is over CUDA's grid limit")]),
    ("block-too-many-threads", _kernels(lambda k: _launch(MUL, 0)(k).update(block=[1024, 2, 1])),
     [("kernels.json", "launches[0].block: (1024, 2, 1) has more than 1024 threads")]),
    ("shared-mem-too-large", _kernels(lambda k: _launch(MUL, 0)(k).update(shared_mem=1 << 20)),
     [("kernels.json", "function 'fused_multiply', launches[0].shared_mem: must be an integer in [0, 232448]")]),
    ("workspaces-not-list", _kernels(lambda k: k["functions"][DENSE].update(workspaces=12)),
     [("kernels.json", "function 'fused_dense_add_relu', workspaces: must be a list")]),
    ("ops-arg-out-of-range", _ops(lambda o: o["functions"][MUL]["ops"][0]["inputs"].__setitem__(0, {"arg": 1})),
     [("ops.json", "function 'fused_multiply', ops[0].inputs[0]: argument 1 is out of range (function has 1 inputs)")]),
    ("ops-forward-op-ref", _ops(lambda o: o["functions"][DENSE]["ops"][1]["inputs"].__setitem__(0, {"op": 2})),
     [("ops.json", "function 'fused_dense_add_relu', ops[1].inputs[0]: refers to op 2, which does not come earlier")]),
    ("ops-arity-disagrees-with-node", _ops(lambda o: o["functions"][MUL].update(num_outputs=2, outputs=[{"op": 0}, {"op": 0}])),
     [("ops.json", "function 'fused_multiply', num_inputs/num_outputs: says 1 in / 2 out but node 5 'scale' has 1 in / 1 out")]),
    ("ops-shapes-wrong-count", _ops(lambda o: o["functions"][MUL]["ops"][0].update(input_shapes=[[3]], input_dtypes=["float32"])),
     [("ops.json", "function 'fused_multiply', ops[0].input_shapes: has 1 shape(s) for 2 input(s)")]),
    ("ops-const-wrong-size", _ops(lambda o: o["functions"][MUL]["ops"][0]["inputs"][1]["const"].update(shape=[2])),
     [("ops.json", "function 'fused_multiply', ops[0].inputs[1]: const must be")]),
    ("param-wrong-shape", _params(w=W.T.copy(), b=B),
     [("params.npz", "param 'w': is float32[3, 4] but node 1 expects float32[4, 3]")]),
    ("param-wrong-dtype", _params(w=W, b=B.astype(np.float64)),
     [("params.npz", "param 'b': is float64[3] but node 2 expects float32[3]")]),
    ("param-missing", _params(w=W), [("params.npz", "param 'b': missing")]),
    ("param-extra", _params(w=W, b=B, zzz=np.zeros(2, F32)), [("params.npz", "param 'zzz': is not a param null node")]),
    ("params-npz-corrupt", lambda b: rewrite(b, "params.npz", b"PK\x03\x04 not really"), [("params.npz", "not a readable .npz archive")]),
    ("unknown-key-bundle-json", _manifest(lambda m: m.update(compression="zstd")), [("bundle.json", "compression: unknown key")]),
    ("unknown-key-params", _manifest(lambda m: m["params"].update(dtype="float32")), [("bundle.json", "params.dtype: unknown key")]),
    ("unknown-key-kernels-top", _kernels(lambda k: k.update(comment="x")), [("kernels.json", "comment: unknown key")]),
    ("unknown-key-kernels-function", _kernels(lambda k: k["functions"][MUL].update(stream=1)),
     [("kernels.json", "function 'fused_multiply', stream: unknown key")]),
    ("unknown-key-launch", _kernels(lambda k: _launch(MUL, 0)(k).update(cluster=[1, 1, 1])),
     [("kernels.json", "function 'fused_multiply', launches[0].cluster: unknown key")]),
    ("unknown-key-workspace", _kernels(lambda k: k["functions"][DENSE]["workspaces"][0].update(align=16)),
     [("kernels.json", "function 'fused_dense_add_relu', workspaces[0].align: unknown key")]),
    ("unknown-key-ops-top", _ops(lambda o: o.update(tvm="0.27")), [("ops.json", "tvm: unknown key")]),
    ("unknown-key-ops-function", _ops(lambda o: o["functions"][MUL].update(pattern="elemwise")),
     [("ops.json", "function 'fused_multiply', pattern: unknown key")]),
    ("unknown-key-op-record", _ops(lambda o: o["functions"][DENSE]["ops"][2].update(layout="NC")),
     [("ops.json", "function 'fused_dense_add_relu', ops[2].layout: unknown key")]),
    ("unknown-key-graph-node", lambda b: edit_json(b, "graph.json", lambda g: g["nodes"][3].update(device="cuda")),
     [("graph.json", "node 3 'dense_relu', device: unknown node key")]),
    ("checksum-mismatch", lambda b: (b / "graph.json").write_text((b / "graph.json").read_text() + "\n"),
     [("graph.json", "sha256 differs from bundle.json")]),
    ("no-checksum", _manifest(lambda m: m["files"].pop("ops.json")), [("bundle.json", "files.ops.json: no sha256")]),
    ("missing-ops-json", lambda b: (b / "ops.json").unlink(), [("ops.json", "missing required bundle file")]),
    ("missing-kernels-cu", lambda b: (b / "kernels.cu").unlink(), [("kernels.cu", "missing required bundle file")]),
    ("missing-params-file", lambda b: (b / "params.npz").unlink(), [("params.npz", "missing required bundle file")]),
    ("missing-listed-file", _manifest(lambda m: m["files"].update({"README.md": "0" * 64})),
     [("README.md", "listed in bundle.json files but missing")]),
    ("file-outside-bundle", _manifest(lambda m: m["files"].update({"../graph.json": "0" * 64})),
     [("bundle.json", "files.../graph.json: must map a file name inside the bundle")]),
    ("params-file-outside-bundle", _manifest(lambda m: m["params"].update(file="/etc/passwd")),
     [("bundle.json", "params.file: must be null or a .safetensors / .npz / .params file name")]),
    ("bad-version", _manifest(lambda m: m.update(version=3)), [("bundle.json", "version: unsupported format version 3")]),
    ("v2-key-in-v1", _manifest(lambda m: m.update(version=1, state=[])), [("bundle.json", "state: needs format version 2")]),
    ("bad-format", _manifest(lambda m: m.update(format="tvm-graph")), [("bundle.json", "format: must be 'tvmpipe-bundle'")]),
    ("bad-kernels-version", _kernels(lambda k: k.update(version=2)), [("kernels.json", "version: unsupported version 2")]),
    ("bad-ops-version", _ops(lambda o: o.pop("version")), [("ops.json", "version: unsupported version None")]),
    ("batch-bool", _manifest(lambda m: m.update(batch=True)), [("bundle.json", "batch: must be a positive integer")]),
    ("negative-seed", _manifest(lambda m: m["params"].update(file=None, generated={"seed": -1})),
     [("bundle.json", "params.generated: must be null or {\"seed\": <non-negative int>}")]),
    ("input-is-op-node", _manifest(lambda m: m.update(inputs=["dense_relu"])),
     [("bundle.json", "inputs/params.names: 'dense_relu' is not a null node of graph.json")]),
    ("input-names-not-strings", _manifest(lambda m: m.update(inputs=[0])), [("bundle.json", "inputs: must be a list of node names")]),
    ("input-also-param", _manifest(lambda m: m["params"].update(names=["x", "w", "b"])),
     [("bundle.json", "'x' is listed both as a graph input and as a param")]),
    ("null-node-unfed", _manifest(lambda m: m["params"].update(names=["w"])),
     [("bundle.json", "node 2 'b' is neither a graph input nor a param")]),
    ("kernels-json-not-json", lambda b: rewrite(b, "kernels.json", '{"version": 1, "functions": {'),
     [("kernels.json", "not readable JSON")]),
    ("bundle-json-not-json", lambda b: rewrite(b, "bundle.json", "{"), [("bundle.json", "not readable JSON")]),
]


def test_the_tiny_bundle_is_valid(tiny_bundle):
    b = load_bundle(tiny_bundle)
    assert b.name == "tiny" and not b.is_bare
    assert b.input_names == ["x"] and b.param_names == ["w", "b"]
    assert [len(b.launches_of(n)) for n in (3, 4, 5)] == [2, 0, 1]
    assert b.ops_of(3).op_names == ["matmul", "add", "nn.relu"]
    assert b.kernels["fused_dense_add_relu"].workspaces[0].nbytes == 12
    np.testing.assert_array_equal(b.params["w"], W)
    assert load_bundle(tiny_bundle / "bundle.json").graph.to_json() == b.graph.to_json()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", BREAKS, ids=[c[0] for c in BREAKS])
def test_each_break_is_caught_and_named(tiny_bundle, case):
    _, brk, expected = case
    brk(tiny_bundle)
    with pytest.raises(BundleError) as info:
        load_bundle(tiny_bundle)
    problems = [str(p) for p in info.value.problems]
    for file, part in expected:
        assert any(p.startswith(str(tiny_bundle / file)) and part in p for p in problems), \
            f"no problem naming {file} with {part!r} in:\n" + "\n".join(problems)


def _problems(bundle: Path) -> list[str]:
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    return [str(p) for p in info.value.problems]


def test_all_problems_are_reported_at_once(tiny_bundle):
    # one break per file and kind, chosen so that none hides another (each edits a different spot)
    chosen = ["no-ops-for-func", "cu-lost-a-kernel", "workspace-out-of-range", "arg-out-of-range",
              "ops-arg-out-of-range", "param-wrong-shape", "unknown-key-bundle-json", "unknown-key-params",
              "unknown-key-kernels-top", "unknown-key-launch", "unknown-key-ops-function", "checksum-mismatch",
              "missing-listed-file", "bad-version", "bad-kernels-version", "bad-ops-version"]
    cases = {c[0]: c for c in BREAKS}
    for name in chosen:
        cases[name][1](tiny_bundle)
    problems = _problems(tiny_bundle)
    for name in chosen:
        for file, part in cases[name][2]:
            assert any(p.startswith(str(tiny_bundle / file)) and part in p for p in problems), (name, problems)
    assert len(problems) == len(chosen)


def test_problems_name_launches_by_their_position_in_the_file(tiny_bundle):
    edit_json(tiny_bundle, "kernels.json", lambda k: _launch(DENSE, 0)(k).update(grid=[0, 1, 1]))
    edit_json(tiny_bundle, "kernels.json", lambda k: _launch(DENSE, 1)(k).update(kernel="undefined_kernel"))
    problems = _problems(tiny_bundle)
    # launch 1 is not cross-checked while launch 0 is unreadable: it would be reported as launch 0
    assert len(problems) == 1 and "function 'fused_dense_add_relu', launches[0].grid: must be [x, y, z]" in problems[0]


def test_a_broken_graph_does_not_hide_the_other_files(tiny_bundle):
    edit_json(tiny_bundle, "graph.json", lambda g: g["nodes"][5]["inputs"].__setitem__(0, [9, 0, 0]))
    edit_json(tiny_bundle, "kernels.json", lambda k: _launch(MUL, 0)(k).update(kernel="nope", grid=[0, 1, 1]))
    (tiny_bundle / "ops.json").unlink()
    problems = _problems(tiny_bundle)
    assert any("graph.json: node 5 'scale', inputs[0]: dangling reference to node 9" in p for p in problems)
    assert any("kernels.json: function 'fused_multiply', launches[0].grid: must be [x, y, z]" in p for p in problems)
    assert any("ops.json: missing required bundle file" in p for p in problems)


def test_bare_graph_json_and_bad_paths(tiny_bundle, tmp_path):
    bare = load_bundle(tiny_bundle / "graph.json")
    assert bare.is_bare and bare.name == "graph" and bare.kernels == {} and bare.params == {}
    with pytest.raises(BundleError, match="no such bundle directory or graph.json file"):
        load_bundle(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="not a tvmpipe bundle"):
        load_bundle(tmp_path / "empty")


def test_checksums_can_be_skipped(tiny_bundle):
    (tiny_bundle / "kernels.cu").write_text(TINY_CU + "// local edit\n")
    assert load_bundle(tiny_bundle, verify_checksums=False).cuda_source.endswith("// local edit\n")


# ---- writing -------------------------------------------------------------------------------------

def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_write_refuses_an_invalid_bundle_and_leaves_nothing(tmp_path):
    broken = tiny_kernels()
    broken["functions"]["fused_multiply"]["launches"][0]["kernel"] = "missing_kernel"
    with pytest.raises(BundleError) as info:
        write_tiny(tmp_path / "tiny", kernels=broken)
    message = str(info.value)
    assert f"{tmp_path / 'tiny' / 'kernels.json'}: function 'fused_multiply', launches[0].kernel" in message
    assert ".tmp-" not in message  # problems name the bundle the caller asked for, not the temp dir
    assert _leftovers(tmp_path) == []


def test_write_overwrites_atomically(tmp_path):
    out = write_tiny(tmp_path / "tiny")
    with pytest.raises(BundleError, match="already exists"):
        write_tiny(out)
    before = (out / "params.npz").read_bytes()
    with pytest.raises(BundleError):  # an invalid replacement leaves the old bundle as it was
        write_tiny(out, overwrite=True, params={"w": W})
    assert (out / "params.npz").read_bytes() == before
    load_bundle(out)
    write_tiny(out, overwrite=True, params=tiny_params(seed=1))
    np.testing.assert_array_equal(load_bundle(out).params["w"], tiny_params(seed=1)["w"])
    assert _leftovers(tmp_path) == ["tiny"]


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_write_interrupted_midway_leaves_nothing(tmp_path, monkeypatch, exc):
    import tvmpipe.bundle.bundle as bundle_module

    def fail(*_args):
        raise exc
    monkeypatch.setattr(bundle_module, "save_npz", fail)
    with pytest.raises(type(exc)):
        write_tiny(tmp_path / "tiny")
    assert _leftovers(tmp_path) == []


def test_write_with_generated_params(tmp_path):
    out = write_tiny(tmp_path / "gen", params=None, params_seed=7)
    m = json.loads((out / "bundle.json").read_text())
    assert m["params"] == {"file": None, "generated": {"seed": 7}}
    assert sorted(m["files"]) == ["graph.json", "kernels.cu", "kernels.json", "ops.json"]
    a, b = load_bundle(out), load_bundle(out)
    assert sorted(a.params) == ["b", "w"]
    assert a.params["w"].shape == (4, 3) and a.params["w"].dtype == F32
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    with pytest.raises(BundleError, match="neither a params file nor generated weights"):
        write_tiny(tmp_path / "none", params=None)
    assert _leftovers(tmp_path) == ["gen"]


def test_generated_params_over_the_size_limit_are_refused(tmp_path):
    """A graph that asks for terabytes of generated weights must fail on load, not allocate."""
    from tests.support.tiny_bundle import tiny_graph

    g = tiny_graph()
    g["attrs"]["shape"][1][1] = [1 << 16, 1 << 16]  # param 'w': 16 GiB of float32
    with pytest.raises(BundleError, match=r"generating weights would allocate \d+ bytes"):
        write_tiny(tmp_path / "huge", graph=g, params=None, params_seed=0)
    assert _leftovers(tmp_path) == []
