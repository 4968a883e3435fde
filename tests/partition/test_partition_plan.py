"""Plan: cuts <-> node ranges, JSON round trip, equal op counts, validation errors."""

from __future__ import annotations

import json

import pytest

from tvmpipe.bundle import EntryRef, load_bundle
from tvmpipe.partition import PartitionError, Plan, PlanError, plan_equal_ops, validate_plan


@pytest.fixture(scope="module")
def resnet(fixtures_dir):
    return load_bundle(fixtures_dir / "resnet18_nnvm.json").graph


def test_from_cuts_uses_op_ordinals(resnet):
    ops = resnet.op_nodes
    plan = Plan.from_cuts(resnet, [9, 17])
    assert plan.stages == [(0, ops[8] + 1), (ops[8] + 1, ops[16] + 1), (ops[16] + 1, len(resnet.nodes))]
    assert plan.op_counts(resnet) == [9, 8, 8]
    assert plan.cuts(resnet) == [9, 17]
    # the stage starting at cut 9 begins with op ordinal 9
    assert [n for n in range(*plan.stages[1]) if resnet.nodes[n].is_op][0] == ops[9]
    validate_plan(resnet, plan)


@pytest.mark.parametrize("cuts, message", [([0], "out of range"), ([25], "out of range"), ([5, 5], "strictly increasing"),
                                            ([9, 3], "strictly increasing"), ([True], "out of range")])
def test_bad_cuts(resnet, cuts, message):
    with pytest.raises(PartitionError, match=message):
        Plan.from_cuts(resnet, cuts)


def test_json_round_trip(resnet, tmp_path):
    plan = Plan.from_cuts(resnet, [3, 20], strategy="optimal")
    plan.predicted = {"bottleneck_us": 12.5}
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    assert Plan.from_json(json.dumps(plan.to_json())) == plan


@pytest.mark.parametrize("obj, field", [({"stages": []}, "stages"), ({"stages": [[0, "a"]]}, "stages"),
                                        ({"stages": [[0, 1]], "version": 9}, "version"),
                                        ({"stages": [[0, 1]], "format": "x"}, "format"), ([1, 2], "JSON object")])
def test_from_json_rejects_malformed(obj, field):
    with pytest.raises(PlanError, match=field):
        Plan.from_json(obj)
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")


@pytest.mark.parametrize("k", range(1, 26))
def test_equal_ops(resnet, k):
    plan = plan_equal_ops(resnet, k)
    validate_plan(resnet, plan)
    counts = plan.op_counts(resnet)
    assert len(counts) == k and sum(counts) == 25 and max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)


def test_more_stages_than_ops(resnet):
    with pytest.raises(PartitionError, match="cannot make 26 stages from 25 op node"):
        plan_equal_ops(resnet, 26)
    with pytest.raises(PartitionError, match="positive integer"):
        plan_equal_ops(resnet, 0)


@pytest.mark.parametrize("stages, message", [
    ([(0, 30), (31, 71)], "contiguous"),
    ([(0, 30), (30, 70)], "ranges end at node 70"),
    ([(0, 30), (30, 30), (30, 71)], "empty or reversed"),
    ([(0, 1), (1, 71)], "holds no op node"),
    ([(1, 71)], "starts at node 1"),
])
def test_validate_rejects(resnet, stages, message):
    with pytest.raises(PlanError, match=message):
        validate_plan(resnet, Plan(stages))


def test_validate_rejects_reading_a_later_stage(fixtures_dir):
    g = load_bundle(fixtures_dir / "resnet18_nnvm.json").graph
    # a hand-built graph whose node 4 reads node 7 (the parser refuses such files; graphs built in code can do it)
    g.nodes[4].inputs = [EntryRef(7)]
    with pytest.raises(PlanError, match="runs later"):
        validate_plan(g, Plan.from_cuts(g, [2]))
