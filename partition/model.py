"""Everything a planner weighs, in one object: the graph's dataflow, op times, devices, links, runtime.

Built once per planning request; planners and predictions only read it. Stage s of a plan runs on
device s: `speeds[s]` divides its compute time (1 = the device the op times are for),
`memory_caps[s]` bounds its memory, and `links[s]` is the link its inbound frames cross (from the
device before it; for stage 0, from the driver's host). A single speed, cap or link applies to every
stage; per-stage lists longer than the plan are cut to its length, so one device list (a cluster
description, hardware.py) serves a sweep over stage counts. `runtime` holds what the pipeline
runtime itself costs per micro-batch (runtime.py).
"""

from __future__ import annotations

import numpy as np

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvmpipe.bundle import Bundle
from tvmpipe.partition.cost import (UNIFORM_OP_US, OpCosts, analytic_costs, measured_costs, read_profile,
                                    uniform_costs, workspace_bytes)
from tvmpipe.partition.cuts import GraphFlow
from tvmpipe.partition.devices import DeviceSpec, Link, get_device
from tvmpipe.partition.errors import PartitionError
from tvmpipe.partition.range_tables import RangeTables
from tvmpipe.partition.runtime import NO_RUNTIME, RuntimeCosts

COST_MODELS = ("auto", "measured", "analytic", "uniform")


@dataclass
class PipelineModel:
    bundle: Bundle
    flow: GraphFlow
    costs: OpCosts
    tables: RangeTables
    link: Link = field(default_factory=Link)
    speeds: list[float] = field(default_factory=lambda: [1.0])
    memory_caps: list[int | None] = field(default_factory=lambda: [None])
    device: DeviceSpec | None = None
    links: list[Link] | None = None  # per stage (inbound link); None: `link` for every stage
    runtime: RuntimeCosts = NO_RUNTIME

    @classmethod
    def build(cls, bundle: Bundle, *, cost: str = "auto", profile: str | Path | dict[str, Any] | None = None,
              device: str | DeviceSpec = "h100", link: Link | None = None, speeds: list[float] | None = None,
              memory_caps: list[int | None] | None = None, inputs: list[str] | None = None,
              uniform_op_us: float = UNIFORM_OP_US, links: list[Link] | None = None,
              runtime: RuntimeCosts = NO_RUNTIME, state_slots: int = 1) -> PipelineModel:
        """`cost="auto"`: the profile if given, else analytic when the bundle has ops.json, else uniform."""
        if cost not in COST_MODELS:
            raise PartitionError(f"unknown cost model {cost!r} (choose from {', '.join(COST_MODELS)})")
        spec = get_device(device) if isinstance(device, str) else device
        flow = GraphFlow.from_bundle(bundle, inputs)
        if bundle.state:  # resident state never travels: its inputs are held like params, its outputs sent nowhere
            import dataclasses

            held = {p.input for p in bundle.state}
            kept = {bundle.graph.head_entries[p.output] for p in bundle.state}
            flow = GraphFlow.build(bundle.graph, [n for n in flow.inputs if n not in held])
            flow.entries = [dataclasses.replace(e, is_head=False) if e.id in kept else e for e in flow.entries]
        unknown = [n for n in flow.inputs if not bundle.graph.is_null_node(n)]
        if unknown:
            raise PartitionError(f"input(s) {unknown} are not null nodes of the graph")
        if cost == "auto":
            cost = "measured" if profile is not None else ("analytic" if bundle.ops else "uniform")
        if cost == "measured":
            if profile is None:
                raise PartitionError("the measured cost model needs a profile (--profile FILE from `tvmpipe profile`)")
            prof = profile if isinstance(profile, dict) else read_profile(profile)
            costs = measured_costs(prof, flow, source=str(profile) if not isinstance(profile, dict) else "profile")
        elif cost == "analytic":
            costs = analytic_costs(bundle, flow, spec)
        else:
            costs = uniform_costs(flow, uniform_op_us)
        tables = RangeTables.build(flow, costs.time_us, workspace_bytes(bundle))
        if bundle.state:  # each stage holds its pairs' caches for `state_slots` sequences; no cut inside a pair
            from tvmpipe.bundle.state import state_spans
            from tvmpipe.partition.range_tables import state_table

            nbytes = bundle.state_held_bytes  # one buffer a slot where a pair is updated in place, else two
            spans = state_spans(bundle.graph, bundle.state)
            scope = {p.name: p.scope for p in bundle.state}

            def held(of_scope: str, slots: int):
                return state_table(flow.num_ops, [(flow.ordinal[lo], flow.ordinal[hi], nbytes[name])
                                                  for name, (lo, hi) in spans.items() if scope[name] == of_scope],
                                   slots)

            # a "stage" pair (a paged KV pool) is held once by its stage, whatever the slots
            tables.state = held("slot", state_slots) + held("stage", 1)
        model = cls(bundle, flow, costs, tables,
                    link or Link(), list(speeds or [1.0]), list(memory_caps or [None]), spec,
                    list(links) if links else None, runtime)
        if any(not (s > 0) for s in model.speeds):
            raise PartitionError(f"speed factors must be positive, got {model.speeds}")
        if any(c is not None and c <= 0 for c in model.memory_caps):
            raise PartitionError(f"memory caps must be positive, got {model.memory_caps}")
        return model

    @property
    def num_ops(self) -> int:
        return self.flow.num_ops

    @property
    def batch(self) -> int:
        return self.bundle.manifest.batch if self.bundle.manifest else 1

    def _per_stage(self, values: list, k: int, what: str) -> list:
        if len(values) == 1:
            return values * k
        if len(values) < k:
            raise PartitionError(f"{len(values)} {what} given for {k} stages: give one per stage, or a single value")
        return values[:k]

    def stage_speeds(self, k: int) -> list[float]:
        return self._per_stage(self.speeds, k, "speed factors")

    def stage_caps(self, k: int) -> list[int | None]:
        return self._per_stage(self.memory_caps, k, "memory caps")

    def stage_links(self, k: int) -> list[Link]:
        return self._per_stage(self.links, k, "links") if self.links else [self.link] * k

    def stage_time_us(self, i: int, j: int, speed: float, link: Link | None = None) -> float:
        """Cycle of stage [i, j) with one inbound and one outbound frame (what the planner weighs)."""
        transfer = (link or self.link).transfer_us(self.tables.recv[i, j])
        rt = self.runtime
        return float(rt.stage_cycle_us(self.tables.compute_us(i, j) / speed, transfer,
                                       inline_out=rt.inline_frames(self.tables.send[i, j])))

    def stage_memory(self, i: int, j: int) -> int:
        t = self.tables
        state = 0.0 if t.state is None else t.state[i, j]
        total = t.params[i, j] + t.workspace[i, j] + t.recv[i, j] + t.activations[i, j] + state
        return int(total) if np.isfinite(total) else total  # inf: [i, j) holds part of a state pair
