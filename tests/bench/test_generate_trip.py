"""bench/generate.py's account of one step's trip: the means it reports are those of the timeline,
and with S = K their sum (a sequence's cycle) is what sets tokens/s."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tvmpipe.cluster.status import Span

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def trip():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import generate

        yield generate.trip
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_trip_takes_each_leg_from_the_timeline(trip):
    us = 1e-6
    # two steps through two stages; step 1 is submitted when step 0's output is in (+40 us)
    submit = {5: 0.0, 6: 1400 * us, 4: -9.0}  # step 4 is older than the measured run: ignored
    s0 = [Span(0, 5, 100 * us, 600 * us), Span(0, 6, 1500 * us, 2000 * us), Span(0, 4, -8.0, -7.9)]
    s1 = [Span(0, 5, 700 * us, 1200 * us), Span(0, 6, 2150 * us, 2650 * us)]
    done = {5: 1360 * us, 6: 2800 * us, 4: -7.0}
    record = SimpleNamespace(worker_stats=[SimpleNamespace(events=s0), SimpleNamespace(events=s1)])
    out = trip(5, record, submit, done)
    assert out["driver->0"] == pytest.approx(100.0)
    assert out["stage"] == [pytest.approx(500.0), pytest.approx(500.0)]
    assert out["0->1"] == pytest.approx(125.0)  # 100 and 150
    assert out["last->driver"] == pytest.approx(155.0)  # 160 and 150
    assert out["driver turnaround"] == pytest.approx(40.0)  # step 6's output has no later submission
    assert out["cycle"] == pytest.approx(100 + 1000 + 125 + 155 + 40)
    assert trip(7, record, submit, done) == {}  # no step of the run in every stage's timeline


def test_a_fed_back_step_is_timed_from_the_draw_it_takes(trip):
    """Step 6 takes the token step 5 drew on the last stage: its wait is the feedback hop (the
    last stage ends step 5 -> stage 0 starts step 6), not the driver's legs, and with most steps fed
    back the cycle is the stages, the hops and that hop."""
    us = 1e-6
    submit = {5: 0.0, 6: 50 * us}  # step 6 was submitted long before its token existed
    s0 = [Span(0, 5, 100 * us, 600 * us), Span(0, 6, 1280 * us, 1780 * us)]
    s1 = [Span(0, 5, 700 * us, 1200 * us), Span(0, 6, 1900 * us, 2400 * us)]
    done = {5: 1360 * us, 6: 2550 * us}
    record = SimpleNamespace(worker_stats=[SimpleNamespace(events=s0), SimpleNamespace(events=s1)])
    out = trip(5, record, submit, done, {6: 5, 9: 8})  # 9: not in the run's timeline, ignored
    assert out["feedback"] == pytest.approx(80.0)
    assert out["driver->0"] == pytest.approx(100.0)  # step 5 only: the driver fed it
    assert out["fed_back"] == 0.5
    assert out["driver turnaround"] is None  # no submission after either output
    assert out["cycle"] == pytest.approx(100 + 1000 + 110 + 155)  # half fed back: the driver's way
    out = trip(6, record, submit, done, {6: 5})
    assert out["fed_back"] == 1.0 and out["driver->0"] is None
    assert out["feedback"] == pytest.approx(80.0) and out["cycle"] == pytest.approx(500 + 500 + 120 + 80)
