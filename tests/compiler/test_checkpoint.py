"""`tvmpipe compile DIR` on Hugging Face checkpoint directories written by `save_pretrained`.

Covering set (tests/support/checkpoints.py COVER): each of the ten decoder families once, five in
float32 and five in bfloat16, five as one model.safetensors and five as shards with an index, five
with the embedding tied to the LM head and five untied:

    gpt2 fp32 shards tied      llama bf16 file tied      qwen2 fp32 file untied
    mistral bf16 shards untied qwen3 bf16 file untied    gemma fp32 shards tied
    phi3 bf16 shards untied    gpt_neox fp32 file untied opt bf16 file tied     falcon fp32 shards tied

Every family's decode step gives, in the single-process oracle (greedy_decode, reference backend),
the tokens of transformers' `generate(do_sample=False)` on the checkpoint loaded by
`from_pretrained` in the checkpoint's dtype, bf16 included; its weights take at most 1.02x the
checkpoint's bytes (a tied embedding stored once). `tvmpipe generate` runs gpt2 (fp32, shards,
tied) and llama (bf16, tied, with tokenizer files) as pipelines at K = 1 and K = 2, as a user
runs it. Forward passes (no --decode) of llama (bf16) and gpt2 (fp32) and of the zoo's encoders
(BertModel, BertForMaskedLM, T5EncoderModel) are checked against transformers' outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.support.checkpoints import COVER, FORWARD_LENGTH, load_transformers, tensor_bytes

pytest.importorskip("tvm")
pytest.importorskip("transformers")
pytestmark = pytest.mark.tvm

PROMPT = [5, 17, 3, 60, 9]
NEW = 8


@pytest.mark.parametrize("family", list(COVER))
def test_a_checkpoint_decode_step_gives_transformers_tokens(family, checkpoint, checkpoint_bundle):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import transformers_generate
    from tvmpipe.executor.decode_loop import greedy_decode

    case, ckpt, bundle = COVER[family], checkpoint(family), checkpoint_bundle(family)
    b = load_bundle(bundle)
    assert b.manifest.dtype == case.dtype and b.manifest.source["kind"] == "checkpoint"
    # compiled without --kv: paged where pages of its dtype are built, else static saying why
    kv = b.manifest.source["decode"]["kv"]
    assert (kv["layout"], b.generation.paged is not None) == (("paged", True) if case.dtype == "float32" else
                                                              ("static", False)), kv
    assert case.dtype == "float32" or "pages of bfloat16 are not built" in kv["reason"]
    assert b.manifest.source["architecture"] == json.loads((ckpt / "config.json").read_text())["architectures"][0]
    assert ((ckpt / "model.safetensors.index.json").is_file(), (ckpt / "model.safetensors").is_file()) == \
        (case.shards, not case.shards)
    # the matrices (>= 4 KiB) take what the checkpoint's take: none held twice. The vectors of a
    # tiny model are a visible share on their own: a bf16 bundle keeps norm scales and biases in
    # float32 (widened, exact), and a decode step has a few int64 [T] position constants a layer
    # (bench/checkpoint.py checks the whole ratio at real sizes: 1.00x)
    big = sum(b.param_nbytes(n) for n in b.param_names if b.param_nbytes(n) >= 4096)
    assert big <= 1.02 * tensor_bytes(ckpt, 4096), (big, tensor_bytes(ckpt, 4096))
    model = load_transformers(ckpt, case.dtype)
    emb = model.get_input_embeddings().weight.detach().float().numpy()
    held = [n for n in b.param_names if b.graph.entry_of(n).shape in (emb.shape, emb.shape[::-1])
            and any(np.array_equal(np.asarray(b.params[n], np.float32), e) for e in (emb, emb.T))]
    assert len(held) == 1, held  # the embedding is one tensor of the bundle, tied or not
    want = transformers_generate(model, PROMPT, NEW)
    assert len(set(want)) > 1, want  # a stream that is not one repeated token: the check can fail
    assert greedy_decode(bundle, PROMPT, NEW).tokens[0] == want


def test_batch_and_chunk_apply_to_a_checkpoint_decode_step(checkpoint, checkpoint_bundle):
    """--batch 2 --chunk 3 on qwen2's checkpoint: two prompts a micro-batch, 3 prompt tokens a step
    (paged, the default: packed by q_indptr); each row gives transformers' tokens."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.decode_layout import step_rows
    from tvmpipe.compiler.decoders import transformers_generate
    from tvmpipe.executor.decode_loop import greedy_decode

    bundle = checkpoint_bundle("qwen2", batch=2, chunk=3)
    b = load_bundle(bundle)
    assert step_rows(b) == (2, 3) and b.generation.paged.q_indptr == "q_indptr"
    prompts = [PROMPT, [60, 2, 100, 7, 41]]
    model = load_transformers(checkpoint("qwen2"), "float32")
    assert greedy_decode(bundle, prompts, NEW).tokens == [transformers_generate(model, p, NEW) for p in prompts]


