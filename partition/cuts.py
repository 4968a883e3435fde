"""Dataflow facts by op ordinal: who produces and consumes each entry, what crosses each cut.

Planners reason about op ordinals (the k-th op node in graph order) because cuts go between op
nodes; null nodes never decide a cut. Everything here is computed once per graph so the planners
can ask about any stage range without walking the graph again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.graph import Graph


@dataclass(frozen=True)
class EntryFlow:
    """One graph entry seen from the pipeline: where it comes from, which op ordinals read it."""

    id: int
    nbytes: int
    producer: int  # op ordinal of the producing node; -1 for a null node
    uses: tuple[int, ...]  # op ordinals reading it, ascending, each once
    is_head: bool
    kind: str  # "activation" | "input" | "param"
    alias_of: int | None = None  # for a `__nop` output: the entry whose storage it shares


@dataclass
class GraphFlow:
    """The graph by op ordinal. `inputs` are the null-node names fed per run; other null nodes are params."""

    graph: Graph
    ops: list[int]  # op ordinal -> node index
    entries: list[EntryFlow]  # by entry id
    inputs: list[str]
    ordinal: dict[int, int] = field(default_factory=dict)  # node index -> op ordinal

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @classmethod
    def from_bundle(cls, bundle: Bundle, inputs: list[str] | None = None) -> GraphFlow:
        return cls.build(bundle.graph, inputs if inputs is not None else default_inputs(bundle))

    @classmethod
    def build(cls, graph: Graph, inputs: list[str]) -> GraphFlow:
        ops = graph.op_nodes
        ordinal = {nid: k for k, nid in enumerate(ops)}
        input_set = set(inputs)
        heads = set(graph.head_entries)
        entries = []
        for e in graph.entries:
            node = graph.nodes[e.node]
            uses = tuple(sorted({ordinal[c] for c in graph.consumers[e.id] if c in ordinal}))
            if node.is_op:
                kind, producer = "activation", ordinal[e.node]
            else:
                kind, producer = ("input" if node.name in input_set else "param"), -1
            alias = graph.ref_entry(node.inputs[0]) if node.is_nop and node.inputs else None
            entries.append(EntryFlow(e.id, e.nbytes, producer, uses, e.id in heads, kind, alias))
        return cls(graph=graph, ops=ops, entries=entries, inputs=list(inputs), ordinal=ordinal)

    def storage_root(self, eid: int) -> int:
        """The entry whose buffer `eid` lives in (follows `__nop` aliases)."""
        while self.entries[eid].alias_of is not None:
            eid = self.entries[eid].alias_of
        return eid

    def op_range(self, start: int, end: int) -> tuple[int, int]:
        """Node range [start, end) -> op-ordinal range [a, b)."""
        a = next((self.ordinal[n] for n in range(start, end) if n in self.ordinal), None)
        if a is None:
            return 0, 0
        b = max(self.ordinal[n] for n in range(start, end) if n in self.ordinal) + 1
        return a, b


_INPUT_NAME = re.compile(r"^(data|input|inputs|x|images?|input_ids)(_?\d+)?$", re.IGNORECASE)


def default_inputs(bundle: Bundle) -> list[str]:
    """Graph inputs: from bundle.json, or from a bare graph.json's params file; else a guess.

    A bare graph.json alone does not say which null nodes are fed per run. The guess: null nodes with a
    conventional input name (data, input, x, ... with an optional number), else null nodes read as
    the first argument of an op (where activations go in TVM's fused functions). Pass `--inputs` to
    override, or `--params` to read the answer from the deployment's params file; the guess only
    changes transfer bytes (inputs) versus loaded bytes (params).
    """
    if bundle.knows_params:
        return list(bundle.input_names)
    g = bundle.graph
    nulls = [g.nodes[i] for i in g.null_nodes]
    named = [n.name for n in nulls if _INPUT_NAME.match(n.name)]
    if named:
        return named
    first_args = {n.inputs[0].node for n in g.nodes if n.is_op and n.inputs}
    return [n.name for n in nulls if n.index in first_args]


@dataclass
class StageIO:
    """What one stage (op ordinals [a, b)) loads, receives and sends."""

    ops: range
    op_nodes: list[int]
    params: list[int]  # entry ids of params its ops read
    inputs: list[int]  # entry ids of graph inputs its ops read (sent by the driver)
    recv: list[int]  # activation entry ids produced by earlier stages and read here
    send: list[int]  # activation entry ids produced here and read by later stages or listed in heads
    outputs: list[int]  # entry ids among `send` that are graph outputs (to the driver)

    def nbytes(self, flow: GraphFlow, which: str) -> int:
        return sum(flow.entries[e].nbytes for e in getattr(self, which))


def stage_io(flow: GraphFlow, a: int, b: int) -> StageIO:
    """Loads, receives and sends of the stage holding op ordinals [a, b)."""
    params, inputs, recv, send, outputs = [], [], [], [], []
    for e in flow.entries:
        used_here = any(a <= u < b for u in e.uses)
        if e.kind == "param" and used_here:
            params.append(e.id)
        elif e.kind == "input" and used_here:
            inputs.append(e.id)
        elif e.kind == "activation":
            if e.producer < a and used_here:
                recv.append(e.id)
            elif a <= e.producer < b and (e.is_head or any(u >= b for u in e.uses)):
                send.append(e.id)
                if e.is_head:
                    outputs.append(e.id)
    return StageIO(range(a, b), [flow.ops[k] for k in range(a, b)], params, inputs, recv, send, outputs)


@dataclass(frozen=True)
class Crossing:
    """The activations live across cut `cut` (between op ordinals cut-1 and cut), skips included."""

    cut: int
    node: int  # node index of the op that starts the next stage
    entries: tuple[int, ...]
    nbytes: int


def cut_crossings(flow: GraphFlow) -> list[Crossing]:
    """For every candidate cut 1..num_ops-1, the activations produced before it and read at or after it."""
    n = flow.num_ops
    delta = [0] * (n + 1)
    live_from: dict[int, list[int]] = {}
    for e in flow.entries:
        if e.kind != "activation" or not e.uses or e.uses[-1] <= e.producer:
            continue
        delta[e.producer + 1] += e.nbytes
        delta[e.uses[-1] + 1] -= e.nbytes
        live_from.setdefault(e.producer + 1, []).append(e.id)
    out, acc, live = [], 0, []
    for c in range(1, n):
        acc += delta[c]
        live = [x for x in live if flow.entries[x].uses[-1] >= c] + live_from.get(c, [])
        out.append(Crossing(c, flow.ops[c], tuple(sorted(live)), acc))
    return out
