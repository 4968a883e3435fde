"""Declared state: which graph input a program's state is read from and which output replaces it.

A decode step reads its KV caches as inputs and returns the updated caches as outputs. Without a
declaration those are ordinary tensors, and a runtime would ship them through the driver every
token; declared as pairs, a stage keeps them resident (one set per sequence slot) and feeds the
output back as the next step's input without sending it anywhere. `generation` names the inputs a
generation loop feeds (token, position) and the logits output it samples from.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

from tvmpipe.bundle.errors import Problem
from tvmpipe.bundle.graph import Graph


@dataclass(frozen=True)
class StatePair:
    """State `name` is read from graph input `input` and replaced by graph output `output` (an
    index into graph.json `heads`); before the first step it holds `fill` (0.0: an empty cache)."""

    name: str
    input: str
    output: int
    fill: float = 0.0
    scope: str = "slot"  # SCOPES: one value per sequence slot, or one for the stage (a paged pool)

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "input": self.input, "output": self.output, "init": {"fill": self.fill}}
        return {**out, "scope": self.scope} if self.scope != "slot" else out


# "slot": a stage keeps one value per sequence slot (a static KV cache [B, H, T, D]); "stage": one
# value for the whole stage, shared by every row and slot, never reset by a slot's fresh start
# (a paged KV pool: rows reach their own pages through the page table a step carries)
SCOPES = ("slot", "stage")


@dataclass(frozen=True)
class PagedSpec:
    """A paged decode step (docs/paged-kv.md): pools of `pages` pages of `page_size` tokens (the
    stage-scoped state), and the names of the int32 inputs each step carries: the CSR page table
    (`indptr` [B + 1], `values` [capacity], `last_page_len` [B]), the append's `position_map`
    [B * C], and for a chunked step `q_indptr` [B + 1] (its tokens packed, row after row)."""

    page_size: int
    pages: int
    indptr: str
    values: str
    last_page_len: str
    position_map: str
    q_indptr: str | None = None

    KEYS = ("page_size", "pages", "indptr", "values", "last_page_len", "position_map")

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.KEYS}
        return {**out, "q_indptr": self.q_indptr} if self.q_indptr is not None else out

    @property
    def inputs(self) -> list[str]:
        return [self.indptr, self.values, self.last_page_len, self.position_map,
                *([self.q_indptr] if self.q_indptr is not None else [])]

    def idle_value(self, name: str) -> int:
        """What input `name` holds, everywhere, in a step whose rows are all idle (no pages, no
        writes): -1 in the position map (an append writes nothing there), 0 in the rest. A warm-up
        run feeds it: random indices would write pages at random, or twice."""
        return -1 if name == self.position_map else 0


@dataclass(frozen=True)
class GenerationSpec:
    """What a generation loop feeds and reads: `token` (ids, [batch, 1]) and `position` (the
    step's position in the sequence) inputs, the `logits` output (head index, [batch, 1 or more,
    vocab]: the last position is sampled), the static `max_context` of the caches, `vocab_size`."""

    token: str
    position: str
    logits: int
    max_context: int
    vocab_size: int
    count: str | None = None  # a chunked step's input: how many of each row's tokens are real
    paged: PagedSpec | None = None  # a paged KV step's pool and page-table inputs

    def to_json(self) -> dict[str, Any]:
        out = {"token": self.token, "position": self.position, "logits": self.logits,
               "max_context": self.max_context, "vocab_size": self.vocab_size}
        if self.count is not None:
            out["count"] = self.count
        if self.paged is not None:
            out["paged"] = self.paged.to_json()
        return out


def token_layout(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """(rows, tokens a row) of a decode step's token input: [B, 1] is B rows of one token a step,
    [B, C] (a step compiled with `--chunk C`) B rows of up to C."""
    return (shape[0] if len(shape) else 1), max(1, math.prod(shape[1:]))


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_state(raw: Any, file: str, problems: list[Problem]) -> list[StatePair]:
    """bundle.json `state`: a list of pairs (shape only; graph checks come in check_state)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.append(Problem(file, "", "state", "must be a list of state pairs"))
        return []
    out = []
    for i, p in enumerate(raw):
        fld = f"state[{i}]"
        if not isinstance(p, dict) or not {"name", "input", "output"} <= set(p) \
                or set(p) - {"name", "input", "output", "init", "scope"}:
            problems.append(Problem(file, "", fld, 'must be {"name", "input", "output"[, "init", "scope"]}'))
            continue
        if p.get("scope", "slot") not in SCOPES:
            problems.append(Problem(file, "", f"{fld}.scope", f"must be one of {', '.join(SCOPES)}"))
            continue
        init = p.get("init", {"fill": 0.0})
        ok_init = isinstance(init, dict) and set(init) == {"fill"} and isinstance(init["fill"], (int, float)) \
            and not isinstance(init["fill"], bool)
        if not (isinstance(p["name"], str) and isinstance(p["input"], str) and _is_count(p["output"]) and ok_init):
            problems.append(Problem(file, "", fld, "name and input are strings, output a head index, "
                                                   'init {"fill": <number>}'))
            continue
        out.append(StatePair(p["name"], p["input"], p["output"], float(init["fill"]), p.get("scope", "slot")))
    return out


