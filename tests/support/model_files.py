"""Model files the compiler tests feed to `tvmpipe compile`: built with onnx.helper and torch.export.

Small on purpose (they compile in about a second) but covering ops the built-in models do not:
sigmoid/multiply (swish), concat, average pooling, batch-norm folding, tanh, bias-less conv.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_onnx_model(path: Path, seed: int = 0) -> Path:
    """Conv+bias -> swish -> maxpool -> [branch a | branch b] concat -> global avg pool -> Gemm -> Softmax.

    Input 'data' is (N, 3, 16, 16) with a symbolic batch dimension.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [
        init("conv1.w", (8, 3, 3, 3), 0.3), init("conv1.b", (8,), 0.1),
        init("conv2.w", (8, 8, 1, 1), 0.3), init("conv2.b", (8,), 0.1),
        init("fc.w", (10, 16), 0.3), init("fc.b", (10,), 0.1),
        numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half"),
    ]
    nodes = [
        helper.make_node("Conv", ["data", "conv1.w", "conv1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["s1"], name="sigmoid1"),
        helper.make_node("Mul", ["c1", "s1"], ["swish1"], name="swish1"),
        helper.make_node("MaxPool", ["swish1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.w", "conv2.b"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Mul", ["p1", "half"], ["scaled"], name="scale"),
        helper.make_node("Concat", ["r2", "scaled"], ["cat"], name="concat", axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "small_onnx",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def write_unsupported_onnx(path: Path, op: str) -> Path:
    """A model whose middle node is TopK or CumSum: sort/scan ops a flat launch list cannot express."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = []
    if op == "TopK":
        inits.append(numpy_helper.from_array(np.array([5], dtype=np.int64), "k"))
        mid = helper.make_node("TopK", ["r", "k"], ["y", "idx"], name="my_topk", axis=-1)
        out_shape = [1, 5]
    elif op == "CumSum":
        inits.append(numpy_helper.from_array(np.array(1, dtype=np.int64), "axis"))
        mid = helper.make_node("CumSum", ["r", "axis"], ["y"], name="my_cumsum")
        out_shape = [1, 64]
    else:
        raise ValueError(op)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), mid]
    graph = helper.make_graph(nodes, f"with_{op.lower()}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def write_two_output_onnx(path: Path) -> Path:
    """relu -> split in two -> (tanh, sigmoid): a tuple-producing op and a model with two outputs."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Relu", ["data"], ["r"], name="relu"),
        helper.make_node("Split", ["r"], ["s0", "s1"], name="split", axis=1, num_outputs=2),
        helper.make_node("Tanh", ["s0"], ["t"], name="tanh"),
        helper.make_node("Sigmoid", ["s1"], ["u"], name="sigmoid"),
    ]
    graph = helper.make_graph(nodes, "two_outputs",
                              [helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 4]),
                               helper.make_tensor_value_info("u", TensorProto.FLOAT, [2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def onnx_reference(path: Path, x: np.ndarray) -> list[np.ndarray]:
    """The ONNX reference implementation's outputs: independent of TVM and of torch."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(onnx.load(str(path))).run(None, {"data": x})


def torch_model(seed: int = 0):
    """Bias-less conv + batch norm (folded at compile time), tanh, avg pool, concat, linear."""
    import torch
    from torch import nn

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(8)
            self.fc = nn.Linear(8 * 4 * 4 + 8, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(self.bn(self.conv(x)))
            pooled = nn.functional.avg_pool2d(y, 2)
            stats = y.mean(dim=(2, 3))
            return self.fc(torch.cat([pooled.flatten(1), stats], dim=1)) - 0.25

    torch.manual_seed(seed)
    m = Small()
    with torch.no_grad():
        m.bn.running_mean.copy_(torch.randn(8) * 0.1)
        m.bn.running_var.copy_(torch.rand(8) + 0.5)
        m.bn.weight.copy_(torch.rand(8) + 0.5)
        m.bn.bias.copy_(torch.randn(8) * 0.1)
    return m.eval()


def write_pt2(path: Path, batch: int = 2, seed: int = 0):
    """torch.export the small model with input (batch, 4, 16, 16); returns the torch module."""
    import torch

    m = torch_model(seed)
    ep = torch.export.export(m, (torch.zeros(batch, 4, 16, 16),))
    torch.export.save(ep, str(path))
    return m
