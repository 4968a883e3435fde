"""Built-in models, written in torch, with weights that depend only on a seed.

They give every part of tvmpipe realistic graphs to work on without downloads: an MLP (the
relay-era five-fused-op example), a small CNN, ResNet-18 (written out here: no torchvision) and one
BERT-base encoder layer. torch is imported inside functions: it is a compile-only dependency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from tvmpipe.compiler.errors import SourceError


@dataclass(frozen=True)
class BuiltinModel:
    """A model tvmpipe can compile by name. `input_shape(batch)` is the shape of its one input `x`."""

    name: str
    description: str
    build: Callable[[], Any]  # () -> torch.nn.Module with default-initialised weights
    input_shape: Callable[[int], tuple[int, ...]]


def _mlp() -> Any:
    import torch
    from torch import nn

    class MLP(nn.Module):
        """100 -> 400 -> 1000 -> 2000 -> 10, relu between, log_softmax on top."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(100, 400)
            self.fc2 = nn.Linear(400, 1000)
            self.fc3 = nn.Linear(1000, 2000)
            self.fc4 = nn.Linear(2000, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.fc1(x))
            x = torch.relu(self.fc2(x))
            x = torch.relu(self.fc3(x))
            return torch.log_softmax(self.fc4(x), dim=-1)

    return MLP()


def _cnn() -> Any:
    import torch
    from torch import nn

    class CNN(nn.Module):
        """Two conv(3x3, bias)+relu+maxpool(2) blocks on 3x32x32, global average pool, dense to 10."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            self.fc = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
            x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
            x = torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1)
            return self.fc(x)

    return CNN()


def _resnet18() -> Any:
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            identity = x if self.downsample is None else self.downsample(x)
            return torch.relu(y + identity)

    class ResNet18(nn.Module):
        """torchvision's resnet18 layout: 224x224 NCHW input, 1000 classes."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            layers = []
            cin = 64
            for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
                cin = cout
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, 1000)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet18()


def _transformer() -> Any:
    import torch
    from torch import nn

    class EncoderLayer(nn.Module):
        """One BERT-base encoder layer (post-norm): hidden 768, 12 heads, FFN 3072, exact gelu.

        Attention is written with matmul/softmax rather than scaled_dot_product_attention so the
        bundle shows the ops a reader expects (and the NumPy backend can compute each one).
        """

        def __init__(self, hidden: int = 768, heads: int = 12, ffn: int = 3072) -> None:
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            self.query = nn.Linear(hidden, hidden)
            self.key = nn.Linear(hidden, hidden)
            self.value = nn.Linear(hidden, hidden)
            self.attn_out = nn.Linear(hidden, hidden)
            self.attn_norm = nn.LayerNorm(hidden, eps=1e-12)
            self.ffn_in = nn.Linear(hidden, ffn)
            self.ffn_out = nn.Linear(ffn, hidden)
            self.ffn_norm = nn.LayerNorm(hidden, eps=1e-12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, h = x.shape
            q = self.query(x).reshape(b, s, self.heads, self.head_dim).permute(0, 2, 1, 3)
            k = self.key(x).reshape(b, s, self.heads, self.head_dim).permute(0, 2, 3, 1)
            v = self.value(x).reshape(b, s, self.heads, self.head_dim).permute(0, 2, 1, 3)
            scores = torch.matmul(q, k) / math.sqrt(self.head_dim)
            ctx = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).reshape(b, s, h)
            x = self.attn_norm(x + self.attn_out(ctx))
            y = self.ffn_out(nn.functional.gelu(self.ffn_in(x)))
            return self.ffn_norm(x + y)

    return EncoderLayer()


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel("mlp", "MLP 100-400-1000-2000-10, relu, log_softmax", _mlp, lambda n: (n, 100)),
        BuiltinModel("cnn", "2x (conv3x3+bias+relu+maxpool2), global avg pool, dense; 3x32x32",
                     _cnn, lambda n: (n, 3, 32, 32)),
        BuiltinModel("resnet18", "ResNet-18, 224x224 NCHW, batch-norm folded at compile time",
                     _resnet18, lambda n: (n, 3, 224, 224)),
        BuiltinModel("transformer", "one BERT-base encoder layer: seq 128, hidden 768, 12 heads",
                     _transformer, lambda n: (n, 128, 768)),
    )
}


def get_builtin(name: str) -> BuiltinModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise SourceError(
            f"'{name}' is not a file and not a built-in model (built-in models: {', '.join(BUILTIN_MODELS)}; "
            "files must end in .onnx or .pt2)"
        ) from None


def init_weights(module: Any, seed: int) -> None:
    """Fill every parameter and buffer from a generator seeded with `seed`.

    torch's default init depends on the global RNG and on the torch version; this depends on the
    seed and the parameter order only. Scales are fan-in based so activations stay O(1).
    """
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in module.modules():
            if isinstance(mod, (nn.Linear, nn.Conv2d)):
                fan_in = math.prod(mod.weight.shape[1:])
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * math.sqrt(2.0 / fan_in))
                if mod.bias is not None:
                    mod.bias.copy_(torch.randn(mod.bias.shape, generator=gen) * 0.1)
            elif isinstance(mod, (nn.BatchNorm2d, nn.LayerNorm)):
                mod.weight.copy_(1.0 + 0.1 * torch.randn(mod.weight.shape, generator=gen))
                mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=gen))


def calibrate_batch_norm(module: Any, x: Any) -> None:
    """Set batch-norm running statistics from one batch so deep random nets keep O(1) activations.

    Random running stats make ResNet-18's logits explode or vanish, which would make a numerical
    check meaningless; this keeps the model deterministic while behaving like a trained one.
    """
    import torch
    from torch import nn

    bns = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    if not bns:
        return
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = 1.0
    module.train()
    with torch.no_grad():
        module(x)
    module.eval()


def example_input(shape: tuple[int, ...], dtype: str = "float32", seed: int = 0) -> np.ndarray:
    """The deterministic input tests and checks feed to a model: standard normal from `seed`."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def build_builtin(name: str, batch: int, seed: int) -> Any:
    """The built-in model `name` in eval mode (float32), weights from `seed`."""
    import torch

    spec = get_builtin(name)
    model = spec.build()
    init_weights(model, seed)
    calib = torch.from_numpy(example_input((max(batch, 2),) + spec.input_shape(1)[1:], "float32", seed + 1))
    calibrate_batch_norm(model, calib)
    return model.eval()
