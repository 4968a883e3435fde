"""Fold what only folds after legalization, before the model ops are recorded.

TVM's FoldConstant on high-level Relax leaves some constant-only computations alone: `arange`,
`expand_dims` of an arange, `where` on a constant mask, `take` from a weight with constant
indices, `cumsum` of a constant. transformers builds position ids and causal masks exactly so.
After `LegalizeOps` they are `call_tir`s on constants and FoldConstant folds them. If ops.json were
recorded before that, a recorded op would read a value that no fused function computes (it became a
param). So this pass legalizes a copy, folds it, and puts each folded value back into the
unlegalized `main` as a constant; the op program is then recorded from a module with nothing left
to fold.
"""

from __future__ import annotations

from typing import Any

from tvmpipe.compiler.constnames import ConstNames
from tvmpipe.compiler.opmap import bindings, key
from tvmpipe.compiler.rewrite import rewrite_main


def folded_values(mod: Any) -> dict[int, Any]:
    """Binding var (of `mod["main"]`) -> the constant FoldConstant computes for it after LegalizeOps.

    LegalizeOps keeps binding vars and FoldConstant drops folded bindings, substituting their
    values into the calls that read them: a call that survives both reads, at the same argument
    position, either the same var or that var's folded constant.
    """
    import tvm
    from tvm import relax

    legal = relax.transform.LegalizeOps()(mod)
    folded = relax.transform.FoldConstant()(legal)
    before = {key(b.var): b.value for b in bindings(legal["main"])}
    out: dict[int, Any] = {}

    def args_of(call: Any) -> list[Any]:
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir":
            a = call.args[1]
            return list(a.fields) if isinstance(a, relax.Tuple) else [a]
        return list(call.args)

    for b in bindings(folded["main"]):
        old = before.get(key(b.var))
        if not (isinstance(old, tvm.ir.Call) and isinstance(b.value, tvm.ir.Call)):
            continue
        old_args, new_args = args_of(old), args_of(b.value)
        if len(old_args) != len(new_args):
            continue
        for o, n in zip(old_args, new_args):
            if isinstance(o, relax.Var) and isinstance(n, tvm.ir.GenericConst):
                out[key(o)] = n
    return out


def fold_after_legalize(mod: Any, names: ConstNames) -> Any:
    """`mod` with every binding that folds after legalization replaced by its constant (named
    after the weight it derives from, if any, plus its op: `p_wpe_weight_take`)."""
    from tvm import relax

    consts = folded_values(mod)
    if not consts:
        return mod
    root: dict[int, str] = {}
    for b in bindings(mod["main"]):
        args = getattr(b.value, "args", [])
        root[key(b.var)] = next((r for a in args for r in (names.root(a), root.get(key(a))) if r), "")

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        const = consts.get(key(binding.var))
        if const is None:
            return relax.Call(op, args, binding.value.attrs, binding.value.ty_args)
        r = root.get(key(binding.var))
        if r and names.get(const) is None:
            names.add(const, f"{r}_{op.name.split('.')[-1]}", root=r)
        return const

    return relax.transform.DeadCodeElimination()(rewrite_main(mod, map_call=call))
