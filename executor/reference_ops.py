"""NumPy implementations of the Relax ops that ops.json records, and the interpreter that runs a
fused function's op program.

This is the oracle the CUDA kernels are checked against, so it shares no code with TVM and favours
plain, obviously-right formulas (vectorised: im2col + matmul for convolution, strided windows for
pooling). Every op computes in its recorded dtype and is cast to the recorded output dtype, so the
result does not depend on NumPy's promotion rules; bfloat16 is computed in float32 and rounded to
bfloat16 per op (`_widen`). Op names are Relax names without `relax.`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.bundle.manifests import FusedFunction, OpRecord, Ref

OpFn = Callable[[list[np.ndarray], dict[str, Any], OpRecord], "np.ndarray | tuple[np.ndarray, ...]"]
OPS: dict[str, OpFn] = {}


def op(*names: str) -> Callable[[OpFn], OpFn]:
    def reg(fn: OpFn) -> OpFn:
        for n in names:
            OPS[n] = fn
        return fn
    return reg


class OpFailure(Exception):
    """An op raised or produced the wrong shape; the backend adds the function and node to the message."""


# ---- interpreter ---------------------------------------------------------------------------------

def const_array(c: dict[str, Any]) -> np.ndarray:
    return np.asarray(c["data"], dtype=np_dtype(c["dtype"])).reshape(c["shape"])


def _last_reads(fn: FusedFunction) -> dict[int, list[int]]:
    """op index i -> the ops whose results are read for the last time by op i (never those of the
    function's outputs): what run_function drops after op i."""
    last: dict[int, int] = {}
    for i, rec in enumerate(fn.ops):
        for r in rec.inputs:
            if r.kind == "op":
                last[r.index] = i
    keep = {r.index for r in fn.outputs if r.kind == "op"}
    out: dict[int, list[int]] = {}
    for j, i in last.items():
        if j not in keep:
            out.setdefault(i, []).append(j)
    return out


# A matmul whose weight is unpacked from packed fields (compiler/packed.py) is computed this many
# weight values at a time: the float weight is never whole in memory, as it is not in the kernel.
CHUNK_VALUES = 1 << 22


@dataclass(frozen=True)
class _Unpacked:
    """A matmul (op `matmul`) whose second operand is `permute_dims` (op `transpose`) of a [rows,
    cols] weight computed by ops `ops` (in order) from the function's arguments and constants
    alone, read by nothing else: computed `rows` slice by slice (arguments `row_args` sliced)."""

    matmul: int
    transpose: int
    ops: tuple[int, ...]
    rows: int
    cols: int
    row_args: frozenset[int]


_PLANS: dict[int, tuple[FusedFunction, dict[int, _Unpacked]]] = {}


def _unpacked_matmuls(fn: FusedFunction) -> dict[int, _Unpacked]:
    """The function's matmuls whose weight is unpacked in it (see _Unpacked), by op index; cached."""
    hit = _PLANS.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    readers: dict[int, set[int]] = {}
    for i, rec in enumerate(fn.ops):
        for r in rec.inputs:
            if r.kind == "op":
                readers.setdefault(r.index, set()).add(i)
    outputs = {r.index for r in fn.outputs if r.kind == "op"}
    plans: dict[int, _Unpacked] = {}
    for m, rec in enumerate(fn.ops):
        if rec.op != "matmul" or len(rec.inputs) != 2 or rec.inputs[1].kind != "op":
            continue
        t = rec.inputs[1].index
        trec = fn.ops[t]
        if trec.op != "permute_dims" or len(trec.output_shapes[0]) != 2 or trec.inputs[0].kind != "op":
            continue
        cols, rows = trec.output_shapes[0]
        sub, todo, args = set(), [t], set()
        while todo:  # every op the weight depends on: args and constants only at the leaves
            j = todo.pop()
            if j in sub:
                continue
            sub.add(j)
            for r in fn.ops[j].inputs:
                if r.kind == "op":
                    todo.append(r.index)
                elif r.kind == "arg":
                    args.add(r.index)
        if any(readers.get(j, set()) - sub - {m} for j in sub) or sub & outputs or rows < 2:
            continue  # a weight op read elsewhere, or the weight's values leave the function: as it is
        row_args = frozenset(a for a in args if any(
            r.kind == "arg" and r.index == a and fn.ops[j].input_shapes[k][:1] == [rows]
            for j in sub for k, r in enumerate(fn.ops[j].inputs)))
        if not row_args:
            continue
        plans[m] = _Unpacked(m, t, tuple(sorted(sub)), rows, cols, row_args)
    _PLANS[id(fn)] = (fn, plans)
    return plans


def _chunk_record(rec: OpRecord, rows: int, n: int, last: bool) -> OpRecord:
    """`rec` with its output's row axis (the first, or the last for the transpose) `n` long."""
    shapes = []
    for k, shape in enumerate(rec.output_shapes):
        shape = list(shape)
        if k == 0 and last and shape and shape[-1] == rows:
            shape[-1] = n
        elif k == 0 and not last and shape and shape[0] == rows:
            shape[0] = n
        shapes.append(shape)
    return OpRecord(rec.op, rec.attrs, rec.inputs, rec.input_shapes, rec.input_dtypes, shapes, rec.output_dtypes)


def _run_unpacked(fn: FusedFunction, plan: _Unpacked, args: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
    """`x @ weight^T` with the weight unpacked CHUNK_VALUES values at a time, rows sliced."""
    step = max(1, CHUNK_VALUES // max(1, plan.cols))
    mrec = fn.ops[plan.matmul]
    out = None
    for r0 in range(0, plan.rows, step):
        r1 = min(plan.rows, r0 + step)
        vals: dict[int, Any] = {}
        for j in plan.ops:
            rec = fn.ops[j]
            ins = []
            for r in rec.inputs:
                if r.kind == "arg":
                    a = args[r.index]
                    ins.append(a[r0:r1] if r.index in plan.row_args and a.shape[:1] == (plan.rows,) else a)
                elif r.kind == "const":
                    ins.append(const_array(r.const or {}))
                else:
                    v = vals[r.index]
                    ins.append(v[r.output] if isinstance(v, tuple) else v)
            crec = _chunk_record(rec, plan.rows, r1 - r0, j == plan.transpose)
            vals[j] = _conform(OPS[rec.op]([_widen(a) for a in ins], rec.attrs, crec), crec, j)
        part = OPS["matmul"]([_widen(x), _widen(vals[plan.transpose])], mrec.attrs, mrec)
        if out is None:
            out = np.empty(tuple(mrec.output_shapes[0]), np.asarray(part).dtype)
        out[..., r0:r1] = part
    return out


def run_function(fn: FusedFunction, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Execute a fused function's op program on concrete arguments (its inputs, not its outputs).
    An op's result is dropped after its last reader, and a matmul whose weight the function
    unpacks from packed fields computes it a slice of rows at a time (_Unpacked): a quantized
    bundle's stage holds its packed weights and one slice of float weight, as its kernels do."""
    values: list[Any] = []
    drop = _last_reads(fn)
    unpacked = _unpacked_matmuls(fn)
    skip = {j for p in unpacked.values() for j in p.ops}

    def get(r: Ref) -> np.ndarray:
        if r.kind == "arg":
            return args[r.index]
        if r.kind == "const":
            return const_array(r.const or {})
        v = values[r.index]
        return v[r.output] if isinstance(v, tuple) else v

    for i, rec in enumerate(fn.ops):
        if i in skip:  # computed slice by slice by its matmul
            values.append(None)
            continue
        if i in unpacked:
            values.append(_conform(_run_unpacked(fn, unpacked[i], args, get(rec.inputs[0])), rec, i))
            for j in drop.get(i, ()):
                values[j] = None
            continue
        ins = [_widen(get(r)) for r in rec.inputs]
        try:
            out = OPS[rec.op](ins, rec.attrs, rec)
        except OpFailure:
            raise
        except Exception as exc:  # report which op of which function broke, with shapes
            shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in ins)
            raise OpFailure(f"op {i} '{rec.op}' on ({shapes}) with attrs {rec.attrs}: {type(exc).__name__}: {exc}") from exc
        del ins
        values.append(_conform(out, rec, i))
        del out
        for j in drop.get(i, ()):
            values[j] = None
    return [np.asarray(get(r)) for r in fn.outputs]


def _widen(a: np.ndarray) -> np.ndarray:
    """bfloat16 operands are computed with in float32, as the kernels do: TVM's CUDA code loads a
    bf16 value, computes in float32 (nv_bfloat16 arithmetic is float32 arithmetic rounded once,
    exact for a product), and rounds to nearest even when it stores a bf16 result; _conform
    rounds each op's result to its recorded dtype the same way (ml_dtypes' astype). A bf16 matmul
    is recorded with a float32 output and a cast (compiler/precision.py): float32 accumulation."""
    return a.astype(np.float32) if a.dtype == _BF16 else a


_BF16 = np_dtype("bfloat16")


def _conform(out: Any, rec: OpRecord, i: int) -> Any:
    """Cast to the recorded output dtypes and check the recorded shapes."""
    outs = out if isinstance(out, tuple) else (out,)
    fixed = []
    for k, a in enumerate(outs):
        a = np.asarray(a)
        if k < len(rec.output_dtypes) and rec.output_dtypes[k]:
            a = a.astype(np_dtype(rec.output_dtypes[k]), copy=False)
        if k < len(rec.output_shapes) and list(a.shape) != list(rec.output_shapes[k]):
            raise OpFailure(f"op {i} '{rec.op}' produced shape {list(a.shape)}, ops.json records {rec.output_shapes[k]}")
        fixed.append(a)
    return tuple(fixed) if isinstance(out, tuple) else fixed[0]


def out_shape(rec: OpRecord, k: int = 0) -> tuple[int, ...]:
    if k >= len(rec.output_shapes):
        raise OpFailure(f"'{rec.op}' needs its output shape recorded in ops.json")
    return tuple(rec.output_shapes[k])


def out_dtype(rec: OpRecord, default: np.dtype, k: int = 0) -> np.dtype:
    if k < len(rec.output_dtypes) and rec.output_dtypes[k]:
        return np_dtype(rec.output_dtypes[k])
    return default


def _axes(axis: Any, ndim: int) -> tuple[int, ...] | None:
    if axis is None:
        return None
    axis = [axis] if isinstance(axis, int) else list(axis)
    return tuple(a % ndim for a in axis)


# ---- elementwise -------------------------------------------------------------------------------

def _binary(f: Callable) -> OpFn:
    return lambda x, a, r: f(x[0], x[1])


def _unary(f: Callable) -> OpFn:
    return lambda x, a, r: f(x[0])


for _name, _f in {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
    "minimum": np.minimum, "power": np.power, "equal": np.equal, "not_equal": np.not_equal,
    "less": np.less, "less_equal": np.less_equal, "greater": np.greater, "greater_equal": np.greater_equal,
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor,
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
    "floor_divide": np.floor_divide, "floor_mod": np.mod,
    "left_shift": np.left_shift, "right_shift": np.right_shift,  # unpacking quantized weights
}.items():
    op(_name)(_binary(_f))

for _name, _f in {
    "abs": np.abs, "negative": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "tanh": np.tanh, "floor": np.floor, "ceil": np.ceil,
    "round": np.round, "sign": np.sign, "square": np.square, "logical_not": np.logical_not,
    "bitwise_not": np.invert, "isnan": np.isnan, "isinf": np.isinf, "isfinite": np.isfinite,
    "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh,
    "log2": np.log2, "log10": np.log10, "log1p": np.log1p, "trunc": np.trunc,
}.items():
    op(_name)(_unary(_f))


@op("divide")
def _divide(x, a, r):
    if np.issubdtype(x[0].dtype, np.integer) and np.issubdtype(x[1].dtype, np.integer):
        return np.trunc(np.true_divide(x[0], x[1])).astype(x[0].dtype)  # TIR integer division truncates
    return np.divide(x[0], x[1])


@op("mod")
def _mod(x, a, r):
    return np.fmod(x[0], x[1])


@op("rsqrt")
def _rsqrt(x, a, r):
    one = np.ones((), x[0].dtype)
    return one / np.sqrt(x[0])


@op("sigmoid")
def _sigmoid(x, a, r):
    one = np.ones((), x[0].dtype)
    return one / (one + np.exp(-x[0]))


_ERF_SERIES = [(-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(46)]


def erf(x: np.ndarray) -> np.ndarray:
    """erf without SciPy, in float64: Maclaurin series (Horner) below |x| = 2.5, the continued
    fraction of erfc above; accurate to ~1e-14, far below float32 resolution."""
    z = np.asarray(x, dtype=np.float64)
    a = np.abs(z)
    out = np.empty_like(a)
    small = a < 2.5
    xs = a[small]
    zz = xs * xs
    p = np.full_like(xs, _ERF_SERIES[-1])
    for c in reversed(_ERF_SERIES[:-1]):
        p *= zz
        p += c
    out[small] = xs * p * (2.0 / math.sqrt(math.pi))
    xb = a[~small]
    f = xb.copy()
    for k in range(60, 0, -1):  # erfc(x) = exp(-x^2) / sqrt(pi) / (x + (1/2) / (x + 1 / (x + (3/2) / ...)))
        f = xb + (k / 2) / f
    out[~small] = 1.0 - np.exp(-xb * xb) / (math.sqrt(math.pi) * f)
    return (np.sign(z) * out).astype(np.asarray(x).dtype)


op("erf")(_unary(erf))


@op("clip")
def _clip(x, a, r):
    lo = a.get("min", x[1] if len(x) > 1 else None)
    hi = a.get("max", x[2] if len(x) > 2 else None)
    lo, hi = (np.asarray(v, dtype=x[0].dtype) if v is not None else None for v in (lo, hi))
    return np.clip(x[0], lo, hi)


@op("where")
def _where(x, a, r):
    return np.where(x[0], x[1], x[2])


@op("astype")
def _astype(x, a, r):
    return x[0].astype(np_dtype(a["dtype"]) if a.get("dtype") else out_dtype(r, x[0].dtype))


@op("nn.relu")
def _relu(x, a, r):
    return np.maximum(x[0], np.zeros((), x[0].dtype))


@op("nn.leakyrelu")
def _leakyrelu(x, a, r):
    alpha = np.asarray(a.get("alpha", 0.01), x[0].dtype)
    return np.where(x[0] > 0, x[0], x[0] * alpha)


@op("nn.gelu")
def _gelu(x, a, r):
    v = x[0].astype(np.float64)
    return (0.5 * v * (1.0 + erf(v / math.sqrt(2.0)))).astype(x[0].dtype)


@op("nn.gelu_tanh")
def _gelu_tanh(x, a, r):
    v = x[0].astype(np.float64)
    return (0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))).astype(x[0].dtype)


@op("nn.silu")
def _silu(x, a, r):
    return x[0] * _sigmoid(x, a, r)


@op("nn.softmax")
def _softmax(x, a, r):
    ax = a.get("axis", -1)
    e = np.exp(x[0] - np.max(x[0], axis=ax, keepdims=True))
    return e / np.sum(e, axis=ax, keepdims=True)


@op("nn.log_softmax")
def _log_softmax(x, a, r):
    ax = a.get("axis", -1)
    s = x[0] - np.max(x[0], axis=ax, keepdims=True)
    return s - np.log(np.sum(np.exp(s), axis=ax, keepdims=True))


# ---- normalisation -----------------------------------------------------------------------------

def _norm_axes(a: dict, ndim: int, default: Sequence[int]) -> tuple[int, ...]:
    return _axes(a.get("axes", list(default)), ndim) or tuple(range(ndim))


def _affine(y: np.ndarray, gamma, beta, axes: tuple[int, ...], a: dict) -> np.ndarray:
    """Apply gamma/beta laid out along `axes` (their shape is the normalised dims)."""
    shape = [y.shape[i] if i in axes else 1 for i in range(y.ndim)]
    if gamma is not None and a.get("scale", True):
        y = y * gamma.reshape(shape)
    if beta is not None and a.get("center", True):
        y = y + beta.reshape(shape)
    return y


@op("nn.layer_norm")
def _layer_norm(x, a, r):
    v = x[0]
    axes = _norm_axes(a, v.ndim, [-1])
    mean = v.mean(axis=axes, keepdims=True)
    var = np.square(v - mean).mean(axis=axes, keepdims=True)
    y = (v - mean) / np.sqrt(var + np.asarray(a.get("epsilon", 1e-5), v.dtype))
    return _affine(y, x[1] if len(x) > 1 else None, x[2] if len(x) > 2 else None, axes, a)


@op("nn.rms_norm")
def _rms_norm(x, a, r):
    v = x[0]
    axes = _norm_axes(a, v.ndim, [-1])
    y = v / np.sqrt(np.square(v).mean(axis=axes, keepdims=True) + np.asarray(a.get("epsilon", 1e-5), v.dtype))
    return _affine(y, x[1] if len(x) > 1 else None, None, axes, a)


@op("nn.group_norm")
def _group_norm(x, a, r):
    v = x[0]
    c_ax = a.get("channel_axis", 1) % v.ndim
    groups = int(a["num_groups"])
    moved = np.moveaxis(v, c_ax, 1)
    n, c = moved.shape[:2]
    g = moved.reshape(n, groups, c // groups, *moved.shape[2:])
    red = tuple(range(2, g.ndim))
    mean = g.mean(axis=red, keepdims=True)
    var = np.square(g - mean).mean(axis=red, keepdims=True)
    y = ((g - mean) / np.sqrt(var + np.asarray(a.get("epsilon", 1e-5), v.dtype))).reshape(moved.shape)
    y = np.moveaxis(y, 1, c_ax)
    return _affine(y, x[1] if len(x) > 1 else None, x[2] if len(x) > 2 else None, (c_ax,), a)


@op("nn.batch_norm")
def _batch_norm(x, a, r):
    v, gamma, beta, mean, var = x[:5]
    ax = a.get("axis", 1) % v.ndim
    shape = [v.shape[i] if i == ax else 1 for i in range(v.ndim)]
    y = (v - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + np.asarray(a.get("epsilon", 1e-5), v.dtype))
    y = _affine(y, gamma, beta, (ax,), a)
    return (y, mean, var)  # inference form: Relax returns (out, moving_mean, moving_var)


@op("nn.dropout")
def _dropout(x, a, r):
    return (x[0], np.ones_like(x[0]))  # inference: identity, mask of ones


# ---- linear algebra ----------------------------------------------------------------------------

@op("matmul")
def _matmul(x, a, r):
    a0, a1 = accumulating(r, x[0], x[1])
    return np.matmul(a0, a1)


def accumulating(r: OpRecord, *xs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Operands in the op's accumulation dtype: a float16/bfloat16 matmul or convolution with a
    float32 out_dtype (compiler/precision.py) sums in float32, as its kernel does."""
    dt = out_dtype(r, xs[0].dtype)
    if dt.kind == "f" and dt.itemsize > xs[0].dtype.itemsize and xs[0].dtype.kind in "fV":
        return tuple(v.astype(dt) for v in xs)
    return xs


@op("nn.dense", "dense")
def _dense(x, a, r):
    return np.matmul(x[0], np.swapaxes(x[1], -1, -2))


def _layout_to(v: np.ndarray, src: str, dst: str) -> np.ndarray:
    if src == dst:
        return v
    if sorted(src) != sorted(dst) or len(src) != v.ndim:
        raise OpFailure(f"unsupported layout {src!r} (expected a permutation of {dst!r})")
    return np.transpose(v, [src.index(c) for c in dst])


def _pads(p: Any, nd: int) -> tuple[list[int], list[int]]:
    """Relax padding: [all], [per-dim begin == end], or [begins..., ends...]."""
    p = [p] if isinstance(p, int) else list(p)
    if len(p) == 1:
        p = p * nd
    if len(p) == nd:
        return p, p
    return p[:nd], p[nd:]


def _pair(v: Any, nd: int) -> list[int]:
    v = [v] if isinstance(v, int) else list(v)
    return v * nd if len(v) == 1 else v


def conv_nd(v: np.ndarray, w: np.ndarray, strides: Any, padding: Any, dilation: Any, groups: int) -> np.ndarray:
    """N-d convolution, channels-first (N, C, *S) x (O, C/groups, *K): im2col + batched matmul."""
    nd = v.ndim - 2
    st, dl = _pair(strides, nd), _pair(dilation, nd)
    lo, hi = _pads(padding, nd)
    v = np.pad(v, [(0, 0), (0, 0)] + [(lo[i], hi[i]) for i in range(nd)])
    n, c = v.shape[:2]
    o, cg = w.shape[:2]
    ks = w.shape[2:]
    osz = [(v.shape[2 + i] - dl[i] * (ks[i] - 1) - 1) // st[i] + 1 for i in range(nd)]
    sv = v.strides
    cols = as_strided(v, shape=(n, c, *osz, *ks),
                      strides=(sv[0], sv[1], *[sv[2 + i] * st[i] for i in range(nd)],
                               *[sv[2 + i] * dl[i] for i in range(nd)]))
    g = groups
    cols = cols.reshape(n, g, cg, *osz, *ks)
    # (n, g, cg, *ks, *osz) -> (n, g, cg*K, P): both matmul operands contiguous, so BLAS runs per batch
    perm = [0, 1, 2, *range(3 + nd, 3 + 2 * nd), *range(3, 3 + nd)]
    kk = cg * math.prod(ks)
    cols = np.ascontiguousarray(cols.transpose(perm)).reshape(n, g, kk, math.prod(osz))
    wg = np.ascontiguousarray(w).reshape(g, o // g, kk)
    return np.matmul(wg, cols).reshape(n, o, *osz)  # (n, g, o/g, P)


@op("nn.conv1d", "nn.conv2d", "nn.conv3d")
def _conv(x, a, r):
    v, w = accumulating(r, x[0], x[1])
    nd = v.ndim - 2
    sp = "DHW"[-nd:] if nd <= 3 else None
    dlay = a.get("data_layout") or "NC" + sp
    klay = a.get("kernel_layout") or "OI" + sp
    olay = a.get("out_layout") or dlay
    out = conv_nd(_layout_to(v, dlay, "NC" + sp), _layout_to(w, klay, "OI" + sp), a.get("strides", 1),
                  a.get("padding", 0), a.get("dilation", 1), int(a.get("groups", 1)))
    out = _layout_to(out, "NC" + sp, olay) if olay != "NC" + sp else out
    return out.astype(out_dtype(r, v.dtype), copy=False)


# ---- pooling -----------------------------------------------------------------------------------

def _pool(v: np.ndarray, a: dict, kind: str, nd: int) -> np.ndarray:
    layout = a.get("layout") or "NC" + "DHW"[-nd:]
    base = "NC" + "DHW"[-nd:]
    v = _layout_to(v, layout, base)
    ks = _pair(a.get("pool_size", 1), nd)
    st = _pair(a.get("strides", 1), nd)
    dl = _pair(a.get("dilation", 1), nd)
    lo, hi = _pads(a.get("padding", 0), nd)
    ceil = bool(a.get("ceil_mode", False))
    osz = []
    extra = []
    for i in range(nd):
        span = v.shape[2 + i] + lo[i] + hi[i] - dl[i] * (ks[i] - 1) - 1
        o = (-(-span // st[i]) if ceil else span // st[i]) + 1
        if ceil and (o - 1) * st[i] >= v.shape[2 + i] + lo[i]:
            o -= 1  # a window must start inside the input or its left padding
        osz.append(o)
        extra.append(max(0, (o - 1) * st[i] + dl[i] * (ks[i] - 1) + 1 - (v.shape[2 + i] + lo[i] + hi[i])))
    if kind == "max":
        fill = -np.inf if v.dtype.kind == "f" else np.iinfo(v.dtype).min
    else:
        fill = 0
    widths = [(0, 0), (0, 0)] + [(lo[i], hi[i] + extra[i]) for i in range(nd)]
    vp = np.pad(v, widths, constant_values=fill)
    acc_dt = np.float64 if kind == "avg" and v.dtype.kind == "f" else vp.dtype
    acc = None
    for offs in itertools.product(*[range(k) for k in ks]):  # one strided slice per window position
        sl = vp[(slice(None), slice(None)) + tuple(
            slice(offs[i] * dl[i], offs[i] * dl[i] + (osz[i] - 1) * st[i] + 1, st[i]) for i in range(nd))]
        if acc is None:
            acc = sl.astype(acc_dt, copy=True)
        elif kind == "max":
            np.maximum(acc, sl, out=acc)
        else:
            acc += sl
    if kind == "max":
        out = acc
    else:
        total = acc
        # divisor: valid (non-padding) elements, or everything inside the explicit padding
        ones = np.pad(np.ones(v.shape[2:], np.float64), [(lo[i], hi[i]) for i in range(nd)],
                      constant_values=1.0 if a.get("count_include_pad", False) else 0.0)
        ones = np.pad(ones, [(0, extra[i]) for i in range(nd)])
        so = ones.strides
        cnt = as_strided(ones, shape=(*osz, *ks), strides=(*[so[i] * st[i] for i in range(nd)],
                                                           *[so[i] * dl[i] for i in range(nd)]))
        out = total / np.maximum(cnt.sum(axis=tuple(range(nd, 2 * nd))), 1.0)
    out = out.astype(v.dtype)
    return _layout_to(out, base, a.get("out_layout") or layout)


@op("nn.max_pool1d", "nn.max_pool2d", "nn.max_pool3d")
def _max_pool(x, a, r):
    return _pool(x[0], a, "max", x[0].ndim - 2)


@op("nn.avg_pool1d", "nn.avg_pool2d", "nn.avg_pool3d")
def _avg_pool(x, a, r):
    return _pool(x[0], a, "avg", x[0].ndim - 2)


@op("nn.adaptive_avg_pool1d", "nn.adaptive_avg_pool2d", "nn.adaptive_avg_pool3d")
def _adaptive_avg_pool(x, a, r):
    v = x[0]
    nd = v.ndim - 2
    base = "NC" + "DHW"[-nd:]
    layout = a.get("layout") or base
    v = _layout_to(v, layout, base)
    size = a.get("output_size")
    osz = list(v.shape[2:]) if size is None else _pair(size, nd)
    out = v.astype(np.float64)
    for i in range(nd):  # separable: average along one spatial axis at a time
        n_in, n_out = out.shape[2 + i], osz[i]
        if n_in % n_out == 0:
            shp = out.shape[:2 + i] + (n_out, n_in // n_out) + out.shape[3 + i:]
            out = out.reshape(shp).mean(axis=3 + i)
        else:
            parts = [np.take(out, range((k * n_in) // n_out, -((-(k + 1) * n_in) // n_out)), axis=2 + i).mean(axis=2 + i, keepdims=True)
                     for k in range(n_out)]
            out = np.concatenate(parts, axis=2 + i)
    return _layout_to(out.astype(v.dtype), base, a.get("out_layout") or layout)


# ---- reductions --------------------------------------------------------------------------------

def _reduce(f: Callable) -> OpFn:
    def run(x, a, r):
        v = x[0]
        return f(v, axis=_axes(a.get("axis"), v.ndim), keepdims=bool(a.get("keepdims", False)))
    return run


for _name, _f in {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod,
                  "variance": np.var, "std": np.std}.items():
    op(_name)(_reduce(_f))


@op("argmax", "argmin")
def _argmax(x, a, r):
    f = np.argmax if r.op == "argmax" else np.argmin
    ax = a.get("axis")
    out = f(x[0], axis=ax, keepdims=bool(a.get("keepdims", False)))
    return out.astype(out_dtype(r, np.dtype(np.int64)))


@op("cumsum", "cumprod")
def _cumsum(x, a, r):
    f = np.cumsum if r.op == "cumsum" else np.cumprod
    ax = a.get("axis")
    v = x[0].reshape(-1) if ax is None else x[0]
    out = f(v, axis=0 if ax is None else ax, dtype=np_dtype(a["dtype"]) if a.get("dtype") else None)
    if a.get("exclusive"):
        out = (out - v) if r.op == "cumsum" else out / v
    return out


# ---- data movement -----------------------------------------------------------------------------

@op("reshape", "flatten", "broadcast_to", "nn.flatten")
def _reshape_like_output(x, a, r):
    """The target shape is an operand in Relax; ops.json records it as the output shape."""
    shape = out_shape(r)
    return np.broadcast_to(x[0], shape).copy() if r.op == "broadcast_to" else x[0].reshape(shape)


@op("permute_dims")
def _permute(x, a, r):
    axes = a.get("axes")
    return np.transpose(x[0], None if axes is None else [int(i) for i in axes])


@op("expand_dims")
def _expand(x, a, r):
    return x[0].reshape(out_shape(r)) if r.output_shapes else np.expand_dims(x[0], tuple(_pair(a["axis"], 1)))


@op("squeeze")
def _squeeze(x, a, r):
    ax = a.get("axis")
    return np.squeeze(x[0], axis=None if ax is None else tuple(_pair(ax, 1)))


@op("concat")
def _concat(x, a, r):
    ax = a.get("axis", 0)
    return np.concatenate(x, axis=0 if ax is None else ax)


@op("stack")
def _stack(x, a, r):
    return np.stack(x, axis=a.get("axis", 0) or 0)


@op("split")
def _split(x, a, r):
    sec = a.get("indices_or_sections")
    parts = np.split(x[0], sec if isinstance(sec, int) else [int(i) for i in sec], axis=a.get("axis", 0))
    return tuple(parts)


@op("strided_slice")
def _strided_slice(x, a, r):
    v = x[0]
    sl = [slice(None)] * v.ndim
    axes = a.get("axes")
    begin, end = a.get("begin", []), a.get("end", [])
    strides = a.get("strides") or [1] * len(begin)
    axes = list(range(len(begin))) if axes is None else axes
    for ax, b, e, s in zip(axes, begin, end, strides):
        sl[ax % v.ndim] = slice(b, e, s)
    return v[tuple(sl)]


@op("index_tensor")
def _index_tensor(x, a, r):
    """NumPy advanced indexing: the index tensors (broadcast together) select along the leading axes.
    TVM's kernel reads the raw index, like its gathers: an index outside its axis is refused."""
    idx = tuple(i.astype(np.int64) for i in x[1:])
    for j, i in enumerate(idx):
        _check_range("index_tensor", i, x[0].shape[j], j, "TVM's kernel does not wrap negative indices")
    return x[0][idx]


def _check_range(op_name: str, idx: np.ndarray, extent: int, axis: int, why: str) -> None:
    """TVM's gather kernels index memory with the raw value: no wrap for negatives, no bounds check.
    The importers normalise negative indices before the op (ONNX) or the framework refuses them
    (torch.gather), so an index outside [0, extent) here means the compiled kernel reads outside its
    row: refused rather than given a made-up value."""
    if idx.size and (idx.min() < 0 or idx.max() >= extent):
        bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
        raise OpFailure(f"'{op_name}' index {bad} outside [0, {extent}) on axis {axis} ({why})")


@op("take")
def _take(x, a, r):
    """relax.take (topi.take): `fast` indexes with the raw value (out-of-range is undefined in the
    kernel, refused here), `clip` clamps, `wrap` takes the index modulo the extent (negatives from
    the back), `nan` gives NaN for out-of-range indices."""
    mode = a.get("mode", "fast")
    ax = a.get("axis")
    data = x[0]
    idx = x[1].astype(np.int64)
    extent = data.size if ax is None else data.shape[int(ax) % data.ndim]
    if mode == "wrap":
        return np.take(data, np.mod(idx, extent), axis=ax)
    if mode == "clip":
        return np.take(data, np.clip(idx, 0, extent - 1), axis=ax)
    if mode == "nan":
        out = np.take(data, np.clip(idx, 0, extent - 1), axis=ax).astype(out_dtype(r, data.dtype), copy=True)
        bad = (idx < 0) | (idx >= extent)
        if bad.any():
            axis = 0 if ax is None else int(ax) % data.ndim
            shape = [1] * out.ndim
            shape[axis:axis + idx.ndim] = idx.shape
            out[np.broadcast_to(bad.reshape(shape), out.shape)] = np.nan
        return out
    _check_range("take", idx, extent, 0 if ax is None else int(ax) % data.ndim, "mode 'fast' reads out of bounds")
    return np.take(data, idx, axis=ax)


@op("gather_elements")
def _gather_elements(x, a, r):
    """relax.gather_elements (topi.gather, torch.gather, ONNX GatherElements): the output has the
    indices' shape, `out[i_0, .., i_n] = data[i_0, .., idx[i_0, .., i_n], .., i_n]` with the index
    replacing position `axis` (a negative axis counts from the back). The indices may be smaller
    than the data on the other axes; they are read as-is (see _check_range)."""
    data, idx = x[0], x[1].astype(np.int64)
    axis = int(a.get("axis", 0)) % data.ndim
    _check_range("gather_elements", idx, data.shape[axis], axis, "TVM's kernel does not wrap negative indices")
    where = list(np.indices(idx.shape, sparse=True))
    where[axis] = idx
    return data[tuple(where)]


@op("gather_nd")
def _gather_nd(x, a, r):
    """relax.gather_nd (ONNX GatherND layout): indices `[*batch, *rest, M]`; the first `batch_dims`
    axes of data and indices are matched, the last index axis holds M coordinates into the next M
    data axes; the output is `indices.shape[:-1] + data.shape[batch_dims + M:]`."""
    data, idx = x[0], x[1].astype(np.int64)
    b = int(a.get("batch_dims", 0))
    m = idx.shape[-1]
    for j in range(m):
        _check_range("gather_nd", idx[..., j], data.shape[b + j], b + j, "TVM's kernel does not wrap negative indices")
    batch = math.prod(data.shape[:b])
    flat_data = data.reshape((batch,) + data.shape[b:])
    flat_idx = idx.reshape((batch, -1, m))
    out = np.stack([flat_data[k][tuple(flat_idx[k].T)] for k in range(batch)])
    return out.reshape(idx.shape[:-1] + data.shape[b + m:])


@op("tile")
def _tile(x, a, r):
    return np.tile(x[0], a["repeats"])


@op("repeat")
def _repeat(x, a, r):
    return np.repeat(x[0], a["repeats"], axis=a.get("axis"))


@op("flip")
def _flip(x, a, r):
    return np.flip(x[0], axis=a.get("axis"))


@op("nn.pad")
def _pad(x, a, r):
    widths = list(a["pad_width"])
    pairs = [(widths[2 * i], widths[2 * i + 1]) for i in range(x[0].ndim)]
    mode = a.get("pad_mode", "constant")
    if mode == "constant":
        value = a.get("pad_value", x[1] if len(x) > 1 else 0)
        return np.pad(x[0], pairs, constant_values=np.asarray(value, x[0].dtype))
    return np.pad(x[0], pairs, mode={"edge": "edge", "reflect": "reflect"}[mode])


@op("tril", "triu")
def _tri(x, a, r):
    k = int(a.get("k", x[1] if len(x) > 1 else 0))
    return (np.tril if r.op == "tril" else np.triu)(x[0], k)


@op("zeros_like", "ones_like", "full_like")
def _like(x, a, r):
    dt = out_dtype(r, x[0].dtype)
    if r.op == "full_like":
        return np.full(x[0].shape, np.asarray(x[1]).item(), dtype=dt)
    return (np.zeros if r.op == "zeros_like" else np.ones)(x[0].shape, dt)


@op("zeros", "ones", "full")
def _fill(x, a, r):
    dt = out_dtype(r, np.dtype(np.float32))
    if r.op == "full":
        return np.full(out_shape(r), np.asarray(x[-1]).item(), dtype=dt)
    return (np.zeros if r.op == "zeros" else np.ones)(out_shape(r), dt)


@op("arange")
def _arange(x, a, r):
    start, end, step = (float(np.asarray(v).item()) for v in x[:3]) if len(x) >= 3 else (a["start"], a["end"], a["step"])
    return np.arange(start, end, step).astype(out_dtype(r, np.dtype(np.int64)))


# ---- paged KV (docs/paged-kv.md): the kernels of compiler/pagedkv.py, by executor/paged_attention.py ----

@op("paged_append")
def _paged_append(x, a, r):
    """pages <- the step's K/V at the position map, written over the pool argument itself (the
    kernel's call_tir_inplace: the graph gives its output the pool's storage), which is returned."""
    pages, k, v, position_map = x[:4]
    if not pages.flags.writeable:
        pages = pages.copy()
    _paged().append(pages, k, v, np.asarray(position_map))
    return pages


@op("paged_decode")
def _paged_decode(x, a, r):
    """(output, lse) of each row's one query over its pages; the rope offsets (x[5:]) are unread:
    the kernels are built with rotary off (the step rotates q and k itself)."""
    q, pages, indptr, values, last = x[:5]
    return _paged().decode(q, pages, indptr, values, last, float(a["sm_scale"]))


@op("paged_prefill")
def _paged_prefill(x, a, r):
    """(output, lse) of a chunk's packed queries over their rows' pages, causal."""
    q, q_indptr, pages, indptr, values, last = x[:6]
    return _paged().prefill(q, q_indptr, pages, indptr, values, last, bool(a.get("causal", True)),
                            float(a["sm_scale"]))


def _paged() -> Any:
    from tvmpipe.executor import paged_attention

    return paged_attention


def unknown_ops(names: Sequence[str]) -> list[str]:
    return [n for n in names if n not in OPS]
