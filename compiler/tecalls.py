"""`call_tir` bindings an importer generated with `emit_te`, turned back into Relax ops.

TVM's ONNX converters build some ops directly as TE functions (`Clip` is `topi.maximum` then
`topi.minimum`), so `main` holds `R.call_tir(maximum, (x, lo))` instead of `R.maximum(x, lo)`.
ops.json records Relax ops, which the reference backend implements; a generated PrimFunc has no
op name or attributes to record. Where the TE function is exactly a Relax op on the same tensor
arguments, the call is rewritten to that op; any other generated function is reported by
`opmap.record_ops` with its name and binding.
"""

from __future__ import annotations

import re
from typing import Any

from tvmpipe.compiler.rewrite import rewrite_main

# TE function name (emit_te names the PrimFunc after the topi function) -> Relax op name
TE_AS_RELAX = {"maximum": "relax.maximum", "minimum": "relax.minimum"}


def te_name(gv: Any) -> str:
    """The topi function behind an emit_te GlobalVar: `maximum3` -> `maximum`."""
    return re.sub(r"\d+$", "", gv.name_hint)


def te_calls_to_ops(mod: Any) -> Any:
    """`mod` with each `call_tir` of a TE function in TE_AS_RELAX replaced by the Relax op."""
    import tvm
    from tvm import relax

    def is_te_call(v: Any) -> bool:
        return isinstance(v, tvm.ir.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.call_tir" \
            and te_name(v.args[0]) in TE_AS_RELAX

    if not any(is_te_call(b.value) for block in mod["main"].body.blocks for b in block.bindings):
        return mod

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        if not is_te_call(binding.value):
            return relax.Call(op, args, binding.value.attrs, binding.value.ty_args)
        operands = args[1].fields if isinstance(args[1], relax.Tuple) else [args[1]]
        return relax.Call(tvm.ir.Op.get(TE_AS_RELAX[te_name(args[0])]), list(operands))

    return relax.transform.DeadCodeElimination()(rewrite_main(mod, map_call=call))