def test_dtype_builds_a_checkpoint_in_another_precision(checkpoint, tmp_path):
    """--dtype float32 on llama's bf16 checkpoint: a float32 bundle (each weight widened as it is
    written) with the tokens of transformers' from_pretrained(dtype=float32) of the same directory."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import transformers_generate
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.executor.decode_loop import greedy_decode

    ckpt = checkpoint("llama")
    export(str(ckpt), progress=Progress(stream=None), decode=24, dtype="float32").write(tmp_path / "b")
    b = load_bundle(tmp_path / "b")
    assert b.manifest.dtype == "float32" and b.manifest.source["dtype"] == "bfloat16"
    assert {b.graph.entry_of(n).dtype for n in b.param_names if b.param_nbytes(n) >= 4096} == {"float32"}
    want = transformers_generate(load_transformers(ckpt, "float32"), PROMPT, NEW)
    assert greedy_decode(tmp_path / "b", PROMPT, NEW).tokens[0] == want


def _generate_cli(bundle, stages: int, where: list[str], prompts: list[list[int]], new: int) -> list[list[int]]:
    """`tvmpipe generate BUNDLE --stages K WHERE --prompt-ids ... --json`, as a user runs it."""
    args = [sys.executable, "-m", "tvmpipe", "generate", str(bundle), "--stages", str(stages), *where,
            "--max-new-tokens", str(new), "--json"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    return [s["tokens"] for s in doc["sequences"]]


# Between two stages a bf16 hidden state crosses the data plane: the bf16 run at K = 2 takes TCP
# (the path between hosts) on purpose, which once could not carry ml_dtypes' bfloat16.
TCP_FOR_BF16 = ["--transport", "tcp"]


@pytest.mark.slow
@pytest.mark.parametrize("family,where", [("llama", ["--local"]), ("gpt2", ["--processes"])])
def test_tvmpipe_generate_runs_a_checkpoint_bundle_at_k_1_and_2(family, where, checkpoint, checkpoint_bundle):
    """llama (bf16, tied) on an embedded Ray cluster (`--local`), gpt2 (fp32, shards, tied) on
    stage processes: transformers' tokens for every prompt at K = 1 and 2."""
    from tvmpipe.compiler.decoders import transformers_generate

    prompts = [PROMPT, [60, 2, 100]]
    model = load_transformers(checkpoint(family), COVER[family].dtype)
    want = [transformers_generate(model, p, NEW) for p in prompts]
    for k in (1, 2):
        extra = TCP_FOR_BF16 if k > 1 and COVER[family].dtype == "bfloat16" else []
        assert _generate_cli(checkpoint_bundle(family), k, where + extra, prompts, NEW) == want, (family, k)


def test_the_bundle_carries_the_tokenizer_files(checkpoint, checkpoint_bundle):
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
    generation_config.json are copied into the bundle's tokenizer/ as they are, checksummed like
    every bundle file, and bundle.json says where: a local transformers tokenizer loads from there."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.errors import BundleError
    from tvmpipe.bundle.bundle import TOKENIZER_FILES

    ckpt, bundle = checkpoint("llama"), checkpoint_bundle("llama")
    b = load_bundle(bundle)
    assert json.loads((bundle / "bundle.json").read_text())["tokenizer"] == "tokenizer"
    assert b.tokenizer_dir == bundle / "tokenizer"
    assert sorted(p.name for p in b.tokenizer_dir.iterdir()) == sorted(TOKENIZER_FILES)
    for name in TOKENIZER_FILES:
        assert (b.tokenizer_dir / name).read_bytes() == (ckpt / name).read_bytes()
        assert f"tokenizer/{name}" in b.manifest.files
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(b.tokenizer_dir), local_files_only=True)
    assert tok.encode("w5 w17 w3", add_special_tokens=False) == [5, 17, 3] and tok.eos_token == "</s>"
    # save_pretrained's generation_config.json alone is no tokenizer: no directory, no key
    assert (checkpoint("gpt2") / "generation_config.json").is_file()
    assert load_bundle(checkpoint_bundle("gpt2")).tokenizer_dir is None
    cfg = b.tokenizer_dir / "generation_config.json"
    cfg.write_text(cfg.read_text() + " ")
    try:
        with pytest.raises(BundleError, match="generation_config.json: sha256 differs from bundle.json"):
            load_bundle(bundle)
    finally:
        cfg.write_text(cfg.read_text()[:-1])


