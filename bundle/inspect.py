"""`tvmpipe inspect`: what a bundle (or a bare graph.json) holds, node by node.

It answers the questions users bring to a compiled model: "graph.json has 5 nodes but nsight shows
6 kernels: which kernels does each node launch, with which grid and block?" and "which model ops
were fused into this function?". `build_report` returns a plain dict, which is also the `--json`
output (schema SCHEMA: add keys, never rename them); `render_text` draws the summary and the node
table from that dict, so both views always say the same thing.

A bare graph.json knows nothing of kernels, fused ops, or which null nodes are inputs rather than
params: the report says `null` for those, and the text says "unknown", instead of guessing. Given
its params file (`--params`, a legacy deployment's .params), it knows inputs from weights and
shows the weight bytes each node reads.
"""

from __future__ import annotations

from typing import Any

from tvmpipe.bundle.bundle import Bundle
from tvmpipe.bundle.graph import DEVICE_TYPES, Graph, Node
from tvmpipe.core.table import Column, render_table
from tvmpipe.core.units import format_bytes

SCHEMA = "tvmpipe-inspect/1"
WIDTH = 100  # the terminal width the text table is laid out for, unless --wide
BARE = "unknown (bare graph.json)"


# ---- the report ----------------------------------------------------------------------------------

def build_report(bundle: Bundle) -> dict[str, Any]:
    """Everything `inspect` shows, as JSON-ready data; `None` marks what the input cannot tell."""
    g = bundle.graph
    m = bundle.manifest
    no_reuse, with_reuse = g.activation_bytes()
    null_entries = [g.entry_of(i) for i in g.null_nodes]
    param_names = bundle.param_names if bundle.knows_params else None
    params_file = m.params_file if m is not None else None if bundle.params_path is None else str(bundle.params_path)
    nodes = [_node_report(bundle, n, None if param_names is None else set(param_names)) for n in g.nodes]
    launches = None if m is None else sum(len(n["launches"]) for n in nodes)
    return {
        "schema": SCHEMA,
        "path": str(bundle.path),
        "kind": "graph" if m is None else "bundle",
        "model": bundle.name,
        "source": None if m is None else m.source,
        "target": None if m is None else m.target,
        "batch": None if m is None else m.batch,
        "dtype": None if m is None else m.dtype,
        "tvm_version": None if m is None else m.tvm_version,
        "created_by": None if m is None else m.created_by,
        "params": {
            "file": params_file,
            "generated": None if m is None or m.params_seed is None else {"seed": m.params_seed},
            "count": None if param_names is None else len(param_names),
            "bytes": None if param_names is None else sum(g.entry_of(n).nbytes for n in param_names),
        },
        "counts": {
            "nodes": len(g.nodes),
            "op_nodes": len(g.op_nodes),
            "null_nodes": len(g.null_nodes),
            "null_bytes": sum(e.nbytes for e in null_entries),
            "entries": g.num_entries,
            "heads": len(g.heads),
            "storage_ids": len(g.storage_sizes()),
            "functions": len({n.func_name for n in g.nodes if n.launches_kernels}),  # __nop/__copy launch nothing
            "kernel_launches": launches,
        },
        "activation_bytes": {"no_reuse": no_reuse, "with_reuse": with_reuse},
        "inputs": None if param_names is None else [_tensor(g, g.node_index[n]) for n in bundle.input_names],
        "outputs": [
            {"node": h.node, "name": g.nodes[h.node].name, "index": h.index, "entry": g.ref_entry(h),
             "shape": list(g.entries[g.ref_entry(h)].shape), "dtype": g.entries[g.ref_entry(h)].dtype}
            for h in g.heads
        ],
        "nodes": nodes,
        "state": None if m is None else [_state_pair(g, p, n) for p, n in zip(bundle.state, bundle.state_buffers.values())],
        "state_bytes_per_slot": None if m is None else bundle.state_bytes_per_slot,
        "state_resident_bytes_per_slot": None if m is None else bundle.state_resident_bytes_per_slot,
        "generation": None if m is None or m.generation is None else m.generation.to_json(),
        "weights": None if param_names is None else _weights(g, param_names, (m.source or {}) if m else {}),
    }


