"""Model ops as ops.json records, and which of them TVM fused into each function.

The ops are recorded from Relax `main` before legalization, because that is the program the user
wrote (`matmul`, `nn.conv2d`, ...), with attributes complete enough for an independent NumPy
implementation. FuseOps then groups the *legalized* bindings into Primitive functions; `Fusion`
maps every group back to the recorded ops, exactly, by following bindings instead of names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tvmpipe.bundle.manifests import FusedFunction, OpRecord, Ref
from tvmpipe.compiler.errors import CompileError, UnsupportedOpError

# Constants at most this many elements are written inline into ops.json; larger ones must be
# function arguments (graph params), or the op program would duplicate weights.
MAX_INLINE_CONST = 64
# Argument names of ops whose registration lists fewer arguments than their calls pass (the Relax
# Python API's parameter names); without them the attrs would be `arg1`, `arg2`, ...
ARG_NAMES = {"relax.strided_slice": ["x", "axes", "begin", "end", "strides"]}


def key(obj: Any) -> int:
    """Identity of a TVM object: the address of the node, not of its Python wrapper."""
    return obj.__chandle__()


# ---- JSON conversion ------------------------------------------------------------------------------

def to_json(value: Any) -> Any:
    """A Relax/TIR attribute or argument value as plain JSON (ints, floats, strings, lists, null)."""
    import tvm
    from tvm import relax, tirx

    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):  # also tvm_ffi's dtype, a str subclass
        return str(value)
    if isinstance(value, tirx.IntImm):
        return bool(value.value) if str(value.ty) == "bool" else int(value.value)
    if isinstance(value, tirx.FloatImm):
        return float(value.value)
    if isinstance(value, tvm.ir.StringImm):
        return str(value.value)
    if isinstance(value, relax.ShapeExpr):
        return [to_json(v) for v in value.values]
    if isinstance(value, relax.Tuple):
        return [to_json(v) for v in value.fields]
    if isinstance(value, (list, tuple, tvm.ir.Array)):
        return [to_json(v) for v in value]
    if isinstance(value, tvm.ir.Attrs):
        return attrs_to_json(value)
    if isinstance(value, (tvm.ir.Map, dict)):
        return {str(k): to_json(v) for k, v in value.items()}
    raise CompileError(f"cannot write attribute value {value!r} ({type(value).__name__}) to ops.json")


def attrs_to_json(attrs: Any) -> dict[str, Any]:
    """Every field of a Relax op's attrs object (read through FFI reflection: attrs have no .keys())."""
    if attrs is None:
        return {}
    out = {}
    info = type(attrs).__tvm_ffi_type_info__
    while info is not None:
        for f in info.fields:
            out[f.name] = to_json(getattr(attrs, f.name))
        info = info.parent_type_info
    return out


def tensor_types(ty: Any) -> list[tuple[list[int], str]]:
    """(shape, dtype) of each tensor in a Relax type (one for a tensor, one per field for a tuple)."""
    from tvm import relax

    if isinstance(ty, relax.TensorType):
        if ty.shape is None:
            raise CompileError(f"tensor of unknown shape ({ty}): tvmpipe bundles need static shapes")
        try:
            shape = [int(d) for d in ty.shape.values]
        except TypeError:
            raise CompileError(f"symbolic shape {ty}: tvmpipe bundles need static shapes") from None
        return [(shape, str(ty.dtype))]
    if isinstance(ty, relax.TupleType):
        return [t for f in ty.fields for t in tensor_types(f)]
    raise CompileError(f"unsupported value type {ty} (expected tensors)")


def is_tensor(expr: Any) -> bool:
    from tvm import relax

    return isinstance(getattr(expr, "ty", None), relax.TensorType)


