"""A GGUF file (llama.cpp's format), read as `tvmpipe compile FILE.gguf --decode` needs it.

The metadata and tensor directory are read with the `gguf` package (llama.cpp's reader) and
transformers' own GGUF mapping (its config and tokenizer conversion); the tensors are never read
here. Each weight is a `GGUFTensor`: a byte range of the file, read when the bundle's weights file
is written (one tensor at a time), split into its blocks' fields (compiler/packed.py) for a
quantized matrix. Refused in one line, before anything is written: a file that is not GGUF or is
cut short, an architecture outside the decode step's families, a tensor type tvmpipe does not
run (naming the tensor), and a file without a tokenizer unless `--tokenizer` names one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.compiler.errors import SourceError, one_line
from tvmpipe.compiler.packed import FORMATS, PackedFormat

# GGUF general.architecture -> the transformers CausalLM its decode step is built from
# (gemma2/gemma3 files transformers reads, but the decode step has no Gemma 2/3: logit soft-capping,
# sliding windows, four norms a layer). falcon: multi-query Falcon (7B-style) only; a file of the new
# decoder architecture (Falcon-40B/180B, Falcon2: several KV heads) is refused (check_falcon).
# gptneox: GPT-NeoX (Pythia), which transformers' GGUF loader does not read (CONFIG_MAPPING's keys,
# its qkv rows put back by neox_qkv_rows, its tokenizer through TOKENIZER_CLASSES)
ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                                 "gpt2": "GPT2LMHeadModel", "gemma": "GemmaForCausalLM",
                                 "falcon": "FalconForCausalLM", "gptneox": "GPTNeoXForCausalLM"}
# GGUF general.architecture -> transformers' model_type, where the two spell it differently
MODEL_TYPES: dict[str, str] = {"gptneox": "gpt_neox"}
# architectures whose config transformers' load_gguf_checkpoint marks tied whatever the file holds
# (its `exceptions`); its load of a file that holds `output.weight` still reads the head from it
# (both present with different values: not tied), as llama.cpp does, and so does build_gguf_model
TIED_IN_CONFIG = ("falcon",)
# metadata -> config keys for the architectures transformers' GGUF_CONFIG_MAPPING lacks. Gemma 1, as
# llama.cpp's convert_hf_to_gguf (GemmaModel) writes it: no rope keys (GemmaConfig's rope_theta, as
# llama.cpp's default, is 10000), head_dim as attention.key_length (Gemma's head_dim is not
# hidden / heads), no vocab_size key (the token list's length)
CONFIG_MAPPING: dict[str, dict[str, str | None]] = {
    "gemma": {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
              "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
              "rope.dimension_count": None, "rope.freq_base": "rope_theta", "attention.key_length": "head_dim",
              "attention.value_length": None, "attention.head_count": "num_attention_heads",
              "attention.head_count_kv": "num_key_value_heads",
              "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"},
    # GPT-NeoX (Pythia), as llama.cpp's GPTNeoXModel writes it: the rotary dimensions a head as
    # rope.dimension_count (neox_config makes it rotary_pct), use_parallel_residual, LayerNorm eps; no
    # rope theta (GPTNeoXConfig's 10000, llama.cpp's default), no vocab_size key
    "gpt_neox": {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                 "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                 "rope.dimension_count": "rotary_ndims", "rope.freq_base": "rope_theta",
                 "attention.head_count": "num_attention_heads", "attention.layer_norm_epsilon": "layer_norm_eps",
                 "use_parallel_residual": "use_parallel_residual", "vocab_size": "vocab_size"},
}
# architectures whose tokenizer is converted through this class, not AutoTokenizer (which reads the
# file's config first, and transformers' GGUF loader reads none of theirs): the class transformers
# would pick for the model; its GGUF builder is picked by tokenizer.ggml.model and the architecture
TOKENIZER_CLASSES: dict[str, str] = {"gemma": "GemmaTokenizer", "gptneox": "GPTNeoXTokenizer"}
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class GGUFEntry:
    """One tensor of the file: its name, GGUF type, shape as NumPy orders it ([rows, cols]),
    and its bytes' place in the file."""

    name: str
    type: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor the bundle stores: a plain float tensor of the file, or one field of a packed
    matrix's blocks; rows permuted by `rows` where the file stores them permuted (Llama's q/k).
    `add`, where not 0, is added to a float tensor's values in float32 (-1 for Gemma's norm scales,
    which llama.cpp stores as 1 + w). `numpy()` reads its bytes by byte range; the interface of
    checkpoint.CheckpointTensor."""

    path: Path
    entry: GGUFEntry
    fmt: PackedFormat | None = None  # None: the file's float tensor, as it is
    field_name: str = ""
    rows: tuple[int, ...] | None = None  # a row permutation to apply
    add: float = 0.0  # added to a float tensor's values (in float32)

    @property
    def _field(self) -> Any:
        return next(f for f in self.fmt.fields if f.name == self.field_name)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.fmt is None:
            return self.entry.shape
        r, c = self.entry.shape
        return self.fmt.field_shape(r, c, self._field)

    @property
    def dtype(self) -> str:
        if self.add:
            return "float32"
        return FLOAT_TYPES[self.entry.type] if self.fmt is None else self._field.dtype

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np_dtype(self.dtype).itemsize

    def numpy(self) -> np.ndarray:
        raw = np.empty(self.entry.nbytes, np.uint8)
        with open(self.path, "rb") as fh:
            got = os.preadv(fh.fileno(), [memoryview(raw)], self.entry.offset)
        if got != self.entry.nbytes:
            raise SourceError(f"{self.path}: tensor '{self.entry.name}' is cut short ({got} of {self.entry.nbytes} "
                              "bytes): the file is truncated")
        if self.fmt is None:
            out = raw.view(np_dtype(self.dtype)).reshape(self.entry.shape)
        elif self.fmt.block == 1:
            out = raw.view(np_dtype(self.dtype)).reshape(self.shape)
        else:
            f = self._field
            r = self.entry.shape[0]
            blocks = raw.reshape(r, -1, self.fmt.block_bytes)
            out = np.ascontiguousarray(blocks[..., f.offset:f.offset + f.nbytes]).view(np_dtype(f.dtype))
        if self.rows is not None:
            out = out[np.asarray(self.rows)]
        if self.add:
            if self.fmt is not None:
                raise ValueError(f"{self.entry.name}: a constant is added to a float tensor only, not a packed field")
            out = out.astype(np.float32) + np.float32(self.add)
        return np.ascontiguousarray(out)


@dataclass
class GGUFSource:
    """What `tvmpipe compile FILE.gguf` takes from the file."""

    path: Path
    arch: str  # general.architecture (llama, qwen2, ...)
    model_type: str  # transformers' (a llama file named mistral is mistral, as transformers reads it)
    architecture: str  # the transformers class
    config: dict[str, Any]  # transformers' config keys, from the metadata
    entries: dict[str, GGUFEntry]
    has_tokenizer: bool
    tensor_bytes: int = 0
    types: dict[str, int] = field(default_factory=dict)  # GGUF type -> tensors

    @property
    def name(self) -> str:
        return self.path.stem


def open_gguf(path: str | Path) -> GGUFSource:
    """The GGUF file at `path`, checked: readable, whole, a supported architecture and every
    tensor of a supported type."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path}: no such file")
    try:
        import gguf
    except ImportError:
        from tvmpipe.compiler.errors import TvmMissingError

        raise TvmMissingError("gguf") from None
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, struct errors, IndexError, ...
        raise SourceError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {one_line(exc)})") from None
    try:
        return _read(path, reader)
    finally:
        del reader  # its memory map


