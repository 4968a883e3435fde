"""Session fixtures: each model is compiled once per test session (ResNet-18 alone takes ~5 s)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cmhelp.py, cmsources.py, cmnumpy.py

from cmhelp import Compiled, compile_source  # noqa: E402


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Compiled]:
    """compiled(name) for a built-in model name, "onnx" or "pt2"; compiles on first use only."""
    cache: dict[str, Compiled] = {}

    def get(name: str) -> Compiled:
        if name not in cache:
            cache[name] = compile_source(name, tmp_path_factory.mktemp(f"bundle_{name}"))
        return cache[name]

    return get
