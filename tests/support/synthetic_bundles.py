"""Synthetic bundles for executor tests: graphs with the awkward shapes real exports have (skip
connections, a graph input read late, multi-output nodes, `__nop` heads, workspaces, scalars,
dynamic shared memory) without needing TVM.

The kernels in kernels.cu have the right symbols and parameter lists but EMPTY bodies: these bundles
are for the reference backend, the simulated backend and the recording fake device only. GPU tests
use the compiler's real bundles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tvmpipe.bundle import write_bundle


@dataclass
class _Fn:
    ops: list[dict]
    outputs: list[dict]
    n_in: int
    n_out: int
    launches: int = 1
    workspace: int = 0  # bytes; adds a workspace between two launches
    smem: int = 0


@dataclass
class SynthGraph:
    """Add null nodes and op nodes in graph order; `build` writes the bundle."""

    name: str
    nodes: list[dict] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    row: list[int] = field(default_factory=lambda: [0])
    funcs: dict[str, _Fn] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    heads: list[list[int]] = field(default_factory=list)

    def _add(self, node: dict, shapes: list[list[int]], dtypes: list[str]) -> int:
        self.nodes.append(node)
        self.shapes += shapes
        self.dtypes += dtypes
        self.row.append(self.row[-1] + len(shapes))
        return len(self.nodes) - 1

    def input(self, name: str, shape: list[int], dtype: str = "float32") -> int:
        self.inputs.append(name)
        return self._add({"op": "null", "name": name, "inputs": []}, [shape], [dtype])

    def param(self, name: str, value: np.ndarray) -> int:
        self.params[name] = value
        return self._add({"op": "null", "name": name, "inputs": []}, [list(value.shape)], [str(value.dtype)])

    def param_spec(self, name: str, shape: list[int], dtype: str = "float32") -> int:
        """A param known by shape only: its values come in `build(weights=...)`, streamed to a file."""
        return self._add({"op": "null", "name": name, "inputs": []}, [list(shape)], [dtype])

    def entry(self, ref: int | tuple[int, int]) -> tuple[int, int]:
        return (ref, 0) if isinstance(ref, int) else ref

    def spec(self, ref) -> tuple[list[int], str]:
        n, k = self.entry(ref)
        return self.shapes[self.row[n] + k], self.dtypes[self.row[n] + k]

    def nop(self, name: str, src, shape: list[int]) -> int:
        n, k = self.entry(src)
        return self._add({"op": "tvm_op", "name": name, "inputs": [[n, k, 0]],
                          "attrs": {"func_name": "__nop", "num_inputs": "1", "num_outputs": "1", "flatten_data": "0"}},
                         [shape], [self.spec(src)[1]])

    def op(self, name: str, func: str, inputs: list, ops: list[tuple], outputs: list[tuple[list[int], str]],
           out_refs: list[dict] | None = None, launches: int = 1, workspace: int = 0, smem: int = 0) -> int:
        """`ops`: (op name, attrs, input refs, output shapes, output dtypes) with refs as in ops.json."""
        recs: list[dict] = []
        arg_specs = [self.spec(r) for r in inputs]

        def ref_spec(ref: dict) -> tuple[list[int], str]:
            if "arg" in ref:
                return arg_specs[ref["arg"]]
            if "const" in ref:
                return ref["const"]["shape"], ref["const"]["dtype"]
            rec = recs[ref["op"]]
            k = ref.get("index", 0)
            return rec["output_shapes"][k], rec["output_dtypes"][k]

        for opname, attrs, refs, oshapes, odtypes in ops:
            specs = [ref_spec(r) for r in refs]
            recs.append({"op": opname, "attrs": attrs, "inputs": refs, "input_shapes": [s for s, _ in specs],
                         "input_dtypes": [d for _, d in specs], "output_shapes": oshapes, "output_dtypes": odtypes})
        outs = out_refs or [{"op": len(recs) - 1}]
        fn = _Fn(recs, outs, len(inputs), len(outputs), launches, workspace, smem)
        if func in self.funcs:
            assert (self.funcs[func].n_in, self.funcs[func].n_out) == (fn.n_in, fn.n_out)
        self.funcs[func] = fn
        refs = [list(self.entry(r)) + [0] for r in inputs]
        return self._add({"op": "tvm_op", "name": name, "inputs": refs,
                          "attrs": {"func_name": func, "num_inputs": str(len(inputs)),
                                    "num_outputs": str(len(outputs)), "flatten_data": "0"}},
                         [s for s, _ in outputs], [d for _, d in outputs])

    def output(self, ref) -> None:
        self.heads.append(list(self.entry(ref)) + [0])

    def build(self, out: Path, weights: tuple[Path, dict[str, str]] | None = None) -> Path:
        n_entries = self.row[-1]
        graph = {"nodes": self.nodes, "arg_nodes": [i for i, n in enumerate(self.nodes) if n["op"] == "null"],
                 "node_row_ptr": self.row, "heads": self.heads,
                 "attrs": {"shape": ["list_shape", self.shapes], "dltype": ["list_str", self.dtypes],
                           "storage_id": ["list_int", list(range(n_entries))],
                           "device_index": ["list_int", [2] * n_entries]}}
        cu, kfuncs, ofuncs = [], {}, {}
        for fname, fn in self.funcs.items():
            nargs = fn.n_in + fn.n_out
            launches = []
            ws = [{"nbytes": fn.workspace, "dtype": "float32", "shape": [fn.workspace // 4]}] if fn.workspace else []
            for k in range(fn.launches):
                sym = f"{fname}_kernel" + (f"_{k}" if k else "")
                args: list[Any] = [{"arg": i} for i in range(nargs)]
                if ws:
                    args.append({"workspace": 0})
                args.append({"scalar": 7 + k, "dtype": "int32"})
                args.append({"scalar": 0.5, "dtype": "float32"})
                params = ", ".join([f"float* __restrict__ p{i}" for i in range(len(args) - 2)] + ["int n", "float s"])
                cu.append(f'extern "C" __global__ void __launch_bounds__(128) {sym}({params}) {{ }}')
                launches.append({"kernel": sym, "grid": [2 + k, 1, 1], "block": [128, 1, 1],
                                 "shared_mem": fn.smem if k == 0 else 0, "args": args})
            kfuncs[fname] = {"workspaces": ws, "launches": launches}
            ofuncs[fname] = {"num_inputs": fn.n_in, "num_outputs": fn.n_out, "ops": fn.ops, "outputs": fn.outputs}
        return write_bundle(out, model=self.name, source={"kind": "handmade", "name": self.name, "sha256": None},
                            target={"kind": "cuda", "arch": "sm_90"}, batch=1, dtype="float32", graph=graph,
                            kernels={"version": 1, "functions": kfuncs}, ops={"version": 1, "functions": ofuncs},
                            cuda_source="\n".join(cu) + "\n", inputs=self.inputs,
                            params=None if weights else self.params, weights=weights)


F = "float32"


def _w(rng, *shape) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)


def write_skipnet(out: Path) -> Path:
    """MLP with a skip connection, a two-output split node, the graph input re-read by a late node,
    a `__nop` whose output is a graph output, and a multi-kernel function with a workspace."""
    rng = np.random.default_rng(1)
    g = SynthGraph("skipnet")
    x = g.input("x", [1, 8])
    w1 = g.param("w1", _w(rng, 8, 16))
    b1 = g.param("b1", _w(rng, 16))
    h1 = g.op("dense1", "fused_matmul_add_relu", [x, w1, b1],
              [("matmul", {"out_dtype": ""}, [{"arg": 0}, {"arg": 1}], [[1, 16]], [F]),
               ("add", {}, [{"op": 0}, {"arg": 2}], [[1, 16]], [F]),
               ("nn.relu", {}, [{"op": 1}], [[1, 16]], [F])], [([1, 16], F)], launches=2, workspace=64)
    flat = g.nop("flat", h1, [16])
    w2 = g.param("w2", _w(rng, 16, 16))
    h2 = g.op("dense2", "fused_matmul_tanh", [h1, w2],
              [("matmul", {"out_dtype": ""}, [{"arg": 0}, {"arg": 1}], [[1, 16]], [F]),
               ("tanh", {}, [{"op": 0}], [[1, 16]], [F])], [([1, 16], F)], smem=64 * 1024)
    sp = g.op("split", "fused_split", [h2],
              [("split", {"indices_or_sections": 2, "axis": 1}, [{"arg": 0}], [[1, 8], [1, 8]], [F, F])],
              [([1, 8], F), ([1, 8], F)], out_refs=[{"op": 0, "index": 0}, {"op": 0, "index": 1}])
    w3 = g.param("w3", _w(rng, 16, 8))
    h3 = g.op("dense3", "fused_matmul_tanh_1", [h1, w3],
              [("matmul", {"out_dtype": ""}, [{"arg": 0}, {"arg": 1}], [[1, 8]], [F]),
               ("tanh", {}, [{"op": 0}], [[1, 8]], [F])], [([1, 8], F)])
    mix = g.op("mix", "fused_multiply_add_add", [(sp, 0), (sp, 1), x, h3],
               [("multiply", {}, [{"arg": 0}, {"arg": 1}], [[1, 8]], [F]),
                ("add", {}, [{"op": 0}, {"arg": 2}], [[1, 8]], [F]),
                ("add", {}, [{"op": 1}, {"arg": 3}], [[1, 8]], [F])], [([1, 8], F)])
    r = g.nop("squeeze", mix, [8])
    head = g.op("head", "fused_log_softmax", [r],
                [("nn.log_softmax", {"axis": -1}, [{"arg": 0}], [[8]], [F])], [([8], F)])
    g.output(head)
    g.output(flat)
    return g.build(out)


def write_convnet(out: Path) -> Path:
    """Small CNN: strided padded conv + relu, max pool, grouped conv with a residual add,
    adaptive average pool, flatten (`__nop`), dense, log_softmax."""
    rng = np.random.default_rng(2)
    g = SynthGraph("convnet")
    x = g.input("data", [1, 3, 16, 16])
    w1 = g.param("conv1_w", (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32))
    b1 = g.param("conv1_b", (rng.standard_normal((1, 8, 1, 1)) * 0.1).astype(np.float32))
    conv = {"strides": [2, 2], "padding": [1, 1, 1, 1], "dilation": [1, 1], "groups": 1, "data_layout": "NCHW",
            "kernel_layout": "OIHW", "out_layout": "NCHW", "out_dtype": "float32"}
    c1 = g.op("conv1", "fused_conv2d_add_relu", [x, w1, b1],
              [("nn.conv2d", conv, [{"arg": 0}, {"arg": 1}], [[1, 8, 8, 8]], [F]),
               ("add", {}, [{"op": 0}, {"arg": 2}], [[1, 8, 8, 8]], [F]),
               ("nn.relu", {}, [{"op": 1}], [[1, 8, 8, 8]], [F])], [([1, 8, 8, 8], F)])
    pool = {"pool_size": [3, 3], "strides": [2, 2], "padding": [1, 1, 1, 1], "dilation": [1, 1],
            "ceil_mode": False, "count_include_pad": False, "layout": "NCHW", "out_layout": "NCHW"}
    p1 = g.op("pool1", "fused_max_pool2d", [c1],
              [("nn.max_pool2d", pool, [{"arg": 0}], [[1, 8, 4, 4]], [F])], [([1, 8, 4, 4], F)])
    w2 = g.param("conv2_w", (rng.standard_normal((8, 2, 3, 3)) * 0.3).astype(np.float32))
    conv2 = dict(conv, strides=[1, 1], groups=4)
    c2 = g.op("conv2", "fused_conv2d_add_relu1", [p1, w2, p1],
              [("nn.conv2d", conv2, [{"arg": 0}, {"arg": 1}], [[1, 8, 4, 4]], [F]),
               ("add", {}, [{"op": 0}, {"arg": 2}], [[1, 8, 4, 4]], [F]),
               ("nn.relu", {}, [{"op": 1}], [[1, 8, 4, 4]], [F])], [([1, 8, 4, 4], F)])
    gap = g.op("gap", "fused_adaptive_avg_pool2d", [c2],
               [("nn.adaptive_avg_pool2d", {"output_size": [1, 1], "layout": "NCHW", "out_layout": "NCHW"},
                 [{"arg": 0}], [[1, 8, 1, 1]], [F])], [([1, 8, 1, 1], F)])
    flat = g.nop("flatten", gap, [1, 8])
    wd = g.param("fc_w", (rng.standard_normal((8, 5)) * 0.3).astype(np.float32))
    fc = g.op("fc", "fused_matmul_log_softmax", [flat, wd],
              [("matmul", {"out_dtype": ""}, [{"arg": 0}, {"arg": 1}], [[1, 5]], [F]),
               ("nn.log_softmax", {"axis": -1}, [{"op": 0}], [[1, 5]], [F])], [([1, 5], F)], launches=3, workspace=8)
    g.output(fc)
    return g.build(out)


def write_dense_stack(out: Path, layers: int = 6, width: int = 32, seed: int = 3) -> Path:
    """`layers` x (matmul + bias + tanh) of `width` units: a weight-heavy chain (safetensors
    weights), for tests that count which weight bytes each stage reads, ships and uploads."""
    rng = np.random.default_rng(seed)
    g = SynthGraph("dense_stack")
    h = g.input("x", [1, width])
    for i in range(layers):
        w = g.param(f"w{i}", _w(rng, width, width))
        b = g.param(f"b{i}", _w(rng, width))
        h = g.op(f"dense{i}", "fused_matmul_add_tanh", [h, w, b],
                 [("matmul", {"out_dtype": ""}, [{"arg": 0}, {"arg": 1}], [[1, width]], [F]),
                  ("add", {}, [{"op": 0}, {"arg": 2}], [[1, width]], [F]),
                  ("tanh", {}, [{"op": 1}], [[1, width]], [F])], [([1, width], F)])
    g.output(h)
    return g.build(out)
