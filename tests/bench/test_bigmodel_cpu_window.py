"""bench/bigmodel.py's account of how busy the machine was while the stages started: the CPU it
reports for a window is that of the samples inside it, not of the whole run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bigmodel():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bigmodel

        yield bigmodel
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_cpu_between_counts_only_the_samples_inside_the_window(bigmodel):
    hz = os.sysconf("SC_CLK_TCK")
    # (wall clock, busy ticks, all ticks) on a 2-core machine sampled every second: idle, then both
    # cores busy from t = 11 to t = 13, then idle again
    samples = [(10.0, 0, 0), (11.0, 0, 2 * hz), (12.0, 2 * hz, 4 * hz), (13.0, 4 * hz, 6 * hz), (14.0, 4 * hz, 8 * hz)]
    assert bigmodel.cpu_between(samples, 11.0, 13.0) == (4.0, 1.0)
    assert bigmodel.cpu_between(samples, 10.0, 14.0) == (4.0, 0.5)
    assert bigmodel.cpu_between(samples, 10.5, 12.5) == (2.0, 1.0)  # from the first sample inside
    assert bigmodel.cpu_between(samples, 12.2, 12.8) is None  # no two samples inside


def test_machine_jiffies_grow_with_work(bigmodel):
    busy0, all0 = bigmodel._machine_jiffies()
    x = 0
    for i in range(3_000_000):
        x += i
    busy1, all1 = bigmodel._machine_jiffies()
    assert all1 >= all0 and busy1 > busy0 and busy1 - busy0 <= all1 - all0