def const_json(const: Any) -> dict[str, Any]:
    arr = const.value.numpy()
    return {"dtype": str(arr.dtype), "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


# ---- recording ------------------------------------------------------------------------------------

@dataclass
class ModelOp:
    """One op of the user's program: a Relax call binding in `main`, before legalization."""

    op: str  # Relax op name without "relax."
    attrs: dict[str, Any]
    inputs: list[Any]  # tensor argument expressions (Var or constant), tuples flattened
    input_types: list[tuple[list[int], str]]
    output_types: list[tuple[list[int], str]]


@dataclass
class Program:
    """The recorded ops of main, by binding var, plus tuple-element aliases (`a = split_out[1]`)."""

    ops: dict[int, ModelOp] = field(default_factory=dict)
    aliases: dict[int, tuple[Any, int]] = field(default_factory=dict)  # var -> (tuple var, index)


def record_ops(main: Any) -> Program:
    """The model program: every op call binding of `main` (before legalization)."""
    import tvm
    from tvm import relax

    prog = Program()
    for b in bindings(main):
        value = b.value
        if isinstance(value, relax.TupleGetItem):
            prog.aliases[key(b.var)] = (value.tuple_value, int(value.index))
            continue
        if isinstance(value, relax.Var):
            prog.aliases[key(b.var)] = (value, -1)
            continue
        if not (isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op)):
            continue
        name = value.op.name
        paged = paged_op(value)
        if paged is not None:
            prog.ops[key(b.var)] = _paged_record(paged, value, b.var)
            continue
        if name in CALL_TIR:
            from tvmpipe.compiler.tecalls import TE_AS_RELAX, te_name

            raise UnsupportedOpError(
                te_name(value.args[0]), b.var.name,
                f"TVM's importer built it as a generated TIR function ('{value.args[0].name_hint}') instead of a "
                f"Relax op, so ops.json cannot describe it (tvmpipe maps only {', '.join(TE_AS_RELAX)} back to "
                "Relax ops); replace that op in the model")
        attrs = attrs_to_json(value.attrs)
        inputs = []
        arg_names = ARG_NAMES.get(name) or [a.name for a in value.op.arguments]
        for k, arg in enumerate(value.args):
            if is_tensor(arg):
                inputs.append(arg)
            elif isinstance(arg, relax.Tuple) and arg.fields and all(is_tensor(f) for f in arg.fields):
                inputs.extend(arg.fields)
            else:
                attrs[arg_names[k] if k < len(arg_names) else f"arg{k}"] = to_json(arg)
        prog.ops[key(b.var)] = ModelOp(
            op=name[len("relax."):] if name.startswith("relax.") else name,
            attrs=attrs,
            inputs=inputs,
            input_types=[t for x in inputs for t in tensor_types(x.ty)],
            output_types=tensor_types(b.var.ty),
        )
    return prog


# The paged KV kernels (compiler/pagedkv.py), called by a paged decode step as `call_tir` (the
# attention) and `call_tir_inplace` (the append, writing its pool argument): recorded as the model
# ops paged_append, paged_decode and paged_prefill, which the reference backend runs with
# executor/paged_attention.py. Their PrimFuncs are named after them (the block builder may add a
# number when two layers' shapes differ).
PAGED_OPS = ("paged_append", "paged_decode", "paged_prefill")
CALL_TIR = ("relax.call_tir", "relax.call_tir_inplace")


def paged_op(value: Any) -> str | None:
    """The paged op a `call_tir` / `call_tir_inplace` binding value calls, or None."""
    import re

    import tvm

    if not (isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in CALL_TIR):
        return None
    m = re.fullmatch(f"({'|'.join(PAGED_OPS)})\\d*", value.args[0].name_hint)
    if m is None:
        return None
    if (m.group(1) == "paged_append") != (value.op.name == "relax.call_tir_inplace"):
        return None
    return m.group(1)


def call_args(value: Any) -> list[Any]:
    """The tensor arguments of a `call_tir` / `call_tir_inplace` (its second argument, a tuple or one)."""
    from tvm import relax

    args = value.args[1]
    return list(args.fields) if isinstance(args, relax.Tuple) else [args]


def _paged_record(op: str, value: Any, var: Any) -> "ModelOp":
    """A paged kernel call as a model op: every tensor argument an input (the rope offsets too:
    the kernels are built with rotary off and do not read them, but the graph passes them), and
    the attributes an independent implementation needs: the page size, the kernels' softmax scale
    (1/sqrt(head_dim): the step scales q to its model's own), causal for a chunk."""
    inputs = call_args(value)
    types = [t for x in inputs for t in tensor_types(x.ty)]
    pages = types[0] if op == "paged_append" else types[1] if op == "paged_decode" else types[2]
    page_size, head_dim = pages[0][3], pages[0][4]
    attrs: dict[str, Any] = {"page_size": page_size, "sm_scale": 1.0 / math.sqrt(head_dim), "rope": "none"}
    if op == "paged_append":
        attrs["inplace"] = [0]
    if op == "paged_prefill":
        attrs["causal"] = True
    return ModelOp(op=op, attrs=attrs, inputs=inputs, input_types=types, output_types=tensor_types(var.ty))


# ---- fused groups ---------------------------------------------------------------------------------

@dataclass
class Group:
    """A fused function as called from main: its model ops in order and where its args come from.

    All expressions are canonical legalized ones (see `Fusion`). `split_ops` lists model ops only
    partly inside this function (TVM lowered them to several bindings, e.g. a dispatched scan):
    ops.json cannot describe such a function, so it is rejected.
    """

    main_var: Any  # binding var in main after FuseOps (FuseTIR keeps it)
    name: str  # Relax function name after FuseOps
    args: list[Any]  # expression (var or constant) behind each function parameter
    op_vars: list[Any] = field(default_factory=list)  # binding vars of the fused model ops, in order
    outputs: list[Any] = field(default_factory=list)  # expressions of the function's outputs
    split_ops: list[Any] = field(default_factory=list)