def _field(reader: Any, key: str) -> Any:
    from transformers.modeling_gguf_pytorch_utils import read_field

    got = read_field(reader, key)
    return got[0] if len(got) == 1 else (got or None)


def _read(path: Path, reader: Any) -> GGUFSource:
    size = path.stat().st_size
    arch = _field(reader, "general.architecture")
    name = _field(reader, "general.name") or ""
    if arch not in ARCHITECTURES:
        raise SourceError(f"{path}: GGUF architecture '{arch}' is not supported; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    # a llama-architecture file named "mistral" is Mistral, as transformers reads it (its test is
    # `"mistral" in [general.name]`: the whole name)
    model_type = "mistral" if arch == "llama" and name == "mistral" else MODEL_TYPES.get(arch, arch)
    entries: dict[str, GGUFEntry] = {}
    types: dict[str, int] = {}
    total = 0
    for t in reader.tensors:
        tname = t.tensor_type.name
        if tname not in TYPES:
            raise SourceError(f"{path}: tensor '{t.name}' is {tname}, which tvmpipe does not run (supported: "
                              f"{', '.join(TYPES)})")
        ne = [int(d) for d in t.shape]  # ne0 (the row length) first
        shape = tuple(reversed(ne))
        if tname in FORMATS and FORMATS[tname].block > 1 and (len(shape) != 2 or shape[1] % FORMATS[tname].block):
            raise SourceError(f"{path}: tensor '{t.name}' is {tname} with shape {list(shape)}: a quantized tensor "
                              "must be a matrix whose rows are whole blocks")
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise SourceError(f"{path}: tensor '{t.name}' ends at byte {end} but the file has {size}: the file is "
                              "truncated")
        entries[t.name] = GGUFEntry(t.name, tname, shape, int(t.data_offset), int(t.n_bytes))
        types[tname] = types.get(tname, 0) + 1
        total += int(t.n_bytes)
    if not entries:
        raise SourceError(f"{path}: the GGUF file holds no tensors")
    try:
        config = _config(reader, arch, model_type, entries)
    except Exception as exc:  # noqa: BLE001 - a malformed field: ValueError, IndexError, UnicodeError, ...
        raise SourceError(f"{path}: its metadata does not read as a {arch} config ({type(exc).__name__}: "
                          f"{one_line(exc)})") from None
    if arch == "falcon":
        check_falcon(path, config, entries)
    has_tok = _field(reader, "tokenizer.ggml.model") is not None and _field(reader, "tokenizer.ggml.tokens") is not None
    model_type = config.get("model_type", model_type)
    return GGUFSource(path=path, arch=arch, model_type=model_type,
                      architecture=ARCHITECTURES.get(model_type, ARCHITECTURES[arch]), config=config, entries=entries,
                      has_tokenizer=has_tok,
                      tensor_bytes=total, types=types)


def _config(reader: Any, arch: str, model_type: str, entries: dict[str, GGUFEntry]) -> dict[str, Any]:
    """transformers' config keys from the metadata, as its load_gguf_checkpoint maps them (its own
    GGUF_CONFIG_MAPPING and defaults; the head tied where the file has no `output.weight`; the
    vocabulary the token list's length where no key gives it), read from this reader: that
    function opens the file again and parses every tokenizer array, which takes seconds at a real
    vocabulary (tests/compiler/test_gguf.py checks the two agree). An architecture transformers
    maps no keys for (Gemma 1) takes CONFIG_MAPPING's."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING, _gguf_parse_value

    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in entries or arch in TIED_IN_CONFIG}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    for key, fld in reader.fields.items():
        if len(fld.data) > 64:  # the tokenizer's arrays: no config key is one
            continue
        prefix, _, rest = key.replace(arch, model_type).partition(".")
        mapping = CONFIG_MAPPING.get(prefix) or GGUF_CONFIG_MAPPING.get(prefix, {})
        target = mapping.get(rest)
        if target is None or target == -1:
            continue
        value = [_gguf_parse_value(fld.parts[i], fld.types) for i in fld.data]
        value = value[0] if len(value) == 1 else value
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, model_type)
        config[target] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in reader.fields:
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    if model_type == "gpt_neox":
        neox_config(config)
    return config


def neox_config(config: dict[str, Any]) -> None:
    """GPT-NeoX's rotary share of a head from the file's rotary dimensions (llama.cpp writes
    int(rotary_pct x head_dim) as rope.dimension_count; GPTNeoXConfig takes the fraction)."""
    dims = config.pop("rotary_ndims", None)
    if dims is not None:
        config["rotary_pct"] = dims / (config["hidden_size"] // config["num_attention_heads"])


def check_falcon(path: Path, config: dict[str, Any], entries: dict[str, GGUFEntry]) -> None:
    """A falcon file of multi-query Falcon (7B-style: one KV head, one norm a layer), or a one-line
    refusal. llama.cpp's FalconModel converter reorders the fused query_key_value from per-KV-group
    interleaving (each group's query heads, then its key, then its value) into all queries, all keys,
    all values; with one group that is the order FalconForCausalLM's multi-query split reads (its
    last two heads the key and value), so the file's matrix is the checkpoint's. With several KV
    heads (the new decoder architecture: Falcon-40B/180B, Falcon2-11B; two norms a layer in 40B's
    `attn_norm_2`) the order differs, transformers' GGUF loader builds a multi-query model it cannot
    load, and the decode step covers multi-query Falcon only."""
    kv = config.get("num_key_value_heads", 1)
    norm2 = next((n for n in entries if ".attn_norm_2." in n), None)
    if kv != 1 or norm2 is not None:
        what = f"{kv} KV heads" if kv != 1 else f"a second norm a layer ('{norm2}')"
        raise SourceError(f"{path}: falcon with {what} (the new decoder architecture: Falcon-40B/180B, Falcon2) is "
                          "not supported; tvmpipe compiles multi-query Falcon (1 KV head, 7B-style)")


def q_k_rows(rows: int, heads: int) -> tuple[int, ...]:
    """The row order that undoes llama.cpp's q/k permutation (convert_hf_to_gguf's `permute`),
    as transformers' LlamaTensorProcessor undoes it: row r of the HF weight is row out[r] of the
    file's."""
    idx = np.arange(rows)
    dim = rows // heads // 2
    return tuple(int(i) for i in idx.reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows))


