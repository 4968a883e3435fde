"""What a pipeline run did, in numbers: throughput, latency, per-stage busy/bubble/idle, bytes per edge.

The raw material is a `RunRecord`: the driver's submit/complete times per micro-batch and each
worker's compute spans and byte counters. All times are wall-clock seconds (`time.time()`), the
only clock that means the same thing on every node of a cluster. A long-running pipeline keeps the
timings of its newest TIMELINE_KEPT micro-batches, so the numbers describe those.

Per stage, over the run's span [first submit, last completion]:
- busy: fraction spent computing;
- bubble: fraction before the stage's first micro-batch started and after its last one ended
  (pipeline fill and drain);
- idle: the rest, waiting between micro-batches in steady state (an unbalanced plan, or transport).
busy + bubble + idle = 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tvmpipe.cluster.wire.frames import DRIVER
from tvmpipe.core.table import Column, render_table
from tvmpipe.core.units import format_bytes
from tvmpipe.cluster.status import WorkerStats

TIMELINE_KEPT = 100_000  # micro-batches of timing kept (driver and each worker): bounded memory


@dataclass
class RunRecord:
    stages: list[tuple[int, int]]  # node ranges
    ops: list[int]  # op nodes per stage
    batch: int
    submit_times: dict[int, float]
    done_times: dict[int, float]
    worker_stats: list[WorkerStats | None]  # StageWorker.stats(), None where unavailable
    edges: list[tuple[int, int, int]]  # (src, dst, planned bytes per micro-batch)
    driver_bytes_out: dict[int, int]
    driver_frames_out: dict[int, int]
    restarts: list[int]
    errors: list[str]

    @property
    def span(self) -> tuple[float, float]:
        done = [self.done_times[s] for s in self.done_times]
        if not done:
            return 0.0, 0.0
        return min(self.submit_times[s] for s in self.done_times), max(done)


@dataclass
class StageMetrics:
    stage: int
    nodes: tuple[int, int]
    ops: int
    host: str | None
    micro_batches: int
    compute_ms_mean: float | None
    busy: float | None
    bubble: float | None
    idle: float | None
    bytes_out: int | None
    build_s: float | None
    weight_bytes: int | None = None  # the stage's own params, resident in its worker
    state_bytes: int | None = None  # its declared state (KV caches) resident, for the slots used


@dataclass
class EdgeMetrics:
    src: int  # -1: the driver
    dst: int
    bytes_per_micro_batch: int
    bytes: int | None  # on the wire, frame headers included
    frames: int | None


@dataclass
class PipelineMetrics:
    micro_batches: int
    batch: int
    wall_s: float
    throughput: float  # micro-batches/s over the whole run (fill and drain included)
    steady_throughput: float  # micro-batches/s between the first and the last completion
    samples_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    stages: list[StageMetrics] = field(default_factory=list)
    edges: list[EdgeMetrics] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def bubble(self) -> float | None:
        """Mean idle fraction of the stages (bubble + steady-state idle), as the partition layer
        predicts it."""
        vals = [1.0 - s.busy for s in self.stages if s.busy is not None]
        return float(np.mean(vals)) if vals else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["bubble"] = self.bubble
        return d

    def table(self) -> str:
        """One row per stage: where it ran, how its time splits, what it sent."""
        rows = [(str(s.stage), f"[{s.nodes[0]}, {s.nodes[1]})", str(s.ops), s.host or "-", _pct(s.busy),
                 _pct(s.bubble), _pct(s.idle), "-" if s.compute_ms_mean is None else f"{s.compute_ms_mean:.3f}",
                 "-" if s.bytes_out is None else format_bytes(s.bytes_out),
                 "-" if s.weight_bytes is None else format_bytes(s.weight_bytes)) for s in self.stages]
        columns = STAGE_COLUMNS
        if any(s.state_bytes for s in self.stages):  # a decode pipeline: its caches, stage by stage
            columns += ("state resident",)
            rows = [r + ("-" if s.state_bytes is None else format_bytes(s.state_bytes),)
                    for r, s in zip(rows, self.stages)]
        return "\n".join(render_table([Column(t) for t in columns], rows))


# per micro-batch (mean over the run) vs totals over the whole run: say which in the header
STAGE_COLUMNS = ("stage", "nodes", "ops", "host", "busy %", "bubble %", "idle %", "ms/mb (mean)",
                 "bytes out (total)", "weights resident")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def compute_metrics(rec: RunRecord) -> PipelineMetrics:
    n = len(rec.done_times)
    t0, t1 = rec.span
    wall = max(t1 - t0, 1e-9)
    done = sorted(rec.done_times.values())
    lat = np.array([rec.done_times[s] - rec.submit_times[s] for s in rec.done_times]) * 1e3
    steady = (n - 1) / (done[-1] - done[0]) if n > 1 and done[-1] > done[0] else 0.0
    stages = []
    for i, ((start, end), ops) in enumerate(zip(rec.stages, rec.ops)):
        st = rec.worker_stats[i] if i < len(rec.worker_stats) else None
        if st is None:
            stages.append(StageMetrics(i, (start, end), ops, None, 0, None, None, None, None, None, None))
            continue
        spans = [(a, b) for _, _, a, b in st.events if b >= t0 and a <= t1]
        busy = sum(min(b, t1) - max(a, t0) for a, b in spans)
        if spans:
            fill_drain = max(0.0, min(a for a, _ in spans) - t0) + max(0.0, t1 - max(b for _, b in spans))
        else:
            fill_drain = wall
        stages.append(StageMetrics(
            i, (start, end), ops, st.host, len(spans),
            float(np.mean([b - a for a, b in spans]) * 1e3) if spans else None,
            busy / wall, fill_drain / wall, max(0.0, 1.0 - (busy + fill_drain) / wall),
            sum(st.bytes_out.values()), st.build_s, getattr(st, "weight_bytes", None), getattr(st, "state_bytes", None)))
    edges = []
    for src, dst, planned in rec.edges:
        if src == DRIVER:
            sent, frames = rec.driver_bytes_out.get(dst, 0), rec.driver_frames_out.get(dst, 0)
        elif rec.worker_stats[src] is not None:
            st = rec.worker_stats[src]
            sent, frames = st.bytes_out.get(dst, 0), st.frames_out.get(dst, 0)
        else:
            sent = frames = None
        edges.append(EdgeMetrics(src, dst, planned, sent, frames))
    return PipelineMetrics(
        micro_batches=n, batch=rec.batch, wall_s=t1 - t0, throughput=n / wall if n else 0.0,
        steady_throughput=steady, samples_per_s=rec.batch * n / wall if n else 0.0,
        latency_p50_ms=float(np.percentile(lat, 50)) if n else 0.0,
        latency_p99_ms=float(np.percentile(lat, 99)) if n else 0.0,
        stages=stages, edges=edges, restarts=list(rec.restarts), errors=list(rec.errors))
