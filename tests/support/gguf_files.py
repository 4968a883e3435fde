"""Tiny GGUF files for `tvmpipe compile FILE.gguf`, written with gguf's own GGUFWriter.

A Llama (or Qwen2, Qwen3, Phi-3) of 2 layers, hidden 256 (the k-quants' rows are blocks of 256
values), 4 heads, 2 KV heads, MLP 512, vocabulary 128, with seeded weights, written as llama.cpp's
converter writes it: GGUF tensor names (`blk.0.attn_q.weight`), Llama's q/k rows permuted, the
metadata (`llama.context_length`, ...) and a SentencePiece-style tokenizer with a chat template.
A GPT-2 (`arch="gpt2"`) as llama.cpp writes one: LayerNorms with biases, learned positions
(`position_embd`, 1024 rows: transformers' GPT-2 takes n_positions' default, not the file's
context length), one fused `attn_qkv` with its bias, MLP 4 x hidden, each Conv1D weight stored
transposed (rows = output features, as a Linear's), and a byte-level BPE tokenizer (`gpt2`:
tokens, merges, `<|endoftext|>`). A Gemma 1 (`arch="gemma"`) as llama.cpp's GemmaModel writes one:
multi-query (1 KV head), heads of 128 (`attention.key_length`/`value_length`, not hidden / heads),
no rope keys, each RMSNorm scale stored as 1 + w, no `output.weight` (the head is the embedding),
no q/k permutation, and the SentencePiece tokenizer with `add_space_prefix` false. A Falcon
(`arch="falcon"`) as llama.cpp's FalconModel writes one: multi-query (its fused query_key_value
reordered from per-KV-group interleaving into queries, keys, values: the identity at one KV head;
`falcon_kv_heads` > 1 writes a Falcon-40B-style file), LayerNorms with biases, parallel attention and MLP
from one norm, MLP 4 x hidden, no linear biases, context length 2048, `output.weight` unless tied,
and GPT-2's byte-level BPE tokenizer (pre-tokenizer `falcon`). A GPT-NeoX (`arch="gptneox"`) as
llama.cpp's GPTNeoXModel writes one: its per-head interleaved query_key_value weight and bias
reordered into queries, keys, values, rotary over a quarter of each head (`rope.dimension_count`),
a sequential residual (`use_parallel_residual` false: not transformers' default), LayerNorms and
linears with biases, MLP 4 x hidden, `output.weight` (the LM head), and the byte-level BPE tokenizer.

Each matrix takes the type `types` gives it (by GGUF name; others F32). Types gguf can quantize
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16) are quantized by gguf.quants from the float weight;
the k-quants (Q4_K, Q5_K, Q6_K), which gguf reads but cannot write, are random blocks whose f16
scales are set to small values, so that gguf's NumPy dequantizer (what transformers loads them
with) gives weights of the usual size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 256, 2, 4, 2, 512
CONTEXT = 256
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# every listed type once across the two layers: Q4_K_M-like (Q4_K beside Q6_K) plus the rest
MIXED = {
    "token_embd.weight": "Q4_K", "output.weight": "Q6_K",
    "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_1", "blk.0.attn_v.weight": "Q5_0",
    "blk.0.attn_output.weight": "Q5_1", "blk.0.ffn_gate.weight": "Q8_0", "blk.0.ffn_up.weight": "Q4_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q5_K", "blk.1.attn_k.weight": "F16", "blk.1.attn_v.weight": "BF16",
    "blk.1.attn_output.weight": "Q4_K", "blk.1.ffn_gate.weight": "F32", "blk.1.ffn_up.weight": "Q6_K",
    "blk.1.ffn_down.weight": "Q5_K",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` of q/k rows (what a reader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kquant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: object) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES
    from tvmpipe.compiler.packed import FORMATS

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    fmt = FORMATS.get(qtype.name)  # a type tvmpipe does not run (Q2_K): random bytes are enough
    d = rng.uniform(2e-4, 1e-3, blocks.shape[:2]).astype(np.float32)
    # Q4_K/Q5_K: w = d*sc*q - dmin*m with q, sc, m uniform codes; dmin = d * mean(q) centres w on 0
    middle = {"Q4_K": 7.5, "Q5_K": 15.5}.get(qtype.name, 1.0)
    for f in fmt.fields if fmt else ():
        if f.dtype == "float16":
            value = (d * middle if f.name == "dmin" else d).astype(np.float16)
            blocks[..., f.offset:f.offset + 2] = value[..., None].view(np.uint8)
    return raw


GEMMA_HEAD_DIM, GEMMA_KV_HEADS = 128, 1
GPT2_CONTEXT = 1024  # GPT2Config's n_positions (transformers reads no GGUF key into it)
FALCON_CONTEXT = 2048  # what llama.cpp's FalconModel writes (its config.json has none)
NEOX_ROTARY_PCT = 0.25  # Pythia's: rotary over a quarter of each head
GPT2_WORDS = ("the", "cat", "is", "on", "mat", "of", "in", "at", "he", "she", "sat")


def _byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 style byte-level BPE of VOCAB tokens: printable ASCII and `Ġ` (the space byte), merges
    spelling " the", " cat", ... (and the bare words), `<|endoftext|>` (control) last."""
    base = [chr(c) for c in range(33, 127)] + ["\u0120"]
    tokens, merges = list(base), []

    def spell(word: str) -> None:
        parts = list(word)
        while len(parts) > 1:
            merged = parts[0] + parts[1]
            if merged not in tokens:
                tokens.append(merged)
                merges.append(f"{parts[0]} {parts[1]}")
            parts = [merged] + parts[2:]

    for word in GPT2_WORDS:
        spell("\u0120" + word)
    tokens = tokens[:VOCAB - 1]
    merges = [m for m in merges if m.replace(" ", "") in tokens]
    tokens += [f"~{i}" for i in range(VOCAB - 1 - len(tokens))] + ["<|endoftext|>"]
    return tokens, merges, [1] * (VOCAB - 1) + [3]


