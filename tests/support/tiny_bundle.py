"""Small hand-made bundles with real CUDA kernels, for tests that must not depend on TVM.

`tiny` is dense(x, w) + b -> relu -> reshape (__nop) -> scale by 2; it exercises params, a
multi-kernel function with a workspace, a scalar operand, and storage aliasing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tvmpipe.bundle import write_bundle

TINY_CU = r'''
extern "C" __global__ void __launch_bounds__(32) dense_add_kernel(float* __restrict__ x, float* __restrict__ w,
                                                                   float* __restrict__ b, float* __restrict__ ws) {
  int j = threadIdx.x;
  if (j < 3) { float acc = b[j]; for (int k = 0; k < 4; ++k) acc += x[k] * w[k * 3 + j]; ws[j] = acc; }
}
extern "C" __global__ void __launch_bounds__(32) dense_add_kernel_1(float* __restrict__ ws, float* __restrict__ y, int n) {
  int j = threadIdx.x;
  if (j < n) y[j] = ws[j] > 0.f ? ws[j] : 0.f;
}
extern "C" __global__ void __launch_bounds__(32) scale_kernel(float* __restrict__ a, float* __restrict__ out) {
  int j = threadIdx.x;
  if (j < 3) out[j] = a[j] * 2.0f;
}
'''


def tiny_graph() -> dict:
    nodes = [
        {"op": "null", "name": "x", "inputs": []},
        {"op": "null", "name": "w", "inputs": []},
        {"op": "null", "name": "b", "inputs": []},
        {"op": "tvm_op", "name": "dense_relu", "inputs": [[0, 0, 0], [1, 0, 0], [2, 0, 0]],
         "attrs": {"func_name": "fused_dense_add_relu", "num_inputs": "3", "num_outputs": "1", "flatten_data": "0"}},
        {"op": "tvm_op", "name": "reshape", "inputs": [[3, 0, 0]],
         "attrs": {"func_name": "__nop", "num_inputs": "1", "num_outputs": "1", "flatten_data": "0"}},
        {"op": "tvm_op", "name": "scale", "inputs": [[4, 0, 0]],
         "attrs": {"func_name": "fused_multiply", "num_inputs": "1", "num_outputs": "1", "flatten_data": "0"}},
    ]
    return {
        "nodes": nodes, "arg_nodes": [0, 1, 2], "node_row_ptr": [0, 1, 2, 3, 4, 5, 6], "heads": [[5, 0, 0]],
        "attrs": {
            "shape": ["list_shape", [[1, 4], [4, 3], [3], [1, 3], [3], [3]]],
            "dltype": ["list_str", ["float32"] * 6],
            "storage_id": ["list_int", [0, 1, 2, 3, 3, 4]],
            "device_index": ["list_int", [2] * 6],
        },
    }


def tiny_kernels() -> dict:
    return {"version": 1, "functions": {
        "fused_dense_add_relu": {
            "workspaces": [{"nbytes": 12, "dtype": "float32", "shape": [3]}],
            "launches": [
                {"kernel": "dense_add_kernel", "grid": [1, 1, 1], "block": [32, 1, 1], "shared_mem": 0,
                 "args": [{"arg": 0}, {"arg": 1}, {"arg": 2}, {"workspace": 0}]},
                {"kernel": "dense_add_kernel_1", "grid": [1, 1, 1], "block": [32, 1, 1], "shared_mem": 0,
                 "args": [{"workspace": 0}, {"arg": 3}, {"scalar": 3, "dtype": "int32"}]},
            ]},
        "fused_multiply": {"workspaces": [], "launches": [
            {"kernel": "scale_kernel", "grid": [1, 1, 1], "block": [32, 1, 1], "shared_mem": 0,
             "args": [{"arg": 0}, {"arg": 1}]}]},
    }}


def tiny_ops() -> dict:
    f32 = "float32"
    return {"version": 1, "functions": {
        "fused_dense_add_relu": {"num_inputs": 3, "num_outputs": 1, "ops": [
            {"op": "matmul", "attrs": {"out_dtype": ""}, "inputs": [{"arg": 0}, {"arg": 1}],
             "input_shapes": [[1, 4], [4, 3]], "input_dtypes": [f32, f32], "output_shapes": [[1, 3]], "output_dtypes": [f32]},
            {"op": "add", "attrs": {}, "inputs": [{"op": 0}, {"arg": 2}],
             "input_shapes": [[1, 3], [3]], "input_dtypes": [f32, f32], "output_shapes": [[1, 3]], "output_dtypes": [f32]},
            {"op": "nn.relu", "attrs": {}, "inputs": [{"op": 1}],
             "input_shapes": [[1, 3]], "input_dtypes": [f32], "output_shapes": [[1, 3]], "output_dtypes": [f32]},
        ], "outputs": [{"op": 2}]},
        "fused_multiply": {"num_inputs": 1, "num_outputs": 1, "ops": [
            {"op": "multiply", "attrs": {}, "inputs": [{"arg": 0}, {"const": {"dtype": f32, "shape": [], "data": [2.0]}}],
             "input_shapes": [[3], []], "input_dtypes": [f32, f32], "output_shapes": [[3]], "output_dtypes": [f32]},
        ], "outputs": [{"op": 0}]},
    }}


def tiny_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}


def write_tiny(out: Path, **overrides) -> Path:
    kw = dict(model="tiny", source={"kind": "handmade", "name": "tiny", "sha256": None},
              target={"kind": "cuda", "arch": "sm_90"}, batch=1, dtype="float32", graph=tiny_graph(),
              kernels=tiny_kernels(), ops=tiny_ops(), cuda_source=TINY_CU, inputs=["x"], params=tiny_params(),
              params_format="npz")
    kw.update(overrides)
    return write_bundle(out, **kw)


def tiny_expected(x: np.ndarray, params: dict[str, np.ndarray]) -> np.ndarray:
    return (np.maximum(x @ params["w"] + params["b"], 0).reshape(3) * 2).astype(np.float32)
