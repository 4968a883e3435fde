"""`python -m tvmpipe.job`: one pipeline run as a cluster job, leaving a self-contained run directory.

The same entry point serves every way a job reaches a cluster:
- `ray job submit --working-dir DIR -- python -m tvmpipe.job ...`: the driver runs on the head node
  inside a Ray job, and the default `--address auto` joins that job's cluster;
- `ray submit CLUSTER.yaml deploy/job.py -- ...`: this file runs as a plain script on the head node,
  and `--address auto` finds the node's running Ray;
- a laptop or CI: `--local` starts a private loopback Ray, `--processes` uses no Ray at all.

The cluster options (--address/--local/--processes, --backend, --placement, --gpus-per-stage, ...)
are `tvmpipe run`'s own, and the run itself is the application layer's (tvmpipe.app.run), so a
job and an interactive run of the same command line place and run the stages the same way. This
module adds what only a job has: the run directory, its log, error.json and SIGTERM handling.

The run directory (`--run-dir`, default runs/<timestamp>-<model>) receives plan.json, outputs.npz,
metrics.json, trace.json, timeline.png and job.log, each written atomically. A failed job writes
the outputs of the micro-batches that completed, error.json saying what failed where, and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# `ray submit CLUSTER.yaml deploy/job.py` copies this file to ~/job.py on the head and runs it there,
# so Python puts ~ first on sys.path, next to the checkout that file_mounts synced to ~/tvmpipe. That
# directory has no __init__.py, so the path scan takes it as a namespace package `tvmpipe` and it
# shadows an editable install (setuptools' editable finder comes after the path scan): the job then
# ran the checkout's copies and died on `tvmpipe.__version__`. The script needs nothing beside it.
if __name__ == "__main__" and sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

from tvmpipe.app.args import COUNT, Parser, add_cluster_args, cluster_options  # noqa: E402
from tvmpipe.app.options import ClusterOptions  # noqa: E402
from tvmpipe.app.run import PipelineRun, write_outputs, write_timeline  # noqa: E402
from tvmpipe.app.sources import (BUILTIN_EXAMPLE, check_forward_pass, choose_plan, micro_batches,  # noqa: E402
                                  resolve_bundle)
from tvmpipe.bundle import Bundle, load_bundle  # noqa: E402
from tvmpipe.core.errors import TvmpipeError  # noqa: E402
from tvmpipe.deploy.rundir import RunDir, RunDirError, default_run_dir  # noqa: E402
from tvmpipe.executor.inputs import Batch  # noqa: E402

log = logging.getLogger("tvmpipe.job")

DEFAULT_MICRO_BATCHES = 8


class JobStopped(BaseException):
    """SIGTERM (what `ray job stop` sends): end like a failure, so completed outputs are written. A
    BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""


