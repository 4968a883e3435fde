"""Bundles shared by the executor tests, built once per session.

`tiny` (tests/handmade.py) has real CUDA kernels; `skipnet` and `convnet` (exsynth.py) have awkward
graph shapes but empty kernel bodies; examples/mlp and examples/cnn are the compiler's real bundles
and are used when present.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tvmpipe.bundle import Bundle, load_bundle

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # tests/handmade.py
sys.path.insert(0, str(HERE))  # exhelp.py, exsynth.py

from exhelp import EXAMPLES  # noqa: E402
from exsynth import write_convnet, write_skipnet  # noqa: E402
from handmade import write_tiny  # noqa: E402


@pytest.fixture(scope="session")
def bundle_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    dirs = {"tiny": write_tiny(root / "tiny"), "skipnet": write_skipnet(root / "skipnet"),
            "convnet": write_convnet(root / "convnet")}
    for name in EXAMPLES:
        if (ROOT / "examples" / name / "bundle.json").is_file():
            dirs[f"examples/{name}"] = ROOT / "examples" / name
    return dirs


@pytest.fixture(scope="session")
def bundles(bundle_dirs) -> dict[str, Bundle]:
    return {k: load_bundle(v) for k, v in bundle_dirs.items()}


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path, bundle_dirs):
    """The strict fake pycuda (tests/fakecuda) in this test, computing the session's bundles."""
    from fakecuda_env import activate

    activate(monkeypatch, tmp_path / "cubins", bundle_dirs.values())
    import pycuda.driver as drv

    yield drv
    for name in [m for m in sys.modules if m == "pycuda" or m.startswith("pycuda.")]:
        del sys.modules[name]
