"""Cost models (FLOP counts, analytic roofline, profile reading, uniform) and unit parsing."""

from __future__ import annotations

import json

import pytest

from tests.support.tiny_bundle import write_tiny
from tvmpipe.bundle import load_bundle
from tvmpipe.bundle.manifests import OpRecord
from tvmpipe.partition import PartitionError
from tvmpipe.partition.cost import measured_costs, op_flops, read_profile
from tvmpipe.partition.cuts import GraphFlow
from tvmpipe.partition.devices import DEVICES, get_device, parse_bandwidth, parse_bytes, parse_duration_us
from tvmpipe.partition.model import PipelineModel


def rec(op, ins, outs, **attrs):
    return OpRecord(op, attrs, [], ins, ["float32"] * len(ins), outs, ["float32"] * len(outs))


@pytest.mark.parametrize("record, flops", [
    (rec("matmul", [[1, 100], [100, 400]], [[1, 400]]), 2 * 400 * 100),
    (rec("matmul", [[8, 16, 64], [64, 32]], [[8, 16, 32]]), 2 * 8 * 16 * 32 * 64),
    (rec("nn.conv2d", [[1, 3, 32, 32], [16, 3, 3, 3]], [[1, 16, 30, 30]]), 2 * 16 * 30 * 30 * 27),
    (rec("nn.conv2d", [[1, 32, 8, 8], [32, 1, 3, 3]], [[1, 32, 8, 8]], groups=32), 2 * 32 * 64 * 9),
    (rec("nn.max_pool2d", [[1, 16, 30, 30]], [[1, 16, 15, 15]], pool_size=[2, 2]), 16 * 15 * 15 * 4),
    (rec("mean", [[1, 16, 8, 8]], [[1, 16, 1, 1]]), 16 * 64),
    (rec("add", [[1, 400], [400]], [[1, 400]]), 400),
    (rec("nn.softmax", [[1, 10]], [[1, 10]]), 50),
    (rec("reshape", [[1, 400]], [[400]]), 0),
])
def test_op_flops(record, flops):
    assert op_flops(record) == flops


def test_analytic_roofline_on_tiny(tmp_path):
    bundle = load_bundle(write_tiny(tmp_path / "tiny"))
    dev = get_device("h100")
    model = PipelineModel.build(bundle, cost="analytic", device=dev)
    c = model.costs
    assert list(c.flops) == [2 * 3 * 4 + 3 + 3, 0, 3]
    # tiny tensors: every node is launch-bound, 2 launches for dense_relu, 1 for scale, none for the __nop
    assert list(c.time_us) == pytest.approx([2 * dev.launch_us, 0, dev.launch_us], rel=1e-3)
    slow = PipelineModel.build(bundle, cost="analytic", device="t4")
    assert slow.costs.time_us[0] >= c.time_us[0]


def test_analytic_needs_ops(fixtures_dir):
    bare = load_bundle(fixtures_dir / "resnet18_nnvm.json")
    with pytest.raises(PartitionError, match="needs ops.json"):
        PipelineModel.build(bare, cost="analytic")
    model = PipelineModel.build(bare)
    assert model.costs.source == "uniform" and set(model.costs.time_us) == {10.0}


def _profile(graph, key="index"):
    return {"format": "tvmpipe-profile", "model": "x",
            "nodes": [{key: n.index, "name": n.name, "time_us": float(n.index), "kernels": []}
                      for n in graph.nodes if n.is_op]}


@pytest.mark.parametrize("key", ["index", "node"])
def test_measured_reads_profile_rows(fixtures_dir, key):
    bundle = load_bundle(fixtures_dir / "resnet18_nnvm.json")
    flow = GraphFlow.from_bundle(bundle)
    costs = measured_costs(_profile(bundle.graph, key), flow)
    assert list(costs.time_us) == [float(n) for n in bundle.graph.op_nodes]


def test_measured_by_name_only(fixtures_dir):
    bundle = load_bundle(fixtures_dir / "wrn_fc_nnvm.json")
    prof = {"nodes": [{"name": n.name, "time_us": 5} for n in bundle.graph.nodes if n.is_op]}
    assert list(measured_costs(prof, GraphFlow.from_bundle(bundle)).time_us) == [5.0] * 4


def test_measured_rejects_another_graphs_profile(fixtures_dir, tmp_path):
    bundle = load_bundle(fixtures_dir / "resnet18_nnvm.json")
    flow = GraphFlow.from_bundle(bundle)
    prof = _profile(bundle.graph)
    prof["nodes"][0]["name"] = "something_else"
    with pytest.raises(PartitionError, match="'relu0' in the graph, 'something_else' in the profile"):
        measured_costs(prof, flow)
    prof = _profile(bundle.graph)
    del prof["nodes"][3:]
    with pytest.raises(PartitionError, match="22 op node\\(s\\) without a time"):
        measured_costs(prof, flow)
    prof = _profile(bundle.graph)
    prof["nodes"][1]["time_us"] = -1
    with pytest.raises(PartitionError, match="non-negative"):
        measured_costs(prof, flow)
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(PartitionError, match='"nodes"'):
        read_profile(tmp_path / "bad.json")
    with pytest.raises(PartitionError, match="cannot read"):
        read_profile(tmp_path / "missing.json")


def test_profile_file_drives_model(fixtures_dir, tmp_path):
    bundle = load_bundle(fixtures_dir / "resnet18_nnvm.json")
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(_profile(bundle.graph)))
    model = PipelineModel.build(bundle, profile=path)
    assert model.costs.source == "measured"
    assert model.tables.compute_us(0, model.num_ops) == sum(bundle.graph.op_nodes)


def test_units():
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("8GB") == 8_000_000_000 and parse_bytes("512") == 512
    assert parse_bandwidth("25GB/s") == 25e9 and parse_bandwidth("100Gbit/s") == 12.5e9
    assert parse_duration_us("0.5ms") == 500 and parse_duration_us("20us") == 20 and parse_duration_us("3") == 3
    for bad in ("8 parsecs", "", "GiB"):
        with pytest.raises(PartitionError, match="as a size"):
            parse_bytes(bad)
    with pytest.raises(PartitionError, match="unknown device 'v100'"):
        get_device("v100")
    assert {"h100", "h200", "a100", "l4", "t4", "cpu"} <= set(DEVICES)
