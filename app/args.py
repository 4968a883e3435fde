"""Command-line options shared by `tvmpipe run`, `tvmpipe sweep` and `python -m tvmpipe.job`.

Every option value is checked where it is parsed, so a bad one is a one-line error naming the
option, exit status 2, before any Ray start or stage build: argparse `type=` checkers for single
values, and `check_output_paths` for files a command will write at the end of a long run.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from tvmpipe.app.options import BACKENDS, ClusterOptions
from tvmpipe.cluster.control.placement import STRATEGIES


class Parser(argparse.ArgumentParser):
    """argparse, with errors as one line naming the option (and where to read the usage), instead
    of a usage dump a user has to search for the line that matters."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number(convert: Callable[[str], Any], minimum: float, *, inclusive: bool = True, maximum: float | None = None,
           what: str = "a number") -> Callable[[str], Any]:
    """An argparse `type`: `convert(text)`, at least (or, not inclusive, above) `minimum`, and at
    most `maximum` where given."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value >= minimum if inclusive else value > minimum):  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {minimum}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


COUNT = number(int, 1, what="an integer")  # stages, micro-batches, window
NON_NEGATIVE_INT = number(int, 0, what="an integer")
NON_NEGATIVE = number(float, 0)
POSITIVE = number(float, 0, inclusive=False)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The cluster options: where the stages run and how the pipeline treats them."""
    g = p.add_argument_group("cluster")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true",
                       help="start an embedded single-node Ray cluster bound to 127.0.0.1 only")
    where.add_argument("--address", metavar="auto|ray://HOST:PORT", help="connect to an existing Ray cluster")
    where.add_argument("--processes", action="store_true",
                       help="run stage workers as plain local processes, without Ray")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: cuda where there is a GPU, else reference")
    g.add_argument("--window", type=COUNT, help="micro-batches in flight (default 2 x stages)")
    g.add_argument("--placement", default="PACK", choices=STRATEGIES, help="placement-group strategy (default PACK)")
    g.add_argument("--gpus-per-stage", type=NON_NEGATIVE, help="GPUs per stage actor (default: 1, or a share when "
                   "stages outnumber GPUs; 0 off cuda)")
    g.add_argument("--cpus-per-stage", type=NON_NEGATIVE, default=0.5,
                   help="CPUs reserved per stage actor (default 0.5)")
    g.add_argument("--max-restarts", type=NON_NEGATIVE_INT, default=3,
                   help="restarts per stage before the run fails (default 3)")
    g.add_argument("--transport", choices=("auto", "tcp", "shm"), default="auto",
                   help="edges within one node: auto (shared memory for frames of 64 KB and more), shm "
                   "(always shared memory), tcp (never); edges between nodes are always TCP. With the cuda backend, "
                   "auto keeps tensors between two stage processes of one node on the GPU (CUDA IPC); shm and "
                   "tcp force a host path")
    g.add_argument("--progress-timeout", type=POSITIVE, default=60.0,
                   help="seconds without a completed micro-batch before workers are checked (default 60)")
    g.add_argument("--ray-temp-dir", help="--local: Ray's session directory (default: a fresh one, removed)")


def cluster_options(ns: argparse.Namespace, **overrides: Any) -> ClusterOptions:
    """The parsed cluster options as the application layer takes them."""
    fields = {f: getattr(ns, f) for f in ClusterOptions.__dataclass_fields__ if hasattr(ns, f)}
    return ClusterOptions(**{**fields, **overrides})


def add_kv_tokens_arg(g: argparse._ActionsGroup | argparse.ArgumentParser) -> None:
    """`--kv-tokens N` (tvmpipe generate and serve): a paged decode step's KV pool, in tokens."""
    g.add_argument("--kv-tokens", type=COUNT, metavar="N", help="a paged decode step (--kv paged): its KV page pool "
                   "in tokens, the same on every stage (rounded up to whole pages; at least one row at the max "
                   "context). Default: every row at the max context, reduced to what fits in 90%% of the tightest "
                   "stage memory's free bytes after its weights (docs/paged-kv.md, Sizing)")