def _falcon_qkv(w: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """llama.cpp's FalconModel.modify_tensors reorder of a checkpoint's query_key_value ([kv groups of
    heads / kv query heads, a key, a value] x head_dim rows): all queries, then keys, then values."""
    head_dim = w.shape[1] // heads
    g = w.reshape(kv_heads, heads // kv_heads + 2, head_dim, w.shape[1])
    return np.concatenate([g[:, :-2].reshape(-1, w.shape[1]), g[:, -2].reshape(-1, w.shape[1]),
                           g[:, -1].reshape(-1, w.shape[1])])


def _neox_qkv(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's GPTNeoXModel.modify_tensors reorder of a checkpoint's query_key_value weight or bias
    (per head: its query, key, value rows): all queries, then keys, then values."""
    g = w.reshape(heads, 3, -1, *w.shape[1:])
    return np.concatenate([g[:, 0].reshape(-1, *w.shape[1:]), g[:, 1].reshape(-1, *w.shape[1:]),
                           g[:, 2].reshape(-1, *w.shape[1:])])


def _tensor(writer: object, rng: np.random.Generator, name: str, w: np.ndarray, qtype_name: str) -> None:
    from gguf import GGMLQuantizationType, quants

    if qtype_name == "F32":
        writer.add_tensor(name, w.astype(np.float32))
        return
    if qtype_name == "F16":
        writer.add_tensor(name, w.astype(np.float16))
        return
    qt = GGMLQuantizationType[qtype_name]
    if qtype_name in ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"):
        raw = _kquant_blocks(rng, w.shape[0], w.shape[1], qt)
    else:
        raw = quants.quantize(w.astype(np.float32), qt)
    writer.add_tensor(name, raw, raw_dtype=qt)


def write_gguf(path: Path, types: dict[str, str] | None = None, *, arch: str = "llama", tied: bool = False,
               seed: int = 1, tokenizer: bool = True, embedding_scale: float | None = None,
               name: str | None = None, falcon_kv_heads: int = 1) -> Path:
    """A tiny `arch` model (llama, qwen2, qwen3, phi3, gpt2, gemma, falcon or gptneox; a llama file
    `name`d mistral is Mistral, as llama.cpp writes one) as a GGUF file at `path`; `types` by GGUF
    tensor name. A tied embedding is drawn smaller (0.05 by default), else the head's product with the last token's
    own embedding wins and the model repeats its input. Qwen3 has q/k RMSNorms and heads of 128
    (transformers' GGUF reader takes Qwen3's default head_dim; real Qwen3 files have 128); Phi-3
    its fused qkv and gate-up matrices; GPT-2, GPT-NeoX, Gemma and Falcon (`falcon_kv_heads` its KV
    heads): see above (Gemma is always tied)."""
    import gguf

    types = dict(MIXED if types is None else types)
    rng = np.random.default_rng(seed)
    gemma = arch == "gemma"
    head_dim = 128 if arch == "qwen3" else GEMMA_HEAD_DIM if gemma else HIDDEN // HEADS
    kv_heads = GEMMA_KV_HEADS if gemma else KV_HEADS
    tied = tied or gemma  # llama.cpp writes no lm_head for Gemma
    gpt2 = arch == "gpt2"
    falcon = arch == "falcon"
    neox = arch == "gptneox"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or f"tiny {arch}")
    w.add_context_length(GPT2_CONTEXT if gpt2 else FALCON_CONTEXT if falcon else CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(4 * HIDDEN if gpt2 or falcon or neox else FFN)
    w.add_head_count(HEADS)
    if gpt2:
        w.add_layer_norm_eps(1e-5)
    elif neox:  # convert_hf_to_gguf's GPTNeoXModel.set_gguf_parameters: no rope theta, no vocab_size
        w.add_rope_dimension_count(int(NEOX_ROTARY_PCT * (HIDDEN // HEADS)))
        w.add_parallel_residual(False)
        w.add_layer_norm_eps(1e-5)
    elif falcon:  # convert_hf_to_gguf's FalconModel.set_gguf_parameters: no rope keys, no vocab_size
        w.add_tensor_data_layout("jploski")  # its qkv reorder
        w.add_head_count_kv(falcon_kv_heads)
        w.add_layer_norm_eps(1e-5)
    elif gemma:  # convert_hf_to_gguf's GemmaModel.set_gguf_parameters: no rope keys, no vocab_size
        w.add_head_count_kv(kv_heads)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
        w.add_head_count_kv(KV_HEADS)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(10000.0)
        w.add_vocab_size(VOCAB)
    if tokenizer and (gpt2 or falcon or neox):
        tokens, merges, token_types = _byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("falcon" if falcon else "gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
        w.add_bos_token_id(VOCAB - 1)
        w.add_eos_token_id(VOCAB - 1)
        w.add_chat_template(CHAT)
    elif tokenizer and gemma:  # Gemma's SentencePiece: <pad> <eos> <bos> <unk> <mask> first, a lone "▁"
        pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<0x{i:02X}>" for i in range(32, 32 + 40)] + \
            ["\u2581"] + ["\u2581" + c for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz") + \
            ["\u2581the", "\u2581is", "\u2581of"]
        pieces += [f"x{i}" for i in range(VOCAB - len(pieces))]
        w.add_tokenizer_model("llama")
        w.add_token_list(pieces)
        w.add_token_scores([0.0] * 5 + [-float(i) for i in range(VOCAB - 5)])
        w.add_token_types([3, 3, 3, 2, 4] + [6] * 40 + [1] * (VOCAB - 45))
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_chat_template(CHAT.replace("</s>", "<eos>"))
        w.add_add_space_prefix(False)  # GemmaModel.set_vocab
    elif tokenizer:
        specials = ["<unk>", "<s>", "</s>"]
        pieces = specials + [f"<0x{i:02X}>" for i in range(32, 32 + 40)] + \
            ["\u2581" + c for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz") + \
            ["\u2581the", "\u2581is", "\u2581of"]
        pieces = pieces[:VOCAB] + [f"x{i}" for i in range(VOCAB - len(pieces))]
        w.add_tokenizer_model("llama")
        w.add_token_list(pieces)
        w.add_token_scores([0.0] * 3 + [-float(i) for i in range(VOCAB - 3)])
        w.add_token_types([2, 3, 3] + [6] * 40 + [1] * (VOCAB - 43))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_pad_token_id(0)  # Phi-3's config would take 32000, outside this vocabulary
        w.add_chat_template(CHAT)

    def mat(rows: int, cols: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def add(name: str, value: np.ndarray) -> None:
        _tensor(w, rng, name, value, types.get(name, "F32") if value.ndim == 2 else "F32")

    add("token_embd.weight", mat(VOCAB, HIDDEN, embedding_scale or (0.05 if tied else 1.0)))
    def norm(size: int) -> np.ndarray:
        return 1 + 0.1 * rng.standard_normal(size).astype(np.float32)

    def bias(size: int) -> np.ndarray:
        return 0.1 * rng.standard_normal(size).astype(np.float32)

    def finish() -> Path:
        """The head (unless tied) after the output norm, then the file written and closed."""
        if not tied:
            add("output.weight", mat(VOCAB, HIDDEN, 0.3))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    def biased(i: int, tensors: tuple[tuple[str, int, int], ...]) -> None:
        """Layer i's LayerNorms (rows 0) and linears [rows, cols], each with its bias."""
        for n, rows, cols in tensors:
            if rows:
                add(f"blk.{i}.{n}.weight", mat(rows, cols, 0.04 if n == "ffn_down" else 0.08))
                add(f"blk.{i}.{n}.bias", bias(rows))
            else:
                add(f"blk.{i}.{n}.weight", norm(cols))
                add(f"blk.{i}.{n}.bias", bias(cols))

    tail = (("attn_output", HIDDEN, HIDDEN), ("ffn_norm", 0, HIDDEN), ("ffn_up", 4 * HIDDEN, HIDDEN),
            ("ffn_down", HIDDEN, 4 * HIDDEN))  # GPT-2's and GPT-NeoX's layers after the fused qkv

    if gpt2:  # every matrix as a Linear's [out, in]: llama.cpp transposes GPT-2's Conv1D weights
        add("position_embd.weight", mat(GPT2_CONTEXT, HIDDEN, 0.3))
        for i in range(LAYERS):
            biased(i, (("attn_norm", 0, HIDDEN), ("attn_qkv", 3 * HIDDEN, HIDDEN), *tail))
        add("output_norm.weight", norm(HIDDEN))
        add("output_norm.bias", bias(HIDDEN))
        return finish()

    if neox:  # LayerNorms and linears with biases; the fused qkv (weight and bias) reordered
        for i in range(LAYERS):
            add(f"blk.{i}.attn_norm.weight", norm(HIDDEN))
            add(f"blk.{i}.attn_norm.bias", bias(HIDDEN))
            add(f"blk.{i}.attn_qkv.weight", _neox_qkv(mat(3 * HIDDEN, HIDDEN), HEADS))
            add(f"blk.{i}.attn_qkv.bias", _neox_qkv(bias(3 * HIDDEN), HEADS))
            biased(i, tail)
        add("output_norm.weight", norm(HIDDEN))
        add("output_norm.bias", bias(HIDDEN))
        return finish()

    if falcon:  # one LayerNorm a layer feeding attention and MLP; no linear biases (Falcon-7B's bias=False)
        head_dim = HIDDEN // HEADS
        for i in range(LAYERS):
            add(f"blk.{i}.attn_norm.weight", norm(HIDDEN))
            add(f"blk.{i}.attn_norm.bias", bias(HIDDEN))
            if falcon_kv_heads > 1:  # Falcon-40B's second norm (ln_attn)
                add(f"blk.{i}.attn_norm_2.weight", norm(HIDDEN))
                add(f"blk.{i}.attn_norm_2.bias", bias(HIDDEN))
            qkv = mat((HEADS + 2 * falcon_kv_heads) * head_dim, HIDDEN)  # the checkpoint's order, kv groups
            add(f"blk.{i}.attn_qkv.weight", _falcon_qkv(qkv, HEADS, falcon_kv_heads))
            add(f"blk.{i}.attn_output.weight", mat(HIDDEN, HIDDEN))
            add(f"blk.{i}.ffn_up.weight", mat(4 * HIDDEN, HIDDEN))
            add(f"blk.{i}.ffn_down.weight", mat(HIDDEN, 4 * HIDDEN, 0.04))
        add("output_norm.weight", norm(HIDDEN))
        add("output_norm.bias", bias(HIDDEN))
        return finish()

    # norm(): 1 + w, w drawn around 0: a Llama's scale, or what llama.cpp stores for a Gemma (whose
    # GemmaRMSNorm scales by 1 + w; the converter adds the 1)
    q_rows, kv_rows = HEADS * head_dim, kv_heads * head_dim
    for i in range(LAYERS):
        q, k, v = mat(q_rows, HIDDEN), mat(kv_rows, HIDDEN), mat(kv_rows, HIDDEN)
        if arch == "llama":
            q, k = _permute(q, HEADS), _permute(k, kv_heads)
        add(f"blk.{i}.attn_norm.weight", norm(HIDDEN))
        if arch == "phi3":
            add(f"blk.{i}.attn_qkv.weight", np.concatenate([q, k, v]))
        else:
            add(f"blk.{i}.attn_q.weight", q)
            add(f"blk.{i}.attn_k.weight", k)
            add(f"blk.{i}.attn_v.weight", v)
        if arch == "qwen2":
            for n, size in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                add(f"blk.{i}.attn_{n}.bias", 0.1 * rng.standard_normal(size).astype(np.float32))
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", norm(head_dim))
            add(f"blk.{i}.attn_k_norm.weight", norm(head_dim))
        add(f"blk.{i}.attn_output.weight", mat(HIDDEN, q_rows))
        add(f"blk.{i}.ffn_norm.weight", norm(HIDDEN))
        if arch == "phi3":  # gate and up in one matrix, gate first (transformers' gate_up_proj)
            add(f"blk.{i}.ffn_up.weight", np.concatenate([mat(FFN, HIDDEN), mat(FFN, HIDDEN)]))
        else:
            add(f"blk.{i}.ffn_gate.weight", mat(FFN, HIDDEN))
            add(f"blk.{i}.ffn_up.weight", mat(FFN, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", mat(HIDDEN, FFN, 0.06))
    add("output_norm.weight", norm(HIDDEN))
    return finish()


def load_transformers(path: Path):
    """transformers' own load of the file (it dequantizes every tensor with gguf), float32, eager."""
    import torch
    import transformers

    from tvmpipe.compiler import zoo

    zoo.ensure_torchvision()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def tensor_bytes(path: Path) -> int:
    """The bytes of the file's tensors (what a bundle's weights are measured against)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


# GGUF name -> GemmaForCausalLM's, as llama.cpp's tensor map names Gemma's (gguf/tensor_mapping.py)
GEMMA_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
               "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def _dequantized(path: Path, names: dict[str, str], layers: str):
    """(transformers name, GGUF tensor kind, float32 value) of each tensor of the file at `path`,
    dequantized by gguf's NumPy dequantizer in the module's [out, in] shape; `names` maps GGUF's
    tensor kinds to the model's, a layer's under `layers`.N."""
    import gguf

    for t in gguf.GGUFReader(str(path)).tensors:
        value = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        value = value.reshape(tuple(reversed([int(d) for d in t.shape])))
        parts = t.name.split(".")
        if parts[0] == "blk":
            yield f"{layers}.{parts[1]}.{names[parts[2]]}.{parts[3]}", parts[2], value
        else:
            yield f"{names[parts[0]]}.{parts[1]}", parts[0], value


def gemma_reference(path: Path, dtype: str = "float32"):
    """transformers' own GemmaForCausalLM (float32, eager) of the config write_gguf's Gemma was
    written from, holding the file's weights with llama.cpp's conversion undone: every tensor
    dequantized by gguf's NumPy dequantizer (gguf.quants.dequantize), each norm scale less the 1
    the converter added, the head tied to the embedding; in `dtype` as from_pretrained builds a
    model (constructed under that default dtype, the float32 weights cast when loaded).
    (transformers' GGUF loader reads no architecture "gemma" file, so this is the load it would
    make.)"""
    import torch
    import transformers

    from tvmpipe.compiler import zoo

    zoo.ensure_torchvision()
    config = transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=GEMMA_KV_HEADS, head_dim=GEMMA_HEAD_DIM, intermediate_size=FFN,
        max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    config._attn_implementation = "eager"
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        model = transformers.GemmaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    state = {}
    for name, _, value in _dequantized(path, GEMMA_NAMES, "model.layers"):
        if name.endswith("norm.weight"):
            value = value - np.float32(1)
        state[name] = torch.from_numpy(np.array(value, np.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


# GGUF name -> GPTNeoXForCausalLM's, as llama.cpp's tensor map names GPT-NeoX's (gguf/tensor_mapping.py)
NEOX_NAMES = {"token_embd": "gpt_neox.embed_in", "output_norm": "gpt_neox.final_layer_norm", "output": "lm_head",
              "attn_norm": "input_layernorm", "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
              "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}


def neox_reference(path: Path):
    """transformers' own GPTNeoXForCausalLM (float32, eager) of the config write_gguf's GPT-NeoX was
    written from, holding the file's weights with llama.cpp's conversion undone: every tensor
    dequantized by gguf's NumPy dequantizer, the fused qkv weight and bias put back from all
    queries, keys, values into per-head [query, key, value] rows. (transformers' GGUF loader reads
    no architecture "gptneox" file, so this is the load it would make.)"""
    import torch
    import transformers

    from tvmpipe.compiler import zoo

    zoo.ensure_torchvision()
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN, max_position_embeddings=CONTEXT, rotary_pct=NEOX_ROTARY_PCT,
        use_parallel_residual=False, layer_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    config._attn_implementation = "eager"
    model = transformers.GPTNeoXForCausalLM(config).eval()
    state = {}
    for name, part, value in _dequantized(path, NEOX_NAMES, "gpt_neox.layers"):
        if part == "attn_qkv":  # [3, heads, head_dim, ...] -> [heads, 3, head_dim, ...]
            value = value.reshape(3, HEADS, -1, *value.shape[1:]).swapaxes(0, 1).reshape(value.shape)
        state[name] = torch.from_numpy(np.array(value, np.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model
