"""`tvmpipe compile DIR --decode --quantize int4|int8 [--group-size G]`: group-quantized linear layers.

The qwen2 checkpoint of the covering set (float32, untied: its head is quantized too) compiled
with int4 (MLC's q4f16_1: groups of 32, a float16 scale each) and int8 in groups of 64 gives, on
the reference backend, the greedy tokens of transformers' model of the same checkpoint holding the
same fake-quantized weights (each linear weight replaced by compiler.quantize.fake_quantize of it,
which at group 32 is gguf's Q4_0 / Q8_0 round trip bit for bit), logits within 1e-4 x max|logits|;
int4's weights take <= 0.3x the float32 checkpoint's. GPT-2's Conv1D layers are quantized as the
Linear layers of the same function (their weights transposed), held to the same reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.checkpoints import load_transformers, tensor_bytes

pytest.importorskip("tvm")
pytest.importorskip("gguf")
pytestmark = pytest.mark.tvm

PROMPT = [5, 17, 3, 60, 9]
NEW = 8


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int8", 64)])
def test_a_quantized_checkpoint_gives_the_fake_quantized_models_tokens(scheme, group, checkpoint, tmp_path):
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.compiler.quantize import fake_quantize

    ckpt = checkpoint("qwen2")
    export(str(ckpt), decode=24, quantize=scheme, group_size=group, progress=Progress(stream=None)).write(tmp_path / "b")
    b = load_bundle(tmp_path / "b")
    # every linear layer, the head and the embedding
    assert b.manifest.source["quantize"] == {"scheme": scheme, "group_size": group, "layers": 2 * 7 + 2}
    # inspect shows each quantized matrix once, in its format, with its packed bytes (codes + f16 scales)
    from tvmpipe.bundle.inspect import build_report

    shown = [w for w in build_report(b)["weights"] if w["format"] == scheme]
    assert len(shown) == 2 * 7 + 2, [w["name"] for w in shown]
    for w in shown:
        rows, cols = w["shape"]
        assert w["bytes"] == rows * cols * (1 if scheme == "int8" else 1 / 2) + rows * cols // group * 2, w
    _assert_unpacked_in_matmuls(tmp_path / "b")
    model = load_transformers(ckpt, "float32")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                w = m.weight.numpy()
                q = fake_quantize(w, scheme, group)
                assert 0 < np.abs(q - w).max() < 0.1 * np.abs(w).max()  # changed, and not beyond recognition
                m.weight.copy_(torch.from_numpy(q))
    _assert_the_models_tokens(tmp_path / "b", model)
    weights = sum(b.param_nbytes(n) for n in b.param_names)
    limit = 0.3 if scheme == "int4" else 0.6
    assert weights <= limit * tensor_bytes(ckpt), (weights, tensor_bytes(ckpt))


def _assert_the_models_tokens(bundle_dir, model) -> None:
    """The bundle's greedy tokens are the (fake-quantized) torch model's, not one repeated token,
    and every step's logits within 1e-4 x max|ref| of its own."""
    from tvmpipe.compiler.decoders import transformers_generate, transformers_logits
    from tvmpipe.executor.decode_loop import greedy_decode

    want = transformers_generate(model, PROMPT, NEW)
    assert len(set(want)) > 1, want
    got = greedy_decode(bundle_dir, PROMPT, NEW)
    assert got.tokens[0] == want
    logits = np.stack([step[0] for step in got.logits])
    ref = transformers_logits(model, PROMPT + want)[:len(logits)]
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


def _assert_unpacked_in_matmuls(bundle) -> None:
    """Every function reading a packed field (bundle.json source.packed) is a matmul's, one launch,
    or the embedding's gather of a token's rows."""
    import json

    from tvmpipe.bundle import load_bundle

    b = load_bundle(bundle)
    ops = json.loads((bundle / "ops.json").read_text())["functions"]
    kernels = json.loads((bundle / "kernels.json").read_text())["functions"]
    packed = {n for m in b.manifest.source["packed"].values() for n in m["fields"].values()}
    readers = 0
    for node in b.graph.nodes:
        if node.op == "tvm_op" and {b.graph.nodes[i.node].name for i in node.inputs} & packed:
            fn = node.attrs["func_name"]
            kinds = [o["op"] for o in ops[fn]["ops"]]
            if "take" in kinds and "matmul" not in kinds:  # the embedding's gather: a token's rows
                continue
            assert "matmul" in kinds and len(kernels[fn]["launches"]) == 1, fn
            readers += 1
    assert readers >= 2 * 4  # a layer's projections may share a function (gate and up)


