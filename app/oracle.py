"""The single-process oracle: the whole graph on one GraphRunner, in a worker-like process, and
the comparison of a pipeline's outputs with it.

Pipelined outputs must equal the oracle's bit for bit where the stages compute with the oracle's
kernels: on this machine, in this process's environment. The run happens in a spawned child with the
stage workers' environment (cluster.environment.worker_environment: one BLAS thread), because OpenBLAS
sums in a different order with a different thread count, and a driver process's BLAS is already
configured. Stages on other hosts may run other BLAS kernels (another CPU, another OPENBLAS_CORETYPE:
OpenBLAS picks its kernel per machine), which round differently in the last bits; `compare` then
takes a tolerance (ACROSS_HOSTS_RTOL), and `differences` says how far from bit-identical a run was.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tvmpipe.bundle.dtypes import is_float

from tvmpipe.cluster.control.environment import worker_environment


def _run(bundle_path: str, backend: str, opts: dict, batches: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    from tvmpipe.executor import GraphRunner

    with GraphRunner(bundle_path, backend=backend, **opts) as runner:
        out = []
        for mb in batches:
            runner.run(**mb)
            out.append([runner.get_output(i).copy() for i in range(runner.get_num_outputs())])
        return out


def _run_streamed(bundle_path: str, backend: str, opts: dict, batches: list[dict[str, np.ndarray]],
                  stages: list[tuple[int, int]]) -> list[list[np.ndarray]]:
    """The same computation one node range at a time: load one range's weights, run every
    micro-batch through it, release them, go on. Only the entries later ranges (or the outputs)
    read are kept between ranges, so the peak is about the largest range's weights."""
    import gc

    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import Stage
    from tvmpipe.executor.runner import head_outputs

    bundle = load_bundle(bundle_path)
    g = bundle.graph
    carried: list[dict[int, np.ndarray]] = [{} for _ in batches]
    for start, end in stages:
        stage = Stage(bundle, start, end, backend, **opts)
        p = stage.program
        fed_inputs = {e: n for n, e in p.input_entries.items()}
        try:
            for mb, kept in zip(batches, carried):
                feed = {e: mb[fed_inputs[e]] if e in fed_inputs else kept[e] for e in p.feed_entries}
                kept.update(stage.run(feed))
        finally:
            stage.close()
            del stage
            release = getattr(bundle.params, "release", None)
            if release is not None:
                release()
            gc.collect()
        later = {e for a, b in stages if a >= end for n in range(a, b) for e in g.input_entry_ids(n)
                 if g.nodes[n].is_op} | set(g.head_entries)
        for kept in carried:
            for e in [e for e in kept if e not in later]:
                del kept[e]
    return [head_outputs(bundle, kept, mb) for mb, kept in zip(batches, carried)]


def reference_outputs(bundle_path: str | Path, batches: list[dict[str, np.ndarray]],
                      backend: str = "reference", backend_opts: dict | None = None,
                      stages: list[tuple[int, int]] | None = None) -> list[list[np.ndarray]]:
    """Outputs of every micro-batch, run one after another on a single GraphRunner built with
    `backend` and `backend_opts` (e.g. {"graphs": True}), as the stages are. With `stages` (node
    ranges covering the graph in order) the run is streamed: one range's weights at a time."""
    with worker_environment(), ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        if stages is not None:
            return pool.submit(_run_streamed, str(bundle_path), backend, dict(backend_opts or {}), batches,
                               [tuple(s) for s in stages]).result()
        return pool.submit(_run, str(bundle_path), backend, dict(backend_opts or {}), batches).result()


# Stages whose BLAS may run other kernels than the oracle's: float outputs pass where
# |got - want| <= rtol * (|want| + max|want|), max over that output. OpenBLAS's kernels for one CPU
# family sum a dot product in another order (block sizes, FMA or not); each order is within about
# n * eps * sum|terms| of the exact sum, so the difference scales with the output's magnitude, not
# with each value: a value that cancels to near zero gets the output's scale as its allowance.
# 1e-5 is ~80 float32 ulp: two kernels differ by ~1e-7 of the scale (examples/mlp: 2.4e-7 with
# outputs up to 2.7, i.e. 9e-8), while a wrong weight, input or micro-batch is off by far more.
ACROSS_HOSTS_RTOL = 1e-5
ULPS = 8  # lower-precision outputs (float16, bfloat16): at least this many units in the last place


def _eps(dtype: np.dtype) -> float:
    try:
        return float(np.finfo(dtype).eps)
    except (TypeError, ValueError):  # bfloat16 (ml_dtypes): np.finfo does not know it
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)


def tolerance(dtype: np.dtype, rtol: float) -> float:
    """The relative tolerance for outputs of `dtype`: `rtol`, and never under ULPS units in the last
    place of a float dtype (a float16 output that differs in its last bit is off by ~1e-3); 0 (exact)
    for integers and booleans, which no summation order changes."""
    if not rtol or not is_float(np.dtype(dtype).name):
        return 0.0
    return max(rtol, ULPS * _eps(dtype))