def parse_generation(raw: Any, file: str, problems: list[Problem]) -> GenerationSpec | None:
    if raw is None:
        return None
    keys = {"token", "position", "logits", "max_context", "vocab_size"}
    if not isinstance(raw, dict) or not keys <= set(raw) <= keys | {"count", "paged"}:
        problems.append(Problem(file, "", "generation", f"must have exactly the keys {sorted(keys)} (and \"count\" "
                                                        "for a chunked step, \"paged\" for a paged one)"))
        return None
    if not (isinstance(raw["token"], str) and isinstance(raw["position"], str) and _is_count(raw["logits"])
            and _is_count(raw["max_context"]) and raw["max_context"] > 0 and _is_count(raw["vocab_size"])
            and raw["vocab_size"] > 0 and isinstance(raw.get("count", ""), str)):
        problems.append(Problem(file, "", "generation", "token, position and count are input names; logits a head "
                                                        "index; max_context and vocab_size positive integers"))
        return None
    paged = None
    if "paged" in raw:
        pg = raw["paged"]
        names = PagedSpec.KEYS[2:]
        if not (isinstance(pg, dict) and set(PagedSpec.KEYS) <= set(pg) <= set(PagedSpec.KEYS) | {"q_indptr"}
                and all(_is_count(pg[k]) and pg[k] > 0 for k in ("page_size", "pages"))
                and all(isinstance(pg[k], str) for k in names) and isinstance(pg.get("q_indptr", ""), str)):
            problems.append(Problem(file, "", "generation.paged", f"must have the keys {list(PagedSpec.KEYS)} (and "
                                    "\"q_indptr\" for a chunked step): page_size and pages positive integers, "
                                    "the others input names"))
            return None
        paged = PagedSpec(pg["page_size"], pg["pages"], *(pg[k] for k in names), pg.get("q_indptr"))
    return GenerationSpec(raw["token"], raw["position"], raw["logits"], raw["max_context"], raw["vocab_size"],
                          raw.get("count"), paged)


