"""Measuring for `tvmpipe sweep` (cluster/experiment.py): CPU time of local processes."""

from __future__ import annotations

import os
import threading
import time

from tvmpipe.cluster.experiment import process_cpu_s


def _sleeping(tid: int) -> bool:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def _spin_in_a_thread_s() -> float:
    """process_cpu_s across a worker thread's 3 ms of CPU; the thread stays alive while read. It is
    read once the thread sleeps: the kernel adds a running thread's time to its schedstat at a tick
    or a switch, so a thread still on a CPU may read up to one tick short (4 ms at HZ=250: 1.1 ms of
    the 3 ms was read once when the thread was still on its way to waiting)."""
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:
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
        deadline = time.monotonic() + 5
        while not _sleeping(th.native_id) and time.monotonic() < deadline:
            time.sleep(0.001)
        after = process_cpu_s(os.getpid())
    finally:
        done.set()
        th.join()
    return after - before


def test_process_cpu_counts_threads_below_a_clock_tick():
    """A calibration reads per-micro-batch CPU of tens of us over a few ms of run: /proc/PID/stat's
    10 ms ticks read 3 ms of a worker thread's CPU as 0 or 10 ms; schedstat reads it as 3 ms.

    Every reading counts the 3 ms (none is lost); the closest of three is under one tick. One
    reading alone also counts whatever else the process ran meanwhile (pytest's threads from
    earlier tests, the machine's noise): 8.3 ms once on a loaded 2-core machine, where ticks would
    still read 0 or 10 ms every time."""
    spent = [_spin_in_a_thread_s() for _ in range(3)]
    assert min(spent) >= 0.003, spent
    assert min(spent) < 0.008, spent


def test_process_cpu_keeps_the_time_of_a_thread_that_ended():
    """A thread that spins 3 ms and ends between two readings still counts (the process's CPU
    clock keeps it; a sum of the live threads' schedstat dropped its whole time)."""
    go = threading.Event()

    def spin() -> None:
        t = time.thread_time()
        while time.thread_time() - t < 0.003:
            pass
        go.wait(10)

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)  # it has spun and waits
    before = process_cpu_s(os.getpid())
    go.set()
    th.join()
    after = process_cpu_s(os.getpid())
    assert before >= 0.003 and after >= before, (before, after)