def owners(lowered_main: Any, prog: Program) -> dict[int, Any]:
    """Model op var owning each helper binding a lowering pass inserted (the next original binding).

    DispatchSortScan and LegalizeOps emit an op's helper bindings just before the binding that keeps
    the op's var, so attribution by order is exact for them.
    """
    out: dict[int, Any] = {}
    pending: list[int] = []
    for b in bindings(lowered_main):
        k = key(b.var)
        if k in prog.ops or k in prog.aliases:
            for h in pending:
                out[h] = b.var
            pending.clear()
        else:
            pending.append(k)
    return out


def _binding_key(value: Any, resolve: Any) -> tuple | None:
    """What identifies a legalized binding independent of var names: callee + resolved args."""
    import tvm
    from tvm import relax

    if isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in CALL_TIR:
        callee = value.args[0].name_hint
        args = value.args[1]
        fields = args.fields if isinstance(args, relax.Tuple) else [args]
        return (value.op.name, callee) + tuple(key(resolve(a)) for a in fields)
    if isinstance(value, relax.TupleGetItem):
        return ("tgi", key(resolve(value.tuple_value)), int(value.index))
    return None


def bindings(func: Any) -> list[Any]:
    """All bindings of a Relax function's body, in order."""
    return [b for block in func.body.blocks for b in block.bindings]


