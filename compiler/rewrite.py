"""Re-emit Relax `main` binding by binding, so a rewrite only has to say what changes.

Used by the float16 conversion and the NumPy constant folder. Re-emitting through a BlockBuilder
makes Relax infer every binding's type again, so changed dtypes or shapes propagate by themselves.
"""

from __future__ import annotations

from typing import Any, Callable

from tvmpipe.compiler.errors import CompileError, one_line

# (binding, op, mapped args) -> the new value: a Call to emit, or a constant that replaces the var.
CallRewrite = Callable[[Any, Any, list[Any]], Any]


def rewrite_main(mod: Any, *, map_param: Callable[[Any], Any] = lambda p: p,
                 map_const: Callable[[Any], Any] = lambda c: c, map_call: CallRewrite | None = None) -> Any:
    """A new module whose main is `mod["main"]` with params, constants and op calls mapped."""
    import tvm
    from tvm import relax

    main = mod["main"]
    vmap: dict[int, Any] = {}

    def conv(expr: Any) -> Any:
        k = expr.__chandle__()
        if k in vmap:
            return vmap[k]
        if isinstance(expr, tvm.ir.GenericConst):
            vmap[k] = map_const(expr)
            return vmap[k]
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([conv(f) for f in expr.fields])
        return expr

    params = []
    for p in main.params:
        new = map_param(p)
        vmap[p.__chandle__()] = new
        params.append(new)

    attrs = {k: main.attrs[k] for k in ("num_input",) if main.attrs is not None and k in main.attrs}
    bb = relax.BlockBuilder()
    with bb.function("main", params, attrs=attrs):
        with bb.dataflow():
            for block in main.body.blocks:
                for b in block.bindings:
                    v = b.value
                    if isinstance(v, tvm.ir.Call) and isinstance(v.op, tvm.ir.Op):
                        args = [conv(a) for a in v.args]
                        new_value = map_call(b, v.op, args) if map_call else relax.Call(v.op, args, v.attrs, v.ty_args)
                    elif isinstance(v, relax.TupleGetItem):
                        new_value = relax.TupleGetItem(conv(v.tuple_value), v.index)
                    elif isinstance(v, (relax.Var, relax.Tuple, tvm.ir.GenericConst)):
                        new_value = conv(v)
                    else:

                        raise CompileError(f"model op '{describe(v)}' at binding '{b.var.name}' is not supported: TVM's "
                                           "importer computes a value at run time there (e.g. a shape from a tensor: "
                                           "an ONNX Expand or Reshape whose shape input is not a constant); export "
                                           "the model with static shapes")
                    if isinstance(new_value, tvm.ir.GenericConst) and isinstance(b.var, relax.DataflowVar):
                        vmap[b.var.__chandle__()] = new_value  # folded: uses read the constant
                        continue
                    emit = bb.emit if isinstance(b.var, relax.DataflowVar) else bb.emit_output
                    try:
                        vmap[b.var.__chandle__()] = emit(new_value, name_hint=b.var.name)
                    except Exception as exc:  # noqa: BLE001 - Relax re-infers types: name the binding
                        op = v.op.name if isinstance(v, tvm.ir.Call) and isinstance(v.op, tvm.ir.Op) else type(v).__name__
                        raise CompileError(f"model op '{op}' at binding '{b.var.name}' does not type-check once "
                                           f"rebuilt ({type(exc).__name__}: {one_line(exc)}); the importer mixed "
                                           "dtypes there (e.g. int32 and int64 shape values)") from None
        bb.emit_func_output(conv(main.body.body))
    # other functions (PrimFuncs an importer generated with emit_te) are kept under their GlobalVars
    others = {gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}
    out = tvm.IRModule(others)
    out["main"] = bb.get()["main"]
    return out


def describe(value: Any) -> str:
    """What a Relax binding calls, as an error message names it: an extern function's symbol or an op's name."""
    import tvm
    from tvm import relax

    if isinstance(value, tvm.ir.Call) and isinstance(value.op, relax.ExternFunc):
        return str(value.op.global_symbol)  # e.g. vm.builtin.tensor_to_shape
    if isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op):
        name = value.op.name
        if value.args and isinstance(value.args[0], relax.ExternFunc):
            name = f"{name}({value.args[0].global_symbol})"
        return name
    return type(value).__name__
