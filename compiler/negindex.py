"""Negative constant indices of `take` and `index_tensor` counted from the back, as torch counts them.

torch indexes a tensor with a list (`qkv[..., [-2]]`: Falcon's key and value heads) through
`aten.index.Tensor`, whose negative indices count from the end. TVM's importer turns it into
`relax.take(x, const [-2], axis, mode="fast")` (one index list) or `relax.index_tensor` (several),
and TVM's kernels for both read memory at the raw index: the element before the row, or outside the
buffer (compiled for LLVM, the `-1` of row 0 reads garbage and that of row 1 reads row 0's last
element). Where the indices are a constant, they are normalised here into [0, extent); indices
outside [-extent, extent) are left for the reference backend to refuse. Indices computed at run
time are left as they are (the reference backend refuses negative ones, see reference_ops.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tvmpipe.compiler.rewrite import rewrite_main


def _shape(expr: Any) -> list[int] | None:
    try:
        return [int(d) for d in expr.ty.shape.values]
    except (TypeError, AttributeError):
        return None


def _normalised(idx: Any, extent: int) -> np.ndarray | None:
    """The constant `idx` with negatives counted from the end, or None if there is nothing to do."""
    import tvm

    if not isinstance(idx, tvm.ir.GenericConst):
        return None
    arr = idx.value.numpy()
    if not np.issubdtype(arr.dtype, np.integer) or not (arr < 0).any() or (arr < -extent).any():
        return None
    return np.where(arr < 0, arr + extent, arr).astype(arr.dtype)


def _rewrites(value: Any) -> dict[int, np.ndarray] | None:
    """{position of an index constant in the call's operands: its normalised value}, or None.

    Positions: `take` -> 1 (its indices); `index_tensor` -> 1 + j (field j of its index tuple)."""
    import tvm
    from tvm import relax

    if not (isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op)):
        return None
    name = value.op.name
    if name == "relax.take" and str(value.attrs.mode) == "fast":
        shape = _shape(value.args[0])
        if shape is None:
            return None
        axis = value.attrs.axis
        extent = int(np.prod(shape)) if axis is None else shape[int(axis) % len(shape)]
        new = _normalised(value.args[1], extent)
        return {1: new} if new is not None else None
    if name == "relax.index_tensor" and isinstance(value.args[1], relax.Tuple):
        shape = _shape(value.args[0])
        if shape is None:
            return None
        out = {1 + j: n for j, f in enumerate(value.args[1].fields) if j < len(shape)
               for n in [_normalised(f, shape[j])] if n is not None}
        return out or None
    return None


def normalize_negative_indices(mod: Any, names: Any = None) -> Any:
    """`mod` with negative constant indices of fast-mode `take` and `index_tensor` made non-negative
    (each new constant named, in the ConstNames `names`, as the constant it replaces)."""
    from tvm import relax

    if not any(_rewrites(b.value) for block in mod["main"].body.blocks for b in block.bindings):
        return mod

    def const(new: np.ndarray, old: Any) -> Any:
        c = relax.const(new)
        if names is not None and names.get(old):
            names.add(c, names.get(old), names.root(old))
        return c

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        v = binding.value
        hits = _rewrites(v)
        if hits is None:
            return relax.Call(op, args, v.attrs, v.ty_args)
        if op.name == "relax.take":
            return relax.Call(op, [args[0], const(hits[1], v.args[1])], v.attrs, v.ty_args)
        fields = [const(hits[1 + j], f) if 1 + j in hits else m
                  for j, (f, m) in enumerate(zip(v.args[1].fields, args[1].fields))]
        return relax.Call(op, [args[0], relax.Tuple(fields)], v.attrs, v.ty_args)

    return rewrite_main(mod, map_call=call)
