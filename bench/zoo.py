"""The model zoo through both export paths: compile, numerics vs torch, K = 2, 3 splits, nvcc.

    python bench/zoo.py [--models resnet50 gpt2 ...] [--paths pt2 onnx] [--dtypes float32 float16] [--no-nvcc]

Every zoo model (compiler/zoo.py: torchvision CNNs, transformers from small configs, random seeded
weights, no downloads) is exported to .pt2 and to ONNX, compiled, and checked by
`tvmpipe.app.zoocheck.check_model`, in float32 and in float16 (`--dtype float16`, compared with the
float32 torch model within zoocheck.FP16_TOLERANCE). Prints the coverage table and writes
bench/results/zoo.json with the machine's load average: this 2-core machine is shared, and other
work inflates compile and run times. Exits 1 if any model fails a check (a path torch itself
cannot export, and the KNOWN_FAILURES of TVM's importer, are listed, not counted).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from stamp import stamp  # when, commit, machine: bench/perfpage.py reads them

RESULTS = Path(__file__).parent / "results" / "zoo.json"
# Rows that fail in TVM itself, documented in docs/compiler.md ("Model zoo"): listed in the table, not
# counted. The exit status says when one of them starts passing (time to take it off this list).
KNOWN_FAILURES = {
    ("swin_t", "onnx"): "TVM's ONNX importer: a Pad whose pads it cannot see as constants",
    ("phi3_mask", "onnx"): "TVM's ONNX importer: int32/int64 mixed in the mask arithmetic",
}


def exit_status(rows: list[dict]) -> int:
    """0 when every row passed, is a path torch's exporter cannot produce, or is a known TVM
    failure that still fails; 1 otherwise (a new failure, or a known one that now passes)."""
    bad = [r for r in rows if not (r["ok"] or r.get("exporter_failed") or (r["model"], r["path"]) in KNOWN_FAILURES)]
    fixed = [r for r in rows if r["ok"] and (r["model"], r["path"]) in KNOWN_FAILURES]
    for r in bad:
        print(f"FAILED: {r['model']} {r['path']} {r.get('dtype', 'float32')}: {r.get('error')}", file=sys.stderr)
    for r in fixed:
        print(f"NOW PASSES (take it off KNOWN_FAILURES): {r['model']} {r['path']}", file=sys.stderr)
    return 1 if bad or fixed else 0


def _short(error: str | None, limit: int = 150) -> str:
    """An error for a table cell: without the temporary file's path, `|` escaped, cut at `limit`."""
    text = re.sub(r"^\S+\.(onnx|pt2): ", "", error or "").replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _half(r: dict) -> str:
    """An fp16 row's error cell also gives torch's own fp16 run's error (zoocheck.torch_half_error)."""
    return f" (torch fp16: {r['torch_fp16_error']:.1e})" if r.get("torch_fp16_error") is not None else ""


def table(rows: list[dict]) -> str:
    """The coverage table (markdown), one row per (model, path)."""
    head = ("| model | path | dtype | compile s | nodes / kernels | max error vs torch (of max\\|out\\|) "
            "| reference ms / torch ms | K = 2, 3 bit-identical | result |\n|---|---|---|--:|--:|--:|--:|---|---|")
    lines = [head]
    for r in rows:
        if r["compile_s"] is None:
            lines.append(f"| {r['model']} | {r['path']} | {r.get('dtype', 'float32')} | — | — | — | — | — | "
                         f"fails: {_short(r['error'])} |")
            continue
        same = ", ".join("yes" if r["split_identical"].get(k) else "NO" for k in ("K=2", "K=3"))
        lines.append(
            f"| {r['model']} | {r['path']} | {r.get('dtype', 'float32')} | {r['compile_s']:.1f} | {r['nodes']} / {r['kernels']} | "
            f"{r['ref_error']:.1e}{_half(r)} | {r['ref_ms']:.1f} / {r['torch_ms']:.1f} | {same} | "
            f"{'ok' if r['ok'] else _short(r['error'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tvmpipe.compiler.zoo import EXPORT_PATHS, ZOO

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO))
    ap.add_argument("--paths", nargs="+", default=list(EXPORT_PATHS), choices=list(EXPORT_PATHS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=["float32", "float16"],
                    help="compile dtypes to check each row in (float16: --dtype float16)")
    ap.add_argument("--no-nvcc", action="store_true", help="skip the nvcc sm_80/sm_90 check")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                    help="combine result files of runs over disjoint --models into --out, print the table")
    args = ap.parse_args(argv)
    if args.merge:
        parts = [json.loads(p.read_text()) for p in args.merge]
        order = {n: i for i, n in enumerate(ZOO)}
        rows = sorted((r for part in parts for r in part["results"]),
                      key=lambda r: (order.get(r["model"], 99), EXPORT_PATHS.index(r["path"]),
                                     r.get("dtype", "float32") != "float32"))
        merged = {**parts[0], "results": rows, "merged_from": len(parts),
                  "total_s": max(p["total_s"] for p in parts)}
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
        print(table(rows))
        return exit_status(rows)

    from tvmpipe.app.zoocheck import check_model

    load_before = os.getloadavg()[0]
    rows = []
    t0 = time.perf_counter()
    for name, path, dtype in itertools.product(args.models, args.paths, args.dtypes):
        with tempfile.TemporaryDirectory(prefix=f"zoo-{name}-") as tmp:
            r = check_model(name, path, Path(tmp), nvcc=not args.no_nvcc, dtype=dtype)
        rows.append(r.to_json())
        print(f"{name:16s} {path:5s} {dtype:8s} {'ok' if r.ok else 'FAIL'}"
              + (f" compile {r.compile_s:.1f}s err {r.ref_error:.1e}" if r.compile_s else "")
              + (f"  {r.error}" if r.error else ""), flush=True)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp({
        "load_average": [load_before, os.getloadavg()[0]], "total_s": time.perf_counter() - t0,
        "results": rows,
    }), indent=1) + "\n")
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
