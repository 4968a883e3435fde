"""`tvmpipe compile FILE.gguf --decode`: GGUF files, their quantized matrices kept packed.

The files are written by gguf's own GGUFWriter (tests/support/gguf_files.py): a tiny Llama with
every listed tensor type once (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32;
the k-quants, which gguf cannot write, as random blocks with sane scales), a tied Llama whose LM
head reads the packed Q8_0 embedding, a Qwen2 (q/k/v biases, no q/k permutation) in Q4_K_M's
mix, a Qwen3 (q/k norms), a Phi-3 (fused qkv and gate-up matrices, packed whole) and a GPT-2
(llama.cpp's transposed Conv1D matrices, fused qkv, LayerNorms, learned positions, a byte-level
BPE tokenizer), untied and tied, a Gemma 1 (norm scales stored as 1 + w, multi-query, heads of
128, a tied packed embedding scaled by sqrt(hidden)) and a multi-query Falcon (fused qkv, parallel
attention and MLP, LayerNorms, its head `output.weight` though transformers' config says tied; a
Falcon-40B-style file, several KV heads, is refused) and a GPT-NeoX (llama.cpp's reordered qkv
weight and bias, partial rotary, a sequential residual). Each bundle, on the reference backend, gives
the greedy tokens of transformers' own load of the same file (`from_pretrained(dir, gguf_file=...)`,
which dequantizes with gguf's NumPy dequantizers), with every step's logits within 1e-4 x
max|logits| of transformers'; and at K = 2 as a user runs it. transformers' GGUF loader reads no
Gemma 1 file (architecture "gemma") and no GPT-NeoX file ("gptneox"), so their reference is
transformers' GemmaForCausalLM / GPTNeoXForCausalLM holding the file's tensors dequantized by gguf
with llama.cpp's conversion undone (tests/support/gguf_files.py gemma_reference, neox_reference).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.gguf_files import (HIDDEN, MIXED, gemma_reference, load_transformers, neox_reference, tensor_bytes,
                                     write_gguf)

pytest.importorskip("tvm")
pytest.importorskip("gguf")
pytestmark = pytest.mark.tvm

PROMPT = [5, 17, 3, 60, 9]
NEW = 8
CONTEXT = 24
Q4_K_M = {**{k: "Q4_K" for k in MIXED}, "output.weight": "Q6_K", "token_embd.weight": "Q6_K",
          "blk.0.ffn_down.weight": "Q6_K", "blk.1.attn_v.weight": "Q6_K"}
PHI3 = {"blk.0.attn_qkv.weight": "Q4_K", "blk.1.attn_qkv.weight": "Q5_0", "blk.0.ffn_up.weight": "Q8_0",
        "blk.1.ffn_up.weight": "Q6_K", "blk.0.ffn_down.weight": "Q4_1", "blk.1.ffn_down.weight": "Q5_K",
        "blk.0.attn_output.weight": "Q4_0", "blk.1.attn_output.weight": "Q5_1", "token_embd.weight": "Q6_K",
        "output.weight": "Q4_K"}
# GPT-2: every quantized type among its Conv1D matrices (stored transposed: the Linear's [out, in])
# and head, the token embedding packed Q8_0 and the position table packed F16
GPT2 = {"token_embd.weight": "Q8_0", "position_embd.weight": "F16", "blk.0.attn_qkv.weight": "Q4_K",
        "blk.0.attn_output.weight": "Q5_0", "blk.0.ffn_up.weight": "Q6_K", "blk.0.ffn_down.weight": "Q4_1",
        "blk.1.attn_qkv.weight": "Q8_0", "blk.1.attn_output.weight": "Q5_1", "blk.1.ffn_up.weight": "Q4_0",
        "blk.1.ffn_down.weight": "Q5_K", "output.weight": "Q8_0"}
# Falcon (multi-query): every listed type among its fused qkv, dense, MLP matrices, embedding and head
FALCON = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K", "blk.0.attn_qkv.weight": "Q4_0",
          "blk.0.attn_output.weight": "Q4_1", "blk.0.ffn_up.weight": "Q5_0", "blk.0.ffn_down.weight": "Q5_1",
          "blk.1.attn_qkv.weight": "Q5_K", "blk.1.attn_output.weight": "BF16", "blk.1.ffn_up.weight": "F16",
          "blk.1.ffn_down.weight": "Q8_0"}
# GPT-NeoX: every listed type among its fused qkv (reordered by llama.cpp), dense, MLP, embedding, head
NEOX = {"token_embd.weight": "Q5_K", "output.weight": "Q8_0", "blk.0.attn_qkv.weight": "Q4_K",
        "blk.0.attn_output.weight": "Q5_1", "blk.0.ffn_up.weight": "Q4_0", "blk.0.ffn_down.weight": "Q6_K",
        "blk.1.attn_qkv.weight": "Q5_0", "blk.1.attn_output.weight": "F16", "blk.1.ffn_up.weight": "Q4_1",
        "blk.1.ffn_down.weight": "BF16"}
CASES = {
    "llama_mixed": dict(types=MIXED),
    "llama_tied_q8": dict(types={k: "Q8_0" for k in MIXED}, tied=True),
    "qwen2_q4_k_m": dict(types=Q4_K_M, arch="qwen2"),
    "qwen3_mixed": dict(types=MIXED, arch="qwen3"),  # q/k norms, heads of 128
    "phi3_fused": dict(types=PHI3, arch="phi3"),  # fused qkv and gate-up matrices
    # fused qkv with bias, transposed Conv1D matrices, LayerNorms, learned positions, byte-level BPE
    # (seeds whose greedy tokens are not one repeated token)
    "gpt2_mixed": dict(types=GPT2, arch="gpt2", seed=2),
    # tied: the head reads the packed token embedding, not the (also packed) position table
    "gpt2_tied": dict(types={k: v for k, v in GPT2.items() if k != "output.weight"}, arch="gpt2", tied=True,
                      seed=3),
    # Gemma 1: every listed type among its matrices, the tied head reading the packed Q4_K embedding
    # (llama.cpp writes no output.weight for Gemma), norms stored as 1 + w, 1 KV head, heads of 128
    "gemma_mixed": dict(types={k: v for k, v in MIXED.items() if k != "output.weight"}, arch="gemma", seed=3),
    # Falcon-7B-style: multi-query fused qkv, parallel attention, LayerNorms; its output.weight is the
    # head though transformers' config of a falcon file says tied
    "falcon_mixed": dict(types=FALCON, arch="falcon", seed=2),
    # GPT-NeoX (Pythia): qkv weight and bias rows put back from llama.cpp's reorder, rotary over a
    # quarter of each head, a sequential residual, LayerNorms and biases
    "gptneox_mixed": dict(types=NEOX, arch="gptneox", seed=2),
}
# the architectures transformers' GGUF loader does not read: their reference built by hand
HAND_BUILT = {"gemma": gemma_reference, "gptneox": neox_reference}


def reference(name: str, f: Path):
    """transformers' model of case `name`'s file: its own GGUF load, or for a Gemma 1 or a GPT-NeoX
    (which that loader does not read) GemmaForCausalLM / GPTNeoXForCausalLM holding the file's
    tensors as llama.cpp's converter wrote them, undone."""
    return HAND_BUILT.get(CASES[name].get("arch"), load_transformers)(f)


