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
from tvmpipe.bundle.decode_layout import SCORES_NAME, SLOT_NAME, STEP_NAME, TOKEN_NAME, DecodeLayout, SlotLayout, decode_layout, slot_layout
from tvmpipe.cluster.wire.frames import DRIVER
from tvmpipe.executor.inputs import input_entry_ids
from tvmpipe.executor.program import EntrySpec, StageProgram, build_stage_program
from tvmpipe.partition import Plan, checked_plan

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
    inputs: dict[str, int]  # graph input name -> entry id of its null node (and the synthetic entries)
    heads: list[int]  # graph output entry ids, in `heads` order
    specs: dict[int, EntrySpec]  # every entry that crosses an edge
    names: dict[int, str]
    # Declared state (bundle.json `state`): inputs a stage keeps resident and the heads that replace
    # them; neither crosses an edge. `slot` (bundle.decode_layout) is the synthetic entry by which the
    # driver tells each stateful stage the micro-batch's sequence slot; `stateful` lists those stages.
    state_inputs: frozenset[int] = frozenset()
    state_heads: frozenset[int] = frozenset()
    slot: SlotLayout | None = None
    stateful: tuple[int, ...] = ()
    # Generation (a decode-step bundle; bundle.decode_layout): the driver tags each micro-batch with
    # the step entry for the sampling stage (`sampler`) and the token stage; the sampling stage sends
    # the token it drew to the driver and, over the feedback edge (none when it is the token stage
    # itself), to the token stage. `feedback` is (sampling stage, token stage), or None when the token
    # input is read in more than one stage: then the driver feeds every token.
    layout: DecodeLayout | None = None
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

    @property
    def slot_entry(self) -> int | None:
        return self.slot.entry if self.slot is not None else None

    @property
    def step_entry(self) -> int | None:
        return self.layout.step if self.layout is not None else None

    @property
    def token_entry(self) -> int | None:
        """The synthetic entry of the tokens the sampling stage draws (`__token__`)."""
        return self.layout.drawn if self.layout is not None else None

    @property
    def sends_scores(self) -> bool:
        """Whether the sampling stage sends the driver each row's log probabilities (`__scores__`)."""
        return self.layout is not None and any(
            e.src == self.sampler and e.dst == DRIVER and self.layout.scores in e.entries for e in self.edges)

    @property
    def batch(self) -> int:
        """Rows of a decode step: sequences per micro-batch (1 for anything else)."""
        return self.layout.batch if self.layout is not None else 1

    @property
    def chunk(self) -> int:
        """Tokens a row a decode step can take (> 1: chunked prefill)."""
        return self.layout.chunk if self.layout is not None else 1

    @property
    def row_reset(self) -> bool:
        """One row of a slot's state can be reset alone: per-row admission."""
        return self.layout is not None and self.slot.row_reset

    def inbound(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.dst == stage]

    def outbound(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.src == stage]

    def edge_bytes(self, edge: Edge) -> int:
        return sum(self.specs[e].nbytes for e in edge.entries)


def build_topology(bundle: Bundle, plan: Plan | int, relay: bool = True, logits: bool = True,
                   scores: bool = True) -> Topology:
    """Every stage's program and every edge of `plan` (checked once where it enters: checked_plan).
    `relay`: a decode step's per-step inputs go along the chain of stages (relay_inputs); off for
    the cuda backend, whose edges between stages of one node carry device tensors only (CUDA IPC).
    `logits`: a decode step's sampling stage sends the driver its logits with the token it drew;
    False sends the token alone (the logits are a vocabulary of floats a token, which a generation
    loop that only streams tokens never reads). `scores`: it also sends each row's log
    probabilities (`__scores__`, a few hundred bytes a row: the logprobs a server returns)."""
    g = bundle.graph
    plan = checked_plan(bundle, plan)
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
    slot = slot_layout(bundle)
    stateful = tuple(j for j, p in enumerate(programs) if state_in & set(p.input_entries.values()))
    if slot is not None:
        specs[slot.entry], names[slot.entry] = slot.spec, SLOT_NAME
        inputs = {n: e for n, e in inputs.items() if e not in state_in}
        inputs[SLOT_NAME] = slot.entry
    layout = decode_layout(bundle)
    step = sampler = feedback = None
    if layout is not None:
        step = layout.step
        specs[step], names[step] = layout.step_spec, STEP_NAME
        specs[layout.drawn], names[layout.drawn] = layout.drawn_spec, TOKEN_NAME
        specs[layout.scores], names[layout.scores] = layout.scores_spec, SCORES_NAME
        inputs[STEP_NAME] = step
        roles = [layout.roles(g, s, e) for s, e in plan.stages]
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
        need = tuple(e for e in p.input_entries.values() if e not in state_in)
        need += (slot.entry,) if j in stateful else ()
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
            edges.append(Edge(feedback[0], j, (layout.drawn,)))
    dropped = frozenset()  # heads no stage sends: the logits, when the driver does not want them
    if sampler is not None and not logits:
        dropped = frozenset({layout.logits})
    head_set = set(heads) - state_heads - dropped
    for i, p in enumerate(programs):
        sends = tuple(e for e in p.send_entries if e in head_set)
        if i == sampler:
            sends += (layout.drawn, layout.scores) if scores else (layout.drawn,)
        edges.append(Edge(i, DRIVER, sends))
    return Topology(programs=programs, edges=edges, inputs=inputs, heads=heads, specs=specs, names=names,
                    state_inputs=state_in, state_heads=state_heads, slot=slot, stateful=stateful,
                    layout=layout, sampler=sampler, feedback=feedback,
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
