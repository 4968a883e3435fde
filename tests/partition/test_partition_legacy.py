"""`tvmpipe partition GRAPH.json --params FILE` on the published legacy deployment (tests/data/legacy):
the params file, not a guess, says which null nodes are weights; each stage is weighed by the
weights its ops read (memory caps) and by the graph inputs it receives (transfer time).

Expected bytes are computed here from the raw graph.json and the arrays, not from the planner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.paths import LEGACY_GRAPH, LEGACY_PARAMS
from tvmpipe.bundle import load_bundle
from tvmpipe.bundle.params import load_tvm_params, save_tvm_params
from tvmpipe.cli import main
from tvmpipe.partition.errors import PartitionError
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.planners import make_plan
from tvmpipe.partition.predict import predict


def _stage_weights(graph: dict, arrays: dict[str, np.ndarray], start: int, end: int) -> int:
    """Bytes of the distinct params read by the op nodes in node range [start, end)."""
    names = [n["name"] for n in graph["nodes"]]
    read = {names[r[0]] for n in graph["nodes"][start:end] if n["op"] != "null" for r in n["inputs"]}
    return sum(arrays[k].nbytes for k in read if k in arrays)


def test_stages_are_weighed_by_the_params_file():
    graph, arrays = json.loads(LEGACY_GRAPH.read_text()), load_tvm_params(LEGACY_PARAMS.read_bytes())
    model = PipelineModel.build(load_bundle(LEGACY_GRAPH, params=LEGACY_PARAMS))
    assert model.flow.inputs == ["data"]
    for k in (1, 2, 3, 4):
        pred = predict(model, make_plan(model, k, "optimal"))
        assert [s.params_bytes for s in pred.stages] == [_stage_weights(graph, arrays, s.start, s.end)
                                                         for s in pred.stages]
        assert pred.stages[0].in_bytes >= 1 * 3 * 480 * 640 * 4  # the graph input goes to the first stage
    assert predict(model, make_plan(model, 1, "optimal")).stages[0].params_bytes == 1_697_280


def test_memory_caps_count_the_weights():
    model = PipelineModel.build(load_bundle(LEGACY_GRAPH, params=LEGACY_PARAMS))
    one = predict(model, make_plan(model, 1, "optimal")).stages[0]
    cap = one.memory_bytes - one.params_bytes // 2  # one device cannot hold it all, two can
    capped = PipelineModel.build(load_bundle(LEGACY_GRAPH, params=LEGACY_PARAMS), memory_caps=[cap])
    with pytest.raises(PartitionError):
        make_plan(capped, 1, "optimal")
    pred = predict(capped, make_plan(capped, 2, "optimal"))
    assert pred.fits_memory and all(s.memory_bytes <= cap for s in pred.stages)


def test_params_file_overrides_a_wrong_guess(tmp_path):
    """Rename the input to `frame` and weight p0 to `data0`: the name guess takes the weight for the
    input; the params file knows better."""
    graph, arrays = json.loads(LEGACY_GRAPH.read_text()), load_tvm_params(LEGACY_PARAMS.read_bytes())
    graph["nodes"][0]["name"], graph["nodes"][2]["name"] = "frame", "data0"
    arrays = {("data0" if k == "p0" else k): v for k, v in arrays.items()}
    (tmp_path / "g.json").write_text(json.dumps(graph))
    (tmp_path / "w.params").write_bytes(save_tvm_params(arrays))
    guessed = PipelineModel.build(load_bundle(tmp_path / "g.json"))
    known = PipelineModel.build(load_bundle(tmp_path / "g.json", params=tmp_path / "w.params"))
    assert guessed.flow.inputs == ["data0"] and known.flow.inputs == ["frame"]
    frame = 1 * 3 * 480 * 640 * 4
    assert predict(known, make_plan(known, 1, "equal")).stages[0].in_bytes == frame
    assert predict(guessed, make_plan(guessed, 1, "equal")).stages[0].in_bytes == 864  # data0's bytes


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["partition", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli(capsys, tmp_path: Path):
    code, out, err = _cli(capsys, str(LEGACY_GRAPH), "--params", str(LEGACY_PARAMS), "-k", "3", "--json")
    assert code == 0, err
    stages = json.loads(out)["prediction"]["stages"]
    assert len(stages) == 3 and all(s["params_bytes"] > 0 for s in stages)
    code, out, err = _cli(capsys, str(LEGACY_GRAPH), "--params", str(LEGACY_PARAMS), "-k", "3")
    assert code == 0, err
    assert f"weights: 145 params, 1.62 MiB from {LEGACY_PARAMS}; graph inputs: data" in out.splitlines()
    code, out, err = _cli(capsys, str(LEGACY_GRAPH), "--params", str(LEGACY_PARAMS), "--inputs", "data", "-k", "2")
    assert code == 2 and out == ""
    assert err == "tvmpipe partition: error: --inputs and --params both say which null nodes are graph inputs: give one\n"
    bad = tmp_path / "bad.params"
    bad.write_bytes(save_tvm_params({"p5": np.zeros(2, np.float32)}))
    code, out, err = _cli(capsys, str(LEGACY_GRAPH), "--params", str(bad), "-k", "2")
    assert code == 2 and out == ""
    assert f"{bad}: param 'p5': is float32[2] but node 9 expects float32[1, 2, 1, 1, 8]" in err
