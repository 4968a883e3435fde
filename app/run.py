"""One pipeline run, the flow `tvmpipe run` and `python -m tvmpipe.job` share.

    run = PipelineRun(bundle, plan, batches, options)
    run.execute()            # open/join the cluster, start the stages, stream every micro-batch
    run.outputs, run.record  # kept as far as the run got, also when execute() raised

Each micro-batch's outputs are taken as soon as they complete, so a run that fails (a stage
beyond its restarts, SIGTERM, Ctrl-C) still holds every output delivered before; the record
(metrics, timeline) is taken while the workers are still up, because their spans live there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tvmpipe.app.connect import Cluster, open_cluster, pick_backend, pipeline_kwargs
from tvmpipe.app.options import ClusterOptions
from tvmpipe.bundle import Bundle
from tvmpipe.core import files
from tvmpipe.executor.inputs import Batch
from tvmpipe.partition import Plan

log = logging.getLogger("tvmpipe.run")

Outputs = list[np.ndarray]


@dataclass
class PipelineRun:
    """`phase` says how far the run got: connect, start, run, done. `on_phase` is called as each
    begins (the job records it, and re-installs its SIGTERM handler once Ray has set its own)."""

    bundle: Bundle
    plan: Plan
    batches: list[Batch]
    options: ClusterOptions
    on_phase: Callable[[str], None] = lambda phase: None
    phase: str = "connect"
    outputs: list[Outputs] = field(default_factory=list)
    record: Any = None  # the pipeline's RunRecord, once taken
    cluster: Cluster | None = None
    backend: str | None = None
    window: int | None = None
    restarts: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    edge_paths: dict[str, str] = field(default_factory=dict)  # "producer->consumer" -> "shm" | "tcp"
    started_at: float | None = None  # wall clock when execute() began (before the cluster opens)
    first_output_at: float | None = None  # wall clock when the first micro-batch's outputs arrived
    phase_at: dict[str, float] = field(default_factory=dict)  # wall clock each phase began

    @property
    def time_to_first_output(self) -> float | None:
        """Seconds from the start of the run (cluster, stage builds and weight loads included) to
        the first micro-batch's outputs."""
        if self.started_at is None or self.first_output_at is None:
            return None
        return self.first_output_at - self.started_at

    @property
    def startup_s(self) -> dict[str, float]:
        """Where the time to first output went, in seconds: `cluster` (Ray up or reached),
        `stages` (stage processes started, weights read, stages built and wired), `first_output`
        (the first micro-batch through every stage)."""
        at = self.phase_at
        out = {}
        if "connect" in at and "start" in at:
            out["cluster"] = at["start"] - at["connect"]
        if "start" in at and "run" in at:
            out["stages"] = at["run"] - at["start"]
        if "run" in at and self.first_output_at is not None:
            out["first_output"] = self.first_output_at - at["run"]
        return out

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.phase_at[phase] = time.time()
        self.on_phase(phase)

    def execute(self) -> None:
        from tvmpipe.cluster import Pipeline

        k = self.plan.num_stages
        self.started_at = time.time()
        self._enter("connect")
        with open_cluster(self.options, k) as cluster:
            self.cluster = cluster
            self.backend = pick_backend(self.options.backend, cluster.gpus)
            self._enter("start")
            log.info("starting %d stages on %s, backend %s", k, cluster.description, self.backend)
            with Pipeline(self.bundle, self.plan, **pipeline_kwargs(self.options, cluster, self.backend, k)) as pipe:
                self.window = pipe.window
                try:
                    self._enter("run")
                    stream(pipe, self.batches, self._delivered)
                finally:
                    self._take_record(pipe)
        self._enter("done")

    def _delivered(self, out: Outputs) -> None:
        if self.first_output_at is None:
            self.first_output_at = time.time()
        self.outputs.append(out)
        log.info("micro-batch %d/%d done", len(self.outputs), len(self.batches))

    def _take_record(self, pipe: Any) -> None:
        try:
            self.record = pipe.record()
        except Exception as exc:  # noqa: BLE001 - a failed run may have no workers left to ask
            log.warning("no run record (metrics, timeline): %s", exc)
        self.restarts, self.errors = list(pipe.restarts), list(pipe.errors)
        try:
            self.edge_paths = {f"{s}->{d}": p for (s, d), p in sorted(pipe.edge_paths().items())}
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning("no edge paths: %s", exc)


