"""A zoo of published architectures with seeded random weights, and their two export paths.

A user brings their own model; these are the models they bring: torchvision's classification
networks and Hugging Face `transformers` models built from small configs. Nothing is downloaded:
every weight comes from a torch generator seeded with `seed`, in parameter order.

CNNs come from torchvision's own model definitions. torchvision's wheels on the package index are
CUDA builds: with the pinned CPU torch, `import torchvision` fails in its package `__init__` while
registering fake kernels for `torchvision::nms`. The classification models are pure Python and
need none of that, so `_torchvision_models()` imports `torchvision.models.<arch>` under empty
parent packages (no `__init__` runs) when the normal import fails. This keeps the real published
layer code (not a copy that could drift) at the cost of one import trick, and needs no second
torch build.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tvmpipe.compiler.errors import SourceError
from tvmpipe.compiler.models import calibrate_batch_norm, example_input

EXPORT_PATHS = ("pt2", "onnx")
ONNX_OPSET = 17


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build the torch module and its seeded example inputs."""

    name: str
    family: str  # "torchvision" | "transformers"
    description: str
    build: Callable[[int], Any]  # seed -> torch module in eval mode
    inputs: Callable[[int], dict[str, np.ndarray]]  # seed -> named example inputs (batch 1)


# ---- torchvision ----------------------------------------------------------------------------------

def ensure_torchvision() -> None:
    """Make `torchvision.models.*` importable, also where `import torchvision` fails (see above).

    transformers imports torchvision too when it is installed, so this runs before either.
    """
    if "torchvision" in sys.modules:
        return
    try:
        importlib.import_module("torchvision")
        return
    except (RuntimeError, ImportError):  # the CUDA wheel's nms registration on a CPU torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    root = Path(spec.origin).parent
    for name, path in (("torchvision", root), ("torchvision.models", root / "models")):
        stub = types.ModuleType(name)
        stub.__path__ = [str(path)]  # a namespace-like package: its __init__ never runs
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        stub.__spec__.submodule_search_locations = [str(path)]
        sys.modules[name] = stub


def _torchvision_models(arch_module: str) -> types.ModuleType:
    """`torchvision.models.<arch_module>`, importable even where `import torchvision` fails."""
    ensure_torchvision()
    try:
        return importlib.import_module(f"torchvision.models.{arch_module}")
    except ImportError as exc:
        raise SourceError(f"the model zoo needs torchvision's model definitions ({exc}): "
                          "pip install -e '.[compile]' (torchvision is in the compile extra)") from None


def _reinit_zero_weights(module: Any, gen: Any) -> None:
    """Zero-initialised heads (ViT, Swin) give an all-zero output; draw them like any Linear."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2 and not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))


def _seeded(module: Any, seed: int) -> None:
    """Every parameter redrawn from `seed` with the module's own init scale (per-tensor std kept)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                std = 1.0 / math.sqrt(math.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("weight"):  # norm scales
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # biases, norm shifts, class tokens
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    _reinit_zero_weights(module, gen)


def _vision(arch_module: str, factory: str, size: int, **kwargs: Any) -> tuple[Callable[[int], Any], Callable]:
    def build(seed: int) -> Any:
        import torch

        mod = _torchvision_models(arch_module)
        torch.manual_seed(seed)  # stochastic-depth and dropout modules draw nothing in eval mode
        model = getattr(mod, factory)(**kwargs)
        _seeded(model, seed)
        calibrate_batch_norm(model, torch.from_numpy(example_input((4, 3, size, size), "float32", seed + 1)))
        return model.eval()

    def inputs(seed: int) -> dict[str, np.ndarray]:
        return {"x": example_input((1, 3, size, size), "float32", seed + 2)}

    return build, inputs


# ---- transformers ---------------------------------------------------------------------------------

SEQ = 16
VOCAB = 128


def _text_inputs(mask: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 2)
    out = {"input_ids": rng.integers(0, VOCAB, (1, SEQ)).astype(np.int64)}
    if mask:
        m = np.ones((1, SEQ), np.int64)
        m[0, SEQ - 4:] = 0  # right padding: the last 4 tokens are masked out
        out["attention_mask"] = m
    return out


