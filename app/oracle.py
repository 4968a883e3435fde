"""The single-process oracle: the whole graph on one GraphRunner, in a worker-like process, and
the comparison of a pipeline's outputs with it.

Pipelined outputs must equal the oracle's bit for bit. The run happens in a spawned child with the stage
workers' environment (cluster.environment.worker_environment: one BLAS thread), because OpenBLAS sums in a
different order with a different thread count, and a driver process's BLAS is already configured.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
import numpy as np

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


def compare(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> list[tuple[int, str]]:
    """(micro-batch, what differs) for every output that is not bit-identical; empty when all are."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        for k, (a, b) in enumerate(zip(g, w)):
            if a.shape != b.shape or a.dtype != b.dtype:
                bad.append((i, f"micro-batch {i} output {k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"))
            elif not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
                diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                bad.append((i, f"micro-batch {i} output {k}: max abs difference {diff:.3g}"))
    for i in range(len(got), len(want)):
        bad.append((i, f"micro-batch {i}: no output"))
    return bad