def _weights(g: Graph, param_names: list[str], source: dict[str, Any]) -> list[dict[str, Any]]:
    """Each weight with its format and bytes: a packed matrix (bundle.json `source.packed`: a
    quantized GGUF or --quantize bundle) as one entry over its fields, in its format (Q4_K, int4,
    ...); every other param in its dtype."""
    packed = source.get("packed") if isinstance(source.get("packed"), dict) else {}
    out, held = [], set()
    for matrix, info in packed.items():
        fields = [n for n in info.get("fields", {}).values() if n in g.node_index]
        held.update(fields)
        out.append({"name": matrix, "format": info.get("format"), "shape": info.get("shape"),
                    "bytes": sum(g.entry_of(n).nbytes for n in fields), "params": fields})
    for n in param_names:
        if n not in held:
            e = g.entry_of(n)
            out.append({"name": n, "format": e.dtype, "shape": list(e.shape), "bytes": e.nbytes, "params": [n]})
    return out


def _state_pair(g: Graph, p: Any, buffers: int) -> dict[str, Any]:
    """A pair as bundle.json declares it, with its tensor and the buffers a stage keeps for it per
    slot (1: updated in place)."""
    e = g.entry_of(p.input)
    return {**p.to_json(), "shape": list(e.shape), "dtype": e.dtype, "bytes": e.nbytes, "buffers": buffers}


def _tensor(g: Graph, nid: int) -> dict[str, Any]:
    e = g.entry_of(nid)
    return {"node": nid, "name": g.nodes[nid].name, "shape": list(e.shape), "dtype": e.dtype}


def _kind(n: Node, params: set[str] | None) -> str:
    if n.is_op:
        return "nop" if n.is_nop else "copy" if n.is_copy else "op"
    if params is None:
        return "null"  # input or param: a bare graph.json does not say
    return "param" if n.name in params else "input"


def _weight_bytes(g: Graph, n: Node, params: set[str] | None) -> int | None:
    """Bytes of the params (weights) a node holds or reads, each once; None where unknown."""
    if params is None:
        return None
    names = {n.name} if not n.is_op else {g.nodes[r.node].name for r in n.inputs}
    return sum(g.entry_of(name).nbytes for name in names & params)


def _node_report(bundle: Bundle, n: Node, params: set[str] | None) -> dict[str, Any]:
    g = bundle.graph
    bare = bundle.manifest is None
    launches: list | None = []
    workspaces: list | None = []
    ops: list | None = []
    if n.launches_kernels:
        if bare:
            launches = workspaces = ops = None
        else:
            kf = bundle.kernels[n.func_name]
            launches = [l.to_json() for l in kf.launches]
            workspaces = [w.to_json() for w in kf.workspaces]
            ops = [o.to_json() for o in bundle.ops[n.func_name].ops]
    return {
        "index": n.index,
        "name": n.name,
        "op": n.op,
        "kind": _kind(n, params),
        "func_name": n.func_name,
        "inputs": [{"node": r.node, "index": r.index, "entry": g.ref_entry(r)} for r in n.inputs],
        "outputs": [
            {"entry": e.id, "shape": list(e.shape), "dtype": e.dtype, "storage_id": e.storage_id,
             "device_type": e.device_type, "storage_scope": e.storage_scope}
            for e in (g.entries[i] for i in g.node_entry_ids(n.index))
        ],
        "launches": launches,
        "workspaces": workspaces,
        "ops": ops,
        "weight_bytes": _weight_bytes(g, n, params),
    }


# ---- text ----------------------------------------------------------------------------------------

def render_text(report: dict[str, Any], wide: bool = False) -> str:
    """The summary, then one row per node with its launches and fused ops indented below it (and,
    with stages, one row per stage with the weight bytes it loads)."""
    title, rows = _summary(report)
    text = [f"  {k:<12} {v}" if wide or k in PATH_ROWS else _clip(f"  {k:<12} {v}", WIDTH) for k, v in rows]
    return "\n".join([title, *text, "", *_stage_table(report), *_weight_table(report), *_table(report, wide)]) + "\n"


