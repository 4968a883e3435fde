"""bench/gpu_check.sh on the CPU, over the strict fake PyCUDA (tests/fakecuda): the tvmpipe step on
its fallback package shim, `pytest -m gpu` (every GPU test must run and pass, from outside the repo
so the repo's tvmpipe/ folder cannot shadow the shim: issue 12, defect 6) and the pipeline bench on
the cuda backend with and without graph replay. A copy of the tree, so no result file is touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from tests.support.fake_cuda import fake_env


def image_python(where: Path) -> Path:
    """A Python like the GPU image's: this environment's packages, but tvmpipe not installed (the
    editable install's finder comes from a .pth that a plain path entry does not run)."""
    import site
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    py = where / "bin" / "python"
    inner_site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    Path(inner_site, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    assert subprocess.run([str(py), "-c", "import tvmpipe.executor"], cwd=where, capture_output=True).returncode != 0
    return py


def test_gpu_check_steps_on_fake_cuda(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", ".gpu", ".whl", "*.egg-info"))
    inner = tmp_path / "inner"
    python = image_python(tmp_path / "image")
    env = {**os.environ, **fake_env(tmp_path / "cache", [tree / "examples" / "mlp", tree / "examples" / "cnn", inner])}
    env.update(PYTHON=str(python), OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
               GPU_CHECK_SITE=str(tmp_path / "site"), GPU_CHECK_SHIM=str(tmp_path / "shim"),
               GPU_CHECK_STEPS="tvmpipe,pytest,pipeline", GPU_CHECK_FORCE_SHIM="1",
               PYTEST_ADDOPTS=f"--basetemp={inner}",
               GPU_CHECK_PIPELINE_ARGS="--stages 1,2 --graphs both --micro-batches 4 --distinct 2 "
                                       "--runner-repeat 3 --plan equal")
    r = subprocess.run(["bash", str(tree / "bench" / "gpu_check.sh")], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=500)
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r.returncode == 0 and summary["passed"], r.stdout[-4000:]
    assert [s["name"] for s in summary["steps"]] == ["tvmpipe", "pytest", "pipeline"]
    assert "using a package shim" in r.stdout
    n = summary["pytest_gpu"]
    assert n["tests"] >= 4 and n["passed"] == n["tests"], n
    runs = summary["pipeline"]["runs"]
    assert {(x["model"], x["graphs"], x["stages"]) for x in runs} == \
        {(m, g, k) for m in ("mlp", "cnn") for g in (False, True) for k in (1, 2)}
    assert all(x["exact"] for x in runs)
