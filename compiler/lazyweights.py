"""Weights as placeholder constants: the compiler holds each weight's bytes once, in its source.

Binding weights as Relax constants is what lets constant folding pre-transpose Linear weights and
fold batch norm into convolutions, but every TVM constant owns a copy of its data, and every fold
made another (the import's copy, the bound constant, the folded constant, the graph's params
dict, the write): `tvmpipe compile` peaked at 4.2x the weights on top of its libraries.

Here a weight is bound as a *placeholder*: a constant of the right shape and dtype whose data is
`tvm.runtime.empty` (allocated, never written, so never resident), plus a recipe saying how its
value is computed from the source tensor (the torch parameter, shared through DLPack, not copied).
The NumPy constant folder (`npfold.py`) and the float16 conversion extend recipes instead of
computing; the value of each graph param is computed once, at write time, one tensor at a time,
and written straight into the safetensors file (`Exported.write`).

Passes that compute with constants would compute with garbage: before TVM's FoldConstant runs,
`materialize_folded` gives every placeholder that a constant-only computation reads its real value
(the model then folds exactly as it did with real constants). Passes that only look at types, or
that read data without writing it (a hash), are unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.compiler.errors import CompileError
from tvmpipe.compiler.opmap import key

# Weights smaller than this stay real constants: folding them costs nothing, and it keeps constants
# that TVM itself folds (a bias broadcast) real without a detour.
LAZY_MIN_BYTES = 1 << 16


@dataclass(eq=False)
class _Node:
    """A weight's value: a source tensor, or `fn` applied to other nodes and small NumPy arrays."""

    shape: tuple[int, ...]
    dtype: str
    source: Any = None  # tvm Tensor (zero-copy on the torch tensor) for a source node
    read: Callable[[], np.ndarray] | None = None  # or a reader of the source's bytes (a checkpoint's file)
    fn: Callable[..., np.ndarray] | None = None
    args: tuple[Any, ...] = ()
    what: str = ""
    kind: str = "op"  # "cast" (astype), "layout" (transpose/reshape: moves values), "op"

    def evaluate(self) -> np.ndarray:
        if self.fn is None:
            return self.read() if self.read is not None else as_numpy(self.source)
        short = self._round_trip()
        vals = [short.evaluate()] if short is not None else [a.evaluate() if isinstance(a, _Node) else a
                                                             for a in self.args]
        if short is not None:  # the layout ops on the half-precision source itself
            out = vals[0]
            for n in self._layout_chain():
                out = n.fn(out)
            out = np.require(out, requirements="C")
        else:
            out = np.require(self.fn(*vals), requirements="C")
        if tuple(out.shape) != self.shape or str(out.dtype) != self.dtype:
            raise CompileError(f"internal: weight preprocessing '{self.what}' gives {out.dtype}{list(out.shape)}, "
                               f"but its Relax type is {self.dtype}{list(self.shape)}")
        return out

    def _layout_chain(self) -> list["_Node"]:
        chain, inner = [], self.args[0] if self.args else None
        while isinstance(inner, _Node) and inner.kind == "layout":
            chain.append(inner)
            inner = inner.args[0]
        return chain[::-1]

    def _round_trip(self) -> "_Node | None":
        """For cast(D) of layout ops of cast(float32) of a D source (a bf16 weight imported in float32,
        transposed, converted back): that source. The round trip is exact, and skipping it keeps the
        write's temporary at one half-precision tensor instead of two float32 ones."""
        if self.kind != "cast" or self.dtype == "float32":
            return None
        inner = self.args[0]
        while isinstance(inner, _Node) and inner.kind == "layout":
            inner = inner.args[0]
        if isinstance(inner, _Node) and inner.kind == "cast" and inner.dtype == "float32" \
                and isinstance(inner.args[0], _Node) and inner.args[0].dtype == self.dtype:
            return inner.args[0]
        return None


