"""kernels.json and ops.json: the launch ABI and the fused-op programs, as checked dataclasses.

Parsing collects problems instead of raising at the first, so a bundle loader can report every
mismatch between files at once. Unknown keys are problems: a silently ignored field in a launch
record is how kernels end up launched with the wrong grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tvmpipe.bundle import dtypes
from tvmpipe.bundle.errors import Problem, ProblemCollector

SCALAR_DTYPES = ("int32", "int64", "uint32", "uint64", "float32", "float64")
# CUDA's launch limits on every architecture since sm_30; a launch past them fails only at run time.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_SHARED_MEM = 227 * 1024  # the largest opt-in dynamic shared memory of any GPU (sm_80/sm_90)


@dataclass(frozen=True)
class Operand:
    """One kernel argument by position: a function argument, a workspace, or a scalar by value."""

    kind: str  # "arg" | "workspace" | "scalar"
    index: int = 0  # for arg / workspace
    value: int | float = 0  # for scalar
    dtype: str = ""  # for scalar

    def to_json(self) -> dict[str, Any]:
        if self.kind == "scalar":
            return {"scalar": self.value, "dtype": self.dtype}
        return {self.kind: self.index}


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple[Operand, ...]

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "grid": list(self.grid), "block": list(self.block),
                "shared_mem": self.shared_mem, "args": [a.to_json() for a in self.args]}


@dataclass(frozen=True)
class Workspace:
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass
class KernelFunction:
    """How one fused function runs on the GPU: the launches its host code would make, in order."""

    name: str
    launches: list[Launch]
    workspaces: list[Workspace] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"workspaces": [w.to_json() for w in self.workspaces],
                "launches": [l.to_json() for l in self.launches]}


@dataclass(frozen=True)
class Ref:
    """Where an op input or function output comes from inside a fused function."""

    kind: str  # "arg" | "op" | "const"
    index: int = 0  # arg index or op index
    output: int = 0  # output of a tuple-producing op
    const: dict[str, Any] | None = None  # {"dtype", "shape", "data"}

    def to_json(self) -> dict[str, Any]:
        if self.kind == "const":
            return {"const": self.const}
        if self.kind == "op" and self.output:
            return {"op": self.index, "index": self.output}
        return {self.kind: self.index}


@dataclass
class OpRecord:
    """A model op fused into a function: what the user wrote, before TVM lowered it."""

    op: str
    attrs: dict[str, Any]
    inputs: list[Ref]
    input_shapes: list[list[int]]
    input_dtypes: list[str]
    output_shapes: list[list[int]]
    output_dtypes: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "attrs": self.attrs, "inputs": [r.to_json() for r in self.inputs],
                "input_shapes": self.input_shapes, "input_dtypes": self.input_dtypes,
                "output_shapes": self.output_shapes, "output_dtypes": self.output_dtypes}


@dataclass
class FusedFunction:
    name: str
    num_inputs: int
    num_outputs: int
    ops: list[OpRecord]
    outputs: list[Ref]

    @property
    def op_names(self) -> list[str]:
        return [o.op for o in self.ops]

    def to_json(self) -> dict[str, Any]:
        return {"num_inputs": self.num_inputs, "num_outputs": self.num_outputs,
                "ops": [o.to_json() for o in self.ops], "outputs": [r.to_json() for r in self.outputs]}


# ---- parsing -------------------------------------------------------------------------------------

def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _list(obj: dict, key: str, c: ProblemCollector, where: str, prefix: str = "") -> list:
    """An optional list field; anything else is reported (iterating it would crash or mislead)."""
    v = obj.get(key, [])
    if isinstance(v, list):
        return v
    c.bad(where, prefix + key, f"must be a list, got {v!r}")
    return []


def _shapes_ok(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(sh, list) and all(_int(d) and d >= 0 for d in sh) for sh in v)


def _top_functions(obj: Any, c: ProblemCollector) -> dict[str, Any]:
    if not isinstance(obj, dict):
        c.bad("", "", "top level must be a JSON object")
        return {}
    c.unknown_keys(obj, {"version", "functions"}, "")
    if obj.get("version") != 1:
        c.bad("", "version", f"unsupported version {obj.get('version')!r} (this tvmpipe reads version 1)")
    funcs = obj.get("functions")
    if not isinstance(funcs, dict):
        c.bad("", "functions", "missing or not an object")
        return {}
    return funcs


def parse_kernels(obj: Any, problems: list[Problem], file: str = "kernels.json") -> dict[str, KernelFunction]:
    c = ProblemCollector(file, problems)
    out: dict[str, KernelFunction] = {}
    for name, f in _top_functions(obj, c).items():
        where = f"function '{name}'"
        if not isinstance(f, dict):
            c.bad(where, "", "must be an object")
            continue
        c.unknown_keys(f, {"launches", "workspaces"}, where)
        workspaces = []
        raw_workspaces = _list(f, "workspaces", c, where)
        for j, w in enumerate(raw_workspaces):
            fld = f"workspaces[{j}]"
            if not isinstance(w, dict):
                c.bad(where, fld, "must be an object")
                continue
            c.unknown_keys(w, {"nbytes", "dtype", "shape"}, where, fld + ".")
            nb, dt, sh = w.get("nbytes"), w.get("dtype", "uint8"), w.get("shape", [])
            if not _int(nb) or nb < 0:
                c.bad(where, fld + ".nbytes", f"must be a non-negative integer, got {nb!r}")
                continue
            if not dtypes.is_known(dt):
                c.bad(where, fld + ".dtype", f"unknown dtype {dt!r}")
                continue
            if not (isinstance(sh, list) and all(_int(d) and d >= 0 for d in sh)):
                c.bad(where, fld + ".shape", f"must be a list of non-negative integers, got {sh!r}")
                continue
            workspaces.append(Workspace(nb, dt, tuple(sh)))
        raw_launches = f.get("launches")
        if not isinstance(raw_launches, list) or not raw_launches:
            c.bad(where, "launches", "missing or empty: every fused function launches at least one kernel")
            raw_launches = []
        # operands index the workspaces as declared, broken ones (reported above) included
        launches = [_parse_launch(l, c, where, f"launches[{i}]", len(raw_workspaces)) for i, l in enumerate(raw_launches)]
        # Cross-checks name launches by position: with one unparseable (reported), skip them all
        # rather than report the survivors under shifted indices.
        out[name] = KernelFunction(name, [] if None in launches else launches, workspaces)
    return out


def _parse_launch(l: Any, c: ProblemCollector, where: str, fld: str, n_ws: int) -> Launch | None:
    if not isinstance(l, dict):
        c.bad(where, fld, "must be an object")
        return None
    c.unknown_keys(l, {"kernel", "grid", "block", "shared_mem", "args"}, where, fld + ".")
    ok = True
    kernel = l.get("kernel")
    if not isinstance(kernel, str) or not kernel:
        c.bad(where, fld + ".kernel", "missing kernel symbol")
        ok = False
    dims = {}
    for key in ("grid", "block"):
        v = l.get(key)
        limit = MAX_GRID if key == "grid" else MAX_BLOCK
        if not (isinstance(v, list) and len(v) == 3 and all(_int(d) and d >= 1 for d in v)):
            c.bad(where, f"{fld}.{key}", f"must be [x, y, z] of positive integers, got {v!r}")
            ok = False
        elif any(d > m for d, m in zip(v, limit)):
            c.bad(where, f"{fld}.{key}", f"{v} is over CUDA's {key} limit {list(limit)}")
            ok = False
        else:
            dims[key] = tuple(v)
    if "block" in dims and dims["block"][0] * dims["block"][1] * dims["block"][2] > 1024:
        c.bad(where, f"{fld}.block", f"{dims['block']} has more than 1024 threads")
        ok = False
    smem = l.get("shared_mem", 0)
    if not _int(smem) or not 0 <= smem <= MAX_SHARED_MEM:
        c.bad(where, f"{fld}.shared_mem", f"must be an integer in [0, {MAX_SHARED_MEM}] bytes, got {smem!r}")
        ok = False
    args = []
    raw_args = l.get("args")
    if not isinstance(raw_args, list):
        c.bad(where, f"{fld}.args", "missing or not a list")
        return None
    for k, a in enumerate(raw_args):
        afld = f"{fld}.args[{k}]"
        if isinstance(a, dict) and len(a) == 1 and ("arg" in a or "workspace" in a):
            kind, idx = next(iter(a.items()))
            if not _int(idx) or idx < 0:
                c.bad(where, afld, f"{kind} index must be a non-negative integer, got {idx!r}")
                ok = False
            elif kind == "workspace" and idx >= n_ws:
                c.bad(where, afld, f"workspace {idx} is out of range (function has {n_ws} workspaces)")
                ok = False
            else:
                args.append(Operand(kind, index=idx))
        elif isinstance(a, dict) and set(a) == {"scalar", "dtype"}:
            if not _scalar_ok(a["scalar"], a["dtype"]):
                c.bad(where, afld, f"scalar needs a dtype in {SCALAR_DTYPES} and a number that fits it, got {a!r}")
                ok = False
            else:
                args.append(Operand("scalar", value=a["scalar"], dtype=a["dtype"]))
        else:
            c.bad(where, afld, f"must be {{'arg': i}}, {{'workspace': j}} or {{'scalar': v, 'dtype': t}}, got {a!r}")
            ok = False
    if not ok:
        return None
    return Launch(kernel, dims["grid"], dims["block"], smem, tuple(args))


def _scalar_ok(v: Any, dtype: Any) -> bool:
    """A scalar operand is packed by value at launch: an int dtype needs an int in its range."""
    if dtype not in SCALAR_DTYPES or isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if dtype.startswith("float"):
        return True
    info = np.iinfo(dtype)
    return _int(v) and info.min <= v <= info.max


def _parse_ref(r: Any, c: ProblemCollector, where: str, fld: str, n_args: int, n_ops: int) -> Ref | None:
    if isinstance(r, dict) and set(r) == {"arg"} and _int(r["arg"]):
        if not 0 <= r["arg"] < n_args:
            c.bad(where, fld, f"argument {r['arg']} is out of range (function has {n_args} inputs)")
            return None
        return Ref("arg", r["arg"])
    if isinstance(r, dict) and set(r) <= {"op", "index"} and "op" in r and _int(r["op"]) and _int(r.get("index", 0)):
        if not 0 <= r["op"] < n_ops:
            c.bad(where, fld, f"refers to op {r['op']}, which does not come earlier in the function")
            return None
        return Ref("op", r["op"], r.get("index", 0))
    if isinstance(r, dict) and set(r) == {"const"} and isinstance(r["const"], dict):
        k = r["const"]
        if set(k) != {"dtype", "shape", "data"} or not dtypes.is_known(k["dtype"]) or not _shapes_ok([k["shape"]]) \
                or not isinstance(k["data"], list) or not all(isinstance(x, (int, float)) for x in k["data"]) \
                or len(k["data"]) != math.prod(k["shape"]):
            c.bad(where, fld, "const must be {'dtype': known dtype, 'shape': [...], 'data': [prod(shape) numbers]}")
            return None
        return Ref("const", const=k)
    c.bad(where, fld, f"must be {{'arg': i}}, {{'op': j[, 'index': k]}} or {{'const': {{...}}}}, got {r!r}")
    return None


def _check_signature(o: dict, n_inputs: int, c: ProblemCollector, where: str, fld: str) -> None:
    """input/output shapes and dtypes: the reference backend allocates and checks by them."""
    for side in ("input", "output"):
        shapes, dts = o.get(f"{side}_shapes", []), o.get(f"{side}_dtypes", [])
        if not _shapes_ok(shapes):
            c.bad(where, f"{fld}.{side}_shapes", f"must be a list of shapes (lists of non-negative integers), got {shapes!r}")
        elif not (isinstance(dts, list) and all(dtypes.is_known(d) for d in dts)):
            c.bad(where, f"{fld}.{side}_dtypes", f"must be a list of known dtypes, got {dts!r}")
        elif len(dts) != len(shapes):
            c.bad(where, f"{fld}.{side}_dtypes", f"has {len(dts)} dtype(s) for {len(shapes)} shape(s)")
        elif side == "input" and len(shapes) != n_inputs:
            c.bad(where, f"{fld}.input_shapes", f"has {len(shapes)} shape(s) for {n_inputs} input(s)")


def parse_ops(obj: Any, problems: list[Problem], file: str = "ops.json") -> dict[str, FusedFunction]:
    c = ProblemCollector(file, problems)
    out: dict[str, FusedFunction] = {}
    for name, f in _top_functions(obj, c).items():
        where = f"function '{name}'"
        if not isinstance(f, dict):
            c.bad(where, "", "must be an object")
            continue
        c.unknown_keys(f, {"num_inputs", "num_outputs", "ops", "outputs"}, where)
        n_in, n_out = f.get("num_inputs"), f.get("num_outputs")
        if not _int(n_in) or n_in < 0 or not _int(n_out) or n_out < 1:
            c.bad(where, "num_inputs/num_outputs", f"must be integers (>= 0, >= 1), got {n_in!r}, {n_out!r}")
            continue
        ops = []
        raw_ops = f.get("ops")
        if not isinstance(raw_ops, list) or not raw_ops:
            c.bad(where, "ops", "missing or empty")
            raw_ops = []
        for i, o in enumerate(raw_ops):
            fld = f"ops[{i}]"
            if not isinstance(o, dict):
                c.bad(where, fld, "must be an object")
                continue
            c.unknown_keys(o, {"op", "attrs", "inputs", "input_shapes", "input_dtypes", "output_shapes", "output_dtypes"},
                   where, fld + ".")
            raw_refs = _list(o, "inputs", c, where, fld + ".")
            refs = [_parse_ref(r, c, where, f"{fld}.inputs[{k}]", n_in, i) for k, r in enumerate(raw_refs)]
            _check_signature(o, len(raw_refs), c, where, fld)
            if not isinstance(o.get("op"), str):
                c.bad(where, fld + ".op", "missing op name")
            attrs = o.get("attrs", {})
            if not isinstance(attrs, dict):
                c.bad(where, fld + ".attrs", "must be an object")
                attrs = {}
            ops.append(OpRecord(o.get("op", "?"), attrs, [r for r in refs if r is not None],
                                o.get("input_shapes", []), o.get("input_dtypes", []),
                                o.get("output_shapes", []), o.get("output_dtypes", [])))
        outs = f.get("outputs")
        if not isinstance(outs, list) or len(outs) != n_out:
            c.bad(where, "outputs", f"must list {n_out} output reference(s), got {outs!r}")
            outs = []
        refs = [_parse_ref(r, c, where, f"outputs[{k}]", n_in, len(ops)) for k, r in enumerate(outs)]
        out[name] = FusedFunction(name, n_in, n_out, ops, [r for r in refs if r is not None])
    return out
