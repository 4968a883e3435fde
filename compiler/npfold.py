"""Constant folding of weight preprocessing in NumPy, before TVM's FoldConstant.

TVM's FoldConstant builds every foldable call with LLVM (tens of milliseconds each); batch-norm
folding alone gives ResNet-18 about a hundred of them, which made constant folding most of its
compile time. The ops weight preprocessing uses are simple and exactly rounded in IEEE arithmetic,
so NumPy computes the same values in microseconds. Anything else is left to FoldConstant. Folded
constants are named after the weight they derive from plus the last op (`conv1_weight_multiply`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tvmpipe.compiler.constnames import ConstNames
from tvmpipe.compiler.rewrite import rewrite_main

_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
    "relax.divide": np.divide,
}
_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relax.sqrt": np.sqrt, "relax.negative": np.negative,
    "relax.rsqrt": lambda a: (np.ones((), a.dtype) / np.sqrt(a)).astype(a.dtype),
}


def _value(arg: Any) -> np.ndarray | None:
    """NumPy value of a constant tensor or literal scalar argument; None if not constant."""
    import tvm
    from tvm import tirx

    if isinstance(arg, tvm.ir.GenericConst):
        return arg.value.numpy()
    if isinstance(arg, (tirx.FloatImm, tirx.IntImm)):
        return np.array(arg.value, dtype=str(arg.ty))
    return None


def _evaluate(op: str, call: Any, args: list[Any]) -> np.ndarray | None:
    from tvm import relax

    if op in _BINARY or op in _UNARY:
        vals = [_value(a) for a in args]
        if any(v is None for v in vals):
            return None
        return _BINARY[op](*vals) if op in _BINARY else _UNARY[op](*vals)
    data = _value(args[0]) if args else None
    if data is None:
        return None
    if op == "relax.reshape" and isinstance(args[1], relax.ShapeExpr):
        return data.reshape([int(d.value) for d in args[1].values])
    if op == "relax.permute_dims":
        axes = call.attrs.axes
        return np.transpose(data, None if axes is None else [int(a) for a in axes])
    return None


def fold_constants(mod: Any, names: ConstNames) -> Any:
    """`mod` with constant-only calls of the ops above replaced by named constants."""
    from tvm import relax

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        out = _evaluate(op.name, binding.value, args)
        ty = binding.var.ty
        if out is not None and isinstance(ty, relax.TensorType) and ty.shape is not None \
                and list(out.shape) == [int(d) for d in ty.shape.values] and str(out.dtype) == str(ty.dtype):
            const = relax.const(np.ascontiguousarray(out))
            root = next((names.root(a) for a in args if isinstance(a, type(const)) and names.root(a)), None)
            if root:
                names.add(const, f"{root}_{op.name.split('.')[-1]}", root=root)
            return const
        return relax.Call(op, args, binding.value.attrs, binding.value.ty_args)

    return rewrite_main(mod, map_call=call)
