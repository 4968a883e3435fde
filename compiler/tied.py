"""A tied embedding stored once: the input embedding and the LM head read one tensor.

A causal LM with `tie_word_embeddings` uses one [V, E] matrix twice: the embedding looks rows up
(`take(W, ids, axis=0)`) and the LM head multiplies by its transpose (`matmul(h,
permute_dims(W))`). Constant folding pre-transposes the head's operand into a new [E, V] constant,
so the bundle held the matrix twice (a 135M Llama's 113 MiB embedding: 621 MiB against the
checkpoint's 513 MiB). Here the lookup reads the transposed matrix too, gathering columns:
`permute_dims(take(permute_dims(W), ids, axis=1))`, the outer transpose moving the few gathered
columns into place ([E, B, C] -> [B, C, E]). Both transposes of W then fold into one constant
(npfold folds identical recipes of one weight once): one graph param, read by the embedding node
and the LM head node, one tensor in the weights file, in the layout the head's GEMM takes.
"""

from __future__ import annotations

from typing import Any

from tvmpipe.compiler.opmap import bindings, key
from tvmpipe.compiler.rewrite import rewrite_main


def _is_transpose_2d(call: Any) -> bool:
    axes = call.attrs.axes
    return axes is None or [int(a) for a in axes] == [1, 0]


def tied_weights(main: Any) -> set[int]:
    """Keys of 2-D constants read both by an axis-0 `take` and by a 2-D transpose."""
    import tvm
    from tvm import relax

    taken: set[int] = set()
    transposed: set[int] = set()
    for b in bindings(main):
        v = b.value
        if not (isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.args):
            continue
        w = v.args[0]
        if not isinstance(w, tvm.ir.GenericConst) or len(w.ty.shape.values) != 2:
            continue
        if v.op.name == "relax.take" and int(v.attrs.axis) == 0:
            taken.add(key(w))
        elif v.op.name == "relax.permute_dims" and _is_transpose_2d(v):
            transposed.add(key(w))
    return taken & transposed


def share_tied_embeddings(mod: Any) -> Any:
    """`mod` with every lookup of a tied weight reading its transpose (see the module docstring)."""
    import tvm
    from tvm import relax

    tied = tied_weights(mod["main"])
    if not tied:
        return mod

    def call(binding: Any, op: Any, args: list[Any]) -> Any:
        value = binding.value
        w = args[0] if args else None
        if op.name == "relax.take" and isinstance(w, tvm.ir.GenericConst) and key(w) in tied \
                and int(value.attrs.axis) == 0:
            ids = args[1]
            rank = len(ids.ty.shape.values) if isinstance(ids.ty, relax.TensorType) and ids.ty.shape is not None else 0
            columns = relax.op.take(relax.op.permute_dims(w, [1, 0]), ids, axis=1, mode=value.attrs.mode)
            return relax.op.permute_dims(columns, [*range(1, rank + 1), 0])  # [E, *ids] -> [*ids, E]
        return relax.Call(op, args, value.attrs, value.ty_args)

    return rewrite_main(mod, map_call=call)
