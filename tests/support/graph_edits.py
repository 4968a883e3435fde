"""Edits on decoded graph.json dicts that keep them consistent, to build the variants real TVM
versions wrote (Relay era: no NNVM dtype codes, multi-output nodes, __nop/__copy, devices)."""

from __future__ import annotations

from typing import Any


def relay_style(g: dict[str, Any]) -> dict[str, Any]:
    """Drop what only NNVM wrote (the `dtype` codes), as Relay's graph executor codegen did."""
    g["attrs"].pop("dtype", None)
    return g


def add_node(g: dict[str, Any], node: dict[str, Any], outputs: list[tuple[list[int], str, int]]) -> int:
    """Append a node with (shape, dltype, storage_id) per output; keeps node_row_ptr, attrs, arg_nodes."""
    assert "dtype" not in g["attrs"], "call relay_style first"
    g["nodes"].append(node)
    nid = len(g["nodes"]) - 1
    g["node_row_ptr"].append(g["node_row_ptr"][-1] + len(outputs))
    for shape, dltype, sid in outputs:
        g["attrs"]["shape"][1].append(shape)
        g["attrs"]["dltype"][1].append(dltype)
        g["attrs"]["storage_id"][1].append(sid)
    if node["op"] == "null":
        g["arg_nodes"].append(nid)
    return nid


def op_node(name: str, func_name: str, inputs: list[list[int]], num_outputs: int = 1, **attrs: str) -> dict[str, Any]:
    return {"op": "tvm_op", "name": name, "inputs": inputs,
            "attrs": {"func_name": func_name, "num_inputs": str(len(inputs)), "num_outputs": str(num_outputs),
                      "flatten_data": "0", **attrs}}
