"""Plans on every real graph.json fixture and every bundle (examples/*, the handmade tiny one) are
valid, checked here independently of validate_plan; cut crossings on ResNet-18 include its skips."""

from __future__ import annotations

import pytest

from tests.support.paths import EXAMPLES, EXAMPLES_DIR
from tests.support.tiny_bundle import write_tiny
from tvmpipe.bundle import Bundle, load_bundle, parse_graph
from tvmpipe.executor.program import build_stage_program
from tvmpipe.partition.cuts import GraphFlow, cut_crossings, stage_io
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.plan import Plan
from tvmpipe.partition.planners import make_plan
from tvmpipe.partition.predict import predict

FIXTURES = ["dlr_4in2out_nnvm", "resnet18_nnvm", "wrn_fc_nnvm"]


def check_plan(graph, plan):
    """Every op node in exactly one stage, in graph order; every entry a stage reads is a null node
    or produced earlier (in an earlier stage, or earlier in this one)."""
    stage_of = {}
    for s, (start, end) in enumerate(plan.stages):
        for n in range(start, end):
            assert n not in stage_of
            stage_of[n] = s
    assert sorted(stage_of) == list(range(len(graph.nodes)))
    order = [stage_of[n] for n in graph.op_nodes]
    assert order == sorted(order) and set(order) == set(range(len(plan.stages)))
    for n in graph.op_nodes:
        for ref in graph.nodes[n].inputs:
            src = graph.nodes[ref.node]
            assert not src.is_op or (ref.node < n and stage_of[ref.node] <= stage_of[n])


def plan_all(bundle, ks, caps=None):
    model = PipelineModel.build(bundle, memory_caps=caps)
    flow = model.flow
    for k in ks:
        for strategy in ("equal", "optimal"):
            plan = make_plan(model, k, strategy)
            check_plan(bundle.graph, plan)
            assert plan.predicted["fits_memory"] or caps is None
            ranges = [flow.op_range(s, e) for s, e in plan.stages]
            assert ranges[0][0] == 0 and ranges[-1][1] == flow.num_ops
            produced_before: set[int] = set()
            for a, b in ranges:
                io = stage_io(flow, a, b)
                assert set(io.recv) <= produced_before  # received = produced by an earlier stage
                produced_before |= {e for nid in io.op_nodes for e in bundle.graph.node_entry_ids(nid)}
            yield k, strategy, plan


@pytest.mark.parametrize("stem", FIXTURES)
def test_fixture_plans_valid(fixtures_dir, stem):
    bundle = load_bundle(fixtures_dir / f"{stem}.json")
    n = len(bundle.graph.op_nodes)
    plans = list(plan_all(bundle, range(1, min(n, 8) + 1)))
    assert len(plans) == 2 * min(n, 8)
    for k, strategy, plan in plans:
        if strategy == "optimal":
            equal = next(p for kk, s, p in plans if kk == k and s == "equal")
            assert plan.predicted["bottleneck_us"] <= equal.predicted["bottleneck_us"] * 1.01 + 1e-9


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_bundle_plans_valid(name):
    bundle = load_bundle(EXAMPLES_DIR / name)
    n = len(bundle.graph.op_nodes)
    assert list(plan_all(bundle, range(1, min(n, 6) + 1)))


def test_tiny_bundle_plans_valid(tmp_path):
    bundle = load_bundle(write_tiny(tmp_path / "tiny"))
    assert len(list(plan_all(bundle, [1, 2, 3]))) == 6
    # the analytic model saw real ops: the dense node costs more than the scale node, the __nop nothing
    model = PipelineModel.build(bundle)
    assert model.costs.source == "analytic"
    t = list(model.costs.time_us)
    assert t[0] > t[2] > 0 and t[1] == 0


def test_resnet_crossings_include_skip_connections(fixtures_dir):
    bundle = load_bundle(fixtures_dir / "resnet18_nnvm.json")
    flow = GraphFlow.from_bundle(bundle)
    crossings = {c.cut: c for c in cut_crossings(flow)}
    assert len(crossings) == flow.num_ops - 1
    # after op 2 (node 7): the max-pool output (entry 4) is still needed by node 10's residual add
    c = crossings[3]
    assert c.node == 10 and c.entries == (4, 7) and c.nbytes == 2 * 64 * 56 * 56 * 4
    # a cut in a plain chain carries one tensor
    assert crossings[1].entries == (3,) and crossings[1].nbytes == 64 * 112 * 112 * 4
    # the downsampling block: node 16's output feeds both node 22 and the 1x1 projection in node 26
    assert crossings[7].entries == (16, 22)


