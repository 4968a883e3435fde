"""The transformers model of a checkpoint directory, built without reading its weights.

`from_pretrained` would read every tensor into memory before tvmpipe could stream it into the
bundle. Here the model is built on the meta device (no memory, no initialisation), its buffers
(rotary frequencies, Gemma's embedding scale: small, not in the checkpoint) are computed on the CPU
by the model's own `_init_weights`, as `from_pretrained` computes them, and each parameter becomes
`torch.empty` of its shape (allocated, never written, so never resident) paired with the
checkpoint tensor it holds. torch.export traces the model without reading parameter values, TVM's
importer takes them through DLPack without a copy, and the compiler binds each one as a
placeholder whose recipe starts from the checkpoint tensor (lazyweights.py): the weights are read
once, tensor by tensor, when the bundle's weights file is written.

A tied LM head is the same Parameter object as the input embedding (transformers ties them at
construction), so it is one weight here, one graph param and one tensor in the bundle.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from tvmpipe.compiler.checkpoint import Checkpoint, CheckpointTensor
from tvmpipe.compiler.errors import SourceError, one_line

TORCH_DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class CheckpointModel:
    """The model (eval mode, eager attention) and, per parameter object, its checkpoint tensor."""

    model: Any  # transformers PreTrainedModel
    sources: dict[int, CheckpointTensor]  # id(parameter) -> the checkpoint tensor it holds
    dtype: str  # the parameters' dtype (the import dtype)

    def sources_by_name(self, module: Any) -> dict[str, CheckpointTensor]:
        """{name in `module` (which holds the model): checkpoint tensor}, under every name a
        parameter has (a tied weight has two), so any name torch.export picks is found."""
        return {n: self.sources[id(p)] for n, p in module.named_parameters(remove_duplicate=False)
                if id(p) in self.sources}


def meta_model(cls: Any, config: Any, tdt: Any, failure: str) -> Any:
    """`cls(config)` with its parameters on the meta device (no weight memory: they are read from
    the source file later) and its buffers real and computed (rotary frequencies, ...); a config the
    class cannot build is a SourceError starting with `failure`."""
    import torch

    try:
        with _default_dtype(tdt), torch.device("meta"):
            model = cls(config)
        with _default_dtype(tdt):
            for name, buf in list(model.named_buffers(remove_duplicate=False)):
                _set(model, name, torch.empty_like(buf, device="cpu"), buffer=True)
            model.initialize_weights()  # computes the buffers; the parameters are still meta: nothing else
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a config the class cannot build
        raise SourceError(f"{failure} ({type(exc).__name__}: {one_line(exc)})") from None
    return model


@contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    """Build in the checkpoint's dtype, as from_pretrained does: buffers made with the default
    dtype (Gemma's embedding scale) then have the dtype transformers gives them."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(ckpt: Checkpoint, dtype: str) -> CheckpointModel:
    """The checkpoint's model with `dtype` parameters (float32, float16 or bfloat16: the checkpoint's
    own, or --dtype's), every parameter an unwritten `torch.empty` whose value is the checkpoint
    tensor beside it (cast to `dtype` as it is written, where they differ)."""
    import torch

    from tvmpipe.compiler import zoo

    zoo.ensure_torchvision()
    import transformers

    if dtype not in TORCH_DTYPES:
        raise SourceError(f"internal: cannot build a {dtype} model")
    tdt = getattr(torch, dtype)
    try:
        config = transformers.AutoConfig.from_pretrained(str(ckpt.path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, KeyError, OSError, ...
        raise SourceError(f"{ckpt.path / 'config.json'}: transformers cannot read it ({type(exc).__name__}: "
                          f"{one_line(exc)})") from None
    config._attn_implementation = "eager"  # traceable by torch.export; the same math as sdpa
    model = meta_model(getattr(transformers, ckpt.architecture), config, tdt,
                       f"{ckpt.path}: transformers cannot build {ckpt.architecture} from its config")
    by_key, converted = _model_keys(ckpt, model)
    _load_persistent_buffers(by_key, model)
    sources: dict[int, CheckpointTensor] = {}
    groups: dict[int, list[str]] = {}
    first: dict[int, Any] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
        first.setdefault(id(p), p)
    for key, names in groups.items():
        old = first[key]
        src = _find(ckpt, by_key, converted, names)
        if tuple(src.shape) != tuple(old.shape):
            raise SourceError(f"{ckpt.path}: tensor '{src.info.name}' is {list(src.shape)} but {ckpt.architecture} "
                              f"with this config.json needs {list(old.shape)} for '{names[0]}'")
        new = torch.nn.Parameter(torch.empty(old.shape, dtype=tdt), requires_grad=False)
        for name in names:
            _set(model, name, new)
        sources[id(new)] = src
    return CheckpointModel(model.eval(), sources, dtype)


def _set(model: Any, name: str, value: Any, buffer: bool = False) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    (module._buffers if buffer else module._parameters)[leaf] = value


def _model_keys(ckpt: Checkpoint, model: Any) -> tuple[dict[str, CheckpointTensor], dict[str, str]]:
    """The checkpoint's tensors under the model's names, renamed as from_pretrained renames them
    (transformers' conversion mapping: GPT-NeoX's `embed_out` is `lm_head`, legacy `gamma`/`beta`
    are `weight`/`bias`, a base model's checkpoint lacks the head model's prefix), and the model
    names whose tensors transformers would compute from several (merged experts): those are
    {model name: checkpoint name} in the second dict, refused when needed."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out: dict[str, CheckpointTensor] = {}
    converted: dict[str, str] = {}
    for name, t in ckpt.tensors.items():
        new, pattern = rename_source_key(name, renamings, converters, prefix, meta)
        if new not in meta and name in meta:  # as from_pretrained: a rename that misses, undone
            new, pattern = rename_source_key(name, [], [], prefix, meta)
        if pattern is not None:
            converted[new] = name
        else:
            out.setdefault(new, t)
    return out, converted


def _find(ckpt: Checkpoint, by_key: dict[str, CheckpointTensor], converted: dict[str, str],
          names: list[str]) -> CheckpointTensor:
    """The checkpoint tensor of a parameter known under `names` (a tied one has several)."""
    for name in names:
        if name in by_key:
            return by_key[name]
    for name in names:
        if name in converted:
            raise SourceError(f"{ckpt.path}: tensor '{converted[name]}' becomes '{name}' only through a conversion "
                              "transformers computes at load time; tvmpipe streams tensors as stored")
    raise SourceError(f"{ckpt.path}: the checkpoint has no tensor '{names[0]}', which {ckpt.architecture} needs "
                      f"(its safetensors hold {len(ckpt.tensors)} tensors)")


def _load_persistent_buffers(by_key: dict[str, CheckpointTensor], model: Any) -> None:
    """Buffers the checkpoint holds (state-dict buffers: small) take its values."""
    import torch

    for name, buf in model.named_buffers():
        t = by_key.get(name)
        if t is not None and tuple(t.shape) == tuple(buf.shape):
            value = t.numpy()
            if value.dtype.kind == "V" or str(value.dtype) == "bfloat16":
                tensor = torch.from_numpy(value.view("int16")).view(torch.bfloat16)
            else:
                tensor = torch.from_numpy(value)
            with torch.no_grad():
                buf.copy_(tensor.to(buf.dtype))
