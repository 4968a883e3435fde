"""The plan: contiguous node ranges of graph.json, one per pipeline stage.

A plan is the only thing the cluster layer needs from the partitioner, so it is plain data
(`stages` as half-open node ranges, see docs/CONTRACTS.md) that round-trips through JSON. Cuts are
placed between op nodes and named by *op ordinal*: cut `c` starts a new stage at the c-th op node
(0-based, counting every `tvm_op` node including `__nop`), so `cuts=[12]` on a 25-op graph gives
stages of 12 and 13 op nodes. A stage range starts just after the last op node of the previous
stage, so null nodes sitting between two stages' op nodes fall into the later one; where a null
node sits is cosmetic, because a stage loads every param and receives every graph input that its op
nodes consume, wherever the null node lies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvmpipe.bundle.errors import Problem
from tvmpipe.bundle.graph import Graph
from tvmpipe.core import files
from tvmpipe.partition.errors import PartitionError, PlanError

PLAN_FORMAT = "tvmpipe-plan"
PLAN_VERSION = 1


@dataclass
class Plan:
    """Stages as node ranges `[start, end)` covering `[0, len(graph.nodes))` in order.

    `predicted` holds the cost model's numbers (per-stage times, bottleneck, throughput, ...) so a
    plan file says what it was chosen for; it is informational and never needed to run the plan.
    """

    stages: list[tuple[int, int]]
    strategy: str = "manual"
    predicted: dict[str, Any] = field(default_factory=dict)
    # the graph this plan was checked against by `checked_plan` (not saved): layers below the one
    # where a plan enters take it as checked instead of checking it again
    checked_for: Graph | None = field(default=None, repr=False, compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "checked_for": None}  # a copy elsewhere is checked again where it enters

    @classmethod
    def from_cuts(cls, graph: Graph, cuts: list[int], strategy: str = "manual") -> Plan:
        """Plan from op-ordinal cuts (strictly increasing, each in 1..num_op_nodes-1)."""
        ops = graph.op_nodes
        bad = [c for c in cuts if not isinstance(c, int) or isinstance(c, bool) or not 1 <= c < len(ops)]
        if not ops:
            raise PartitionError("the graph has no op nodes: there is nothing to partition")
        if bad:
            raise PartitionError(f"cut(s) {bad} out of range: cuts are op ordinals in 1..{len(ops) - 1} "
                                 f"(the graph has {len(ops)} op nodes)")
        if any(b <= a for a, b in zip(cuts, cuts[1:])):
            raise PartitionError(f"cuts {list(cuts)} must be strictly increasing (each stage needs an op node)")
        starts = [0] + [ops[c - 1] + 1 for c in cuts]
        ends = starts[1:] + [len(graph.nodes)]
        return cls(stages=list(zip(starts, ends)), strategy=strategy)

    def cuts(self, graph: Graph) -> list[int]:
        """The op-ordinal cuts of this plan (inverse of `from_cuts`)."""
        ordinal = {nid: k for k, nid in enumerate(graph.op_nodes)}
        out = []
        for start, end in self.stages[1:]:
            first = next((ordinal[n] for n in range(start, end) if n in ordinal), None)
            if first is None:
                raise PartitionError(f"stage [{start}, {end}) has no op node")
            out.append(first)
        return out

    def op_counts(self, graph: Graph) -> list[int]:
        return [sum(1 for n in range(s, e) if graph.nodes[n].is_op) for s, e in self.stages]

    # ---- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "strategy": self.strategy,
                "stages": [[s, e] for s, e in self.stages], "predicted": self.predicted}

    @classmethod
    def from_json(cls, obj: dict[str, Any] | str, where: str = "plan") -> Plan:
        """Read `to_json()` output (a dict or its JSON text); raises PlanError on malformed input,
        naming `where` (the file it came from)."""
        if isinstance(obj, str):
            try:
                obj = json.loads(obj)
            except json.JSONDecodeError as exc:
                raise PlanError([Problem(where, "", "", f"not valid JSON: {exc}")]) from None
        if not isinstance(obj, dict):
            raise PlanError([Problem(where, "", "", "a plan must be a JSON object")])
        problems = []
        if obj.get("format", PLAN_FORMAT) != PLAN_FORMAT:
            problems.append(Problem(where, "", "format", f"must be {PLAN_FORMAT!r}, got {obj.get('format')!r}"))
        if obj.get("version", PLAN_VERSION) != PLAN_VERSION:
            problems.append(Problem(where, "", "version", f"unsupported plan version {obj.get('version')!r}"))
        raw = obj.get("stages")
        ok = isinstance(raw, list) and raw and all(
            isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
            for r in raw)
        if not ok:
            problems.append(Problem(where, "", "stages", f"must be a non-empty list of [start, end] integer pairs, got {raw!r}"))
        predicted = obj.get("predicted", {})
        if not isinstance(predicted, dict):
            problems.append(Problem(where, "", "predicted", "must be an object"))
        if problems:
            raise PlanError(problems)
        return cls(stages=[(int(s), int(e)) for s, e in raw], strategy=str(obj.get("strategy", "manual")),
                   predicted=predicted)

    def save(self, path: str | Path) -> None:
        files.write_text(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PlanError([Problem(str(path), "", "", f"cannot read: {exc.strerror or exc}")]) from None
        except UnicodeDecodeError:
            raise PlanError([Problem(str(path), "", "", "not a JSON text file (not UTF-8)")]) from None
        return cls.from_json(text, where=str(path))


def plan_equal_ops(graph: Graph, k: int) -> Plan:
    """K stages whose op-node counts differ by at most one (earlier stages take the extra ones)."""
    n = len(graph.op_nodes)
    check_stage_count(n, k)
    base, extra = divmod(n, k)
    cuts, acc = [], 0
    for s in range(k - 1):
        acc += base + (1 if s < extra else 0)
        cuts.append(acc)
    return Plan.from_cuts(graph, cuts, strategy="equal")


def check_stage_count(num_ops: int, k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise PartitionError(f"the number of stages must be a positive integer, got {k!r}")
    if k > num_ops:
        raise PartitionError(f"cannot make {k} stages from {num_ops} op node(s): every stage needs at least one op node")


def validate_plan(graph: Graph, plan: Plan) -> None:
    """Raise PlanError listing every way `plan` does not fit `graph`.

    Checks: ranges cover all nodes contiguously and in order; each stage has an op node; every entry
    an op node reads is a null node (param or graph input) or produced by an op node earlier in the
    same stage or in an earlier stage; every head is produced by some stage.
    """
    where = "plan"
    problems: list[Problem] = []
    n = len(graph.nodes)
    if not plan.stages:
        raise PlanError([Problem(where, "", "stages", "a plan needs at least one stage")])
    expect = 0
    for s, (start, end) in enumerate(plan.stages):
        fld = f"stages[{s}]"
        if start != expect:
            problems.append(Problem(where, f"stage {s}", fld, f"starts at node {start}, expected {expect} (ranges must be contiguous)"))
        if end <= start:
            problems.append(Problem(where, f"stage {s}", fld, f"empty or reversed range [{start}, {end})"))
        expect = max(end, expect)
    if expect != n:
        problems.append(Problem(where, "", "stages", f"ranges end at node {expect}, but the graph has {n} nodes"))
    if problems:
        raise PlanError(problems)
    stage_of = [0] * n
    for s, (start, end) in enumerate(plan.stages):
        for nid in range(start, end):
            stage_of[nid] = s
        if not any(graph.nodes[nid].is_op for nid in range(start, end)):
            problems.append(Problem(where, f"stage {s}", f"stages[{s}]", f"range [{start}, {end}) holds no op node"))
    for node in graph.nodes:
        if not node.is_op:
            continue
        for k, ref in enumerate(node.inputs):
            src = graph.nodes[ref.node]
            if not src.is_op:
                continue
            if ref.node >= node.index or stage_of[ref.node] > stage_of[node.index]:
                problems.append(Problem(where, f"stage {stage_of[node.index]}", f"{node.label()} inputs[{k}]",
                                        f"reads {src.label()}, which runs later (stage {stage_of[ref.node]})"))
    if problems:
        raise PlanError(problems)


def plan_equal_keeping_state(bundle: Any, k: int) -> Plan:
    """K stages of nearly equal op counts whose cuts split no state pair of `bundle` (bundle.json
    `state`): each equal-op cut moves to the nearest op ordinal outside every pair's node span
    (bundle.state.state_spans), and where no tensor as large as a cache entry crosses, if there are
    such cuts (ties: the earlier one). Without state: plan_equal_ops."""
    from tvmpipe.bundle.state import state_spans

    g = bundle.graph
    plan = plan_equal_ops(g, k)
    if not bundle.state or k == 1:
        return plan
    ops = g.op_nodes
    spans = list(state_spans(g, bundle.state).values())
    ok = [c for c in range(1, len(ops)) if not any(lo < ops[c - 1] + 1 <= hi for lo, hi in spans)]
    # prefer cuts where no cache-sized tensor crosses (a reshaped copy of a new cache value, read later)
    small = min(g.entry_of(p.input).nbytes for p in bundle.state)
    lean = [c for c in ok if crossing_bytes(g, ops[c - 1] + 1, largest=True) < small]
    ok = lean or ok
    cuts: list[int] = []
    for want in plan.cuts(g):
        free = [c for c in ok if not cuts or c > cuts[-1]]
        if not free:
            raise PartitionError(f"cannot make {k} stages without splitting a state pair: at most {len(ok) + 1} "
                                 "stages keep every pair whole")
        cuts.append(min(free, key=lambda c: (abs(c - want), c)))
    return Plan.from_cuts(g, cuts, strategy="equal")


def checked_plan(bundle: Any, plan: Plan | int) -> Plan:
    """The one way a plan enters a run: K (an int) becomes K nearly equal stages that keep every
    state pair whole (plan_equal_keeping_state); a Plan is checked against the bundle's graph
    (validate_plan) and its state pairs (check_state_split), once: the plan is marked as checked for
    this graph, and a plan so marked is returned as it is."""
    if isinstance(plan, int) and not isinstance(plan, bool):
        plan = plan_equal_keeping_state(bundle, plan)
    elif plan.checked_for is bundle.graph:
        return plan
    else:
        validate_plan(bundle.graph, plan)
        check_state_split(bundle, plan)
    plan.checked_for = bundle.graph
    return plan


def check_state_split(bundle: Any, plan: Plan) -> None:
    """Refuse, in one line, a plan that puts a state pair's input and output (or a reader of the
    output) in different stages."""
    from tvmpipe.bundle.state import state_spans

    spans = state_spans(bundle.graph, bundle.state)
    stage_of = {n: i for i, (s, e) in enumerate(plan.stages) for n in range(s, e)}
    for name, (lo, hi) in spans.items():
        a, b = stage_of[lo], stage_of[hi]
        if a != b:
            raise PartitionError(f"the plan splits state pair '{name}': its input is read in stage {a} "
                                 f"{list(plan.stages[a])} but its output is produced in stage {b} "
                                 f"{list(plan.stages[b])}; cut outside nodes {list(spans[name])}")


def crossing_bytes(g: Graph, start: int, largest: bool = False) -> int:
    """Bytes of the op outputs made before node `start` and read at or after it (the largest one's
    with `largest`): what a cut there sends per micro-batch."""
    sizes = [g.entries[e].nbytes for e in range(len(g.entries))
             if g.nodes[g.entries[e].node].is_op and g.entries[e].node < start
             and any(c >= start for c in g.consumers[e])]
    return (max(sizes, default=0) if largest else sum(sizes))