def stream(pipe: Any, batches: list[Batch], delivered: Callable[[Outputs], None]) -> None:
    """Submit every micro-batch and hand each one's outputs to `delivered` as they complete, in
    order; on a PipelineError the outputs it carries are handed over before it is re-raised.
    Every micro-batch is checked before the first is sent."""
    from tvmpipe.cluster import PipelineError

    for batch in batches:
        pipe.check_inputs(batch)
    done = 0
    try:
        for submitted, batch in enumerate(batches, 1):
            pipe.submit(batch)
            while done < submitted:  # take what is ready, without waiting
                try:
                    out = pipe.get(timeout=0)
                except TimeoutError:
                    break
                delivered(out)
                done += 1
        for _ in range(done, len(batches)):
            delivered(pipe.get())
    except PipelineError as exc:
        for out in exc.completed:
            delivered(out)
        raise


def output_arrays(outputs: list[Outputs]) -> dict[str, np.ndarray]:
    """output<k> with a leading micro-batch axis, and `micro_batch`: the index of each row."""
    arrays = {f"output{k}": np.stack([o[k] for o in outputs]) for k in range(len(outputs[0]))}
    arrays["micro_batch"] = np.arange(len(outputs), dtype=np.int64)
    return arrays


def write_outputs(path: str | Path, outputs: list[Outputs]) -> Path | None:
    """The outputs as an .npz, atomically; nothing when no micro-batch completed."""
    return files.write_npz(path, output_arrays(outputs)) if outputs else None


def write_timeline(record: Any, trace_path: str | Path, png_path: str | Path, title: str) -> list[Path]:
    """The Chrome/Perfetto trace and the Gantt PNG (each atomic); nothing before a completion."""
    from tvmpipe.cluster.timeline import write_gantt, write_trace

    if record is None or not record.done_times:
        return []
    return [write_trace(record, trace_path), write_gantt(record, png_path, title=title)]


@dataclass
class CheckedRun:
    """A finished `tvmpipe run`: the run, its metrics, how its outputs compare with the
    single-process oracle (micro-batch, what differs), and the files written."""

    run: PipelineRun
    metrics: Any
    mismatches: list[tuple[int, str]]  # beyond the tolerance (`rtol`; 0: any difference)
    written: list[Path]
    check: str = "full"  # CHECKS: how the outputs were checked
    rtol: float = 0.0  # 0: bit-identical required; else oracle.ACROSS_HOSTS_RTOL (see oracle_tolerance)
    differences: Any = None  # oracle.Differences: bit-identical micro-batches, the largest difference

    @property
    def checked(self) -> str:
        """What was checked, in words, for the output."""
        words = CHECK_WORDS[self.check]
        if self.check == "none":
            return words
        if self.rtol:
            words += (f", within rtol {self.rtol:g} of each output's scale (stages on a cluster this run joined "
                      "may run other BLAS kernels than the driver's: docs/cluster.md)")
        if self.differences is not None:
            words += f"; {self.differences.words()}"
        return words

    @property
    def identical(self) -> int:
        """Micro-batches whose every output is bit-identical to the oracle's."""
        if self.differences is not None:
            return self.differences.bit_identical
        return len(self.run.batches) - len({i for i, _ in self.mismatches})

    def summary(self, bundle_path: str) -> dict[str, Any]:
        run = self.run
        return {"bundle": bundle_path, "model": run.bundle.name, "stages": [list(s) for s in run.plan.stages],
                "strategy": run.plan.strategy, "backend": run.backend, "cluster": run.cluster.description,
                "micro_batches": len(run.batches), "window": run.window,
                "match": None if self.check == "none" else not self.mismatches, "check": self.check,
                "tolerance": None if self.check == "none" else (self.rtol or "bit-identical"),
                "differences": self.differences.to_json() if self.differences is not None else None,
                "mismatches": [m for _, m in self.mismatches[:20]], "metrics": self.metrics.to_json(),
                "edge_paths": run.edge_paths,
                "time_to_first_output_s": run.time_to_first_output, "startup_s": run.startup_s,
                "started_at": run.started_at,
                "trace": [str(p) for p in self.written if p.suffix in (".json", ".png")]}


