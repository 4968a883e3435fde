"""Relax `main` after FuseTIR -> graph.json (TVM graph-executor format, Relay-era style).

Each main parameter and each constant argument becomes a `null` node, each `call_tir` a `tvm_op`
node, and each copy-free `R.reshape` (RewriteDataflowReshape's output) a `__nop` node sharing its
input's storage. The storage plan is the Relay GraphPlanMemory idea: an entry's storage is
returned to a free pool after its last reader, and a later entry of similar size reuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tvmpipe.bundle import dtypes
from tvmpipe.compiler.errors import CompileError, UnsupportedOpError
from tvmpipe.compiler.opmap import CALL_TIR, call_args, key, tensor_types
from tvmpipe.compiler.rewrite import describe

DEVICE_CUDA = 2
# A free storage block is reused for a request within this size ratio (Relay's match_range).
MATCH_RANGE = 16


@dataclass
class GNode:
    op: str  # "null" | "tvm_op"
    name: str
    inputs: list[tuple[int, int]] = field(default_factory=list)
    func_name: str = ""
    outputs: list[tuple[list[int], str]] = field(default_factory=list)  # (shape, dtype) per output
    main_var: Any = None  # the Relax binding var, for tvm_op nodes
    inplace: list[int] = field(default_factory=list)  # call_tir_inplace: the input each output is written over


@dataclass
class BuiltGraph:
    """graph.json content plus what the rest of the export needs to know about its nodes."""

    graph: dict[str, Any]
    nodes: list[GNode]
    params: dict[str, Any]  # name -> NumPy value, or what build_graph's value_of gives
    inputs: list[str]


class _Names:
    """Unique node names: the first use of a name keeps it, later ones get `_1`, `_2`, ..."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def take(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name


