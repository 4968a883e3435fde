"""What-if clusters (partition/hardware.py): the description file, `partition --cluster`, a 64-stage
experiment on a 700-op graph; and the report's pictures (steady-state window, spread, titles)."""

from __future__ import annotations

import json
import random

import pytest

from tests.support.random_graphs import random_bundle, random_profile
from tvmpipe.cli import main
from tvmpipe.partition import PartitionError
from tvmpipe.partition.hardware import load_cluster, parse_cluster
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.report import GANTT_ROWS, Span, gantt_rows, plot_gantt, plot_throughput, steady_window, write_report
from tvmpipe.partition.sweep import Measured, simulate_cases, sweep_plans

H100_2x4 = {"format": "tvmpipe-cluster", "version": 1, "name": "8 H100 on 2 nodes",
            "nodes": [{"device": "h100", "devices": 4, "count": 2, "link": {"bandwidth": "450GB/s", "latency": "3us"}}],
            "network": {"bandwidth": "100Gbit/s", "latency": "10us"}}
A10_4x4 = {"name": "16 A10 on 4 nodes", "nodes": [{"device": "a10", "devices": 4, "count": 4,
                                                   "link": {"bandwidth": "25GB/s", "latency": "5us"}}],
           "network": {"bandwidth": "100Gbit/s", "latency": "10us"}}


def test_cluster_lays_stages_on_devices_and_links():
    c = parse_cluster(H100_2x4)
    assert c.num_devices == 8 and c.num_nodes == 2
    speeds, caps, links = c.stages(6)
    assert speeds == [1.0] * 6 and caps == [80 << 30] * 6
    # stage 0 from the driver's host, 1-3 within node 0, 4 crosses the network, 5 within node 1
    assert links[0] == c.host and links[1:4] == [c.node_links[0]] * 3 and links[4] == c.network
    assert links[5] == c.node_links[1] and c.network.bandwidth == 12.5e9 and c.network.latency_us == 10
    a10 = parse_cluster(A10_4x4)
    assert a10.slots[0].speed == pytest.approx(31.2 / 67) and a10.slots[0].memory == 24 << 30
    mixed = parse_cluster({"nodes": [{"device": "h100", "speed": 2, "memory": "40GB"}, {"device": "t4"}]})
    assert [s.speed for s in mixed.slots][0] == 2 and mixed.slots[0].memory == 40_000_000_000
    with pytest.raises(PartitionError, match="has 8 devices: it cannot run 9 stages"):
        c.stages(9)


