"""Reading graph.json, as every TVM era wrote it, into a checked Graph (graph.py).

The reader collects every problem it finds before raising, because users repair these files by
hand and one-error-at-a-time is slow. It never allocates tensor memory, so a hostile shape costs
nothing, and it accepts the NNVM (2018-19) and Relay (2020-24) variants side by side.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tvmpipe.bundle import dtypes
from tvmpipe.bundle.errors import GraphError, Problem, ProblemCollector
from tvmpipe.bundle.graph import Entry, EntryRef, Graph, Node

TOP_KEYS = {"nodes", "arg_nodes", "node_row_ptr", "heads", "attrs", "metadata"}
REQUIRED_TOP_KEYS = ("nodes", "arg_nodes", "node_row_ptr", "heads", "attrs")
NODE_KEYS = {"op", "name", "inputs", "attrs", "attr", "control_deps"}
# attrs arrays TVM's GraphExecutor reads; each entry: attr name -> expected type tag.
ENTRY_ATTRS = {
    "shape": "list_shape",
    "dltype": "list_str",
    "storage_id": "list_int",
    "device_index": "list_int",
    "storage_scope": "list_str",
    "dtype": "list_int",  # NNVM era, beside dltype
}
REQUIRED_ENTRY_ATTRS = ("shape", "dltype", "storage_id")
# A single tensor above this is certainly a corrupt file, not a model.
MAX_ENTRY_BYTES = 1 << 40
# No model has a tensor of higher rank (params.py reads .params with the same bound); a corrupt
# shape with thousands of dimensions must not cost a huge product or message.
MAX_NDIM = 32

def read_graph(path: str | Path) -> Graph:
    """Read and validate a graph.json file; GraphError lists every problem found."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GraphError([Problem(str(path), "", "", "file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GraphError([Problem(str(path), "", "", f"cannot read: {exc}")]) from None
    return parse_graph_text(text, source=str(path))


