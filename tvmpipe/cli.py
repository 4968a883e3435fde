"""The `tvmpipe` command. Each layer registers its own subcommands, so this file only dispatches.

Heavy imports (ray, tvm, pycuda) stay inside the command functions: `tvmpipe inspect` must start
fast and work on a machine that has none of them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tvmpipe.app.args import Parser
from tvmpipe.core.errors import TvmpipeError

# The functions `register(subparsers)` that add each layer's commands, in the order the commands
# appear in --help ("module" means its `register`).
COMMAND_MODULES = [
    "tvmpipe.app.cli:register_inspect",  # inspect (a bundle, and optionally a plan's stages)
    "tvmpipe.compiler.cli",  # compile
    "tvmpipe.executor.cli",  # profile, extract
    "tvmpipe.partition.cli",  # partition
    "tvmpipe.app.cli",  # run, sweep
    "tvmpipe.app.generate",  # generate
    "tvmpipe.app.serving",  # serve
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tvmpipe",
        description="Run Apache TVM graph-executor models as pipelines of GPU stages on a Ray cluster.")
    parser.add_argument("--traceback", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:  # every layer is part of the product: a missing one is an install defect
        module, _, function = name.partition(":")
        getattr(importlib.import_module(module), function or "register")(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option (one line, see app.args.Parser): a status, not an exception
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `tvmpipe inspect ... | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except TvmpipeError as exc:
        if args.traceback:
            raise
        print(f"tvmpipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tvmpipe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
