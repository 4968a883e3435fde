"""A two-op bundle that fails mid-run on purpose, for the job's failure path.

x[1] -> double (x * 2) -> span (arange(0, max(2x, 4), 1), recorded as 4 elements). With x <= 2 the
second op yields its recorded 4 elements, as it does for the workers' warm-up feed (standard
normal values); x > 2 makes it yield more, which the reference backend refuses (an op's output
shape must match ops.json). So an inputs file whose
micro-batch k holds x != 2 fails in the pipeline's last stage at micro-batch k, after the earlier
micro-batches completed: a real failure in a real pipeline, no fakes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tvmpipe.bundle import write_bundle

F32 = "float32"
CU = r'''
extern "C" __global__ void double_kernel(float* __restrict__ x, float* __restrict__ y) { y[0] = x[0] * 2.0f; }
extern "C" __global__ void span_kernel(float* __restrict__ end, float* __restrict__ out) {
  int j = threadIdx.x;
  if (j < 4) out[j] = (float)j;
}
'''


def _graph() -> dict:
    op = lambda name, fn, src: {"op": "tvm_op", "name": name, "inputs": [[src, 0, 0]],  # noqa: E731
                                "attrs": {"func_name": fn, "num_inputs": "1", "num_outputs": "1", "flatten_data": "0"}}
    return {"nodes": [{"op": "null", "name": "x", "inputs": []}, op("double", "fused_multiply", 0),
                      op("span", "fused_arange", 1)],
            "arg_nodes": [0], "node_row_ptr": [0, 1, 2, 3], "heads": [[2, 0, 0]],
            "attrs": {"shape": ["list_shape", [[1], [1], [4]]], "dltype": ["list_str", [F32] * 3],
                      "storage_id": ["list_int", [0, 1, 2]], "device_index": ["list_int", [2, 2, 2]]}}


def _launch(kernel: str) -> dict:
    return {"workspaces": [], "launches": [{"kernel": kernel, "grid": [1, 1, 1], "block": [32, 1, 1],
                                            "shared_mem": 0, "args": [{"arg": 0}, {"arg": 1}]}]}


def _const(v: float) -> dict:
    return {"const": {"dtype": F32, "shape": [], "data": [v]}}


def _ops() -> dict:
    return {"version": 1, "functions": {
        "fused_multiply": {"num_inputs": 1, "num_outputs": 1, "ops": [
            {"op": "multiply", "attrs": {}, "inputs": [{"arg": 0}, _const(2.0)], "input_shapes": [[1], []],
             "input_dtypes": [F32, F32], "output_shapes": [[1]], "output_dtypes": [F32]}], "outputs": [{"op": 0}]},
        "fused_arange": {"num_inputs": 1, "num_outputs": 1, "ops": [
            {"op": "clip", "attrs": {"min": 4.0, "max": 1e9}, "inputs": [{"arg": 0}], "input_shapes": [[1]],
             "input_dtypes": [F32], "output_shapes": [[1]], "output_dtypes": [F32]},
            {"op": "arange", "attrs": {}, "inputs": [_const(0.0), {"op": 0}, _const(1.0)],
             "input_shapes": [[], [1], []], "input_dtypes": [F32, F32, F32], "output_shapes": [[4]],
             "output_dtypes": [F32]}], "outputs": [{"op": 1}]},
    }}


def write_poison(out: Path) -> Path:
    return write_bundle(out, model="poison", source={"kind": "handmade", "name": "poison", "sha256": None},
                        target={"kind": "cuda", "arch": "sm_90"}, batch=1, dtype=F32, graph=_graph(),
                        kernels={"version": 1, "functions": {"fused_multiply": _launch("double_kernel"),
                                                             "fused_arange": _launch("span_kernel")}},
                        ops=_ops(), cuda_source=CU, inputs=["x"], params={})


def poison_inputs(n: int, bad: int) -> np.ndarray:
    """[n, 1] inputs, all good (2.0) except micro-batch `bad`."""
    x = np.full((n, 1), 2.0, np.float32)
    x[bad] = 3.0
    return x
