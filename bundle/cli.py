"""`tvmpipe inspect`: the bundle layer's command. Imports nothing of the other layers."""

from __future__ import annotations

import argparse
import json
import sys

from tvmpipe.bundle.bundle import load_bundle
from tvmpipe.bundle.inspect import SCHEMA, build_report, render_text, stage_weights


def _stages(bundle, args: argparse.Namespace) -> list[tuple[int, int]] | None:
    """The node ranges asked for (the partition layer's cuts, imported only then), or None."""
    if args.plan:
        from tvmpipe.partition.plan import Plan

        return list(Plan.load(args.plan).stages)
    if args.stages:
        from tvmpipe.partition.plan import plan_equal_ops

        return list(plan_equal_ops(bundle.graph, args.stages).stages)
    return None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect", help="summarise a bundle or graph.json: nodes, kernels launched, fused ops",
        description="Show what a tvmpipe bundle (or a bare TVM graph.json) holds: a summary, then one row "
                    "per graph node with its inputs, outputs, storage id, the kernels it launches "
                    "(grid x block, shared memory) and the model ops fused into its function.")
    p.add_argument("path", help="bundle directory, its bundle.json, or a bare graph.json")
    p.add_argument("--params", metavar="FILE",
                   help="a bare graph.json's params file (.params as TVM <= 0.19 saved it, or .npz): "
                        "tells graph inputs from weights and shows the weight bytes of each node")
    p.add_argument("--json", action="store_true", help=f"print the report as JSON (schema {SCHEMA})")
    p.add_argument("--wide", action="store_true", help="do not shorten names to fit 100 columns")
    p.add_argument("--stages", "-k", type=int, metavar="K",
                   help="also show K stages (equal op counts, as `tvmpipe run --stages K` cuts) with the "
                        "weight bytes each loads")
    p.add_argument("--plan", metavar="PLAN.json", help="also show the stages of a plan (`tvmpipe partition -o`) "
                                                       "with the weight bytes each loads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bundle = load_bundle(args.path, params=args.params)
    report = build_report(bundle)
    stages = _stages(bundle, args)
    if stages is not None:
        report["stages"] = stage_weights(bundle, stages)
    text = json.dumps(report, indent=2) + "\n" if args.json else render_text(report, wide=args.wide)
    sys.stdout.write(text)
    return 0
