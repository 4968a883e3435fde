"""The transformers model of a GGUF file, built without reading its weights, quantized ones packed.

As for a checkpoint directory (compiler/hfmodel.py), the model is built on the meta device from
the config transformers reads from the file's metadata, its buffers (rotary frequencies) computed
by its own `_init_weights`, and every parameter becomes an unwritten `torch.empty` paired with the
file tensor it holds (ggufsource.GGUFTensor). A linear layer or embedding whose GGUF tensor is
quantized (or F16/BF16) becomes a PackedLinear / PackedEmbedding (compiler/packed.py) whose
parameters are the fields of the file's blocks, dequantized by ops in the graph; the rest (norm
scales, biases, F32 matrices) are plain float32 parameters. GGUF's names are mapped to the
model's by transformers' own map (get_gguf_hf_weights_map), Llama's q/k rows are put back in
transformers' order (a row permutation of the blocks: nothing is re-quantized), and a file without
`output.weight` ties the LM head to the embedding, which is then stored once. GPT-2's Conv1D layers
(weight [in, out], `x @ W + b`) become Linear layers of the same function, whose weight [out, in]
is the file's matrix as llama.cpp stores it (transposed from the checkpoint's; transformers' GGUF
loader transposes it back): its rows stay whole blocks. Gemma's files store each RMSNorm scale
as 1 + w (llama.cpp's GemmaModel adds the 1 that GemmaRMSNorm's `x * (1 + w)` adds): the
parameter is the file's value - 1, in float32; its packed embedding keeps Gemma's sqrt(hidden)
scale (GemmaTextScaledWordEmbedding's `embed_scale`). A multi-query Falcon's fused qkv is the
file's matrix as it is (llama.cpp's reorder of one KV group is the identity: ggufsource.check_falcon),
and its LM head is `output.weight` where the file holds one, though transformers' config of a
falcon file says tied (its load reads the head from the file then, as llama.cpp does). A GPT-NeoX's
fused qkv rows (weight and bias), which llama.cpp's converter reorders from per-head [q, k, v]
into all queries, keys, values, are put back by a row permutation too (ggufsource.neox_qkv_rows).
"""

from __future__ import annotations

from typing import Any

from tvmpipe.compiler.errors import SourceError, one_line
from tvmpipe.compiler.ggufsource import GGUFSource, GGUFTensor, neox_qkv_rows, q_k_rows
from tvmpipe.compiler.hfmodel import CheckpointModel, _set, meta_model
from tvmpipe.compiler.packed import FORMATS, packed_modules