def as_numpy(tensor: Any) -> np.ndarray:
    """A NumPy view of a TVM tensor (no copy where DLPack allows; bfloat16 through torch)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if type(tensor).__module__.startswith("torch"):
        import torch

        t = tensor.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    try:
        return np.from_dlpack(tensor)
    except (BufferError, RuntimeError, TypeError, ValueError):
        pass
    if str(tensor.dtype) == "bfloat16":
        import ml_dtypes
        import torch

        return torch.from_dlpack(tensor).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


@dataclass
class LazyWeights:
    """Placeholder constant -> its recipe, by constant identity. Holds the constants (so their
    identities stay valid) and, through the recipes, the source tensors."""

    _nodes: dict[int, tuple[Any, _Node]] = field(default_factory=dict)
    min_bytes: int = LAZY_MIN_BYTES

    def _placeholder(self, node: _Node) -> Any:
        import tvm
        from tvm import relax

        const = relax.const(tvm.runtime.empty(node.shape, node.dtype))
        self._nodes[key(const)] = (const, node)
        return const

    def bind(self, tensor: Any) -> Any:
        """The constant to bind for weight `tensor` (a TVM tensor or NumPy array): a placeholder for
        a big one, a real constant (a copy) for a small one."""
        from tvm import relax

        shape, dtype = tuple(int(d) for d in tensor.shape), str(tensor.dtype)
        itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        if int(np.prod(shape, dtype=np.int64)) * itemsize < self.min_bytes:
            return relax.const(np.array(as_numpy(tensor)) if dtype != "bfloat16" else tensor.copyto(_cpu()))
        return self._placeholder(_Node(shape, dtype, source=tensor))

    def bind_float32(self, tensor: Any) -> Any:
        """Like bind, for a torch tensor in half precision whose float32 value is bound (exact)."""
        import torch
        from tvm import relax

        shape = tuple(int(d) for d in tensor.shape)
        src = _Node(shape, str(tensor.dtype).replace("torch.", ""), source=tensor)
        node = _Node(shape, "float32", fn=lambda a: a.astype(np.float32), args=(src,), what="astype float32",
                     kind="cast")
        if tensor.numel() * 4 < self.min_bytes:
            return relax.const(tensor.detach().to(torch.float32).numpy())
        return self._placeholder(node)

    def bind_file(self, tensor: Any, dtype: str) -> Any:
        """The constant to bind for a tensor of a file that is read when asked (`tensor.numpy()`,
        with `shape` and `dtype`: a checkpoint's, compiler/checkpoint.py), as `dtype`: a
        placeholder whose recipe reads it (and casts it, where the dtypes differ) for a big one, a
        real constant read now for a small one."""
        shape = tuple(int(d) for d in tensor.shape)
        node = _Node(shape, tensor.dtype, read=tensor.numpy, what="read")
        if tensor.dtype != dtype:
            node = _Node(shape, dtype, fn=lambda a: a.astype(np_dtype(dtype)), args=(node,), what=f"astype {dtype}",
                         kind="cast")
        if int(np.prod(shape, dtype=np.int64)) * np_dtype(dtype).itemsize < self.min_bytes:
            return constant(node.evaluate())
        return self._placeholder(node)

    def is_lazy(self, const: Any) -> bool:
        return key(const) in self._nodes

    def derive(self, fn: Callable[..., np.ndarray], args: list[Any], shape: tuple[int, ...], dtype: str,
               what: str, kind: str = "op") -> Any:
        """A placeholder for `fn(*values of args)`: args are constants (lazy or real) or NumPy arrays."""
        parts = []
        for a in args:
            if isinstance(a, np.ndarray):
                parts.append(a)
            else:
                hit = self._nodes.get(key(a))
                parts.append(hit[1] if hit else a.value.numpy())
        return self._placeholder(_Node(tuple(shape), dtype, fn=fn, args=tuple(parts), what=what, kind=kind))

    def value(self, const: Any) -> np.ndarray:
        """The constant's value: computed from its recipe for a placeholder (a new array, or a view
        of the source tensor), its data for a real constant."""
        hit = self._nodes.get(key(const))
        if hit:
            return hit[1].evaluate()
        value, shape = const.value.numpy(), tuple(int(d) for d in const.value.shape)
        return value.reshape(shape) if value.shape != shape else value  # TVM gives a 0-d fp16 tensor as [1]

    def real(self, const: Any) -> Any:
        """A real constant with the placeholder's value (a copy)."""
        return constant(self.value(const))


