"""Fixtures shared by every layer's tests. Keep it small: layer-specific helpers live beside their tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

# CI clones the repository with the read-only shared/ folder beside it.
GRAPH_FIXTURES = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "graphs"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The real graph.json files from public TVM deployments (see their SOURCES.md)."""
    if not GRAPH_FIXTURES.is_dir():
        pytest.skip(f"graph fixtures not found at {GRAPH_FIXTURES.resolve()}: clone shared/ beside the repository")
    return GRAPH_FIXTURES.resolve()


@pytest.fixture(scope="session")
def graph_json(fixtures_dir: Path) -> Callable[[str], dict[str, Any]]:
    """Factory: a fresh decoded copy of a fixture by file stem, safe to mutate."""
    return lambda stem: json.loads((fixtures_dir / f"{stem}.json").read_text())


@pytest.fixture
def tiny_bundle(tmp_path: Path) -> Path:
    """A valid tiny bundle with real CUDA kernels (tests/handmade.py), in a fresh directory."""
    from handmade import write_tiny

    return write_tiny(tmp_path / "tiny")
