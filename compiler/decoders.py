"""Decode-step programs: one token of an autoregressive decoder, with its KV caches as explicit state.

`tvmpipe compile llama --decode --max-context 64 -o B` builds, from a transformers decoder with
seeded random weights (the zoo's), a torch module whose forward is one decode step:

    inputs   input_ids [B, 1] int64, position [B] int64 (tokens already in the cache),
             k_cache_<l>, v_cache_<l> [B, H_kv, T, D] per layer (T = max context)
    outputs  logits [B, 1, V], then the updated caches in the same order

With `--chunk C` (chunked prefill) a step takes up to C tokens a row: input_ids [B, C] and one more
input, count [B] int64 (how many of the row's C tokens are real, from `position` on); it writes
their k and v into the caches at position .. position + count - 1, each attending to the cache up
to its own position, and the logits [B, 1, V] are the last real token's. A prompt then goes in C
tokens a step, and a generated token one (count 1) in the same graph: one set of weights, one
partition, one wiring.

The step is written from the HF model's own modules and functions (embeddings, q/k/v projections,
its rotary embedding and `apply_rotary_pos_emb`, `repeat_kv` for grouped-query attention, its norms,
MLPs and LM head), so its tokens are transformers' tokens. Two things differ from HF's own
forward, both because of TVM: the cache update is a mask (`where(arange(T) == position, new,
cache)`; index_put and scatter do not compile, see docs/compiler.md), and attention runs over the
whole static T with the positions after `position` masked out.

Each cache is declared as a state pair of the bundle (input `k_cache_<l>`, output `1 + 2l`, fill
0), and `generation` names input_ids, position, the logits head (0), T and the vocabulary size.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from tvmpipe.compiler.errors import SourceError

DEFAULT_MAX_CONTEXT = 64
TOKEN, POSITION, COUNT = "input_ids", "position", "count"

_VOCAB = 128
# tiny configs, like the zoo's: 2 layers, hidden 64, vocabulary 128
_DECODERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0,
                  eos_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
                   use_sliding_window=False, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                     rms_norm_eps=1e-6, sliding_window=None)),
    # the zoo's forward-pass decoders that the Llama-style step also covers
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",  # RMSNorm on q and k per head
              dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                   rms_norm_eps=1e-6)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",  # multi-query, GeGLU, scaled embeddings
              dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=16, intermediate_size=128, max_position_embeddings=256)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",  # Pythia: interleaved fused qkv, partial rotary
                 dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=256, rotary_pct=0.25, bos_token_id=0,
                      eos_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM",  # learned positions, pre-LayerNorm, ReLU MLP
            dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                 max_position_embeddings=256, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2,
                 eos_token_id=2)),
    "falcon": ("FalconConfig", "FalconForCausalLM",  # multi-query fused qkv, parallel attention
               dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=256, bos_token_id=0, eos_token_id=0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",  # fused qkv and gate-up projections
             dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)),
}
DECODERS = tuple(_DECODERS)
# model_type -> its CausalLM class: the architectures a checkpoint directory may name (compiler/checkpoint.py)
CAUSAL_LM: dict[str, str] = {name: spec[1] for name, spec in _DECODERS.items()}


def build_decoder(name: str, seed: int = 0, **overrides: Any) -> Any:
    """The transformers CausalLM `name` (tiny config, `overrides` applied) with the zoo's seeded
    weights, in eval mode, eager attention. Zoo entries that wrap a CausalLM are accepted too."""
    import torch

    from tvmpipe.compiler import zoo

    if name not in _DECODERS:
        if name in zoo.ZOO and zoo.ZOO[name].family == "transformers" and not overrides:
            model = getattr(zoo.ZOO[name].build(seed), "inner", None)
            if model is not None and type(model).__name__.endswith(("LMHeadModel", "ForCausalLM")):
                return model.eval()
        raise SourceError(f"'{name}' is not a decoder tvmpipe can build a decode step for "
                          f"(decoders: {', '.join(DECODERS)})")
    zoo.ensure_torchvision()
    import transformers

    config_cls, model_cls, cfg = _DECODERS[name]
    config = getattr(transformers, config_cls)(**{**cfg, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    zoo._seeded(model, seed)
    return model.eval()


@dataclass(frozen=True)
class _Layout:
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: Any


def _is_gpt2(model: Any) -> bool:
    """GPT-2's layout (transformer.h of blocks with a fused c_attn), not merely a `transformer`
    attribute: Falcon has one too, with different blocks."""
    return getattr(model.config, "model_type", None) == "gpt2"


def _layout(model: Any) -> _Layout:
    cfg = model.config
    if _is_gpt2(model):
        heads = cfg.n_head
        return _Layout(cfg.n_layer, heads, cfg.n_embd // heads, cfg.vocab_size, model.lm_head.weight.dtype)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if cfg.model_type == "falcon":
        kv = cfg.num_kv_heads if cfg.new_decoder_architecture or not cfg.multi_query else 1
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return _Layout(cfg.num_hidden_layers, kv, head_dim, cfg.vocab_size, model.get_output_embeddings().weight.dtype)


def _positions(position: Any, c: int) -> Any:
    """[B, C] positions of a step's C tokens: position, position + 1, ... (C = 1: position[:, None]).
    A 2-D `position` is already every token's (a paged chunk's packed tokens: _paged_chunk)."""
    import torch

    if position.dim() == 2:
        return position
    return position[:, None] if c == 1 else position[:, None] + torch.arange(c)[None, :]


def _masked_attention(q: Any, k: Any, v: Any, position: Any, scaling: float) -> Any:
    """softmax(q k^T * scaling) v over the static T, with cache slots after each query's position
    masked out (query c of a chunk is at position + c)."""
    import torch

    t, c = k.shape[-2], q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, H, C, T]
    if c == 1:
        valid = (torch.arange(t) <= position[:, None])[:, None, None, :]  # [B, 1, 1, T]
    else:
        valid = (torch.arange(t)[None, None, :] <= _positions(position, c)[:, :, None])[:, None]  # [B, 1, C, T]
    scores = torch.where(valid, scores, torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)  # [B, H, 1, D]


def _attend(q: Any, k: Any, v: Any, caches: Any, i: int, position: Any, scaling: float,
            repeat: Callable[[Any], Any] = lambda kv: kv, count: Any = None) -> tuple[Any, list[Any]]:
    """Layer `i`'s step: the step's k and v ([B, H_kv, C, D]) written into its caches, q attending
    over them (`repeat`: the model's own repeat_kv for grouped-query heads; one KV head broadcasts).
    Returns (context [B, C, H*D], the layer's new state: k and v caches, or its page pool when
    `caches` is a PagedKV)."""
    if isinstance(caches, PagedKV):
        return caches.attend(q, k, v, i, scaling)
    kc, vc = _write(caches[2 * i], k, position, count), _write(caches[2 * i + 1], v, position, count)
    ctx = _masked_attention(q, repeat(kc), repeat(vc), position, scaling)
    return ctx.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1), [kc, vc]


class PagedKV:
    """The paged layout's per-step inputs inside a step (docs/paged-kv.md): each layer's pool
    [N, 2, H_kv, P, D] and the page table, position map (and q_indptr for a chunk) the step
    carries. A layer appends its new K/V to its pool (in place, compiled), then attends through
    the table: decode (one token a row) or a causal chunk (`chunk` > 1: the step's tokens packed
    by q_indptr, as one sequence of B * C tokens)."""

    def __init__(self, pools: list[Any], indptr: Any, values: Any, last: Any, position_map: Any,
                 q_indptr: Any = None) -> None:
        self.pools, self.indptr, self.values, self.last = pools, indptr, values, last
        self.position_map, self.q_indptr = position_map, q_indptr

    def attend(self, q: Any, k: Any, v: Any, i: int, scaling: float) -> tuple[Any, list[Any]]:
        """q [b, H, c, D], k and v [b, H_kv, c, D] of the step's b * c token slots: appended, then
        attended; the kernels scale by 1/sqrt(D), so q is scaled first to the model's `scaling`."""
        import math

        import torch

        b, h, c, d = q.shape
        tokens = b * c
        q = q.transpose(1, 2).reshape(tokens, h, d)
        if abs(scaling * math.sqrt(d) - 1.0) > 1e-12:
            q = q * (scaling * math.sqrt(d))
        k = k.transpose(1, 2).reshape(tokens, k.shape[1], d)
        v = v.transpose(1, 2).reshape(tokens, v.shape[1], d)
        pool = torch.ops.tvmpipe.paged_append(self.pools[i], k, v, self.position_map)
        if self.q_indptr is None:
            out = torch.ops.tvmpipe.paged_decode(q, pool, self.indptr, self.values, self.last)
        else:
            out = torch.ops.tvmpipe.paged_prefill(q, self.q_indptr, pool, self.indptr, self.values, self.last)
            # the kernel leaves the spare query slots (past q_indptr[B]) unwritten: whatever the
            # buffer held, NaN included, which the logits' one-hot pick would carry (0 x NaN)
            spare = torch.arange(tokens) >= self.q_indptr[-1]
            out = torch.where(spare[:, None, None], torch.zeros_like(out), out)
        return out.reshape(b, c, h * d), [pool]


def _write(cache: Any, new: Any, position: Any, count: Any = None) -> Any:
    """cache with slot `position` replaced by `new` [B, H, 1, D], as a mask (TVM compiles it). A
    chunk of C ([B, H, C, D]) writes its first `count` entries at position, position + 1, ...: a
    one-hot [B, T, C] places them (a matmul, exact: each slot takes one entry times 1 plus zeros),
    and the slots it hits take them."""
    import torch

    t, c = cache.shape[-2], new.shape[-2]
    if c == 1:
        at = (torch.arange(t) == position[:, None])[:, None, :, None]  # [B, 1, T, 1]
        return torch.where(at, new, cache)
    hit = (torch.arange(t)[None, :, None] == _positions(position, c)[:, None, :]) \
        & (torch.arange(c)[None, None, :] < count[:, None, None])  # [B, T, C]
    placed = torch.matmul(hit.to(new.dtype)[:, None], new)  # [B, H, T, D]
    return torch.where(hit.any(-1)[:, None, :, None], placed, cache)


def _last(h: Any, count: Any) -> Any:
    """[B, 1, E]: each row's hidden state at its last valid token (`count` - 1) of a chunk [B, C, E]
    (C = 1: h itself). Only that token's logits are sampled, so the head runs once a row. A 2-D
    `count` is a paged chunk's pick [B, B * C] of each row's last packed token (h [1, B * C, E])."""
    import torch

    if count is not None and count.dim() == 2:
        return torch.matmul(count.to(h.dtype), h[0])[:, None, :]
    c = h.shape[1]
    if c == 1:
        return h
    pick = (torch.arange(c)[None, :] == (count - 1)[:, None]).to(h.dtype)  # [B, C]
    return torch.matmul(pick[:, None, :], h)


def _gpt2_step(model: Any) -> Callable:
    tr = model.transformer

    def step(input_ids: Any, position: Any, caches: list[Any], count: Any = None) -> list[Any]:
        b, c = input_ids.shape
        h = tr.wte(input_ids) + tr.wpe(_positions(position, c))
        out = []
        for i, block in enumerate(tr.h):
            attn = block.attn
            x = block.ln_1(h)
            q, k, v = attn.c_attn(x).split(attn.split_size, dim=2)
            shape = (b, c, attn.num_heads, attn.head_dim)
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            ctx, new = _attend(q, k, v, caches, i, position, attn.scaling, count=count)
            h = h + attn.c_proj(ctx)
            h = h + block.mlp(block.ln_2(h))
            out += new
        return [model.lm_head(tr.ln_f(_last(h, count)))] + out

    return step


def _qkv(attn: Any, x: Any, heads: int, kv_heads: int) -> tuple[Any, Any, Any]:
    """q, k, v projections of `x`: separate (Llama) or one fused qkv_proj (Phi-3), split as HF does."""
    if hasattr(attn, "qkv_proj"):
        d = attn.head_dim
        qkv = attn.qkv_proj(x)
        return qkv[..., :heads * d], qkv[..., heads * d:(heads + kv_heads) * d], qkv[..., (heads + kv_heads) * d:]
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def _modeling(module: Any) -> Any:
    """The transformers modeling module `module`'s class comes from: where each architecture keeps
    its own `apply_rotary_pos_emb` (and `repeat_kv`), which the steps call rather than copy."""
    return sys.modules[type(module).__module__]


def _llama_step(model: Any) -> Callable:
    """Llama, Qwen2, Mistral, Qwen3 (q/k norms), Gemma (scaled embeddings, GeGLU), Phi-3 (fused
    projections): RMSNorm, rotary, GQA, gated MLP, each from the HF model's own modules."""
    inner = model.model
    modeling = _modeling(inner.layers[0].self_attn)
    apply_rotary, repeat_kv = modeling.apply_rotary_pos_emb, modeling.repeat_kv
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", None) or heads

    def step(input_ids: Any, position: Any, caches: list[Any], count: Any = None) -> list[Any]:
        b, c = input_ids.shape
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, _positions(position, c))
        out = []
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            d = attn.head_dim
            q, k, v = _qkv(attn, x, heads, kv_heads)
            q, k, v = q.view(b, c, -1, d), k.view(b, c, -1, d), v.view(b, c, -1, d).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            groups = attn.num_key_value_groups
            ctx, new = _attend(q, k, v, caches, i, position, attn.scaling, lambda kv: repeat_kv(kv, groups), count)
            h = h + attn.o_proj(ctx)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            out += new
        return [model.lm_head(inner.norm(_last(h, count)))] + out

    return step


