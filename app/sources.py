"""Where a run's bundle, plan and micro-batches come from, each checked before any cluster
resource is taken: a bad plan or inputs file is found before Ray starts."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from tvmpipe.bundle import Bundle
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.executor.inputs import Batch, npz_micro_batches, random_micro_batches
from tvmpipe.partition import Plan

BUILTIN_EXAMPLE = "mlp"


def builtin_example(name: str = BUILTIN_EXAMPLE) -> Path:
    """The example bundle shipped inside the package (examples/<name> in a source checkout)."""
    path = Path(str(importlib.resources.files("tvmpipe.examples") / name))
    if not (path / "bundle.json").is_file():
        raise TvmpipeError(f"built-in example '{name}' is missing from this installation ({path})")
    return path


def resolve_bundle(name: str | None) -> Path:
    """A path as given if it exists, else a built-in example of that name (None: the default
    one), else the path (which then fails to load with the bundle loader's own message)."""
    if name is None:
        return builtin_example()
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve()
    try:
        return builtin_example(name)
    except TvmpipeError:
        return path


def check_forward_pass(bundle: Bundle, command: str) -> None:
    """`command` (run, sweep, the cluster job) streams independent forward passes: a decode step's
    caches stay on its stages and one step alone has nothing to check, so it is refused in one line
    naming the command that runs it."""
    if bundle.state:
        raise TvmpipeError(f"{bundle.path} is a decode step with {len(bundle.state)} state pair(s): {command} streams "
                           "forward passes; run it with `tvmpipe generate` (docs/generation.md)")


def choose_plan(bundle: Bundle, plan_path: str | None, stages: int, strategy: str) -> Plan:
    """The plan a run uses, checked here once (against this bundle's graph and its state pairs,
    before any cluster starts; partition.checked_plan): the plan file, or K stages cut by `strategy`
    (equal op counts keeping every state pair whole, or the cost model's optimum)."""
    from tvmpipe.partition import checked_plan, make_plan

    if plan_path:
        return checked_plan(bundle, Plan.load(plan_path))
    if strategy == "equal":
        return checked_plan(bundle, stages)
    from tvmpipe.partition.model import PipelineModel

    return checked_plan(bundle, make_plan(PipelineModel.build(bundle), stages, strategy))


def micro_batches(bundle: Bundle, inputs: str | None, count: int | None, seed: int, *,
                  default_count: int, cycle: bool) -> list[Batch]:
    """The rows of an inputs .npz (`cycle`: repeated up to `count`), or `count` (default
    `default_count`) seeded random micro-batches."""
    if inputs:
        return npz_micro_batches(bundle, inputs, count, cycle=cycle)
    return random_micro_batches(bundle, count or default_count, seed)
