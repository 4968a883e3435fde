"""What a plan should do on the pipeline: per-stage times and memory, throughput, latency, bubble.

Stage time = compute time / speed factor + link time of the bytes it receives (activations from
earlier stages, graph inputs from the driver). In steady state the slowest stage paces the
pipeline: throughput = batch / bottleneck. One request's latency is the sum of stage times plus
the link time of the graph outputs to the driver. The bubble is the fraction of stage-device time
spent idle: for M requests through K stages with times t_s and bottleneck B it is
1 - M*sum(t) / (K * (sum(t) + (M-1)*B)); as M grows it tends to 1 - mean(t)/B (imbalance alone).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tvmpipe.partition.cuts import stage_io
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.plan import Plan, validate_plan


@dataclass
class StagePrediction:
    stage: int
    start: int
    end: int
    ops: tuple[int, int]  # op-ordinal range [a, b)
    num_ops: int
    speed: float
    compute_us: float
    transfer_us: float
    time_us: float
    params_bytes: int
    memory_bytes: int
    memory_cap: int | None
    in_bytes: int  # received activations + graph inputs
    out_bytes: int  # sent to every later stage that reads them + graph outputs to the driver
    shared_params: list[str] = field(default_factory=list)  # params this stage loads that other stages load too

    @property
    def fits(self) -> bool:
        return self.memory_cap is None or self.memory_bytes <= self.memory_cap


@dataclass
class Prediction:
    strategy: str
    cost_model: str
    stages: list[StagePrediction]
    bottleneck_us: float
    throughput: float  # samples per second (batch / bottleneck)
    latency_us: float
    bubble: float  # steady-state idle fraction, or for `requests` requests when given
    bytes_moved: int  # sum of stage in_bytes
    requests: int | None = None

    @property
    def fits_memory(self) -> bool:
        return all(s.fits for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["fits_memory"] = self.fits_memory
        return d


def bubble_fraction(times_us: list[float], requests: int | None = None) -> float:
    """Idle fraction of K stage devices over a run of `requests` requests (None: steady state)."""
    if not times_us or max(times_us) <= 0:
        return 0.0
    k, total, b = len(times_us), sum(times_us), max(times_us)
    if requests is None:
        return 1.0 - total / (k * b)
    m = max(1, requests)
    return 1.0 - m * total / (k * (total + (m - 1) * b))


def predict(model: PipelineModel, plan: Plan, requests: int | None = None) -> Prediction:
    """Predict `plan` on `model`'s devices and link; the plan is validated against the graph first."""
    validate_plan(model.flow.graph, plan)
    k = plan.num_stages
    speeds, caps = model.stage_speeds(k), model.stage_caps(k)
    flow = model.flow
    ranges = [flow.op_range(s, e) for s, e in plan.stages]
    ios = [stage_io(flow, a, b) for a, b in ranges]
    loaders: dict[int, list[int]] = {}
    for s, io in enumerate(ios):
        for p in io.params:
            loaders.setdefault(p, []).append(s)
    stage_of_op = {op: s for s, (a, b) in enumerate(ranges) for op in range(a, b)}
    out_bytes = [0] * k
    for s, io in enumerate(ios):
        for e in io.recv:
            out_bytes[stage_of_op[flow.entries[e].producer]] += flow.entries[e].nbytes
        out_bytes[s] += io.nbytes(flow, "outputs")
    stages = []
    for s, ((start, end), (a, b), io) in enumerate(zip(plan.stages, ranges, ios)):
        t = model.tables
        compute = t.compute_us(a, b) / speeds[s]
        transfer = model.link.transfer_us(t.recv[a, b])
        shared = [flow.graph.nodes[flow.graph.entries[p].node].name for p in io.params if len(loaders[p]) > 1]
        stages.append(StagePrediction(
            stage=s, start=start, end=end, ops=(a, b), num_ops=b - a, speed=speeds[s], compute_us=compute,
            transfer_us=transfer, time_us=compute + transfer, params_bytes=int(t.params[a, b]),
            memory_bytes=model.stage_memory(a, b), memory_cap=caps[s], in_bytes=int(t.recv[a, b]),
            out_bytes=out_bytes[s], shared_params=shared))
    times = [st.time_us for st in stages]
    bottleneck = max(times)
    head_bytes = sum(flow.entries[e].nbytes for e in flow.graph.head_entries)
    return Prediction(
        strategy=plan.strategy, cost_model=model.costs.source, stages=stages, bottleneck_us=bottleneck,
        throughput=model.batch * 1e6 / bottleneck if bottleneck > 0 else float("inf"),
        latency_us=sum(times) + model.link.transfer_us(head_bytes), bubble=bubble_fraction(times, requests),
        bytes_moved=sum(st.in_bytes for st in stages), requests=requests)


def attach(plan: Plan, prediction: Prediction) -> Plan:
    """Record the prediction's summary in `plan.predicted`, the part that travels in the plan file."""
    plan.predicted = {
        "cost_model": prediction.cost_model,
        "bottleneck_us": prediction.bottleneck_us,
        "throughput": prediction.throughput,
        "latency_us": prediction.latency_us,
        "bubble": prediction.bubble,
        "bytes_moved": prediction.bytes_moved,
        "fits_memory": prediction.fits_memory,
        "stage_time_us": [s.time_us for s in prediction.stages],
        "stage_memory_bytes": [s.memory_bytes for s in prediction.stages],
    }
    return plan