unscheduled: dict[str, object] = {}  # the fixture's compiled functions before scheduling, by case


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory: pytest.TempPathFactory):
    """gguf_case(name) -> (file, bundle): written and compiled once per module, static caches;
    gguf_case(name, "paged", batch, chunk): the same file's `--kv paged --page-size 4` step (the
    default pool: one row at the max context a row of the batch)."""
    from tvmpipe.compiler.decoders import KvOptions
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    files: dict[str, Path] = {}
    cache: dict[tuple[str, str, int, int], tuple[Path, Path]] = {}
    unscheduled.clear()

    def get(name: str, kv: str = "static", batch: int = 1, chunk: int = 1) -> tuple[Path, Path]:
        if name not in files:
            files[name] = write_gguf(tmp_path_factory.mktemp(f"gguf_{name}") / f"{name}.gguf", **CASES[name])
        key = (name, kv, batch, chunk)
        if key not in cache:
            out = files[name].parent / ("b" if key[1:] == ("static", 1, 1) else f"b_{kv}_{batch}_{chunk}")
            exported = export(str(files[name]), decode=CONTEXT, batch=batch, chunk=chunk,
                              kv=KvOptions("paged", page_size=4) if kv == "paged" else "static",
                              progress=Progress(stream=None))
            exported.write(out)
            if key[1:] == ("static", 1, 1):
                unscheduled[name] = exported.unscheduled
            cache[key] = (files[name], out)
        return cache[key]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_a_gguf_bundle_gives_transformers_tokens_and_logits(name, gguf_case):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import transformers_generate, transformers_logits
    from tvmpipe.executor.decode_loop import greedy_decode

    f, bundle = gguf_case(name)
    b = load_bundle(bundle)
    assert b.manifest.source["kind"] == "gguf" and b.manifest.dtype == "float32"
    model = reference(name, f)
    want = transformers_generate(model, PROMPT, NEW)
    assert len(set(want)) >= 4, want  # not a repeated token or two: the check can fail
    got = greedy_decode(bundle, PROMPT, NEW)
    assert got.tokens[0] == want
    logits = np.stack([step[0] for step in got.logits])
    ref = transformers_logits(model, PROMPT + want)[:len(logits)]
    # within 1e-4 of the logits' scale, as tests/compiler/test_decode.py (summation order only)
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max(), (np.abs(logits - ref).max(), np.abs(ref).max())
    # memory: the bundle holds the file's tensors' bytes (packed as they are), nothing dequantized
    weights = sum(b.param_nbytes(n) for n in b.param_names)
    assert weights <= 1.05 * tensor_bytes(f), (weights, tensor_bytes(f))


