"""Published architectures (compiler/zoo.py) through both export paths, and the compiler fixes they needed.

The zoo subset and the decoders beyond GPT-2 and Llama run `tvmpipe.app.zoocheck.check_model`:
reference backend within 1e-4 x max|torch| of torch eager, TVM's CPU build of the same functions
too, K = 2 and 3 equal-op splits bit-identical to the single-process run. The whole zoo (and nvcc
for sm_80/sm_90 on every kernels.cu) is bench/zoo.py. Each fix below has a tiny model that failed before it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tvm")
pytest.importorskip("transformers")
pytestmark = pytest.mark.tvm


def quiet_export(path: Path):
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    return export(str(path), progress=Progress(stream=None))


def reference_and_cpu(ex, tmp_path: Path, inputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(reference backend output, TVM CPU build output) of an export, fed `inputs` in order."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.cpucheck import CpuRunner
    from tvmpipe.executor import GraphRunner

    b = load_bundle(ex.write(tmp_path / "bundle"))
    named = dict(zip(b.input_names, inputs))
    r = GraphRunner(b)
    r.set_input(**named)
    r.run()
    return r.get_output(0), CpuRunner.build(ex.unscheduled).run(b.graph, named, b.params)[0]


def save_pt2(module, args, path: Path) -> Path:
    import torch

    torch.export.save(torch.export.export(module, args), str(path))
    return path


# ---- the zoo subset ---------------------------------------------------------------------------------

# a CNN through ONNX (Clip -> maximum/minimum), BERT with a mask both ways (folded position ids;
# ONNX shape arithmetic), GPT-2 (a cumsum in its mask), Llama with a mask (RoPE, RMSNorm, SiLU, GQA)
SUBSET = [("mobilenet_v2", "onnx"), ("bert_mask", "pt2"), ("bert_mask", "onnx"), ("gpt2", "pt2"),
          ("llama_mask", "pt2")]


@pytest.mark.slow
@pytest.mark.parametrize("name, path", SUBSET, ids=[f"{n}-{p}" for n, p in SUBSET])
def test_zoo_model_matches_torch_and_splits_bit_identical(name, path, tmp_path):
    from tvmpipe.app.zoocheck import TOLERANCE, check_model

    r = check_model(name, path, tmp_path, nvcc=False, repeat=1)
    assert r.error is None, r.error
    assert r.ok and r.ref_error <= TOLERANCE and r.cpu_error <= TOLERANCE
    assert r.split_identical == {"K=2": True, "K=3": True}
    assert r.nodes > 10 and r.kernels >= r.nodes - r.nodes // 2  # a real network, most nodes launch kernels


# each zoo row is also checked in fp16 (bench/zoo.py --dtypes); two here: BERT through ONNX, Llama
FP16_SUBSET = [("bert_mask", "onnx"), ("llama_mask", "pt2")]


@pytest.mark.slow
@pytest.mark.parametrize("name, path", FP16_SUBSET, ids=[f"{n}-{p}-fp16" for n, p in FP16_SUBSET])
def test_zoo_model_in_float16_matches_torch_and_splits_bit_identical(name, path, tmp_path):
    from tvmpipe.app.zoocheck import FP16_CPU_TOLERANCE, FP16_TOLERANCE, check_model

    r = check_model(name, path, tmp_path, nvcc=False, repeat=1, dtype="float16")
    assert r.error is None, r.error
    assert r.dtype == "float16" and r.ok and r.ref_error <= FP16_TOLERANCE and r.cpu_error <= FP16_CPU_TOLERANCE
    assert r.ref_error > 1e-5  # really computed in fp16 (float32 would agree to ~1e-6)
    assert r.torch_fp16_error is not None and r.torch_fp16_error > 1e-5  # what fp16 costs torch itself
    assert r.split_identical == {"K=2": True, "K=3": True}


def test_zoo_models_build_without_torchvision_import():
    """torchvision's CUDA wheel cannot be imported on the CPU torch; its model definitions can."""
    from tvmpipe.compiler import zoo

    m = zoo.get_zoo_model("resnet50").build(0)
    assert type(m).__name__ == "ResNet" and sum(p.numel() for p in m.parameters()) > 25_000_000
    a, b = zoo.get_zoo_model("vit_small").build(0), zoo.get_zoo_model("vit_small").build(0)
    x = zoo.get_zoo_model("vit_small").inputs(0)
    out_a, out_b = zoo.torch_output(a, x), zoo.torch_output(b, x)
    assert out_a.tobytes() == out_b.tobytes() and np.abs(out_a).max() > 1e-3  # seeded, and the zero head redrawn