def check_state(graph: Graph, inputs: list[str], state: list[StatePair], gen: GenerationSpec | None,
                file: str, problems: list[Problem]) -> None:
    """Every pair reads a graph input and is replaced by a head of the same shape and dtype; no
    input, head or name is in two pairs; the generation inputs and logits are not state."""
    seen_in: set[str] = set()
    seen_out: set[int] = set()
    names: set[str] = set()
    for i, p in enumerate(state):
        fld = f"state[{i}]"
        if p.name in names:
            problems.append(Problem(file, "", fld, f"state name '{p.name}' is used twice"))
        names.add(p.name)
        if p.input not in inputs:
            problems.append(Problem(file, "", f"{fld}.input", f"'{p.input}' is not one of the bundle's inputs"))
            continue
        if p.output >= len(graph.heads):
            problems.append(Problem(file, "", f"{fld}.output", f"head {p.output} does not exist "
                                                               f"(graph.json has {len(graph.heads)} outputs)"))
            continue
        if p.input in seen_in or p.output in seen_out:
            problems.append(Problem(file, "", fld, "its input or output is already in another state pair"))
        seen_in.add(p.input)
        seen_out.add(p.output)
        ein, eout = graph.entry_of(p.input), graph.entries[graph.head_entries[p.output]]
        if (ein.shape, ein.dtype) != (eout.shape, eout.dtype):
            problems.append(Problem(file, "", fld, f"input '{p.input}' is {ein.dtype}{list(ein.shape)} but output "
                                                   f"{p.output} is {eout.dtype}{list(eout.shape)}"))
    if gen is None:
        return
    for key in ("token", "position", "count"):
        name = getattr(gen, key)
        if name is None:
            continue
        if name not in inputs:
            problems.append(Problem(file, "", f"generation.{key}", f"'{name}' is not one of the bundle's inputs"))
        elif name in seen_in:
            problems.append(Problem(file, "", f"generation.{key}", f"'{name}' is a state input"))
    if gen.paged is not None:
        for name in gen.paged.inputs:
            if name not in inputs:
                problems.append(Problem(file, "", "generation.paged", f"'{name}' is not one of the bundle's inputs"))
        if not any(p.scope == "stage" for p in state):
            problems.append(Problem(file, "", "generation.paged", "a paged step keeps its pools as \"stage\" state"))
        short = pool_shortfall(gen.paged, gen.max_context)
        if short is not None:
            problems.append(Problem(file, "", "generation.paged", short))
    if gen.count is None and gen.paged is None and gen.token in inputs:
        shape = graph.entry_of(gen.token).shape
        if token_layout(shape)[1] > 1:
            problems.append(Problem(file, "", "generation.count", f"token input '{gen.token}' is {list(shape)}: a step "
                                    "of several tokens a row needs a `count` input saying how many are real"))
    if gen.logits >= len(graph.heads):
        problems.append(Problem(file, "", "generation.logits", f"head {gen.logits} does not exist"))
    elif gen.logits in seen_out:
        problems.append(Problem(file, "", "generation.logits", f"head {gen.logits} is a state output"))
    elif graph.entries[graph.head_entries[gen.logits]].shape[-1:] != (gen.vocab_size,):
        problems.append(Problem(file, "", "generation.vocab_size", f"logits head {gen.logits} is "
                                f"{list(graph.entries[graph.head_entries[gen.logits]].shape)}, not [..., {gen.vocab_size}]"))


def pool_shortfall(paged: PagedSpec, max_context: int) -> str | None:
    """Why a pool of `paged.pages` pages is too small for a step of `max_context`, or None: it must
    hold at least one row at the max context (`pages x page_size >= max_context`). The scheduler's
    admission rests on it (no row is ever unfit), so a load refuses less, whether the pool was
    compiled (`--kv-pages`) or set at run time (bundle.pool.resize_pool, `--kv-tokens`)."""
    if paged.pages * paged.page_size >= max_context:
        return None
    return (f"a pool of {paged.pages} pages of {paged.page_size} tokens ({paged.pages * paged.page_size} tokens) "
            f"holds less than one row at the max context ({max_context})")


def row_resettable(shape: tuple[int, ...] | list[int], rows: int) -> bool:
    """Whether a state of `shape` can be reset one row at a time for a step of `rows` rows: its
    leading axis is the rows (a KV cache [B, H, T, D]), so a row is one contiguous span."""
    return len(shape) > 0 and shape[0] == rows


