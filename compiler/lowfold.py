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
    """Binding var (of `mod["main"]`) -> the constant FoldConstant computes for it after LegalizeOps
    (scans lowered as the fuse step lowers them, so both folds agree)."""
    from tvm import relax

    from tvmpipe.compiler.scanops import scans_to_reductions

    legal = relax.transform.LegalizeOps()(scans_to_reductions(mod))
    return match_folded(legal["main"], relax.transform.FoldConstant()(legal)["main"])


def match_folded(before: Any, after: Any) -> dict[int, Any]:
    """Var of `before` -> its constant in `after`, for the bindings FoldConstant removed.

    LegalizeOps keeps binding vars and FoldConstant drops folded bindings, substituting their
    values into the expressions that read them: walking each surviving binding's value in both
    functions in step, a var where `after` has a constant was folded to that constant.
    """
    import tvm
    from tvm import relax

    old_values = {key(b.var): b.value for b in bindings(before)}
    out: dict[int, Any] = {}

    def match(old: Any, new: Any) -> None:
        if isinstance(old, relax.Var) and isinstance(new, tvm.ir.GenericConst):
            out[key(old)] = new
        elif isinstance(old, tvm.ir.Call) and isinstance(new, tvm.ir.Call) and len(old.args) == len(new.args):
            for o, n in zip(old.args, new.args):
                match(o, n)
        elif isinstance(old, relax.Tuple) and isinstance(new, relax.Tuple) and len(old.fields) == len(new.fields):
            for o, n in zip(old.fields, new.fields):
                match(o, n)
        elif isinstance(old, relax.TupleGetItem) and isinstance(new, relax.TupleGetItem):
            match(old.tuple_value, new.tuple_value)

    for b in bindings(after):
        if key(b.var) in old_values:
            match(old_values[key(b.var)], b.value)
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
