"""Convert a float32 Relax program to float16: inputs, weights and compute.

TVM's torch importer hard-codes `out_dtype="float32"` for matmul/linear, so a half-precision torch
model cannot be imported as such. Instead every model is imported and constant-folded in float32
(batch-norm folding is more accurate there, and weights are rounded to float16 once) and rewritten
here: float32 parameters and constants become float16, and attributes that name float32
(`out_dtype`, `dtype`) name float16. Relax re-infers every type when the bindings are re-emitted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tvmpipe.compiler.constnames import ConstNames
from tvmpipe.compiler.lazyweights import LazyWeights
from tvmpipe.compiler.rewrite import rewrite_main

F32, F16 = "float32", "float16"


def _convert_attrs(attrs: Any) -> Any:
    if attrs is None:
        return None
    info = type(attrs).__tvm_ffi_type_info__
    fields = {f.name: getattr(attrs, f.name) for f in info.fields}
    changed = {k: F16 for k, v in fields.items() if k in ("out_dtype", "dtype") and v is not None and str(v) == F32}
    if not changed:
        return attrs
    fields.update(changed)
    return type(attrs)(**fields)


def to_float16(mod: Any, names: ConstNames, weights: LazyWeights | None = None) -> Any:
    """The float16 module; its weight constants are named like the float32 ones they replace.

    Only `main` is rewritten: it is all there is before legalization."""
    from tvm import relax, tirx

    def param(p: Any) -> Any:
        ty = p.ty
        if isinstance(ty, relax.TensorType) and str(ty.dtype) == F32:
            ty = relax.TensorType(ty.shape, F16)
        return relax.Var(p.name, ty)

    def const(c: Any) -> Any:
        if str(c.ty.dtype) != F32:
            return c
        if weights is not None and weights.is_lazy(c):  # a placeholder: rounded when written
            shape = tuple(int(d) for d in c.ty.shape.values)
            new = weights.derive(lambda a: a.astype(np.float16), [c], shape, F16, "astype float16")
        else:
            new = relax.const(c.value.numpy().astype(np.float16))
        if names.get(c):
            names.add(new, names.get(c), root=names.root(c))
        return new

    def scalar(arg: Any) -> Any:  # literal scalars such as batch norm's epsilon
        if isinstance(arg, tirx.FloatImm) and str(arg.ty) == F32:
            return tirx.FloatImm(F16, float(arg.value))
        return arg

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        return relax.Call(op, [scalar(a) for a in args], _convert_attrs(binding.value.attrs), binding.value.ty_args)

    return rewrite_main(mod, map_param=param, map_const=const, map_call=call)