def test_a_bf16_checkpoint_quantizes_and_computes_in_bf16(checkpoint, tmp_path):
    """llama (bf16, tied) with int4: the embedding quantized and read packed by the lookup and the
    tied head alike; the bundle computes in bf16 (each weight unpacked in float32 and rounded once
    to bf16), and gives the tokens of transformers' bf16 model holding those bf16 weights."""
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import transformers_generate
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.compiler.quantize import fake_quantize
    from tvmpipe.executor.decode_loop import greedy_decode

    ckpt = checkpoint("llama")
    export(str(ckpt), decode=24, quantize="int4", progress=Progress(stream=None)).write(tmp_path / "b")
    b = load_bundle(tmp_path / "b")
    assert b.manifest.dtype == "bfloat16" and b.manifest.source["quantize"]["layers"] == 2 * 7 + 1  # + embedding
    _assert_unpacked_in_matmuls(tmp_path / "b")
    model = load_transformers(ckpt, "bfloat16")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():  # the tied head is the embedding: quantized once, read by both
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and m is not model.get_output_embeddings():
                m.weight.copy_(torch.from_numpy(fake_quantize(m.weight.float().numpy(), "int4", 32)).to(torch.bfloat16))
    want = transformers_generate(model, PROMPT, NEW)
    assert len(set(want)) > 1, want
    assert greedy_decode(tmp_path / "b", PROMPT, NEW).tokens[0] == want


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int8", 64)])
def test_gpt2s_conv1d_layers_are_quantized_as_the_linears_of_the_same_function(scheme, group, checkpoint, tmp_path):
    """GPT-2 (float32, tied): its Conv1D layers (c_attn, attn.c_proj, c_fc, mlp.c_proj; weight
    [in, out], x @ W + b) are quantized too, as Linear layers of the same function whose weight
    [out, in] is the checkpoint's transposed, grouped along the input features; with the
    embedding (read by the tied head) int4 takes <= 0.3x the float32 checkpoint's weight bytes.
    The tokens and logits are those of transformers' GPT-2 holding each Conv1D weight W as
    fake_quantize(W.T).T and the embedding fake-quantized (the position table stays float)."""
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.inspect import build_report
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.compiler.quantize import fake_quantize

    ckpt = checkpoint("gpt2")
    export(str(ckpt), decode=24, quantize=scheme, group_size=group, progress=Progress(stream=None)).write(tmp_path / "b")
    b = load_bundle(tmp_path / "b")
    assert b.manifest.source["quantize"] == {"scheme": scheme, "group_size": group, "layers": 2 * 4 + 1}
    by_name = {w["name"]: w for w in build_report(b)["weights"]}
    hidden = 64
    for name, shape in (("h_0_attn_c_attn", [3 * hidden, hidden]), ("h_1_attn_c_proj", [hidden, hidden]),
                        ("h_0_mlp_c_fc", [4 * hidden, hidden]), ("h_1_mlp_c_proj", [hidden, 4 * hidden])):
        w = by_name[f"p_model_transformer_{name}"]
        assert w["format"] == scheme and w["shape"] == shape, w
    assert by_name["p_model_transformer_wpe_weight"]["format"] == "float32"
    _assert_unpacked_in_matmuls(tmp_path / "b")
    weights = sum(b.param_nbytes(n) for n in b.param_names)
    limit = 0.3 if scheme == "int4" else 0.6
    assert weights <= limit * tensor_bytes(ckpt), (weights, tensor_bytes(ckpt))
    model = load_transformers(ckpt, "float32")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    convs = 0
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Conv1D":  # weight [in, out]: quantized as the Linear's [out, in]
                w = m.weight.numpy()
                q = fake_quantize(np.ascontiguousarray(w.T), scheme, group).T
                assert 0 < np.abs(q - w).max() < 0.2 * np.abs(w).max()  # changed, not beyond recognition
                m.weight.copy_(torch.from_numpy(np.ascontiguousarray(q)))
                convs += 1
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.from_numpy(fake_quantize(emb.numpy(), scheme, group)))
    assert convs == 2 * 4
    _assert_the_models_tokens(tmp_path / "b", model)


def test_group_32_values_are_ggufs_q4_0_and_q8_0_round_trips():
    from gguf import GGMLQuantizationType as T, quants

    from tvmpipe.compiler.quantize import fake_quantize

    w = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    for scheme, qt in (("int4", T.Q4_0), ("int8", T.Q8_0)):
        assert np.array_equal(fake_quantize(w, scheme, 32), quants.dequantize(quants.quantize(w, qt), qt))


def test_int4_matmuls_are_scheduled_by_dlights_gemv_rule(checkpoint):
    """int4's flat layout reads each value's codes and scale at one index each, with nothing else per
    value, so at batch 1 dlight's GEMV rule (as export's schedule step tries the rules) takes every
    fused unpack + matmul."""
    import tvm.s_tir.dlight as dl

    from tests.support.dlight_rule import rule_taken
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    ex = export(str(checkpoint("qwen2")), decode=24, quantize="int4", progress=Progress(stream=None))
    taken = {}
    for gv, func in ex.unscheduled.functions.items():
        name = gv.name_hint
        if "matmul" not in name or "right_shift" not in name:
            continue
        rule = rule_taken(name, func, (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction()))
        if rule is not None:
            taken[name] = rule
    assert taken and set(taken.values()) == {"GEMV"}, taken


def test_quantize_applies_to_a_checkpoint_decode_step_only(tmp_path, capsys):
    from tvmpipe.cli import main

    code = main(["compile", "llama", "--decode", "--quantize", "int4", "-o", str(tmp_path / "b"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--quantize" in err and len(err.splitlines()) == 1 and not (tmp_path / "b").exists()