@dataclass
class JobConfig:
    """The job's own options; `cluster` holds the options shared with `tvmpipe run`."""

    bundle: str
    plan: str | None
    stages: int
    strategy: str
    inputs: str | None
    seed: int
    micro_batches: int | None
    ship_bundle: str
    run_dir: str | None
    cluster: ClusterOptions

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cluster"}
        return {**dataclasses.asdict(self.cluster), **fields}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m tvmpipe.job",
        description="Run a bundle as a pipeline, as a cluster job, and leave a run directory (plan.json, outputs.npz, "
                    "metrics.json, trace.json, timeline.png, job.log; error.json when it fails). Without --local, "
                    "--address or --processes it joins the running Ray cluster (--address auto). "
                    "See docs/cluster-jobs.md.")
    p.add_argument("bundle", nargs="?", default=BUILTIN_EXAMPLE,
                   help=f"bundle directory (on shared storage or in the job's working dir), or the name of a "
                        f"built-in example (default: {BUILTIN_EXAMPLE})")
    plan = p.add_mutually_exclusive_group()
    plan.add_argument("--plan", metavar="PLAN.json", help="plan from `tvmpipe partition -o`")
    plan.add_argument("--stages", "-k", type=COUNT, default=2, help="number of stages when no --plan is given (default 2)")
    p.add_argument("--strategy", choices=["equal", "optimal"], default="equal",
                   help="how --stages K are cut: equal op counts, or the cost model's optimum (default equal)")
    p.add_argument("--inputs", metavar="IN.npz", help="one array per graph input name, of its shape (the same in "
                   "every micro-batch) or [N, *shape] for N micro-batches (default: seeded random inputs)")
    p.add_argument("--seed", type=int, default=0, help="random inputs: micro-batch i uses seed + i (default 0)")
    p.add_argument("--micro-batches", "-n", type=COUNT,
                   help=f"number of micro-batches (default: the rows in --inputs, else {DEFAULT_MICRO_BATCHES})")
    p.add_argument("--ship-bundle", choices=["auto", "yes", "no"], default="auto",
                   help="send the bundle's files to the stage actors through Ray instead of having them read its "
                        "path; auto: when the cluster has more than one node (default auto)")
    p.add_argument("--run-dir", help="results directory, new or empty; use shared storage or an absolute path on the "
                                     "head node (default runs/<timestamp>-<model> under the current directory)")
    add_cluster_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> JobConfig:
    ns = build_parser().parse_args(argv)
    if not (ns.local or ns.processes or ns.address):
        ns.address = "auto"  # a job runs on a cluster: inside `ray job submit`, or on a node of it
    own = {f.name for f in dataclasses.fields(JobConfig)} - {"cluster"}
    ship = {"auto": None, "yes": True, "no": False}[ns.ship_bundle]
    return JobConfig(**{k: getattr(ns, k) for k in own}, cluster=cluster_options(ns, ship_bundle=ship))


