"""Packed weights in the fuse step: bound late, and unpacked inside the matmul kernel that reads them.

A packed weight's unpack ops (compiler/packed.py: shifts, masks, casts, scales) read constants
only, so every constant fold of the pipeline would compute them, and the bundle would hold the
float weight. The fields therefore stay parameters of `main` through the fold steps and the fold
after legalization, and `bind_packed` binds them as the constants they are (named, streamed from
the file at write time) just before FuseOps.

TVM's FuseOps then puts the unpack ops of one weight into one injective function and the matmul
into another: FuseOps fuses an elementwise or broadcast producer into a reduction, but not into an
`kOutEWiseFusable` op (matmul), and the unpack chain has injective ops (reshape, transpose,
concatenate) that it never fuses into a reduction either. That function would write the float
weight to memory and the matmul would read it back: 4-8 times the packed bytes of traffic, which
is what quantization is meant to save. `fuse_dequantize_matmul` is the pass MLC calls
FuseDecodeMatmulEwise, on the fused Relax functions: a function that only unpacks (every op
injective, at least one argument a packed field) whose one result is read by exactly one call,
which is a matmul's function, is merged into that call's function. FuseTIR then makes one
PrimFunc of both, the unpack as a block the schedule inlines into the matmul's reads, so the
kernel reads the packed bytes and never stores a float weight.
"""

from __future__ import annotations

from typing import Any

INJECTIVE = 2  # TVM's OpPatternKind: kElemWise 0, kBroadcast 1, kInjective 2, kCommReduce 3, kOutEWiseFusable 4


def bind_packed(mod: Any, packed: dict[str, Any]) -> tuple[Any, dict[int, Any]]:
    """`mod` with main's packed-field parameters (by name) bound to their constants, and
    {key of the parameter var: constant} for the op records made while they were parameters."""
    from tvm import relax

    from tvmpipe.compiler.opmap import key

    main = mod["main"]
    binding = {p: packed[p.name] for p in main.params if p.name in packed}
    missing = set(packed) - {p.name for p in binding}
    if missing:
        from tvmpipe.compiler.errors import CompileError

        raise CompileError(f"internal: packed weight(s) {', '.join(sorted(missing))} are not parameters of main")
    if not binding:
        return mod, {}
    return relax.transform.BindParams("main", binding)(mod), {key(p): c for p, c in binding.items()}


def _bindings(func: Any) -> list[Any]:
    return [b for block in func.body.blocks for b in block.bindings]


def _flat_args(call: Any) -> list[Any]:
    from tvm import relax

    out = []
    for a in call.args:
        out.extend(a.fields if isinstance(a, relax.Tuple) else [a])
    return out


def _callees(mod: Any, func: Any) -> list[Any]:
    """The PrimFuncs a fused Relax function calls (its call_tir bindings), in order."""
    import tvm

    out = []
    for b in _bindings(func):
        v = b.value
        if isinstance(v, tvm.ir.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.call_tir":
            out.append((v.args[0], mod[v.args[0]]))
    return out


def _only_unpacks(mod: Any, func: Any) -> bool:
    calls = _callees(mod, func)
    return bool(calls) and all(p.attrs is not None and "op_pattern" in p.attrs
                               and int(p.attrs["op_pattern"]) <= INJECTIVE for _, p in calls)


def _has_matmul(mod: Any, func: Any) -> bool:
    return any("matmul" in gv.name_hint for gv, _ in _callees(mod, func))


def _as_function(call_var: Any, call: Any) -> tuple[Any, list[Any]]:
    """A lone `call_tir(matmul, args)` of main as a Primitive function of its arguments."""
    from tvm import relax

    args = list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
    params = [relax.Var(f"p{i}", a.ty) for i, a in enumerate(args)]
    out = relax.Var("gv", call_var.ty)
    body = relax.SeqExpr([relax.DataflowBlock([relax.VarBinding(out, relax.call_tir(call.args[0], params,
                                                                                      call_var.ty))])], out)
    return relax.Function(params, body, call_var.ty, True).with_attr("Primitive", True), args


def fuse_dequantize_matmul(mod: Any, packed: set[int]) -> tuple[Any, int]:
    """`mod` (after FuseOps) with each packed weight's unpack function merged into the function of
    the one matmul that reads its result (see the module docstring); and how many were merged."""
    import tvm
    from tvm import relax

    from tvmpipe.compiler.opmap import key

    if not packed:
        return mod, 0
    main = mod["main"]
    if len(main.body.blocks) != 1:  # FuseOps leaves main one dataflow block; anything else is left as it is
        return mod, 0
    binds = _bindings(main)
    readers: dict[int, list[Any]] = {}
    for b in binds:
        if isinstance(b.value, tvm.ir.Call):
            for a in _flat_args(b.value):
                readers.setdefault(key(a), []).append(b)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    merged = 0
    for b in binds:
        v = b.value
        if not (isinstance(v, tvm.ir.Call) and isinstance(v.op, relax.GlobalVar)):
            continue
        unpack = mod[v.op]
        if not any(key(a) in packed for a in v.args) or not _only_unpacks(mod, unpack):
            continue
        users = readers.get(key(b.var), [])
        if len(users) != 1 or key(users[0].var) in replace or key(users[0].var) in drop:
            continue
        user = users[0]
        uv = user.value
        if isinstance(uv.op, relax.GlobalVar):
            consumer, cargs = mod[uv.op], list(uv.args)
            if not _has_matmul(mod, consumer):
                continue
            cname = uv.op.name_hint
        elif isinstance(uv.op, tvm.ir.Op) and uv.op.name == "relax.call_tir" and "matmul" in uv.args[0].name_hint:
            consumer, cargs = _as_function(user.var, uv)
            cname = uv.args[0].name_hint
        else:
            continue
        at = [i for i, a in enumerate(cargs) if a.same_as(b.var)]
        if len(at) != 1:
            continue
        inner = consumer.bind_params({consumer.params[at[0]]: unpack.body.body})
        body = relax.SeqExpr([relax.DataflowBlock(_bindings(unpack) + _bindings(inner))], inner.body.body)
        func = relax.Function(list(unpack.params) + list(inner.params), body, consumer.ret_ty, True, consumer.attrs)
        name = f"{v.op.name_hint}_{cname.removeprefix('fused_')}"
        bb = relax.BlockBuilder(mod)
        gv = bb.add_func(func, name)
        mod = bb.get()
        args = list(v.args) + [a for i, a in enumerate(cargs) if i != at[0]]
        replace[key(user.var)] = relax.VarBinding(user.var, relax.Call(gv, args))
        drop.add(key(b.var))
        merged += 1
    if not merged:
        return mod, 0
    new = [replace.get(key(b.var), b) for b in binds if key(b.var) not in drop]
    block = relax.DataflowBlock(new)
    main = relax.Function(main.params, relax.SeqExpr([block], main.body.body), main.ret_ty, main.is_pure,
                          main.attrs)
    mod["main"] = main
    return mod, merged
