"""Random small graph.json DAGs (skip connections, multi-output ops, __nop views, shared functions)
and an independent, deliberately naive stage-cost reference to check the planner's tables against."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

from tvmpipe.bundle import Bundle, parse_graph
from tvmpipe.bundle.manifests import KernelFunction, Workspace


def random_graph(rng: random.Random, n_ops: int) -> tuple[dict, list[str]]:
    """A valid graph.json dict with `n_ops` op nodes, and the names of its graph inputs."""
    nodes, shapes, dtypes = [], [], []
    inputs: list[str] = []
    avail_ops: list[tuple[int, int]] = []  # (node, output) of op outputs
    row = [0]
    funcs = [f"fused_f{i}" for i in range(max(1, n_ops // 2))]

    def add(node: dict, outs: list[tuple[list[int], str]]) -> int:
        nodes.append(node)
        for sh, dt in outs:
            shapes.append(sh)
            dtypes.append(dt)
        row.append(row[-1] + len(outs))
        return len(nodes) - 1

    def null(kind: str) -> int:
        name = f"{kind}{len(nodes)}"
        if kind == "in":
            inputs.append(name)
        return add({"op": "null", "name": name, "inputs": []}, [([rng.randint(1, 64)], rng.choice(["float32", "float16"]))])

    null("in")
    for k in range(n_ops):
        refs = []
        for _ in range(rng.randint(0, 2)):
            nulls = [i for i, nd in enumerate(nodes) if nd["op"] == "null"]
            if rng.random() < 0.25:  # a param or input read by several ops (maybe several stages)
                refs.append([rng.choice(nulls), 0, 0])
            else:
                refs.append([null(rng.choice(["in", "w", "w", "w"])), 0, 0])
        if avail_ops and rng.random() < 0.2:
            src = rng.choice(avail_ops)
            add({"op": "tvm_op", "name": f"nop{k}", "inputs": [[src[0], src[1], 0]],
                 "attrs": {"func_name": "__nop", "num_inputs": "1", "num_outputs": "1", "flatten_data": "0"}},
                [(shapes[row[src[0]] + src[1]], dtypes[row[src[0]] + src[1]])])
            avail_ops.append((len(nodes) - 1, 0))
            continue
        if avail_ops:
            # usually the latest output, sometimes a skip from further back
            picks = {avail_ops[-1]} if rng.random() < 0.8 else set()
            for _ in range(rng.randint(0, 2)):
                picks.add(rng.choice(avail_ops))
            refs += [[a, b, 0] for a, b in sorted(picks)]
        refs = refs or [[0, 0, 0]]  # duplicates stay: TVM graphs have add(x, x)
        nout = 2 if rng.random() < 0.15 else 1
        nid = add({"op": "tvm_op", "name": f"op{k}", "inputs": refs,
                   "attrs": {"func_name": rng.choice(funcs), "num_inputs": str(len(refs)),
                             "num_outputs": str(nout), "flatten_data": "0"}},
                  [([rng.randint(1, 256)], rng.choice(["float32", "float16"])) for _ in range(nout)])
        avail_ops += [(nid, o) for o in range(nout)]
    if rng.random() < 0.3:
        null("w")  # a param nobody reads
    op_nodes = [i for i, n in enumerate(nodes) if n["op"] != "null"]
    heads = {(op_nodes[-1], 0)} | {rng.choice(avail_ops) for _ in range(rng.randint(0, 2))}
    graph = {"nodes": nodes, "arg_nodes": [i for i, n in enumerate(nodes) if n["op"] == "null"],
             "node_row_ptr": row, "heads": [[a, b, 0] for a, b in sorted(heads)],
             "attrs": {"shape": ["list_shape", shapes], "dltype": ["list_str", dtypes],
                       "storage_id": ["list_int", list(range(len(shapes)))]}}
    return graph, inputs


def random_bundle(rng: random.Random, n_ops: int) -> tuple[Bundle, list[str], dict[str, int]]:
    """A bare Bundle over a random graph, with workspaces on some functions."""
    obj, inputs = random_graph(rng, n_ops)
    graph = parse_graph(obj, source="random")
    funcs = sorted({n.func_name for n in graph.nodes if n.launches_kernels})
    ws = {fn: rng.choice([0, 16, 400]) for fn in funcs}
    kernels = {fn: KernelFunction(fn, [], [Workspace(b, "uint8", (b,))] if b else []) for fn, b in ws.items()}
    return Bundle(path=Path("random.json"), graph=graph, kernels=kernels), inputs, ws


def random_profile(rng: random.Random, bundle: Bundle) -> dict:
    g = bundle.graph
    return {"nodes": [{"index": n.index, "name": n.name, "time_us": 0.0 if n.is_nop else round(rng.uniform(1, 100), 3),
                       "calls": 1} for n in g.nodes if n.is_op]}


# ---- naive reference ---------------------------------------------------------------------------

class Reference:
    """Stage costs straight from the graph, one stage at a time, no tables."""

    def __init__(self, bundle: Bundle, inputs: list[str], times: list[float], ws: dict[str, int],
                 bandwidth: float, latency_us: float):
        self.g = bundle.graph
        self.inputs, self.times, self.ws = set(inputs), times, ws
        self.bw, self.lat = bandwidth, latency_us
        self.ops = self.g.op_nodes
        self.ordinal = {nid: k for k, nid in enumerate(self.ops)}
        self.heads = set(self.g.head_entries)

    def root(self, eid: int) -> int:
        node = self.g.nodes[self.g.entries[eid].node]
        return self.root(self.g.ref_entry(node.inputs[0])) if node.is_nop else eid

    def uses(self, eid: int) -> list[int]:
        return [self.ordinal[c] for c in self.g.consumers[eid] if c in self.ordinal]

    def recv(self, a: int, b: int) -> set[int]:
        out = set()
        for nid in self.ops[a:b]:
            for eid in self.g.input_entry_ids(nid):
                src = self.g.nodes[self.g.entries[eid].node]
                if (src.is_op and self.ordinal[src.index] < a) or (not src.is_op and src.name in self.inputs):
                    out.add(eid)
        return out

    def send(self, a: int, b: int) -> set[int]:
        """Entries produced by ops in [a, b) that an op after the stage reads, or graph outputs."""
        return {eid for nid in self.ops[a:b] for eid in self.g.node_entry_ids(nid)
                if eid in self.heads or any(u >= b for u in self.uses(eid))}

    def nbytes(self, eids) -> int:
        return sum(self.g.entries[e].nbytes for e in eids)

    def memory(self, a: int, b: int) -> int:
        g = self.g
        params = {e for nid in self.ops[a:b] for e in g.input_entry_ids(nid)
                  if not g.nodes[g.entries[e].node].is_op and g.nodes[g.entries[e].node].name not in self.inputs}
        ws = sum(self.ws.get(fn, 0) for fn in {g.nodes[nid].func_name for nid in self.ops[a:b]})
        op_entries = [e.id for e in g.entries if g.nodes[e.node].is_op]
        peak = 0
        for t in range(a, b):
            live = 0
            for r in op_entries:
                if self.root(r) != r or not a <= self.ordinal[g.entries[r].node] <= t:
                    continue
                group = [e for e in op_entries if self.root(e) == r]
                if (any(u >= t for e in group for u in self.uses(e)) or any(e in self.heads for e in group)
                        or self.ordinal[g.entries[r].node] == t):
                    live += g.entries[r].nbytes
            peak = max(peak, live)
        return self.nbytes(params) + ws + self.nbytes(self.recv(a, b)) + peak

    def time(self, a: int, b: int, speed: float) -> float:
        rb = self.nbytes(self.recv(a, b))
        return sum(self.times[a:b]) / speed + (self.lat + rb / self.bw * 1e6 if rb else 0.0)


def brute_force(ref: Reference, k: int, speeds: list[float], caps: list[int | None], tolerance: float):
    """(best bottleneck, fewest bytes within tolerance) over every K-stage plan, or None if none fits."""
    n = len(ref.ops)
    plans = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        stages = list(zip(bounds, bounds[1:]))
        if any(caps[s] is not None and ref.memory(a, b) > caps[s] for s, (a, b) in enumerate(stages)):
            continue
        bottleneck = max(ref.time(a, b, speeds[s]) for s, (a, b) in enumerate(stages))
        plans.append((bottleneck, sum(ref.nbytes(ref.recv(a, b)) for a, b in stages)))
    if not plans:
        return None
    best = min(p[0] for p in plans)
    limit = best * (1 + tolerance) + 1e-9 * max(best, 1.0)
    return best, min(m for bn, m in plans if bn <= limit)


def isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
