"""The layering rule (pyproject.toml [tool.importlinter]) holds, checked by import-linter over this
source tree: layers import only downwards, the cluster's planes in their order, and no package has an
import cycle between its modules. import-linter finds a package's modules by walking its folder, and
tvmpipe's subpackages live in top-level folders that pyproject maps into the namespace, so the check
runs over a tree of links that lays them out as they are installed."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tree(tmp: Path) -> Path:
    """tmp/tvmpipe/<subpackage>/... : a real folder per package, a link per source file (so a test
    may add a module without touching the repository)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in dirs.items():
        dest = tmp.joinpath(*package.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder)
            if rel.parts[0] == "__pycache__" or (len(rel.parts) > 1 and (ROOT / folder / rel.parts[0]) in
                                                  [ROOT / d for d in dirs.values()]):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(src)
    return tmp


def lint(tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tmp)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())", str(ROOT / "pyproject.toml"),
                           "--no-cache"], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory.mktemp("layering"))


def test_the_layering_contracts_hold(tree):
    proc = lint(tree)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in proc.stdout
    modules = {p for p in (tree / "tvmpipe").rglob("*.py")}
    assert len(modules) > 120  # every subpackage is in the tree, not only tvmpipe/


@pytest.mark.parametrize("where,source,contract", [
    ("bundle/probe_up.py", "import tvmpipe.partition.plan\n", "tvmpipe's layers"),  # the old inspect import
    ("cluster/wire/probe_up.py", "import tvmpipe.cluster.driver\n", "the cluster layer"),
    ("cluster/probe_driver_up.py", "import tvmpipe.generation.scheduler\n", "tvmpipe's layers"),
])
def test_an_upward_import_is_refused(tmp_path, where, source, contract):
    tree = _tree(tmp_path)
    probe = tree / "tvmpipe" / where
    probe.write_text(source)
    proc = lint(tree)
    assert proc.returncode != 0 and contract in proc.stdout and "BROKEN" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("where,line", [
    ("cluster/wire/frames.py", "from tvmpipe.cluster.wire import cudaipc"),  # the codec importing a transport
    ("compiler/rewrite.py", "from tvmpipe.compiler.graphjson import plan_storage"),  # rewrite -> graphjson -> ... -> rewrite
])
def test_an_import_cycle_is_refused(tmp_path, where, line):
    """Both were cycles once: frames <-> cudaipc, and the compiler's rewrite -> graphjson -> opmap ->
    tecalls -> rewrite."""
    tree = _tree(tmp_path)
    module = tree / "tvmpipe" / where
    text = module.read_text()
    module.unlink()  # a link to the repository's file: replaced, not written through
    module.write_text(text + f"\n{line}  # noqa\n")
    proc = lint(tree)
    assert proc.returncode != 0 and "no import cycles" in proc.stdout, proc.stdout[-3000:]