def build_gguf_model(src: GGUFSource, dtype: str = "float32") -> CheckpointModel:
    """The file's model in `dtype` (float32, or float16/bfloat16: a packed matrix unpacked in
    float32 and rounded once to it, a float tensor cast as it is written), its weights the file's
    tensors (packed where quantized)."""
    import torch

    from tvmpipe.compiler import zoo

    zoo.ensure_torchvision()
    import transformers

    cfg = {k: v for k, v in src.config.items() if k != "model_type"}
    if "output.weight" in src.entries:  # a Falcon's config says tied (TIED_IN_CONFIG); its head is the file's
        cfg["tie_word_embeddings"] = False
    try:
        config = transformers.AutoConfig.for_model(src.model_type, **cfg)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, TypeError, ...
        raise SourceError(f"{src.path}: transformers cannot make a {src.model_type} config of its metadata "
                          f"({type(exc).__name__}: {one_line(exc)})") from None
    config._attn_implementation = "eager"
    tdt = getattr(torch, dtype)
    model = meta_model(getattr(transformers, src.architecture), config, tdt,
                       f"{src.path}: transformers cannot build {src.architecture} from its metadata")
    conv1d_as_linear(model, torch)
    by_hf = _names(model, src)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads

    def rows(gguf_name: str, n: int) -> tuple[int, ...] | None:
        if src.arch == "gptneox" and ".attn_qkv." in gguf_name:  # llama.cpp's qkv reorder, weight and bias
            return neox_qkv_rows(n, heads)
        if src.arch != "llama":  # llama.cpp permutes q/k of llama-architecture files only
            return None
        if ".attn_q." in gguf_name:
            return q_k_rows(n, heads)
        if ".attn_k." in gguf_name:
            return q_k_rows(n, kv_heads)
        return None

    def tensor(hf_name: str, shape: tuple[int, ...]) -> Any:
        entry = by_hf.get(hf_name)
        if entry is None:
            raise SourceError(f"{src.path}: the file has no tensor for '{hf_name}', which {src.architecture} "
                              f"needs (its {len(src.entries)} tensors: {', '.join(list(src.entries)[:4])}, ...)")
        if tuple(entry.shape) != tuple(shape):
            raise SourceError(f"{src.path}: tensor '{entry.name}' is {list(entry.shape)} but {src.architecture} with "
                              f"this metadata needs {list(shape)} for '{hf_name}'")
        return entry

    sources: dict[int, Any] = {}
    linear_cls, embedding_cls = packed_modules()

    def packed(entry: Any) -> tuple[Any, dict[str, Any]]:
        fmt = FORMATS[entry.type]
        r, c = entry.shape
        perm = rows(entry.name, r)
        fields = {}
        for f in fmt.fields:
            src_t = GGUFTensor(src.path, entry, fmt, f.name, perm)
            p = torch.nn.Parameter(torch.empty(src_t.shape, dtype=getattr(torch, f.dtype)), requires_grad=False)
            sources[id(p)] = src_t
            fields[f.name] = p
        return fmt, fields

    def plain(hf_name: str, like: Any) -> Any:
        entry = tensor(hf_name, tuple(like.shape))
        p = torch.nn.Parameter(torch.empty(tuple(like.shape), dtype=tdt), requires_grad=False)
        # llama.cpp writes Gemma's norm scales as 1 + w (convert_hf_to_gguf: names ending norm.weight)
        add = -1.0 if src.arch == "gemma" and hf_name.endswith("norm.weight") else 0.0
        sources[id(p)] = GGUFTensor(src.path, entry, None, "", rows(entry.name, like.shape[0]) if like.dim() else None,
                                    add)
        return p

    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_name = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
    emb_fields = None
    for name, module in list(model.named_modules()):
        if name == head_name and tied:
            continue
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            entry = tensor(f"{name}.weight", tuple(module.weight.shape))
            if entry.type in FORMATS:
                fmt, fields = packed(entry)
                r, c = entry.shape
                if isinstance(module, torch.nn.Embedding):
                    new = embedding_cls(fmt, r, c, fields, dtype=tdt)
                    if module is model.get_input_embeddings():  # not GPT-2's position table
                        emb_fields = (fmt, r, c, fields)
                    if isinstance(getattr(module, "embed_scale", None), torch.Tensor):
                        new = _scaled_embedding(new, module.embed_scale, torch)  # Gemma's sqrt(hidden)
                else:
                    bias = plain(f"{name}.bias", module.bias) if module.bias is not None else None
                    new = linear_cls(fmt, r, c, fields, bias, dtype=tdt)
                _replace(model, name, new)
                continue
        for pname, p in list(module.named_parameters(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            _set(model, full, plain(full, p))
    if head_name is not None and tied:
        if emb_fields is not None:  # the head reads the embedding's packed fields: one tensor each
            fmt, r, c, fields = emb_fields
            _replace(model, head_name, linear_cls(fmt, r, c, fields, None, dtype=tdt))
        else:
            head = model.get_output_embeddings()
            head.weight = model.get_input_embeddings().weight
    return CheckpointModel(model.eval(), sources, dtype)


def _scaled_embedding(inner: Any, scale: Any, torch: Any) -> Any:
    """A packed embedding times its `embed_scale` (Gemma's GemmaTextScaledWordEmbedding: the rows
    times sqrt(hidden), in the weight's dtype), which replacing the module would otherwise drop."""

    class ScaledPackedEmbedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.packed = inner
            self.num_embeddings, self.embedding_dim = inner.num_embeddings, inner.embedding_dim
            self.register_buffer("embed_scale", scale, persistent=False)

        def forward(self, ids: Any) -> Any:
            out = self.packed(ids)
            return out * self.embed_scale.to(out.dtype)

    return ScaledPackedEmbedding()


def conv1d_as_linear(model: Any, torch: Any) -> list[tuple[Any, Any]]:
    """Each transformers Conv1D (GPT-2's c_attn, c_proj, c_fc: weight [nx, nf], `x @ W + b`) replaced
    by a meta nn.Linear(nx, nf) (weight [nf, nx], `x @ W.T + b`): the same function of the
    transposed weight, which is the matrix the GGUF file holds (and the one `--quantize` groups
    along its input features). Returns the (Conv1D, Linear) pairs replaced."""
    done = []
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "Conv1D" and hasattr(module, "nx") and hasattr(module, "nf"):
            new = torch.nn.Linear(module.nx, module.nf, bias=module.bias is not None, device="meta",
                                  dtype=module.weight.dtype)
            _replace(model, name, new)
            done.append((module, new))
    return done


def _names(model: Any, src: GGUFSource) -> dict[str, Any]:
    """The model's parameter names -> the file's entries, through gguf's own tensor name map (what
    transformers' get_gguf_hf_weights_map uses; it builds the map once per submodule, which takes
    seconds on a 30-layer model, where one map of the top-level names covers a CausalLM)."""
    import gguf

    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == src.arch), None)
    if arch is None:
        raise SourceError(f"{src.path}: gguf knows no architecture '{src.arch}'")
    name_map = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    out: dict[str, Any] = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        g = name_map.get_name(base)
        if g is not None and f"{g}.{suffix}" in src.entries:
            out[hf_name] = src.entries[f"{g}.{suffix}"]
    return out


def _replace(model: Any, name: str, module: Any) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, module)
