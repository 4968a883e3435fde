"""Fuzzing bundle loading: damage any file of the tiny bundle (structurally or textually, with
checksums fixed up or not) and load_bundle answers BundleError/GraphError or a valid Bundle that
`tvmpipe inspect` can render."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.tiny_bundle import write_tiny
from tests.support.json_mutations import paths, structural, textual
from tvmpipe.bundle import BundleError, GraphError, load_bundle
from tvmpipe.bundle.inspect import build_report, render_text

JSON_FILES = ["bundle.json", "graph.json", "kernels.json", "ops.json"]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    out = write_tiny(tmp_path_factory.mktemp("fuzz") / "tiny")
    return {f.name: f.read_bytes() for f in out.iterdir()}


@st.composite
def damaged(draw: st.DrawFn, files: dict[str, bytes]) -> dict[str, bytes]:
    files = dict(files)
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(sorted(files)))
        data = files[name]
        if name in JSON_FILES and draw(st.booleans()):
            try:
                doc = json.loads(data)
            except ValueError:
                continue  # already damaged textually
            files[name] = json.dumps(draw(structural(doc, paths(doc)))).encode()
        elif name == "params.npz":
            i = draw(st.integers(0, len(data)))
            files[name] = data[:i] + draw(st.binary(max_size=8)) + data[i + draw(st.integers(0, 8)):]
        else:
            files[name] = draw(textual(data.decode("utf-8", "replace"))).encode()
        if draw(st.integers(0, 9)) == 0:  # now and then the file goes missing altogether
            del files[name]
    if "bundle.json" in files and draw(st.sampled_from([True, True, True, False])):
        try:  # usually keep the checksums right, so the damage reaches the parsers
            m = json.loads(files["bundle.json"])
            m["files"] = {n: hashlib.sha256(b).hexdigest() for n, b in files.items() if n != "bundle.json"}
            files["bundle.json"] = json.dumps(m).encode()
        except (ValueError, TypeError):
            pass
    return files


@pytest.mark.timeout(90)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_bundles_load_or_fail_cleanly(tiny_files, data):
    files = data.draw(damaged(tiny_files))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tiny"
        root.mkdir()
        for name, content in files.items():
            (root / name).write_bytes(content)
        try:
            bundle = load_bundle(root)
        except (BundleError, GraphError) as exc:
            assert exc.problems and str(exc)
            return
        render_text(build_report(bundle))
