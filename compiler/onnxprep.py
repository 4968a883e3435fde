"""ONNX models prepared for TVM's importer with onnx's own tools, and its failures located.

Exporters leave shape arithmetic in the graph: `Shape -> Gather -> Unsqueeze -> Concat ->
ConstantOfShape / Reshape / Expand`. TVM's ONNX importer then meets ops whose inputs it can only
partly infer: `ConstantOfShape` of an empty shape (a scalar) trips its `broadcast_to`, a `Reshape`
of a value whose shape it lost fails, int32/int64 shape values meet in one `Where`. With the model's
input shapes fixed, every such value is a constant. `fold_constants` runs onnx's shape inference,
turns `Shape` of a statically shaped value into a constant, and evaluates every node whose inputs
are all constant with `onnx.reference` (onnx's own evaluator), so the importer sees constants.

`locate_failure` wraps the importer so a failure names the ONNX node (its name and op type)
instead of a Python traceback and TVM's printout of the node's inputs.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

# Nodes never folded: random ops would freeze one draw, and control flow has subgraphs.
_NEVER_FOLD = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
               "Bernoulli", "If", "Loop", "Scan", "SequenceConstruct"}
# A folded value larger than this stays an op: folding would only copy weights around.
_MAX_FOLD_ELEMENTS = 1 << 22


def fold_constants(model: Any, shapes: dict[str, list[int]]) -> Any:
    """A copy of `model` with shape arithmetic and constant-only nodes replaced by initializers."""
    import onnx
    from onnx import helper, numpy_helper, shape_inference
    from onnx.reference import ReferenceEvaluator

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    for vi in graph.input:  # fix the input shapes inference works from (batch included)
        if vi.name in shapes:
            for d, n in zip(vi.type.tensor_type.shape.dim, shapes[vi.name]):
                d.Clear()
                d.dim_value = n
    try:
        model = shape_inference.infer_shapes(model, data_prop=True)
        graph = model.graph
    except Exception:  # noqa: BLE001 - inference is an aid; the importer reports real problems
        pass
    static: dict[str, list[int]] = {}
    for vi in list(graph.value_info) + list(graph.input) + list(graph.output):
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            static[vi.name] = [d.dim_value for d in dims]
    known: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    kept, added = [], []
    for node in graph.node:
        value = _fold_node(node, known, static, ReferenceEvaluator)
        if value is None or any(o in outputs for o in node.output):
            kept.append(node)
            continue
        for name, arr in zip(node.output, value):
            known[name] = arr
            added.append(numpy_helper.from_array(np.asarray(arr), name))
    used = {i for n in kept for i in n.input} | outputs
    # Integer values (shapes, indices, masks) go in as Constant nodes: with keep_params_in_input
    # TVM's importer makes every initializer a parameter, and an `Expand` whose shape is a parameter
    # gets symbolic dims (`vm.builtin.tensor_to_shape`), which the next `Reshape` cannot infer from.
    values = [i for i in graph.initializer if i.name in used] + [a for a in added if a.name in used]
    consts = [v for v in values if not _is_float(v)]
    if not added and not consts:
        return model
    const_nodes = [helper.make_node("Constant", [], [v.name], name=f"folded:{v.name}", value=v) for v in consts]
    del graph.node[:]
    graph.node.extend(const_nodes + kept)
    del graph.initializer[:]
    graph.initializer.extend(v for v in values if _is_float(v))
    del graph.value_info[:]  # stale for folded values; TVM infers its own
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)


def _is_float(tensor: Any) -> bool:
    from onnx import TensorProto

    return tensor.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


def _fold_node(node: Any, known: dict[str, np.ndarray], static: dict[str, list[int]],
               evaluator: Any) -> list[np.ndarray] | None:
    """The node's output values if they are constants (small enough to keep), else None."""
    if node.op_type in _NEVER_FOLD or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape" and node.input[0] in static and not node.attribute:
        return [np.asarray(static[node.input[0]], np.int64)]
    if node.op_type == "Size" and node.input[0] in static:
        return [np.asarray(int(np.prod(static[node.input[0]])), np.int64)]
    ins = [i for i in node.input if i]
    if any(i not in known for i in ins):
        return None
    if node.op_type != "Constant" and not ins:
        return None
    try:
        feeds = {i: known[i] for i in ins}
        values = evaluator(node).run(None, feeds)
    except Exception:  # noqa: BLE001 - leave it to the importer, which names the node
        return None
    if any(np.asarray(v).size > _MAX_FOLD_ELEMENTS for v in values):
        return None
    return [np.asarray(v) for v in values]


@dataclass
class FailedNode:
    """The ONNX node TVM's importer was converting when it raised (None until one fails)."""

    name: str | None = None
    op_type: str | None = None


@contextlib.contextmanager
def locate_failure() -> Iterator[FailedNode]:
    """While importing: record which ONNX node the importer converts, and keep its stdout quiet."""
    from tvm.relax.frontend.onnx import onnx_frontend as fe

    where = FailedNode()
    original = fe.ONNXGraphImporter._convert_operator

    def convert(self: Any, op_name: str, inputs: Any, attrs: dict, opset: int) -> Any:
        where.name = (attrs.get("tvm_custom") or {}).get("name")
        where.op_type = op_name
        out = original(self, op_name, inputs, attrs, opset)
        where.name = where.op_type = None
        return out

    fe.ONNXGraphImporter._convert_operator = convert
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # "Error converting operator ..." dumps
            yield where
    finally:
        fe.ONNXGraphImporter._convert_operator = original
