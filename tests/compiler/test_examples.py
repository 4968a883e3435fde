"""The shipped example bundles are what `tvmpipe compile NAME --omit-params` produces today."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_example_matches_a_fresh_compile(compiled, name, tmp_path):
    fresh = compiled(name).exported.write(tmp_path / name, params_seed=0)
    shipped = json.loads((EXAMPLES / name / "bundle.json").read_text())
    rebuilt = json.loads((fresh / "bundle.json").read_text())
    assert shipped["params"] == {"file": None, "generated": {"seed": 0}}
    assert sorted(shipped["files"]) == ["graph.json", "kernels.cu", "kernels.json", "ops.json"]
    # rebuild with: tvmpipe compile NAME -o examples/NAME --omit-params --force
    assert shipped == rebuilt, f"examples/{name} is stale"