def _neox_step(model: Any) -> Callable:
    """GPT-NeoX (Pythia): one fused qkv projection interleaved per head, rotary over part of each
    head, parallel (or sequential) residual, LayerNorm."""
    inner = model.gpt_neox
    apply_rotary = _modeling(inner.layers[0].attention).apply_rotary_pos_emb

    def step(input_ids: Any, position: Any, caches: list[Any], count: Any = None) -> list[Any]:
        b, c = input_ids.shape
        h = inner.embed_in(input_ids)
        cos, sin = inner.rotary_emb(h, _positions(position, c))
        out = []
        for i, layer in enumerate(inner.layers):
            attn = layer.attention
            qkv = attn.query_key_value(layer.input_layernorm(h)).view(b, c, -1, 3 * attn.head_size).transpose(1, 2)
            q, k, v = qkv.chunk(3, dim=-1)
            q, k = apply_rotary(q, k, cos, sin)
            ctx, new = _attend(q, k, v, caches, i, position, attn.scaling, count=count)
            a = attn.dense(ctx)
            if layer.use_parallel_residual:
                h = h + a + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = h + a
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            out += new
        return [model.get_output_embeddings()(inner.final_layer_norm(_last(h, count)))] + out

    return step


def _opt_step(model: Any) -> Callable:
    """OPT: learned positions (offset 2), LayerNorm before or after each block, ReLU MLP."""
    dec = model.model.decoder
    pos_emb = dec.embed_positions

    def step(input_ids: Any, position: Any, caches: list[Any], count: Any = None) -> list[Any]:
        import torch

        b, c = input_ids.shape
        h = dec.embed_tokens(input_ids)
        if dec.project_in is not None:
            h = dec.project_in(h)
        h = h + torch.nn.Embedding.forward(pos_emb, _positions(position, c) + pos_emb.offset)
        out = []
        for i, layer in enumerate(dec.layers):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(h) if layer.do_layer_norm_before else h
            q, k, v = (p(x).view(b, c, -1, attn.head_dim).transpose(1, 2)
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            ctx, new = _attend(q, k, v, caches, i, position, attn.scaling, count=count)
            h = h + attn.out_proj(ctx)
            if not layer.do_layer_norm_before:
                h = layer.self_attn_layer_norm(h)
            x = layer.final_layer_norm(h) if layer.do_layer_norm_before else h
            h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
            if not layer.do_layer_norm_before:
                h = layer.final_layer_norm(h)
            out += new
        h = _last(h, count)
        if dec.final_layer_norm is not None:
            h = dec.final_layer_norm(h)
        if dec.project_out is not None:
            h = dec.project_out(h)
        return [model.lm_head(h)] + out

    return step


def _falcon_step(model: Any) -> Callable:
    """Falcon (7B-style): multi-query fused qkv (the key and value are its last two heads), rotary,
    attention and MLP in parallel from one LayerNorm."""
    tr = model.transformer
    cfg = model.config
    if cfg.alibi or cfg.new_decoder_architecture or not cfg.multi_query or not cfg.parallel_attn:
        raise SourceError("FalconForCausalLM: the decode step covers multi-query, rotary, parallel-attention "
                          "Falcon (alibi, new_decoder_architecture and sequential blocks are not supported)")
    apply_rotary = _modeling(tr.h[0].self_attention).apply_rotary_pos_emb

    def step(input_ids: Any, position: Any, caches: list[Any], count: Any = None) -> list[Any]:
        b, c = input_ids.shape
        h = tr.word_embeddings(input_ids)
        cos, sin = tr.rotary_emb(h, _positions(position, c))
        out = []
        for i, layer in enumerate(tr.h):
            attn = layer.self_attention
            x = layer.input_layernorm(h)
            qkv = attn.query_key_value(x).view(b, c, attn.num_heads + 2, attn.head_dim)
            q, k, v = (t.transpose(1, 2) for t in (qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]))
            q, k = apply_rotary(q, k, cos, sin)
            ctx, new = _attend(q, k, v, caches, i, position, attn.inv_norm_factor, count=count)  # one KV head
            a = attn.dense(ctx)
            h = h + a + layer.mlp(x)
            out += new
        return [model.lm_head(tr.ln_f(_last(h, count)))] + out

    return step


