"""`tvmpipe inspect --stages K` shows the weight bytes each stage loads, from the graph alone."""

from __future__ import annotations

import json

from tests.support.synthetic_bundles import write_dense_stack
from tvmpipe.bundle import load_bundle
from tvmpipe.cli import main


def test_inspect_shows_weight_bytes_per_stage(tmp_path, capsys):
    path = write_dense_stack(tmp_path / "stack", layers=4, width=16)
    assert main(["inspect", str(path), "--stages", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    layer = (16 * 16 + 16) * 4
    assert [s["weight_bytes"] for s in report["stages"]] == [2 * layer, 2 * layer]
    assert [s["params"] for s in report["stages"]] == [4, 4]
    weights = load_bundle(path).params.file
    assert weights.bytes_read == weights.header_bytes, "only the header was read"
    assert main(["inspect", str(path), "-k", "4"]) == 0
    out = capsys.readouterr().out
    from tvmpipe.core.units import format_bytes

    table = out[out.index("stage  nodes"):].splitlines()[1:5]
    assert all(row.split()[-2] + " " + row.split()[-1] == format_bytes(layer) for row in table), table
