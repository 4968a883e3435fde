"""Run a bundle's graph.json on the CPU with TVM's own LLVM build of the unscheduled functions.

This is the compiler's independent numerical check: the same fused PrimFuncs the bundle's CUDA
kernels were scheduled from, but built for CPU without any GPU schedule, executed node by node in
graph order with the bundle's params. Optionally every tensor lives in its graph.json storage id
(one buffer per id, as a GPU executor would allocate), which also checks the storage plan: an
entry overwritten while still needed shows up as a wrong result.

The executor's tests reuse it as the oracle for the NumPy reference backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tvmpipe.bundle import dtypes
from tvmpipe.bundle.graph import Graph
from tvmpipe.bundle.graph_reader import parse_graph
from tvmpipe.compiler.errors import CompileError


@dataclass
class CpuRunner:
    """Callable CPU builds of a bundle's fused functions, by func_name."""

    functions: dict[str, Any]

    @classmethod
    def build(cls, unscheduled: Any) -> CpuRunner:
        """Build every PrimFunc of `unscheduled` (an IRModule, as in `Exported.unscheduled`) for LLVM."""
        import tvm

        mod = tvm.IRModule({gv.name_hint: f.with_attr("global_symbol", gv.name_hint)
                            for gv, f in unscheduled.functions.items()})
        lib = tvm.tirx.build(mod, target="llvm")
        return cls({gv.name_hint: lib[gv.name_hint] for gv in unscheduled.functions})

    def run(self, graph: Graph | dict, inputs: dict[str, np.ndarray], params: dict[str, np.ndarray],
            use_storage_plan: bool = True, keep: dict[int, np.ndarray] | None = None) -> list[np.ndarray]:
        """Execute `graph` in node order; returns the head entries as NumPy arrays.

        `keep`, if given, receives a copy of every entry's value (entry id -> array) as it is
        produced, for checks of single nodes.
        """
        import tvm

        g = graph if isinstance(graph, Graph) else parse_graph(graph)
        values: list[np.ndarray | None] = [None] * g.num_entries
        storage: dict[int, np.ndarray] = {}
        if use_storage_plan:
            storage = {sid: np.zeros(size, dtype=np.uint8) for sid, size in g.storage_sizes().items()}

        def place(eid: int, arr: np.ndarray) -> None:
            e = g.entries[eid]
            arr = np.asarray(arr, dtype=dtypes.np_dtype(e.dtype), order="C").reshape(e.shape)
            if use_storage_plan:
                view = storage[e.storage_id][: e.nbytes].view(arr.dtype).reshape(e.shape)
                view[...] = arr
                values[eid] = view
            else:
                values[eid] = arr
            if keep is not None:
                keep[eid] = arr.copy()

        for node in g.nodes:
            out_ids = list(g.node_entry_ids(node.index))
            if not node.is_op:
                src = inputs if node.name in inputs else params
                if node.name not in src:
                    raise CompileError(f"no value for {node.label()} (neither an input nor a param)")
                place(out_ids[0], src[node.name])
                continue
            in_arrays = [values[eid] for eid in g.input_entry_ids(node.index)]
            if node.is_nop:
                place(out_ids[0], np.array(in_arrays[0]))
                continue
            func = self.functions.get(node.func_name)
            if func is None:
                raise CompileError(f"{node.label()} calls '{node.func_name}', which the CPU build does not have")
            args = [tvm.runtime.tensor(np.asarray(a, order="C")) for a in in_arrays]  # 0-d stays 0-d
            if node.inplace:  # call_tir_inplace: the function writes its input, which is the output
                func(*args)
                for eid, k in zip(out_ids, node.inplace):
                    place(eid, args[k].numpy())
                continue
            outs = [tvm.runtime.empty(g.entries[eid].shape, g.entries[eid].dtype) for eid in out_ids]
            func(*args, *outs)
            for eid, out in zip(out_ids, outs):
                place(eid, out.numpy())
        return [np.array(values[eid]) for eid in g.head_entries]


def compare(actual: np.ndarray, expected: np.ndarray, rtol: float, atol_scale: float) -> float:
    """Max abs error, asserting `|a - e| <= atol_scale * max(1, max|e|) + rtol * |e|` elementwise.

    The absolute part scales with the output's magnitude because logits of a random ResNet are
    O(10) while probabilities are O(0.1); one fixed atol would be too loose for one, too tight for
    the other.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape} != expected {expected.shape}")
    atol = atol_scale * max(1.0, float(np.max(np.abs(expected))) if expected.size else 1.0)
    err = np.abs(actual - expected)
    bad = err > atol + rtol * np.abs(expected)
    if bad.any():
        i = np.unravel_index(np.argmax(err - atol - rtol * np.abs(expected)), err.shape)
        raise AssertionError(f"{int(bad.sum())} of {err.size} elements differ beyond atol={atol:.3g}, "
                             f"rtol={rtol}: worst at {tuple(int(k) for k in i)}: {actual[i]} vs {expected[i]}")
    return float(err.max()) if err.size else 0.0
