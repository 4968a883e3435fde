"""A corpus of broken graph.json files, each derived from a real fixture by one defect.

Every one must fail with GraphError (never another exception, never a hang) and the message must
name the node / field at fault, because users repair these files by hand.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from tvmpipe.bundle import GraphError, parse_graph, parse_graph_text, read_graph

Mutation = Callable[[dict[str, Any]], "str | None"]  # mutate in place, or return replacement text


def _set(path: str, value: Any) -> Mutation:
    """Set a value by a dotted path of keys / list indices ("nodes.2.attrs.func_name")."""
    *parents, last = path.split(".")

    def mutate(g: dict[str, Any]) -> None:
        obj: Any = g
        for p in parents:
            obj = obj[int(p)] if isinstance(obj, list) else obj[p]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value
    return mutate


def _drop(path: str) -> Mutation:
    *parents, last = path.split(".")

    def mutate(g: dict[str, Any]) -> None:
        obj: Any = g
        for p in parents:
            obj = obj[int(p)] if isinstance(obj, list) else obj[p]
        del obj[last]
    return mutate


def _text(fn: Callable[[str], str]) -> Mutation:
    return lambda g: fn(json.dumps(g))


def _cycle(g: dict[str, Any]) -> None:
    # relu0 (node 3) reads max_pool2d0 (node 4), which reads relu0
    g["nodes"][3]["inputs"][0] = [4, 0, 0]


def _two_devices(g: dict[str, Any]) -> None:
    g["attrs"]["device_index"] = ["list_int", [2, 2, 2, 2, 1, 2]]
    g["attrs"]["storage_id"][1][4] = 2  # entry 4 (CPU) reuses storage id 2 of entry 0 (CUDA)


# (id, fixture stem, mutation, substrings the message must contain)
CASES: list[tuple[str, str, Mutation, list[str]]] = [
    ("missing-nodes", "dlr_4in2out_nnvm", _drop("nodes"), ["nodes: missing required key"]),
    ("missing-heads", "dlr_4in2out_nnvm", _drop("heads"), ["heads: missing required key"]),
    ("missing-node-row-ptr", "wrn_fc_nnvm", _drop("node_row_ptr"), ["node_row_ptr: missing required key"]),
    ("missing-storage-id", "dlr_4in2out_nnvm", _drop("attrs.storage_id"), ["attrs.storage_id: missing required attribute"]),
    ("missing-dltype", "resnet18_nnvm", _drop("attrs.dltype"), ["attrs.dltype: missing required attribute"]),
    ("unknown-top-key", "dlr_4in2out_nnvm", _set("plan", {}), ["plan: unknown top-level key"]),
    ("nan-node-attr", "dlr_4in2out_nnvm", _set("nodes.2.attrs.scale", float("nan")),
     ["node 2 '__add_symbol__0', attrs: holds NaN or Infinity"]),
    ("inf-metadata", "dlr_4in2out_nnvm", _set("metadata", {"x": [float("inf")]}), ["metadata: holds NaN or Infinity"]),
    ("unknown-node-key", "dlr_4in2out_nnvm", _set("nodes.2.device", 1), ["node 2 '__add_symbol__0', device: unknown node key"]),
    ("missing-op", "dlr_4in2out_nnvm", _drop("nodes.5.op"), ["node 5 '__add_symbol__1', op: must be 'null' or 'tvm_op'"]),
    ("missing-name", "dlr_4in2out_nnvm", _drop("nodes.2.name"), ["node 2, name: missing or not a string"]),
    ("duplicate-name", "dlr_4in2out_nnvm", _set("nodes.3.name", "data1"),
     ["node 3 'data1', name: duplicate node name (also node 0)"]),
    ("missing-func-name", "resnet18_nnvm", _drop("nodes.3.attrs.func_name"), ["node 3 'relu0', attrs.func_name"]),
    ("dangling-ref", "dlr_4in2out_nnvm", _set("nodes.2.inputs.1", [99, 0, 0]),
     ["node 2 '__add_symbol__0', inputs[1]: dangling reference to node 99"]),
    ("ref-output-out-of-range", "dlr_4in2out_nnvm", _set("nodes.5.inputs.0", [3, 1, 0]),
     ["node 5 '__add_symbol__1', inputs[0]: refers to output 1 of node 3 'data3'"]),
    ("negative-ref", "wrn_fc_nnvm", _set("nodes.5.inputs.0", [-1, 0, 0]), ["node 5 '_contrib_conv2d_nchwc0', inputs[0]: negative"]),
    ("ref-wrong-type", "wrn_fc_nnvm", _set("nodes.5.inputs.0", "3"), ["node 5 '_contrib_conv2d_nchwc0', inputs[0]: must be [node, index]"]),
    ("forward-ref", "dlr_4in2out_nnvm", _set("nodes.2.inputs.1", [3, 0, 0]),
     ["node 2 '__add_symbol__0', inputs[1]: forward reference to node 3"]),
    ("self-cycle", "wrn_fc_nnvm", _set("nodes.6.inputs.0", [6, 0, 0]), ["node 6 '__mul_scalar__0', inputs: cycle between nodes 6 -> 6"]),
    ("cycle", "resnet18_nnvm", _cycle, ["cycle between nodes", "3", "4"]),
    ("null-node-with-inputs", "dlr_4in2out_nnvm", _set("nodes.3.inputs", [[0, 0, 0]]), ["node 3 'data3', inputs: a null node"]),
    ("num-outputs-not-int", "resnet18_nnvm", _set("nodes.4.attrs.num_outputs", "two"), ["node 4 'max_pool2d0', attrs.num_outputs"]),
    ("num-inputs-wrong", "resnet18_nnvm", _set("nodes.3.attrs.num_inputs", "4"), ["node 3 'relu0', attrs.num_inputs: says '4'"]),
    ("flatten-data-2", "dlr_4in2out_nnvm", _set("nodes.2.attrs.flatten_data", "2"), ["node 2 '__add_symbol__0', attrs.flatten_data"]),
    ("node-attrs-list", "dlr_4in2out_nnvm", _set("nodes.2.attrs", []), ["node 2 '__add_symbol__0', attrs: must be an object"]),
    ("node-not-object", "dlr_4in2out_nnvm", _set("nodes.1", "data2"), ["node 1: must be an object"]),
    ("bad-dltype", "dlr_4in2out_nnvm", _set("attrs.dltype.1.4", "float8"), ["entry 4 (node 4 'data4' output 0), attrs.dltype: unknown dtype 'float8'"]),
    ("bfloat16", "wrn_fc_nnvm", _set("attrs.dltype.1.9", "bfloat16"), ["entry 9 (node 9 'dense0' output 0)", "bfloat16"]),
    ("dltype-not-str", "dlr_4in2out_nnvm", _set("attrs.dltype.1.0", 32), ["entry 0 (node 0 'data1' output 0), attrs.dltype"]),
    ("nnvm-code-disagrees", "dlr_4in2out_nnvm", _set("attrs.dtype.1.1", 4), ["entry 1 (node 1 'data2' output 0), attrs.dtype: NNVM type code 4"]),
    ("nnvm-code-unhashable", "dlr_4in2out_nnvm", _set("attrs.dtype.1.1", [0]), ["entry 1 (node 1 'data2' output 0), attrs.dtype"]),
    ("shape-list-short", "dlr_4in2out_nnvm", lambda g: g["attrs"]["shape"][1].pop(), ["attrs.shape: has 5 items but node_row_ptr gives 6 entries"]),
    ("storage-id-list-long", "wrn_fc_nnvm", lambda g: g["attrs"]["storage_id"][1].append(0), ["attrs.storage_id: has 11 items"]),
    ("shape-tag-wrong", "dlr_4in2out_nnvm", _set("attrs.shape.0", "list_int"), ["attrs.shape: type tag must be 'list_shape'"]),
    ("attr-not-pair", "dlr_4in2out_nnvm", _set("attrs.storage_id", [0, 1]), ["attrs.storage_id: must be"]),
    ("unknown-attr-unknown-tag", "dlr_4in2out_nnvm", _set("attrs.layout", ["list_layout", []]), ["attrs.layout: unknown attribute"]),
    ("size-t-attr-not-int", "dlr_4in2out_nnvm", _set("attrs.plan", ["size_t", "x"]), ["attrs.plan: size_t attribute"]),
    ("row-ptr-wrong-length", "dlr_4in2out_nnvm", _set("node_row_ptr", [0, 1, 2, 3, 4, 5]), ["node_row_ptr: has 6 items, expected nodes + 1 = 7"]),
    ("row-ptr-not-monotone", "dlr_4in2out_nnvm", _set("node_row_ptr", [0, 1, 2, 1, 4, 5, 6]), ["node 2 '__add_symbol__0', node_row_ptr[3]: not monotone"]),
    ("row-ptr-not-zero", "dlr_4in2out_nnvm", _set("node_row_ptr.0", 1), ["node_row_ptr[0]: must be 0"]),
    ("row-ptr-gap-without-outputs", "wrn_fc_nnvm", _set("node_row_ptr", [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]),
     ["node 6 '__mul_scalar__0', node_row_ptr[7]: gives 2 entries but the node has 1 output(s)"]),
    ("row-ptr-float", "dlr_4in2out_nnvm", _set("node_row_ptr.6", 6.0), ["node_row_ptr: must be a list of integers"]),
    ("negative-shape", "resnet18_nnvm", _set("attrs.shape.1.0", [1, -3, 224, 224]), ["entry 0 (node 0 'data' output 0), attrs.shape: negative dimension"]),
    ("shape-not-list", "resnet18_nnvm", _set("attrs.shape.1.3", "1x64"), ["entry 3 (node 3 'relu0' output 0), attrs.shape: must be a list of integers"]),
    ("huge-shape", "wrn_fc_nnvm", _set("attrs.shape.1.4", [1 << 20, 1 << 20, 1 << 20]), ["entry 4 (node 4 '8_OIHW8i8o' output 0), attrs.shape", "tensor limit"]),
    ("rank-100000", "dlr_4in2out_nnvm", _set("attrs.shape.1.0", [2] * 100_000), ["entry 0 (node 0 'data1' output 0), attrs.shape: rank 100000"]),
    ("storage-id-negative", "dlr_4in2out_nnvm", _set("attrs.storage_id.1.2", -1), ["entry 2 (node 2 '__add_symbol__0' output 0), attrs.storage_id"]),
    ("storage-id-huge", "dlr_4in2out_nnvm", _set("attrs.storage_id.1.2", 10**12), ["entry 2 (node 2 '__add_symbol__0' output 0), attrs.storage_id"]),
    ("storage-id-on-two-devices", "dlr_4in2out_nnvm", _two_devices, ["entry 4 (node 4 'data4' output 0), attrs.device_index: storage id 2"]),
    ("device-index-not-int", "dlr_4in2out_nnvm", _set("attrs.device_index", ["list_int", [2, 2, "cuda", 2, 2, 2]]), ["entry 2 (node 2 '__add_symbol__0' output 0), attrs.device_index"]),
    ("storage-scope-not-str", "dlr_4in2out_nnvm", _set("attrs.storage_scope", ["list_str", ["global"] * 5 + [0]]), ["entry 5 (node 5 '__add_symbol__1' output 0), attrs.storage_scope"]),
    ("heads-out-of-range", "dlr_4in2out_nnvm", _set("heads.1", [99, 0, 0]), ["heads[1]: refers to node 99"]),
    ("heads-output-out-of-range", "resnet18_nnvm", _set("heads.0", [70, 1, 0]), ["heads[0]: refers to output 1 of node 70 'softmax0'"]),
    ("heads-not-list", "dlr_4in2out_nnvm", _set("heads", {"0": 2}), ["heads: must be a list"]),
    ("arg-nodes-not-list", "dlr_4in2out_nnvm", _set("arg_nodes", 4), ["arg_nodes: must be a list"]),
    ("arg-node-out-of-range", "dlr_4in2out_nnvm", _set("arg_nodes.0", 99), ["arg_nodes[0]: node 99 is out of range"]),
    ("arg-node-is-op", "dlr_4in2out_nnvm", _set("arg_nodes.3", 5), ["arg_nodes[3]: node 5 '__add_symbol__1' is a tvm_op"]),
    ("arg-node-missing", "resnet18_nnvm", lambda g: g["arg_nodes"].remove(67), ["node 67 'resnetv10_dense0_weight', arg_nodes: null node"]),
    ("arg-node-twice", "dlr_4in2out_nnvm", lambda g: g["arg_nodes"].append(1), ["arg_nodes[4]: node 1 'data2' is listed twice"]),
    ("nodes-not-list", "dlr_4in2out_nnvm", _set("nodes", {}), ["nodes: must be a list"]),
    ("no-nodes", "dlr_4in2out_nnvm", _set("nodes", []), ["nodes: graph has no nodes"]),
    ("attrs-not-object", "dlr_4in2out_nnvm", _set("attrs", []), ["attrs: must be an object"]),
    ("metadata-not-object", "dlr_4in2out_nnvm", _set("metadata", "v1"), ["metadata: must be an object"]),
    ("top-level-list", "dlr_4in2out_nnvm", _text(lambda t: "[" + t + "]"), ["top level must be a JSON object"]),
    ("truncated", "resnet18_nnvm", _text(lambda t: t[: len(t) // 2]), ["not valid JSON"]),
    ("empty-file", "dlr_4in2out_nnvm", _text(lambda t: ""), ["not valid JSON"]),
    ("huge-int-literal", "dlr_4in2out_nnvm", _text(lambda t: t.replace('"storage_id": ["list_int", [2', '"storage_id": ["list_int", [' + "9" * 5000, 1)),
     ["not valid JSON", "digits"]),
    ("nested-too-deeply", "dlr_4in2out_nnvm", _text(lambda t: t[:-1] + ', "metadata": ' + "[" * 200_000 + "]" * 200_000 + "}"),
     ["not valid JSON"]),
]


def test_corpus_is_large_enough():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_graph_fails_with_graph_error_naming_the_problem(graph_json, case):
    _, stem, mutate, expected = case
    g = graph_json(stem)
    text = mutate(g)
    with pytest.raises(GraphError) as info:
        if isinstance(text, str):
            parse_graph_text(text, source=f"{stem}.json")
        else:
            parse_graph(g, source=f"{stem}.json")
    message = str(info.value)
    n = len(info.value.problems)
    assert message.startswith("1 problem in graph.json: " if n == 1 else f"{n} problem(s) in graph.json:\n")
    assert n > 1 or "\n" not in message  # one problem, one line
    assert f"{stem}.json: " in message
    for part in expected:
        assert part in message, f"{part!r} not in:\n{message}"
    assert len(message) < 20_000  # a giant offending value is quoted, not dumped


def test_every_problem_is_reported_at_once(graph_json):
    g = graph_json("dlr_4in2out_nnvm")
    g["nodes"][2]["inputs"][1] = [99, 0, 0]
    g["nodes"][5]["attrs"]["num_inputs"] = "7"
    g["heads"][0] = [2, 3, 0]
    g["arg_nodes"].append(0)
    with pytest.raises(GraphError) as info:
        parse_graph(g)
    fields = {(p.where, p.field) for p in info.value.problems}
    assert fields == {("node 2 '__add_symbol__0'", "inputs[1]"), ("node 5 '__add_symbol__1'", "attrs.num_inputs"),
                      ("", "heads[0]"), ("", "arg_nodes[4]")}


def test_read_graph_file_errors(tmp_path):
    with pytest.raises(GraphError, match="file not found"):
        read_graph(tmp_path / "absent.json")
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"nodes": "\xff"}')
    with pytest.raises(GraphError, match="cannot read"):
        read_graph(bad)
