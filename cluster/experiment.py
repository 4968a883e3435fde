"""Measuring plans for `tvmpipe sweep`: repeated rounds, CPU time per process, runtime calibration.

A single run on a shared machine is one sample of a noisy process; a researcher needs to see the
spread. So each plan runs `rounds` times in one Pipeline (workers start once) and every round is
measured on its own: compute_metrics over that round's micro-batches only (its time span), plus the
CPU time each stage process and the driver spent in it, read from /proc where the workers are local
processes, plus the load average. Rounds are summarised as median, min and max.

Calibration measures the runtime itself (partition/runtime.py) with a 1-stage pipeline of the same
bundle, run before the plans. On the simulated backend every op time is 0 there, so what it measures
is receive, decode, Stage.run, encode, send and the driver, with the model's real frame sizes and
nothing of the model's compute: a workload no plan of the sweep runs. On the reference backend it
computes the real ops too, because ops run slower in a pipelining worker than in the single-process
profile and only such a run shows by how much; it then does the work of the 1-stage plan (other
inputs, its own process, earlier), so the K = 1 row checks the model's structure and the calibration's
repeatability, and rows with K >= 2 check the model.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from tvmpipe.cluster.metrics import PipelineMetrics, RunRecord, compute_metrics
from tvmpipe.cluster.status import WorkerStatus
from tvmpipe.partition.runtime import Calibration


@dataclass
class Round:
    metrics: PipelineMetrics
    stage_cpu_us: list[float] | None  # CPU per micro-batch of each stage process (None: not readable)
    driver_cpu_us: float
    load: float  # 1-minute load average at the end of the round
    record: RunRecord = field(repr=False)
    others_cores: float | None = None  # cores other processes (and the hypervisor) took during the round
    cores_busy: float | None = None  # cores the pipeline's own processes (stages + driver) kept busy

    @property
    def cpu_us(self) -> float | None:
        """CPU per micro-batch of the whole pipeline (stage processes + driver), or None if unreadable."""
        return None if self.stage_cpu_us is None else sum(self.stage_cpu_us) + self.driver_cpu_us

    @property
    def throughput(self) -> float:
        """Samples/s between the round's first and last completion (fill excluded)."""
        return self.metrics.steady_throughput * self.metrics.batch


@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over rounds."""

    rounds: int
    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(len(values), statistics.median(values), min(values), max(values))


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds a local process has spent, all its threads, or None when it cannot be read.

    From the kernel's CPU clock of the process (clock_gettime on its CPUCLOCK_SCHED clock id, in
    nanoseconds), because /proc/PID/stat counts clock ticks (10 ms): a calibration of 74
    micro-batches at ~60 us of runtime each is under one tick, and was read as 0 us per frame. The
    clock keeps the time of threads that have ended; a sum of the live threads' schedstat, used
    before, lost a thread's whole time when it ended between two readings (a 3 ms reading came out
    1.1 ms in a full test run). A thread on a CPU while it is read counts its time up to its last
    tick or switch (at most one tick short). Falls back to ticks where the clock cannot be read."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except (OSError, OverflowError):
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def machine_busy_s() -> float | None:
    """CPU seconds this machine has spent busy since boot, all cores, steal included (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def local_cores() -> int:
    """CPU cores this process may run on (what local stage processes and the driver share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _worker_pids(pipe: Any) -> list[int | None]:
    return [st.pid if isinstance(st, WorkerStatus) else None for st in pipe.status()]


def _slice(rec: RunRecord, seqs: range) -> RunRecord:
    """The record of micro-batches `seqs` only; worker spans are cut to their time span by compute_metrics."""
    return replace(rec, submit_times={s: rec.submit_times[s] for s in seqs if s in rec.submit_times},
                   done_times={s: rec.done_times[s] for s in seqs if s in rec.done_times})


WARMUP_MICRO_BATCHES = 100


def measure_rounds(pipe: Any, batches: list[dict[str, Any]], rounds: int, local: bool,
                   warmup: int = WARMUP_MICRO_BATCHES) -> list[Round]:
    """Run `batches` through `pipe` `rounds` times; one Round per pass. `local`: workers are processes
    of this machine, so their CPU time can be read from /proc. The first `warmup` micro-batches run once
    before, unmeasured: a fresh worker's first few hundred micro-batches compute up to 1.6x slower (first
    touches of its buffers; measured on examples/cnn: 600 vs 380 us per micro-batch over a first round)."""
    if warmup:
        pipe.run(batches[:warmup])
    pids = _worker_pids(pipe) if local else []
    out = []
    for r in range(rounds):
        first = pipe.submitted
        cpu0 = [process_cpu_s(p) if p else None for p in pids]
        m0, w0, d0 = machine_busy_s(), time.perf_counter(), time.process_time()
        pipe.run(batches)
        d1, w1, m1 = time.process_time(), time.perf_counter(), machine_busy_s()
        cpu1 = [process_cpu_s(p) if p else None for p in pids]
        n = len(batches)
        stage_cpu, others, busy = None, None, None
        if pids and all(a is not None and b is not None for a, b in zip(cpu0, cpu1)):
            stage_cpu = [(b - a) / n * 1e6 for a, b in zip(cpu0, cpu1)]
            ours = sum(b - a for a, b in zip(cpu0, cpu1)) + (d1 - d0)
            busy = ours / (w1 - w0) if w1 > w0 else None
            if m0 is not None and m1 is not None and w1 > w0:  # the machine's busy time that was not ours
                others = max(0.0, (m1 - m0 - ours) / (w1 - w0))
        rec = _slice(pipe.record(since=first), range(first, first + n))
        out.append(Round(compute_metrics(rec), stage_cpu, (d1 - d0) / n * 1e6, os.getloadavg()[0], rec, others, busy))
    return out


def calibration_of(rounds: list[Round]) -> Calibration:
    """The median round of a 1-stage zero-compute run as a Calibration."""
    mid = sorted(rounds, key=lambda r: r.throughput)[len(rounds) // 2]
    st = mid.metrics.stages[0]
    others = [r.others_cores for r in rounds if r.others_cores is not None]
    return Calibration(busy_us=(st.compute_ms_mean or 0.0) * 1e3,
                       stage_cpu_us=mid.stage_cpu_us[0] if mid.stage_cpu_us else None,
                       driver_cpu_us=mid.driver_cpu_us if mid.stage_cpu_us else None,
                       period_us=1e6 / mid.metrics.steady_throughput if mid.metrics.steady_throughput else 0.0,
                       others_cores=statistics.median(others) if others else None)


def spreads(rounds: list[Round]) -> dict[str, Spread]:
    """Throughput, latency p50/p99 (us), bubble and load over rounds; CPU per micro-batch and cores
    busy where every round could read them."""
    cpu = [r.cpu_us for r in rounds]
    cores = [r.cores_busy for r in rounds]
    readable = {"cpu_us": Spread.of(cpu)} if rounds and None not in cpu else {}
    if rounds and None not in cores:
        readable["cores_busy"] = Spread.of(cores)
    return readable | {"throughput": Spread.of([r.throughput for r in rounds]),
            "latency_p50_us": Spread.of([r.metrics.latency_p50_ms * 1e3 for r in rounds]),
            "latency_p99_us": Spread.of([r.metrics.latency_p99_ms * 1e3 for r in rounds]),
            "bubble": Spread.of([r.metrics.bubble or 0.0 for r in rounds]),
            "load": Spread.of([r.load for r in rounds])}


RunPlan = Callable[..., list[Round]]
