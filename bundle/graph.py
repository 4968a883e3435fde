"""The graph of a TVM graph-executor model (graph.json) as data: nodes, entries, addressing.

graph_reader.py builds a Graph from graph.json after checking every field, so code that holds a
Graph indexes it without re-checking. The model never allocates tensor memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from tvmpipe.bundle import dtypes

DEVICE_TYPES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 13: "cuda_managed"}


class EntrySpec(NamedTuple):
    """Shape and dtype of one entry; a tuple so `shape, dtype = spec` works as CONTRACTS says."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * dtypes.itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class EntryRef:
    """A reference to output `index` of node `node` (TVM's [nid, index, version] triple)."""

    node: int
    index: int = 0
    version: int = 0


@dataclass
class Node:
    index: int
    op: str  # "null" (graph input or param) or "tvm_op"
    name: str
    inputs: list[EntryRef]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_op(self) -> bool:
        return self.op != "null"

    @property
    def func_name(self) -> str | None:
        return self.attrs.get("func_name") if self.is_op else None

    @property
    def num_outputs(self) -> int:
        return int(self.attrs.get("num_outputs", 1)) if self.is_op else 1

    @property
    def is_nop(self) -> bool:
        """`__nop`: a copy-free reshape whose output aliases its input's storage; launches nothing."""
        return self.func_name == "__nop"

    @property
    def inplace(self) -> list[int]:
        """A `call_tir_inplace` node's attrs `inplace_indices`: the input its output is written over
        (the output entry shares that input's storage); [] for other nodes."""
        raw = self.attrs.get("inplace_indices") if self.is_op else None
        return [int(i) for i in str(raw).split(",")] if raw not in (None, "") else []

    @property
    def is_copy(self) -> bool:
        return self.func_name == "__copy"

    @property
    def launches_kernels(self) -> bool:
        return self.is_op and not self.is_nop and not self.is_copy

    def label(self) -> str:
        return f"node {self.index} '{self.name}'"


@dataclass(frozen=True)
class Entry:
    """One tensor of the graph: an output of a node, addressed by its entry id."""

    id: int
    node: int
    index: int
    shape: tuple[int, ...]
    dtype: str
    storage_id: int
    device_type: int | None = None
    storage_scope: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


@dataclass
class Graph:
    nodes: list[Node]
    arg_nodes: list[int]
    node_row_ptr: list[int]
    heads: list[EntryRef]
    entries: list[Entry]
    metadata: dict[str, Any] | None = None
    extra_attrs: dict[str, Any] = field(default_factory=dict)
    source: str = "graph.json"

    # ---- addressing -------------------------------------------------------------------------
    def entry_id(self, node: int, index: int = 0) -> int:
        return self.node_row_ptr[node] + index

    def ref_entry(self, ref: EntryRef) -> int:
        return self.node_row_ptr[ref.node] + ref.index

    def node_entry_ids(self, node: int) -> range:
        return range(self.node_row_ptr[node], self.node_row_ptr[node + 1])

    def entry_of(self, node: int | str, index: int = 0) -> Entry:
        """Output `index` of a node given by index or by name: the one lookup of a node's tensor
        (a null node, input or param, has exactly one)."""
        nid = self.node_index[node] if isinstance(node, str) else node
        return self.entries[self.entry_id(nid, index)]

    def input_entry_ids(self, node: int) -> list[int]:
        return [self.ref_entry(r) for r in self.nodes[node].inputs]

    @property
    def num_entries(self) -> int:
        return self.node_row_ptr[-1]

    @cached_property
    def node_index(self) -> dict[str, int]:
        return {n.name: n.index for n in self.nodes}

    def is_null_node(self, name: str) -> bool:
        """Whether `name` names a null node (a graph input or param): what inputs and params must be."""
        nid = self.node_index.get(name)
        return nid is not None and not self.nodes[nid].is_op

    @property
    def op_nodes(self) -> list[int]:
        return [n.index for n in self.nodes if n.is_op]

    @property
    def null_nodes(self) -> list[int]:
        return [n.index for n in self.nodes if not n.is_op]

    @property
    def head_entries(self) -> list[int]:
        return [self.ref_entry(h) for h in self.heads]

    @cached_property
    def consumers(self) -> list[list[int]]:
        """For each entry id, the nodes that read it, in graph order (each node once)."""
        out: list[list[int]] = [[] for _ in range(self.num_entries)]
        for n in self.nodes:
            for eid in dict.fromkeys(self.input_entry_ids(n.index)):
                out[eid].append(n.index)
        return out

    # ---- storage ------------------------------------------------------------------------------
    def storage_sizes(self) -> dict[int, int]:
        """Bytes each storage id needs: the largest entry that TVM's plan puts in it."""
        sizes: dict[int, int] = {}
        for e in self.entries:
            sizes[e.storage_id] = max(sizes.get(e.storage_id, 0), e.nbytes)
        return sizes

    def activation_bytes(self) -> tuple[int, int]:
        """(bytes without storage reuse, bytes with TVM's storage plan) of op-node outputs.

        `__nop` outputs alias their input, so they cost nothing in either figure.
        """
        sizes = self.storage_sizes()
        op_entries = [
            e for e in self.entries if self.nodes[e.node].is_op and not self.nodes[e.node].is_nop
        ]
        no_reuse = sum(e.nbytes for e in op_entries)
        with_reuse = sum(sizes[sid] for sid in {e.storage_id for e in op_entries})
        return no_reuse, with_reuse

    # ---- serialisation ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The graph as graph.json content; round-trips what the reader accepted."""
        attrs: dict[str, Any] = {
            "shape": ["list_shape", [list(e.shape) for e in self.entries]],
            "dltype": ["list_str", [e.dtype for e in self.entries]],
            "storage_id": ["list_int", [e.storage_id for e in self.entries]],
        }
        if any(e.device_type is not None for e in self.entries):
            attrs["device_index"] = ["list_int", [e.device_type or 0 for e in self.entries]]
        if any(e.storage_scope is not None for e in self.entries):
            attrs["storage_scope"] = ["list_str", [e.storage_scope or "" for e in self.entries]]
        attrs.update(self.extra_attrs)
        nodes = []
        for n in self.nodes:
            d: dict[str, Any] = {"op": n.op, "name": n.name,
                                 "inputs": [[r.node, r.index, r.version] for r in n.inputs]}
            if n.attrs:
                d["attrs"] = dict(n.attrs)
            nodes.append(d)
        out: dict[str, Any] = {
            "nodes": nodes,
            "arg_nodes": list(self.arg_nodes),
            "node_row_ptr": list(self.node_row_ptr),
            "heads": [[h.node, h.index, h.version] for h in self.heads],
            "attrs": attrs,
        }
        if self.metadata is not None:
            out["metadata"] = self.metadata
        return out
