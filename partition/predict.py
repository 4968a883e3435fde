"""What a plan should do on the pipeline: per-stage times and memory, throughput, latency, bubble.

Per stage (runtime.py has the why): busy = compute / speed + the runtime's fixed Stage.run cost;
cycle = link time of the bytes it receives + max(busy + receives, its CPU time). The pipeline's
period is the largest of: the slowest stage's cycle (the bottleneck), the driver's cycle, the total
CPU per micro-batch over the shared cores (when stage processes + driver outnumber them, the run is
CPU-bound and `cpu_bound` says so), and one micro-batch's latency over the window. Throughput =
batch / period. One request's latency is the longest path through the stages (a stage starts once
every stage it reads from has sent) of link time, receive, busy and send, after the driver's work,
plus the link time of the graph outputs to the driver.

The bubble is the fraction of stage-device time not spent busy, as the cluster measures it: for M
requests the run lasts latency + (M-1) x period, and stage s is busy M x busy_s of it; as M grows it
tends to 1 - mean(busy) / period. With no runtime costs this is the imbalance alone.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tvmpipe.partition.cuts import plan_io
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
    time_us: float  # the stage's cycle: what it can sustain between micro-batches
    params_bytes: int
    memory_bytes: int
    memory_cap: int | None
    in_bytes: int  # received activations + graph inputs
    out_bytes: int  # sent to every later stage that reads them + graph outputs to the driver
    shared_params: list[str] = field(default_factory=list)  # params this stage loads that other stages load too
    frames_in: int = 1  # producers sending to it per micro-batch (earlier stages, the driver)
    frames_out: int = 1  # consumers it sends to (later stages, the driver)
    busy_us: float = 0.0  # what its worker records as compute
    cpu_us: float = 0.0  # host CPU per micro-batch

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
    period_us: float = 0.0  # interval between completions: max(bottleneck, driver, CPU share, latency / window)
    limit: str = "stage"  # what sets the period: "stage" | "driver" | "cpu" | "window"
    driver_us: float = 0.0  # the driver's cycle per micro-batch (wall time)
    driver_cpu_us: float = 0.0  # the driver's CPU time per micro-batch
    cpu_demand: float = 0.0  # CPU cores busy at the predicted throughput (stages + driver)
    processes: int = 1  # stage processes + the driver
    cores: int | None = None
    runtime: str = "none"  # RuntimeCosts.source
    cores_free: float | None = None  # of `cores`, what other processes left (measured; RuntimeCosts.cores_free)
    host_cpu: bool = False  # the runtime models host CPU (costs or shared cores); the ideal runtime does not

    @property
    def cpu_bound(self) -> bool:
        """More processes than cores, and the shared CPU sets the pace: predictions then assume an
        even share of the cores, which a loaded or differently scheduled machine will not give."""
        return self.cores is not None and self.processes > self.cores and self.limit == "cpu"

    @property
    def oversubscribed(self) -> bool:
        return self.cores is not None and self.processes > self.cores

    @property
    def fits_memory(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def cpu_us(self) -> float:
        """Host CPU per micro-batch of the whole pipeline: every stage process plus the driver."""
        return sum(s.cpu_us for s in self.stages) + self.driver_cpu_us

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["fits_memory"] = self.fits_memory
        d["cpu_bound"] = self.cpu_bound
        d["cpu_us"] = self.cpu_us
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
    """Predict `plan` on `model`'s devices, links and runtime; the plan is validated against the graph first."""
    validate_plan(model.flow.graph, plan)
    k = plan.num_stages
    speeds, caps, links = model.stage_speeds(k), model.stage_caps(k), model.stage_links(k)
    rt = model.runtime
    flow = model.flow
    ranges = [flow.op_range(s, e) for s, e in plan.stages]
    ios = plan_io(flow, ranges)
    loaders: dict[int, list[int]] = {}
    for s, io in enumerate(ios):
        for p in io.params:
            loaders.setdefault(p, []).append(s)
    stage_of_op = {op: s for s, (a, b) in enumerate(ranges) for op in range(a, b)}
    out_bytes = [0] * k
    senders: list[set[int]] = [set() for _ in range(k)]  # producer stages (-1: the driver) per stage
    frames: list[dict[int, int]] = [{} for _ in range(k)]  # per stage: bytes of its frame to each consumer (-1: driver)
    for s, io in enumerate(ios):
        for e in io.recv:
            producer = stage_of_op[flow.entries[e].producer]
            out_bytes[producer] += flow.entries[e].nbytes
            frames[producer][s] = frames[producer].get(s, 0) + flow.entries[e].nbytes
            senders[s].add(producer)
        if io.inputs:
            senders[s].add(-1)
        out_bytes[s] += io.nbytes(flow, "outputs")
        if io.outputs:
            frames[s][-1] = io.nbytes(flow, "outputs")
    receivers = [sum(1 for r in senders if s in r) + (1 if ios[s].outputs else 0) for s in range(k)]
    stages = []
    t = model.tables
    for s, ((start, end), (a, b), io) in enumerate(zip(plan.stages, ranges, ios)):
        compute = t.compute_us(a, b) / speeds[s]
        transfer = links[s].transfer_us(t.recv[a, b])
        fin, fout = len(senders[s]), receivers[s]
        shared = [flow.graph.nodes[flow.graph.entries[p].node].name for p in io.params if len(loaders[p]) > 1]
        stages.append(StagePrediction(
            stage=s, start=start, end=end, ops=(a, b), num_ops=b - a, speed=speeds[s], compute_us=compute,
            transfer_us=transfer,
            time_us=float(rt.stage_cycle_us(compute, transfer, fin, fout, rt.inline_frames(list(frames[s].values())))),
            params_bytes=int(t.params[a, b]), memory_bytes=model.stage_memory(a, b), memory_cap=caps[s],
            in_bytes=int(t.recv[a, b]), out_bytes=out_bytes[s], shared_params=shared, frames_in=fin, frames_out=fout,
            busy_us=float(rt.busy_us(compute)), cpu_us=float(rt.stage_cpu_us(compute, fin, fout))))
    bottleneck = max(st.time_us for st in stages)
    driver_frames = (sum(1 for r in senders if -1 in r), sum(1 for io in ios if io.outputs))
    driver = rt.driver_cycle_us(*driver_frames)
    driver_cpu = rt.driver_cpu_us(*driver_frames)
    head_bytes = sum(flow.entries[e].nbytes for e in flow.graph.head_entries)
    finish: list[float] = []  # one micro-batch alone: when each stage has sent it (longest path over stages)
    for s, st in enumerate(stages):
        ready = max([finish[p] for p in senders[s] if p >= 0] + [driver if -1 in senders[s] else 0.0])
        finish.append(ready + st.transfer_us + st.frames_in * rt.recv_us + st.busy_us + st.frames_out * rt.send_us)
    outputs = [finish[s] for s, io in enumerate(ios) if io.outputs]
    latency = max(max(outputs, default=0.0) + links[-1].transfer_us(head_bytes), max(finish))
    cpu_total = sum(st.cpu_us for st in stages) + driver_cpu
    window = rt.window or 2 * k
    bounds = {"stage": bottleneck, "driver": driver, "window": latency / window}
    if rt.cpu_cores is not None:
        bounds["cpu"] = cpu_total / rt.cpu_cores
    limit = max(bounds, key=lambda key: bounds[key])
    period = bounds[limit]
    busy = [st.busy_us for st in stages]
    if period <= 0:
        bubble = 0.0
    elif requests is None:
        bubble = 1.0 - sum(busy) / (k * period)
    else:
        m = max(1, requests)
        bubble = 1.0 - m * sum(busy) / (k * (latency + (m - 1) * period))
    return Prediction(
        strategy=plan.strategy, cost_model=model.costs.source, stages=stages, bottleneck_us=bottleneck,
        throughput=model.batch * 1e6 / period if period > 0 else float("inf"),
        latency_us=latency, bubble=max(0.0, bubble), bytes_moved=sum(st.in_bytes for st in stages),
        requests=requests, period_us=period, limit=limit, driver_us=driver, driver_cpu_us=driver_cpu,
        cpu_demand=cpu_total / period if period > 0 else 0.0, processes=k + 1, cores=rt.cores, runtime=rt.source,
        cores_free=rt.cores_free, host_cpu=not rt.is_zero or rt.cores is not None)


def attach(plan: Plan, prediction: Prediction) -> Plan:
    """Record the prediction's summary in `plan.predicted`, the part that travels in the plan file."""
    plan.predicted = {
        "cost_model": prediction.cost_model,
        "bottleneck_us": prediction.bottleneck_us,
        "period_us": prediction.period_us,
        "limit": prediction.limit,
        "throughput": prediction.throughput,
        "latency_us": prediction.latency_us,
        "bubble": prediction.bubble,
        "bytes_moved": prediction.bytes_moved,
        "fits_memory": prediction.fits_memory,
        "stage_time_us": [s.time_us for s in prediction.stages],
        "stage_memory_bytes": [s.memory_bytes for s in prediction.stages],
    }
    return plan