class Job:
    """One run: everything it learns goes into `info` (metrics.json) or error.json."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.phase = "load"
        self.rundir: RunDir | None = None
        self.batches: list[Batch] = []
        self.run_: PipelineRun | None = None
        self.info: dict[str, Any] = {"config": cfg.to_json(), "host": socket.gethostname(), "started": time.time()}

    @property
    def outputs(self) -> list[list[np.ndarray]]:
        return self.run_.outputs if self.run_ else []

    @property
    def record(self) -> Any:
        return self.run_.record if self.run_ else None

    # ---- the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        path = resolve_bundle(self.cfg.bundle)
        bundle: Bundle | None = None
        load_error: BaseException | None = None
        try:
            bundle = load_bundle(path)
        except TvmpipeError as exc:
            load_error = exc
        model = bundle.name if bundle else path.name
        try:
            target = self.cfg.run_dir or default_run_dir(model)
            self.rundir = RunDir.create(target, unique=self.cfg.run_dir is None)
        except RunDirError as exc:
            print(f"tvmpipe job: error: {exc}", file=sys.stderr)
            return 2
        self.info.update(bundle=str(path), model=model, run_dir=str(self.rundir.path))
        try:
            with _job_logging(self.rundir.partial_log):
                return self._logged_run(bundle, load_error)
        finally:
            self.rundir.finish_log()

    def _logged_run(self, bundle: Bundle | None, load_error: BaseException | None) -> int:
        previous = _trap_sigterm()
        try:
            log.info("run directory %s", self.rundir.path)
            if load_error is not None:
                raise load_error
            self._run(bundle)
            log.info("done: %d micro-batches, results in %s", len(self.outputs), self.rundir.path)
            return 0
        except BaseException as exc:  # noqa: BLE001 - every failure must leave error.json behind
            self._fail(exc)
            return 130 if isinstance(exc, KeyboardInterrupt) else 1
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _run(self, bundle: Bundle) -> None:
        cfg = self.cfg
        self.phase = "plan"
        check_forward_pass(bundle, "the cluster job")
        plan = choose_plan(bundle, cfg.plan, cfg.stages, cfg.strategy)
        self.rundir.write_json("plan.json", plan.to_json())
        log.info("plan (%s): %d stages %s", plan.strategy, plan.num_stages, plan.stages)

        self.phase = "inputs"
        self.batches = micro_batches(bundle, cfg.inputs, cfg.micro_batches, cfg.seed,
                                     default_count=DEFAULT_MICRO_BATCHES, cycle=False)
        self.info["micro_batches"] = len(self.batches)

        self.run_ = PipelineRun(bundle, plan, self.batches, cfg.cluster, on_phase=self._on_phase)
        self.run_.execute()
        self.phase = "write"
        self._write_results(title=f"{bundle.name}: {plan.num_stages} stages, {self.run_.backend}")

    def _on_phase(self, phase: str) -> None:
        run = self.run_
        if phase == "start":  # connected: ray.init has installed its own SIGTERM handler
            _trap_sigterm()
            self.info.update(cluster=dataclasses.asdict(run.cluster), backend=run.backend)
        if phase != "done":
            self.phase = phase

    # ---- results ---------------------------------------------------------------------------------
    def _write_results(self, title: str, best_effort: bool = False) -> None:
        """outputs.npz, trace.json + timeline.png (need a completed micro-batch), metrics.json. On
        the failure path each is attempted on its own: one that cannot be written loses only itself."""
        steps = [("outputs", self._write_outputs), ("timeline", lambda: self._write_timeline(title)),
                 ("metrics", self._write_metrics)]
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001
                if not best_effort:
                    raise
                log.error("could not write %s: %s: %s", what, type(exc).__name__, exc)

    def _write_timeline(self, title: str) -> None:
        if self.record is None or not self.record.done_times:
            return
        from tvmpipe.cluster.metrics import compute_metrics

        self.info["pipeline"] = compute_metrics(self.record).to_json()
        write_timeline(self.record, self.rundir.path / "trace.json", self.rundir.path / "timeline.png", title)

    def _write_outputs(self) -> None:
        write_outputs(self.rundir.path / "outputs.npz", self.outputs)

    def _write_metrics(self) -> None:
        import tvmpipe

        if self.run_ is not None:  # a failed run: what the supervisor handled until then
            self.info.update(restarts=list(self.run_.restarts), errors=list(self.run_.errors))
        self.info.update(completed=len(self.outputs), finished=time.time(), tvmpipe_version=tvmpipe.__version__)
        self.info["wall_s"] = self.info["finished"] - self.info["started"]
        self.rundir.write_json("metrics.json", self.info)

    def _fail(self, exc: BaseException) -> None:
        log.error("job failed in phase %s: %s: %s", self.phase, type(exc).__name__, exc)
        summary = {"error": type(exc).__name__, "message": str(exc), "phase": self.phase,
                   "stage": getattr(exc, "stage", None), "last_error": getattr(exc, "last_error", None),
                   "completed_micro_batches": len(self.outputs), "micro_batches": len(self.batches),
                   "traceback": "".join(traceback.format_exception(exc))}
        self._write_results(title=f"failed in phase {self.phase}", best_effort=True)
        self.rundir.write_json("error.json", summary)


@contextmanager
def _job_logging(path: Path) -> Iterator[None]:
    """tvmpipe's log records go to the partial log, and to stderr (what `ray job logs` shows) unless
    the host program already handles logging; everything is undone afterwards, for in-process use."""
    logger = logging.getLogger("tvmpipe")
    handlers: list[logging.Handler] = [logging.FileHandler(path, encoding="utf-8")]
    handlers[0].setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if not logging.getLogger().handlers:
        handlers.append(logging.StreamHandler(sys.stderr))
    level = logger.level
    for h in handlers:
        logger.addHandler(h)
    if level == logging.NOTSET or level > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for h in handlers:
            logger.removeHandler(h)
            h.close()
        logger.setLevel(level)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise JobStopped("stopped by SIGTERM (ray job stop?)")


def _trap_sigterm() -> Any:
    """Make SIGTERM raise JobStopped; returns the handler it replaced (None off the main thread,
    where Python cannot set handlers). Called again after connecting: ray.init installs its own."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def main(argv: list[str] | None = None) -> int:
    return Job(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
