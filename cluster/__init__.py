"""tvmpipe.cluster: run a bundle as a pipeline of stage workers, on Ray or in local processes.

    from tvmpipe.cluster import Pipeline
    with Pipeline("examples/mlp", 2, launcher="ray") as pipe:    # after ray.init(), or launcher="process"
        outputs = pipe.run([{"x": x0}, {"x": x1}])

Modules, from the top:
  driver      Pipeline: the schedule (a window of micro-batches in flight, results in order),
              supervision and recovery (restart, re-wire under a new epoch, replay)
  experiment  measurement rounds of a running pipeline (what `tvmpipe sweep` reports)
  linkprobe   a link's latency and bandwidth, measured through the data plane
  timeline    Chrome/Perfetto traces and Gantt charts of a run
  control/    the control plane: launchers (processes, Ray actors), placement, shipping, local Ray
  worker      StageWorker: one stage, its inbound and outbound edges, its part in decoding
  topology    who sends what to whom: edges derived once from the plan's stage programs
  metrics     RunRecord and the per-stage numbers computed from it
  status      what a worker reports (WorkerStatus, WorkerStats, Span, Progress)
  wire/       the data plane: frame codec, stream, handshake, TCP, shared memory, CUDA IPC

The names below are imported on first use (PEP 562), so importing one light module of this
package (control.placement, control.local) from the CLI does not pay for the whole layer.
"""

from __future__ import annotations

from tvmpipe.core.lazy import lazy_exports

_EXPORTS = {
    "Pipeline": "driver", "PipelineError": "driver",
    "StepResult": "driver",
    "Timeouts": "control.launchers", "WorkerError": "control.launchers", "WorkerLost": "control.launchers",
    "ProcessLauncher": "control.launchers", "RayLauncher": "control.ray_actors",
    "Placement": "control.placement", "PlacementError": "control.placement",
    "StageSpec": "worker", "StageWorker": "worker",
    "WorkerStatus": "status", "WorkerStats": "status", "Span": "status",
    "RunRecord": "metrics", "PipelineMetrics": "metrics", "StageMetrics": "metrics", "compute_metrics": "metrics",
    "trace": "timeline", "write_trace": "timeline", "write_gantt": "timeline",
    "local_ray": "control.local",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
