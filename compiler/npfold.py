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
from tvmpipe.compiler.lazyweights import LazyWeights
from tvmpipe.compiler.rewrite import rewrite_main

_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
    "relax.divide": np.divide,
}
_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relax.sqrt": np.sqrt, "relax.negative": np.negative,
    "relax.rsqrt": lambda a: (np.ones((), a.dtype) / np.sqrt(a)).astype(a.dtype),
}


_LAYOUT = ("relax.reshape", "relax.permute_dims")  # ops that only move values


def _axes(call: Any) -> tuple[int, ...] | None:
    """A permute_dims' axes, None meaning all reversed as Relax reads it (a reshape's result is its type)."""
    if call.op.name != "relax.permute_dims":
        return None
    axes = call.attrs.axes
    if axes is None:
        return tuple(range(len(call.args[0].ty.shape.values)))[::-1]
    return tuple(int(a) for a in axes)


def _value(arg: Any) -> np.ndarray | None:
    """NumPy value of a constant tensor or literal scalar argument; None if not constant."""
    import tvm
    from tvm import tirx

    if isinstance(arg, tvm.ir.GenericConst):
        return arg.value.numpy()
    if isinstance(arg, (tirx.FloatImm, tirx.IntImm)):
        return np.array(arg.value, dtype=str(arg.ty))
    return None


def _plan(op: str, call: Any, args: list[Any]) -> tuple[Callable[..., np.ndarray], list[Any]] | None:
    """(fn, operands) when the call is one of the ops above on constants only: `fn` maps the
    operands' values (constants, or NumPy arrays for literal scalars) to the result."""
    import tvm
    from tvm import relax, tirx

    def operand(a: Any) -> Any:
        if isinstance(a, tvm.ir.GenericConst):
            return a
        if isinstance(a, (tirx.FloatImm, tirx.IntImm)):
            return np.array(a.value, dtype=str(a.ty))
        return None

    if op in _BINARY or op in _UNARY:
        ops = [operand(a) for a in args]
        if any(o is None for o in ops):
            return None
        return (_BINARY[op] if op in _BINARY else _UNARY[op]), ops
    data = operand(args[0]) if args else None
    if data is None or isinstance(data, np.ndarray):
        return None
    if op == "relax.reshape" and isinstance(args[1], relax.ShapeExpr):
        shape = [int(d.value) for d in args[1].values]
        return (lambda a: a.reshape(shape)), [data]
    if op == "relax.permute_dims":
        axes = call.attrs.axes
        perm = None if axes is None else [int(a) for a in axes]
        return (lambda a: np.transpose(a, perm)), [data]
    return None


def _result_type(op: str, operands: list[Any]) -> str:
    """The dtype NumPy's evaluation of a plan gives, from the operands' dtypes alone."""
    from tvmpipe.bundle.dtypes import np_dtype

    dts = [o.dtype if isinstance(o, np.ndarray) else np_dtype(str(o.ty.dtype)) for o in operands]
    if op in _BINARY or op in ("relax.sqrt", "relax.negative"):
        return str(np.result_type(*[np.empty(0, d) for d in dts]))
    return str(dts[0])


def _evaluate(op: str, call: Any, args: list[Any]) -> np.ndarray | None:
    plan = _plan(op, call, args)
    if plan is None:
        return None
    fn, operands = plan
    return fn(*[o if isinstance(o, np.ndarray) else o.value.numpy() for o in operands])


def fold_constants(mod: Any, names: ConstNames, weights: LazyWeights | None = None) -> Any:
    """`mod` with constant-only calls of the ops above replaced by named constants. A call reading
    a placeholder weight (`lazyweights`) gives a placeholder whose recipe is the call: nothing is
    computed until the bundle is written."""
    from tvm import relax

    from tvmpipe.compiler.opmap import key

    layouts: dict[tuple, Any] = {}  # (op, its shape/axes, weight) -> the folded constant

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        ty = binding.var.ty
        typed = isinstance(ty, relax.TensorType) and ty.shape is not None
        plan = _plan(op.name, binding.value, args) if typed else None
        same = (op.name, str(ty), _axes(binding.value), key(args[0])) if plan is not None and op.name in _LAYOUT else None
        if same in layouts:  # one weight transposed twice the same way is one constant (tied.py)
            return layouts[same]
        const = None
        if plan is not None and weights is not None and any(
                not isinstance(o, np.ndarray) and weights.is_lazy(o) for o in plan[1]):
            shape = tuple(int(d) for d in ty.shape.values)
            if _result_type(op.name, plan[1]) == str(ty.dtype):  # else TVM folds it, materialized
                const = weights.derive(plan[0], plan[1], shape, str(ty.dtype), op.name,
                                       "layout" if op.name in _LAYOUT else "op")
        elif plan is not None:
            fn, operands = plan
            out = fn(*[o if isinstance(o, np.ndarray) else o.value.numpy() for o in operands])
            if list(out.shape) == [int(d) for d in ty.shape.values] and str(out.dtype) == str(ty.dtype):
                const = relax.const(np.ascontiguousarray(out))
        if const is not None:
            root = next((names.root(a) for a in args if isinstance(a, type(const)) and names.root(a)), None)
            if root:
                names.add(const, f"{root}_{op.name.split('.')[-1]}", root=root)
            if same is not None:
                layouts[same] = const
            return const
        return relax.Call(op, args, binding.value.attrs, binding.value.ty_args)

    return rewrite_main(mod, map_call=call)