def test_bare_graph_input_guess(fixtures_dir):
    assert GraphFlow.from_bundle(load_bundle(fixtures_dir / "resnet18_nnvm.json")).inputs == ["data"]
    assert GraphFlow.from_bundle(load_bundle(fixtures_dir / "dlr_4in2out_nnvm.json")).inputs == \
        ["data1", "data2", "data3", "data4"]
    # no conventional names: null nodes read as an op's first argument ('0' is the data tensor)
    assert GraphFlow.from_bundle(load_bundle(fixtures_dir / "wrn_fc_nnvm.json")).inputs == ["0"]


def test_memory_caps_shape_the_plan(fixtures_dir):
    bundle = load_bundle(fixtures_dir / "resnet18_nnvm.json")
    free = make_plan(PipelineModel.build(bundle), 3, "optimal")
    cap = int(max(free.predicted["stage_memory_bytes"]) * 0.8)
    capped_model = PipelineModel.build(bundle, memory_caps=[cap])
    capped = make_plan(capped_model, 3, "optimal")
    assert capped.stages != free.stages
    assert max(capped.predicted["stage_memory_bytes"]) <= cap
    assert capped.predicted["bottleneck_us"] >= free.predicted["bottleneck_us"]


def test_shared_params_reported(tmp_path):
    """A param read by ops in two stages is loaded by both, and the prediction says so."""
    f = {"func_name": "fused_add", "num_inputs": "2", "num_outputs": "1", "flatten_data": "0"}
    obj = {"nodes": [{"op": "null", "name": "x", "inputs": []}, {"op": "null", "name": "w", "inputs": []},
                     {"op": "tvm_op", "name": "a", "inputs": [[0, 0, 0], [1, 0, 0]], "attrs": f},
                     {"op": "tvm_op", "name": "b", "inputs": [[2, 0, 0], [1, 0, 0]], "attrs": f}],
           "arg_nodes": [0, 1], "node_row_ptr": [0, 1, 2, 3, 4], "heads": [[3, 0, 0]],
           "attrs": {"shape": ["list_shape", [[8], [8], [8], [8]]], "dltype": ["list_str", ["float32"] * 4],
                     "storage_id": ["list_int", [0, 1, 2, 3]]}}
    bundle = Bundle(path=tmp_path / "g.json", graph=parse_graph(obj))
    model = PipelineModel.build(bundle, inputs=["x"])
    pred = predict(model, Plan.from_cuts(bundle.graph, [1]))
    assert [s.shared_params for s in pred.stages] == [["w"], ["w"]]
    assert [s.params_bytes for s in pred.stages] == [32, 32]
    assert [s.in_bytes for s in pred.stages] == [32, 32]  # x from the driver; a's output from stage 0


@pytest.mark.parametrize("stem", FIXTURES)
def test_stage_io_agrees_with_executor_programs(fixtures_dir, stem, tmp_path):
    """What the planner thinks a stage loads, receives and sends is what the executor builds."""
    bundle = load_bundle(fixtures_dir / f"{stem}.json")
    # the executor treats every null node of a bare graph.json as a graph input
    model = PipelineModel.build(bundle, inputs=bundle.input_names)
    for k in range(1, min(model.num_ops, 6) + 1):
        plan = make_plan(model, k, "optimal")
        for start, end in plan.stages:
            prog = build_stage_program(bundle, start, end)
            io = stage_io(model.flow, *model.flow.op_range(start, end))
            assert io.op_nodes == prog.op_nodes
            assert sorted(io.recv) == sorted(prog.recv_entries)
            assert sorted(io.send) == sorted(prog.send_entries)
            assert sorted(io.inputs) == sorted(prog.input_entries.values())
            assert sorted(io.params) == sorted(prog.param_entries.values())
