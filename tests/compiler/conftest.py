"""Session fixtures: each model is compiled once per test session (ResNet-18 alone takes ~5 s)."""

from __future__ import annotations

from typing import Callable

import pytest

from tests.support.compiled_models import Compiled, compile_source


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Compiled]:
    """compiled(name) for a built-in model name, "onnx" or "pt2"; compiles on first use only."""
    cache: dict[str, Compiled] = {}

    def get(name: str) -> Compiled:
        if name not in cache:
            cache[name] = compile_source(name, tmp_path_factory.mktemp(f"bundle_{name}"))
        return cache[name]

    return get
