"""A run's timeline: Chrome/Perfetto trace JSON and a PNG Gantt chart.

Trace layout (open in ui.perfetto.dev or chrome://tracing): one process row per stage with a
`compute` thread (one slice per micro-batch, "mb <seq>", replays marked with their epoch), and a
`driver` row where each micro-batch is an async slice from submit to completion, so queueing in the
window is visible. Times are microseconds from the first submit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tvmpipe.cluster.metrics import RunRecord
from tvmpipe.core import files

DRIVER_PID = 1000


def _events(rec: RunRecord) -> list[tuple[int, int, int, float, float]]:
    """(stage, epoch, seq, start, end) of every compute span, in seconds from the first submit."""
    t0 = rec.span[0]
    out = []
    for i, st in enumerate(rec.worker_stats):
        if st is not None:
            out += [(i, epoch, seq, a - t0, b - t0) for epoch, seq, a, b in st.events if a >= t0]
    return out


def trace(rec: RunRecord) -> dict[str, Any]:
    t0 = rec.span[0]
    ev: list[dict[str, Any]] = []
    for i, (start, end) in enumerate(rec.stages):
        host = rec.worker_stats[i].host if rec.worker_stats[i] else "?"
        name = f"stage {i} [{start},{end}) @ {host}"
        ev.append({"ph": "M", "name": "process_name", "pid": i, "args": {"name": name}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": i, "args": {"sort_index": i}})
        ev.append({"ph": "M", "name": "thread_name", "pid": i, "tid": 0, "args": {"name": "compute"}})
    for stage, epoch, seq, a, b in _events(rec):
        ev.append({"ph": "X", "name": f"mb {seq}" + (f" (epoch {epoch})" if epoch else ""), "cat": "compute",
                   "pid": stage, "tid": 0, "ts": a * 1e6, "dur": (b - a) * 1e6, "args": {"seq": seq, "epoch": epoch}})
    ev.append({"ph": "M", "name": "process_name", "pid": DRIVER_PID, "args": {"name": "driver"}})
    ev.append({"ph": "M", "name": "process_sort_index", "pid": DRIVER_PID, "args": {"sort_index": -1}})
    for seq, done in rec.done_times.items():
        common = {"name": f"mb {seq}", "cat": "in flight", "pid": DRIVER_PID, "tid": 0, "id": seq}
        ev.append({**common, "ph": "b", "ts": (rec.submit_times[seq] - t0) * 1e6})
        ev.append({**common, "ph": "e", "ts": (done - t0) * 1e6})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"restarts": rec.restarts, "errors": rec.errors}}


def write_trace(rec: RunRecord, path: str | Path) -> Path:
    """The trace JSON, written atomically (complete or absent)."""
    return files.write_text(path, json.dumps(trace(rec)))


def gantt_spans(rec: RunRecord) -> list[tuple[int, float, float, str]]:
    """(stage, start ms, end ms, label) per compute span; labels cycle so neighbours differ in colour."""
    return [(stage, a * 1e3, b * 1e3, f"mb {seq % 10}") for stage, _, seq, a, b in _events(rec)]


def write_gantt(rec: RunRecord, path: str | Path, title: str = "pipeline timeline") -> Path:
    from tvmpipe.partition.report import plot_gantt

    return plot_gantt(gantt_spans(rec), path, unit="ms", title=title)
