"""`tvmpipe partition`: the table, the plan file, --json, and clear errors without tracebacks."""

from __future__ import annotations

import json

import pytest

from tvmpipe.bundle import load_bundle
from tvmpipe.cli import main
from tvmpipe.partition import Plan, validate_plan


@pytest.fixture(scope="module")
def resnet_path(fixtures_dir):
    return str(fixtures_dir / "resnet18_nnvm.json")


def test_table_and_plan_file(resnet_path, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["partition", resnet_path, "--stages", "3", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 stage(s), strategy optimal, cost model uniform" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit() and "[" in line]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert "bottleneck" in text and "throughput" in text and "bubble" in text
    plan = Plan.load(out)
    graph = load_bundle(resnet_path).graph
    validate_plan(graph, plan)
    assert plan.strategy == "optimal" and plan.num_stages == 3
    # the table's node ranges are the plan's
    assert [r[1] for r in rows] == [f"[{s},{e})" for s, e in plan.stages]
    assert plan.predicted["bottleneck_us"] == pytest.approx(max(plan.predicted["stage_time_us"]))


def test_manual_cuts_and_json(resnet_path, capsys):
    assert main(["partition", resnet_path, "--cuts", "5,12", "--json", "--show-cuts"]) == 0
    obj = json.loads(capsys.readouterr().out)
    graph = load_bundle(resnet_path).graph
    plan = Plan.from_json(obj["plan"])
    assert plan.strategy == "manual" and plan.cuts(graph) == [5, 12]
    pred = obj["prediction"]
    assert [s["num_ops"] for s in pred["stages"]] == [5, 7, 13]
    assert len(obj["cuts"]) == 24 and obj["cuts"][2] == {"cut": 3, "node": 10, "entries": [4, 7], "bytes": 1605632}


def test_speeds(resnet_path, capsys):
    assert main(["partition", resnet_path, "--stages", "2", "--speeds", "1,0.5", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["prediction"]["stages"]
    assert [s["speed"] for s in stages] == [1.0, 0.5]
    assert stages[1]["compute_us"] == pytest.approx(stages[1]["num_ops"] * 10 / 0.5)
    assert stages[1]["num_ops"] < stages[0]["num_ops"]  # the slow device gets fewer ops


def test_link(resnet_path, capsys):
    assert main(["partition", resnet_path, "--stages", "2", "--link-bandwidth", "1GB/s",
                 "--link-latency", "20us", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["prediction"]["stages"]
    for s in stages:
        assert s["transfer_us"] == pytest.approx(20 + s["in_bytes"] / 1e9 * 1e6)
    # stage 0 receives the 1x3x224x224 float32 input from the driver
    assert stages[0]["in_bytes"] == 3 * 224 * 224 * 4


@pytest.mark.parametrize("argv, message", [
    (["--stages", "26"], "cannot make 26 stages from 25 op node(s)"),
    (["--stages", "3", "--memory-per-device", "10MiB"], "no 3-stage plan fits the memory caps (10.00 MiB per device)"),
    (["--cuts", "5,x"], "cannot read --cuts '5,x'"),
    (["--cuts", "12,5"], "strictly increasing"),
    (["--cuts", "0,30"], "out of range: cuts are op ordinals in 1..24"),
    (["--cuts", "5", "--stages", "3"], "--stages 3 disagrees with 1 cut(s)"),
    (["--stages", "3", "--strategy", "manual"], "the manual strategy needs --cuts"),
    (["--stages", "2", "--speeds", "1,1,1x"], "cannot read --speeds"),
    (["--stages", "3", "--speeds", "1,2"], "2 speed factors given for 3 stages"),
    (["--stages", "2", "--device", "v100"], "unknown device 'v100'"),
    (["--stages", "2", "--memory-per-device", "lots"], "cannot read 'lots' as a size"),
    (["--stages", "2", "--cost", "analytic"], "needs ops.json"),
    (["--stages", "2", "--cost", "measured"], "needs a profile"),
    (["--stages", "2", "--inputs", "nope"], "not null nodes of the graph"),
])
def test_errors_are_clear(resnet_path, capsys, argv, message):
    assert main(["partition", resnet_path, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tvmpipe partition: error: ") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("where, message", [("missing/plan.json", "does not exist"), (".", "is a directory")])
def test_an_unwritable_plan_file_is_refused_before_planning(resnet_path, tmp_path, capsys, where, message):
    """-o in a directory that does not exist, or naming a directory, ended in a FileNotFoundError /
    IsADirectoryError traceback after the planning; now one line, and nothing written."""
    out = tmp_path / where
    assert main(["partition", resnet_path, "--stages", "3", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tvmpipe partition: error: -o/--output ") and message in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_missing_path(tmp_path, capsys):
    assert main(["partition", str(tmp_path / "nothing"), "--stages", "2"]) == 2
    assert "no such bundle directory" in capsys.readouterr().err


def test_over_cap_manual_plan_is_flagged(resnet_path, capsys):
    assert main(["partition", resnet_path, "--cuts", "20", "--memory-per-device", "30MiB"]) == 0
    captured = capsys.readouterr()
    assert " !" in captured.out and "over their memory cap" in captured.err
