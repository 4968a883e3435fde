"""Planner benchmark: optimal-planner time on a synthetic 700-op graph (K = 2..8, target < 1 s),
and the bottleneck of the optimal plan against equal op counts on every fixture and example bundle.

Run: python bench/planner.py   (writes bench/results/planner.json)
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tvmpipe.bundle import Bundle, load_bundle, parse_graph
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.planners import make_plan, plan_optimal

from stamp import stamp  # when, commit, machine: bench/perfpage.py reads them

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "graphs"
RESULTS = REPO / "bench" / "results" / "planner.json"
TARGET_S = 1.0


def synthetic_transformer(n_ops: int = 700, seq: int = 128, hidden: int = 768) -> tuple[dict, dict]:
    """A transformer-shaped graph.json with `n_ops` op nodes (10 per block, residual skips, params
    per op) and a profile-shaped dict of times from a roofline of its matmuls."""
    nodes, shapes, times = [], [], {}
    row = [0]
    f = {"num_outputs": "1", "flatten_data": "0"}

    def add(node, shape):
        nodes.append(node)
        shapes.append(shape)
        row.append(row[-1] + 1)
        return len(nodes) - 1

    def param(shape):
        return add({"op": "null", "name": f"p{len(nodes)}", "inputs": []}, shape)

    def op(name, ins, shape, flops):
        nid = add({"op": "tvm_op", "name": f"{name}{len(nodes)}", "inputs": [[i, 0, 0] for i in ins],
                   "attrs": {"func_name": f"fused_{name}", "num_inputs": str(len(ins)), **f}}, shape)
        nbytes = 4 * sum(_numel(shapes[i]) for i in ins) + 4 * _numel(shape)
        times[nid] = 4.0 + max(flops / 20e12, nbytes / 2e12) * 1e6
        return nid

    x = add({"op": "null", "name": "data", "inputs": []}, [seq, hidden])
    h = [seq, hidden]
    mm = 2 * seq * hidden * hidden
    while sum(1 for n in nodes if n["op"] == "tvm_op") + 10 <= n_ops:
        ln = op("layer_norm", [x, param([hidden]), param([hidden])], h, 8 * seq * hidden)
        qkv = op("matmul_add", [ln, param([hidden, 3 * hidden]), param([3 * hidden])], [seq, 3 * hidden], 3 * mm)
        s = op("attn_scores", [qkv], [12, seq, seq], 2 * seq * seq * hidden)
        p = op("softmax", [s], [12, seq, seq], 5 * 12 * seq * seq)
        a = op("attn_values", [p, qkv], h, 2 * seq * seq * hidden)
        o = op("matmul_add_residual", [a, param([hidden, hidden]), param([hidden]), x], h, mm)
        ln2 = op("layer_norm", [o, param([hidden]), param([hidden])], h, 8 * seq * hidden)
        up = op("matmul_add_gelu", [ln2, param([hidden, 4 * hidden]), param([4 * hidden])], [seq, 4 * hidden], 4 * mm)
        down = op("matmul_add", [up, param([4 * hidden, hidden]), param([hidden])], h, 4 * mm)
        x = op("add_residual", [down, o], h, seq * hidden)
    while sum(1 for n in nodes if n["op"] == "tvm_op") < n_ops:
        x = op("relu", [x], h, seq * hidden)
    graph = {"nodes": nodes, "arg_nodes": [i for i, n in enumerate(nodes) if n["op"] == "null"],
             "node_row_ptr": row, "heads": [[x, 0, 0]],
             "attrs": {"shape": ["list_shape", shapes], "dltype": ["list_str", ["float32"] * len(shapes)],
                       "storage_id": ["list_int", list(range(len(shapes)))]}}
    profile = {"nodes": [{"index": i, "name": nodes[i]["name"], "time_us": t} for i, t in times.items()]}
    return graph, profile


def _numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def bench_speed(repeat: int = 5) -> dict:
    graph, profile = synthetic_transformer(700)
    bundle = Bundle(path=Path("synthetic.json"), graph=parse_graph(graph))
    total_bytes = PipelineModel.build(bundle, profile=profile, inputs=["data"]).stage_memory(0, 700)
    cap = int(0.6 * total_bytes)  # binds for K = 2, loose for larger K
    rows = []
    for k in range(2, 9):
        for label, kw in (("plain", {}), ("caps+speeds", {"memory_caps": [cap],
                                                          "speeds": [1, 0.5, 1, 1, 2, 1, 1, 0.75]})):
            build, plan_t = [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                model = PipelineModel.build(bundle, profile=profile, inputs=["data"], **kw)
                t1 = time.perf_counter()
                plan = plan_optimal(model, k)
                t2 = time.perf_counter()
                build.append(t1 - t0)
                plan_t.append(t2 - t1)
            total = statistics.median(build) + statistics.median(plan_t)
            rows.append({"k": k, "variant": label, "build_s": statistics.median(build),
                         "plan_s": statistics.median(plan_t), "total_s": total, "under_target": total < TARGET_S,
                         "stages": plan.stages})
    return {"graph": {"nodes": len(graph["nodes"]), "op_nodes": 700, "memory_bytes": total_bytes},
            "memory_cap": cap, "target_s": TARGET_S, "rows": rows}


def bench_quality() -> list[dict]:
    targets = [(p.stem, p) for p in sorted(FIXTURES.glob("*.json"))]
    targets += [(f"examples/{p.parent.name}", p.parent) for p in sorted((REPO / "examples").glob("*/bundle.json"))]
    rows = []
    for name, path in targets:
        bundle = load_bundle(path)
        model = PipelineModel.build(bundle)
        n = model.num_ops
        for k in range(2, min(n, 8) + 1):
            eq, opt = make_plan(model, k, "equal"), make_plan(model, k, "optimal")
            rows.append({"graph": name, "cost_model": model.costs.source, "op_nodes": n, "k": k,
                         "equal_bottleneck_us": eq.predicted["bottleneck_us"],
                         "optimal_bottleneck_us": opt.predicted["bottleneck_us"],
                         "speedup": eq.predicted["bottleneck_us"] / opt.predicted["bottleneck_us"],
                         "equal_bytes": eq.predicted["bytes_moved"], "optimal_bytes": opt.predicted["bytes_moved"]})
    return rows


def main() -> None:
    speed = bench_speed()
    quality = bench_quality()
    print(f"optimal planner on a synthetic {speed['graph']['op_nodes']}-op graph "
          f"({speed['graph']['nodes']} nodes); target < {TARGET_S} s per plan including table build")
    print(f"{'K':>2} {'variant':>12} {'build ms':>9} {'plan ms':>8} {'total ms':>9}")
    for r in speed["rows"]:
        print(f"{r['k']:>2} {r['variant']:>12} {1e3 * r['build_s']:>9.1f} {1e3 * r['plan_s']:>8.1f} "
              f"{1e3 * r['total_s']:>9.1f}{'' if r['under_target'] else '  OVER TARGET'}")
    print()
    print("bottleneck: equal op counts vs optimal (predicted, default cost model per graph)")
    print(f"{'graph':>22} {'cost':>9} {'ops':>4} {'K':>2} {'equal us':>10} {'optimal us':>11} {'x':>6} "
          f"{'equal B':>10} {'optimal B':>10}")
    for r in quality:
        print(f"{r['graph']:>22} {r['cost_model']:>9} {r['op_nodes']:>4} {r['k']:>2} {r['equal_bottleneck_us']:>10.1f} "
              f"{r['optimal_bottleneck_us']:>11.1f} {r['speedup']:>6.2f} {r['equal_bytes']:>10} {r['optimal_bytes']:>10}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(stamp({"speed": speed, "quality": quality}), indent=1) + "\n")
    print(f"\nwrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
