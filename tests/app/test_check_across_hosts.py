"""What `tvmpipe run`'s check of outputs promises (docs/cluster.md, "Checking outputs across hosts"):
bit-identical to the single-process oracle where the stages run this machine's kernels in the
driver's environment (--processes, --local); within oracle.ACROSS_HOSTS_RTOL of each output's scale
on a cluster the run joined (--address), whose hosts' OpenBLAS may pick other kernels than the
driver's (another CPU, another OPENBLAS_CORETYPE: 4 of examples/mlp's 60 values differed in their
last bit between Haswell and SkylakeX kernels). Either way the report says how many micro-batches
were bit-identical and the largest difference, and anything beyond the last bits still fails.

A real 2-stage run on local processes is replayed with its outputs moved by a few units in the last
place (what another host's kernels do) or by far more (what a wrong weight or micro-batch does),
as if its stages had run on a joined cluster or on this machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.support.synthetic_bundles import write_dense_stack
from tvmpipe.app.options import ClusterOptions
from tvmpipe.app.oracle import ACROSS_HOSTS_RTOL, compare, differences, reference_outputs
from tvmpipe.app.run import PipelineRun, run_checked
from tvmpipe.bundle import load_bundle
from tvmpipe.executor.inputs import random_micro_batches
from tvmpipe.partition import plan_equal_ops

N = 4
REPLAYED = ("outputs", "record", "backend", "window", "restarts", "errors", "edge_paths", "started_at",
            "first_output_at", "phase_at")


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> PipelineRun:
    stack = write_dense_stack(tmp_path_factory.mktemp("stack") / "stack", layers=4, width=16)
    bundle = load_bundle(stack)
    run = PipelineRun(bundle, plan_equal_ops(bundle.graph, 2), random_micro_batches(bundle, N, 0),
                      ClusterOptions(processes=True))
    run.execute()
    assert len(run.outputs) == N
    want = reference_outputs(stack, run.batches)
    assert compare(run.outputs, want) == []  # the run itself is bit-identical on this machine
    return run


def ulps(x: np.ndarray, n: int) -> np.ndarray:
    """x moved n units in the last place away from zero."""
    for _ in range(n):
        x = np.nextafter(x, np.copysign(np.inf, x)).astype(x.dtype)
    return x


def replay(real: PipelineRun, joined: bool, change) -> PipelineRun:
    """A run whose execute() ends as `real` did, with `change(outputs)` applied to a copy of its
    outputs, on a cluster the run joined (`joined`) or on the local processes it started."""
    run = PipelineRun(real.bundle, real.plan, real.batches, real.options)

    def execute() -> None:
        for name in REPLAYED:
            setattr(run, name, getattr(real, name))
        run.outputs = [[o.copy() for o in out] for out in real.outputs]
        change(run.outputs)
        run.cluster = dataclasses.replace(real.cluster, launcher="ray", host=None, nodes=3, grows=True,
                                          description="Ray cluster auto (3 node(s))") if joined else real.cluster

    run.execute = execute
    return run


def last_bits(outputs) -> None:
    """Micro-batches 1 and 2 as another host's BLAS kernels leave them: a few values off by 1-3 ulp."""
    outputs[1][0][0, 3] = ulps(outputs[1][0][0, 3], 1)
    outputs[2][0][0, :5] = ulps(outputs[2][0][0, :5], 3)


