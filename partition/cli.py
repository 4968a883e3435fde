"""`tvmpipe partition`: plan a bundle (or bare graph.json) into pipeline stages and print the plan."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from tvmpipe.core import files
from tvmpipe.partition.devices import format_bytes
from tvmpipe.partition.errors import PartitionError

if TYPE_CHECKING:
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.predict import Prediction


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "partition", help="split a model into pipeline stages",
        description="Split a bundle or a bare graph.json into K pipeline stages and predict the pipeline. "
                    "Cuts are op ordinals: cut c starts a stage at the c-th op node (0-based, every tvm_op "
                    "node counts, __nop included); the table's 'ops' column shows each stage's ordinals.")
    p.add_argument("path", help="bundle directory or graph.json")
    p.add_argument("--stages", "-k", type=int, help="number of stages K")
    p.add_argument("--strategy", choices=["manual", "equal", "optimal"],
                   help="default: manual with --cuts, else optimal")
    p.add_argument("--cuts", help="manual cuts as op ordinals, e.g. 12,30 (3 stages: ops 0-11, 12-29, 30-)")
    p.add_argument("--memory-per-device", help="memory cap per device, e.g. 8GiB, or one per stage: 8GiB,8GiB,4GiB "
                                               "(default: the --device's memory)")
    p.add_argument("--slots", type=int, default=None, metavar="S",
                   help="a decode step: sequence slots each stage keeps caches for, counted in the memory column and "
                        "the cap (default 1; `tvmpipe generate --slots`)")
    p.add_argument("--speeds", help="per-stage speed factors, e.g. 1,1,0.5 (stage time = compute / speed)")
    p.add_argument("--device", default="h100", help="device for the analytic model and default memory cap: "
                                                    "h100, h200, a100, l4, t4, cpu (default h100)")
    p.add_argument("--link-bandwidth", default="25GB/s", help="bandwidth between stages, e.g. 25GB/s, 100Gbit/s")
    p.add_argument("--link-latency", default="0us", help="fixed cost per received frame, e.g. 20us")
    p.add_argument("--cluster", metavar="CLUSTER.json",
                   help="what-if cluster: devices per node, speeds, memory, links (docs/partition.md); replaces "
                        "--speeds, --memory-per-device and the --link options")
    p.add_argument("--profile", help="GraphRunner.profile() JSON measured on the device (measured cost model)")
    p.add_argument("--cost", default="auto", choices=["auto", "measured", "analytic", "uniform"],
                   help="op cost model (auto: --profile, else analytic with ops.json, else uniform)")
    p.add_argument("--inputs", help="graph input names for a bare graph.json (default: a guess, see docs/partition.md)")
    p.add_argument("--params", metavar="FILE",
                   help="a bare graph.json's params file (.params as TVM <= 0.19 saved it, or .npz): its arrays "
                        "are the weights each stage loads, the other null nodes the graph inputs")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="optimal: accept plans this fraction above the best bottleneck that move fewer bytes")
    p.add_argument("--show-cuts", action="store_true", help="also list every candidate cut and the bytes crossing it")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print plan and prediction as JSON instead of a table")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PartitionError(f"cannot read {what} {text!r}: expected comma-separated integers, e.g. 12,30") from None


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PartitionError(f"cannot read {what} {text!r}: expected comma-separated numbers, e.g. 1,1,0.5") from None


def run(args: argparse.Namespace) -> int:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.partition.cuts import cut_crossings
    from tvmpipe.partition.devices import Link, get_device, parse_bandwidth, parse_bytes, parse_duration_us
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.planners import make_plan
    from tvmpipe.partition.predict import predict

    if args.params and args.inputs:
        raise PartitionError("--inputs and --params both say which null nodes are graph inputs: give one")
    if args.output:
        files.check_writable(args.output, "-o/--output")  # before the planning it would lose
    bundle = load_bundle(args.path, params=args.params)
    if args.slots is not None and (args.slots < 1 or not bundle.state):
        raise PartitionError(f"--slots {args.slots}: " + ("must be >= 1" if args.slots < 1 else
                             f"{args.path} declares no state (slots hold a decode step's caches)"))
    device = get_device(args.device)
    cuts = _ints(args.cuts, "--cuts") if args.cuts is not None else None
    strategy = args.strategy or ("manual" if cuts is not None else "optimal")
    caps = [parse_bytes(v) for v in args.memory_per_device.split(",")] if args.memory_per_device else [device.memory]
    speeds = _floats(args.speeds, "--speeds") if args.speeds else None
    links = None
    if args.cluster:
        from tvmpipe.partition.hardware import load_cluster

        if args.speeds or args.memory_per_device:
            raise PartitionError("--cluster gives every device's speed and memory: drop --speeds / --memory-per-device")
        cluster = load_cluster(args.cluster)
        speeds, caps, links = cluster.stages(args.stages or (len(cuts) + 1 if cuts is not None else 1))
    model = PipelineModel.build(
        bundle, cost=args.cost, profile=args.profile, device=device,
        link=Link(parse_bandwidth(args.link_bandwidth), parse_duration_us(args.link_latency)),
        speeds=speeds, memory_caps=caps, links=links, state_slots=args.slots or 1,
        inputs=[s for s in args.inputs.split(",") if s] if args.inputs else None)
    plan = make_plan(model, args.stages, strategy, cuts=cuts, tolerance=args.tolerance)
    prediction = predict(model, plan)
    if args.output:
        plan.save(args.output)
    if args.json:
        out = {"plan": plan.to_json(), "prediction": prediction.to_json()}
        if args.show_cuts:
            out["cuts"] = [{"cut": c.cut, "node": c.node, "entries": list(c.entries), "bytes": c.nbytes}
                           for c in cut_crossings(model.flow)]
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(format_table(model, prediction, args))
    if args.show_cuts:
        print("\ncandidate cuts (op ordinal: node index, live entries crossing, bytes):")
        for c in cut_crossings(model.flow):
            print(f"  {c.cut:5d}: node {c.node:5d}  {len(c.entries):3d} entries  {format_bytes(c.nbytes):>10}")
    if not prediction.fits_memory:
        print("warning: stage(s) over their memory cap are marked '!'", file=sys.stderr)
    if args.output:
        print(f"plan written to {args.output}")
    return 0


def format_table(model: PipelineModel, prediction: Prediction, args: argparse.Namespace) -> str:
    from tvmpipe.partition.cost import UNIFORM_OP_US

    costs = model.costs.source + (f" ({UNIFORM_OP_US:g} us per op node)" if model.costs.source == "uniform" else "")
    lines = [f"{model.bundle.name}: {len(prediction.stages)} stage(s), strategy {prediction.strategy}, "
             f"cost model {costs}, " + (f"cluster {args.cluster}" if getattr(args, "cluster", None) else
                                        f"device {model.device.name}, link {args.link_bandwidth}"
                                        + (f" + {args.link_latency}/frame" if model.link.latency_us else ""))]
    b = model.bundle
    if b.is_bare and b.knows_params:
        lines.append(f"weights: {len(b.param_names)} params, {format_bytes(b.weight_bytes)} "
                     f"from {b.params_path}; graph inputs: {', '.join(b.input_names) or 'none'}")
    lines.append("")
    head = f"{'stage':>5} {'nodes':>13} {'ops':>11} {'#ops':>5} {'params':>10} {'memory':>11} " \
           f"{'time us':>10} {'compute':>10} {'xfer':>8} {'in':>10} {'out':>10}"
    lines.append(head)
    for s in prediction.stages:
        mark = "" if s.fits else " !"
        lines.append(f"{s.stage:>5} {f'[{s.start},{s.end})':>13} {f'[{s.ops[0]},{s.ops[1]})':>11} {s.num_ops:>5} "
                     f"{format_bytes(s.params_bytes):>10} {format_bytes(s.memory_bytes):>10}{mark or ' '} {s.time_us:>10.1f} "
                     f"{s.compute_us:>10.1f} {s.transfer_us:>8.1f} {format_bytes(s.in_bytes):>10} {format_bytes(s.out_bytes):>10}")
    p = prediction
    lines += ["", f"bottleneck {p.bottleneck_us:.1f} us, throughput {p.throughput:.1f} samples/s, "
                  f"latency {p.latency_us:.1f} us, bubble {100 * p.bubble:.1f} %, bytes moved {format_bytes(p.bytes_moved)}"]
    shared: dict[str, list[int]] = {}
    for s in p.stages:
        for name in s.shared_params:
            shared.setdefault(name, []).append(s.stage)
    if shared:
        lines.append("params loaded by several stages: " +
                     ", ".join(f"{n} (stages {','.join(map(str, st))})" for n, st in shared.items()))
    return "\n".join(lines)