# ---- A: values that fold only after legalization ------------------------------------------------------

def test_constants_folded_after_legalization_are_params_not_ops(tmp_path):
    """transformers' position ids and causal masks: arange / where on constants, folded before ops.json
    is recorded (was: `internal: op ... reads 'lv..', which is neither an argument ...`)."""
    import torch

    class PosAndMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Parameter(torch.randn(32, 8, generator=torch.Generator().manual_seed(0)))

        def forward(self, x):
            mask = torch.where(torch.ones(16, 16, dtype=torch.bool).tril(), 0.0, float("-inf"))
            return torch.softmax(x @ x.T + mask, -1) @ (x + self.emb[torch.arange(16)])

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    ex = quiet_export(save_pt2(PosAndMask(), (x,), tmp_path / "m.pt2"))
    ops = {o["op"] for f in ex.ops["functions"].values() for o in f["ops"]}
    assert not ops & {"arange", "where", "take", "tril", "less_equal"}, ops
    assert "p_emb_take" in ex.params  # named after the weight it was computed from
    assert ex.model == "PosAndMask"  # the bundle is named after the exported module's class, not "m"
    ref, cpu = reference_and_cpu(ex, tmp_path, [x.numpy()])
    want = PosAndMask()(x).detach().numpy()
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cpu, want, rtol=1e-5, atol=1e-5)


# ---- D: scans ---------------------------------------------------------------------------------------

def test_cumsum_and_cumprod_compile_to_flat_kernels(tmp_path):
    """Was: `model op 'cumsum' ... TVM lowers it to relax.call_pure_packed(vm.builtin.reshape)`."""
    import torch

    class Scans(torch.nn.Module):
        def forward(self, x, m):
            pos = torch.cumsum(m, dim=-1) - 1  # transformers' position ids from a mask
            return torch.cumsum(x, dim=1) * 2 + pos[:, :, None] + torch.cumprod(x[:, :3] * 0.5 + 1, dim=0).sum()

    x = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    m = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    ex = quiet_export(save_pt2(Scans(), (x, m), tmp_path / "s.pt2"))
    ops = [o["op"] for f in ex.ops["functions"].values() for o in f["ops"]]
    assert ops.count("cumsum") == 2 and ops.count("cumprod") == 1
    ref, cpu = reference_and_cpu(ex, tmp_path, [x.numpy(), m.numpy()])
    want = Scans()(x, m).numpy()
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cpu, want, rtol=1e-5, atol=1e-5)
    for fn in ex.kernels["functions"].values():  # replayable: static launches, no host logic
        assert fn["launches"] and all(len(l["grid"]) == 3 for l in fn["launches"])


# ---- G and B: ONNX converters -------------------------------------------------------------------------

def _onnx(path: Path, nodes, inits, inputs, outputs) -> Path:
    import onnx
    from onnx import helper

    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_onnx_clip_and_scalar_constant_of_shape_compile(tmp_path):
    """G: Clip is emit_te(maximum/minimum) in TVM's importer (was: `cannot write attribute value
    I.GlobalVar("maximum")`). B: ConstantOfShape of an empty shape (a scalar) trips the importer's
    broadcast_to; constant shape arithmetic is folded with onnx's own evaluator first."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
             numpy_helper.from_array(np.array([], np.int64), "empty")]
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["c"], name="relu6"),
             helper.make_node("ConstantOfShape", ["empty"], ["one"], name="scalar_one",
                              value=numpy_helper.from_array(np.array([2.0], np.float32))),
             helper.make_node("Mul", ["c", "one"], ["y"], name="scale")]
    path = _onnx(tmp_path / "clip.onnx", nodes, inits,
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])])
    ex = quiet_export(path)
    assert [o["op"] for f in ex.ops["functions"].values() for o in f["ops"]] == ["maximum", "minimum", "multiply"]
    x = np.linspace(-4, 10, 10, dtype=np.float32).reshape(2, 5)
    ref, cpu = reference_and_cpu(ex, tmp_path, [x])
    np.testing.assert_array_equal(ref, np.clip(x, 0, 6) * 2)
    np.testing.assert_array_equal(cpu, np.clip(x, 0, 6) * 2)


def test_onnx_expand_to_an_initializer_shape_keeps_static_shapes(tmp_path):
    """transformers' ONNX attention: `Expand` to a shape held in an int64 initializer, then `Reshape`
    with a -1. TVM's importer turned the initializer into a parameter, the Expand's dims went
    symbolic and the Reshape failed (`Reshape expects the input tensor to have known shape`);
    integer initializers are now Constant nodes."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array([2, 3], np.int64), "to_shape"),
             numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    nodes = [helper.make_node("Expand", ["x", "to_shape"], ["e"], name="expand"),
             helper.make_node("Reshape", ["e", "flat"], ["y"], name="flatten")]
    path = _onnx(tmp_path / "expand.onnx", nodes, inits,
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6])])
    ex = quiet_export(path)
    x = np.arange(3, dtype=np.float32).reshape(1, 3)
    ref, cpu = reference_and_cpu(ex, tmp_path, [x])
    np.testing.assert_array_equal(ref, np.broadcast_to(x, (2, 3)).reshape(-1))
    np.testing.assert_array_equal(cpu, ref)