@pytest.mark.parametrize("bad, message", [
    ({"nodes": []}, "nodes: must be a non-empty list"),
    ({"nodes": [{"devices": 2}]}, r"nodes\[0\].device: missing"),
    ({"nodes": [{"device": "b200"}]}, r"nodes\[0\].device: unknown device 'b200'"),
    ({"nodes": [{"device": "h100", "devices": 0}]}, r"nodes\[0\].devices: must be a positive integer"),
    ({"nodes": [{"device": "h100", "speed": -1}]}, r"nodes\[0\].speed: must be positive"),
    ({"nodes": [{"device": "h100", "memory": "lots"}]}, r"nodes\[0\].memory: cannot read 'lots'"),
    ({"nodes": [{"device": "h100"}], "network": {"bandwidth": "fast"}}, "network.bandwidth: cannot read 'fast'"),
    ({"nodes": [{"device": "h100"}], "netwrok": {}}, r"unknown field\(s\) \['netwrok'\]"),
    ({"format": "other", "nodes": [{"device": "h100"}]}, "format: must be 'tvmpipe-cluster'"),
])
def test_bad_cluster_descriptions_name_the_field(tmp_path, bad, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(PartitionError, match=f"{path}: {message}"):
        load_cluster(path)


def test_partition_cli_takes_a_cluster(capsys, tmp_path, fixtures_dir):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(A10_4x4))
    code = main(["partition", str(fixtures_dir / "resnet18_nnvm.json"), "--stages", "6", "--cluster", str(path),
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["plan"]["stages"]) == 6
    assert [s["memory_cap"] for s in out["prediction"]["stages"]] == [24 << 30] * 6
    assert out["prediction"]["stages"][0]["speed"] == pytest.approx(31.2 / 67)
    code = main(["partition", str(fixtures_dir / "resnet18_nnvm.json"), "--stages", "17", "--cluster", str(path)])
    assert code == 2 and "cannot run 17 stages" in capsys.readouterr().err


def test_whatif_at_scale_700_ops_64_stages():
    """The issue's experiment: a 700-op graph, K up to 64, planned and simulated (timed in bench/whatif.py)."""
    _k64_run()


def _k64_run():
    rng = random.Random(5)
    bundle, inputs, _ = random_bundle(rng, 700)
    prof = random_profile(rng, bundle)
    big = parse_cluster({"name": "64 A10", "nodes": [{"device": "a10", "devices": 4, "count": 16}]})
    speeds, caps, links = big.stages(64)
    model = PipelineModel.build(bundle, profile=prof, inputs=inputs, speeds=speeds, memory_caps=caps, links=links)
    cases = sweep_plans(model, 64, ("optimal",), min_stages=64, requests=200)
    runs = simulate_cases(model, cases, 200)
    (case,) = cases
    assert case.plan.num_stages == 64 and len(runs[id(case)].busy) == 64
    assert case.measured.throughput == pytest.approx(case.prediction.throughput, rel=0.02)
    assert case.measured.bubble == pytest.approx(case.prediction.bubble, abs=0.02)
    return runs[id(case)]


def test_deep_gantt_draws_a_few_rows_over_a_steady_time_window(tmp_path):
    """64 rows of 20 micro-batches crossing a deep pipeline diagonally were unreadable slivers (and 5 s
    to draw): at most GANTT_ROWS stages (every n-th and the last), over the time the busiest of them
    takes for 20 micro-batches, so every row is full of labelled bars."""
    assert gantt_rows(list(range(8))) == list(range(8))
    assert gantt_rows(list(range(64))) == list(range(0, 64, 5)) + [63]
    assert all(len(gantt_rows(list(range(k)))) <= GANTT_ROWS and gantt_rows(list(range(k)))[-1] == k - 1
               for k in range(1, 200))
    run = _k64_run()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = []
    real_close = plt.close
    plt.close = lambda fig: (seen.append(fig), real_close(fig))
    try:
        plot_gantt(run.spans(), tmp_path / "g.png", unit="us", title="k64")
    finally:
        plt.close = real_close
    ax = seen[0].axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == [f"stage {s}" for s in gantt_rows(list(range(64)))]
    title = ax.get_title().replace("\n", " ")
    assert "14 of 64 stages" in title and "of steady state" in title
    lo, hi = ax.get_xlim()
    labels = [t for t in ax.texts if lo <= t.get_position()[0] <= hi]
    per_row = {round(t.get_position()[1]) for t in labels}
    assert per_row == set(range(len(rows))) and len(labels) >= 10 * len(rows)


def test_gantt_window_and_spread_in_the_report(tmp_path, fixtures_dir):
    from tvmpipe.bundle import load_bundle

    stall = {m: 50.0 if 95 <= m < 100 else 0.0 for m in range(200)}  # a loaded machine stalls somewhere
    spans = [Span(s, m * 1.0 + s + sum(stall[q] for q in range(m)), m * 1.0 + s + 0.9 + sum(stall[q] for q in range(m))
                  + stall[m], m) for m in range(200) for s in range(2)]
    window = sorted({s.label for s in steady_window(spans)})
    assert len(window) == 20 and window[0] >= 20 and window[-1] < 180  # not the fill nor the drain, not all 200
    assert not set(window) & set(range(95, 100))  # a typical window, not the one with the stall
    model = PipelineModel.build(load_bundle(fixtures_dir / "resnet18_nnvm.json"))
    cases = sweep_plans(model, 2, ("equal",))
    for c in cases:
        t = c.prediction.throughput
        c.measured = Measured(t * 0.97, 1.0, 2.0, bubble=0.1, rounds=5, throughput_range=(t * 0.9, t * 1.05),
                              bubble_range=(0.05, 0.2), load=(0.5, 1.5), utilisation=[(0.8, 0.1, 0.1)] * c.stages)
    long_title = "a sweep title that is far too long to fit on one line of a plot at any sensible font size " * 2
    paths = write_report(cases, tmp_path, title=long_title, timeline=spans)
    md = paths["markdown"].read_text()
    assert "| 1 | equal |" in md and "| 5 |" in md and "+3.1 |" in md and "yes" in md and "Load average" in md
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = []
    real_close = plt.close
    plt.close = lambda fig: (seen.append(fig), real_close(fig))
    try:
        plot_throughput(cases, tmp_path / "t.png", title=long_title)
    finally:
        plt.close = real_close
    (fig,) = seen
    title = fig._suptitle.get_text()
    assert "\n" in title and max(len(line) for line in title.splitlines()) <= 70  # wrapped: it fits
    errorbars = [c for c in fig.axes[0].containers if type(c).__name__ == "ErrorbarContainer"]
    assert errorbars, "measured throughput is drawn with its min-max bars"


def test_report_draws_the_fewest_stages_that_reach_the_best_rate():
    """On a what-if cluster many stage counts can reach one bottleneck op's rate (K = 56..64 of the 64-A10
    sweep, equal to the last bits): the report's Gantt chart and busy bars are the plan with the fewest
    stages among those, not whichever K float noise put highest; a plan clearly faster still wins."""
    from tvmpipe.partition.report import fastest
    from tvmpipe.partition.sweep import SweepCase

    def case(k, t):
        return SweepCase(k, "optimal", None, None, measured=Measured(t, 1.0, 2.0) if t else None)

    tied = [case(k, 2234.1696827850 + (1e-11 * (k % 3))) for k in range(56, 65)]
    assert fastest(tied).stages == 56
    assert fastest([case(8, 100.0), case(9, 100.05), case(10, 120.0), case(11, None)]).stages == 10
    assert fastest([case(8, 100.0), case(9, 100.05)]).stages == 8  # within 0.1 %: one rate
    assert fastest([case(3, None)]) is None and fastest([]) is None


def test_whatif_report_claims_no_host_cpu(tmp_path, fixtures_dir):
    """A what-if sweep plans with the ideal runtime: no host CPU is modelled, so the report's CPU columns stay
    empty rather than passing GPU op time off as CPU."""
    import csv

    from tvmpipe.bundle import load_bundle

    model = PipelineModel.build(load_bundle(fixtures_dir / "resnet18_nnvm.json"))
    cases = sweep_plans(model, 2, ("optimal",))
    simulate_cases(model, cases, 50)
    paths = write_report(cases, tmp_path, measured_label="simulated")
    rows = list(csv.DictReader(open(paths["csv"])))
    assert all(r["pred_cpu_us"] == r["pred_cores_busy"] == r["meas_cpu_us"] == "" for r in rows)
    table = [line for line in paths["markdown"].read_text().splitlines() if line.startswith("| 1 |")]
    assert table and table[0].split(" | ")[11:13] == ["-", "-"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = []
    real_close = plt.close
    plt.close = lambda fig: (seen.append(fig), real_close(fig))
    try:
        plot_throughput(cases, tmp_path / "t.png", "what-if")
        t = cases[0].measured.throughput
        cases[0].measured.throughput_range = (0.9 * t, 1.1 * t)
        plot_throughput(cases, tmp_path / "u.png", "sweep")
    finally:
        plt.close = real_close
    # one simulated run per plan has no rounds to spread: the title claims no min-max bars
    assert seen[0]._suptitle.get_text() == "what-if" and "min-max over rounds" in seen[1]._suptitle.get_text()