class Fusion:
    """Maps FuseOps' functions back to the legalized bindings, and so to the recorded model ops.

    FuseOps makes new vars for group outputs and main's calls, and dedupes identical groups into one
    function, so vars cannot be trusted. Instead every legalized binding is value-numbered by
    (callee, canonical args): identical computations get one canonical var, and a binding inside
    a fused function, with its parameters bound to the call's arguments, finds its legalized
    binding exactly.
    """

    def __init__(self, legalized_main: Any, prog: Program, folded: dict[int, Any] | None = None):
        self.prog = prog
        self.folded = folded or {}  # var -> the constant FoldConstant replaced it with
        self.by_key: dict[tuple, Any] = {}
        self.canon: dict[int, Any] = {}
        for b in bindings(legalized_main):
            k = _binding_key(b.value, self.canonical)
            if k is None:
                continue
            if k in self.by_key:
                self.canon[key(b.var)] = self.by_key[k]
            else:
                self.by_key[k] = b.var
        self.owner = owners(legalized_main, prog)
        self.const_of: dict[int, Any] = {}  # fused-main var -> the constant it passes (groups())

    def canonical(self, expr: Any) -> Any:
        k = key(expr)
        return self.folded[k] if k in self.folded else self.canon.get(k, expr)

    def groups(self, fused_mod: Any) -> list[Group]:
        """One Group per call in the fused main (of a Primitive function or of a lone call_tir)."""
        import tvm
        from tvm import relax

        env: dict[int, Any] = {}  # fused-module var -> canonical legalized expression

        def resolve(expr: Any) -> Any:
            return env[key(expr)] if key(expr) in env else self.canonical(expr)

        def match(binding: Any, group: Group | None) -> None:
            k = _binding_key(binding.value, resolve)
            orig = self.by_key.get(k) if k is not None else None
            if orig is None:
                return
            env[key(binding.var)] = orig
            if group is None or not isinstance(binding.value, tvm.ir.Call):
                return
            if key(orig) in self.prog.ops:
                if all(key(v) != key(orig) for v in group.op_vars):
                    group.op_vars.append(orig)
            elif key(orig) in self.owner:
                op_var = self.owner[key(orig)]
                if all(key(v) != key(op_var) for v in group.split_ops):
                    group.split_ops.append(op_var)

        groups = []
        for b in bindings(fused_mod["main"]):
            value = b.value
            if isinstance(value, tvm.ir.Call) and isinstance(value.op, relax.GlobalVar):
                func = fused_mod[value.op]
                group = Group(b.var, value.op.name_hint, [resolve(a) for a in value.args])
                for p, a in zip(func.params, group.args):
                    env[key(p)] = a
                for fb in bindings(func):
                    match(fb, group)
                body = func.body.body
                outs = body.fields if isinstance(body, relax.Tuple) else [body]
                group.outputs = [resolve(o) for o in outs]
                if not isinstance(body, relax.Tuple):
                    env[key(b.var)] = group.outputs[0]
                groups.append(group)
            elif isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in CALL_TIR:
                group = Group(b.var, value.args[0].name_hint, [resolve(a) for a in call_args(value)])
                match(b, group)
                group.outputs = [resolve(b.var)]
                groups.append(group)
            else:
                if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Tuple):
                    # `lv = (c0, c1)[i]`: how FuseOps passes constant arguments (index_tensor's indices)
                    field = value.tuple_value.fields[int(value.index)]
                    if _is_const(field):
                        self.const_of[key(b.var)] = field
                match(b, None)
        return groups

    def program(self, group: Group, func_name: str) -> FusedFunction:
        """The ops.json entry of a group: its model ops with inputs as arg / op / const references."""
        from tvm import relax

        prog = self.prog
        op_index = {key(v): j for j, v in enumerate(group.op_vars)}
        arg_index: dict[int, int] = {}
        for i, a in enumerate(group.args):
            arg_index.setdefault(key(a), i)

        # Constant arguments by value: graph.json makes each one a param (a null node) that
        # load_params can replace, so an op reading the same constant must read the argument, not
        # an inlined copy of its value that the reference backend would keep using. The call gets
        # a different object holding equal data (a lone call_tir of index_tensor gets `(c0, c1)[i]`),
        # so identity alone misses it. One value key per argument (None: not a small constant).
        arg_consts = [self.const_of.get(key(a), a) for a in group.args]
        const_keys = [_const_value_key(c) if _is_const(c) else None for c in arg_consts]
        const_args: dict[tuple, int] = {}
        for i, vk in enumerate(const_keys):
            if vk is not None:
                const_args.setdefault(vk, i)

        def ref(expr: Any, where: str) -> Ref:
            c = self.canonical(expr)
            k = key(c)
            if k in prog.aliases:  # a tuple element or a plain rename
                src, idx = prog.aliases[k]
                if idx < 0:
                    return ref(src, where)
                if key(self.canonical(src)) in op_index:
                    return Ref("op", op_index[key(self.canonical(src))], idx)
            if k in op_index:
                return Ref("op", op_index[k])
            if k in arg_index:
                return Ref("arg", arg_index[k])
            if _is_const(c):
                vk = _const_value_key(c)
                i = const_args.get(vk) if vk is not None else None
                return Ref("arg", i) if i is not None else _const_ref(c, where)
            raise CompileError(f"internal: {where} reads '{getattr(expr, 'name', expr)}', which is neither an "
                               f"argument of '{func_name}' nor an op fused into it")

        ops = []
        for j, var in enumerate(group.op_vars):
            mop = prog.ops[key(var)]
            where = f"op {j} ({mop.op}) of '{func_name}'"
            ops.append(OpRecord(
                op=mop.op, attrs=mop.attrs, inputs=[ref(x, where) for x in mop.inputs],
                input_shapes=[s for s, _ in mop.input_types], input_dtypes=[d for _, d in mop.input_types],
                output_shapes=[s for s, _ in mop.output_types], output_dtypes=[d for _, d in mop.output_types],
            ))
        outputs: list[Ref] = []
        for o in group.outputs:
            c = self.canonical(o)
            if isinstance(getattr(c, "ty", None), relax.TupleType) and key(c) in op_index:
                # a tuple-producing op (split) whose whole result is the function's output
                outputs += [Ref("op", op_index[key(c)], k) for k in range(len(c.ty.fields))]
            else:
                outputs.append(ref(o, f"output of '{func_name}'"))
        read = {r.index for r in [*outputs, *(x for op in ops for x in op.inputs)] if r.kind == "arg"}
        # an argument passed twice (`x * x` calls multiply(x, x)) is read through its first index; so
        # is a constant equal in value to one read (the ops cannot tell which of the two they read)
        read_keys = {key(group.args[i]) for i in read}
        read_consts = {const_keys[i] for i in read} - {None}
        unread = [i for i, a in enumerate(group.args) if i not in read and key(a) not in read_keys
                  and const_keys[i] not in read_consts]
        if unread:
            # the kernel reads them (graph.json wires each to a node) but the op program would not:
            # the reference backend would ignore the value a user loads into such a param
            raise CompileError(f"internal: '{func_name}' takes argument(s) {unread} that none of its ops "
                               f"({', '.join(op.op for op in ops) or 'none'}) reads")
        return FusedFunction(func_name, len(group.args), len(outputs), ops, outputs)


def _is_const(expr: Any) -> bool:
    import tvm

    return isinstance(expr, tvm.ir.GenericConst)


def _const_value_key(const: Any) -> tuple | None:
    """(dtype, shape, bytes) of a constant small enough to inline (equal keys hold equal tensors);
    None for a larger one, whose data is never copied here (a weight, maybe a lazy placeholder)."""
    shape = tuple(int(d) for d in const.value.shape)
    if math.prod(shape) > MAX_INLINE_CONST:
        return None
    arr = const.value.numpy()
    return str(arr.dtype), shape, arr.tobytes()


def _const_ref(const: Any, where: str) -> Ref:
    arr = const.value.numpy()
    if arr.size > MAX_INLINE_CONST:
        raise CompileError(f"internal: {where} reads a {arr.size}-element constant that is not a function argument")
    return Ref("const", const=const_json(const))
