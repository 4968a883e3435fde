"""A local Hugging Face checkpoint directory, read as `tvmpipe compile DIR` needs it.

A directory `save_pretrained` wrote: `config.json`, the weights as safetensors (`model.safetensors`,
or shards listed by `model.safetensors.index.json`), and the tokenizer files beside them. This
module reads what the compiler needs and refuses, in one line naming the file, what it cannot
take: no config, weights in a pickle format (`pytorch_model.bin`, `.pt`), an architecture outside
the supported families. Nothing is downloaded; no weight is read here: each tensor is a
`CheckpointTensor`, read from its file (bundle.weights.WeightsFile, by byte range) when the
bundle's weights file is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tvmpipe.bundle.bundle import TOKENIZER_FILES
from tvmpipe.bundle.dtypes import is_float, np_dtype
from tvmpipe.bundle.errors import BundleError
from tvmpipe.bundle.weights import TensorInfo, WeightsFile
from tvmpipe.compiler.decoders import CAUSAL_LM
from tvmpipe.compiler.errors import SourceError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Weights tvmpipe does not read (pickles, other frameworks): refused with what to do instead.
OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
OTHER_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")

# encoders the zoo compiles (compiler/zoo.py: bert_mask, t5_encoder), and BERT's masked-LM head:
# architecture -> the output the forward pass returns
ENCODERS: dict[str, str] = {"BertModel": "last_hidden_state", "BertForMaskedLM": "logits",
                            "T5EncoderModel": "last_hidden_state"}


def supported(decode: bool) -> list[str]:
    """The architectures `tvmpipe compile DIR` takes (with --decode: the causal LMs only)."""
    return list(CAUSAL_LM.values()) + ([] if decode else list(ENCODERS))


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a checkpoint's safetensors files, read when asked (`numpy()`): the weight
    source a placeholder constant's recipe starts from (compiler/lazyweights.py)."""

    file: WeightsFile
    info: TensorInfo

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    def numpy(self) -> np.ndarray:
        """A new array with the tensor's bytes, read by byte range (nothing else of the file)."""
        out = np.empty(self.info.shape, np_dtype(self.info.dtype))
        self.file.read_into(self.info.name, out)
        return out


@dataclass
class Checkpoint:
    """What `tvmpipe compile DIR` takes from a checkpoint directory."""

    path: Path
    config: dict[str, Any]
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    tensors: dict[str, CheckpointTensor]
    dtype: str  # the checkpoint's own: config `torch_dtype`/`dtype`, else its tensors'
    tokenizer_files: list[Path] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The directory's own name (`tvmpipe compile .` too)."""
        return self.path.resolve().name


def open_checkpoint(source: str | Path, decode: bool) -> Checkpoint:
    """The checkpoint directory `source`, checked: its config names a supported architecture (with
    `decode`, a causal LM), its weights are safetensors and every shard the index names exists."""
    path = Path(source)
    config = _read_config(path)
    arch = _architecture(path, config, decode)
    tensors = _open_weights(path)
    return Checkpoint(path=path, config=config, architecture=arch, tensors=tensors, dtype=_dtype(path, config, tensors),
                      tokenizer_files=tokenizer_files(path))


def tokenizer_files(path: Path) -> list[Path]:
    """The tokenizer files of TOKENIZER_FILES the directory has, where it has a tokenizer.json: a
    bundle's tokenizer directory is a tokenizer (the text layer reads tokenizer.json first), so a
    checkpoint without one (save_pretrained's generation_config.json alone) gives none."""
    if not (path / TOKENIZER_FILES[0]).is_file():
        return []
    return [path / n for n in TOKENIZER_FILES if (path / n).is_file()]


def _read_config(path: Path) -> dict[str, Any]:
    f = path / CONFIG
    if not f.is_file():
        raise SourceError(f"{path}: no {CONFIG}: not a Hugging Face checkpoint directory (write one with "
                          "model.save_pretrained(DIR))")
    try:
        obj = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{f}: not readable JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{f}: must be a JSON object")
    return obj


def _architecture(path: Path, config: dict[str, Any], decode: bool) -> str:
    """The transformers class to build: config `architectures[0]`, else the causal LM of its
    `model_type`; refused unless supported."""
    archs = config.get("architectures")
    model_type = config.get("model_type")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        arch = archs[0]
    elif model_type in CAUSAL_LM:
        arch = CAUSAL_LM[model_type]
    else:
        arch = None
    ok = supported(decode)
    if arch not in ok:
        what = f"architecture '{arch}'" if arch else "no architecture"
        raise SourceError(f"{path / CONFIG}: {what} (model_type '{model_type}') is not supported"
                          f"{' by --decode' if decode else ''}; supported: {', '.join(ok)}")
    return arch


def _open_weights(path: Path) -> dict[str, CheckpointTensor]:
    """name -> tensor over the single file or the index's shards (each file opened once)."""
    if (path / SINGLE).is_file():
        return _tensors(path / SINGLE)
    index = path / INDEX
    if not index.is_file():
        other = sorted(p.name for p in path.iterdir() if p.name in OTHER_WEIGHTS or p.suffix in OTHER_SUFFIXES)
        if other:
            raise SourceError(f"{path / other[0]}: tvmpipe reads safetensors weights only; save the model with "
                              f"save_pretrained(DIR, safe_serialization=True) to write {SINGLE}")
        raise SourceError(f"{path}: no {SINGLE} or {INDEX} (the weights as safetensors)")
    try:
        obj = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{index}: not readable JSON: {exc}") from None
    wmap = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) and "/" not in v for v in wmap.values()):
        raise SourceError(f"{index}: weight_map must map tensor names to shard file names in {path}")
    out: dict[str, CheckpointTensor] = {}
    for shard in sorted(set(wmap.values())):
        if not (path / shard).is_file():
            raise SourceError(f"{index}: shard {shard} is missing from {path}")
        for name, t in _tensors(path / shard).items():
            if wmap.get(name) == shard:
                out[name] = t
    missing = [n for n, s in wmap.items() if n not in out]
    if missing:
        raise SourceError(f"{path / wmap[missing[0]]}: has no tensor '{missing[0]}', which {INDEX} places there")
    return out


def _tensors(file: Path) -> dict[str, CheckpointTensor]:
    try:
        wf = WeightsFile(file)
    except BundleError as exc:
        raise SourceError(f"{exc.problems[0]} (a checkpoint's safetensors file)") from None
    return {name: CheckpointTensor(wf, info) for name, info in wf.tensors.items()}


def _dtype(path: Path, config: dict[str, Any], tensors: dict[str, CheckpointTensor]) -> str:
    """The checkpoint's own float dtype: config `dtype` (transformers 5) or `torch_dtype`, else
    the dtype most of its floating-point tensors' bytes are in."""
    raw = config.get("dtype") or config.get("torch_dtype")
    if isinstance(raw, str) and raw.replace("torch.", "") in FLOAT_DTYPES:
        return raw.replace("torch.", "")
    sizes: dict[str, int] = {}
    for t in tensors.values():
        if is_float(t.dtype):
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes
    if not sizes:
        raise SourceError(f"{path}: the checkpoint has no floating-point tensors")
    dt = max(sizes, key=sizes.__getitem__)
    if dt not in FLOAT_DTYPES:
        raise SourceError(f"{path}: its weights are {dt}; tvmpipe compiles {', '.join(FLOAT_DTYPES)} checkpoints")
    return dt