def state_spans(graph: Graph, state: list[StatePair]) -> dict[str, tuple[int, int]]:
    """Per state pair, the node span from the first reader of its input to the producer of its
    output or the last reader of that output, whichever is later: a pipeline stage holding the
    whole span sends no state over the data plane (not even the new value as an activation), so
    plans cut only outside spans."""
    spans = {}
    for p in state:
        eid = graph.entry_id(graph.node_index[p.input])
        out = graph.head_entries[p.output]
        nodes = [graph.entries[out].node, *graph.consumers[eid], *graph.consumers[out]]
        spans[p.name] = (min(nodes), max(nodes))
    return spans


# Ops whose output element i reads element i of every operand of the output's own shape (the
# others broadcast): a state input read only by such an op can be overwritten by the op's output.
ELEMENTWISE = frozenset({"where", "add", "subtract", "multiply", "divide", "maximum", "minimum"})


def state_buffers(graph: Graph, ops: dict[str, Any], kernels: dict[str, Any],
                  state: list[StatePair]) -> dict[str, int]:
    """Per pair, the buffers a stage keeps for it per sequence slot: 1 where the step may write the
    new value over the current one (updated_in_place), else 2 (read one, write the other)."""
    return {p.name: 1 if updated_in_place(graph, ops, kernels, p) else 2 for p in state}


def updated_in_place(graph: Graph, ops: dict[str, Any], kernels: dict[str, Any], pair: StatePair) -> bool:
    """Whether `pair`'s new value may be written over its current one: one buffer a sequence slot
    instead of two, half the memory of the caches.

    A stage keeps two buffers a pair and slot by default: the step reads one and writes the other
    (the generated kernels take their operands as `__restrict__` pointers), and they swap. One
    buffer is enough when the output's element i depends on the input's element i alone, read
    before it is written: the one node reading the state input is the one producing the state
    output, and inside that fused function (ops.json) the input's argument is read by the
    function's output op only, an elementwise op (ELEMENTWISE) whose output has the input's shape
    and dtype; and the function is one kernel launch (kernels.json), so no earlier launch of it can
    use the output as scratch before the cache is read. That is the cache update a decode step
    compiles to, `where(arange(T) == pos, new, cache)`: a kernel thread reads cache[i] (or not, at
    `pos`) and writes element i. Any other form (the input read by another node, through a reshape
    or a transpose, a head that is a view of the output, a function of several launches) keeps two
    buffers. A paged pool's update is an in-place call (graph.json `inplace_indices`): its output
    is its input's storage, one buffer by construction."""
    e_in = graph.entry_id(graph.node_index[pair.input])
    e_out = graph.head_entries[pair.output]
    node = graph.nodes[graph.entries[e_out].node]
    if node.is_op and node.inplace:
        # a call_tir_inplace (a paged pool's append): its output is the input it writes, by
        # construction one buffer; it is the update when the input it writes is the state's, and
        # nothing else reads that input (compiler/graphjson.py checks it when it builds the graph)
        ins = graph.input_entry_ids(node.index)
        return graph.consumers[e_in] == [node.index] and ins[node.inplace[0]] == e_in \
            and graph.entries[e_out].index == 0
    fn = ops.get(node.func_name or "")
    launches = getattr(kernels.get(node.func_name or ""), "launches", ())
    if graph.consumers[e_in] != [node.index] or fn is None or len(fn.outputs) != 1 or len(launches) != 1:
        return False
    args = [k for k, e in enumerate(graph.input_entry_ids(node.index)) if e == e_in]
    readers = [i for i, op in enumerate(fn.ops) if any(r.kind == "arg" and r.index in args for r in op.inputs)]
    out = fn.outputs[0]
    if len(args) != 1 or len(readers) != 1 or (out.kind, out.index, out.output) != ("op", readers[0], 0):
        return False
    op = fn.ops[readers[0]]
    at = [j for j, r in enumerate(op.inputs) if r.kind == "arg" and r.index == args[0]]
    return (op.op in ELEMENTWISE and len(at) == 1 and op.input_shapes[at[0]] == op.output_shapes[0]
            and op.input_dtypes[at[0]] == op.output_dtypes[0])
