"""A paged decode step's page pool sized at run time (issue 53, `--kv-tokens`): the one owner of
the override.

A paged step compiled with `--kv paged [--kv-pages N]` records its pool of N pages in three places:
the graph's entries of each layer's pool (`pages[N, 2, H_kv, P, D]`: the state input and the output
the in-place append writes over it), the ops.json records of the functions that read or write it
(the reference backend checks each op's shapes against them), and `generation.paged.pages`. The
kernels do not depend on N: it is the outermost axis of every pool index, a page's stride does not
depend on it, and TVM's kernels built for two pool sizes are the same source and launches
(tests/compiler/test_pagedkv.py). So a run-time size is a load-time change of those shapes, made
here once and applied wherever a bundle is loaded for a stage (cluster/worker.py: `StageSpec.kv_pages`;
the driver's own copy, which the planner, topology and scheduler read): the storage plan, the
backends' buffers, the resident state and the scheduler's PagePool then all follow the bundle.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from tvmpipe.bundle.bundle import Bundle
from tvmpipe.bundle.errors import BundleError, Problem
from tvmpipe.bundle.graph import Graph
from tvmpipe.bundle.manifests import FusedFunction, OpRecord
from tvmpipe.bundle.state import StatePair, check_state


def pages_for(tokens: int, page_size: int) -> int:
    """Whole pages holding `tokens` tokens (rounded up)."""
    return max(0, math.ceil(tokens / page_size))


def pool_entries(graph: Graph, state: Iterable[StatePair]) -> set[int]:
    """Entry ids that hold a stage-scoped pool: each "stage" pair's input, every output written
    over one of them in place (a `call_tir_inplace` node's `inplace_indices`), and `__nop` views of
    one of the same shape. Graph order: a writer comes after what it writes."""
    pools = {graph.entry_id(graph.node_index[p.input]) for p in state if p.scope == "stage"}
    for n in graph.nodes:
        if not n.is_op:
            continue
        ins = graph.input_entry_ids(n.index)
        for j, k in enumerate(n.inplace):
            if ins[k] in pools:
                pools.add(graph.entry_id(n.index, j))
        if n.is_nop and ins and ins[0] in pools:
            out = graph.entry_id(n.index)
            if graph.entries[out].shape == graph.entries[ins[0]].shape:
                pools.add(out)
    return pools


def resize_pool(bundle: Bundle, pages: int) -> Bundle:
    """`bundle` with its page pools of `pages` pages (the same count on every layer and stage):
    the pool entries' shapes, the ops.json records that read or write them, and
    `generation.paged.pages`. Weights, kernels and everything else are shared with `bundle`. The
    result passes the load's own checks (bundle.state.check_state: among them, the pool holds one
    row at the max context), else BundleError. `bundle` is returned as is at its own size."""
    gen = bundle.generation
    if gen is None or gen.paged is None:
        raise BundleError([Problem(str(bundle.path), "", "generation.paged", "not a paged decode step: its KV "
                                                                             "caches have no pool to size")])
    if pages == gen.paged.pages:
        return bundle
    g = bundle.graph
    pools = pool_entries(g, bundle.state)
    old = gen.paged.pages
    bad = [e for e in pools if g.entries[e].shape[:1] != (old,) or len(g.entries[e].shape) != 5]
    if bad:
        raise BundleError([Problem(str(bundle.path / "graph.json"), "", "generation.paged",
                                   f"entry {bad[0]} holds a pool but is {list(g.entries[bad[0]].shape)}, not "
                                   f"[{old}, 2, H_kv, {gen.paged.page_size}, D]")])
    entries = [dataclasses.replace(e, shape=(pages, *e.shape[1:])) if e.id in pools else e for e in g.entries]
    graph = dataclasses.replace(g, entries=entries)
    ops = dict(bundle.ops)
    for n in g.nodes:
        fn = ops.get(n.func_name or "") if n.is_op else None
        if fn is None:
            continue
        args = {k for k, e in enumerate(g.input_entry_ids(n.index)) if e in pools}
        outs = {j for j, e in enumerate(g.node_entry_ids(n.index)) if e in pools}
        if args or outs:
            ops[fn.name] = resize_function(fn, args, outs, pages)
    generation = dataclasses.replace(gen, paged=dataclasses.replace(gen.paged, pages=pages))
    manifest = dataclasses.replace(bundle.manifest, generation=generation)
    problems: list[Problem] = []
    check_state(graph, manifest.inputs, manifest.state, generation, str(bundle.path / "bundle.json"), problems)
    if problems:
        raise BundleError(problems)
    return dataclasses.replace(bundle, graph=graph, manifest=manifest, ops=ops)


def resize_function(fn: FusedFunction, args: set[int], outs: set[int], pages: int) -> FusedFunction:
    """`fn` with the pool's leading axis `pages` in each op's shapes where the op reads a pool
    argument (`args`: the function's argument indices) or makes a pool output (`outs`: the
    function's output indices)."""
    made = {(r.index, r.output) for j, r in enumerate(fn.outputs) if j in outs and r.kind == "op"}

    def grown(shape: list[int]) -> list[int]:
        return [pages, *shape[1:]]

    records = []
    for i, rec in enumerate(fn.ops):
        ins = [grown(s) if r.kind == "arg" and r.index in args else s for r, s in zip(rec.inputs, rec.input_shapes)]
        outs_ = [grown(s) if (i, k) in made else s for k, s in enumerate(rec.output_shapes)]
        records.append(OpRecord(rec.op, rec.attrs, rec.inputs, ins, rec.input_dtypes, outs_, rec.output_dtypes))
    return dataclasses.replace(fn, ops=records)
