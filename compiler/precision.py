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

F32, F16, BF16 = "float32", "float16", "bfloat16"
# ops whose TVM 0.27 legalization refuses bfloat16: the norms ("only support float32 and float16 for
# now"), power ("power only applies to float": GPT-2's tanh GELU cubes in bf16)
F32_ONLY_BF16 = frozenset({"relax.nn.layer_norm", "relax.nn.group_norm", "relax.nn.instance_norm", "relax.power"})
# Reductions over long dot products: low-precision operands, float32 accumulation (out_dtype),
# rounded once at the end, as cuBLAS/cuDNN half GEMMs and convolutions run. Accumulating in float16
# loses ~3 decimal digits over a 4608-long sum: resnet50's fp16 bundle was 6e-2 of max|out| off
# torch's with float16 accumulation.
ACCUMULATE_F32 = frozenset({"relax.matmul", "relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d",
                            "relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose"})


def _is_low(expr: Any, target: str) -> bool:
    from tvm import relax

    ty = getattr(expr, "ty", None)
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == target


def _convert_attrs(attrs: Any, target: str = F16) -> Any:
    if attrs is None:
        return None
    fields = _fields(attrs)
    changed = {k: target for k, v in fields.items() if k in ("out_dtype", "dtype") and v is not None and str(v) == F32}
    if not changed:
        return attrs
    fields.update(changed)
    return type(attrs)(**fields)


def _fields(attrs: Any) -> dict[str, Any]:
    return {f.name: getattr(attrs, f.name) for f in type(attrs).__tvm_ffi_type_info__.fields}


def _accumulating_f32(attrs: Any) -> Any:
    """The attrs with out_dtype float32 (matmul's importer attrs already say so; a convolution's
    out_dtype is often unset, meaning the input dtype)."""
    fields = _fields(attrs)
    if "out_dtype" not in fields or str(fields["out_dtype"]) == F32:
        return attrs
    fields["out_dtype"] = F32
    return type(attrs)(**fields)


def to_float16(mod: Any, names: ConstNames, weights: LazyWeights | None = None, target: str = F16) -> Any:
    """The `target` (float16 or bfloat16) module; its weight constants are named like the float32
    ones they replace. Placeholder weights (lazyweights.py) get the rounding added to their recipe.

    Only `main` is rewritten: it is all there is before legalization, but for a paged decode
    step's kernels (compiler/pagedkv.py), PrimFuncs TVM generates for one dtype: each is rebuilt
    for pages of `target` (compiler/pagedops.py `in_dtype`), for the CUDA target the conversion
    runs under (export converts inside the target the step's kernels were imported for; none:
    their llvm variants). Pages of bfloat16 are not built: refused in one line."""
    from tvmpipe.bundle.dtypes import np_dtype
    from tvmpipe.compiler import pagedops
    from tvmpipe.compiler.opmap import paged_op

    low = np_dtype(target)
    import tvm
    from tvm import relax, tirx

    paged_funcs: dict[Any, Any] = {}  # paged PrimFunc GlobalVar -> the function rebuilt in `target`

    def param(p: Any) -> Any:
        ty = p.ty
        if isinstance(ty, relax.TensorType) and str(ty.dtype) == F32:
            ty = relax.TensorType(ty.shape, target)
        return relax.Var(p.name, ty)

    def const(c: Any) -> Any:
        if str(c.ty.dtype) != F32:
            return c
        if weights is not None and weights.is_lazy(c):  # a placeholder: rounded when written
            shape = tuple(int(d) for d in c.ty.shape.values)
            new = weights.derive(lambda a: a.astype(low), [c], shape, target, f"astype {target}", "cast")
        else:
            with np.errstate(over="ignore"):  # a mask fill such as float32's min is -inf in fp16, as torch's .half() makes it
                new = _const(c.value.numpy().astype(low))
        if names.get(c):
            names.add(new, names.get(c), root=names.root(c))
        return new

    def scalar(arg: Any) -> Any:  # literal scalars such as batch norm's epsilon
        if isinstance(arg, tirx.FloatImm) and str(arg.ty) == F32:
            return tirx.FloatImm(target, float(arg.value))
        return arg

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        if paged_op(binding.value) is not None:
            return pagedops.in_dtype(binding.value, args, target, tvm.target.Target.current(allow_none=True),
                                     paged_funcs)
        if target == BF16 and op.name in F32_ONLY_BF16:
            # TVM legalizes these norms for float32/float16 only: compute in float32 between casts,
            # what a bf16 kernel does anyway (load bf16, compute float32, round on store)
            return _norm_in_float32(binding, op, args, target, names, weights)
        if op.name in ACCUMULATE_F32 and binding.value.attrs is not None and "out_dtype" in _fields(binding.value.attrs):
            # low-precision operands, float32 accumulation, rounded once at the end (ACCUMULATE_F32)
            return relax.op.astype(relax.Call(op, [scalar(a) for a in args], _accumulating_f32(binding.value.attrs),
                                              binding.value.ty_args), target)
        return relax.Call(op, [scalar(a) for a in args], _convert_attrs(binding.value.attrs, target),
                          binding.value.ty_args)

    out = rewrite_main(mod, map_param=param, map_const=const, map_call=call)
    for gv, func in paged_funcs.items():
        out[gv] = func
    return out


def _norm_in_float32(binding: Any, op: Any, args: list[Any], target: str, names: ConstNames,
                     weights: LazyWeights | None) -> Any:
    """A bf16 norm or power (F32_ONLY_BF16) computed in float32 between casts: its operands widened (a weight
    constant becomes a float32 constant of the same name: exact), the result rounded to `target`."""
    import tvm
    from tvm import relax

    def to_f32(a: Any) -> Any:
        if not _is_low(a, target):
            return a
        if isinstance(a, tvm.ir.GenericConst):
            if weights is not None and weights.is_lazy(a):
                shape = tuple(int(d) for d in a.ty.shape.values)
                new = weights.derive(lambda v: v.astype(np.float32), [a], shape, F32, "astype float32", "cast")
            else:
                new = relax.const(weights.value(a).astype(np.float32) if weights is not None
                                  else a.value.numpy().astype(np.float32))
            if names.get(a):
                names.add(new, names.get(a), root=names.root(a))
            return new
        return relax.op.astype(a, F32)

    return relax.op.astype(relax.Call(op, [to_f32(a) for a in args], binding.value.attrs, binding.value.ty_args),
                           target)


def norms_in_float32(mod: Any, names: ConstNames, weights: LazyWeights | None, target: str) -> Any:
    """A program imported in `target` precision itself (compiler/importops.py) with the ops TVM
    cannot legalize in bfloat16 (F32_ONLY_BF16) computed in float32 between casts; nothing else changes."""
    from tvm import relax

    if target != BF16:
        return mod

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        if op.name in F32_ONLY_BF16 and args and _is_low(args[0], target):
            return _norm_in_float32(binding, op, args, target, names, weights)
        return relax.Call(op, args, binding.value.attrs, binding.value.ty_args)

    return rewrite_main(mod, map_call=call)


def _const(value: np.ndarray) -> Any:
    """relax.const for any dtype bundle.dtypes knows, bfloat16 (ml_dtypes) included."""
    import tvm
    from tvm import relax

    if value.dtype == np.float16 or value.dtype.kind != "V" and str(value.dtype) != "bfloat16":
        return relax.const(value)
    t = tvm.runtime.empty(value.shape, "bfloat16")
    t.copyfrom(np.array(value, order="C"))
    return relax.const(t)