def test_shape_computed_at_run_time_names_the_builtin(tmp_path):
    """I: an Expand to a shape that is a graph input becomes `vm.builtin.tensor_to_shape` (was:
    `cannot rewrite binding 'lv35' (Call)`); the error names it and says what to change."""
    from onnx import TensorProto, helper

    from tvmpipe.compiler.errors import CompileError

    path = _onnx(tmp_path / "dyn.onnx", [helper.make_node("Expand", ["x", "s"], ["y"], name="expand")], [],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3]),
                  helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(CompileError) as info:
        quiet_export(path)
    assert "\n" not in str(info.value)
    assert re.search(r"model op 'vm\.builtin\.tensor_to_shape' at binding '\w+' is not supported.*static shapes",
                     str(info.value)), str(info.value)


def test_onnx_importer_failure_names_the_node_in_one_line(tmp_path, capfd):
    """A node TVM's importer rejects is named (name and op type); TVM's stdout dump is swallowed."""
    from onnx import TensorProto, helper

    from tvmpipe.compiler.errors import SourceError

    nodes = [helper.make_node("Relu", ["x"], ["r"], name="first"),
             helper.make_node("Reshape", ["r", "r_shape"], ["y"], name="bad_reshape")]
    path = _onnx(tmp_path / "bad.onnx", nodes, [],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                  helper.make_tensor_value_info("r_shape", TensorProto.FLOAT, [2])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(SourceError) as info:
        quiet_export(path)
    msg = str(info.value)
    assert "\n" not in msg and "node 'bad_reshape' (Reshape)" in msg, msg
    assert "Error converting operator" not in capfd.readouterr().out


# ---- H: a function dlight's rules cannot schedule ------------------------------------------------------

def test_function_dlight_rules_reject_gets_the_fallback_schedule(tmp_path, monkeypatch):
    """Was a ~280-line traceback from dlight on Swin-T at 64 px. A rule that raises on one function
    stands in for it: that function alone is scheduled by Fallback and the bundle still compiles."""
    import importlib

    import tvm.s_tir.dlight as dl

    export_mod = importlib.import_module("tvmpipe.compiler.export")  # the package re-exports a function of that name

    class Crashes(dl.ScheduleRule):
        def apply(self, func, target, tunable):
            if "log_softmax" in str(func.attrs) or "softmax" in func.script():
                raise TypeError("simulated dlight crash")
            return None

    real = export_mod.default_rules
    monkeypatch.setattr(export_mod, "default_rules", lambda: [Crashes()] + real())
    from tvmpipe.compiler.progress import Progress

    ex = export_mod.export("mlp", progress=Progress(stream=None))
    assert len(ex.kernels["functions"]) == 5 and "log_softmax" in ex.cuda_source


# ---- no traceback, ever ------------------------------------------------------------------------------

def test_cli_compile_failure_is_one_line_without_traceback(tmp_path):
    """An ONNX node TVM's importer cannot convert: `tvmpipe compile` prints one error line."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Reshape", ["x", "s"], ["y"], name="dyn_reshape")]
    path = _onnx(tmp_path / "m.onnx", nodes, [],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                  helper.make_tensor_value_info("s", TensorProto.FLOAT, [2])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    p = subprocess.run([sys.executable, "-m", "tvmpipe", "compile", str(path), "-o", str(tmp_path / "out"), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    errors = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    assert re.search(r"node 'dyn_reshape' \(Reshape\)", errors[0]), errors[0]
    assert not (tmp_path / "out").exists()


def test_every_dlight_rule_crashing_is_refused_in_one_line_naming_each_rule(monkeypatch):
    """A rule that raises hands the function to the next rule; when every rule raises (Fallback too),
    the refusal is one line that says what each rule raised."""
    import importlib

    import tvm.s_tir.dlight as dl

    from tvmpipe.compiler.errors import UnsupportedOpError
    from tvmpipe.compiler.progress import Progress

    export_mod = importlib.import_module("tvmpipe.compiler.export")

    def crashing(kind: str):
        class Crashes(dl.ScheduleRule):
            def apply(self, func, target, tunable):
                if "softmax" in func.script():
                    raise ValueError(f"simulated {kind} crash")
                return None
        Crashes.__name__ = kind
        return Crashes()

    monkeypatch.setattr(export_mod, "default_rules", lambda: [crashing("RuleA"), crashing("RuleB")])
    with pytest.raises(UnsupportedOpError) as info:
        export_mod.export("mlp", progress=Progress(stream=None))
    msg = str(info.value)
    assert "\n" not in msg and "dlight GPU scheduler fails on it" in msg, msg
    assert "RuleA: ValueError: simulated RuleA crash; RuleB: ValueError: simulated RuleB crash" in msg, msg


# ---- I: breadth of decoders (issue 24, item 6) ----------------------------------------------------------

class _FullRotary:
    """Phi-3 / GPT-NeoX partial rotary with the rotary dim = the head dim: `q[..., rot:]` is empty."""

    @staticmethod
    def module(rot: int = 16):
        import torch

        class Rotary(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
                f = torch.outer(torch.arange(8).float(), inv)
                self.register_buffer("cos", torch.cat([f, f], -1).cos()[None, None])
                self.register_buffer("sin", torch.cat([f, f], -1).sin()[None, None])

            def forward(self, q):
                q_rot, q_pass = q[..., :rot], q[..., rot:]
                half = rot // 2
                rotated = torch.cat((-q_rot[..., half:], q_rot[..., :half]), dim=-1)  # Llama's rotate_half
                q = torch.cat((q_rot * self.cos + rotated * self.sin, q_pass), dim=-1)
                return q[:, :, None].expand(1, 2, 2, 8, 16).reshape(1, 4, 8, 16)  # repeat_kv's broadcast_to

        return Rotary().eval()


@pytest.mark.parametrize("rot", [16, 8], ids=["whole-head", "partial"])
def test_rotary_embedding_with_an_empty_pass_through_compiles_and_matches_torch(rot, tmp_path):
    """Was (Phi-3): `model op 'strided_slice, strided_slice, negative, strided_slice, concat, multiply,
    multiply, add, concat, expand_dims, broadcast_to, reshape' ... TVM's dlight GPU scheduler fails on
    it (InternalError: Check failed: pb->value != 0 (0 vs. 0) : Divide by zero)`: the empty slice's
    loop of extent 0 made every rule, Fallback too, divide by zero. The empty operand is dropped."""
    import torch

    m = _FullRotary.module(rot)
    q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(0))
    ex = quiet_export(save_pt2(m, (q,), tmp_path / "rotary.pt2"))
    concats = [o for f in ex.ops["functions"].values() for o in f["ops"] if o["op"] == "concat"]
    assert len(concats) == (1 if rot == 16 else 2)  # rotate_half's; the empty pass-through's is gone
    ref, cpu = reference_and_cpu(ex, tmp_path, [q.numpy()])
    want = m(q).numpy()
    np.testing.assert_allclose(ref, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cpu, want, rtol=1e-6, atol=1e-6)


def test_torch_gather_compiles_and_runs_on_the_reference_backend(tmp_path):
    """Was: `gather_elements` compiled but the reference backend had no such op, so neither the
    oracle nor local mode could run the model. Indices computed in the graph (an argmax, gathered
    on dim -1) and given by the caller (gathered on dim 1 with fewer rows than x)."""
    import torch

    class Gathers(torch.nn.Module):
        def forward(self, x, idx):
            best = torch.argmax(x * x, dim=-1, keepdim=True)  # indices computed in the graph
            picked = torch.gather(x, -1, best)
            rows = torch.gather(x, 1, idx)  # caller's indices, fewer than x's rows
            return picked * 0.5 + rows[:, :1, :]

    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(0))
    idx = torch.randint(0, 5, (2, 4, 6), generator=torch.Generator().manual_seed(1))
    ex = quiet_export(save_pt2(Gathers(), (x, idx), tmp_path / "g.pt2"))
    ops = [o["op"] for f in ex.ops["functions"].values() for o in f["ops"]]
    assert ops.count("gather_elements") == 2, ops
    ref, cpu = reference_and_cpu(ex, tmp_path, [x.numpy(), idx.numpy()])
    want = Gathers()(x, idx).numpy()
    np.testing.assert_allclose(ref, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cpu, want, rtol=1e-6, atol=1e-6)


def test_constant_indices_passed_to_a_kernel_are_params_the_reference_reads(tmp_path):
    """BERT's, GPT-2's and Llama's mask lookup `mask[rows, cols]` with constant index tensors: FuseOps
    passes them to the lone index_tensor kernel as `(c0, c1)[i]`, graph.json makes each a param, but
    ops.json inlined their values. The kernel read the param and the reference its own copy, so after
    load_params the two disagreed (found on an H100: the GPU's load_params test, bert_mask). Now
    ops.json reads the arguments, and the compiler refuses a function whose ops ignore an argument."""
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import GraphRunner

    class MaskLookup(torch.nn.Module):
        def forward(self, x):
            rows = torch.zeros(1, 1, 1, 1, dtype=torch.long)
            cols = torch.arange(16).view(1, 1, 1, 16)
            return x[rows, cols] * 2.0

    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(0))
    ex = quiet_export(save_pt2(MaskLookup(), (x,), tmp_path / "m.pt2"))
    (fn,) = [f for f in ex.ops["functions"].values() if f["ops"][0]["op"] == "index_tensor"]
    assert fn["num_inputs"] == 3 and fn["ops"][0]["inputs"] == [{"arg": 0}, {"arg": 1}, {"arg": 2}]
    b = load_bundle(ex.write(tmp_path / "bundle"))
    (cols_param,) = [n for n in b.param_names if np.shape(b.params[n]) == (1, 1, 1, 16)]
    r = GraphRunner(b)
    r.run(x=x.numpy())
    np.testing.assert_array_equal(r.get_output(0).reshape(16), x.numpy()[0] * 2)
    r.load_params({cols_param: np.arange(16)[::-1].reshape(1, 1, 1, 16).astype(np.int64)})
    r.run(x=x.numpy())
    np.testing.assert_array_equal(r.get_output(0).reshape(16), x.numpy()[0, ::-1] * 2)


def test_negative_list_index_counts_from_the_back(tmp_path):
    """Falcon's `qkv[..., [-2], :]`: TVM imports it as a fast-mode `take` of the constant [-2], which
    TVM's kernel reads at offset -2 (outside the row); several index lists become an `index_tensor`,
    read the same way. Normalised to [extent - 2] at import (was: the reference clamped -2 to 0 and
    disagreed with torch, and with TVM's own CPU build, which read the previous row)."""
    import torch

    class LastHeads(torch.nn.Module):
        def forward(self, qkv):
            both = qkv[0][[-1, 0], [-3, 1]]  # two index lists: an index_tensor, [2, 4]
            return qkv[:, :, [-2]] * 2 + qkv[:, :, [-1]] + qkv[:, :, [0]] + both[None, :1, None]

    qkv = torch.randn(1, 3, 6, 4, generator=torch.Generator().manual_seed(0))
    ex = quiet_export(save_pt2(LastHeads(), (qkv,), tmp_path / "h.pt2"))
    ref, cpu = reference_and_cpu(ex, tmp_path, [qkv.numpy()])
    want = LastHeads()(qkv).numpy()
    np.testing.assert_allclose(ref, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cpu, want, rtol=1e-6, atol=1e-6)


# decoders beyond GPT-2 and Llama (issue 24, item 6), each with a padding mask, through .pt2: Phi-3's
# whole-head rotary (an empty pass-through slice) and Falcon's qkv[..., [-2]] (a negative take index)
# needed compiler fixes; Gemma, GPT-NeoX, OPT and Qwen3 compiled as they are
DECODERS = ["phi3_mask", "gemma_mask", "gpt_neox_mask", "opt_mask", "falcon_mask", "qwen3_mask"]


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODERS)
def test_more_decoders_match_torch_and_split_bit_identical(name, tmp_path):
    from tvmpipe.app.zoocheck import TOLERANCE, check_model

    r = check_model(name, "pt2", tmp_path, nvcc=False, repeat=1)
    assert r.error is None, r.error
    assert r.ok and r.ref_error <= TOLERANCE and r.cpu_error <= TOLERANCE
    assert r.split_identical == {"K=2": True, "K=3": True}
