"""Relay-era graph.json variants (2020-24), built from the NNVM fixtures the way Relay wrote them."""

from __future__ import annotations

import json

import pytest

from tests.support.graph_edits import add_node, op_node, relay_style
from tvmpipe.bundle import EntryRef, parse_graph, parse_graph_text


@pytest.fixture
def dlr(graph_json):
    return relay_style(graph_json("dlr_4in2out_nnvm"))


def test_relay_names_hash_layout_metadata_and_two_element_inputs(dlr):
    n2, n5 = dlr["nodes"][2], dlr["nodes"][5]
    n2["name"] = n2["attrs"]["func_name"] = "tvmgen_default_fused_add"
    n2["attrs"].update(hash="5c0e3b2a9f1d7e64", data_layout="NCHW", kernel_layout="OIHW", out_layout="")
    n5["name"] = n5["attrs"]["func_name"] = "fused_add_1"
    n2["inputs"] = [[0, 0], [1, 0]]  # Relay-era writers left out the version field
    dlr["metadata"] = {"signatures": {"default": {"inputs": ["data1", "data2", "data3", "data4"]}}}
    g = parse_graph(dlr)
    assert g.nodes[2].func_name == "tvmgen_default_fused_add" and g.nodes[5].func_name == "fused_add_1"
    assert g.nodes[2].attrs["hash"] == "5c0e3b2a9f1d7e64" and g.nodes[2].attrs["data_layout"] == "NCHW"
    assert g.nodes[2].inputs == [EntryRef(0, 0, 0), EntryRef(1, 0, 0)]
    assert g.metadata == dlr["metadata"]
    assert g.to_json()["metadata"] == dlr["metadata"]
    assert parse_graph(g.to_json()).nodes[2].attrs == g.nodes[2].attrs


def test_multi_output_node_leaves_gaps_in_node_row_ptr(dlr):
    split = add_node(dlr, op_node("split", "tvmgen_default_fused_split", [[2, 0, 0]], num_outputs=3),
                     [([1], "float32", 6), ([1], "float32", 7), ([0], "float32", 8)])
    mul = add_node(dlr, op_node("mul", "tvmgen_default_fused_multiply", [[split, 2, 0], [split, 0, 0]]),
                   [([1], "float32", 9)])
    dlr["heads"] = [[split, 1, 0], [mul, 0, 0]]
    g = parse_graph(dlr)
    assert g.node_row_ptr == [0, 1, 2, 3, 4, 5, 6, 9, 10]
    assert g.nodes[split].num_outputs == 3
    assert list(g.node_entry_ids(split)) == [6, 7, 8]
    assert [(e.node, e.index) for e in g.entries[6:9]] == [(split, 0), (split, 1), (split, 2)]
    assert g.entries[8].shape == (0,) and g.entries[8].nbytes == 0
    assert g.input_entry_ids(mul) == [8, 6]
    assert g.head_entries == [7, 9]
    assert g.consumers[6] == [mul] and g.consumers[7] == [] and g.consumers[8] == [mul]
    assert g.activation_bytes() == (20 + 4 + 4 + 0 + 4, 20 + 12)


def test_nop_aliases_storage_and_copy_crosses_devices(dlr):
    # data1 lives on the CPU; __copy moves it to the GPU; a __nop reshape aliases the add's output.
    copy = add_node(dlr, op_node("copy", "__copy", [[0, 0, 0]]), [([2], "float32", 6)])
    add = add_node(dlr, op_node("add2", "tvmgen_default_fused_add", [[copy, 0, 0], [1, 0, 0]]), [([2], "float32", 7)])
    nop = add_node(dlr, op_node("reshape", "__nop", [[add, 0, 0]]), [([1, 2], "float32", 7)])
    dlr["heads"] = [[nop, 0, 0], [5, 0, 0]]
    devices = [2] * 9
    devices[0] = 1  # data1 (storage id 2) on the CPU, everything else on CUDA
    dlr["attrs"]["device_index"] = ["list_int", devices]
    g = parse_graph(dlr)
    assert g.nodes[copy].is_copy and not g.nodes[copy].launches_kernels
    assert g.nodes[nop].is_nop and not g.nodes[nop].launches_kernels
    assert g.nodes[add].launches_kernels
    assert [e.device_type for e in g.entries] == devices
    assert g.entry_of(nop).storage_id == g.entry_of(add).storage_id == 7
    # the __nop output aliases its input: no bytes of its own in either figure
    assert g.activation_bytes() == (8 + 12 + 8 + 8, 8 + 12 + 8 + 8)
    assert g.to_json()["attrs"]["device_index"] == ["list_int", devices]


def test_storage_scope_and_unknown_attrs_that_tvm_skips(dlr):
    scopes = ["global", "global", "global.texture", "global", "global", "global.texture-weight"]
    dlr["attrs"]["storage_scope"] = ["list_str", scopes]
    dlr["attrs"]["plan_version"] = ["size_t", 2]  # TVM skips unknown size_t and list_int attrs
    dlr["attrs"]["node_flags"] = ["list_int", [0, 1, 0, 1, 0, 1]]
    g = parse_graph(dlr)
    assert [e.storage_scope for e in g.entries] == scopes
    assert g.extra_attrs == {"plan_version": ["size_t", 2], "node_flags": ["list_int", [0, 1, 0, 1, 0, 1]]}
    again = parse_graph(json.loads(json.dumps(g.to_json())))
    assert again.entries == g.entries and again.extra_attrs == g.extra_attrs


def test_old_nnvm_attr_key_control_deps_and_int_attrs(graph_json):
    g = graph_json("dlr_4in2out_nnvm")
    node = g["nodes"][2]
    node["attr"] = node.pop("attrs")  # the earliest NNVM JSON said "attr"
    node["control_deps"] = []
    g["nodes"][5]["attrs"].update(num_outputs=1, num_inputs=2, flatten_data=1)  # ints, not strings
    parsed = parse_graph(g)
    assert parsed.nodes[2].func_name == "fuse_broadcast_add"
    assert parsed.nodes[5].num_outputs == 1


def test_bool_dltype_and_uint1(dlr):
    dlr["attrs"]["dltype"][1][2] = "uint1"
    dlr["attrs"]["dltype"][1][5] = "bool"
    g = parse_graph_text(json.dumps(dlr))
    assert g.entries[2].dtype == "bool" and g.entries[5].dtype == "bool"
    assert g.entries[2].nbytes == 2
