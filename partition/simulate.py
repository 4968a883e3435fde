"""A discrete-event run of a predicted plan: micro-batch by micro-batch, stage by stage.

What-if clusters (hardware.py) have no hardware to run on, and 64 stage processes on a laptop would
measure the laptop. This simulator replays the pipeline's mechanics instead, from the same per-stage
figures the prediction uses (busy, cycle, link time, runtime costs), so a sweep over a described
cluster gets a run record in milliseconds. It is an independent check of the closed form in
predict.py: it schedules every micro-batch through a recurrence of who waits for whom (window,
driver, each stage as a resource, producers of each stage, the cores as a shared CPU pool), where
predict.py takes a maximum of rates. The two must agree within fill and drain effects.

Stage s serves micro-batch m from start = max(inputs arrived, stage free); it is busy from start +
transfer + receives for busy_us, its output is sent send_us later, and it is free again cycle_us
after start. The driver submits m when the window admits it (m - window completed) and the driver is
free; m completes when every output frame has reached the driver and every stage has finished it
(queues are bounded, so even a stage whose output nobody reads paces its producers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tvmpipe.partition.cuts import plan_io
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.plan import Plan
from tvmpipe.partition.predict import Prediction, predict


@dataclass
class SimulatedRun:
    """The schedule of M micro-batches: times in microseconds from the first submit."""

    submit_us: np.ndarray  # (M,)
    done_us: np.ndarray  # (M,)
    busy: list[list[tuple[float, float]]]  # per stage, (start, end) of each micro-batch's compute
    batch: int = 1
    prediction: Prediction | None = field(default=None, repr=False)

    @property
    def wall_us(self) -> float:
        return float(self.done_us[-1] - self.submit_us[0])

    @property
    def steady_throughput(self) -> float:
        """Samples/s between the first and the last completion (as the cluster measures it)."""
        m = len(self.done_us)
        span = self.done_us[-1] - self.done_us[0]
        return self.batch * (m - 1) * 1e6 / span if m > 1 and span > 0 else 0.0

    @property
    def latency_p50_us(self) -> float:
        return float(np.percentile(self.done_us - self.submit_us, 50))

    @property
    def latency_p99_us(self) -> float:
        return float(np.percentile(self.done_us - self.submit_us, 99))

    def utilisation(self) -> list[tuple[float, float, float]]:
        """Per stage (busy, bubble, idle) fractions of the run, as cluster/metrics.py defines them."""
        t0, t1 = float(self.submit_us[0]), float(self.done_us[-1])
        wall = max(t1 - t0, 1e-12)
        out = []
        for spans in self.busy:
            busy = sum(b - a for a, b in spans)
            fill_drain = (spans[0][0] - t0) + (t1 - spans[-1][1]) if spans else wall
            out.append((busy / wall, fill_drain / wall, max(0.0, 1 - (busy + fill_drain) / wall)))
        return out

    def spans(self) -> list[tuple[int, float, float, int]]:
        """(stage, start us, end us, micro-batch) of every compute span, for a Gantt chart."""
        return [(s, a, b, m) for s, spans in enumerate(self.busy) for m, (a, b) in enumerate(spans)]

    @property
    def bubble(self) -> float:
        u = self.utilisation()
        return float(np.mean([1 - b for b, _, _ in u])) if u else 0.0


def simulate(model: PipelineModel, plan: Plan, micro_batches: int, prediction: Prediction | None = None) -> SimulatedRun:
    """Run `plan` through the event recurrence for `micro_batches` micro-batches (`prediction`: the
    plan's, for its per-stage figures, if already made)."""
    pred = prediction if prediction is not None else predict(model, plan, micro_batches)
    rt = model.runtime
    k, n = len(pred.stages), max(1, micro_batches)
    window = rt.window or 2 * k
    flow = model.flow
    ios = plan_io(flow, [st.ops for st in pred.stages])
    stage_of_op = {op: s for s, io in enumerate(ios) for op in io.ops}
    producers = [{stage_of_op[flow.entries[e].producer] for e in io.recv} for io in ios]
    reads_inputs = [bool(io.inputs) for io in ios]
    outputs_from = [s for s, io in enumerate(ios) if io.outputs]
    head_bytes = sum(flow.entries[e].nbytes for e in flow.graph.head_entries)
    head_link = model.stage_links(k)[-1].transfer_us(head_bytes)
    cpu_per_mb = pred.cpu_us
    submit, done = np.zeros(n), np.zeros(n)
    out = np.zeros((k, n))  # when stage s's frame for m has been sent
    free = np.zeros(k)
    driver_free = cpu_free = 0.0
    busy: list[list[tuple[float, float]]] = [[] for _ in range(k)]
    for m in range(n):
        t = driver_free if m < window else max(driver_free, done[m - window])
        submit[m] = t
        driver_free = t + pred.driver_us
        for s, st in enumerate(pred.stages):
            ready = max([out[p, m] for p in producers[s]] + [driver_free if reads_inputs[s] else t])
            start = max(ready, free[s])
            compute_start = start + st.transfer_us + st.frames_in * rt.recv_us
            busy[s].append((compute_start, compute_start + st.busy_us))
            out[s, m] = compute_start + st.busy_us + st.frames_out * rt.send_us
            free[s] = start + st.time_us
        finished = max(out[s, m] for s in outputs_from) + head_link if outputs_from else driver_free
        # bounded queues: a stage whose frames nobody waits for still holds its producers back, so
        # m counts as done (for the window) once every stage has finished it
        finished = max(finished, out[:, m].max())
        if rt.cpu_cores is not None:  # the cores as one pool: a micro-batch needs cpu_per_mb of it
            cpu_free = max(cpu_free, submit[m]) + cpu_per_mb / rt.cpu_cores
            finished = max(finished, cpu_free)
        done[m] = max(finished, done[m - 1] if m else 0.0)
    return SimulatedRun(submit, done, busy, model.batch, pred)
