"""Per-op-node cost models: how long each op node runs, in microseconds.

Three sources, one shape (a time per op ordinal), so planners never care where times came from:
- measured: `GraphRunner.profile()` JSON from the real device; the one to trust;
- analytic: FLOPs and bytes moved from ops.json and graph.json shapes on a roofline of a device
  from devices.py, plus a launch overhead per kernel; good for ranking plans before any run;
- uniform: the same time for every op node, for a bare graph.json (no ops.json to count FLOPs in),
  so any real graph.json can still be planned (the plan then balances op counts and transfers).
`__nop` nodes launch nothing and cost 0 in every model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.manifests import OpRecord
from tvmpipe.partition.cuts import GraphFlow
from tvmpipe.partition.devices import DeviceSpec
from tvmpipe.partition.errors import PartitionError

UNIFORM_OP_US = 10.0


@dataclass
class OpCosts:
    """Time per op ordinal (microseconds); flops and bytes where the model knows them."""

    source: str  # "measured" | "analytic" | "uniform"
    time_us: np.ndarray
    flops: np.ndarray | None = None
    bytes_moved: np.ndarray | None = None


# ---- analytic ------------------------------------------------------------------------------------

_DATA_MOVEMENT = {"reshape", "permute_dims", "expand_dims", "squeeze", "flatten", "concat", "split",
                  "strided_slice", "take", "broadcast_to", "astype", "layout_transform", "repeat", "tile",
                  "collapse_sum_like", "collapse_sum_to", "zeros", "ones", "full", "zeros_like", "ones_like",
                  "full_like", "wrap_param", "dynamic_strided_slice", "gather_elements", "gather_nd", "scatter_elements"}
_REDUCTIONS = {"sum", "mean", "max", "min", "prod", "variance", "std", "argmax", "argmin",
               "nn.adaptive_avg_pool1d", "nn.adaptive_avg_pool2d", "nn.adaptive_avg_pool3d"}
_FLOPS_PER_ELEMENT = {"nn.softmax": 5, "nn.log_softmax": 6, "nn.layer_norm": 8, "nn.group_norm": 8,
                      "nn.batch_norm": 4, "nn.rms_norm": 6, "nn.gelu": 8, "nn.gelu_tanh": 10, "nn.silu": 4,
                      "sigmoid": 4, "tanh": 6, "exp": 4, "erf": 6, "log": 4, "sqrt": 2, "rsqrt": 2, "power": 4}


def _prod(shape: Any) -> int:
    return math.prod(int(d) for d in shape) if isinstance(shape, (list, tuple)) else 1


def op_flops(op: OpRecord) -> int:
    """Floating-point operations of one model op (multiply-add = 2), from its recorded shapes."""
    name = op.op
    out = _prod(op.output_shapes[0]) if op.output_shapes else 0
    ins = op.input_shapes
    if name in ("matmul", "nn.dense", "nn.linear", "linear") and ins:
        a = ins[0]
        k = a[-1] if a else 1
        return 2 * out * int(k)
    if name.startswith("nn.conv") and len(ins) >= 2:
        w = ins[1]
        if "transpose" in name:
            return 2 * _prod(ins[0]) * _prod(w[1:])
        return 2 * out * _prod(w[1:])
    if "pool" in name and not name.startswith("nn.adaptive"):
        size = op.attrs.get("pool_size") or []
        return out * (_prod(size) if size else 1)
    if name in _REDUCTIONS:
        return _prod(ins[0]) if ins else out
    if name in _DATA_MOVEMENT:
        return 0
    return out * _FLOPS_PER_ELEMENT.get(name, 1)


def analytic_costs(bundle: Bundle, flow: GraphFlow, device: DeviceSpec) -> OpCosts:
    """Roofline per op node: launches x launch overhead + max(compute time, memory time)."""
    if bundle.is_bare or not bundle.ops:
        raise PartitionError(f"{bundle.path}: the analytic cost model needs ops.json; a bare graph.json "
                             "can be planned with the uniform model or a measured --profile")
    g = bundle.graph
    n = flow.num_ops
    times, flops, moved = np.zeros(n), np.zeros(n), np.zeros(n)
    for k, nid in enumerate(flow.ops):
        node = g.nodes[nid]
        if node.is_nop:
            continue
        nbytes = sum(g.entries[e].nbytes for e in g.input_entry_ids(nid)) + \
            sum(g.entries[e].nbytes for e in g.node_entry_ids(nid))
        moved[k] = nbytes
        mem_s = nbytes / (device.mem_bandwidth * device.bandwidth_efficiency)
        if node.is_copy:
            times[k] = mem_s * 1e6
            continue
        fn = bundle.ops_of(nid)
        compute_s = 0.0
        for op in fn.ops if fn else []:
            f = op_flops(op)
            flops[k] += f
            dtype = op.output_dtypes[0] if op.output_dtypes else "float32"
            compute_s += f / (device.peak_flops(dtype) * device.compute_efficiency)
        launches = max(1, len(bundle.launches_of(nid)))
        times[k] = launches * device.launch_us + max(compute_s, mem_s) * 1e6
    return OpCosts("analytic", times, flops, moved)


# ---- uniform -------------------------------------------------------------------------------------

def uniform_costs(flow: GraphFlow, op_us: float = UNIFORM_OP_US) -> OpCosts:
    g = flow.graph
    return OpCosts("uniform", np.array([0.0 if g.nodes[nid].is_nop else op_us for nid in flow.ops]))


# ---- measured ------------------------------------------------------------------------------------

def read_profile(path: str | Path) -> dict[str, Any]:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PartitionError(f"{path}: cannot read the profile: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("nodes"), list):
        raise PartitionError(f'{path}: a profile is a JSON object with "nodes": [{{"index", "name", "time_us"}}, ...]')
    return obj


def measured_costs(profile: dict[str, Any], flow: GraphFlow, source: str = "profile") -> OpCosts:
    """Times from `GraphRunner.profile()` JSON: {"nodes": [{"index", "name", "time_us", ...}, ...]}.

    Rows are matched by `index` (the executor writes it as `node`; either is read), or by `name` when
    neither is there, and a name that disagrees with
    the graph is an error: a profile of another graph would silently produce a wrong plan.
    Every op node that launches kernels must have a time; extra keys and rows for null nodes are ignored.
    """
    g = flow.graph
    times: dict[int, float] = {}
    problems: list[str] = []
    for r, row in enumerate(profile.get("nodes", [])):
        if not isinstance(row, dict):
            problems.append(f"nodes[{r}] is not an object")
            continue
        nid = row.get("index", row.get("node"))
        name = row.get("name")
        if nid is None and isinstance(name, str):
            nid = g.node_index.get(name)
        if not isinstance(nid, int) or not 0 <= nid < len(g.nodes):
            problems.append(f"nodes[{r}]: no node with index/name {row.get('index', row.get('node', name))!r} in the graph")
            continue
        if isinstance(name, str) and name != g.nodes[nid].name:
            problems.append(f"nodes[{r}]: node {nid} is '{g.nodes[nid].name}' in the graph, '{name}' in the profile")
            continue
        t = row.get("time_us")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            problems.append(f"nodes[{r}]: time_us must be a non-negative number, got {t!r}")
            continue
        times[nid] = float(t)
    missing = [nid for nid in flow.ops if nid not in times and g.nodes[nid].launches_kernels]
    if missing:
        shown = ", ".join(str(m) for m in missing[:10]) + (" ..." if len(missing) > 10 else "")
        problems.append(f"{len(missing)} op node(s) without a time: {shown}")
    if problems:
        raise PartitionError(f"{source}: the profile does not match the graph:\n  - " + "\n  - ".join(problems[:20]))
    return OpCosts("measured", np.array([times.get(nid, 0.0) for nid in flow.ops]))


def workspace_bytes(bundle: Bundle) -> dict[str, int]:
    """Workspace bytes per fused function (a stage allocates each function's workspaces once)."""
    return {name: sum(w.nbytes for w in kf.workspaces) for name, kf in bundle.kernels.items()}
