"""The graph reader on real graph.json files that NNVM-era TVM wrote (tests/data/graphs)."""

from __future__ import annotations

import json

import pytest

from tvmpipe.bundle import parse_graph, read_graph

# stem: (nodes, op nodes, null nodes, heads, entries, storage ids, distinct functions)
COUNTS = {
    "dlr_4in2out_nnvm": (6, 2, 4, 2, 6, 6, 2),
    "resnet18_nnvm": (71, 25, 46, 1, 71, 52, 23),
    "wrn_fc_nnvm": (10, 4, 6, 1, 10, 9, 4),
}
# stem: (activation bytes without reuse, with TVM's storage plan, storage ids the op outputs use, null-node bytes)
# Computed by hand from the raw attrs (float32 everywhere): sum of op-output sizes vs sum over their
# storage ids of the largest entry placed there.
STORAGE = {
    "dlr_4in2out_nnvm": (20, 20, 2, 40),
    "resnet18_nnvm": (10_749_760, 4_925_248, 6, 47_344_544),
    "wrn_fc_nnvm": (21_160, 21_120, 3, 1_662_760),
}


def test_every_fixture_is_covered(fixtures_dir):
    assert {p.stem for p in fixtures_dir.glob("*.json")} == set(COUNTS)


@pytest.mark.parametrize("stem", sorted(COUNTS))
def test_counts(fixtures_dir, stem):
    g = read_graph(fixtures_dir / f"{stem}.json")
    nodes, ops, nulls, heads, entries, sids, funcs = COUNTS[stem]
    assert len(g.nodes) == nodes
    assert len(g.op_nodes) == ops
    assert len(g.null_nodes) == nulls == len(g.arg_nodes)
    assert len(g.heads) == heads
    assert g.num_entries == entries == len(g.entries)
    assert len(g.storage_sizes()) == sids
    assert len({g.nodes[i].func_name for i in g.op_nodes}) == funcs


@pytest.mark.parametrize("stem", sorted(STORAGE))
def test_storage_reuse(fixtures_dir, stem):
    g = read_graph(fixtures_dir / f"{stem}.json")
    no_reuse, with_reuse, op_sids, null_bytes = STORAGE[stem]
    assert g.activation_bytes() == (no_reuse, with_reuse)
    assert len({g.entries[e].storage_id for i in g.op_nodes for e in g.node_entry_ids(i)}) == op_sids
    assert sum(g.entry_of(i).nbytes for i in g.null_nodes) == null_bytes


def test_dlr_details(fixtures_dir):
    g = read_graph(fixtures_dir / "dlr_4in2out_nnvm.json")
    assert [g.nodes[i].name for i in g.null_nodes] == ["data1", "data2", "data3", "data4"]
    assert [g.nodes[i].func_name for i in g.op_nodes] == ["fuse_broadcast_add", "fuse_broadcast_add_1"]
    assert g.head_entries == [2, 5]
    assert g.nodes[2].attrs["flatten_data"] == "1"
    assert [(e.shape, e.dtype, e.storage_id) for e in g.entries[:3]] == [((2,), "float32", 2), ((2,), "float32", 3),
                                                                          ((2,), "float32", 0)]
    assert g.consumers[0] == [2] and g.consumers[2] == []
    assert g.input_entry_ids(5) == [3, 4]


def test_wrn_rank6_shapes_and_nnvm_names(fixtures_dir):
    g = read_graph(fixtures_dir / "wrn_fc_nnvm.json")
    weight = g.entry_of("8_OIHW8i8o")
    assert weight.shape == (10, 10, 8, 8, 8, 8)
    assert weight.nbytes == 10 * 10 * 8 * 8 * 8 * 8 * 4
    assert g.nodes[3].func_name == "fuse_broadcast_mul_broadcast_add_relu___layout_transform__"


def test_resnet_skip_connection_consumers(fixtures_dir):
    g = read_graph(fixtures_dir / "resnet18_nnvm.json")
    pool = g.node_index["max_pool2d0"]
    # the max-pool output feeds the first conv and the residual add after it
    assert [g.nodes[c].name for c in g.consumers[g.entry_id(pool)]] == ["relu1", "relu2"]


@pytest.mark.parametrize("stem", sorted(COUNTS))
def test_to_json_round_trips(fixtures_dir, stem):
    raw = json.loads((fixtures_dir / f"{stem}.json").read_text())
    g = parse_graph(raw)
    again = parse_graph(json.loads(json.dumps(g.to_json())))
    assert again.to_json() == g.to_json()
    assert [(n.name, n.op, n.inputs, n.attrs) for n in again.nodes] == [(n.name, n.op, n.inputs, n.attrs) for n in g.nodes]
    assert again.entries == g.entries
    assert again.extra_attrs == g.extra_attrs == {}
    # the NNVM `dtype` codes are checked against dltype and not carried: dltype says the same
    assert "dtype" in raw["attrs"] and "dtype" not in g.to_json()["attrs"]