def _weight_table(r: dict[str, Any]) -> list[str]:
    """Each weight's format, shape and bytes, where the bundle holds packed (quantized) matrices."""
    ws = r.get("weights") or []
    if not any(w["params"] != [w["name"]] for w in ws):
        return []
    rows = [(w["name"], str(w["format"]), "x".join(map(str, w["shape"] or [])), format_bytes(w["bytes"])) for w in ws]
    return render_table([Column(t) for t in ("weight", "format", "shape", "bytes")], rows) + [""]


def stage_weights(bundle: Bundle, stages: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per node range: the params its op nodes read and their bytes, from the graph (no data read).
    A param read by two stages is loaded, and counted, by both."""
    g = bundle.graph
    params = set(bundle.param_names) if bundle.knows_params else None
    out = []
    for i, (start, end) in enumerate(stages):
        names = None if params is None else sorted(
            {g.nodes[r.node].name for n in range(start, end) for r in g.nodes[n].inputs} & params)
        out.append({"stage": i, "nodes": [start, end], "ops": sum(1 for n in range(start, end) if g.nodes[n].is_op),
                    "params": None if names is None else len(names),
                    "weight_bytes": None if names is None else sum(g.entry_of(n).nbytes for n in names)})
    return out


def _stage_table(r: dict[str, Any]) -> list[str]:
    if not r.get("stages"):
        return []
    rows = [(str(s["stage"]), f"[{s['nodes'][0]}, {s['nodes'][1]})", str(s["ops"]),
             "unknown" if s["params"] is None else str(s["params"]),
             "unknown" if s["weight_bytes"] is None else format_bytes(s["weight_bytes"])) for s in r["stages"]]
    return render_table([Column(t) for t in ("stage", "nodes", "ops", "params", "weights")], rows) + [""]


def _token_shape(r: dict, gen: dict) -> list[int]:
    """The shape of a decode step's token input ([B, C]), from the report's inputs."""
    return next(i["shape"] for i in r["inputs"] if i["name"] == gen["token"])


def _tensor_type(dtype: str, shape: list[int]) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


# Summary rows never clipped, like the title: they end in a file's path, which is copied whole
PATH_ROWS = ("params",)


def _summary(r: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    c, p = r["counts"], r["params"]
    bare = r["kind"] == "graph"
    known = r["inputs"] is not None  # a bundle, or a bare graph.json given its params file
    kinds = [n["kind"] for n in r["nodes"]]
    special = ", ".join(f"{kinds.count(k)} {f}" for k, f in (("nop", "__nop"), ("copy", "__copy")) if k in kinds)
    rows = [("nodes", f"{c['nodes']}: {c['op_nodes']} op{f' ({special})' if special else ''}, {c['null_nodes']} null"),
            ("entries", f"{c['entries']} in {c['storage_ids']} storage ids; {c['heads']} head(s)")]
    if not bare:
        src, tgt = r["source"], r["target"]
        rows = [("source", " ".join(str(src.get(k)) for k in ("kind", "name") if src.get(k) is not None)
                 + (f" sha256 {str(src['sha256'])[:12]}" if src.get("sha256") else "")),
                ("target", " ".join([str(tgt[k]) for k in ("kind", "arch") if k in tgt]
                                    + [f"{k}={v}" for k, v in tgt.items() if k not in ("kind", "arch")])
                 + f"; batch {r['batch']}, dtype {r['dtype']}"),
                ("built by", f"{r['created_by'] or 'unknown'}, TVM {r['tvm_version'] or 'unknown'}")] + rows
    if known:
        rows.append(("inputs", f"{len(r['inputs'])}: " + ", ".join(
            f"{i['name']} {_tensor_type(i['dtype'], i['shape'])}" for i in r["inputs"])))
        where = (f"generated on load from seed {p['generated']['seed']} (not stored in the bundle)"
                 if p["file"] is None else f"in {p['file']}")
        rows.append(("params", f"{p['count']}, {format_bytes(p['bytes'])}, {where}"))
    else:
        rows += [("inputs", f"{BARE}: {c['null_nodes']} null nodes, {format_bytes(c['null_bytes'])}, "
                            "are inputs and params together"),
                 ("params", BARE)]
    rows.append(("outputs", f"{len(r['outputs'])}: " + ", ".join(
        f"node {o['node']}" + (f":{o['index']}" if o["index"] else "") + f" '{o['name']}' "
        + _tensor_type(o["dtype"], o["shape"]) for o in r["outputs"])))
    if r.get("state"):
        per = {}
        for st in r["state"]:
            per.setdefault((st["dtype"], tuple(st["shape"])), []).append(st)
        kinds = "; ".join(f"{len(v)} x {_tensor_type(d, list(sh))}" for (d, sh), v in per.items())
        stage = sum(st["bytes"] for st in r["state"] if st.get("scope") == "stage")
        if stage == r["state_bytes_per_slot"]:  # a paged step: pools shared by every row and slot
            rows.append(("state", f"{len(r['state'])} pool(s) ({kinds}), {format_bytes(stage)} for the stage"))
        else:
            rows.append(("state", f"{len(r['state'])} pair(s) ({kinds}), {format_bytes(r['state_bytes_per_slot'])} "
                                  f"per sequence slot (batch {r['batch']})"))
        in_place = sum(st["buffers"] == 1 for st in r["state"])
        held = "" if stage == r["state_bytes_per_slot"] else " a slot"
        rows.append(("state held", f"{format_bytes(r['state_resident_bytes_per_slot'])}{held} in the stages: {in_place} "
                                   f"pair(s) updated in place, {len(r['state']) - in_place} in two buffers"))
        rows.append(("state pairs", ", ".join(f"{st['name']}: {st['input']} <- output {st['output']}"
                                              + (f" (fill {st['init']['fill']:g})" if st["init"]["fill"] else "")
                                              for st in r["state"])))
    if r.get("generation"):
        gen = r["generation"]
        chunked = f" (up to {_token_shape(r, gen)[-1]} a row, count {gen['count']})" if gen.get("count") else ""
        rows.append(("generation", f"token {gen['token']}{chunked}, position {gen['position']}, logits output "
                                   f"{gen['logits']}, max context {gen['max_context']}, vocab {gen['vocab_size']}"))
        pg = gen.get("paged")
        decode = (r["source"] or {}).get("decode")
        why = decode.get("kv", {}).get("reason") if isinstance(decode, dict) and isinstance(decode.get("kv"), dict) \
            else None  # the compiler's reason a step compiled without --kv is not paged
        rows.append(("kv cache", "static, [B, H_kv, T, D] per layer and sequence slot" if pg is None else
                     f"paged, page size {pg['page_size']}, pool {pg['pages']} pages shared by the stage's rows"))
        if pg is None and why:
            rows.append(("not paged", why))
        if pg is not None:
            rows.append(("page table", ", ".join(pg[k] for k in ("indptr", "values", "last_page_len", "position_map",
                                                                 "q_indptr") if pg.get(k))))
    if r.get("weights") and any(w["params"] != [w["name"]] for w in r["weights"]):  # packed matrices
        per: dict[str, list[int]] = {}
        for w in r["weights"]:
            per.setdefault(w["format"], []).append(w["bytes"])
        rows.append(("weights", ", ".join(f"{f} {len(b)} ({format_bytes(sum(b))})" for f, b in
                                          sorted(per.items(), key=lambda kv: -sum(kv[1])))))
    a = r["activation_bytes"]
    rows.append(("activations", f"{format_bytes(a['no_reuse'])} without storage reuse, "
                                f"{format_bytes(a['with_reuse'])} with TVM's storage plan"))
    if bare:
        rows += [("kernels", BARE), ("fused ops", BARE)]
    else:
        rows.append(("kernels", f"{c['kernel_launches']} launch(es) per run from {c['functions']} function(s)"))
    title = f"{r['model']}  ({'bare graph.json' if bare else 'bundle'} {r['path']})"
    return title, rows


def _ellipsize(s: str, width: int) -> str:
    """Cut the middle out, keeping more of the end: fused names share long prefixes
    (tvmgen_default_fused_...) and differ at the end (..._relu_1, ..._kernel_2)."""
    if len(s) <= width:
        return s
    if width <= 3:
        return s[:width]
    head = (width - 3) // 3
    return s[:head] + "..." + s[len(s) - (width - 3 - head):]


def _clip(s: str, width: int) -> str:
    """Cut the end: for lists (inputs, ops) the start matters most."""
    return s if len(s) <= width else s[:max(width - 3, 0)] + "..."


# Column name, width in the 100-column layout, how to shorten a cell that does not fit.
_COLUMNS = (("#", 4, _clip), ("name", 22, _ellipsize), ("func_name", 30, _ellipsize),
            ("inputs", 9, _clip), ("outputs", 21, _clip), ("sid", 9, _clip))
_SUB_INDENT = 7  # launches / ops lines sit under the name column


def _table(r: dict[str, Any], wide: bool) -> list[str]:
    mixed_devices = len({o["device_type"] for n in r["nodes"] for o in n["outputs"]}) > 1
    items: list[list[str] | str] = []  # table rows (cells) and the detail lines under them (str)
    for n in r["nodes"]:
        first, *more = [[_tensor_type(o["dtype"], o["shape"]), _storage(o, mixed_devices)] for o in n["outputs"]]
        inputs = ",".join(f"{i['node']}:{i['index']}" if i["index"] else str(i["node"]) for i in n["inputs"])
        items.append([str(n["index"]), n["name"], n["func_name"] or f"({n['kind']})", inputs, *first])
        items += [["", "", "", "", *cells] for cells in more]  # further outputs of a multi-output node
        items += _details(n, r["kind"] == "graph", wide)
    columns = [Column(h, None if wide else w, cut=cut) for h, w, cut in _COLUMNS]
    indent = " " * _SUB_INDENT
    return render_table(columns, [i if isinstance(i, list) else indent + (i if wide else _clip(i, WIDTH - _SUB_INDENT))
                                  for i in items], gap=1)


def _storage(o: dict[str, Any], mixed_devices: bool) -> str:
    s = str(o["storage_id"])
    if mixed_devices and o["device_type"] is not None:
        s += "@" + DEVICE_TYPES.get(o["device_type"], f"dev{o['device_type']}")
    if o["storage_scope"] not in (None, "", "global"):
        s += f" ({o['storage_scope']})"
    return s


def _details(n: dict[str, Any], bare: bool, wide: bool) -> list[str]:
    """The lines under a node row: its kernel launches, workspaces, fused model ops and the weights it reads."""
    if n["kind"] == "nop":
        return ["no launch: __nop output aliases its input's storage"]
    if n["kind"] == "copy":
        return ["no kernel: __copy copies across devices"]
    if n["kind"] != "op":
        return []  # null nodes
    weights = [f"weights {format_bytes(n['weight_bytes'])}"] if n["weight_bytes"] else []
    if bare:
        return weights  # the summary says kernels and fused ops are unknown
    dims = [f"  grid {'x'.join(map(str, l['grid']))}  block {'x'.join(map(str, l['block']))}  smem {l['shared_mem']}"
            for l in n["launches"]]
    name_w = max(len(l["kernel"]) for l in n["launches"])
    if not wide:  # shorten kernel names, never the grid/block figures after them
        name_w = min(name_w, WIDTH - _SUB_INDENT - len("launch ") - max(map(len, dims)))
    out = [f"launch {_ellipsize(l['kernel'], name_w).ljust(name_w)}{d}" for l, d in zip(n["launches"], dims)]
    if n["workspaces"]:
        out.append("workspaces " + ", ".join(format_bytes(w["nbytes"]) for w in n["workspaces"]))
    out.append("ops    " + ", ".join(o["op"] for o in n["ops"]))
    return out + weights
