"""Who sends what to whom: the pipeline's edges, derived once from the plan's stage programs.

An edge carries, per micro-batch, exactly the entries its consumer needs from its producer. Frames
go straight from a producing stage to *every* later stage that reads its tensors (skip connections
included), and graph outputs to the driver: the driver relays nothing. The driver is `DRIVER` (-1)
on both ends: as a producer of graph inputs, and as the consumer of graph outputs and of errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvmpipe.bundle import Bundle
from tvmpipe.cluster.frames import DRIVER
from tvmpipe.executor.inputs import input_entry_ids
from tvmpipe.executor.program import EntrySpec, StageProgram, build_stage_program
from tvmpipe.partition import Plan, validate_plan


@dataclass(frozen=True)
class Edge:
    """Producer `src` sends `entries` to consumer `dst` once per micro-batch.

    Stage->stage edges always carry entries. A stage->driver edge may carry none: it then only
    carries error reports. A driver->stage edge with no entries is a tick that lets a stage with no
    other input know a micro-batch has started.
    """

    src: int
    dst: int
    entries: tuple[int, ...]

    @property
    def carries_data(self) -> bool:
        return bool(self.entries) or self.src == DRIVER


@dataclass
class Topology:
    programs: list[StageProgram]
    edges: list[Edge]
    inputs: dict[str, int]  # graph input name -> entry id of its null node
    heads: list[int]  # graph output entry ids, in `heads` order
    specs: dict[int, EntrySpec]  # every entry that crosses an edge
    names: dict[int, str]

    @property
    def num_stages(self) -> int:
        return len(self.programs)

    def inbound(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.dst == stage]

    def outbound(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.src == stage]

    def edge_bytes(self, edge: Edge) -> int:
        return sum(self.specs[e].nbytes for e in edge.entries)


def build_topology(bundle: Bundle, plan: Plan) -> Topology:
    """Validate `plan` against the graph and derive every stage's program and every edge."""
    g = bundle.graph
    validate_plan(g, plan)
    programs = [build_stage_program(bundle, s, e) for s, e in plan.stages]
    stage_of_node = {n: i for i, (s, e) in enumerate(plan.stages) for n in range(s, e)}
    inputs = input_entry_ids(bundle)
    heads = g.head_entries
    specs: dict[int, EntrySpec] = {}
    names: dict[int, str] = {}
    for p in programs:
        specs.update(p.entry_specs)
        names.update(p.entry_names)
    for name, eid in inputs.items():
        entry = g.entries[eid]
        specs.setdefault(eid, EntrySpec(entry.shape, entry.dtype))
        names.setdefault(eid, name)

    edges: list[Edge] = []
    for j, p in enumerate(programs):
        from_stage: dict[int, list[int]] = {}
        for eid in p.recv_entries:
            from_stage.setdefault(stage_of_node[g.entries[eid].node], []).append(eid)
        if p.input_entries or not from_stage:
            edges.append(Edge(DRIVER, j, tuple(p.input_entries.values())))
        edges += [Edge(i, j, tuple(es)) for i, es in sorted(from_stage.items())]
    head_set = set(heads)
    for i, p in enumerate(programs):
        edges.append(Edge(i, DRIVER, tuple(e for e in p.send_entries if e in head_set)))
    return Topology(programs=programs, edges=edges, inputs=inputs, heads=heads, specs=specs, names=names)