def _as_float64(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64: exact for every dtype we hold (bfloat16 included, which NumPy's own
    functions do not all know)."""
    return a.astype(np.float64), b.astype(np.float64)


def _difference(a64: np.ndarray, b64: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(max |a - b|, the output's scale max|b|, the finite mask) over the values where both are
    finite; NaNs and infinities are compared apart (_same_nonfinite)."""
    finite = np.isfinite(a64) & np.isfinite(b64)
    if not finite.any():
        return 0.0, 0.0, finite
    return float(np.max(np.abs(a64[finite] - b64[finite]))), float(np.max(np.abs(b64[finite]))), finite


def _relative(diff: float, scale: float) -> float:
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


def _same_nonfinite(a64: np.ndarray, b64: np.ndarray) -> bool:
    """NaN where the other is NaN, the same infinities in the same places."""
    nonfinite = ~np.isfinite(a64) | ~np.isfinite(b64)
    return bool(np.array_equal(a64[nonfinite], b64[nonfinite], equal_nan=True))


def compare(got: list[list[np.ndarray]], want: list[list[np.ndarray]],
            rtol: float = 0.0) -> list[tuple[int, str]]:
    """(micro-batch, what differs) for every output that is not bit-identical; empty when all are.
    With `rtol` (e.g. ACROSS_HOSTS_RTOL), a float output passes where every finite value is within
    tolerance(dtype, rtol) * (|want| + max|want|) and its NaNs and infinities match; shapes, dtypes,
    integer outputs and the number of micro-batches are still compared exactly."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        for k, (a, b) in enumerate(zip(g, w)):
            what = f"micro-batch {i} output {k}"
            if a.shape != b.shape or a.dtype != b.dtype:
                bad.append((i, f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"))
                continue
            if not is_float(a.dtype.name):  # integers, booleans: exact, in their own dtype
                if not np.array_equal(a, b):
                    diff = int(np.max(np.abs(a.astype(object) - b.astype(object))))
                    bad.append((i, f"{what}: max abs difference {diff}"))
                continue
            a64, b64 = _as_float64(a, b)
            if np.array_equal(a64, b64, equal_nan=True):
                continue
            if not _same_nonfinite(a64, b64):
                bad.append((i, f"{what}: NaN or infinity where the other has none, or another"))
                continue
            diff, scale, finite = _difference(a64, b64)
            r = tolerance(a.dtype, rtol)
            if not r:
                bad.append((i, f"{what}: max abs difference {diff:.3g}"))
            elif not np.all(np.abs(a64[finite] - b64[finite]) <= r * (np.abs(b64[finite]) + scale)):
                bad.append((i, f"{what}: max abs difference {diff:.3g} ({_relative(diff, scale):.3g} of the "
                               f"output's scale {scale:.3g}), beyond the tolerance rtol {r:g}"))
    for i in range(len(got), len(want)):
        bad.append((i, f"micro-batch {i}: no output"))
    return bad


@dataclass
class Differences:
    """How far a run's outputs are from the oracle's: micro-batches whose every output is
    bit-identical, and the largest difference over every float output (absolute, and relative to
    that output's scale max|want|)."""

    micro_batches: int
    bit_identical: int
    max_abs: float
    max_rel: float

    def words(self) -> str:
        if self.bit_identical == self.micro_batches:
            return "bit-identical"
        return (f"{self.bit_identical}/{self.micro_batches} micro-batches bit-identical, largest difference "
                f"{self.max_abs:.3g} ({self.max_rel:.3g} of the output's scale)")

    def to_json(self) -> dict:
        return {"micro_batches": self.micro_batches, "bit_identical": self.bit_identical,
                "max_abs_difference": self.max_abs, "max_rel_difference": self.max_rel}


def differences(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> Differences:
    """The Differences of `got` from `want`. Micro-batches of `want` missing from `got`, outputs of
    another shape or dtype, and integer outputs that differ are not bit-identical and add nothing to
    the largest difference (compare() reports them, whatever the tolerance)."""
    same = 0
    max_abs = max_rel = 0.0
    for g, w in zip(got, want):
        identical = len(g) == len(w)
        for a, b in zip(g, w):
            if a.shape != b.shape or a.dtype != b.dtype:
                identical = False
                continue
            if not is_float(a.dtype.name):  # compare() reports these: no tolerance applies
                identical = identical and bool(np.array_equal(a, b))
                continue
            a64, b64 = _as_float64(a, b)
            if np.array_equal(a64, b64, equal_nan=True):
                continue
            identical = False
            diff, scale, _ = _difference(a64, b64)
            max_abs, max_rel = max(max_abs, diff), max(max_rel, _relative(diff, scale))
        same += identical
    return Differences(len(want), same, max_abs, max_rel)
