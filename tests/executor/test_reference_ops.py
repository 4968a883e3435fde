"""Reference ops, one at a time, against independent formulas: torch (CPU) where it has the op, hand
NumPy otherwise. Tolerance: float32 results within rtol 1e-5 / atol 1e-6 of the oracle; ops that
sum many products (conv) within rtol 1e-4 / atol 1e-5, since summation order differs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvmpipe.bundle.manifests import FusedFunction, OpRecord, Ref
from tvmpipe.executor.reference_ops import OPS, erf, run_function

torch = pytest.importorskip("torch")
F = torch.nn.functional
RTOL, ATOL = 1e-5, 1e-6


def apply(op: str, attrs: dict, *inputs: np.ndarray, out_shapes=None, out_dtypes=None, n_out: int = 1):
    """Run one op through the ops.json interpreter, as a one-op fused function."""
    rec = OpRecord(op, attrs, [Ref("arg", i) for i in range(len(inputs))],
                   [list(a.shape) for a in inputs], [str(a.dtype) for a in inputs],
                   out_shapes or [], out_dtypes or [])
    outs = [Ref("op", 0, k) for k in range(n_out)]
    res = run_function(FusedFunction("f", len(inputs), n_out, [rec], outs), list(inputs))
    return res if n_out > 1 else res[0]


def t(a: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(a))


def close(got: np.ndarray, want, rtol: float = RTOL, atol: float = ATOL) -> None:
    want = want.numpy() if hasattr(want, "numpy") else np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


rng = np.random.default_rng(0)


def rand(*shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("stride,pad,dil,groups", [
    (1, [0, 0, 0, 0], 1, 1), (2, [1, 1, 1, 1], 1, 1), (1, [2, 1, 0, 3], 2, 1), (2, [1, 1, 1, 1], 1, 4),
    (1, [1, 1, 1, 1], 1, 8),  # depthwise
])
def test_conv2d(stride, pad, dil, groups):
    x, w = rand(2, 8, 11, 13), rand(16, 8 // groups, 3, 3)
    attrs = {"strides": [stride, stride], "padding": pad, "dilation": [dil, dil], "groups": groups,
             "data_layout": "NCHW", "kernel_layout": "OIHW", "out_layout": "NCHW", "out_dtype": "float32"}
    want = F.conv2d(F.pad(t(x), (pad[1], pad[3], pad[0], pad[2])), t(w), stride=stride, dilation=dil, groups=groups)
    close(apply("nn.conv2d", attrs, x, w), want, rtol=1e-4, atol=1e-5)


def test_conv2d_nhwc_hwio():
    x, w = rand(1, 9, 9, 4), rand(3, 3, 4, 6)
    attrs = {"strides": [1, 1], "padding": [1, 1, 1, 1], "dilation": [1, 1], "groups": 1,
             "data_layout": "NHWC", "kernel_layout": "HWIO", "out_layout": "NHWC", "out_dtype": ""}
    want = F.conv2d(t(x).permute(0, 3, 1, 2), t(w).permute(3, 2, 0, 1), padding=1).permute(0, 2, 3, 1)
    close(apply("nn.conv2d", attrs, x, w), want.contiguous(), rtol=1e-4, atol=1e-5)


def test_conv1d():
    x, w = rand(2, 4, 20), rand(6, 4, 5)
    attrs = {"strides": [2], "padding": [2, 2], "dilation": [1], "groups": 1, "data_layout": "NCW",
             "kernel_layout": "OIW", "out_layout": "NCW", "out_dtype": "float32"}
    close(apply("nn.conv1d", attrs, x, w), F.conv1d(t(x), t(w), stride=2, padding=2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("include_pad", [False, True])
def test_pools(ceil, include_pad):
    x = rand(2, 3, 10, 11)
    attrs = {"pool_size": [3, 3], "strides": [2, 2], "padding": [1, 1, 1, 1], "dilation": [1, 1],
             "ceil_mode": ceil, "count_include_pad": include_pad, "layout": "NCHW", "out_layout": "NCHW"}
    close(apply("nn.max_pool2d", attrs, x), F.max_pool2d(t(x), 3, 2, 1, ceil_mode=ceil))
    close(apply("nn.avg_pool2d", attrs, x),
          F.avg_pool2d(t(x), 3, 2, 1, ceil_mode=ceil, count_include_pad=include_pad))


@pytest.mark.parametrize("size", [[1, 1], [2, 3], [3, 3], None])
def test_adaptive_avg_pool(size):
    x = rand(2, 4, 7, 9)
    got = apply("nn.adaptive_avg_pool2d", {"output_size": size, "layout": "NCHW", "out_layout": "NCHW"}, x)
    close(got, F.adaptive_avg_pool2d(t(x), size or (7, 9)))


def test_softmax_family_and_norms():
    x = rand(3, 5, 8)
    close(apply("nn.softmax", {"axis": -1}, x), torch.softmax(t(x), -1))
    close(apply("nn.log_softmax", {"axis": 1}, x), torch.log_softmax(t(x), 1))
    g, b = rand(8), rand(8)
    close(apply("nn.layer_norm", {"axes": [-1], "epsilon": 1e-5, "center": True, "scale": True}, x, g, b),
          F.layer_norm(t(x), (8,), t(g), t(b), 1e-5))
    g2, b2 = rand(5, 8), rand(5, 8)
    close(apply("nn.layer_norm", {"axes": [1, 2], "epsilon": 1e-6, "center": True, "scale": True}, x, g2, b2),
          F.layer_norm(t(x), (5, 8), t(g2), t(b2), 1e-6))
    xc, gc, bc = rand(2, 6, 4, 4), rand(6), rand(6)
    close(apply("nn.group_norm", {"num_groups": 3, "channel_axis": 1, "axes": [2, 3], "epsilon": 1e-5,
                                  "center": True, "scale": True}, xc, gc, bc),
          F.group_norm(t(xc), 3, t(gc), t(bc), 1e-5))
    mean, var = rand(6), np.abs(rand(6)) + 0.5
    y = apply("nn.batch_norm", {"axis": 1, "epsilon": 1e-5, "center": True, "scale": True}, xc, gc, bc, mean, var,
              n_out=3)
    close(y[0], F.batch_norm(t(xc), t(mean), t(var), t(gc), t(bc), False, 0.1, 1e-5))


def test_activations():
    x = rand(4, 33) * 3
    close(apply("nn.relu", {}, x), torch.relu(t(x)))
    close(apply("nn.gelu", {}, x), F.gelu(t(x)))
    close(apply("nn.gelu_tanh", {}, x), F.gelu(t(x), approximate="tanh"))
    close(apply("nn.silu", {}, x), F.silu(t(x)))
    close(apply("sigmoid", {}, x), torch.sigmoid(t(x)))
    close(apply("tanh", {}, x), torch.tanh(t(x)))
    close(apply("erf", {}, x), torch.erf(t(x)))
    close(apply("exp", {}, x), torch.exp(t(x)))
    pos = np.abs(x) + 0.1
    close(apply("sqrt", {}, pos), torch.sqrt(t(pos)))
    close(apply("rsqrt", {}, pos), torch.rsqrt(t(pos)))
    close(apply("power", {}, pos, np.full((), 1.7, np.float32)), torch.pow(t(pos), 1.7))
    close(apply("clip", {"min": -0.5, "max": 1.5}, x), torch.clamp(t(x), -0.5, 1.5))


def test_erf_accuracy():
    xs = np.concatenate([np.linspace(-7, 7, 20001), [0.0, 1e-8, -1e-8, 3.5, -3.5, 3.4999, 3.5001]])
    want = np.array([math.erf(v) for v in xs])
    got = erf(xs)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-11)


def test_matmul_and_broadcasting():
    a, b = rand(2, 1, 4, 5), rand(3, 5, 6)
    close(apply("matmul", {"out_dtype": ""}, a, b), torch.matmul(t(a), t(b)))
    x, y = rand(2, 3, 4), rand(4)
    close(apply("add", {}, x, y), t(x) + t(y))
    z = rand(3, 1)
    close(apply("subtract", {}, x, z), t(x) - t(z))
    close(apply("multiply", {}, x, y), t(x) * t(y))
    close(apply("divide", {}, x, y + 5), t(x) / (t(y) + 5))
    close(apply("maximum", {}, x, y), torch.maximum(t(x), t(y)))
    close(apply("greater", {}, x, y), t(x) > t(y))
    ai, bi = np.array([7, -7, 9], np.int32), np.array([2, 2, -4], np.int32)
    close(apply("divide", {}, ai, bi), torch.div(t(ai), t(bi), rounding_mode="trunc"))
    close(apply("floor_divide", {}, ai, bi), torch.div(t(ai), t(bi), rounding_mode="floor"))


def test_reductions():
    x = rand(3, 4, 5)
    close(apply("mean", {"axis": [1, 2], "keepdims": True}, x), t(x).mean((1, 2), keepdim=True))
    close(apply("sum", {"axis": [0], "keepdims": False}, x), t(x).sum(0))
    close(apply("max", {"axis": None, "keepdims": False}, x), t(x).max())
    close(apply("variance", {"axis": [-1], "keepdims": True}, x), t(x).var(-1, unbiased=False, keepdim=True))
    close(apply("argmax", {"axis": 2, "keepdims": False}, x, out_dtypes=["int64"]), t(x).argmax(2))


def test_data_movement():
    x = rand(2, 3, 4)
    close(apply("reshape", {"shape": [6, 4]}, x, out_shapes=[[6, 4]]), t(x).reshape(6, 4))
    close(apply("permute_dims", {"axes": [2, 0, 1]}, x), t(x).permute(2, 0, 1).contiguous())
    close(apply("permute_dims", {"axes": None}, x), t(x).permute(2, 1, 0).contiguous())
    y = rand(2, 5, 4)
    close(apply("concat", {"axis": 1}, x, y), torch.cat([t(x), t(y)], 1))
    parts = apply("split", {"indices_or_sections": [1, 3], "axis": 2}, x, n_out=3)
    for got, want in zip(parts, torch.tensor_split(t(x), [1, 3], 2)):
        close(got, want.contiguous())
    close(apply("strided_slice", {"axes": [1, 2], "begin": [1, 0], "end": [3, 4], "strides": [1, 2]}, x),
          t(x)[:, 1:3, 0:4:2].contiguous())
    idx = np.array([[0, 2], [1, 1]], np.int64)
    close(apply("take", {"axis": 1, "mode": "fast"}, x, idx), torch.from_numpy(np.take(x, idx, axis=1)))
    emb, ids = rand(10, 4), np.array([[3, 9, 0]], np.int32)
    close(apply("take", {"axis": 0}, emb, ids), F.embedding(t(ids).long(), t(emb)))
    close(apply("expand_dims", {"axis": [0, 3]}, x, out_shapes=[[1, 2, 3, 1, 4]]), t(x)[None, :, :, None])
    close(apply("squeeze", {"axis": [0]}, x[:1]), t(x[:1]).squeeze(0))
    close(apply("astype", {"dtype": "float16"}, x), t(x).half())
    close(apply("where", {}, x > 0, x, -x), torch.abs(t(x)))
    close(apply("nn.pad", {"pad_width": [0, 0, 1, 2, 0, 1], "pad_mode": "constant", "pad_value": 0.5}, x),
          F.pad(t(x), (0, 1, 1, 2), value=0.5))


def test_const_inputs_and_tuple_refs():
    """ops.json constants and {'op': j, 'index': k} references to tuple outputs."""
    x = rand(2, 6)
    recs = [
        OpRecord("split", {"indices_or_sections": 2, "axis": 1}, [Ref("arg", 0)], [[2, 6]], ["float32"],
                 [[2, 3], [2, 3]], ["float32", "float32"]),
        OpRecord("multiply", {}, [Ref("op", 0, 1), Ref("const", const={"dtype": "float32", "shape": [], "data": [2.0]})],
                 [[2, 3], []], ["float32", "float32"], [[2, 3]], ["float32"]),
        OpRecord("add", {}, [Ref("op", 0, 0), Ref("op", 1)], [[2, 3], [2, 3]], ["float32", "float32"], [[2, 3]], ["float32"]),
    ]
    (out,) = run_function(FusedFunction("f", 1, 1, recs, [Ref("op", 2)]), [x])
    np.testing.assert_array_equal(out, x[:, :3] + 2 * x[:, 3:])


def test_recorded_shape_mismatch_is_reported():
    from tvmpipe.executor.reference_ops import OpFailure

    with pytest.raises(OpFailure, match=r"produced shape \[2, 3\], ops.json records \[3, 2\]"):
        apply("nn.relu", {}, rand(2, 3), out_shapes=[[3, 2]], out_dtypes=["float32"])


def test_op_table_covers_brief():
    needed = ["matmul", "add", "subtract", "multiply", "divide", "power", "nn.relu", "nn.gelu", "nn.silu", "sigmoid",
              "tanh", "clip", "erf", "exp", "sqrt", "rsqrt", "nn.conv2d", "nn.max_pool2d", "nn.avg_pool2d",
              "nn.adaptive_avg_pool2d", "nn.softmax", "nn.log_softmax", "nn.layer_norm", "mean", "sum", "max",
              "reshape", "permute_dims", "concat", "split", "strided_slice", "take", "expand_dims", "squeeze",
              "astype", "nn.batch_norm"]
    assert [n for n in needed if n not in OPS] == []


# ---- gathers ----------------------------------------------------------------------------------------

def test_gather_elements_matches_torch_gather():
    x = rand(3, 5, 4)
    for axis in (0, 1, 2, -1, -3):
        n = x.shape[axis]
        idx = rng.integers(0, n, (2, 4, 3) if axis % 3 != 1 else (3, 6, 2)).astype(np.int64)
        close(apply("gather_elements", {"axis": axis}, x, idx), torch.gather(t(x), axis, t(idx)))
    idx32 = rng.integers(0, 5, (3, 5, 4)).astype(np.int32)  # int32 indices (ONNX), full-size index tensor
    close(apply("gather_elements", {"axis": 1}, x, idx32), torch.gather(t(x), 1, t(idx32).long()))


def test_gather_elements_refuses_indices_tvm_reads_out_of_row():
    """TVM's kernel reads `data` at the raw index (no wrap): -1 reads the previous row or outside the
    buffer. torch.gather refuses it too; the oracle refuses rather than inventing a value."""
    from tvmpipe.executor.reference_ops import OpFailure

    x = rand(3, 4)
    for bad in (-1, 4):
        with pytest.raises(OpFailure, match=rf"'gather_elements' index {bad} outside \[0, 4\) on axis 1"):
            apply("gather_elements", {"axis": -1}, x, np.array([[0, bad]], np.int64))


def test_gather_nd_matches_numpy_indexing():
    x = rand(2, 3, 4, 5)
    idx = np.stack([rng.integers(0, 2, (6, 7)), rng.integers(0, 3, (6, 7))], -1)  # M = 2 of rank 4
    close(apply("gather_nd", {"batch_dims": 0}, x, idx), x[idx[..., 0], idx[..., 1]])
    one = rng.integers(0, 3, (2, 4, 1))  # batch_dims 1: per batch row, one coordinate into axis 1
    want = np.stack([x[b][one[b, :, 0]] for b in range(2)])
    close(apply("gather_nd", {"batch_dims": 1}, x, one), want)
    full = np.stack([rng.integers(0, s, (2, 3)) for s in (4, 5)], -1)  # batch_dims 2, M = 2: scalars
    want = np.array([[x[i, j, full[i, j, 0], full[i, j, 1]] for j in range(3)] for i in range(2)], np.float32)
    close(apply("gather_nd", {"batch_dims": 2}, x, full), want)
    from tvmpipe.executor.reference_ops import OpFailure

    with pytest.raises(OpFailure, match=r"'gather_nd' index -1 outside \[0, 3\) on axis 1"):
        apply("gather_nd", {"batch_dims": 0}, x, np.array([[1, -1]], np.int64))


def test_take_modes():
    x = rand(3, 4)
    idx = np.array([[-1, 5], [2, 0]], np.int64)
    close(apply("take", {"axis": 1, "mode": "wrap"}, x, idx), x[:, np.mod(idx, 4)])
    close(apply("take", {"axis": 1, "mode": "clip"}, x, idx), x[:, np.clip(idx, 0, 3)])
    nan = apply("take", {"axis": 1, "mode": "nan"}, x, idx)
    assert nan.shape == (3, 2, 2) and np.isnan(nan[:, 0, :]).all() and np.isnan(nan[:, 1]).sum() == 0
    close(nan[:, 1], x[:, [2, 0]])
    close(apply("take", {"axis": None, "mode": "wrap"}, x[0], idx), x[0][np.mod(idx, 4)])
    from tvmpipe.executor.reference_ops import OpFailure

    with pytest.raises(OpFailure, match=r"'take' index 5 outside \[0, 4\) on axis 1 \(mode 'fast'"):
        apply("take", {"axis": 1, "mode": "fast"}, x, np.array([0, 5], np.int64))


def test_index_tensor_refuses_indices_tvm_reads_out_of_row():
    from tvmpipe.executor.reference_ops import OpFailure

    x = rand(3, 4)
    close(apply("index_tensor", {}, x, np.array([2, 0], np.int64), np.array([3, 1], np.int64)), x[[2, 0], [3, 1]])
    with pytest.raises(OpFailure, match=r"'index_tensor' index -1 outside \[0, 3\) on axis 0"):
        apply("index_tensor", {}, x, np.array([-1, 0], np.int64))


def test_half_matmul_and_conv_with_float32_out_dtype_accumulate_in_float32():
    """compiler/precision.py gives fp16 matmuls and convolutions out_dtype float32 (then a cast),
    as cuBLAS/cuDNN accumulate; the reference must sum in float32 too, not round every partial sum
    to fp16."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 4096)).astype(np.float16)
    b = rng.standard_normal((4096, 8)).astype(np.float16)
    got = apply("matmul", {"out_dtype": "float32"}, a, b, out_shapes=[[4, 8]], out_dtypes=["float32"])
    want = a.astype(np.float32) @ b.astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    half = apply("matmul", {"out_dtype": "float16"}, a, b, out_shapes=[[4, 8]], out_dtypes=["float16"])
    assert half.dtype == np.float16 and not np.array_equal(half.astype(np.float32), want)
    x = rng.standard_normal((1, 64, 6, 6)).astype(np.float16)
    w = rng.standard_normal((8, 64, 3, 3)).astype(np.float16)
    got = apply("nn.conv2d", {"out_dtype": "float32"}, x, w, out_shapes=[[1, 8, 4, 4]], out_dtypes=["float32"])
    close(got, F.conv2d(t(x.astype(np.float32)), t(w.astype(np.float32))), rtol=1e-5, atol=1e-4)
    assert got.dtype == np.float32