def text_forward(inner: Any, output: str) -> Any:
    """A transformers model as a module of positional tensors in, one tensor out (its `output`:
    logits, last_hidden_state): what both exporters and tvmpipe expect. A causal LM runs without
    its KV cache objects (use_cache=False)."""
    import torch

    config = inner.config
    causal = getattr(config, "is_decoder", False) or type(inner).__name__.endswith(("CausalLM", "LMHeadModel"))

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any = None) -> Any:
            kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
            if causal:
                kwargs["use_cache"] = False  # no KV cache objects: one tensor in, one out
            return getattr(self.inner(input_ids=input_ids, return_dict=True, **kwargs), output)

    return Wrapped().eval()


def _hf(config_cls: str, model_cls: str, mask: bool, output: str, **cfg: Any) -> tuple[Callable, Callable]:
    def build(seed: int) -> Any:
        import torch

        ensure_torchvision()
        import transformers

        config = getattr(transformers, config_cls)(**cfg)
        config._attn_implementation = "eager"  # traceable by both exporters; same math as sdpa
        torch.manual_seed(seed)
        inner = getattr(transformers, model_cls)(config)
        _seeded(inner, seed)
        return text_forward(inner.eval(), output)

    return build, lambda seed: _text_inputs(mask, seed)


_BERT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=64)
_GPT2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=64, rms_norm_eps=1e-6)
# more published decoders (issue 24, item 6), same tiny sizes: 2 layers, hidden 64, 4 heads of 16
_DEC = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64)
_PHI3 = dict(_DEC, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # rotary over whole heads
_GEMMA = dict(_DEC, num_key_value_heads=1, head_dim=16)  # multi-query, GeGLU (tanh GELU), scaled embeddings
_NEOX = dict(_DEC, rotary_pct=0.25, bos_token_id=0, eos_token_id=0)  # Pythia: partial rotary, parallel residual
_OPT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
            max_position_embeddings=64, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2, eos_token_id=2)
_FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, bos_token_id=0,
               eos_token_id=0)  # multi-query fused qkv (qkv[..., [-2]] picks the key), parallel attention
_QWEN3 = dict(_DEC, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)  # RMSNorm on q and k per head
_T5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)