def parse_graph_text(text: str, source: str = "graph.json") -> Graph:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GraphError([Problem(source, "", "", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")]) from None
    except RecursionError:
        raise GraphError([Problem(source, "", "", "not valid JSON: nested too deeply")]) from None
    except ValueError as exc:  # e.g. an integer literal over Python's 4300-digit conversion limit
        raise GraphError([Problem(source, "", "", f"not valid JSON: {exc}")]) from None
    return parse_graph(obj, source=source)


def parse_graph(obj: Any, source: str = "graph.json") -> Graph:
    """Validate a decoded graph.json object and build the Graph, or raise GraphError."""
    return _GraphReader(source).read(obj)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_int(v: Any) -> int | None:
    """TVM writes node attrs as strings ("1"); accept ints and integer strings."""
    if _is_int(v):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return None
    return None


class _GraphReader(ProblemCollector):
    """Builds a Graph from decoded graph.json, collecting every problem; stops early only where a
    later check would need what is broken (no node list, no addressable entries)."""

    def fail_if_any(self) -> None:
        self.raise_if_any(GraphError)

    def read(self, obj: Any) -> Graph:
        if not isinstance(obj, dict):
            self.bad("", "", f"top level must be a JSON object, got {type(obj).__name__}")
            self.fail_if_any()
        for key in REQUIRED_TOP_KEYS:
            if key not in obj:
                self.bad("", key, "missing required key")
        self.unknown_keys(obj, TOP_KEYS, "", what="top-level key")
        self.fail_if_any()

        nodes = self.read_nodes(obj["nodes"])
        if not nodes:
            self.fail_if_any()
        row_ptr = self.read_row_ptr(obj["node_row_ptr"], nodes)
        self.check_inputs(nodes)
        arg_nodes = self.read_arg_nodes(obj["arg_nodes"], nodes)
        heads = [r for i, h in enumerate(_list_or_empty(obj["heads"], self, "heads"))
                 if (r := self.read_ref(h, nodes, "", f"heads[{i}]")) is not None]
        metadata = obj.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            self.bad("", "metadata", "must be an object")
        elif not _finite(metadata):
            self.bad("", "metadata", "holds NaN or Infinity, which JSON cannot represent")
        if row_ptr is None:  # entry ids are not addressable: the attrs arrays cannot be read
            self.fail_if_any()
        entries, extra = self.read_attrs(obj["attrs"], nodes, row_ptr)
        self.fail_if_any()
        return Graph(nodes=nodes, arg_nodes=arg_nodes, node_row_ptr=row_ptr, heads=heads,
                     entries=entries, metadata=metadata, extra_attrs=extra, source=self.file)

    # -- nodes --
    def read_nodes(self, raw: Any) -> list[Node]:
        if not isinstance(raw, list):
            self.bad("", "nodes", "must be a list")
            return []
        if not raw:
            self.bad("", "nodes", "graph has no nodes")
        nodes = []
        for i, rn in enumerate(raw):
            where = f"node {i}"
            if not isinstance(rn, dict):
                self.bad(where, "", "must be an object")
                nodes.append(Node(index=i, op="null", name=f"<node {i}>", inputs=[]))
                continue
            name = rn.get("name")
            if isinstance(name, str):
                where = f"node {i} '{name}'"
            else:
                self.bad(where, "name", "missing or not a string")
                name = f"<node {i}>"
            self.unknown_keys(rn, NODE_KEYS, where, what="node key")
            op = rn.get("op")
            if op not in ("null", "tvm_op"):
                self.bad(where, "op", f"must be 'null' or 'tvm_op', got {op!r}")
                op = "null"
            attrs = rn.get("attrs", rn.get("attr", {}))
            if not isinstance(attrs, dict):
                self.bad(where, "attrs", "must be an object")
                attrs = {}
            elif not _finite(attrs):
                self.bad(where, "attrs", "holds NaN or Infinity, which JSON cannot represent")
            raw_inputs = rn.get("inputs")
            if not isinstance(raw_inputs, list):
                self.bad(where, "inputs", "missing or not a list")
                raw_inputs = []
            inputs = []
            for k, ref in enumerate(raw_inputs):
                r = self.parse_ref(ref, where, f"inputs[{k}]")
                if r is not None:
                    inputs.append(r)
            node = Node(index=i, op=op, name=name, inputs=inputs, attrs=attrs)
            if op == "tvm_op":
                self.check_op_attrs(node, where, len(raw_inputs))
            elif raw_inputs:
                self.bad(where, "inputs", "a null node (graph input or param) cannot have inputs")
            nodes.append(node)
        names: dict[str, int] = {}
        for n in nodes:
            if n.name in names:
                self.bad(n.label(), "name", f"duplicate node name (also node {names[n.name]})")
            names.setdefault(n.name, n.index)
        return nodes

    def check_op_attrs(self, node: Node, where: str, n_inputs: int) -> None:
        fn = node.attrs.get("func_name")
        if not isinstance(fn, str) or not fn:
            self.bad(where, "attrs.func_name", "a tvm_op node needs a non-empty func_name")
        nout = _as_int(node.attrs.get("num_outputs", 1))
        if nout is None or nout < 1:
            self.bad(where, "attrs.num_outputs", f"must be a positive integer, got {node.attrs.get('num_outputs')!r}")
            node.attrs["num_outputs"] = "1"
        nin = node.attrs.get("num_inputs")
        if nin is not None and _as_int(nin) != n_inputs:
            self.bad(where, "attrs.num_inputs", f"says {nin!r} but the node has {n_inputs} inputs")
        flat = node.attrs.get("flatten_data")
        if flat is not None and _as_int(flat) not in (0, 1):
            self.bad(where, "attrs.flatten_data", f"must be 0 or 1, got {flat!r}")

    def parse_ref(self, ref: Any, where: str, fld: str) -> EntryRef | None:
        if not (isinstance(ref, list) and len(ref) in (2, 3) and all(_is_int(v) for v in ref)):
            self.bad(where, fld, f"must be [node, index] or [node, index, version] of integers, got {ref!r}")
            return None
        if ref[0] < 0 or ref[1] < 0:
            self.bad(where, fld, f"negative node or output index in {ref!r}")
            return None
        return EntryRef(ref[0], ref[1], ref[2] if len(ref) == 3 else 0)

    def read_ref(self, raw: Any, nodes: list[Node], where: str, fld: str) -> EntryRef | None:
        r = self.parse_ref(raw, where, fld)
        if r is None:
            return None
        if r.node >= len(nodes):
            self.bad(where, fld, f"refers to node {r.node}, but the graph has {len(nodes)} nodes")
            return None
        if r.index >= nodes[r.node].num_outputs:
            self.bad(where, fld, f"refers to output {r.index} of {nodes[r.node].label()}, which has {nodes[r.node].num_outputs} output(s)")
            return None
        return r

    def check_inputs(self, nodes: list[Node]) -> None:
        """Dangling, out-of-range and forward references; a forward one that closes a loop is a cycle."""
        forward = False
        for n in nodes:
            for k, r in enumerate(n.inputs):
                fld = f"inputs[{k}]"
                if r.node >= len(nodes):
                    self.bad(n.label(), fld, f"dangling reference to node {r.node} (graph has {len(nodes)} nodes)")
                elif r.index >= nodes[r.node].num_outputs:
                    self.bad(n.label(), fld, f"refers to output {r.index} of {nodes[r.node].label()}, which has {nodes[r.node].num_outputs} output(s)")
                elif r.node >= n.index:
                    forward = True
        if forward:
            cyc = _find_cycle(nodes)
            if cyc:
                path = " -> ".join(str(i) for i in cyc)
                self.bad(nodes[cyc[0]].label(), "inputs", f"cycle between nodes {path}")
            for n in nodes:
                for k, r in enumerate(n.inputs):
                    if n.index <= r.node < len(nodes) and (not cyc or n.index not in cyc):
                        self.bad(n.label(), f"inputs[{k}]",
                                 f"forward reference to node {r.node}: nodes must be in topological order")

    def read_row_ptr(self, raw: Any, nodes: list[Node]) -> list[int] | None:
        """node_row_ptr, or None (with problems reported) when it disagrees with the nodes' outputs."""
        if not isinstance(raw, list) or not all(_is_int(v) for v in raw):
            self.bad("", "node_row_ptr", "must be a list of integers")
            self.fail_if_any()
        if len(raw) != len(nodes) + 1:
            self.bad("", "node_row_ptr", f"has {len(raw)} items, expected nodes + 1 = {len(nodes) + 1}")
            self.fail_if_any()
        before = len(self.problems)
        if raw[0] != 0:
            self.bad("", "node_row_ptr[0]", f"must be 0, got {raw[0]}")
        for i, n in enumerate(nodes):
            step = raw[i + 1] - raw[i]
            if step < 0:
                self.bad(n.label(), f"node_row_ptr[{i + 1}]", f"not monotone: {raw[i + 1]} < {raw[i]}")
            elif step != n.num_outputs:
                self.bad(n.label(), f"node_row_ptr[{i + 1}]",
                         f"gives {step} entries but the node has {n.num_outputs} output(s)")
        return list(raw) if len(self.problems) == before else None

    def read_arg_nodes(self, raw: Any, nodes: list[Node]) -> list[int]:
        if not isinstance(raw, list) or not all(_is_int(v) for v in raw):
            self.bad("", "arg_nodes", "must be a list of node indices")
            return []
        listed: set[int] = set()
        for k, a in enumerate(raw):
            if not 0 <= a < len(nodes):
                self.bad("", f"arg_nodes[{k}]", f"node {a} is out of range (graph has {len(nodes)} nodes)")
            elif nodes[a].is_op:
                self.bad("", f"arg_nodes[{k}]", f"{nodes[a].label()} is a tvm_op, not a null node")
            elif a in listed:
                self.bad("", f"arg_nodes[{k}]", f"{nodes[a].label()} is listed twice")
            listed.add(a)
        for n in nodes:  # TVM can only feed a null node through arg_nodes; one left out is never set
            if not n.is_op and n.index not in listed:
                self.bad(n.label(), "arg_nodes", "null node (graph input or param) is not listed in arg_nodes")
        return list(raw)

    # -- per-entry attrs --
    def read_attrs(self, raw: Any, nodes: list[Node], row_ptr: list[int]) -> tuple[list[Entry], dict]:
        if not isinstance(raw, dict):
            self.bad("", "attrs", "must be an object")
            self.fail_if_any()
        n_entries = row_ptr[-1]
        before = len(self.problems)
        cols: dict[str, list] = {}
        extra: dict[str, Any] = {}
        for key in REQUIRED_ENTRY_ATTRS:
            if key not in raw:
                self.bad("", f"attrs.{key}", "missing required attribute")
        for key, val in raw.items():
            tag = ENTRY_ATTRS.get(key)
            if tag is None and isinstance(val, list) and len(val) == 2 and val[0] == "size_t":
                # TVM skips unknown graph attrs tagged list_int or size_t; size_t holds one number.
                if not (_is_int(val[1]) and val[1] >= 0):
                    self.bad("", f"attrs.{key}", f"size_t attribute must hold a non-negative integer, got {val[1]!r}")
                extra[key] = val
                continue
            if not (isinstance(val, list) and len(val) == 2 and isinstance(val[0], str) and isinstance(val[1], list)):
                self.bad("", f"attrs.{key}", 'must be ["<type>", [values...]]')
                continue
            if tag is None:
                if val[0] not in ("list_int", "list_str", "list_shape"):
                    self.bad("", f"attrs.{key}", f"unknown attribute with unknown type tag {val[0]!r}")
                extra[key] = val  # TVM ignores unknown list attrs; we keep them for round trips
                continue
            if val[0] != tag:
                self.bad("", f"attrs.{key}", f"type tag must be {tag!r}, got {val[0]!r}")
                continue
            if len(val[1]) != n_entries:
                self.bad("", f"attrs.{key}", f"has {len(val[1])} items but node_row_ptr gives {n_entries} entries")
                continue
            cols[key] = val[1]
        if len(self.problems) > before:
            self.fail_if_any()

        owner = [0] * n_entries
        for i in range(len(nodes)):
            for e in range(row_ptr[i], row_ptr[i + 1]):
                owner[e] = i
        entries = []
        sid_device: dict[int, tuple[int, int]] = {}
        for eid in range(n_entries):
            nid = owner[eid]
            where = f"entry {eid} ({nodes[nid].label()} output {eid - row_ptr[nid]})"
            shape = cols["shape"][eid]
            if not (isinstance(shape, list) and all(_is_int(d) for d in shape)):
                self.bad(where, "attrs.shape", f"must be a list of integers, got {shape!r}")
                continue
            if any(d < 0 for d in shape):
                self.bad(where, "attrs.shape", f"negative dimension in {shape}")
                continue
            if len(shape) > MAX_NDIM:
                self.bad(where, "attrs.shape", f"rank {len(shape)} is over the {MAX_NDIM}-dimension limit")
                continue
            dt = cols["dltype"][eid]
            if not dtypes.is_known(dt):
                self.bad(where, "attrs.dltype", f"unknown dtype {dt!r} (known: {', '.join(dtypes.DTYPES)})")
                continue
            if "dtype" in cols:
                code = cols["dtype"][eid]
                if not _is_int(code) or dtypes.NNVM_TYPE_CODES.get(code) != dt:
                    self.bad(where, "attrs.dtype", f"NNVM type code {code!r} disagrees with dltype {dt!r}")
            nbytes = math.prod(shape) * dtypes.itemsize(dt)
            if nbytes > MAX_ENTRY_BYTES:
                self.bad(where, "attrs.shape", f"shape {shape} of {dt} is over the {MAX_ENTRY_BYTES}-byte tensor limit")
            sid = cols["storage_id"][eid]
            if not _is_int(sid) or not 0 <= sid < n_entries:
                # TVM numbers storage densely (at most one id per entry); executors index pools by id.
                self.bad(where, "attrs.storage_id", f"must be an integer in [0, {n_entries}), got {sid!r}")
                continue
            dev = None
            if "device_index" in cols:
                dev = cols["device_index"][eid]
                if not _is_int(dev):
                    self.bad(where, "attrs.device_index", f"must be an integer device type, got {dev!r}")
                    continue
                if sid in sid_device and sid_device[sid][0] != dev:
                    other_dev, other_e = sid_device[sid]
                    self.bad(where, "attrs.device_index",
                             f"storage id {sid} is used on device type {dev} and on device type {other_dev} (entry {other_e})")
                sid_device.setdefault(sid, (dev, eid))
            scope = None
            if "storage_scope" in cols:
                scope = cols["storage_scope"][eid]
                if not isinstance(scope, str):
                    self.bad(where, "attrs.storage_scope", f"must be a string, got {scope!r}")
                    continue
            entries.append(Entry(eid, nid, eid - row_ptr[nid], tuple(shape), "bool" if dt == "uint1" else dt,
                                 sid, dev, scope))
        return entries, extra


def _finite(v: Any) -> bool:
    """No NaN/Infinity anywhere: Python's json accepts them, but they are not JSON and break round trips."""
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    return True


def _list_or_empty(v: Any, reader: _GraphReader, fld: str) -> list:
    if isinstance(v, list):
        return v
    reader.bad("", fld, "must be a list")
    return []


def _find_cycle(nodes: list[Node]) -> list[int] | None:
    """A node cycle through input edges, if any (iterative DFS: graphs can be deep)."""
    color = [0] * len(nodes)  # 0 new, 1 on stack, 2 done
    for root in range(len(nodes)):
        if color[root]:
            continue
        stack = [(root, iter(nodes[root].inputs))]
        path = [root]
        color[root] = 1
        while stack:
            nid, it = stack[-1]
            nxt = next((r.node for r in it if r.node < len(nodes)), None)
            if nxt is None:
                color[nid] = 2
                stack.pop()
                path.pop()
            elif color[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            elif color[nxt] == 0:
                color[nxt] = 1
                stack.append((nxt, iter(nodes[nxt].inputs)))
                path.append(nxt)
    return None
