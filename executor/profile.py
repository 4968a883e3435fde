"""Per-node and per-kernel timings, shown like TVM's debug executor, as JSON, and as a Chrome trace.

The JSON form is also the input of the simulated backend's cost model (`nodes[*].time_us` keyed by
node index), so a profile taken on a GPU machine can drive pipeline experiments on CPU machines.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from tvmpipe.bundle import Bundle
from tvmpipe.core.table import Column, render_table
from tvmpipe.executor.backend import StepTiming
from tvmpipe.executor.program import KERNELS, StageProgram

PROFILE_COLUMNS = ("Node", "Name", "Ops", "Time(us)", "Time(%)", "Output shape", "Kernels")


@dataclass
class KernelTime:
    kernel: str
    time_us: float  # mean over repetitions


@dataclass
class NodeTime:
    node: int
    name: str
    func: str
    ops: list[str]  # the model ops fused into this node (ops.json)
    inputs: list[str]  # "float32[1, 784]" per input entry
    outputs: list[str]
    time_us: float  # mean over repetitions
    min_us: float
    kernels: list[KernelTime] = field(default_factory=list)


@dataclass
class Profile:
    model: str
    backend: str
    repeat: int
    run_us: float  # mean wall time of a whole Stage.run (copies in and out included)
    run_min_us: float
    nodes: list[NodeTime]

    @property
    def node_total_us(self) -> float:
        return sum(n.time_us for n in self.nodes)

    @property
    def kernel_total_us(self) -> float:
        return sum(k.time_us for n in self.nodes for k in n.kernels)

    def to_json(self) -> dict[str, Any]:
        return {"format": "tvmpipe-profile", "version": 1, "model": self.model, "backend": self.backend,
                "repeat": self.repeat, "run_us": self.run_us, "run_min_us": self.run_min_us,
                "node_total_us": self.node_total_us, "kernel_total_us": self.kernel_total_us,
                "nodes": [asdict(n) for n in self.nodes]}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> "Profile":
        nodes = [NodeTime(**{**n, "kernels": [KernelTime(**k) for k in n.get("kernels", [])]}) for n in obj["nodes"]]
        return Profile(obj["model"], obj["backend"], obj["repeat"], obj["run_us"], obj["run_min_us"], nodes)

    def table(self) -> str:
        total = self.node_total_us or 1.0
        columns = [Column(title, max_width=48) for title in PROFILE_COLUMNS]
        rows = [(str(n.node), n.name, ",".join(n.ops) or n.func, f"{n.time_us:.2f}", f"{100 * n.time_us / total:.1f}",
                 ", ".join(n.outputs), str(len(n.kernels)) if n.kernels else "-") for n in self.nodes]
        lines = render_table(columns, rows, rule=True)
        lines.append("")
        lines.append(f"{self.model} on {self.backend}, {self.repeat} run(s): run() mean {self.run_us:.1f} us "
                     f"(min {self.run_min_us:.1f}); nodes sum {self.node_total_us:.1f} us"
                     + (f"; kernels sum {self.kernel_total_us:.1f} us" if any(n.kernels for n in self.nodes) else ""))
        return "\n".join(lines)

    def chrome_trace(self) -> dict[str, Any]:
        """Trace Event Format (chrome://tracing, ui.perfetto.dev): nodes on one track, their kernels
        on a second, laid end to end with mean durations."""
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "graph nodes"}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "kernels"}},
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{self.model} ({self.backend})"}},
        ]
        t = 0.0
        for n in self.nodes:
            events.append({"name": n.name, "cat": "node", "ph": "X", "ts": t, "dur": n.time_us, "pid": 0, "tid": 0,
                           "args": {"node": n.node, "func": n.func, "ops": n.ops, "inputs": n.inputs, "outputs": n.outputs}})
            k_t = t
            for k in n.kernels:
                events.append({"name": k.kernel, "cat": "kernel", "ph": "X", "ts": k_t, "dur": k.time_us,
                               "pid": 0, "tid": 1, "args": {"node": n.node}})
                k_t += k.time_us
            t += n.time_us
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def build_profile(bundle: Bundle, program: StageProgram, backend: str,
                  reps: Sequence[Sequence[StepTiming]], run_seconds: Sequence[float]) -> Profile:
    """Average per-step timings over repetitions and attach each node's fused ops and shapes."""
    nodes = []
    for i, s in enumerate(program.steps):
        times = [r[i].seconds * 1e6 for r in reps]
        kernels = []
        if reps and reps[0][i].kernels:
            for k, (sym, _) in enumerate(reps[0][i].kernels):
                kernels.append(KernelTime(sym, statistics.fmean(r[i].kernels[k][1] * 1e6 for r in reps)))
        fn = bundle.ops.get(s.func) if s.kind == KERNELS else None
        nodes.append(NodeTime(node=s.node, name=s.name, func=s.func, ops=fn.op_names if fn else [],
                              inputs=[str(program.entry_specs[e]) for e in s.inputs],
                              outputs=[str(program.entry_specs[e]) for e in s.outputs],
                              time_us=statistics.fmean(times) if times else 0.0, min_us=min(times, default=0.0),
                              kernels=kernels))
    run_us = [t * 1e6 for t in run_seconds]
    return Profile(model=bundle.name, backend=backend, repeat=len(reps),
                   run_us=statistics.fmean(run_us) if run_us else 0.0, run_min_us=min(run_us, default=0.0), nodes=nodes)
