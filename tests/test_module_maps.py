"""A package's module map (the "Modules" list in its __init__ docstring) names exactly the modules
the package has: a map that names a file that does not exist, or leaves one out, tells a reader
the wrong house (issue 50 found maps naming `jobs`, `transport.py`, `actor.py`, `sampling.py`)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^  (\w+)/?(?=\s)", re.M)  # "  name   what it holds" (a subpackage: "name/")


def _packages() -> list[tuple[str, Path]]:
    """(package, folder) of every package with a module map."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = []
    for package, folder in sorted(dirs.items()):
        for init in sorted((ROOT / folder).rglob("__init__.py")):  # the package and its subpackages
            doc = ast.get_docstring(ast.parse(init.read_text()))
            if doc and re.search(r"^Modules\b", doc, re.M):
                rel = init.parent.relative_to(ROOT / folder).parts
                out.append((".".join((package, *rel)), init.parent))
    return sorted(set(out))


def _map(folder: Path) -> set[str]:
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    body = doc[re.search(r"^Modules\b.*$", doc, re.M).end():]
    return set(ENTRY.findall(body.split("\n\n", 1)[0]))


def test_the_maps_are_found():
    found = {p for p, _ in _packages()}
    assert {"tvmpipe.cluster", "tvmpipe.cluster.wire", "tvmpipe.cluster.control", "tvmpipe.compiler",
            "tvmpipe.generation", "tvmpipe.serve"} <= found, found


@pytest.mark.parametrize("package,folder", _packages(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_module_map_names_exactly_the_package_s_modules(package, folder):
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    named = _map(folder)
    assert not named - modules, f"{package}'s map names modules that do not exist: {sorted(named - modules)}"
    assert not modules - named, f"{package}'s map leaves out: {sorted(modules - named)}"
