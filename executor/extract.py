"""Cut a node range out of a bundle into a standalone, runnable bundle.

Received boundary entries become graph inputs (null nodes named `<producer>:<output>`), sent ones
become graph outputs (heads, in entry-id order); only the kernels, op programs and params the range
uses are kept. kernels.cu is copied whole: unused kernels cost nothing and trimming C is fragile.
Used to debug one stage of a pipeline alone, or to ship a stage to a machine by itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tvmpipe.bundle import Bundle, Graph, write_bundle
from tvmpipe.executor.errors import ExecutorError
from tvmpipe.executor.program import build_stage_program


def boundary_input_name(graph: Graph, entry: int) -> str:
    """Name of the graph input that stands for a received entry in an extracted bundle."""
    e = graph.entries[entry]
    return f"{graph.nodes[e.node].name}:{e.index}"


def extract_graph(bundle: Bundle, start: int, end: int) -> tuple[dict[str, Any], list[str], list[str]]:
    """graph.json content for nodes [start, end), its input names and its param names."""
    g = bundle.graph
    prog = build_stage_program(bundle, start, end)
    taken = {g.nodes[i].name for i in prog.op_nodes}
    nodes: list[dict[str, Any]] = []
    where: dict[int, tuple[int, int]] = {}  # old entry id -> (new node, output index)
    entries: list[int] = []  # old entry id of each new entry, in new entry order

    def null(name: str, eid: int) -> None:
        where[eid] = (len(nodes), 0)
        nodes.append({"op": "null", "name": name, "inputs": []})
        entries.append(eid)

    inputs = list(prog.input_names)
    for name, eid in prog.input_entries.items():
        null(name, eid)
    for eid in prog.recv_entries:
        name = boundary_input_name(g, eid)
        while name in taken or name in g.node_index:
            name += "'"
        inputs.append(name)
        null(name, eid)
    for name, eid in prog.param_entries.items():
        null(name, eid)
    n_null = len(nodes)
    for nid in prog.op_nodes:
        node = g.nodes[nid]
        refs = [list(where[e]) + [0] for e in g.input_entry_ids(nid)]
        for k, eid in enumerate(g.node_entry_ids(nid)):
            where[eid] = (len(nodes), k)
            entries.append(eid)
        nodes.append({"op": node.op, "name": node.name, "inputs": refs, "attrs": dict(node.attrs)})
    row_ptr = [0]
    for n in nodes:
        row_ptr.append(row_ptr[-1] + int(n.get("attrs", {}).get("num_outputs", 1)))
    attrs: dict[str, Any] = {
        "shape": ["list_shape", [list(g.entries[e].shape) for e in entries]],
        "dltype": ["list_str", [g.entries[e].dtype for e in entries]],
        "storage_id": ["list_int", [prog.storage.entry_slot[e] for e in entries]],
    }
    if any(g.entries[e].device_type is not None for e in entries):
        attrs["device_index"] = ["list_int", [g.entries[e].device_type or 2 for e in entries]]
    graph = {"nodes": nodes, "arg_nodes": list(range(n_null)), "node_row_ptr": row_ptr,
             "heads": [list(where[e]) + [0] for e in prog.send_entries], "attrs": attrs}
    return graph, inputs, list(prog.param_names)


def extract_bundle(bundle: Bundle, start: int, end: int, out: str | Path, overwrite: bool = False) -> Path:
    """Write nodes [start, end) of `bundle` as a bundle at `out` (atomic, validated on write); the
    source's state pairs the range reads are named in `source.extracted_from.state_as_plain_io`."""
    if bundle.is_bare or bundle.manifest is None:
        raise ExecutorError(f"{bundle.path}: extract needs a bundle directory; a bare graph.json has no kernels or ops")
    m = bundle.manifest
    graph, inputs, param_names = extract_graph(bundle, start, end)
    funcs = {n["attrs"]["func_name"] for n in graph["nodes"] if n["op"] != "null"}
    kernels = {"version": 1, "functions": {f: bundle.kernels[f].to_json() for f in sorted(funcs) if f in bundle.kernels}}
    ops = {"version": 1, "functions": {f: bundle.ops[f].to_json() for f in sorted(funcs) if f in bundle.ops}}
    generated = m.params_file is None and m.params_seed is not None
    params = None if generated else {n: bundle.params[n] for n in param_names}
    source = dict(m.source)
    source["extracted_from"] = {"model": m.model, "nodes": [start, end]}
    # An extracted range declares no state (it has no generation loop of its own to feed it): the
    # caches it reads are plain inputs and outputs there, which is recorded rather than left unsaid
    plain = [p.name for p in bundle.state if p.input in inputs]
    if plain:
        source["extracted_from"]["state_as_plain_io"] = plain
    return write_bundle(out, model=f"{m.model}[{start}:{end}]", source=source, target=m.target, batch=m.batch,
                        dtype=m.dtype, graph=graph, kernels=kernels, ops=ops, cuda_source=bundle.cuda_source,
                        inputs=inputs, params=params, params_seed=m.params_seed if generated else None,
                        tvm_version=m.tvm_version, overwrite=overwrite)
