"""Measuring for `tvmpipe sweep` (cluster/experiment.py): CPU time of local processes."""

from __future__ import annotations

import os
import threading
import time

from tvmpipe.cluster.experiment import process_cpu_s


def test_process_cpu_counts_threads_below_a_clock_tick():
    """A calibration reads per-micro-batch CPU of tens of us over a few ms of run: /proc/PID/stat's
    10 ms ticks read 3 ms of a worker thread's CPU as 0 or 10 ms; schedstat reads it as 3 ms."""
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:  # a worker thread: it stays alive while the caller reads
        t = time.thread_time()
        while time.thread_time() - t < 0.003:
            pass
        spun.set()
        done.wait(10)

    before = process_cpu_s(os.getpid())
    th = threading.Thread(target=spin)
    th.start()
    try:
        assert spun.wait(10)
        after = process_cpu_s(os.getpid())
    finally:
        done.set()
        th.join()
    assert 0.003 <= after - before < 0.008, after - before
