"""tvmpipe.cluster: run a bundle as a pipeline of stage workers, on Ray or in local processes.

    from tvmpipe.cluster import Pipeline
    with Pipeline("examples/mlp", 2, launcher="ray") as pipe:    # after ray.init(), or launcher="process"
        outputs = pipe.run([{"x": x0}, {"x": x1}])

Modules: frames (wire format), transport (sockets), topology (edges), worker (StageWorker),
status (what a worker reports), control (launchers, process workers, timeouts), environment
(worker processes' variables), actor (StageActor, RayLauncher), placement, driver (Pipeline),
metrics, timeline, local (loopback Ray).

The names below are imported on first use (PEP 562), so importing one light module of this
package (placement, local) from the CLI does not pay for the whole layer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Pipeline": "driver", "PipelineError": "driver",
    "Timeouts": "control", "WorkerError": "control", "WorkerLost": "control", "ProcessLauncher": "control",
    "Placement": "placement", "PlacementError": "placement",
    "StageSpec": "worker", "StageWorker": "worker",
    "WorkerStatus": "status", "WorkerStats": "status", "Span": "status",
    "RunRecord": "metrics", "PipelineMetrics": "metrics", "StageMetrics": "metrics", "compute_metrics": "metrics",
    "trace": "timeline", "write_trace": "timeline", "write_gantt": "timeline",
    "local_ray": "local",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tvmpipe.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tvmpipe.cluster.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