def _scheduled(bundle: Path, prompts: list[list[int]], stages: int = 1) -> tuple[list[list[int]], dict]:
    """Greedy tokens of `prompts` through the scheduler (generation.Generator on a Pipeline of
    `stages` stages in this process, 2 slots) and every step's logits, by sequence and position."""
    from tests.support.pipeline_harness import ThreadLauncher
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    with Pipeline(bundle, stages, launcher=ThreadLauncher(), slots=2, kv_tokens=None) as pipe:  # the compiled pool
        results, logs = {}, {}
        list(Generator(pipe).generate(prompts, NEW, results=results, logits_log=logs))
    return [results[i].tokens for i in range(len(prompts))], logs


@pytest.mark.parametrize("name, batch, chunk, stages", [("llama_mixed", 2, 2, 2), ("gpt2_mixed", 1, 1, 1)])
def test_a_paged_gguf_step_gives_the_static_steps_tokens_and_logits(name, batch, chunk, stages, gguf_case):
    """--kv paged on a GGUF file (the paged ops' converters beside the packed weights' own): the
    every-type llama (Q4_K and Q6_K among them) at --batch 2 --chunk 2 (tokens packed by q_indptr,
    the causal chunk kernel) cut into 2 stages, and GPT-2 (transposed matrices, learned positions;
    the decode kernel). Its fields stay packed, and through the scheduler (stages in this process,
    sequences in flight preempting each other in the default pool) its greedy tokens are the
    static step's and transformers', every step's logits within 1e-4 x max|logits| of the static
    step's at that position and of transformers'."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import transformers_generate, transformers_logits

    f, static = gguf_case(name)
    _, paged = gguf_case(name, "paged", batch, chunk)
    b = load_bundle(paged)
    assert b.generation.paged is not None and b.manifest.source["decode"]["kv"]["layout"] == "paged"
    assert sum(b.param_nbytes(n) for n in b.param_names) <= 1.05 * tensor_bytes(f)
    prompts = [PROMPT, [60, 2, 100, 7], [1, 2, 3]]
    model = reference(name, f)
    want = [transformers_generate(model, p, NEW) for p in prompts]
    tokens, logs = _scheduled(paged, prompts, stages)
    tokens_static, logs_static = _scheduled(static, prompts)
    assert tokens == tokens_static == want
    for i, p in enumerate(prompts):
        ref = transformers_logits(model, (p + want[i])[:-1])
        assert len(logs[i]) >= NEW and set(logs[i]) <= set(logs_static[i])  # a chunk: its last token's
        for pos, got in logs[i].items():
            got, s = np.asarray(got).reshape(-1), np.asarray(logs_static[i][pos]).reshape(-1)
            assert np.abs(got - s).max() <= 1e-4 * np.abs(s).max(), (i, pos)
            assert np.abs(got - ref[pos]).max() <= 1e-4 * np.abs(ref[pos]).max(), (i, pos)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].get("arch") not in HAND_BUILT])
def test_the_config_is_the_one_transformers_reads(name, gguf_case):
    """open_gguf maps the metadata itself (one reader, tokenizer arrays unparsed): the same config
    as transformers' load_gguf_checkpoint."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tvmpipe.compiler.ggufsource import open_gguf

    f, _ = gguf_case(name)
    assert open_gguf(f).config == load_gguf_checkpoint(str(f), return_tensors=False)["config"]


@pytest.mark.parametrize("name, linears", [("llama_mixed", 2 * 7 - 1 + 1), ("gpt2_mixed", 2 * 4 + 1),
                                           ("gemma_mixed", 2 * 7 - 1 + 1),  # the head: the Q4_K embedding's
                                           ("falcon_mixed", 2 * 4 + 1)])
def test_quantized_matrices_stay_packed_and_unpack_inside_the_matmul_kernel(name, linears, gguf_case):
    """Every packed field is a uint8/int8/f16/bf16 param of the file's bytes; every function reading
    one either gathers embedding rows (take) or holds the matmul: one kernel, which reads the packed
    bytes, and no kernel that writes a float weight to memory."""
    from tvmpipe.bundle import load_bundle

    f, bundle = gguf_case(name)
    b = load_bundle(bundle)
    ops = json.loads((bundle / "ops.json").read_text())["functions"]
    kernels = json.loads((bundle / "kernels.json").read_text())["functions"]
    packed = {n for n in b.param_names if b.graph.entry_of(n).dtype in ("uint8", "int8", "float16", "bfloat16")
              and np.prod(b.graph.entry_of(n).shape) > 64}  # not the shift amounts ([2, 1] uint8)
    assert {n.rsplit("_", 1)[-1] for n in packed} >= {"qs", "qh", "ql", "d", "dmin", "m", "scales", "w"}
    nodes = b.graph.nodes
    matrices = set()  # the packed matrices the matmul kernels read (a field name less its last part)
    for node in nodes:
        if node.op != "tvm_op" or node.attrs.get("func_name") in (None, "__nop"):
            continue
        names = {nodes[i.node].name for i in node.inputs}
        if not names & packed:
            continue
        fn = node.attrs["func_name"]
        kinds = [o["op"] for o in ops[fn]["ops"]]
        assert "matmul" in kinds or "take" in kinds, (fn, kinds)
        if "take" in kinds and "matmul" not in kinds:  # the embedding: the token's row, not the table
            for k in range(len(ops[fn]["outputs"])):
                assert np.prod(b.graph.entry_of(node.index, k).shape) <= HIDDEN, (fn, k)
        else:
            matrices |= {n.rsplit("_", 1)[0] for n in names & packed}
            assert len(kernels[fn]["launches"]) == 1, fn
            assert "right_shift" in kinds or "astype" in kinds, kinds  # the unpack ops are in it
    # every packed linear layer of both blocks (llama_mixed has one F32: not packed) and the head
    assert len(matrices) == linears, sorted(matrices)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"])