def neox_qkv_rows(rows: int, heads: int) -> tuple[int, ...]:
    """The row order that undoes llama.cpp's GPT-NeoX qkv reorder (GPTNeoXModel.modify_tensors:
    the checkpoint's per-head [query, key, value] rows made all queries, keys, values): row r of
    the HF weight (or bias) is row out[r] of the file's. Whole rows: a packed matrix's blocks move
    as they are."""
    return tuple(int(i) for i in np.arange(rows).reshape(3, heads, rows // 3 // heads).swapaxes(0, 1).reshape(rows))


def write_tokenizer(src: GGUFSource, out_dir: Path) -> list[Path]:
    """The file's tokenizer (tokenizer.ggml.*) and chat template as the tokenizer files text
    generation reads (tokenizer.json, tokenizer_config.json, ...), converted by transformers,
    offline, into `out_dir`. A GPT-NeoX file's is converted through GPTNeoXTokenizer (AutoTokenizer
    reads the config first, which transformers' GGUF loader does not read for "gptneox"); a Gemma
    file's is GemmaTokenizer's conversion (transformers' GGUF
    tokenizer builder for "gemma": merges from the token order, no prefix space), which AutoTokenizer
    would pick but cannot reach: it reads the file's config first, and its GGUF loader reads no
    Gemma 1 config."""
    from tvmpipe.bundle.bundle import TOKENIZER_FILES
    from tvmpipe.compiler import zoo

    zoo.ensure_torchvision()
    import transformers

    cls = getattr(transformers, TOKENIZER_CLASSES.get(src.arch, "AutoTokenizer"))
    try:
        tok = cls.from_pretrained(str(src.path.parent), gguf_file=src.path.name, local_files_only=True)
        tok.save_pretrained(str(out_dir))
    except Exception as exc:  # noqa: BLE001 - the converters raise anything on a tokenizer they do not know
        raise SourceError(f"{src.path}: transformers cannot convert its tokenizer ({type(exc).__name__}: "
                          f"{one_line(exc)}); pass --tokenizer DIR with the model's tokenizer files") from None
    files = [out_dir / n for n in TOKENIZER_FILES if (out_dir / n).is_file()]
    if not files or files[0].name != TOKENIZER_FILES[0]:
        raise SourceError(f"{src.path}: its tokenizer converts to no {TOKENIZER_FILES[0]}; pass --tokenizer DIR")
    return files
