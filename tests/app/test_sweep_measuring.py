"""`tvmpipe sweep`'s measuring (app/sweep.py, cluster/experiment.py): what its figures are taken from."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from tvmpipe.app.sweep import backend_profile
from tvmpipe.bundle import load_bundle
from tvmpipe.cluster import Pipeline
from tvmpipe.cluster.experiment import measure_rounds, spreads
from tvmpipe.executor import GraphRunner
from tvmpipe.executor.inputs import random_micro_batches
from tvmpipe.partition import plan_equal_ops

CNN = Path(__file__).resolve().parents[2] / "examples" / "cnn"


def test_reference_profile_is_each_nodes_fastest_over_spaced_bursts(monkeypatch):
    """One profile of examples/cnn lasts ~10 ms: a neighbour busy for those 10 ms slowed every run of it
    (505 against 326 us). The sweep's profile is each node's fastest over bursts 50 ms apart, so one
    slowed burst leaves no trace."""
    real = GraphRunner.profile
    bursts, pauses = [], []

    def profile(self, **kw):
        prof = real(self, **kw)
        if not bursts:  # the first burst ran beside a busy neighbour
            for row in prof.nodes:
                row.min_us *= 1.5
        bursts.append(prof.to_json())
        return prof

    monkeypatch.setattr(GraphRunner, "profile", profile)
    monkeypatch.setattr(time, "sleep", pauses.append)
    got = backend_profile(load_bundle(CNN), "reference", 1.0)
    assert len(bursts) == 5 and pauses == [0.05] * 4
    for i, row in enumerate(got["nodes"]):
        assert row["time_us"] == min(b["nodes"][i]["min_us"] for b in bursts)
        assert row["time_us"] < bursts[0]["nodes"][i]["min_us"] or bursts[0]["nodes"][i]["min_us"] == 0
    assert got["run_min_us"] == min(b["run_min_us"] for b in bursts)


def test_rounds_start_after_unmeasured_warm_up():
    """A fresh worker's first few hundred micro-batches computed up to 1.6x slower (600 against 380 us on
    examples/cnn): measured rounds start after `warmup` micro-batches that no round counts."""
    bundle = load_bundle(CNN)
    batches = random_micro_batches(bundle, 6, seed=0)
    with Pipeline(bundle, plan_equal_ops(bundle.graph, 1), backend="simulated", launcher="process",
                  host="127.0.0.1", backend_opts={"time_scale": 0.0}) as pipe:
        rounds = measure_rounds(pipe, batches, 2, True, warmup=4)
        assert pipe.submitted == 4 + 2 * 6
    assert [r.metrics.micro_batches for r in rounds] == [6, 6]
    assert all(r.stage_cpu_us and r.stage_cpu_us[0] > 0 for r in rounds)  # per-thread CPU read from /proc
    for r in rounds:  # the whole pipeline's CPU per micro-batch, and the cores its processes kept busy
        assert r.cpu_us == sum(r.stage_cpu_us) + r.driver_cpu_us and r.cpu_us > r.stage_cpu_us[0]
        assert r.cores_busy is not None and 0 < r.cores_busy <= len(os.sched_getaffinity(0)) + 0.05
    sp = spreads(rounds)
    assert sp["cpu_us"].median == statistics.median(r.cpu_us for r in rounds) and sp["cpu_us"].rounds == 2
    assert sp["cores_busy"].lo == min(r.cores_busy for r in rounds)
    rounds[0].stage_cpu_us = None  # a remote worker: its CPU cannot be read, so no figure at all
    assert "cpu_us" not in spreads(rounds) and "throughput" in spreads(rounds)


def test_rounds_measure_the_cores_other_processes_take():
    """A shared machine: while a round runs, a neighbour spinning a core (started here) takes CPU the
    pipeline's processes do not get. The round reads it from /proc/stat, less its own processes' CPU; the
    calibration then leaves the pipeline only the cores that were free (partition/runtime.py)."""
    import subprocess
    import sys

    bundle = load_bundle(CNN)
    batches = random_micro_batches(bundle, 1500, seed=0)
    with Pipeline(bundle, plan_equal_ops(bundle.graph, 1), backend="simulated", launcher="process",
                  host="127.0.0.1", backend_opts={"time_scale": 0.0}) as pipe:
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.2)
            (busy,) = measure_rounds(pipe, batches, 1, True, warmup=0)
        finally:
            neighbour.kill()
            neighbour.wait()
    # the neighbour alone is up to a core; on a machine loaded by others too, they take at least as much
    assert busy.others_cores is not None and busy.others_cores >= 0.5, busy.others_cores


def _span(rnd) -> tuple[float, float]:
    rec = rnd.record
    return min(rec.submit_times.values()), max(rec.done_times.values())


def test_plan_rounds_take_turns_with_calibration_rounds():
    """The shared machine's speed swings by tens of percent from one tenth of a second to the next, so a
    prediction is taken from calibration rounds that ran right beside the plan's rounds: pair by pair,
    in alternating order (calibration first, then the plan first), the warm-up run once, before the first."""
    from tvmpipe.app.sweep import Calibrator

    bundle = load_bundle(CNN)
    kw = dict(backend="simulated", launcher="process", host="127.0.0.1", backend_opts={"time_scale": 0.0})
    with Pipeline(bundle, plan_equal_ops(bundle.graph, 1), **kw) as cal_pipe, \
            Pipeline(bundle, plan_equal_ops(bundle.graph, 2), **kw) as pipe:
        cal = Calibrator(pipe=cal_pipe, batches=random_micro_batches(bundle, 5, seed=1))
        measured, alongside = cal.paired(pipe, random_micro_batches(bundle, 6, seed=0), 4, True, warmup=3)
        assert pipe.submitted == 3 + 4 * 6 and cal_pipe.submitted == 4 * 5
    assert [r.metrics.micro_batches for r in measured] == [6] * 4 and [r.metrics.micro_batches for r in alongside] == [5] * 4
    order = []
    for i, (plan, calib) in enumerate(zip(measured, alongside)):
        pair = [("plan", *_span(plan)), ("cal", *_span(calib))]
        order += sorted(pair, key=lambda x: x[1])
        assert [name for name, *_ in sorted(pair, key=lambda x: x[1])] == (["plan", "cal"] if i % 2 else ["cal", "plan"])
    assert all(a[2] <= b[1] for a, b in zip(order, order[1:]))  # one pipeline at a time, never overlapping


def test_real_op_calibration_rounds_last_as_long_as_the_plans():
    """A pair's halves must see the machine for equally long: a calibration that computes the real ops
    runs rounds of the plans' micro-batch count; a zero-compute one keeps its own count."""
    from tvmpipe.app.sweep import CALIBRATION_MICRO_BATCHES, Calibrator

    bundle = load_bundle(CNN)
    real = Calibrator(pipe=object(), batches=[{}] * CALIBRATION_MICRO_BATCHES, fields={"compute_us": 300.0})
    zero = Calibrator(pipe=object(), batches=[{}] * CALIBRATION_MICRO_BATCHES, fields={})
    for c in (real, zero):
        c.match(bundle, 217)
    assert len(real.batches) == 217 and len(zero.batches) == CALIBRATION_MICRO_BATCHES
    assert real.batches[0].keys() == random_micro_batches(bundle, 1, seed=1)[0].keys()
