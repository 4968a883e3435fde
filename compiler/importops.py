"""Converters given to TVM's torch importer (`custom_convert_map`) for checkpoint programs.

A checkpoint's decode step (compiler/frontend.py `_from_checkpoint`) is imported as torch.export
traced it, without `run_decompositions()`: that second trace of every op took 44 s of a 135M
Llama decode step's 67 s import (30 layers, 3096 nodes), and TVM's importer takes the high-level
ops (linear, silu, layer_norm, softmax) itself. (A forward pass runs transformers' own forward,
whose mask code uses ops TVM imports only decomposed, `where.ScalarOther`: it is decomposed.) Three need help (UNDECOMPOSED): `to.device` and
`numpy_T` (`x.T`), which TVM does not know (a cast where `to` names a dtype; a transpose), and
`softmax.int`, whose `dtype` argument (transformers' `softmax(x, dtype=torch.float32)`) TVM ignores.

Half precision (HALF): TVM 0.27's importer converts every `mm`, `bmm`, `matmul`, `linear` and `addmm` with
`out_dtype="float32"`, so a half-precision program does not import (`R.add(p_bias, lv)`: bfloat16
vs float32). These converters (passed as `custom_convert_map`) keep the float32 accumulation and
round the result to the operands' dtype once, with a bias added before the rounding, which is how
torch's CPU (oneDNN) and cuBLAS half-precision GEMMs compute. Everything else imports unchanged,
so the program keeps the places where the model itself computes in float32 (an RMSNorm's
variance, a softmax, the rotary angles: `.to(torch.float32)` in transformers) and rounds where it
rounds: a decode step's tokens follow transformers' own half-precision run.

The frontend passes these for half-precision checkpoints only; a float32 operand pair would
import as TVM imports it anyway (out_dtype float32, no cast).
"""

from __future__ import annotations

from typing import Any, Callable

F32 = "float32"


def _args(node: Any, importer: Any) -> list[Any]:
    import torch

    return [importer.env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]


def _accumulate(importer: Any, a: Any, b: Any, bias: Any = None, alpha: float = 1.0, beta: float = 1.0) -> Any:
    """matmul(a, b) in float32 (+ beta x bias), rounded once to the operands' dtype."""
    from tvm import relax

    bb = importer.block_builder
    low = str(a.ty.dtype)
    if str(b.ty.dtype) != low:  # torch refuses mixed operands; an importer constant may differ: promote
        a, b, low = bb.emit(relax.op.astype(a, F32)), bb.emit(relax.op.astype(b, F32)), F32
    out = bb.emit(relax.op.matmul(a, b, out_dtype=F32))
    if alpha != 1:
        out = bb.emit(relax.op.multiply(out, relax.const(alpha, F32)))
    if bias is not None and beta != 0:
        bias = bias if str(bias.ty.dtype) == F32 else bb.emit(relax.op.astype(bias, F32))
        if beta != 1:
            bias = bb.emit(relax.op.multiply(bias, relax.const(beta, F32)))
        out = bb.emit(relax.op.add(out, bias))
    return out if low == F32 else bb.emit(relax.op.astype(out, low))


def _matmul(node: Any, importer: Any) -> Any:
    a, b = _args(node, importer)[:2]
    return _accumulate(importer, a, b)


def _linear(node: Any, importer: Any) -> Any:
    from tvm import relax

    args = _args(node, importer)
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
    return _accumulate(importer, x, importer.block_builder.emit(relax.op.permute_dims(w)), bias)


def _addmm(node: Any, importer: Any) -> Any:
    bias, a, b = _args(node, importer)[:3]
    return _accumulate(importer, a, b, bias, alpha=node.kwargs.get("alpha", 1), beta=node.kwargs.get("beta", 1))


def _cast_to(importer: Any, x: Any, dtype: Any) -> Any:
    """`x` as torch dtype `dtype` (None or its own: unchanged)."""
    import torch
    from tvm import relax

    if not isinstance(dtype, torch.dtype):
        return x
    name = str(dtype).replace("torch.", "")
    return x if str(x.ty.dtype) == name else importer.block_builder.emit(relax.op.astype(x, name))


def _to_device(node: Any, importer: Any) -> Any:
    """aten `to.device(x, device, dtype, ...)`: one device here; a cast where the dtype differs."""
    args = _args(node, importer)
    return _cast_to(importer, args[0], args[2] if len(args) > 2 else node.kwargs.get("dtype"))


def _softmax(node: Any, importer: Any) -> Any:
    """aten `softmax.int(x, dim, dtype=None)`: the input cast to `dtype` first, as torch does."""
    from tvm import relax

    args = _args(node, importer)
    x = _cast_to(importer, args[0], args[2] if len(args) > 2 else node.kwargs.get("dtype"))
    dim = args[1] if len(args) > 1 else node.kwargs.get("dim", -1)
    return importer.block_builder.emit(relax.op.nn.softmax(x, dim))


# aten op name -> converter(node, importer)
HALF: dict[str, Callable[[Any, Any], Any]] = {
    "matmul.default": _matmul, "mm.default": _matmul, "bmm.default": _matmul, "linear.default": _linear,
    "addmm.default": _addmm,
}
def _numpy_t(node: Any, importer: Any) -> Any:
    """aten `numpy_T(x)` (`x.T`, Falcon's linear layers): every axis reversed."""
    from tvm import relax

    x = _args(node, importer)[0]
    return importer.block_builder.emit(relax.op.permute_dims(x, list(range(len(x.ty.shape.values)))[::-1]))


def _shift(op: str) -> Callable[[Any, Any], Any]:
    """aten `__rshift__`/`__lshift__` (a packed weight's unpacking, compiler/packed.py): TVM's
    importer has bitwise and/or but no shifts; Relax's right_shift/left_shift on the same dtype."""

    def convert(node: Any, importer: Any) -> Any:
        from tvm import relax

        x, s = _args(node, importer)[:2]
        if not hasattr(s, "ty"):
            s = relax.const(s, str(x.ty.dtype))
        elif str(s.ty.dtype) != str(x.ty.dtype):
            s = importer.block_builder.emit(relax.op.astype(s, str(x.ty.dtype)))
        return importer.block_builder.emit(getattr(relax.op, op)(x, s))

    return convert


SHIFTS: dict[str, Callable[[Any, Any], Any]] = {
    "__rshift__.Tensor": _shift("right_shift"), "__rshift__.Scalar": _shift("right_shift"),
    "__lshift__.Tensor": _shift("left_shift"), "__lshift__.Scalar": _shift("left_shift"),
}
UNDECOMPOSED: dict[str, Callable[[Any, Any], Any]] = {"to.device": _to_device, "softmax.int": _softmax,
                                                      "numpy_T.default": _numpy_t}


def converters(dtype: str, decomposed: bool) -> dict[str, Callable[[Any, Any], Any]]:
    """The converters for a checkpoint program imported in `dtype`, `decomposed` or as traced."""
    return {**SHIFTS, **({} if decomposed else UNDECOMPOSED), **(HALF if dtype in ("bfloat16", "float16") else {})}
