"""Negative constant indices of `take` counted from the back, as torch and NumPy count them.

torch indexes a tensor with a list (`qkv[..., [-2]]`: Falcon's key and value heads) through
`aten.index.Tensor`, whose negative indices count from the end. TVM's importer turns it into
`relax.take(x, const [-2], axis, mode="fast")`, and TVM's take kernel reads memory at the raw index:
the element before the row, or outside the buffer (topi.take; compiled for LLVM, the `-1` of row 0
reads garbage and that of row 1 reads row 0's last element). Where the indices are a constant, they
are normalised here into [0, extent); indices outside [-extent, extent) are left for the reference
backend to refuse. Indices computed at run time are left as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tvmpipe.compiler.rewrite import rewrite_main


def _negative_const_take(value: Any) -> tuple[np.ndarray, int] | None:
    """(normalised indices, extent) for a fast-mode `take` of a constant with negative indices."""
    import tvm

    if not (isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.take"):
        return None
    data, idx = value.args[0], value.args[1]
    if not isinstance(idx, tvm.ir.GenericConst) or str(value.attrs.mode) != "fast":
        return None
    try:
        shape = [int(d) for d in data.ty.shape.values]
    except (TypeError, AttributeError):
        return None
    axis = value.attrs.axis
    extent = int(np.prod(shape)) if axis is None else shape[int(axis) % len(shape)]
    arr = idx.value.numpy()
    if not np.issubdtype(arr.dtype, np.integer) or not (arr < 0).any() or (arr < -extent).any():
        return None
    return np.where(arr < 0, arr + extent, arr).astype(arr.dtype), extent


def normalize_negative_take_indices(mod: Any, names: Any = None) -> Any:
    """`mod` with each fast-mode `take` of negative constant indices given their non-negative form
    (named, in the ConstNames `names`, as the constant it replaces)."""
    from tvm import relax

    if not any(_negative_const_take(b.value) for block in mod["main"].body.blocks for b in block.bindings):
        return mod

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        v = binding.value
        hit = _negative_const_take(v)
        if hit is None:
            return relax.Call(op, args, v.attrs, v.ty_args)
        new = relax.const(hit[0])
        old = v.args[1]
        if names is not None and names.get(old):
            names.add(new, names.get(old), names.root(old))
        return relax.Call(op, [args[0], new], v.attrs, v.ty_args)

    return rewrite_main(mod, map_call=call)
