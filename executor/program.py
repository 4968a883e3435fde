"""StageProgram: everything a backend needs to run graph nodes [start, end), resolved once.

Backends never look at graph.json again: the program says which entries come in (graph inputs
and entries received from earlier stages), which go out (to later stages or as graph outputs),
which params to upload, the steps in order, and every kernel operand bound to a concrete buffer
(storage slot, workspace slot or scalar). The whole graph is simply the stage [0, len(nodes)).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvmpipe.bundle import Bundle, Graph
from tvmpipe.bundle.graph import EntrySpec
from tvmpipe.bundle.pool import pool_entries
from tvmpipe.executor.errors import ExecutorError
from tvmpipe.executor.storage import StepUse, StoragePlan, plan_storage

KERNELS, NOP, COPY = "kernels", "nop", "copy"


@dataclass(frozen=True)
class BoundOperand:
    """A kernel argument resolved to memory: a slot (entry or workspace) by pointer, or a scalar."""

    kind: str  # "slot" | "scalar"
    slot: int = -1
    entry: int = -1  # the entry the slot holds at this point, -1 for a workspace
    value: int | float = 0
    dtype: str = ""


@dataclass(frozen=True)
class BoundLaunch:
    node: int
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple[BoundOperand, ...]


@dataclass(frozen=True)
class Step:
    """One op node of the stage: what it reads and writes and, for kernels, what it launches."""

    node: int
    name: str
    func: str
    kind: str  # KERNELS | NOP | COPY
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    launches: tuple[BoundLaunch, ...] = ()
    inplace: tuple[int, ...] = ()  # a call_tir_inplace's: the input its output is written over (same slot)


@dataclass
class StageProgram:
    model: str
    start: int
    end: int
    op_nodes: list[int]
    param_names: list[str]
    input_names: list[str]  # graph inputs this stage consumes
    param_entries: dict[str, int]
    input_entries: dict[str, int]
    recv_entries: list[int]  # produced by earlier stages, consumed here
    send_entries: list[int]  # produced here, consumed later or graph outputs
    entry_specs: dict[int, EntrySpec]
    entry_names: dict[int, str]  # "node 3 'dense_relu' output 0", for messages
    steps: list[Step]
    storage: StoragePlan
    # entries whose memory the stage's resident state holds (a paged pool kept by SlotState, bound
    # before every run): the storage plan gives them no bytes, backends no buffer of their own
    resident: frozenset[int] = frozenset()

    @property
    def feed_entries(self) -> list[int]:
        """Entries `Stage.run` takes: the graph inputs it consumes, then received entries."""
        return list(self.input_entries.values()) + list(self.recv_entries)

    @property
    def launches(self) -> list[BoundLaunch]:
        return [l for s in self.steps for l in s.launches]

    def label(self, entry: int) -> str:
        return f"entry {entry} ({self.entry_names[entry]})"

    def describe(self, entry: int) -> str:
        return f"{self.label(entry)}: {self.entry_specs[entry]}"


def entry_label(graph: Graph, eid: int) -> str:
    e = graph.entries[eid]
    node = graph.nodes[e.node]
    return node.label() if not node.is_op else f"{node.label()} output {e.index}"


def build_stage_program(bundle: Bundle, start: int, end: int, resident_state: bool = False) -> StageProgram:
    """Resolve graph nodes [start, end) of `bundle` into a runnable program. `resident_state`: the
    stage keeps its state resident (a Stage with state slots: executor/stage.py SlotState, which
    points these entries at its own buffers before every run), so the state's entries get no
    storage of their own, SlotState's buffers being the only copy: a paged step's pools (each
    pool's input and the outputs written over it in place) and a static cache pair's input and
    output (not one sent to a later stage, which is read back from the bound buffer). Without it
    state is an ordinary input and output (a single-process loop that feeds it)."""
    g = bundle.graph
    if not (0 <= start < end <= len(g.nodes)):
        raise ExecutorError(f"node range [{start}, {end}) is not inside the graph's [0, {len(g.nodes)})")
    params = set(bundle.param_names)
    graph_inputs = set(bundle.input_names)
    heads = set(g.head_entries)

    op_nodes = [i for i in range(start, end) if g.nodes[i].is_op]
    param_entries: dict[str, int] = {}
    input_entries: dict[str, int] = {}
    recv: list[int] = []
    sends: list[int] = []
    steps: list[Step] = []
    for nid in op_nodes:
        node = g.nodes[nid]
        ins = tuple(g.input_entry_ids(nid))
        for eid in ins:
            producer = g.nodes[g.entries[eid].node]
            if producer.is_op:
                if producer.index < start and eid not in recv:
                    recv.append(eid)
            elif producer.name in params:
                param_entries.setdefault(producer.name, eid)
            elif producer.name in graph_inputs:
                input_entries.setdefault(producer.name, eid)
            else:
                raise ExecutorError(f"{producer.label()} (read by {node.label()}) is neither a graph input "
                                    "nor a param in bundle.json")
        outs = tuple(g.node_entry_ids(nid))
        for eid in outs:
            if eid in heads or any(c >= end for c in g.consumers[eid]):
                sends.append(eid)
        kind = NOP if node.is_nop else COPY if node.is_copy else KERNELS
        if kind == NOP and (len(ins), len(outs)) != (1, 1):
            raise ExecutorError(f"{node.label()}: __nop must have one input and one output, has {len(ins)} and {len(outs)}")
        steps.append(Step(nid, node.name, node.func_name or "", kind, ins, outs, inplace=tuple(node.inplace)))
    recv.sort()

    touched = set(param_entries.values()) | set(input_entries.values()) | set(recv)
    for s in steps:
        touched.update(s.outputs)
    specs = {e: EntrySpec(g.entries[e].shape, g.entries[e].dtype) for e in sorted(touched)}
    names = {e: entry_label(g, e) for e in specs}

    workspaces: dict[tuple[str, int], int] = {}
    for s in steps:
        if s.kind == KERNELS and s.func in bundle.kernels:
            for j, w in enumerate(bundle.kernels[s.func].workspaces):
                workspaces[(s.func, j)] = w.nbytes
    # an in-place call's output is its input's bytes (a paged pool's append): one slot, like a __nop's
    uses = [StepUse((s.inputs[s.inplace[0]],) + s.inputs if s.inplace else s.inputs, s.outputs,
                    alias=s.kind == NOP or bool(s.inplace)) for s in steps]
    resident = frozenset(_resident_state(bundle, input_entries, specs, start, end)) if resident_state else frozenset()
    storage = plan_storage(uses, {e: 0 if e in resident else sp.nbytes for e, sp in specs.items()},
                           list(param_entries.values()), list(input_entries.values()) + recv, sends, workspaces)
    steps = [_bind(bundle, s, storage) for s in steps]
    return StageProgram(model=bundle.name, start=start, end=end, op_nodes=op_nodes,
                        param_names=list(param_entries), input_names=list(input_entries),
                        param_entries=param_entries, input_entries=input_entries, recv_entries=recv,
                        send_entries=sends, entry_specs=specs, entry_names=names, steps=steps, storage=storage,
                        resident=resident)


def _resident_state(bundle: Bundle, inputs: dict[str, int], specs: dict[int, EntrySpec], start: int,
                    end: int) -> set[int]:
    """The entries of the state pairs whose both sides are in [start, end) (the pairs a Stage keeps
    resident, SlotState binding each pair's input and output to its buffers): a "stage"-scoped
    pool's input and what is written over it in place (bundle.pool.pool_entries); a slot pair's
    input and output, unless a later stage reads the output (it is sent, through its own bytes).
    A `__nop` view of either keeps its bytes: backends that copy into a view of a bound entry need
    them, and the plan sizes an alias group by its largest member."""
    g = bundle.graph
    held = [p for p in bundle.state if p.input in inputs and start <= g.entries[g.head_entries[p.output]].node < end]
    out = pool_entries(g, [p for p in held if p.scope == "stage"])
    for p in held:
        if p.scope != "stage":
            e_out = g.head_entries[p.output]
            out.add(inputs[p.input])
            if not any(c >= end for c in g.consumers[e_out]):
                out.add(e_out)
    return {e for e in out if e in specs}


def _bind(bundle: Bundle, step: Step, storage: StoragePlan) -> Step:
    """Resolve each launch operand per the calling convention: args = inputs, then outputs."""
    if step.kind != KERNELS or step.func not in bundle.kernels:
        return step
    args = step.inputs + step.outputs
    launches = []
    for l in bundle.kernels[step.func].launches:
        bound = []
        for op in l.args:
            if op.kind == "arg":
                bound.append(BoundOperand("slot", slot=storage.entry_slot[args[op.index]], entry=args[op.index]))
            elif op.kind == "workspace":
                bound.append(BoundOperand("slot", slot=storage.workspace_slot[(step.func, op.index)]))
            else:
                bound.append(BoundOperand("scalar", value=op.value, dtype=op.dtype))
        launches.append(BoundLaunch(step.node, l.kernel, l.grid, l.block, l.shared_mem, tuple(bound)))
    return Step(step.node, step.name, step.func, step.kind, step.inputs, step.outputs, tuple(launches), step.inplace)