def output_paths(save_outputs: str | None, trace: str | None) -> dict[str, Path]:
    """The files a run will write, by the option that named them, each checked writable now:
    a typo in a directory must not cost a whole run and then a traceback."""
    paths: dict[str, Path] = {}
    if save_outputs:
        paths["--save-outputs"] = files.check_writable(save_outputs, "--save-outputs")
    if trace:
        paths["--trace"] = files.check_writable(trace, "--trace")
        paths["--trace (Gantt PNG)"] = files.check_writable(Path(trace).with_suffix(".png"), "--trace")
    return paths


CHECKS = ("streamed", "full", "none")
CHECK_WORDS = {
    "full": "every output against a single-process run of the whole model",
    "streamed": "every output against a single-process run streamed stage by stage (one stage's weights at a time)",
    "none": "nothing (--check none)",
}


def oracle_tolerance(cluster: Any) -> float:
    """0 (bit-identical required) where the stages run this machine's BLAS kernels in this process's
    environment, as the oracle does: this run started them (--processes) or the Ray cluster they run
    on (--local), and they inherit both. On a cluster it joined (--address) a stage may run on
    another host, or under a Ray node started from another shell, and OpenBLAS picks its kernel per
    CPU (or by OPENBLAS_CORETYPE): the sums round differently in the last bits there, so outputs must
    be within oracle.ACROSS_HOSTS_RTOL (docs/cluster.md, "Checking outputs across hosts")."""
    from tvmpipe.app.oracle import ACROSS_HOSTS_RTOL

    if cluster is None or cluster.launcher == "process" or not cluster.grows:
        return 0.0
    return ACROSS_HOSTS_RTOL


def run_checked(run: PipelineRun, save_outputs: str | None = None, trace: str | None = None,
                check: str = "streamed") -> CheckedRun:
    """Execute `run`, compare every output with the single-process oracle (bit for bit, or within
    a tolerance on a cluster this run joined: oracle_tolerance), write the outputs
    (--save-outputs) and the timeline (--trace). When the run fails, the outputs that completed
    are still written before the error goes on. `check`: "full" runs the oracle on the whole
    model at once; "streamed" (default) runs the same graph one plan stage at a time in one
    process, so the check never holds more than the largest stage's weights; "none" skips it."""
    if check not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {check!r}")
    from tvmpipe.app.oracle import compare, differences, reference_outputs
    from tvmpipe.cluster.metrics import compute_metrics

    output_paths(save_outputs, trace)
    try:
        run.execute()
    except BaseException:
        if save_outputs and run.outputs:
            kept = write_outputs(save_outputs, run.outputs)
            log.warning("kept the %d completed micro-batch(es) in %s", len(run.outputs), kept)
        raise
    metrics = compute_metrics(run.record)
    mismatches, diff, rtol = [], None, oracle_tolerance(run.cluster)
    if check != "none":
        want = reference_outputs(run.bundle.path, run.batches, run.backend,
                                 stages=list(run.plan.stages) if check == "streamed" else None)
        mismatches, diff = compare(run.outputs, want, rtol), differences(run.outputs, want)
    written = []
    if save_outputs:
        written.append(write_outputs(save_outputs, run.outputs))
    if trace:
        written += write_timeline(run.record, trace, Path(trace).with_suffix(".png"),
                                  title=f"{run.bundle.name}: {run.plan.num_stages} stages")
    return CheckedRun(run, metrics, mismatches, written, check, rtol, diff)