def constant(value: np.ndarray) -> Any:
    """A real Relax constant holding a copy of `value` (bfloat16 through a TVM tensor: relax.const
    cannot take an ml_dtypes array)."""
    from tvm import relax

    if str(value.dtype) == "bfloat16":
        import tvm

        t = tvm.runtime.empty(value.shape, "bfloat16")
        t.copyfrom(np.array(value, order="C"))
        return relax.const(t)
    return relax.const(np.array(value))


def _cpu() -> Any:
    import tvm

    return tvm.cpu(0)


def materialize_folded(mod: Any, names: Any, weights: LazyWeights) -> Any:
    """`mod` with every placeholder that a constant-only computation of `main` reads replaced by a
    real constant of the same name, so TVM's constant folding (and the fold after legalization)
    computes with real values. A binding computes a constant if every tensor it reads is a
    constant or such a binding (a superset of what FoldConstant folds: safe, only less lazy)."""
    import tvm
    from tvm import relax

    from tvmpipe.compiler.opmap import bindings
    from tvmpipe.compiler.rewrite import rewrite_main

    if not weights._nodes:
        return mod
    constant: set[int] = set()
    hit: set[int] = set()

    def leaves(expr: Any) -> Iterator[Any]:
        if isinstance(expr, relax.Tuple):
            for f in expr.fields:
                yield from leaves(f)
        elif isinstance(expr, (relax.Var, tvm.ir.GenericConst)):
            yield expr

    for b in bindings(mod["main"]):
        v = b.value
        if isinstance(v, tvm.ir.Call):
            args = [x for a in v.args for x in leaves(a)]
        elif isinstance(v, relax.TupleGetItem):
            args = list(leaves(v.tuple_value))
        else:
            args = list(leaves(v))
        if all(isinstance(a, tvm.ir.GenericConst) or key(a) in constant for a in args):
            constant.add(key(b.var))
            hit.update(key(a) for a in args if isinstance(a, tvm.ir.GenericConst) and weights.is_lazy(a))
    if not hit:
        return mod

    def const(c: Any) -> Any:
        if key(c) not in hit:
            return c
        new = weights.real(c)
        if names.get(c):
            names.add(new, names.get(c), root=names.root(c))
        return new

    return rewrite_main(mod, map_const=const)


class GraphParams(Mapping[str, np.ndarray]):
    """The bundle's params: graph param name -> constant, valued on lookup (one tensor at a time).

    `specs()` gives names, dtypes and shapes without computing anything (the safetensors header);
    `write(path)` streams every tensor into a safetensors file and returns the checksums."""

    def __init__(self, consts: Mapping[str, Any], weights: LazyWeights):
        self.consts = dict(consts)
        self.weights = weights

    def __getitem__(self, name: str) -> np.ndarray:
        return self.weights.value(self.consts[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.consts)

    def __len__(self) -> int:
        return len(self.consts)

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor as written: a placeholder's from its recipe, a real
        constant's from its data (a scalar constant can hold a [1] array under a [] type)."""
        out = []
        for n, c in self.consts.items():
            hit = self.weights._nodes.get(key(c))
            if hit:
                out.append((n, hit[1].dtype, hit[1].shape))
            else:
                out.append((n, str(c.value.dtype), tuple(int(d) for d in c.value.shape)))
        return out

    def nbytes(self) -> int:
        from tvmpipe.bundle import dtypes

        return sum(int(np.prod(s, dtype=np.int64)) * dtypes.itemsize(d) for _, d, s in self.specs())

    def write(self, path: Any) -> dict[str, str]:
        """Write every tensor to a safetensors file at `path`, each computed, written and dropped in
        turn: at most one computed tensor is alive at a time."""
        from tvmpipe.bundle.weights import WeightsWriter

        w = WeightsWriter(path, self.specs())
        try:
            for name in self.consts:
                w.write(name, self[name])
        except BaseException:
            w.abort()
            raise
        return w.close()