def _forward(bundle, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    from tvmpipe.executor import GraphRunner

    r = GraphRunner(bundle)
    r.run(input_ids=ids, attention_mask=mask)
    return np.asarray(r.get_output(0)).astype(np.float32)


IDS = np.array([[5, 17, 3, 60, 9, 1, 2, 100]], dtype=np.int64)
MASK = np.array([[1, 1, 1, 1, 1, 1, 0, 0]], dtype=np.int64)  # right padding: the last 2 masked


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_checkpoint_forward_pass_gives_transformers_logits(family, checkpoint, checkpoint_bundle):
    """Without --decode: input_ids and attention_mask in, logits [1, 8, V] out, as transformers'
    forward computes them (bf16: within one bf16 rounding of the largest logit)."""
    import torch

    from tvmpipe.bundle import load_bundle

    bundle, dtype = checkpoint_bundle(family, decode=False), COVER[family].dtype
    b = load_bundle(bundle)
    assert b.input_names == ["input_ids", "attention_mask"] and b.manifest.source["seq_len"] == FORWARD_LENGTH
    assert b.generation is None and b.manifest.dtype == dtype
    got = _forward(bundle, IDS, MASK)
    with torch.no_grad():
        ref = load_transformers(checkpoint(family), dtype)(torch.from_numpy(IDS),
                                                           attention_mask=torch.from_numpy(MASK)).logits.float().numpy()
    tol = 2.0 ** -8 if dtype == "bfloat16" else 1e-5
    assert got.shape == ref.shape and np.abs(got - ref).max() <= tol * np.abs(ref).max()


@pytest.mark.parametrize("arch,config,output", [("BertModel", "BertConfig", "last_hidden_state"),
                                                ("BertForMaskedLM", "BertConfig", "logits"),
                                                ("T5EncoderModel", "T5Config", "last_hidden_state")])
def test_the_zoo_encoders_compile_from_a_checkpoint(arch, config, output, tmp_path):
    """The zoo's encoder architectures (compiler/zoo.py: bert_mask, t5_encoder; and BERT's masked-LM
    head, whose decoder is tied to the word embeddings: stored once) from save_pretrained."""
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.compiler.zoo import _BERT, _T5, _seeded, ensure_torchvision

    ensure_torchvision()
    import transformers

    model = getattr(transformers, arch)(getattr(transformers, config)(**(_T5 if config == "T5Config" else _BERT)))
    _seeded(model, 1)
    model.save_pretrained(tmp_path / "ckpt")
    export(str(tmp_path / "ckpt"), progress=Progress(stream=None), seq_len=8).write(tmp_path / "b")
    b = load_bundle(tmp_path / "b")
    assert b.weight_bytes <= 1.02 * tensor_bytes(tmp_path / "ckpt")  # BERT's tied decoder held once
    assert b.tokenizer_dir is None  # no tokenizer files in the directory: no key
    got = _forward(tmp_path / "b", IDS, MASK)
    ref_model = getattr(transformers, arch).from_pretrained(str(tmp_path / "ckpt"), local_files_only=True,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        ref = getattr(ref_model(torch.from_numpy(IDS), attention_mask=torch.from_numpy(MASK)), output).numpy()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


# ---- refusals: one line naming the file, as the command line prints them ----------------------------

def _compile_cli(capsys, *args: str) -> str:
    from tvmpipe.cli import main

    capsys.readouterr()  # what came before (save_pretrained's progress bars)
    assert main(["compile", *args, "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_a_pickle_checkpoint_is_refused_with_what_to_do(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    err = _compile_cli(capsys, str(tmp_path), "--decode", "-o", str(tmp_path / "out"))
    assert "pytorch_model.bin: tvmpipe reads safetensors weights only" in err
    assert "save_pretrained(DIR, safe_serialization=True)" in err
    (tmp_path / "pytorch_model.bin").rename(tmp_path / "model.pt")
    assert "model.pt: tvmpipe reads safetensors weights only" in _compile_cli(capsys, str(tmp_path), "-o",
                                                                              str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_unsupported_architecture_is_refused_naming_it(tmp_path, capsys):
    from tvmpipe.compiler.checkpoint import supported

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    err = _compile_cli(capsys, str(tmp_path), "--decode", "-o", str(tmp_path / "out"))
    assert "architecture 'MambaForCausalLM' (model_type 'mamba') is not supported by --decode; supported: " \
           + ", ".join(supported(True)) in err
    assert "LlamaForCausalLM" in err and "BertModel" not in err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    assert "architecture 'BertModel' (model_type 'bert') is not supported by --decode" in _compile_cli(
        capsys, str(tmp_path), "--decode", "-o", str(tmp_path / "out"))  # an encoder has no decode step


def test_a_directory_without_config_or_weights_is_refused(tmp_path, capsys, checkpoint):
    import shutil

    err = _compile_cli(capsys, str(tmp_path), "--decode", "-o", str(tmp_path / "out"))
    assert f"{tmp_path}: no config.json: not a Hugging Face checkpoint directory" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "no model.safetensors or model.safetensors.index.json" in _compile_cli(capsys, str(tmp_path), "-o",
                                                                                   str(tmp_path / "out"))
    sharded = tmp_path / "sharded"
    shutil.copytree(checkpoint("gpt2"), sharded)
    shard = sorted(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]
    (sharded / shard).unlink()
    assert f"shard {shard} is missing" in _compile_cli(capsys, str(sharded), "--decode", "-o", str(tmp_path / "out"))


def test_options_that_do_not_apply_are_refused(tmp_path, capsys, checkpoint):
    assert "--seq-len is the forward pass's length" in _compile_cli(
        capsys, str(checkpoint("qwen2")), "--decode", "--seq-len", "8", "-o", str(tmp_path / "out"))
    assert "--token-input declares the generation section of a .pt2" in _compile_cli(
        capsys, str(checkpoint("qwen2")), "--decode", "--token-input", "x", "-o", str(tmp_path / "out"))
    assert "--seq-len 300 exceeds the model's 256 positions" in _compile_cli(
        capsys, str(checkpoint("gpt2")), "--seq-len", "300", "-o", str(tmp_path / "out"))
    # generated params would replace a decode step's compiled constants (cache positions, the mask's fill)
    assert "--omit-params does not apply to a decode step" in _compile_cli(
        capsys, str(checkpoint("qwen2")), "--decode", "--omit-params", "-o", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ---- memory: the checkpoint is streamed into the bundle, never held whole ------------------------

@pytest.mark.slow
def test_compiling_a_checkpoint_holds_no_copy_of_its_weights(tmp_path):
    """A 288 MiB fp32 Llama checkpoint (4 layers, hidden 1024, 16 MiB tensors) compiled in a fresh
    interpreter (bench/checkpoint.py's child): its resident set grows by at most a quarter of the
    weights + 128 MiB over the libraries' (measured 99 MiB: ~64 MiB of the compiler's own state, a
    tensor read and its transpose being written). A compiler holding the weights once, as
    from_pretrained does, would grow by more than the weights."""
    import torch

    from bench.checkpoint import measure
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.zoo import ensure_torchvision

    ensure_torchvision()
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=4096, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=4096, tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "ckpt")
    weights = tensor_bytes(tmp_path / "ckpt")
    assert weights > 280 << 20
    r = measure(tmp_path / "ckpt", tmp_path / "b")
    grown = (r["peak_kib"] - r["baseline_kib"]) * 1024
    assert grown <= weights / 4 + (128 << 20), f"compile grew by {grown >> 20} MiB for {weights >> 20} MiB of weights"
    b = load_bundle(tmp_path / "b")  # the streamed tensors are the checkpoint's (one of them, transposed)
    np.testing.assert_array_equal(b.params["p_model_model_layers_3_mlp_down_proj_weight_permute_dims"],
                                  model.model.layers[3].mlp.down_proj.weight.detach().numpy().T)