def test_the_unpack_ops_equal_ggufs_numpy_dequantizer_bit_for_bit(qtype, tmp_path):
    """Each packed type's fields, as GGUFTensor reads them from a file (byte range, split into
    fields), unpacked by packed.dequantize (the ops a bundle runs) equal gguf's own NumPy
    dequantizer of the same bytes, bit for bit: the types gguf writes quantized by gguf from
    floats, the k-quants (which gguf only reads) random blocks, every code and sub-scale drawn."""
    import gguf
    import torch

    from tests.support.gguf_files import _tensor
    from tvmpipe.compiler.ggufsource import GGUFEntry, GGUFTensor
    from tvmpipe.compiler.packed import FORMATS, dequantize

    rows, cols = 6, 512
    rng = np.random.default_rng(11)
    path = tmp_path / f"{qtype}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    _tensor(w, rng, "m.weight", (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    t = gguf.GGUFReader(str(path)).tensors[0]
    assert t.tensor_type.name == qtype
    fmt = FORMATS[qtype]
    entry = GGUFEntry(t.name, qtype, (rows, cols), int(t.data_offset), int(t.n_bytes))

    def torch_field(a: np.ndarray) -> torch.Tensor:
        if a.dtype.name == "bfloat16":  # NumPy's bfloat16 (ml_dtypes) is not torch's: by bits
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    fields = {f.name: torch_field(GGUFTensor(path, entry, fmt, f.name).numpy()) for f in fmt.fields}
    got = dequantize(fmt, fields).numpy()
    want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(rows, cols)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.array_equal(got, want.astype(np.float32)), np.abs(got - want).max()
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):  # random blocks: every sub-block scale and code in use
        assert len(np.unique(got)) > cols


def test_the_unpack_matmul_kernels_are_scheduled_as_reductions_not_by_fallback(gguf_case):
    """At batch 1 every fused unpack + matmul function is taken by dlight's GEMV or Reduction rule
    (threads across the row's packed bytes), as export's schedule step tries them in order; none is
    left to Fallback (one thread an output, the row read serially)."""
    import tvm.s_tir.dlight as dl

    from tests.support.dlight_rule import rule_taken

    gguf_case("llama_mixed")
    mod = unscheduled["llama_mixed"]
    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction()]
    seen = 0
    for gv, func in mod.functions.items():
        name = gv.name_hint
        if "matmul" not in name or not any(k in name for k in ("right_shift", "cast")):
            continue
        assert rule_taken(name, func, rules) is not None, name
        seen += 1
    assert seen >= 10


