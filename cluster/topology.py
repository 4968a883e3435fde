"""Who sends what to whom: the pipeline's edges, derived once from the plan's stage programs.

An edge carries, per micro-batch, exactly the entries its consumer needs from its producer. Frames
go straight from a producing stage to *every* later stage that reads its tensors (skip connections
included), and graph outputs to the driver: the driver relays nothing. The one exception runs the
other way: a decode step's per-step inputs (a few bytes that every stateful stage reads) go from the
driver to the first stage and on along the chain with the hidden states (relay_inputs), one frame
a step from the driver instead of one per stage. The driver is `DRIVER` (-1) on both ends: as a
producer of graph inputs, and as the consumer of graph outputs and of errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.state import row_resettable, state_spans as bundle_state_spans, token_layout
from tvmpipe.cluster.frames import DRIVER
from tvmpipe.cluster.sampling import STEP_NAME, TOKEN_NAME, step_spec, token_spec
from tvmpipe.executor.inputs import input_entry_ids
from tvmpipe.executor.program import EntrySpec, StageProgram, build_stage_program
from tvmpipe.partition import Plan, validate_plan
from tvmpipe.partition.errors import PartitionError

SLOT_NAME = "__slot__"
RELAY_MAX_BYTES = 1024  # driver inputs a stage passes on to the next (relay_inputs): per-step tags, not tensors


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
    # Declared state (bundle.json `state`): inputs a stage keeps resident and the heads that replace
    # them; neither crosses an edge. `slot_entry` is the synthetic entry (one past the graph's last)
    # by which the driver tells each stateful stage the micro-batch's sequence slot; `stateful` lists
    # those stages.
    state_inputs: frozenset[int] = frozenset()
    state_heads: frozenset[int] = frozenset()
    slot_entry: int | None = None
    stateful: tuple[int, ...] = ()
    # Generation (a bundle with a `generation` section; sampling.py): the driver tags each micro-batch
    # with `step_entry` for the sampling stage (`sampler`) and the token stage; the sampling stage
    # sends the token it drew (`token_entry`) to the driver and, over the feedback edge (none when it
    # is the token stage itself), to the token stage. `feedback` is (sampling stage, token stage), or
    # None when the token input is read in more than one stage: then the driver feeds every token.
    step_entry: int | None = None
    token_entry: int | None = None
    batch: int = 1  # rows of a decode step (decode_batch): sequences per micro-batch
    row_reset: bool = False  # one row's state can be reset alone (rows_resettable): per-row admission
    chunk: int = 1  # tokens a row a step can take (decode_chunk; > 1: chunked prefill)
    sampler: int | None = None
    feedback: tuple[int, int] | None = None
    # Per stage: the driver entries it takes from the stage before it, which passed them on
    # (relay_inputs); () where the driver feeds the stage itself.
    relayed: tuple[tuple[int, ...], ...] = ()
    # Graph outputs no stage sends (build_topology's `logits`): None in the driver's results.
    dropped_heads: frozenset[int] = frozenset()

    @property
    def num_stages(self) -> int:
        return len(self.programs)

    def inbound(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.dst == stage]

    def outbound(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.src == stage]

    def edge_bytes(self, edge: Edge) -> int:
        return sum(self.specs[e].nbytes for e in edge.entries)


def build_topology(bundle: Bundle, plan: Plan, relay: bool = True, logits: bool = True) -> Topology:
    """Validate `plan` against the graph and derive every stage's program and every edge.
    `relay`: a decode step's per-step inputs go along the chain of stages (relay_inputs); off for
    the cuda backend, whose edges between stages of one node carry device tensors only (CUDA IPC).
    `logits`: a decode step's sampling stage sends the driver its logits with the token it drew;
    False sends the token alone (the logits are a vocabulary of floats a token, which a generation
    loop that only streams tokens never reads)."""
    g = bundle.graph
    validate_plan(g, plan)
    check_state_split(bundle, plan)
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

    state_in = frozenset(inputs[p.input] for p in bundle.state)
    state_heads = frozenset(heads[p.output] for p in bundle.state)
    slot = slot_entry(bundle) if bundle.state else None
    stateful = tuple(j for j, p in enumerate(programs) if state_in & set(p.input_entries.values()))
    if slot is not None:
        specs[slot] = slot_spec(bundle)
        names[slot] = SLOT_NAME
        inputs = {n: e for n, e in inputs.items() if e not in state_in}
        inputs[SLOT_NAME] = slot
    step = token = sampler = feedback = None
    batch = 1
    if slot is not None and bundle.generation is not None:
        step, token = step_entries(bundle)
        batch = decode_batch(bundle)
        specs[step], names[step] = step_spec(batch), STEP_NAME
        specs[token], names[token] = token_spec(batch), TOKEN_NAME
        inputs[STEP_NAME] = step
        roles = [generation_roles(bundle, s, e) for s, e in plan.stages]
        sampler = next(j for j, (_, head) in enumerate(roles) if head is not None)
        reader = next((j for j, (token_in, _) in enumerate(roles) if token_in is not None), None)
        feedback = (sampler, reader) if reader is not None else None

    recv: list[dict[int, list[int]]] = []  # per stage: producer stage -> entries it sends there
    fed: list[tuple[int, ...]] = []  # per stage: the driver's entries it reads
    for j, p in enumerate(programs):
        from_stage: dict[int, list[int]] = {}
        for eid in p.recv_entries:
            from_stage.setdefault(stage_of_node[g.entries[eid].node], []).append(eid)
        recv.append(from_stage)
        need = tuple(e for e in p.input_entries.values() if e not in state_in) + ((slot,) if j in stateful else ())
        if step is not None and (j == sampler or (feedback is not None and j == feedback[1])):
            need += (step,)
        fed.append(need)
    # a decode step's small per-step inputs travel along the chain of stages (relay_inputs)
    carry, through = relay_inputs(fed, recv, specs) if relay and slot is not None else (fed, [False] * len(fed))

    edges: list[Edge] = []
    for j in range(len(programs)):
        own = () if through[j] else carry[j]
        if own or not recv[j]:
            edges.append(Edge(DRIVER, j, own))
        edges += [Edge(i, j, tuple(es) + (carry[j] if through[j] and i == j - 1 else ()))
                  for i, es in sorted(recv[j].items())]
        if feedback is not None and j == feedback[1] != feedback[0]:
            edges.append(Edge(feedback[0], j, (token,)))
    dropped = frozenset()  # heads no stage sends: the logits, when the driver does not want them
    if sampler is not None and not logits:
        dropped = frozenset({heads[bundle.generation.logits]})
    head_set = set(heads) - state_heads - dropped
    for i, p in enumerate(programs):
        sends = tuple(e for e in p.send_entries if e in head_set)
        if i == sampler:
            sends += (token,)
        edges.append(Edge(i, DRIVER, sends))
    return Topology(programs=programs, edges=edges, inputs=inputs, heads=heads, specs=specs, names=names,
                    state_inputs=state_in, state_heads=state_heads, slot_entry=slot, stateful=stateful,
                    step_entry=step, token_entry=token, batch=batch, sampler=sampler, feedback=feedback,
                    row_reset=step is not None and rows_resettable(bundle),
                    chunk=decode_chunk(bundle) if step is not None else 1,
                    relayed=tuple(c if t else () for c, t in zip(carry, through)), dropped_heads=dropped)


def relay_inputs(fed: list[tuple[int, ...]], recv: list[dict[int, list[int]]],
                 specs: dict[int, EntrySpec]) -> tuple[list[tuple[int, ...]], list[bool]]:
    """Which stages get their driver inputs from the stage before them instead of the driver.

    A decode step's per-step inputs are a few bytes (the slot, the step tag, the position) that
    every stateful stage reads. Fed by the driver, they cost it K frames a step and each stage a
    second frame to wait for, read and wake up on; on a few cores those bursts queue behind each
    other (docs/generation.md). Stage j takes them from stage j - 1 when that stage already sends it
    a frame every micro-batch and they stay within RELAY_MAX_BYTES: stage j - 1 passes them on
    with its outputs. Returns, per stage, the driver entries that reach it (its own, then those it
    passes on) and whether they come from the stage before it."""
    n = len(fed)
    carry: list[tuple[int, ...]] = list(fed)
    through = [False] * n
    for j in range(n - 1, -1, -1):
        later = carry[j + 1] if j + 1 < n and through[j + 1] else ()
        carry[j] = fed[j] + tuple(e for e in later if e not in fed[j])
        through[j] = (j > 0 and j - 1 in recv[j] and bool(carry[j])
                      and sum(specs[e].nbytes for e in carry[j]) <= RELAY_MAX_BYTES)
    return carry, through


def step_entries(bundle: Bundle) -> tuple[int, int]:
    """The synthetic entry ids of the step tag and of the sampled token (after the slot's)."""
    n = slot_entry(bundle)
    return n + 1, n + 2


def decode_batch(bundle: Bundle) -> int:
    """Rows of a decode step: the leading axis of its token input ([B, 1], or [B, C] for a step of
    up to C tokens a row), one sequence each (bundle.state.token_layout)."""
    return token_layout(bundle.graph.entry_of(bundle.generation.token).shape)[0]


def decode_chunk(bundle: Bundle) -> int:
    """Tokens a row of a decode step can take: C of a step compiled with `--chunk C` (token input
    [B, C], generation.count saying how many are real), else 1 (bundle.state.token_layout)."""
    return token_layout(bundle.graph.entry_of(bundle.generation.token).shape)[1]


def slot_rows(bundle: Bundle) -> int:
    """Rows of a stateful step: a decode bundle's batch, else 1 (the state is the slot's as a whole)."""
    return decode_batch(bundle) if bundle.generation is not None and bundle.state else 1


def slot_spec(bundle: Bundle) -> EntrySpec:
    """The `__slot__` entry: [slot, fresh row 0, ..., fresh row B-1] (B = slot_rows): the stage's
    state slot for this micro-batch, and per row 1 when that row starts a sequence (its part of
    every state pair is reset to the declared fill first; every row at once resets the whole slot)."""
    return EntrySpec((1 + slot_rows(bundle),), "int64")


def rows_resettable(bundle: Bundle) -> bool:
    """Whether one row of a slot's state can be reset alone: every state pair's leading axis is
    the decode step's rows (a cache [B, H, T, D]), so that a sequence can take a row of a group
    that is still running (Stage resets that row only). A state shaped otherwise is reset only as
    a whole, and a group's rows are then admitted together."""
    b = slot_rows(bundle)
    inputs = input_entry_ids(bundle)
    return b > 1 and all(row_resettable(bundle.graph.entries[inputs[p.input]].shape, b) for p in bundle.state)


def generation_roles(bundle: Bundle, start: int, end: int) -> tuple[int | None, int | None]:
    """What the node range [start, end) of a decode bundle does in generation (sampling.py): the
    token input's entry if the range holds every node that reads it (the token stage, which takes
    fed-back tokens in place of the driver's), and the logits head's entry if the range computes it
    (the sampling stage). The one place both the topology and each stage worker decide roles."""
    gen = bundle.generation
    if gen is None or not bundle.state:
        return None, None
    g = bundle.graph
    token_in = input_entry_ids(bundle)[gen.token]
    token_node = g.entries[token_in].node
    readers = [node.index for node in g.nodes if any(r.node == token_node for r in node.inputs)]
    logits = g.head_entries[gen.logits]
    return (token_in if readers and all(start <= n < end for n in readers) else None,
            logits if start <= g.entries[logits].node < end else None)


def check_state_split(bundle: Bundle, plan: Plan) -> None:
    """Refuse, in one line, a plan that puts a state pair's input and output (or a reader of the
    output) in different stages."""
    where = state_stages(bundle, plan)
    for name, (a, b) in where.items():
        if a != b:
            raise PartitionError(f"the plan splits state pair '{name}': its input is read in stage {a} "
                                 f"{list(plan.stages[a])} but its output is produced in stage {b} "
                                 f"{list(plan.stages[b])}; cut outside nodes {list(state_spans(bundle)[name])}")


def state_spans(bundle: Bundle) -> dict[str, tuple[int, int]]:
    """Per state pair, its node span (bundle.state.state_spans): cuts go outside spans."""
    return bundle_state_spans(bundle.graph, bundle.state)


def state_stages(bundle: Bundle, plan: Plan) -> dict[str, tuple[int, int]]:
    """Per state pair, (stage reading its input first, stage producing its output)."""
    stage_of = {n: i for i, (s, e) in enumerate(plan.stages) for n in range(s, e)}
    return {name: (stage_of[lo], stage_of[hi]) for name, (lo, hi) in state_spans(bundle).items()}


def slot_entry(bundle: Bundle) -> int:
    """The synthetic entry id carrying a micro-batch's sequence slot: one past the graph's entries."""
    return len(bundle.graph.entries)


def plan_keeping_state(bundle: Bundle, k: int) -> Plan:
    """K nearly equal stages that split no state pair (partition.plan.plan_equal_keeping_state)."""
    from tvmpipe.partition.plan import plan_equal_keeping_state

    return plan_equal_keeping_state(bundle, k)