def build_graph(main: Any, const_name: Any, op_of_var: Any, value_of: Any = None) -> BuiltGraph:
    """graph.json for `main`. `const_name(c)` names weight constants; `op_of_var(v)` names the model
    op behind a binding var (for errors about bindings that are not kernels); `value_of(c)` is what
    `params` keeps for a constant (default: its data as NumPy; the export keeps the constant and
    values it when writing)."""
    import tvm
    from tvm import relax

    names = _Names()
    nodes: list[GNode] = []
    entry_of: dict[int, Any] = {}  # expr -> (node, index) or a list of them for tuples
    params: dict[str, Any] = {}
    inputs = []

    for p in main.params:
        name = names.take(p.name)
        nodes.append(GNode("null", name, outputs=tensor_types(p.ty)))
        entry_of[key(p)] = (len(nodes) - 1, 0)
        inputs.append(name)

    def entry(expr: Any, where: str) -> tuple[int, int]:
        k = key(expr)
        if k in entry_of:
            e = entry_of[k]
            if isinstance(e, list):
                raise CompileError(f"internal: {where} passes a whole tuple as one tensor")
            return e
        if isinstance(expr, tvm.ir.GenericConst):
            name = names.take(const_name(expr) or f"p{len(params)}")
            params[name] = expr.value.numpy() if value_of is None else value_of(expr)
            nodes.append(GNode("null", name, outputs=tensor_types(expr.ty)))
            entry_of[k] = (len(nodes) - 1, 0)
            return entry_of[k]
        raise CompileError(f"internal: {where} reads {expr}, which no node produces")

    for block in main.body.blocks:
        for b in block.bindings:
            v = b.value
            where = f"binding '{b.var.name}'"
            if isinstance(v, tvm.ir.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name in CALL_TIR:
                func = v.args[0].name_hint
                ins = [entry(a, where) for a in call_args(v)]
                outs = tensor_types(b.var.ty)
                nodes.append(GNode("tvm_op", names.take(func), ins, func, outs, b.var))
                if v.op.name == "relax.call_tir_inplace":
                    nodes[-1].inplace = _inplace(v, ins, nodes, where)
            elif isinstance(v, tvm.ir.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.reshape":
                ins = [entry(v.args[0], where)]
                nodes.append(GNode("tvm_op", names.take("reshape_nop"), ins, "__nop", tensor_types(b.var.ty), b.var))
            elif isinstance(v, relax.TupleGetItem):
                src = entry_of.get(key(v.tuple_value))
                if not isinstance(src, list):
                    raise CompileError(f"internal: {where} takes an element of a non-tuple")
                entry_of[key(b.var)] = src[int(v.index)]
                continue
            elif isinstance(v, relax.Tuple):
                entry_of[key(b.var)] = [entry(f, where) for f in v.fields]
                continue
            elif isinstance(v, relax.Var):
                entry_of[key(b.var)] = entry_of[key(v)]
                continue
            else:
                raise UnsupportedOpError(op_of_var(b.var) or describe(v), b.var.name, _why(v))
            nid = len(nodes) - 1
            n_out = len(nodes[nid].outputs)
            is_tuple = isinstance(b.var.ty, relax.TupleType)
            entry_of[key(b.var)] = [(nid, i) for i in range(n_out)] if is_tuple else (nid, 0)

    body = main.body.body
    head_exprs = body.fields if isinstance(body, relax.Tuple) else [body]
    heads: list[tuple[int, int]] = []
    for h in head_exprs:
        e = entry_of.get(key(h))
        heads.extend(e if isinstance(e, list) else [entry(h, "the output")])
    _check_inplace(nodes, heads)
    return BuiltGraph(_to_json(nodes, heads), nodes, params, inputs)


def _inplace(call: Any, ins: list[tuple[int, int]], nodes: list[GNode], where: str) -> list[int]:
    """A `call_tir_inplace`'s outputs are its inputs `inplace_indices`, written over: the node's
    output entry shares that input's storage (as a `__nop`'s does) and graph.json says which input
    (attrs `inplace_indices`). tvmpipe takes one output written over a graph input read by nothing
    else (a paged decode step's pool: docs/paged-kv.md; _check_inplace), so no other reader sees
    it change."""
    indices = [int(i) for i in call.attrs.inplace_indices]
    if len(indices) != 1 or indices[0] < 0:
        raise CompileError(f"internal: {where} writes {indices} in place; tvmpipe takes one output over one input")
    if nodes[ins[indices[0]][0]].op != "null":
        raise CompileError(f"internal: {where} writes in place over an op's output, not a graph input")
    return indices


def _check_inplace(nodes: list[GNode], heads: list[tuple[int, int]]) -> None:
    """No node but an in-place call reads the input it writes over (it would see it change), nor
    does the call read it twice, nor is it a graph output."""
    for n in nodes:
        if n.inplace:
            src = n.inputs[n.inplace[0]]
            readers = [m.name for m in nodes if m is not n and src in m.inputs]
            if readers or n.inputs.count(src) > 1 or src in heads:
                raise CompileError(f"internal: '{n.name}' writes in place over an input that "
                                   f"{', '.join(readers) or 'it or the outputs'} also read(s)")


def _why(value: Any) -> str:
    """Why a binding of the fused main is not a kernel call, in the user's terms."""
    import tvm

    callee = describe(value)
    if isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op) and callee.startswith("relax.call"):
        return f"TVM lowers it to `{callee}`, not to GPU kernels a launch list can run"
    return f"TVM has no GPU kernel lowering for `{callee}`"


def plan_storage(nodes: list[GNode], heads: list[tuple[int, int]]) -> list[int]:
    """A storage id per entry (in entry order), reusing storage after an entry's last reader.

    Null nodes (inputs, params) own their storage. An op's outputs are allocated before its inputs
    are released, so no kernel writes over what it reads; `__nop` outputs share their input's
    storage; graph outputs are never released.
    """
    row = [0]
    for n in nodes:
        row.append(row[-1] + len(n.outputs))
    sizes = [math.prod(s) * dtypes.itemsize(d) for n in nodes for s, d in n.outputs]
    uses = [0] * row[-1]
    for n in nodes:
        for nid, i in n.inputs:
            uses[row[nid] + i] += 1
    for nid, i in heads:
        uses[row[nid] + i] += 1 << 30  # never released
    sid = [-1] * row[-1]
    token_size: list[int] = []
    token_refs: list[int] = []
    free: list[int] = []
    pinned: set[int] = set()

    def new_token(size: int) -> int:
        token_size.append(size)
        token_refs.append(0)
        return len(token_size) - 1

    def request(size: int) -> int:
        best = None
        for t in free:  # smallest free block that fits, within the match range
            if size <= token_size[t] <= size * MATCH_RANGE and (best is None or token_size[t] < token_size[best]):
                best = t
        if best is None:
            for t in free:  # else the largest smaller block, grown
                if token_size[t] * MATCH_RANGE >= size and token_size[t] < size and \
                        (best is None or token_size[t] > token_size[best]):
                    best = t
        if best is None:
            return new_token(size)
        free.remove(best)
        token_size[best] = max(token_size[best], size)
        return best

    for nid, n in enumerate(nodes):
        eids = range(row[nid], row[nid + 1])
        if n.op == "null":
            for e in eids:
                sid[e] = new_token(sizes[e])
                pinned.add(sid[e])
            continue
        if n.func_name == "__nop" or n.inplace:
            at = n.inputs[n.inplace[0] if n.inplace else 0]
            src = row[at[0]] + at[1]
            sid[eids[0]] = sid[src]
            token_refs[sid[src]] += uses[eids[0]]
        else:
            for e in eids:
                sid[e] = request(sizes[e])
                token_refs[sid[e]] += uses[e]
        for inid, i in n.inputs:
            t = sid[row[inid] + i]
            token_refs[t] -= 1
            if token_refs[t] == 0 and t not in pinned:
                free.append(t)
        for e in eids:
            if token_refs[sid[e]] == 0 and sid[e] not in pinned and sid[e] not in free:
                free.append(sid[e])
    return sid


def _to_json(nodes: list[GNode], heads: list[tuple[int, int]]) -> dict[str, Any]:
    sids = plan_storage(nodes, heads)
    row = [0]
    for n in nodes:
        row.append(row[-1] + len(n.outputs))
    out_nodes = []
    for n in nodes:
        d: dict[str, Any] = {"op": n.op, "name": n.name, "inputs": [[i, k, 0] for i, k in n.inputs]}
        if n.op == "tvm_op":
            d["attrs"] = {"func_name": n.func_name, "num_inputs": str(len(n.inputs)),
                          "num_outputs": str(len(n.outputs)), "flatten_data": "0"}
            if n.inplace:
                d["attrs"]["inplace_indices"] = ",".join(map(str, n.inplace))
        out_nodes.append(d)
    shapes = [s for n in nodes for s, _ in n.outputs]
    dts = [d for n in nodes for _, d in n.outputs]
    return {
        "nodes": out_nodes,
        "arg_nodes": [i for i, n in enumerate(nodes) if n.op == "null"],
        "node_row_ptr": row,
        "heads": [[i, k, 0] for i, k in heads],
        "attrs": {
            "shape": ["list_shape", shapes],
            "dltype": ["list_str", dts],
            "storage_id": ["list_int", sids],
            "device_index": ["list_int", [DEVICE_CUDA] * len(shapes)],
        },
    }