def cache_names(layers: int) -> list[str]:
    return [f"{kv}_cache_{i}" for i in range(layers) for kv in ("k", "v")]


def pool_names(layers: int) -> list[str]:
    """The paged layout's state inputs: one page pool a layer."""
    return [f"kv_pages_{i}" for i in range(layers)]


KV_LAYOUTS = ("static", "paged")
DEFAULT_PAGE_SIZE = 16
INDPTR, VALUES, LAST, POSITION_MAP, Q_INDPTR = (
    "page_table_indptr", "page_table_values", "last_page_len", "position_map", "q_indptr")


@dataclass(frozen=True)
class KvOptions:
    """`tvmpipe compile --decode`'s KV layout: `layout` static or paged; a paged step's page size
    and pool pages (None: every row at the max context), and the CUDA arch its kernels are built
    for (compiler/pagedops.py). `reason`: why a step that asked for no layout is static
    (export.default_kv), recorded in bundle.json's source.decode.kv and said in the compile log."""

    layout: str = "static"
    page_size: int = DEFAULT_PAGE_SIZE
    pages: int | None = None
    arch: str = "sm_90"
    reason: str | None = None

    def step_args(self) -> dict[str, Any]:
        """decode_step_module's keywords."""
        return {"kv": self.layout, "page_size": self.page_size, "pages": self.pages}

    def converters(self) -> dict[str, Any]:
        """The importer's convert map for the paged ops (none for the static layout)."""
        if self.layout != "paged":
            return {}
        from tvmpipe.compiler import launches, pagedops

        return pagedops.converters(launches.cuda_target(self.arch))


