"""Names for weight constants, kept across constant folding.

Graph params are null nodes named after the weights they hold. Binding the weights as constants
lets FoldConstant pre-transpose them, but folded results are fresh, nameless constants. A folded
constant takes the name of the weight it was computed from plus the last op applied
(`p_fc1_weight_permute_dims`), found by comparing the same binding before and after folding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tvmpipe.compiler.opmap import bindings, key


@dataclass
class ConstNames:
    """Constant -> name, by object identity. Holds the constants so their identities stay valid."""

    _names: dict[int, tuple[Any, str, str]] = field(default_factory=dict)  # key -> (const, name, root)

    def add(self, const: Any, name: str, root: str | None = None) -> None:
        """Name `const`; `root` is the weight it was computed from (default: its own name)."""
        self._names[key(const)] = (const, name, root or name)

    def get(self, const: Any) -> str | None:
        hit = self._names.get(key(const))
        return hit[1] if hit else None

    def root(self, const: Any) -> str | None:
        """The original weight a (possibly folded) constant derives from."""
        hit = self._names.get(key(const))
        return hit[2] if hit else None

    def track_fold(self, before: Any, after: Any) -> None:
        """Name the constants FoldConstant created in `after` (a Relax main) from `before`.

        An expression in `before` that only reads constants is what FoldConstant folds; its
        derived name is (root weight name, last op). Bindings that survive folding keep their
        var, so their args can be compared position by position.
        """
        import tvm

        derived: dict[int, tuple[str, str] | None] = {}  # var -> derivation, None: not foldable

        def derive(expr: Any) -> tuple[str, str] | None:
            """(root weight, last op) of a constant-only expression; None if it reads a non-constant."""
            if _is_const(expr):
                return (self.root(expr) or "", "")
            if isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op):
                parts = [derive(a) for a in expr.args if _is_tensor(a)]
                if not parts or any(p is None for p in parts):
                    return None
                root = next((p[0] for p in parts if p[0]), "")
                return (root, expr.op.name.split(".")[-1])
            return derived.get(key(expr))

        calls_before: dict[int, Any] = {}
        for b in bindings(before):
            derived[key(b.var)] = derive(b.value)
            if isinstance(b.value, tvm.ir.Call):
                calls_before[key(b.var)] = b.value
        for b in bindings(after):
            old = calls_before.get(key(b.var))
            if old is None or not isinstance(b.value, tvm.ir.Call) or len(old.args) != len(b.value.args):
                continue
            for new_arg, old_arg in zip(b.value.args, old.args):
                if not _is_const(new_arg) or self.get(new_arg) is not None:
                    continue
                d = derive(old_arg)
                if d and d[0]:
                    self.add(new_arg, f"{d[0]}_{d[1]}" if d[1] else d[0], root=d[0])


def _is_const(expr: Any) -> bool:
    import tvm

    return isinstance(expr, tvm.ir.GenericConst)


def _is_tensor(expr: Any) -> bool:
    from tvm import relax

    return isinstance(getattr(expr, "ty", None), relax.TensorType)