def test_the_reference_backend_unpacks_a_weight_a_slice_of_rows_at_a_time(gguf_case, monkeypatch):
    """Every matmul whose weight its function unpacks is computed in row slices on the reference
    backend (the stage never holds a whole float weight); slices of 40 rows give the logits of one
    slice (to BLAS's summation order)."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import reference_ops
    from tvmpipe.executor.decode_loop import greedy_decode

    f, bundle = gguf_case("llama_mixed")
    b = load_bundle(bundle)
    planned = sum(len(reference_ops._unpacked_matmuls(fn)) for fn in b.ops.values())
    assert planned >= 2 * 7 - 1 + 1  # every packed linear (one F32 matrix is not packed) and the head
    whole = greedy_decode(bundle, PROMPT, 4)
    monkeypatch.setattr(reference_ops, "CHUNK_VALUES", 40 * HIDDEN)
    sliced = greedy_decode(bundle, PROMPT, 4)
    assert sliced.tokens == whole.tokens
    # other BLAS calls (a [K, 40] operand instead of [K, R]) may sum in another order: not bitwise
    assert all(np.abs(a - c).max() <= 1e-6 * np.abs(a).max() for a, c in zip(whole.logits, sliced.logits))


def test_nvcc_builds_the_fused_unpack_matmul_kernels(gguf_case, tmp_path):
    """kernels.cu of the every-type bundle compiles for sm_90 (the shifts, masks and f16 loads of
    every format), and each launch passes as many arguments as its kernel takes."""
    import shutil

    from tests.support.cubin_elf import compile_and_read
    from tvmpipe.bundle import load_bundle

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc not installed")
    f, bundle = gguf_case("llama_mixed")
    b = load_bundle(bundle)
    kernels = compile_and_read(nvcc, b.cuda_source, "sm_90", tmp_path)
    launches = json.loads((bundle / "kernels.json").read_text())["functions"]
    for fn, rec in launches.items():
        for launch in rec["launches"]:
            assert len(kernels[launch["kernel"]].params) == len(launch["args"]), (fn, launch["kernel"])


def test_inspect_shows_each_weights_format_and_bytes(gguf_case):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.inspect import build_report, render_text

    f, bundle = gguf_case("llama_mixed")
    r = build_report(load_bundle(bundle))
    by_name = {w["name"]: w for w in r["weights"]}
    q = by_name["p_model_model_layers_0_self_attn_q_proj"]
    assert q["format"] == "Q4_0" and q["shape"] == [HIDDEN, HIDDEN] and q["bytes"] == HIDDEN * HIDDEN // 32 * 18
    assert by_name["p_model_model_layers_1_mlp_down_proj"]["format"] == "Q5_K"
    assert by_name["p_model_lm_head"]["format"] == "Q6_K"
    assert {w["format"] for w in r["weights"]} >= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
                                                   "F16", "BF16", "float32"}
    assert sum(w["bytes"] for w in r["weights"]) == r["params"]["bytes"]  # every param counted once
    text = render_text(r)
    assert "p_model_model_layers_0_self_attn_q_proj" in text and "Q6_K" in text


def test_the_gguf_tokenizer_and_chat_template_become_the_bundle_tokenizer(gguf_case):
    from transformers import AutoTokenizer

    from tvmpipe.bundle import load_bundle
    from tvmpipe.generation.text import load_text_codec

    f, bundle = gguf_case("llama_mixed")
    b = load_bundle(bundle)
    hf = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    codec = load_text_codec(b.tokenizer_dir)
    assert codec.encode("the cat is") == hf.encode("the cat is")
    msgs = [{"role": "user", "content": "hi"}]
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>hi</s><|assistant|>"  # the file's template (tests/support/gguf_files.py CHAT)
    assert codec.render_chat(msgs, add_generation_prompt=True) == text
    assert codec.apply_chat_template(msgs) == hf.encode(text, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tvmpipe_generate_runs_a_gguf_bundle_at_k_1_and_2(name, gguf_case):
    from tvmpipe.compiler.decoders import transformers_generate

    f, bundle = gguf_case(name)
    want = transformers_generate(reference(name, f), PROMPT, NEW)
    for k in (1, 2):
        args = [sys.executable, "-m", "tvmpipe", "generate", str(bundle), "--stages", str(k), "--processes",
                "--max-new-tokens", str(NEW), "--ignore-eos", "--json", "--prompt-ids", ",".join(map(str, PROMPT))]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout)["sequences"][0]["tokens"] == want, k


def test_batch_and_chunk_apply_to_a_gguf_decode_step(gguf_case, tmp_path):
    """--batch 2 --chunk 3 on the every-type file: the packed matmuls take [B, C] rows; each row gives
    transformers' tokens."""
    from tvmpipe.compiler.decoders import transformers_generate
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.executor.decode_loop import greedy_decode

    f, _ = gguf_case("llama_mixed")
    export(str(f), decode=CONTEXT, batch=2, chunk=3, progress=Progress(stream=None)).write(tmp_path / "b")
    prompts = [PROMPT, [60, 2, 100, 7, 41]]
    model = load_transformers(f)
    assert greedy_decode(tmp_path / "b", prompts, NEW).tokens == [transformers_generate(model, p, NEW) for p in prompts]


@pytest.mark.parametrize("dtype, kv", [("bfloat16", "static"), ("float16", "static"), ("float16", "paged")])
def test_dtype_computes_a_gguf_step_in_half_precision(dtype, kv, gguf_case, tmp_path):
    """--dtype bfloat16/float16: each packed weight unpacked in float32 and rounded once, the rest
    computed as a half-precision checkpoint is: transformers' own load of the file in that dtype
    (it dequantizes, then casts) gives the same tokens; the fields stay packed. float16 with --kv
    paged: pages of float16, the same tokens (the single-process loop drives its page table)."""
    import torch
    import transformers

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import KvOptions, transformers_generate
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.executor.decode_loop import greedy_decode

    f, fp32 = gguf_case("llama_mixed")
    export(str(f), decode=CONTEXT, dtype=dtype, kv=KvOptions("paged", page_size=4) if kv == "paged" else "static",
           progress=Progress(stream=None)).write(tmp_path / "b")
    b = load_bundle(tmp_path / "b")
    assert b.manifest.dtype == dtype
    assert [b.graph.entry_of(p.input).dtype for p in b.state] == [dtype] * len(b.state)
    assert (b.generation.paged is not None) == (kv == "paged")
    assert sum(b.param_nbytes(n) for n in b.param_names) <= 1.05 * tensor_bytes(f)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name,
                                                              dtype=getattr(torch, dtype), attn_implementation="eager")
    want = transformers_generate(model.eval(), PROMPT, NEW)
    assert greedy_decode(tmp_path / "b", PROMPT, NEW).tokens[0] == want


