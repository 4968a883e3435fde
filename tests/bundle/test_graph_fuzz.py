"""Fuzzing the graph reader: any damage to a real graph.json gives GraphError or a valid Graph.

A Graph the reader accepts must be fully usable: every derived view works, inspect can render it,
and it round-trips through to_json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.json_mutations import paths, structural, textual
from tvmpipe.bundle import Bundle, Graph, GraphError, parse_graph, parse_graph_text
from tvmpipe.bundle.inspect import build_report, render_text

STEMS = ["dlr_4in2out_nnvm", "wrn_fc_nnvm", "resnet18_nnvm"]
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def docs(fixtures_dir) -> dict[str, tuple[str, dict, list[tuple]]]:
    out = {}
    for stem in STEMS:
        text = (fixtures_dir / f"{stem}.json").read_text()
        doc = json.loads(text)
        out[stem] = (text, doc, paths(doc))
    return out


def _check_usable(g: Graph) -> None:
    """What every consumer of an accepted Graph relies on."""
    assert len(g.entries) == g.num_entries == g.node_row_ptr[-1]
    for n in g.nodes:
        for r in n.inputs:
            assert r.node < n.index and r.index < g.nodes[r.node].num_outputs
    assert all(0 <= e < g.num_entries for e in g.head_entries)
    g.consumers, g.activation_bytes()
    again = parse_graph(json.loads(json.dumps(g.to_json())))
    assert again.to_json() == g.to_json()
    render_text(build_report(Bundle(path=Path("fuzz.json"), graph=g)))


def _parse(fn, *args) -> None:
    try:
        g = fn(*args)
    except GraphError as exc:
        assert exc.problems and str(exc)
        return
    _check_usable(g)


@pytest.mark.timeout(60)
@FUZZ
@given(data=st.data(), stem=st.sampled_from(STEMS))
def test_structural_damage(docs, data, stem):
    _, doc, doc_paths = docs[stem]
    _parse(parse_graph, data.draw(structural(doc, doc_paths)))


@pytest.mark.timeout(60)
@FUZZ
@given(data=st.data(), stem=st.sampled_from(STEMS[:2]))
def test_textual_damage(docs, data, stem):
    text, _, _ = docs[stem]
    _parse(parse_graph_text, data.draw(textual(text)))
