"""Zero-size operands of `concat` dropped before anything is fused or scheduled.

Partial rotary embeddings (Phi-3, GPT-NeoX, Phi, StableLM) split each head into the rotated part
and the pass-through part, `q[..., :rot]` and `q[..., rot:]`, and concatenate them back. When the
whole head is rotated the pass-through part is empty (`[1, 4, 16, 0]`), and its legalized
`strided_slice` is a loop of extent 0. Fused with the rotation (strided_slice, negative, concat,
multiply, add, broadcast_to), every dlight rule, Fallback included, divides by that extent when it
fuses the loops ("Divide by zero"). An empty operand adds nothing to a concat, so it is removed in
Relax (a concat left with one operand becomes that operand) and the empty slice that fed it is dead.
"""

from __future__ import annotations

from typing import Any

from tvmpipe.compiler.rewrite import rewrite_main


def _is_empty(expr: Any) -> bool:
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return False
    try:
        return any(int(d) == 0 for d in shape.values)
    except TypeError:  # a symbolic dimension: not known to be empty
        return False


def _concat_fields(value: Any) -> list[Any] | None:
    """The operands of a `concat` call whose operand tuple is written out, else None."""
    import tvm
    from tvm import relax

    if not (isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.concat"):
        return None
    tup = value.args[0]
    return list(tup.fields) if isinstance(tup, relax.Tuple) else None


def drop_empty_concat_operands(mod: Any) -> Any:
    """`mod` with every zero-size operand of a (non-empty) concat removed."""
    from tvm import relax

    def has_empty(value: Any) -> bool:
        fields = _concat_fields(value)
        return bool(fields) and any(_is_empty(f) for f in fields) and not all(_is_empty(f) for f in fields)

    if not any(has_empty(b.value) for block in mod["main"].body.blocks for b in block.bindings):
        return mod

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        v = binding.value
        if not has_empty(v):
            return relax.Call(op, args, v.attrs, v.ty_args)
        kept = [f for f in args[0].fields if not _is_empty(f)]
        if len(kept) == 1:
            return kept[0]  # an alias; CanonicalizeBindings removes it
        return relax.Call(op, [relax.Tuple(kept)], v.attrs, v.ty_args)

    return rewrite_main(mod, map_call=call)
