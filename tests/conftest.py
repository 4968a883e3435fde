"""Fixtures shared by every layer's tests. Keep it small: helpers live in tests/support/."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

# One BLAS thread in the test process, as tvmpipe gives its workers when the driver sets none
# (cluster/control/environment.py): OpenBLAS sums in another order at another thread count, and tests compare
# pipelines with in-process oracles bit for bit. Set before anything imports NumPy.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from tests.support.paths import GRAPH_FIXTURES  # noqa: E402


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The real graph.json files from public TVM deployments (tests/data/graphs/SOURCES.md)."""
    return GRAPH_FIXTURES


@pytest.fixture(scope="session")
def graph_json(fixtures_dir: Path) -> Callable[[str], dict[str, Any]]:
    """Factory: a fresh decoded copy of a fixture by file stem, safe to mutate."""
    return lambda stem: json.loads((fixtures_dir / f"{stem}.json").read_text())


@pytest.fixture(scope="session")
def decode_bundle(tmp_path_factory) -> Path:
    """The tiny 2-layer GPT-style decode step with declared KV-cache state (tests/support/decode_bundle.py),
    compiled once per session (~40 s on 2 cores): tests/cluster and the GPU kit's CPU run share it."""
    from tests.support.decode_bundle import decode_bundle as build

    return build(tmp_path_factory.mktemp("decode"))


@pytest.fixture(scope="session")
def zoo_decoder(tmp_path_factory):
    """`zoo_decoder(name, batch=1, chunk=1, kv="paged")`: the zoo decoder's `tvmpipe compile NAME
    --decode` bundle (max context 20, seed 1: seed 0's GPT-2 and Llama repeat one token; `--batch`,
    `--chunk`; the default layout, paged, with `--page-size 4`: 5 pages a row at the max context,
    in the default pool; `kv="static"`: `--kv static`) with the transformers model of the same
    weights, compiled once per session and batch: the generation tests and the GPU kit's CPU run
    share them."""
    cache: dict[tuple[str, int, int, str], tuple[Path, object]] = {}

    def get(name: str, batch: int = 1, chunk: int = 1, kv: str = "paged") -> tuple[Path, object]:
        if (name, batch, chunk, kv) not in cache:
            from tvmpipe.compiler.decoders import KvOptions, build_decoder
            from tvmpipe.compiler.export import export
            from tvmpipe.compiler.progress import Progress

            out = tmp_path_factory.mktemp(f"decoder_{name}_{batch}_{chunk}_{kv}") / "b"
            export(name, progress=Progress(stream=None), decode=20, seed=1, batch=batch, chunk=chunk,
                   kv=KvOptions(kv, page_size=4)).write(out)
            cache[name, batch, chunk, kv] = (out, build_decoder(name, 1))
        return cache[name, batch, chunk, kv]

    return get


@pytest.fixture
def tiny_bundle(tmp_path: Path) -> Path:
    """A valid tiny bundle with real CUDA kernels (tests/support/tiny_bundle.py), in a fresh directory."""
    from tests.support.tiny_bundle import write_tiny

    return write_tiny(tmp_path / "tiny")
