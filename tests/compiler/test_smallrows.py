"""compiler/smallrows.py: a decode step's matmuls of 2-16 rows reading a float weight get the 8-row
tile (measured on an H200: docs/gpu-validation.md); batch 1, other functions and non-decode programs
keep dlight's default rules; the kernels build with nvcc and take the arguments their launches pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.tvm
TILE = [2, 32, 1]  # SmallRows' thread block


def launches_by_rows(ex) -> dict[str, tuple[int | None, list[list[int]]]]:
    from tvmpipe.compiler.smallrows import weight_rows

    funcs = ex.kernels["functions"]
    return {name: (weight_rows(ex.unscheduled[name]), [la["block"] for la in funcs[name]["launches"]])
            for name in funcs if name in ex.unscheduled}


@pytest.fixture(scope="module")
def steps():
    pytest.importorskip("tvm")
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    quiet = Progress(stream=None)
    return {"b8": export("llama", decode=16, batch=8, seed=1, progress=quiet),
            "b2c4": export("llama", decode=16, batch=2, chunk=4, seed=1, progress=quiet),
            "b1": export("llama", decode=16, seed=1, progress=quiet)}


@pytest.mark.parametrize("name, rows", [("b8", {8}), ("b2c4", {8, 2})])  # b2c4: 8 tokens, the head 2 rows
def test_a_decode_steps_few_row_matmuls_get_the_tile(steps, name, rows):
    got = launches_by_rows(steps[name])
    tiled = {f: blocks for f, (r, blocks) in got.items() if r is not None and 2 <= r <= 16}
    assert len(tiled) >= 3 and {r for r, _ in got.values() if r is not None} == rows  # projections, MLP, head
    assert all(blocks == [TILE] for blocks in tiled.values()), tiled
    assert all(TILE not in blocks for f, (r, blocks) in got.items() if f not in tiled)  # nothing else took it


def test_batch_1_keeps_the_default_rules(steps):
    got = launches_by_rows(steps["b1"])
    assert {r for r, _ in got.values() if r is not None} == {1}
    assert all(TILE not in blocks for _, blocks in got.values())


def test_the_tiled_kernels_build_and_take_their_launches_arguments(steps, tmp_path):
    from tests.support.cubin_elf import compile_and_read

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc not installed")
    ex = steps["b8"]
    kernels = compile_and_read(nvcc, ex.cuda_source, "sm_90", tmp_path)
    for fn, rec in ex.kernels["functions"].items():
        for launch in rec["launches"]:
            assert len(kernels[launch["kernel"]].params) == len(launch["args"]), (fn, launch["kernel"])
    assert json.dumps(ex.kernels).count('"block": [2, 32, 1]') >= 3
