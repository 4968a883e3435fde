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
