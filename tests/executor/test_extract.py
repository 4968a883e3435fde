"""extract: a node range written as its own bundle runs alone exactly like inside the whole graph."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.executor_cases import CPU_MODELS, get_bundle
from tvmpipe.bundle import load_bundle
from tvmpipe.cli import main
from tvmpipe.executor import ExecutorError, GraphRunner, Stage, boundary_input_name, extract_bundle, feeds_by_entry, random_inputs


def whole_values(bundle) -> dict[int, np.ndarray]:
    """Every entry the whole graph computes, by running each op node as its own stage."""
    values = feeds_by_entry(bundle, random_inputs(bundle, seed=7))
    n = len(bundle.graph.nodes)
    values.update(Stage(bundle, 0, n).run(values))
    for nid in bundle.graph.op_nodes:  # entries consumed internally are not sent by the whole graph
        s = Stage(bundle, nid, nid + 1)
        values.update(s.run({e: values[e] for e in s.program.feed_entries}))
    return values


@pytest.mark.parametrize("model", CPU_MODELS)
def test_extracted_ranges_match(bundles, model, tmp_path):
    bundle = get_bundle(bundles, model)
    g = bundle.graph
    n = len(g.nodes)
    values = whole_values(bundle)
    ranges = [(0, c) for c in range(1, n)] + [(c, n) for c in range(1, n)] + [(n // 3, 2 * n // 3)]
    for start, end in ranges:
        stage = Stage(bundle, start, end)
        if not stage.program.steps:
            continue
        out = extract_bundle(bundle, start, end, tmp_path / f"{start}_{end}")
        sub = load_bundle(out)
        prog = stage.program
        assert sub.input_names == prog.input_names + [boundary_input_name(g, e) for e in prog.recv_entries]
        assert sorted(sub.param_names) == sorted(prog.param_names)
        assert set(sub.params) == set(prog.param_names)
        assert set(sub.kernels) == {s.func for s in prog.steps if s.kind == "kernels"}
        r = GraphRunner(sub)
        feeds = {name: values[e] for name, e in prog.input_entries.items()}
        feeds.update({boundary_input_name(g, e): values[e] for e in prog.recv_entries})
        r.run(**feeds)
        assert r.get_num_outputs() == len(prog.send_entries)
        for i, e in enumerate(prog.send_entries):
            assert r.get_output(i).tobytes() == values[e].tobytes(), f"{model} [{start}, {end}) output {i}"


def test_extract_generated_params_stay_generated(tmp_path):
    from tests.support.tiny_bundle import write_tiny

    b = load_bundle(write_tiny(tmp_path / "gen", params=None, params_seed=11))
    sub = load_bundle(extract_bundle(b, 0, 4, tmp_path / "sub"))
    assert sub.manifest.params_file is None and sub.manifest.params_seed == 11
    for name in ("w", "b"):
        np.testing.assert_array_equal(sub.params[name], b.params[name])


def test_extract_cli(bundle_dirs, tmp_path, capsys):
    out = tmp_path / "half"
    assert main(["extract", str(bundle_dirs["skipnet"]), "--nodes", "0:7", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    manifest = json.loads((out / "bundle.json").read_text())
    assert manifest["model"] == "skipnet[0:7]" and manifest["source"]["extracted_from"]["nodes"] == [0, 7]
    assert main(["extract", str(bundle_dirs["skipnet"]), "--nodes", "0:7", "-o", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["extract", str(bundle_dirs["skipnet"]), "--nodes", "0:7", "-o", str(out), "--force"]) == 0


def test_extract_bare_graph_refused(fixtures_dir, tmp_path):
    b = load_bundle(fixtures_dir / "wrn_fc_nnvm.json")
    with pytest.raises(ExecutorError, match="bare graph.json"):
        extract_bundle(b, 0, 3, tmp_path / "x")


def test_extract_names_the_state_it_turns_into_plain_tensors(decode_bundle, tmp_path, capsys):
    """An extracted range declares no state pairs (it has no generation loop to feed them): its
    caches are plain inputs and outputs. That used to happen without a word; now the command says
    which pairs, and bundle.json's source records them."""
    b = load_bundle(decode_bundle)
    n = len(b.graph.nodes)
    names = [p.name for p in b.state]
    assert main(["extract", str(decode_bundle), "--nodes", f"0:{n}", "-o", str(tmp_path / "all")]) == 0
    assert f"note: state pair(s) {', '.join(names)} of the source are plain inputs and outputs" in capsys.readouterr().out
    sub = load_bundle(tmp_path / "all")
    assert sub.state == [] and sub.generation is None
    assert all(p.input in sub.input_names for p in b.state)
    assert sub.manifest.source["extracted_from"]["state_as_plain_io"] == names
    # the embedding at the front reads no cache: no note, nothing recorded
    caches = {p.input for p in b.state}
    end = next(c for c in range(1, n)
               if Stage(b, 0, c).program.steps and not caches & set(Stage(b, 0, c).program.input_names))
    assert main(["extract", str(decode_bundle), "--nodes", f"0:{end}", "-o", str(tmp_path / "front")]) == 0
    assert "note:" not in capsys.readouterr().out
    assert "state_as_plain_io" not in load_bundle(tmp_path / "front").manifest.source["extracted_from"]