def _entries() -> dict[str, ZooModel]:
    def tv(name: str, module: str, factory: str, size: int, desc: str, **kw: Any) -> ZooModel:
        return ZooModel(name, "torchvision", desc, *_vision(module, factory, size, **kw))

    def hf(name: str, desc: str, *args: Any, **kw: Any) -> ZooModel:
        return ZooModel(name, "transformers", desc, *_hf(*args, **kw))

    zoo = [
        tv("resnet50", "resnet", "resnet50", 64, "torchvision ResNet-50, 64x64"),
        tv("mobilenet_v2", "mobilenetv2", "mobilenet_v2", 64, "torchvision MobileNetV2 (ReLU6), 64x64"),
        tv("efficientnet_b0", "efficientnet", "efficientnet_b0", 64, "torchvision EfficientNet-B0 (SiLU, SE), 64x64"),
        tv("convnext_tiny", "convnext", "convnext_tiny", 64, "torchvision ConvNeXt-T (LayerNorm2d, GELU), 64x64"),
        tv("shufflenet_v2", "shufflenetv2", "shufflenet_v2_x0_5", 64, "torchvision ShuffleNetV2 x0.5, 64x64"),
        tv("swin_t", "swin_transformer", "swin_t", 64, "torchvision Swin-T (shifted windows, padded to 7x7), 64x64"),
        tv("vit_small", "vision_transformer", "VisionTransformer", 32,
           "torchvision ViT: 32x32, patch 8, 2 layers, 4 heads, hidden 64",
           image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128),
        hf("bert_mask", "BERT encoder, hidden 64, 2 layers, seq 16, with attention mask",
           "BertConfig", "BertModel", True, "last_hidden_state", **_BERT),
        hf("gpt2", "GPT-2 LM, n_embd 64, 2 layers, seq 16, no mask", "GPT2Config", "GPT2LMHeadModel", False,
           "logits", **_GPT2),
        hf("gpt2_mask", "GPT-2 LM with attention mask", "GPT2Config", "GPT2LMHeadModel", True, "logits", **_GPT2),
        hf("llama", "Llama LM (RoPE, RMSNorm, SiLU, GQA 4/2 heads, causal), hidden 64, 2 layers, no mask",
           "LlamaConfig", "LlamaForCausalLM", False, "logits", **_LLAMA),
        hf("llama_mask", "Llama LM with attention mask", "LlamaConfig", "LlamaForCausalLM", True, "logits",
           **_LLAMA),
        hf("phi3_mask", "Phi-3 LM (fused qkv and gate-up, rotary over whole heads, GQA 4/2), with attention mask",
           "Phi3Config", "Phi3ForCausalLM", True, "logits", **_PHI3),
        hf("gemma_mask", "Gemma LM (multi-query, GeGLU, scaled embeddings, head_dim 16), with attention mask",
           "GemmaConfig", "GemmaForCausalLM", True, "logits", **_GEMMA),
        hf("gpt_neox_mask", "GPT-NeoX / Pythia LM (rotary on 25% of each head, parallel residual), with attention "
           "mask", "GPTNeoXConfig", "GPTNeoXForCausalLM", True, "logits", **_NEOX),
        hf("opt_mask", "OPT LM (learned positions offset by 2, ReLU MLP), with attention mask", "OPTConfig",
           "OPTForCausalLM", True, "logits", **_OPT),
        hf("falcon_mask", "Falcon LM (multi-query fused qkv, parallel attention and MLP, rotary), with attention "
           "mask", "FalconConfig", "FalconForCausalLM", True, "logits", **_FALCON),
        hf("qwen3_mask", "Qwen3 LM (q/k RMSNorm per head, GQA 4/2), with attention mask", "Qwen3Config",
           "Qwen3ForCausalLM", True, "logits", **_QWEN3),
        hf("t5_encoder", "T5 encoder (relative position bias, RMS norm), d_model 64, 2 layers, with mask",
           "T5Config", "T5EncoderModel", True, "last_hidden_state", **_T5),
    ]
    return {m.name: m for m in zoo}


ZOO: dict[str, ZooModel] = _entries()


def get_zoo_model(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        raise SourceError(f"'{name}' is not a zoo model (zoo: {', '.join(ZOO)})") from None


# ---- export ---------------------------------------------------------------------------------------

def export_pt2(module: Any, inputs: dict[str, np.ndarray], path: Path) -> Path:
    """torch.export the module on `inputs` (static shapes) and save it as a .pt2 program."""
    import torch

    args = tuple(torch.from_numpy(v) for v in inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, args)
        torch.export.save(ep, str(path))
    return path


def export_onnx(module: Any, inputs: dict[str, np.ndarray], path: Path) -> Path:
    """torch's TorchScript-based ONNX exporter (the dynamo one needs onnxscript), static shapes."""
    import torch

    args = tuple(torch.from_numpy(v) for v in inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=list(inputs), output_names=["out"],
                          opset_version=ONNX_OPSET, dynamo=False, do_constant_folding=True)
    return path


def export_model(model: ZooModel, path_kind: str, out_dir: Path, seed: int = 0) -> tuple[Path, Any, dict]:
    """(model file, torch module, example inputs) for one zoo model and export path."""
    if path_kind not in EXPORT_PATHS:
        raise SourceError(f"unknown export path {path_kind!r} (expected one of {', '.join(EXPORT_PATHS)})")
    module = model.build(seed)
    inputs = model.inputs(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{model.name}.{path_kind}"
    (export_pt2 if path_kind == "pt2" else export_onnx)(module, inputs, path)
    return path, module, inputs


def torch_output(module: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return module(*(torch.from_numpy(v) for v in inputs.values())).numpy()
