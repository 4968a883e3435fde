"""Bad inputs fail with a clear error naming the problem, and leave the output directory alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import model_files

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm


def compile_quiet(source: str | Path, out: Path, **kw):
    from tvmpipe.compiler.export import compile_model
    from tvmpipe.compiler.progress import Progress

    return compile_model(str(source), out, progress=Progress(stream=None), **kw)


def assert_nothing_written(parent: Path, expected: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == expected  # no bundle, no temporary sibling


def test_missing_onnx_file(tmp_path):
    from tvmpipe.compiler.errors import SourceError

    with pytest.raises(SourceError, match=r"missing\.onnx: no such file"):
        compile_quiet(tmp_path / "missing.onnx", tmp_path / "out")
    assert_nothing_written(tmp_path, set())


def test_corrupt_onnx_file(tmp_path):
    from tvmpipe.compiler.errors import SourceError

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07this is not a protobuf\xff\xff")
    with pytest.raises(SourceError, match=r"bad\.onnx: not a readable ONNX model"):
        compile_quiet(bad, tmp_path / "out")
    assert_nothing_written(tmp_path, {"bad.onnx"})


def test_corrupt_pt2_file(tmp_path):
    from tvmpipe.compiler.errors import SourceError

    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(SourceError, match=r"bad\.pt2: not a readable torch\.export program"):
        compile_quiet(bad, tmp_path / "out")
    assert_nothing_written(tmp_path, {"bad.pt2"})


def test_unknown_model_name(tmp_path):
    from tvmpipe.compiler.errors import SourceError

    with pytest.raises(SourceError, match=r"'resnet50' is not a file and not a built-in model "
                                          r"\(built-in models: mlp, cnn, resnet18, transformer"):
        compile_quiet("resnet50", tmp_path / "out")
    assert_nothing_written(tmp_path, set())


def test_unknown_file_type(tmp_path):
    from tvmpipe.compiler.errors import SourceError

    f = tmp_path / "model.tflite"
    f.write_bytes(b"x")
    with pytest.raises(SourceError, match=r"unknown model file type '\.tflite'"):
        compile_quiet(f, tmp_path / "out")


@pytest.mark.parametrize("onnx_op, op, reason", [
    ("TopK", "topk", r"operand .* is computed at run time"),
])
def test_sort_ops_are_rejected_naming_op_and_node(tmp_path, onnx_op, op, reason):
    from tvmpipe.compiler.errors import UnsupportedOpError

    src = model_files.write_unsupported_onnx(tmp_path / f"{op}.onnx", onnx_op)
    with pytest.raises(UnsupportedOpError) as info:
        compile_quiet(src, tmp_path / "out")
    err = info.value
    assert err.op == op and err.node
    assert re.search(rf"model op '{op}' in graph node '{re.escape(err.node)}' is not supported", str(err))
    assert re.search(reason, str(err))
    assert_nothing_written(tmp_path, {f"{op}.onnx"})


def test_onnx_cumsum_compiles_and_matches_onnx_reference(tmp_path):
    """Scans were rejected (`TVM lowers it to relax.call_pure_packed(vm.builtin.reshape)`); now one
    reduction kernel each (compiler/scanops.py)."""
    import numpy as np

    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import GraphRunner

    src = model_files.write_unsupported_onnx(tmp_path / "cumsum.onnx", "CumSum")
    b = load_bundle(compile_quiet(src, tmp_path / "out"))
    assert "cumsum" in [o.op for nid in b.graph.op_nodes if b.ops_of(nid) for o in b.ops_of(nid).ops]
    x = np.random.default_rng(0).standard_normal(b.graph.entries[0].shape).astype(np.float32)
    r = GraphRunner(b)
    r.set_input(b.input_names[0], x)
    r.run()
    import onnx
    from onnx.reference import ReferenceEvaluator

    want = ReferenceEvaluator(onnx.load(str(src))).run(None, {"x": x})[0]
    np.testing.assert_allclose(r.get_output(0), want, rtol=1e-5, atol=1e-5)


def test_failed_compile_leaves_existing_bundle_untouched(tmp_path):
    from tvmpipe.compiler.errors import CompileError, UnsupportedOpError

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old bundle")
    with pytest.raises(CompileError, match="already exists"):
        compile_quiet("mlp", out)
    src = model_files.write_unsupported_onnx(tmp_path / "topk.onnx", "TopK")
    with pytest.raises(UnsupportedOpError):
        compile_quiet(src, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "old bundle"
    assert_nothing_written(tmp_path, {"out", "topk.onnx"})


def test_pt2_batch_mismatch(tmp_path):
    from tvmpipe.compiler.errors import SourceError

    path = tmp_path / "small.pt2"
    model_files.write_pt2(path, batch=2)
    with pytest.raises(SourceError, match=r"exported with batch 2; --batch 4 needs a re-export"):
        compile_quiet(path, tmp_path / "out", batch=4)


def test_cli_reports_errors_without_traceback_and_shows_steps(tmp_path, capsys):
    from tvmpipe.cli import main

    rc = main(["compile", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "tvmpipe compile: error: " in err and "nope.onnx: no such file" in err
    assert "Traceback" not in err
    assert re.search(r"^\[\s*\d+\.\ds\] load tvm, torch, onnx \.\.\. done \(\d+\.\ds\)$", err, re.M)
    assert re.search(r"^\[\s*\d+\.\ds\] import .*nope\.onnx \.\.\. failed$", err, re.M)


def test_cli_compiles_a_bundle(tmp_path, capsys):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cli import main

    onnx_path = model_files.write_onnx_model(tmp_path / "m.onnx")
    rc = main(["compile", str(onnx_path), "-o", str(tmp_path / "b"), "--arch", "sm_80", "--batch", "2"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.strip() == str((tmp_path / "b").resolve())
    for step in ("import", "fold", "fuse", "schedule", "codegen", "write"):
        assert re.search(rf"^\[\s*\d+\.\ds\] {step}.* \.\.\. done \(\d+\.\ds\)$", captured.err, re.M), step
    b = load_bundle(tmp_path / "b")
    assert b.manifest.target == {"kind": "cuda", "arch": "sm_80"} and b.manifest.batch == 2
    assert b.manifest.source["kind"] == "onnx" and b.manifest.params_seed is None


@pytest.mark.parametrize("kw, message", [
    ({"arch": "sm_70"}, r"--arch 'sm_70': expected sm_XY with XY >= 75"),
    ({"arch": "hopper"}, r"--arch 'hopper': expected sm_XY"),
    ({"dtype": "int8"}, r"unsupported --dtype 'int8' \(supported: float32, float16, bfloat16\)"),
    ({"batch": 0}, r"--batch must be a positive integer, got 0"),
])
def test_bad_options(tmp_path, kw, message):
    from tvmpipe.compiler.errors import CompileError

    with pytest.raises(CompileError, match=message):
        compile_quiet("mlp", tmp_path / "out", **kw)
    assert_nothing_written(tmp_path, set())


def test_omit_params_is_refused_where_generated_values_would_change_the_model(tmp_path):
    """generate_params zeroes integer params: an index tensor the model gathers with would become all
    zeros, a different model behind the same kernels. --omit-params refuses, naming the param, and
    writes nothing; the same program compiles with its params."""
    import torch

    from tvmpipe.compiler.errors import CompileError

    class Gather(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))
            self.register_buffer("idx", torch.tensor([3, 1, 2, 0, 7, 6, 5, 4]))

        def forward(self, x):
            return torch.index_select(x @ self.w, 1, self.idx)

    pt2 = tmp_path / "gather.pt2"
    torch.export.save(torch.export.export(Gather(), (torch.randn(2, 8),)), pt2)
    with pytest.raises(CompileError, match=r"--omit-params would generate param '\w+' \(int64 \[8\]\)"):
        compile_quiet(pt2, tmp_path / "out", omit_params=True)
    assert_nothing_written(tmp_path, {"gather.pt2"})
    assert compile_quiet(pt2, tmp_path / "out").is_dir()
