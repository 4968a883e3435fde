"""`tvmpipe sweep --measure-links` on the 4-host bed: links probed between every pair of hosts through
the data plane, kept in the report, charged to boundary frames, and predicted against measured per
stage count with the stages spread one per host."""

from __future__ import annotations

import json
import re
from pathlib import Path

from raybed import RayBed


def test_sweep_measures_the_links_between_hosts_and_plans_with_them(bed: RayBed, tmp_path: Path):
    out = tmp_path / "report"
    done = bed.python("-m", "tvmpipe.cli", "sweep", str(bed.head_only / "mlp"), "--address", "auto",
                      "--stages", "2..3", "--strategies", "equal", "--placement", "STRICT_SPREAD",
                      "--backend", "reference", "--gpus-per-stage", "0", "--measure-links", "--rounds", "1",
                      "-n", "200", "-o", str(out), timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    links = json.loads((out / "links.json").read_text())
    hosts = {h.address for h in bed.net.hosts}
    pairs = {(p["src"], p["dst"]) for p in links["pairs"]}
    assert pairs == {(a, b) for a in hosts for b in hosts}  # every ordered pair, each host's loopback too
    assert all(p["latency_us"] > 0 and p["bandwidth"] > 0 for p in links["pairs"])
    net, loop = links["network"], links["loopback"]
    assert net is not None and net["bandwidth"] > 0
    # the planner took the network's bandwidth, and the latency it adds to loopback
    charged = re.search(r"boundary frames charged (\d+) us \+ bytes at ([\d.]+) GB/s \(stages spread over nodes",
                        done.stdout)
    assert charged, done.stdout[-2000:]
    assert float(charged.group(2)) == round(net["bandwidth"] / 1e9, 2)
    assert int(charged.group(1)) == round(max(0.0, net["latency_us"] - loop["latency_us"]))
    md = (out / "sweep.md").read_text()
    assert "Links (measured, links.json)" in md
    for k in (2, 3):  # predicted against measured for each stage count
        row = next(line for line in md.splitlines() if line.startswith(f"| {k} | equal |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert float(cells[2]) > 0 and float(cells[3]) > 0, row
    print("\n" + "\n".join(line for line in done.stdout.splitlines() if line.startswith(("links", "boundary", "[equal"))))
