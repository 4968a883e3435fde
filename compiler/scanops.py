"""`cumsum` / `cumprod` as plain reductions a flat launch list can run.

On CUDA, TVM's DispatchSortScan lowers a scan to a symbolic-shape PrimFunc behind
`vm.builtin.reshape` calls, with a host loop over scan rounds: a graph node could not replay it.
For static shapes a scan is also a reduction: `out[..., j, ...] = sum_{k <= j} x[..., k, ...]`
(`k < j` when exclusive). That is one TE compute that dlight schedules like any reduction, with
one kernel and no host logic. It does O(n^2) work along the scan axis, which for the position ids
and masks models compute (n = sequence length) is nothing next to attention; integer scans are
exact, float ones differ from a sequential scan by summation order only.

Run before DispatchSortScan, so that pass never sees the scans. Sort ops (`sort`, `argsort`,
`topk`) keep TVM's lowering and are reported by the launch reader if they cannot be replayed.
"""

from __future__ import annotations

from typing import Any

SCAN_OPS = ("relax.cumsum", "relax.cumprod")


def scan_as_reduction(x: Any, axis: int | None, dtype: str, exclusive: bool, product: bool) -> Any:
    """TE compute of a cumulative sum/product along `axis` (None: over the flattened tensor)."""
    import tvm
    from tvm import te, topi

    if axis is None:
        x = topi.reshape(x, (int(tvm.arith.Analyzer().simplify(_numel(x.shape))),))
        axis = 0
    axis = axis % len(x.shape)
    k = te.reduce_axis((0, x.shape[axis]), name="k")
    if dtype == "bool":
        # Relax types a bool tensor's scan as bool (TVM's importers pass no dtype), and LLVM has no
        # bool add: a bool sum is any-so-far (or), a bool product all-so-far (and), as in NumPy.
        reducer = te.comm_reducer((lambda a, b: tvm.tirx.And(a, b)) if product else (lambda a, b: tvm.tirx.Or(a, b)),
                                  lambda t: tvm.tirx.const(bool(product), dtype=t), name="all" if product else "any")
    elif product:
        reducer = te.comm_reducer(lambda a, b: a * b, lambda t: tvm.tirx.const(1, dtype=t), name="prod")
    else:
        reducer = te.sum

    def body(*idx: Any) -> Any:
        src = list(idx)
        src[axis] = k
        j = idx[axis]
        keep = (k < j) if exclusive else (k <= j)
        neutral = tvm.tirx.const(bool(product) if dtype == "bool" else (1 if product else 0), dtype)
        # a select, not te's `where=`: TVM 0.27 drops the reduction predicate when it lowers
        return reducer(tvm.tirx.if_then_else(keep, x(*src).astype(dtype), neutral), axis=k)

    return te.compute(x.shape, body, name="cumprod" if product else "cumsum")


def _numel(shape: Any) -> Any:
    n = 1
    for d in shape:
        n = n * d
    return n


def scans_to_reductions(mod: Any) -> Any:
    """`mod` with every cumsum/cumprod in main emitted as a `call_tir` of `scan_as_reduction`."""
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class _Rewriter(relax.PyExprMutator):
        def visit_call_(self, call: Any) -> Any:  # noqa: N802 - TVM's visitor name
            call = super().visit_call_(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name in SCAN_OPS):
                return call
            a = call.attrs
            axis = None if a.axis is None else int(a.axis)
            dtype = str(call.ty.dtype)  # the result's: a bool mask's cumsum counts in int64
            return self.builder_.call_te(scan_as_reduction, call.args[0], axis, dtype, bool(int(a.exclusive)),
                                         call.op.name == "relax.cumprod", primfunc_name_hint=call.op.name[6:])

    if not any(isinstance(b.value, tvm.ir.Call) and isinstance(b.value.op, tvm.ir.Op) and b.value.op.name in SCAN_OPS
               for block in mod["main"].body.blocks for b in block.bindings):
        return mod
    rewriter = _Rewriter(mod)
    main = rewriter.visit_expr(mod["main"])
    out = rewriter.builder_.get()
    out["main"] = main
    return out
