"""Predictions (throughput, latency, bubble), sweeps, reports, and planner speed."""

from __future__ import annotations

import csv
import random
import time
from pathlib import Path

import pytest

from tests.support.random_graphs import random_bundle, random_profile
from tvmpipe.bundle import load_bundle
from tvmpipe.partition import Plan
from tvmpipe.partition.devices import Link
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.planners import make_plan, plan_optimal
from tvmpipe.partition.predict import bubble_fraction, predict
from tvmpipe.partition.report import Span, plot_gantt, write_report
from tvmpipe.partition.sweep import Measured, sweep_plans

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def resnet(fixtures_dir):
    return load_bundle(fixtures_dir / "resnet18_nnvm.json")


def test_bubble_formula():
    assert bubble_fraction([10, 10, 10]) == 0
    assert bubble_fraction([5, 10]) == pytest.approx(0.25)
    # one request through 3 equal stages: each device busy 1/3 of the time
    assert bubble_fraction([10, 10, 10], requests=1) == pytest.approx(2 / 3)
    # fill/drain shrinks as requests grow, towards the steady-state value
    b = [bubble_fraction([5, 10], requests=m) for m in (1, 10, 1000)]
    assert b[0] > b[1] > b[2] > 0.25 and b[2] == pytest.approx(0.25, abs=1e-3)


def test_prediction_numbers(resnet):
    model = PipelineModel.build(resnet, link=Link(bandwidth=1e10, latency_us=3.0))
    plan = Plan.from_cuts(resnet.graph, [9, 17])
    p = predict(model, plan)
    assert [s.num_ops for s in p.stages] == [9, 8, 8]
    assert [s.compute_us for s in p.stages] == [90.0, 80.0, 80.0]
    for s in p.stages:
        assert s.transfer_us == pytest.approx(3.0 + s.in_bytes / 1e10 * 1e6)
        assert s.time_us == pytest.approx(s.compute_us + s.transfer_us)
    assert p.bottleneck_us == max(s.time_us for s in p.stages)
    assert p.throughput == pytest.approx(1e6 / p.bottleneck_us)
    assert p.latency_us == pytest.approx(sum(s.time_us for s in p.stages) + 3.0 + 1000 * 4 / 1e10 * 1e6)
    # idle = not computing: time on the link is not device work (the cluster measures compute spans)
    assert p.bubble == pytest.approx(1 - sum(s.compute_us for s in p.stages) / (3 * p.bottleneck_us))
    assert p.period_us == p.bottleneck_us and p.limit == "stage" and not p.cpu_bound
    # bytes out of a stage = bytes its later stages receive from it (+ graph outputs)
    assert p.stages[0].out_bytes == p.stages[1].in_bytes and p.stages[2].out_bytes == 1000 * 4
    assert p.bytes_moved == sum(s.in_bytes for s in p.stages)


def test_sweep_and_report(resnet, tmp_path):
    model = PipelineModel.build(resnet, memory_caps=[40 << 20])
    cases = sweep_plans(model, 4)
    assert [(c.stages, c.strategy) for c in cases] == [(k, s) for k in range(1, 5) for s in ("equal", "optimal")]
    # one stage cannot hold all of ResNet-18 under a 40 MiB cap: recorded, not dropped
    assert cases[1].error and "fits the memory caps" in cases[1].error and cases[1].plan is None
    assert cases[0].plan is not None and not cases[0].prediction.fits_memory  # equal ignores caps; predicted says so
    for c in cases[2:]:
        if c.prediction is not None:
            c.measured = Measured(throughput=c.prediction.throughput * 0.95, latency_p50_us=c.prediction.latency_us,
                                  latency_p99_us=c.prediction.latency_us * 1.2, bubble=c.prediction.bubble)
    spans = [Span(s, r * 10 + s * 10, r * 10 + s * 10 + 9, f"req {r}") for r in range(4) for s in range(3)]
    paths = write_report(cases, tmp_path / "report", title="resnet18 sweep", timeline=spans, timeline_unit="us")
    for key in ("throughput_png", "gantt_png"):
        assert paths[key].read_bytes()[:8] == PNG and paths[key].stat().st_size > 5000
    rows = list(csv.DictReader(open(paths["csv"])))
    assert len(rows) == 8
    assert float(rows[3]["throughput_error_pct"]) == pytest.approx(100 * (1 / 0.95 - 1))
    assert rows[1]["pred_throughput"] == "" and "memory caps" in rows[1]["error"]
    md = paths["markdown"].read_text()
    assert "| 2 | optimal |" in md and "not planned" in md and "gantt.png" in md


def test_gantt_from_tuples(tmp_path):
    path = plot_gantt([(0, 0.0, 1.0, "a"), (1, 1.0, 2.5, "b")], tmp_path / "g.png")
    assert Path(path).read_bytes()[:8] == PNG


def test_optimal_beats_equal_on_uneven_costs(resnet):
    """With measured times skewed to the early layers, the optimal plan cuts earlier than equal counts."""
    g = resnet.graph
    prof = {"nodes": [{"index": n, "name": g.nodes[n].name, "time_us": 100.0 if k < 5 else 10.0}
                      for k, n in enumerate(g.op_nodes)]}
    model = PipelineModel.build(resnet, profile=prof)
    equal, best = make_plan(model, 3, "equal"), make_plan(model, 3, "optimal")
    assert best.predicted["bottleneck_us"] < 0.6 * equal.predicted["bottleneck_us"]
    assert best.cuts(g)[0] < equal.cuts(g)[0]


def test_planner_speed_700_ops():
    rng = random.Random(7)
    bundle, inputs, _ = random_bundle(rng, 700)
    model = PipelineModel.build(bundle, profile=random_profile(rng, bundle), inputs=inputs,
                                memory_caps=[None], speeds=[1, 1, 0.5, 1, 1, 2, 1, 1])
    t0 = time.perf_counter()
    plan = plan_optimal(model, 8)
    elapsed = time.perf_counter() - t0
    assert plan.num_stages == 8
    assert elapsed < 2.0, f"optimal planning of 700 ops into 8 stages took {elapsed:.2f} s"


def test_report_states_the_noise_floor_of_identical_plans(resnet, tmp_path):
    """Rows that run the very same stages (equal and optimal at K = 1) measure this machine's run-to-run
    noise: the report says how far apart they came, and says nothing for rows whose plans differ."""
    from tvmpipe.partition.report import same_plans

    cases = sweep_plans(PipelineModel.build(resnet), 2)
    for c, t in zip(cases, (1000.0, 800.0, 600.0, 700.0)):
        c.measured = Measured(throughput=t, latency_p50_us=1.0, latency_p99_us=2.0, bubble=0.1)
    k1 = [c for c in cases if c.stages == 1]
    assert k1[0].plan.stages == k1[1].plan.stages
    groups = same_plans(cases)
    k2_same = cases[2].plan.stages == cases[3].plan.stages
    assert [g.rows for g in groups][:1] == [("K=1 equal", "K=1 optimal")] and len(groups) == 1 + k2_same
    assert groups[0].spread_pct == pytest.approx(25.0)
    md = write_report(cases, tmp_path / "r")["markdown"].read_text()
    assert "Noise floor" in md and "K=1 equal, K=1 optimal" in md and "1000/s vs 800/s, 25 % apart" in md
    for c in cases:  # no identical plans measured: no claim
        c.measured = None
    assert same_plans(cases) == [] and "Noise floor" not in write_report(cases, tmp_path / "s")["markdown"].read_text()
