"""Bundles shared by the executor tests, built once per session.

`tiny` (tests/support/tiny_bundle.py) has real CUDA kernels; `skipnet` and `convnet`
(tests/support/synthetic_bundles.py) have awkward graph shapes but empty kernel bodies;
examples/mlp and examples/cnn are the compiler's real bundles, committed to the repository.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.paths import EXAMPLES, EXAMPLES_DIR
from tests.support.synthetic_bundles import write_convnet, write_skipnet
from tests.support.tiny_bundle import write_tiny
from tvmpipe.bundle import Bundle, load_bundle


@pytest.fixture(scope="session")
def bundle_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    dirs = {"tiny": write_tiny(root / "tiny"), "skipnet": write_skipnet(root / "skipnet"),
            "convnet": write_convnet(root / "convnet")}
    for name in EXAMPLES:
        dirs[f"examples/{name}"] = EXAMPLES_DIR / name
    return dirs


@pytest.fixture(scope="session")
def bundles(bundle_dirs) -> dict[str, Bundle]:
    return {k: load_bundle(v) for k, v in bundle_dirs.items()}


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path, bundle_dirs):
    """The strict fake pycuda (tests/fakecuda) in this test, computing the session's bundles."""
    from tests.support.fake_cuda import activate

    activate(monkeypatch, tmp_path / "cubins", bundle_dirs.values())
    import pycuda.driver as drv

    yield drv  # activate's monkeypatch takes the fake's modules out of sys.modules again