def test_joined_cluster_passes_last_bit_differences_and_reports_them(real: PipelineRun):
    done = run_checked(replay(real, True, last_bits))
    assert done.mismatches == [], done.mismatches
    assert done.rtol == ACROSS_HOSTS_RTOL and done.identical == N - 2
    want = np.stack([o[0] for o in real.outputs]).astype(np.float64)
    got = np.stack([o[0] for o in done.run.outputs]).astype(np.float64)
    largest = float(np.max(np.abs(got - want)))
    assert largest > 0 and done.differences.max_abs == largest
    assert done.differences.max_rel == max(np.max(np.abs(g - w)) / np.max(np.abs(w)) for g, w in zip(got, want))
    words = done.checked
    assert f"within rtol {ACROSS_HOSTS_RTOL:g}" in words and "docs/cluster.md" in words, words
    assert f"{N - 2}/{N} micro-batches bit-identical, largest difference {largest:.3g}" in words, words
    summary = done.summary("stack")
    assert summary["match"] is True and summary["tolerance"] == ACROSS_HOSTS_RTOL
    assert summary["differences"] == {"micro_batches": N, "bit_identical": N - 2, "max_abs_difference": largest,
                                      "max_rel_difference": done.differences.max_rel}


def test_joined_cluster_reports_bit_identical_when_it_is(real: PipelineRun):
    done = run_checked(replay(real, True, lambda outputs: None))
    assert done.mismatches == [] and done.identical == N
    assert done.checked.endswith("; bit-identical"), done.checked
    assert done.differences.max_abs == 0.0


def test_joined_cluster_still_fails_beyond_the_last_bits(real: PipelineRun):
    def wrong(outputs) -> None:
        out = outputs[1][0]
        out[0, 0] += 1e-3 * np.max(np.abs(out))  # a wrong weight: far beyond any summation order
        outputs[2], outputs[3] = outputs[3], outputs[2]  # micro-batches out of order

    done = run_checked(replay(real, True, wrong))
    assert sorted({i for i, _ in done.mismatches}) == [1, 2, 3], done.mismatches
    assert all("beyond the tolerance rtol 1e-05" in m for _, m in done.mismatches), done.mismatches
    assert done.summary("stack")["match"] is False and done.identical == 1


def test_own_processes_still_require_bit_identical_outputs(real: PipelineRun):
    """Stages this run started compute with the oracle's kernels: one ulp is a failure there."""
    done = run_checked(replay(real, False, last_bits))
    assert done.rtol == 0.0 and sorted(i for i, _ in done.mismatches) == [1, 2], done.mismatches
    assert done.summary("stack")["tolerance"] == "bit-identical" and done.identical == N - 2
    assert "within rtol" not in done.checked


@pytest.mark.parametrize("dtype, moved, passes", [
    (np.float32, 3, True),
    (np.float32, 400, False),  # the largest value, 3, may move 2e-5 x 3 (~250 of its ulps), no more
    (np.float16, 2, True),  # float16's last bit is ~1e-3: the tolerance is at least 8 of its ulps
    (np.float16, 40, False),
])
def test_tolerance_in_units_of_the_output_dtype(dtype, moved: int, passes: bool):
    want = np.linspace(-3, 3, 16).astype(dtype).reshape(1, 16)
    got = want.copy()
    got[0, -1] = ulps(got[0, -1:], moved)[0]
    assert (compare([[got]], [[want]], ACROSS_HOSTS_RTOL) == []) is passes
    assert compare([[got]], [[want]]) != []  # never bit-identical
    assert differences([[got]], [[want]]).bit_identical == 0


def test_integer_outputs_nans_and_missing_micro_batches_stay_exact():
    ints = [[np.array([[3, 7]], np.int64)]]
    assert compare([[np.array([[3, 8]], np.int64)]], ints, ACROSS_HOSTS_RTOL) != []
    floats = [[np.array([[1.0, np.nan, np.inf]], np.float32)]]
    assert compare(floats, floats, ACROSS_HOSTS_RTOL) == []
    assert compare([[np.array([[1.0, 0.5, np.inf]], np.float32)]], floats, ACROSS_HOSTS_RTOL) != []
    assert compare([[np.array([[1.0, np.nan, -np.inf]], np.float32)]], floats, ACROSS_HOSTS_RTOL) != []
    assert compare(floats[:0], floats, ACROSS_HOSTS_RTOL) == [(0, "micro-batch 0: no output")]
