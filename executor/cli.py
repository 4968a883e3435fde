"""`tvmpipe profile` and `tvmpipe extract`: the executor's commands."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tvmpipe.core import files
from tvmpipe.executor.backend import BACKENDS
from tvmpipe.executor.errors import ExecutorError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile", help="run a bundle and time every graph node (and kernel, on cuda)",
        description="Run a bundle's whole graph on one device and report per-node times with the model ops "
                    "fused into each node, like TVM's debug executor. Inputs default to seeded random arrays.")
    p.add_argument("bundle", help="bundle directory (or a bare graph.json with --backend simulated)")
    p.add_argument("--backend", choices=list(BACKENDS), default="reference")
    p.add_argument("--inputs", metavar="IN.npz", help="graph inputs by name (default: random, seeded)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--repeat", type=int, default=10, help="timed runs to average (default 10)")
    p.add_argument("--cost-profile", metavar="PROFILE.json",
                   help="simulated backend: per-node times from an earlier `tvmpipe profile --json`")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--trace", metavar="FILE", help="also write a Chrome/Perfetto trace (JSON) to FILE")
    p.set_defaults(func=run_profile)

    e = subparsers.add_parser(
        "extract", help="write a node range of a bundle as a standalone bundle",
        description="Cut graph nodes [A, B) out of a bundle: entries it receives become graph inputs "
                    "(named '<producer>:<output>'), entries it sends become graph outputs.")
    e.add_argument("bundle", help="bundle directory")
    e.add_argument("--nodes", required=True, metavar="A:B", help="half-open node range, e.g. 0:12")
    e.add_argument("-o", "--output", required=True, metavar="OUT", help="directory to write")
    e.add_argument("--force", action="store_true", help="replace OUT if it exists")
    e.set_defaults(func=run_extract)


def _write(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def run_profile(args: argparse.Namespace) -> int:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor.inputs import load_inputs_npz, random_inputs
    from tvmpipe.executor.runner import GraphRunner

    if args.trace:
        files.check_writable(args.trace, "--trace")
    bundle = load_bundle(args.bundle)
    opts = {}
    if args.cost_profile:
        if args.backend != "simulated":
            raise ExecutorError("--cost-profile only applies to --backend simulated")
        opts["cost_profile"] = args.cost_profile
    inputs = load_inputs_npz(args.inputs) if args.inputs else random_inputs(bundle, seed=args.seed)
    with GraphRunner(bundle, backend=args.backend, **opts) as runner:
        runner.set_input(**inputs)
        prof = runner.profile(repeat=args.repeat)
    if args.trace:
        files.write_text(args.trace, json.dumps(prof.chrome_trace()))
    _write(json.dumps(prof.to_json(), indent=1) + "\n" if args.json else prof.table() + "\n")
    return 0


def parse_range(text: str) -> tuple[int, int]:
    try:
        a, b = (int(v) for v in text.split(":"))
    except ValueError:
        raise ExecutorError(f"--nodes must be A:B (two integers), got {text!r}") from None
    return a, b


def run_extract(args: argparse.Namespace) -> int:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor.extract import extract_bundle

    start, end = parse_range(args.nodes)
    out = extract_bundle(load_bundle(args.bundle), start, end, args.output, overwrite=args.force)
    _write(f"wrote {out} (nodes [{start}, {end}))\n")
    plain = load_bundle(out).manifest.source["extracted_from"].get("state_as_plain_io")  # as extract recorded it
    if plain:
        _write(f"note: state pair(s) {', '.join(plain)} of the source are plain inputs and outputs here: an extracted "
               "range declares no state (run it with `tvmpipe run`, caches fed and returned like any tensor)\n")
    return 0