def test_dtype_bfloat16_computes_a_gemma_gguf_step_in_bfloat16(gguf_case, tmp_path):
    """--dtype bfloat16 on the Gemma: its reference built in bfloat16 as from_pretrained builds one
    (as transformers' half load of a file: dequantized, norms less one, then cast) gives the same
    tokens; the fields stay packed."""
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import transformers_generate
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.executor.decode_loop import greedy_decode

    f, _ = gguf_case("gemma_mixed")
    export(str(f), decode=CONTEXT, dtype="bfloat16", progress=Progress(stream=None)).write(tmp_path / "b")
    b = load_bundle(tmp_path / "b")
    assert b.manifest.dtype == "bfloat16"
    assert sum(b.param_nbytes(n) for n in b.param_names) <= 1.05 * tensor_bytes(f)
    model = gemma_reference(f, "bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    want = transformers_generate(model, PROMPT, NEW)
    assert len(set(want)) >= 4, want
    assert greedy_decode(tmp_path / "b", PROMPT, NEW).tokens[0] == want


def test_a_llama_file_named_mistral_compiles_as_mistral(tmp_path):
    """A llama-architecture file whose general.name is "mistral" is Mistral, as transformers' config
    reads it (MistralForCausalLM, q/k rows un-permuted as a Llama's). transformers cannot load its
    weights with this gguf (its name map asks gguf for an architecture "mistral", which gguf 0.19
    lacks), so the reference is its load of the same tensors named as a Llama: at a context inside
    Mistral's sliding window the two models are one function."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import transformers_generate
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.ggufsource import open_gguf
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.executor.decode_loop import greedy_decode

    (tmp_path / "m").mkdir(), (tmp_path / "l").mkdir()
    mistral = write_gguf(tmp_path / "m" / "mistral.gguf", Q4_K_M, name="mistral")
    llama = write_gguf(tmp_path / "l" / "llama.gguf", Q4_K_M)
    config = open_gguf(mistral).config
    assert config["model_type"] == "mistral" and config == load_gguf_checkpoint(str(mistral))["config"]
    export(str(mistral), decode=CONTEXT, progress=Progress(stream=None)).write(tmp_path / "b")
    assert load_bundle(tmp_path / "b").manifest.source["architecture"] == "MistralForCausalLM"
    try:  # when transformers loads it, it is the reference itself
        reference = load_transformers(mistral)
        assert isinstance(reference, transformers.MistralForCausalLM)
    except NotImplementedError as exc:
        assert "mistral" in str(exc)
        reference = load_transformers(llama)
    want = transformers_generate(reference, PROMPT, NEW)
    assert len(set(want)) >= 4, want
    assert greedy_decode(tmp_path / "b", PROMPT, NEW).tokens[0] == want


def test_a_gpt2_files_byte_level_bpe_becomes_the_bundle_tokenizer(gguf_case):
    """GPT-2's tokenizer.ggml.model "gpt2" (byte-level BPE: tokens, merges, <|endoftext|>), converted
    as transformers converts it: the same ids, merged words included, and its end-of-text id."""
    from transformers import AutoTokenizer

    from tvmpipe.bundle import load_bundle
    from tvmpipe.generation.text import load_text_codec

    f, bundle = gguf_case("gpt2_mixed")
    hf = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    codec = load_text_codec(load_bundle(bundle).tokenizer_dir)
    text = "the cat sat on the mat, she is in it!"
    ids = hf.encode(text)
    assert codec.encode(text) == ids
    pieces = hf.convert_ids_to_tokens(ids)
    assert {"\u0120cat", "\u0120sat", "\u0120the", "\u0120mat"} <= set(pieces), pieces  # the file's merges
    assert codec.decode(ids) == text
    assert hf.eos_token == "<|endoftext|>" and hf.convert_tokens_to_ids("<|endoftext|>") == 127


def test_a_gguf_step_of_gpt2_keeps_the_files_matrices_as_stored(gguf_case):
    """GPT-2's Conv1D weights ([in, out]) are stored by llama.cpp transposed; the bundle keeps each
    as the file's [out, in] blocks (a Linear of the same function), not transposed back."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.inspect import build_report

    f, bundle = gguf_case("gpt2_mixed")
    b = load_bundle(bundle)
    assert b.manifest.source["architecture"] == "GPT2LMHeadModel"
    by_name = {w["name"]: w for w in build_report(b)["weights"]}
    qkv = by_name["p_model_transformer_h_0_attn_c_attn"]
    assert qkv["format"] == "Q4_K" and qkv["shape"] == [3 * HIDDEN, HIDDEN]
    down = by_name["p_model_transformer_h_1_mlp_c_proj"]
    assert down["format"] == "Q5_K" and down["shape"] == [HIDDEN, 4 * HIDDEN]
    assert by_name["p_model_transformer_wpe"]["format"] == "F16"
    assert by_name["p_model_lm_head"]["format"] == "Q8_0"


def test_a_gemma_files_metadata_reads_as_the_config_it_was_converted_from(gguf_case):
    """transformers' GGUF loader maps no "gemma" metadata (and refuses the file): tvmpipe's own map
    (ggufsource.CONFIG_MAPPING, llama.cpp's GemmaModel keys) gives the GemmaConfig the file was
    written from: head_dim from attention.key_length (not hidden / heads), 1 KV head, tied, the
    vocabulary the token list's length, rope_theta GemmaConfig's (no rope key)."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tvmpipe.compiler.ggufsource import open_gguf

    f, _ = gguf_case("gemma_mixed")
    with pytest.raises(ValueError, match="gemma"):  # when transformers reads it, hold it to that load
        load_gguf_checkpoint(str(f), return_tensors=False)
    src = open_gguf(f)
    assert src.architecture == "GemmaForCausalLM"
    got = transformers.AutoConfig.for_model("gemma", **{k: v for k, v in src.config.items() if k != "model_type"})
    want = gemma_reference(f).config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(got, key) == getattr(want, key), key
    assert got.head_dim == 128 != got.hidden_size // got.num_attention_heads and got.num_key_value_heads == 1
    assert got.rms_norm_eps == pytest.approx(1e-6) and got.rope_parameters == want.rope_parameters


def test_a_gemma_step_holds_its_norms_less_one_and_its_scaled_packed_embedding_once(gguf_case):
    """llama.cpp stores Gemma's RMSNorm scales as 1 + w: the bundle's are the file's - 1 (as the
    reference's); the head is the embedding's packed Q4_K fields (no lm_head tensor), and the
    embedding keeps GemmaTextScaledWordEmbedding's sqrt(hidden) (without it the tokens differ:
    test_a_gguf_bundle_gives_transformers_tokens_and_logits)."""
    import gguf

    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.inspect import build_report
    from tvmpipe.compiler.ggufmodel import build_gguf_model
    from tvmpipe.compiler.ggufsource import open_gguf

    f, bundle = gguf_case("gemma_mixed")
    file_norm = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(f)).tensors if t.name.endswith("norm.weight")}
    assert len(file_norm) == 2 * 2 + 1 and abs(file_norm["output_norm.weight"].mean() - 1) < 0.05  # stored 1 + w
    built = build_gguf_model(open_gguf(f))
    sources = built.sources_by_name(built.model)
    for hf, g in (("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
                  ("model.layers.1.post_attention_layernorm.weight", "blk.1.ffn_norm.weight"),
                  ("model.norm.weight", "output_norm.weight")):
        assert np.array_equal(sources[hf].numpy(), file_norm[g] - np.float32(1)), hf
    assert float(built.model.model.embed_tokens.embed_scale) == pytest.approx(HIDDEN ** 0.5)
    weights = {w["name"]: w for w in build_report(load_bundle(bundle))["weights"]}
    # the embedding and the head: one Q4_K table's fields, stored once (inspect counts them at the head)
    table = [w for n, w in weights.items() if "embed_tokens" in n or "lm_head" in n]
    assert sorted(w["format"] for w in table) == ["Q4_K", "Q4_K"], table
    assert sum(w["bytes"] for w in table) == 128 * HIDDEN // 256 * 144, table
    assert weights["p_model_model_layers_0_self_attn_q_proj"]["shape"] == [4 * 128, HIDDEN]


def test_a_gemma_files_sentencepiece_becomes_the_bundle_tokenizer(gguf_case):
    """Gemma's tokenizer (tokenizer.ggml.model "llama", add_space_prefix false, <bos> id 2): converted
    as transformers' GGUF builder for "gemma" converts it (AutoTokenizer cannot: it reads the
    config first). No space is prepended: "the" at the start is t-h-e (a Llama's ▁the), " is" is
    the piece ▁is (merges rebuilt from the token order)."""
    import gguf

    from tvmpipe.bundle import load_bundle
    from tvmpipe.generation.text import load_text_codec

    f, bundle = gguf_case("gemma_mixed")
    codec = load_text_codec(load_bundle(bundle).tokenizer_dir)
    fld = gguf.GGUFReader(str(f)).fields["tokenizer.ggml.tokens"]
    vocab = [bytes(fld.parts[i]).decode() for i in fld.data]
    want = [2] + [vocab.index(p) for p in ("t", "h", "e", "\u2581c", "a", "t", "\u2581is")]
    assert codec.encode("the cat is") == want
    assert codec.decode(want[1:]) == "the cat is"


def test_a_falcon_steps_head_is_the_files_output_weight_though_its_config_says_tied(gguf_case):
    """transformers' config of every falcon file says tied (load_gguf_checkpoint's `exceptions`), but
    its load, as llama.cpp's, reads the head from `output.weight` where the file holds one: so does
    the bundle (the Q6_K head beside the Q4_K embedding; tied to it, the tokens differ). The fused
    qkv is the file's matrix whole: the 4 query heads, then the key and the value (llama.cpp's
    reorder of one KV group is the identity)."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.inspect import build_report
    from tvmpipe.compiler.ggufsource import open_gguf

    f, bundle = gguf_case("falcon_mixed")
    src = open_gguf(f)
    assert src.architecture == "FalconForCausalLM" and src.config["tie_word_embeddings"] is True
    ref = reference("falcon_mixed", f)
    assert ref.lm_head.weight.data_ptr() != ref.transformer.word_embeddings.weight.data_ptr()
    weights = {w["name"]: w for w in build_report(load_bundle(bundle))["weights"]}
    assert weights["p_model_lm_head"]["format"] == "Q6_K"
    assert weights["p_model_transformer_word_embeddings"]["format"] == "Q4_K"
    qkv = weights["p_model_transformer_h_1_self_attention_query_key_value"]
    assert qkv["format"] == "Q5_K" and qkv["shape"] == [HIDDEN + 2 * HIDDEN // 4, HIDDEN]


def test_a_gptneox_files_metadata_and_tokenizer_read_as_the_model_it_was_converted_from(gguf_case):
    """transformers reads no "gptneox" file (neither config nor tokenizer: AutoTokenizer reads the
    config first): tvmpipe's map (ggufsource.CONFIG_MAPPING) gives the GPTNeoXConfig it was written
    from, the rotary share a head from rope.dimension_count and the file's sequential residual; the
    byte-level BPE converts through GPTNeoXTokenizer as a GPT-2 file's through AutoTokenizer."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.ggufsource import open_gguf
    from tvmpipe.generation.text import load_text_codec

    f, bundle = gguf_case("gptneox_mixed")
    with pytest.raises(ValueError, match="gptneox"):  # when transformers reads it, hold it to that load
        load_gguf_checkpoint(str(f), return_tensors=False)
    src = open_gguf(f)
    assert src.architecture == "GPTNeoXForCausalLM" and src.model_type == "gpt_neox"
    got = transformers.AutoConfig.for_model("gpt_neox", **{k: v for k, v in src.config.items() if k != "model_type"})
    want = neox_reference(f).config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "tie_word_embeddings", "use_parallel_residual", "hidden_act",
                "attention_bias", "rope_parameters", "bos_token_id", "eos_token_id"):
        assert getattr(got, key) == getattr(want, key), key
    assert got.rope_parameters["partial_rotary_factor"] == 0.25 and got.use_parallel_residual is False
    assert got.layer_norm_eps == pytest.approx(1e-5)
    gpt2, _ = gguf_case("gpt2_mixed")  # the same byte-level vocabulary and merges
    hf = transformers.AutoTokenizer.from_pretrained(str(gpt2.parent), gguf_file=gpt2.name)
    codec = load_text_codec(load_bundle(bundle).tokenizer_dir)
    text = "the cat sat on the mat, she is in it!"
    assert codec.encode(text) == hf.encode(text) and codec.decode(hf.encode(text)) == text


def test_tokenizer_names_the_tokenizer_of_a_file_without_one(tmp_path):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cli import main

    with_tok = write_gguf(tmp_path / "tok.gguf")
    src = tmp_path / "tokdir"
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=with_tok.name).save_pretrained(str(src))
    f = write_gguf(tmp_path / "notok.gguf", tokenizer=False)
    assert main(["compile", str(f), "--decode", "--max-context", "16", "--tokenizer", str(src), "-o",
                 str(tmp_path / "b"), "--quiet"]) == 0
    b = load_bundle(tmp_path / "b")
    assert (b.tokenizer_dir / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


# ---- bad input: one line each, nothing written -------------------------------------------------

def _compile(capsys, src: Path, out: Path, *extra: str) -> str:
    from tvmpipe.cli import main

    code = main(["compile", str(src), "--decode", "--max-context", "16", "-o", str(out), "--quiet", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert not out.exists()
    return err


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor(tmp_path, capsys):
    f = write_gguf(tmp_path / "q2.gguf", {**MIXED, "blk.1.ffn_up.weight": "Q2_K"})
    err = _compile(capsys, f, tmp_path / "b")
    assert "blk.1.ffn_up.weight" in err and "Q2_K" in err


def test_an_unsupported_architecture_is_refused(tmp_path, capsys):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    err = _compile(capsys, tmp_path / "rwkv.gguf", tmp_path / "b")
    assert "rwkv6" in err and "llama" in err


def test_a_falcon_of_the_new_decoder_architecture_is_refused(tmp_path, capsys):
    """A Falcon-40B-style file (2 KV heads, llama.cpp's qkv reorder of 2 groups, a second norm a layer):
    refused in one line naming the file; transformers' GGUF loader cannot load it either (it builds a
    multi-query model: when it can, hold the bundle to that load)."""
    f = write_gguf(tmp_path / "falcon40b.gguf", {}, arch="falcon", falcon_kv_heads=2)
    err = _compile(capsys, f, tmp_path / "b")
    assert str(f) in err and "2 KV heads" in err and "new decoder architecture" in err
    with pytest.raises(RuntimeError, match="mismatch"):
        load_transformers(f)


def test_a_truncated_or_corrupt_file_is_refused(tmp_path, capsys):
    f = write_gguf(tmp_path / "whole.gguf")
    data = f.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 5000])
    assert "truncated" in _compile(capsys, cut, tmp_path / "b1")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:200])
    assert "not a readable GGUF file" in _compile(capsys, bad, tmp_path / "b2")


def test_a_gguf_without_a_tokenizer_needs_tokenizer(tmp_path, capsys):
    f = write_gguf(tmp_path / "notok.gguf", tokenizer=False)
    err = _compile(capsys, f, tmp_path / "b")
    assert "no tokenizer" in err and "--tokenizer" in err
