"""Where the test data lives. All of it is in the repository: a fresh clone runs every test."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Real graph.json files that NNVM-era TVM wrote, copied verbatim (tests/data/graphs/SOURCES.md).
GRAPH_FIXTURES = REPO / "tests" / "data" / "graphs"
# A real legacy deployment, graph.json + TVM's binary .params, as published (tests/data/legacy/SOURCES.md).
LEGACY = REPO / "tests" / "data" / "legacy"
LEGACY_GRAPH = LEGACY / "mnet25_macos_graph.json"
LEGACY_PARAMS = LEGACY / "mnet25_macos.params"
# The prebuilt example bundles committed under examples/ (the compiler writes them; tests never skip them).
EXAMPLES = ("mlp", "cnn")
EXAMPLES_DIR = REPO / "examples"
