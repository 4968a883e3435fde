"""`equal` / `not_equal` of two bool tensors, compared as int8.

transformers' masks compare bool tensors (`packed_sequence_mask[..., None] == packed_sequence_mask`).
TVM's LLVM code generator emits a float compare (`fcmp`) for a bool `==`, which LLVM's verifier
rejects, so the CPU check could not build the function. Casting both operands to int8 first is the
same comparison everywhere (CUDA, LLVM, the reference backend) and records as plain `astype` ops.
"""

from __future__ import annotations

from typing import Any

from tvmpipe.compiler.rewrite import rewrite_main

_COMPARES = ("relax.equal", "relax.not_equal")


def bool_compares_as_int8(mod: Any) -> Any:
    import tvm
    from tvm import relax

    def is_bool_compare(v: Any) -> bool:
        return isinstance(v, tvm.ir.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name in _COMPARES \
            and all(str(getattr(a.ty, "dtype", "")) == "bool" for a in v.args)

    if not any(is_bool_compare(b.value) for block in mod["main"].body.blocks for b in block.bindings):
        return mod

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        if not is_bool_compare(binding.value):
            return relax.Call(op, args, binding.value.attrs, binding.value.ty_args)
        return relax.Call(op, [relax.op.astype(a, "int8") for a in args])

    return rewrite_main(mod, map_call=call)