@dataclass(frozen=True)
class PagedLayout:
    """A paged step's sizes: `page_size` tokens a page, a pool of `pages` pages a layer, and the
    page table's static length `table_capacity` (every row at the max context)."""

    page_size: int
    pages: int
    table_capacity: int


class DecodeStepSpec:
    """What the compiler needs to declare the state: cache input names, their shape, logits head.
    With `paged` (a PagedLayout) the state is one page pool a layer, stage-scoped, and the step
    takes the page table inputs (docs/paged-kv.md)."""

    def __init__(self, layout: _Layout, batch: int, max_context: int, chunk: int = 1,
                 paged: PagedLayout | None = None) -> None:
        self.layout, self.batch, self.max_context, self.chunk = layout, batch, max_context, chunk
        self.paged = paged
        self.caches = pool_names(layout.layers) if paged else cache_names(layout.layers)
        self.cache_shape = (batch, layout.kv_heads, max_context, layout.head_dim)
        if paged:
            self.cache_shape = (paged.pages, 2, layout.kv_heads, paged.page_size, layout.head_dim)

    def state_pairs(self) -> list[Any]:
        from tvmpipe.bundle.state import StatePair

        if self.paged:
            return [StatePair(f"layer{i}.pages", n, 1 + i, 0.0, scope="stage") for i, n in enumerate(self.caches)]
        return [StatePair(f"layer{n.rsplit('_', 1)[1]}.{n[0]}", n, 1 + i, 0.0) for i, n in enumerate(self.caches)]

    def generation(self) -> Any:
        from tvmpipe.bundle.state import GenerationSpec, PagedSpec

        paged = None
        if self.paged:
            paged = PagedSpec(self.paged.page_size, self.paged.pages, INDPTR, VALUES, LAST, POSITION_MAP,
                              Q_INDPTR if self.chunk > 1 else None)
        return GenerationSpec(TOKEN, POSITION, 0, self.max_context, self.layout.vocab,
                              COUNT if self.chunk > 1 and not self.paged else None, paged)

    @property
    def table_inputs(self) -> list[str]:
        """A paged step's page-table inputs, in order (none for the static layout)."""
        if not self.paged:
            return []
        return [INDPTR, VALUES, LAST, POSITION_MAP, *([Q_INDPTR] if self.chunk > 1 else [])]

    @property
    def inputs(self) -> list[str]:
        """The step's input names, in order."""
        count = [COUNT] if self.chunk > 1 and not self.paged else []
        return [TOKEN, POSITION, *count, *self.table_inputs, *self.caches]


def _paged_chunk(step: Callable, input_ids: Any, position: Any, kv: PagedKV) -> list[Any]:
    """A paged chunked step: row b's q_indptr[b + 1] - q_indptr[b] tokens packed in the token
    slots from q_indptr[b] (spare slots last), run as one sequence of B * C tokens, each at its
    row's position + its index in the row; the logits are each row's last packed token's."""
    import torch

    q_indptr = kv.q_indptr.long()
    rows = position.shape[0]
    tokens = input_ids.shape[0]
    t = torch.arange(tokens)
    row = (t[:, None] >= q_indptr[None, 1:]).sum(-1)  # [T]: the row of each slot (rows for a spare one)
    onehot = (row[:, None] == torch.arange(rows)[None, :]).long()  # [T, B]
    at = (onehot * position[None, :]).sum(-1) + t - (onehot * q_indptr[None, :-1]).sum(-1)
    at = torch.where(onehot.sum(-1) > 0, at, torch.zeros_like(at))  # spare slots: position 0, unread
    ends = q_indptr[1:]
    pick = (t[None, :] == (ends - 1)[:, None]) & (ends > q_indptr[:-1])[:, None]  # [B, T]
    return step(input_ids[None, :], at[None, :], kv, pick)


def decode_step_module(model: Any, max_context: int, batch: int = 1, chunk: int = 1, kv: str = "static",
                       page_size: int = DEFAULT_PAGE_SIZE, pages: int | None = None) -> tuple[Any, DecodeStepSpec]:
    """A torch module computing one decode step of `model` (see the module docstring); with
    `chunk` C > 1 a step takes up to C tokens a row (input_ids [B, C], count [B] of them valid),
    so that a prompt goes in C tokens a step (chunked prefill), and samples the last valid one.
    With `kv="paged"` the caches are a pool of `pages` pages of `page_size` tokens a layer
    (default: every row at the max context), read and written through the page table inputs
    (docs/paged-kv.md; a chunk's tokens packed: input_ids [B * C])."""
    import torch

    if max_context < 1:
        raise SourceError(f"--max-context must be a positive integer, got {max_context}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= max_context:
        raise SourceError(f"--chunk must be an integer from 1 to the max context {max_context}, got {chunk!r}")
    if kv not in KV_LAYOUTS:
        raise SourceError(f"--kv {kv!r}: the KV layouts are {', '.join(KV_LAYOUTS)}")
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    learned = _is_gpt2(model) or getattr(model.config, "model_type", None) == "opt"  # a table of positions
    if learned and limit is not None and max_context > limit:
        raise SourceError(f"--max-context {max_context} exceeds the model's {limit} learned positions")
    window = getattr(model.config, "sliding_window", None)
    if window and getattr(model.config, "use_sliding_window", True) and window < max_context:
        raise SourceError(f"{type(model).__name__}: sliding-window attention ({window} tokens) is not supported "
                          f"by the decode step; use --max-context {window} or less")
    kind = getattr(model.config, "model_type", None)
    if _is_gpt2(model):
        step = _gpt2_step(model)
    elif kind == "gpt_neox":
        step = _neox_step(model)
    elif kind == "opt":
        step = _opt_step(model)
    elif kind == "falcon":
        step = _falcon_step(model)
    elif hasattr(model, "model") and hasattr(model.model, "layers") and hasattr(model.model, "rotary_emb"):
        step = _llama_step(model)
    else:
        raise SourceError(f"{type(model).__name__}: no decode step for this architecture (GPT-2 and "
                          f"Llama-style decoders: {', '.join(DECODERS)})")
    layout = _layout(model)
    paged = None
    if kv == "paged":
        paged = _paged_layout(layout, batch, max_context, page_size, pages)
        from tvmpipe.compiler.pagedops import register_torch_ops

        register_torch_ops()
    spec = DecodeStepSpec(layout, batch, max_context, chunk, paged)
    args = ", ".join(spec.caches)
    ns: dict[str, Any] = {"PagedKV": PagedKV, "_paged_chunk": _paged_chunk}
    # explicit parameter names (spec.inputs): torch.export names the graph inputs (and so the bundle's) after them
    if paged is None:
        count = f", {COUNT}" if chunk > 1 else ""
        body = f"    return tuple(self.step({TOKEN}, {POSITION}, [{args}]{count}))\n"
    else:
        q = f", {Q_INDPTR}" if chunk > 1 else ""
        table = f"PagedKV([{args}], {INDPTR}, {VALUES}, {LAST}, {POSITION_MAP}{q})"
        body = (f"    return tuple(self.step({TOKEN}, {POSITION}, {table}, None))\n" if chunk == 1 else
                f"    return tuple(_paged_chunk(self.step, {TOKEN}, {POSITION}, {table}))\n")
    exec(f"def forward(self, {', '.join(spec.inputs)}):\n" + body, ns)

    class DecodeStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model  # its weights become the step's weights
            self.step = step

        forward = ns["forward"]

    return DecodeStep().eval(), spec


def _paged_layout(layout: _Layout, batch: int, max_context: int, page_size: int, pages: int | None) -> PagedLayout:
    """The pool and table sizes of a paged step, checked: the kernels are built for float16 and
    float32 pages, and a pool smaller than one row's max context could never hold a full row."""
    for name, value in (("--page-size", page_size), ("--kv-pages", pages)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SourceError(f"{name} must be a positive integer, got {value!r}")
    dtype = str(layout.dtype).replace("torch.", "")
    if dtype not in ("float32", "float16"):
        raise SourceError(f"--kv paged: pages of {dtype} are not built (float32 and float16 are); use --kv static")
    per_row = -(-max_context // page_size)
    pages = batch * per_row if pages is None else pages
    if pages < per_row:
        raise SourceError(f"--kv-pages {pages}: a pool smaller than one row at the max context "
                          f"({per_row} pages of {page_size})")
    return PagedLayout(page_size, pages, batch * per_row)


def example_inputs(spec: DecodeStepSpec) -> dict[str, Any]:
    """Zero caches, token 0 at position 0 (a whole chunk of them): the shapes torch.export fixes.
    A paged step's: an empty page table (no pages, nothing written: position map -1)."""
    import numpy as np

    dt = str(spec.layout.dtype).replace("torch.", "")
    b, c = spec.batch, spec.chunk
    tokens = (b * c,) if spec.paged and c > 1 else (b, c)
    out: dict[str, Any] = {TOKEN: np.zeros(tokens, np.int64), POSITION: np.zeros((b,), np.int64)}
    if c > 1 and not spec.paged:
        out[COUNT] = np.full((b,), c, np.int64)
    if spec.paged:
        out[INDPTR] = np.zeros(b + 1, np.int32)
        out[VALUES] = np.zeros(spec.paged.table_capacity, np.int32)
        out[LAST] = np.zeros(b, np.int32)
        out[POSITION_MAP] = np.full(b * c, -1, np.int32)
        if c > 1:
            out[Q_INDPTR] = np.zeros(b + 1, np.int32)
    for n in spec.caches:
        out[n] = np.zeros(spec.cache_shape, dt)
    return out


def export_decode_step(name: str, max_context: int, batch: int = 1, seed: int = 0,
                       chunk: int = 1, **kv: Any) -> tuple[Any, Any, DecodeStepSpec]:
    """(torch.export program, step module, spec) of decoder `name`'s decode step (`kv`: the KV
    layout's keywords of decode_step_module)."""
    model = build_decoder(name, seed)
    module, spec = decode_step_module(model, max_context, batch, chunk, **kv)
    return export_step(module, spec), module, spec


def export_step(module: Any, spec: DecodeStepSpec) -> Any:
    """torch.export of a decode step on its example inputs (caches in the model's own dtype, bf16
    included: made in torch, which NumPy's bfloat16 cannot be converted to)."""
    import warnings

    import torch

    args = tuple(torch.from_numpy(v) if v.dtype.kind in "iuf" and str(v.dtype) != "bfloat16"
                 else torch.zeros(v.shape, dtype=spec.layout.dtype) for v in example_inputs(spec).values())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args)


# ---- transformers' own answers, for the oracle tests -----------------------------------------------

def transformers_generate(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate(do_sample=False)` (its own KV cache, no stop token): the new ids.
    `model` is a CausalLM or a decoder name (built with seed 0; build_decoder(name, seed) for others)."""
    import torch

    model = build_decoder(model) if isinstance(model, str) else model
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():  # an explicit mask: without one, generate takes every pad_token_id (0) in the prompt for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def transformers_logits(model: Any, ids: list[int]) -> Any:
    """[len(ids), vocab] logits of every prefix of `ids`: one forward without a cache (NumPy)."""
    import torch

    model = build_decoder(model) if isinstance(model, str) else model
    with torch.no_grad():
        return model(torch.tensor([list(ids)]), use_cache=False).logits[0].numpy()
