"""A paged step's pool sized at run time (issue 53, `--kv-tokens`; bundle/pool.py, executor/kvpool.py).

The zoo's GPT-2 compiled paged (tests/conftest.py zoo_decoder: max context 20, pages of 4, batch 2,
its default pool of 10 pages) is resized
at load: every pool entry, the ops.json records reading or writing it and `generation.paged.pages`
follow, the load's own check refuses a pool under one row, and a Stage over the resized bundle
(reference backend; cuda on the strict fake PyCUDA, whose kernels read the pool's pages from the
allocation as real ones do) gives the compiled bundle's logits with every row's pages at ids the
compiled pool does not have. The default size: rows x max context, reduced to what fits in 90 %
of the tightest memory's free bytes (faked where it is read), through a process pipeline too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm

T, B, P, POOL = 20, 2, 4, 10  # zoo_decoder's paged GPT-2 at batch 2: the default pool, B x T / P
# per row: its prompt, tokens to generate, and its pages in the compiled pool and in a resized one
# of 32 (ids past the compiled 10)
ROWS = [([5, 17, 3, 60, 9], 6, [0, 1, 2], [29, 30, 31]), ([7, 8], 8, [3, 4, 5], [20, 21, 9])]


@pytest.fixture(scope="module")
def paged(zoo_decoder):
    out = zoo_decoder("gpt2", B, kv="paged")[0]
    from tvmpipe.bundle import load_bundle

    g = load_bundle(out).generation
    assert (g.max_context, g.paged.page_size, g.paged.pages) == (T, P, POOL)
    return out


def _table(lengths: list[int], pages: list[list[int]], capacity: int) -> dict[str, np.ndarray]:
    """A step's page table: row b holds lengths[b] tokens (its newest written this step) on its
    first pages; a row of 0 is idle."""
    counts = [math.ceil(n / P) for n in lengths]
    values = np.zeros(capacity, np.int32)
    flat = [p for n, ps in zip(counts, pages) for p in ps[:n]]
    values[:len(flat)] = flat
    last = [n - (c - 1) * P if n else 0 for n, c in zip(lengths, counts)]
    posmap = [ps[(n - 1) // P] * P + (n - 1) % P if n else -1 for n, ps in zip(lengths, pages)]
    return {"page_table_indptr": np.array([0, *np.cumsum(counts)], np.int32), "page_table_values": values,
            "last_page_len": np.array(last, np.int32), "position_map": np.array(posmap, np.int32)}


def _drive(bundle, ids: int, backend: str = "reference", tokens: list[list[int]] | None = None):
    """Greedy steps of ROWS through a Stage keeping the pools resident, each row's pages at its
    compiled (`ids` 2) or resized (3) ids; `tokens`: feed these instead of the argmax (so two
    runs compare logits step for step). Returns each row's tokens and every step's logits."""
    from tvmpipe.executor.stage import Stage

    stage = Stage(bundle, 0, len(bundle.graph.nodes), backend, state_slots=1)
    feeds = stage.program.input_entries
    capacity = bundle.graph.entry_of("page_table_values").shape[0]
    seqs = [list(p) for p, _, _, _ in ROWS] if tokens is None else [list(t) for t in tokens]
    pages = [r[ids] for r in ROWS]
    fed, logs = [0, 0], []
    while any(fed[b] < len(ROWS[b][0]) + ROWS[b][1] - 1 for b in range(2)):
        live = [fed[b] < len(ROWS[b][0]) + ROWS[b][1] - 1 for b in range(2)]
        lengths = [fed[b] + 1 if live[b] else 0 for b in range(B)]
        step = {"input_ids": np.array([[seqs[b][fed[b]] if live[b] else 0] for b in range(B)], np.int64),
                "position": np.array(fed, np.int64),
                **_table(lengths, pages, capacity)}
        inputs = {e: step[n] for n, e in feeds.items() if e not in stage.state.inputs}
        inputs[stage.slot_entry] = np.array([0] + [0] * B, np.int64)
        out = stage.run(inputs)
        logits = out[bundle.graph.head_entries[0]].reshape(B, -1)
        logs.append(logits.copy())
        for b in range(2):
            if not live[b]:
                continue
            fed[b] += 1
            if fed[b] == len(seqs[b]):
                seqs[b].append(int(logits[b].argmax()))
    stage.close()
    return seqs, logs


def test_resizing_sets_every_pool_shape_and_the_load_check_stands(paged):
    from tvmpipe.bundle import BundleError, load_bundle
    from tvmpipe.bundle.pool import pool_entries, resize_pool

    b = load_bundle(paged)
    big = resize_pool(b, 32)
    assert big.generation.paged.pages == 32 and b.generation.paged.pages == POOL  # the loaded one unchanged
    pools = pool_entries(b.graph, b.state)
    assert len(pools) == 2 * len(b.state)  # each layer's pool input and the append's output written over it
    for e in pools:
        assert big.graph.entries[e].shape == (32, *b.graph.entries[e].shape[1:])
    others = [e.id for e in b.graph.entries if e.id not in pools]
    assert all(big.graph.entries[e].shape == b.graph.entries[e].shape for e in others)
    paged_ops = [r for f in big.ops.values() for r in f.ops if r.op.startswith("paged_")]
    assert paged_ops and all(32 in [s[0] for s in r.input_shapes] for r in paged_ops)
    assert all(r.output_shapes[0][0] == 32 for r in paged_ops if r.op == "paged_append")
    assert big.params is b.params and big.kernels is b.kernels  # nothing else is copied
    assert resize_pool(b, POOL) is b
    with pytest.raises(BundleError, match="holds less than one row at the max context"):
        resize_pool(b, T // P - 1)


def test_a_resized_pool_gives_the_compiled_pools_logits(paged):
    """The same steps, each row's pages at ids 20-31 of a pool of 32 (past the compiled 8): the
    same logits at every step, and the same greedy tokens."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.pool import resize_pool

    b = load_bundle(paged)
    want, want_logs = _drive(b, 2)
    got, logs = _drive(resize_pool(b, 32), 3, tokens=want)
    assert len(logs) == len(want_logs) > 8
    for a, c in zip(want_logs, logs):
        np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-6)
    assert got == want


def test_the_cuda_backend_allocates_and_runs_the_run_time_pool(paged, monkeypatch, tmp_path):
    """On the strict fake PyCUDA: a Stage over the bundle resized to 32 pages allocates each
    layer's pool at 32 pages, once (its resident buffer: the storage plan gives the pool no slot of
    its own, and nothing is staged through the host for it), and its launches give the
    reference backend's logits with the rows' pages past the compiled pool."""
    from tests.support.fake_cuda import activate
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.pool import resize_pool

    activate(monkeypatch, tmp_path / "cubins", [paged])
    import pycuda.driver as drv

    b = resize_pool(load_bundle(paged), 32)
    pool_bytes = b.graph.entry_of(b.state[0].input).nbytes
    want, want_logs = _drive(b, 3)
    got, logs = _drive(b, 3, backend="cuda", tokens=want)
    for a, c in zip(want_logs, logs):
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5)
    assert got == want and not drv.violations
    # the device memory a stage holds for the pools, measured against the fake's allocations
    from tvmpipe.executor.stage import Stage

    stage = Stage(b, 0, len(b.graph.nodes), "cuda", state_slots=1)
    pools = stage.program.resident
    assert len(pools) == 2 * len(b.state) and all(stage.program.storage.slots[stage.program.storage.entry_slot[e]]
                                                  .nbytes == 0 for e in pools)
    assert not pools & (set(stage.backend.host_in) | set(stage.backend.host_out))
    before = {id(a) for prim in drv._primaries.values() for a in prim.allocs.values()}
    stage.state.enter(0, False)  # the resident pools are made on first use
    made = [a.size for prim in drv._primaries.values() for a in prim.allocs.values() if id(a) not in before]
    assert sorted(made) == [pool_bytes] * len(b.state)
    assert stage.state.stage_bytes == pool_bytes * len(b.state)
    stage.close()


# ---- the default size, memory faked where it is read ---------------------------------------------

def _needs(fixed: int, page: int, memories: list[str]):
    from tvmpipe.executor.kvpool import StageMemory

    return [StageMemory(i, m, fixed, page) for i, m in enumerate(memories)]


def test_the_default_is_rows_at_max_context_within_the_free_memory(paged):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.core.errors import FieldError
    from tvmpipe.executor.kvpool import AUTO, size_pool

    b = load_bundle(paged)
    one_row = T // P  # 5 pages
    plenty = lambda m: 1 << 40  # noqa: E731
    s = size_pool(b, 4, _needs(1000, 100, ["host", "host"]), AUTO, plenty)
    assert (s.pages, s.cap_pages, s.requested) == (4 * one_row, 4 * one_row, None)
    # 0.9 x 10_000 - 2 x 1000 of fixed bytes = 7000: 35 pages at 2 x 100 a page (both stages share it)
    s = size_pool(b, 16, _needs(1000, 100, ["host", "host"]), AUTO, lambda m: 10_000)
    assert (s.pages, s.fit_pages, s.limit) == (35, 35, "host")
    # the tightest of two GPUs limits: each holds its own stage
    free = {"cuda:0": 10_000, "cuda:1": 5_000}
    s = size_pool(b, 16, _needs(1000, 100, ["cuda:0", "cuda:1"]), AUTO, free.get)
    assert (s.pages, s.limit) == ((int(0.9 * 5000) - 1000) // 100, "cuda:1")
    # a memory that cannot be read does not limit it
    assert size_pool(b, 2, _needs(1000, 100, ["remote"]), AUTO, lambda m: None).pages == 2 * one_row
    with pytest.raises(FieldError, match=r"\(default\): only 3 pages of 4 tokens fit, less than one row") as e:
        size_pool(b, 16, _needs(1000, 100, ["host"]), AUTO, lambda m: 1500)
    assert e.value.field == "kv_tokens"


def test_tokens_asked_for_are_whole_pages_checked_against_a_row_and_the_memory(paged, zoo_decoder):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.core.errors import FieldError
    from tvmpipe.executor.kvpool import size_pool

    b = load_bundle(paged)
    s = size_pool(b, 3, _needs(0, 10, ["host"]), 101, lambda m: 1 << 30)
    assert (s.pages, s.tokens, s.requested) == (26, 104, 101)  # rounded up; more than rows x T is allowed
    with pytest.raises(FieldError, match=r"^kv_tokens 16: a pool of 4 pages of 4 tokens \(16 tokens\) holds less "
                                         r"than one row at the max context \(20\)$"):
        size_pool(b, 3, _needs(0, 10, ["host"]), 16, lambda m: 1 << 30)
    with pytest.raises(FieldError, match=r"kv_tokens 4000: 1000 pages of 4 tokens do not fit; 900 pages"):
        size_pool(b, 3, _needs(0, 10, ["host"]), 4000, lambda m: 10_000)
    with pytest.raises(FieldError, match="keeps static caches"):
        size_pool(load_bundle(zoo_decoder("gpt2", B, kv="static")[0]), 3, [], 100, lambda m: None)


def test_free_memory_is_read_from_the_host_and_from_the_stages_gpu(monkeypatch, tmp_path, paged):
    from tests.support.fake_cuda import activate
    from tvmpipe.executor import kvpool

    avail = kvpool.host_available()
    with open("/proc/meminfo") as f:
        assert avail is not None and abs(avail - int(next(l for l in f if l.startswith("MemAvailable")).split()[1])
                                         * 1024) < 1 << 30
    assert kvpool.free_memory("host") is not None and kvpool.free_memory("none") is None
    activate(monkeypatch, tmp_path / "cubins", [paged])
    monkeypatch.setenv("FAKE_PYCUDA_MEMORY_GIB", "0.5")
    assert kvpool.free_memory("cuda:0") == 1 << 29  # cuMemGetInfo, nothing allocated
    assert kvpool.free_memory("cuda:7") is None  # no such device


def test_a_pipelines_default_pool_follows_the_free_memory(paged, monkeypatch):
    """A process pipeline opened without kv_tokens (the default, "auto") with the host's free
    memory faked (the driver reads it): 7 pages fit where rows x max context would be 20; every
    stage and the scheduler get 7 (fewer than compiled: the pool fills and preempts), and the
    tokens equal the compiled pool's (kv_tokens=None)."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.core.errors import FieldError
    from tvmpipe.executor import kvpool
    from tvmpipe.generation import Generator

    b = load_bundle(paged)
    needs = kvpool.stage_memory(b, [(0, len(b.graph.nodes))], ["host"])
    monkeypatch.setattr(kvpool, "host_available", lambda: int((needs[0].fixed_bytes + 7.5 * needs[0].page_bytes) / 0.9))
    prompts = [p for p, _, _, _ in ROWS] + [[1, 2, 3]]
    runs = {}
    for kv in (None, kvpool.AUTO):
        kw = {} if kv == kvpool.AUTO else {"kv_tokens": kv}  # the default, or the compiled pool
        with Pipeline(paged, 1, launcher="process", logits=False, slots=2, **kw) as pipe:
            runs[kv] = [r.tokens for r in Generator(pipe).generate_all(prompts, 8)]
            if kv is not None:
                assert (pipe.kv_pool.pages, pipe.kv_pool.cap_pages) == (7, 2 * B * T // P)
                assert pipe.bundle.generation.paged.pages == 7
    assert runs[None] == runs[kvpool.AUTO]
    with pytest.raises(FieldError, match=r"^kv_tokens 1000: 250 pages of 4 tokens do not fit; 7 pages \(28 tokens\)"):
        Pipeline(paged, 1, launcher="process", logits=False, slots=2, kv_tokens=1000)  # before any stage starts



def test_auto_sizes_nothing_for_a_step_without_a_pool(zoo_decoder):
    """kv_tokens "auto" (a Pipeline's default, what tvmpipe generate and serve pass whatever the
    bundle) on a static step: no pool to size, the bundle as loaded; a number of tokens for it stays
    a one-line refusal."""
    from tests.support.pipeline_harness import ThreadLauncher
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.core.errors import TvmpipeError

    static = zoo_decoder("gpt2", B, kv="static")[0]
    with Pipeline(static, 1, launcher=ThreadLauncher(), logits=False, slots=1) as pipe:
        assert pipe.kv_pool is None and pipe.bundle.generation.paged is None
    with pytest.raises(TvmpipeError, match="kv-tokens|paged"):
        Pipeline(static, 1, launcher=ThreadLauncher(), logits=False, slots=1, kv_tokens=64)


def test_a_stage_refuses_a_pool_its_memory_cannot_hold_in_one_line(paged, monkeypatch, tmp_path):
    """Where the driver could not read a stage's memory (a remote node), the stage itself refuses
    at start, before allocating it, a pool past its free memory (here 8 GiB of pools on a fake GPU
    of 1 GiB): one line, no OOM."""
    from tests.support.fake_cuda import activate
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.pool import resize_pool
    from tvmpipe.executor.errors import InputError
    from tvmpipe.executor.stage import Stage

    activate(monkeypatch, tmp_path / "cubins", [paged])
    monkeypatch.setenv("FAKE_PYCUDA_MEMORY_GIB", "1")
    b = resize_pool(load_bundle(paged), 2_000_000)
    with pytest.raises(InputError, match=r"^stage \[0, \d+\): its KV page pools take 7.6 GiB, more than the .* of "
                                         r"device memory free; give a smaller pool \(--kv-tokens\) or use more stages$"):
        Stage(b, 0, len(b.graph.nodes), "cuda", state_slots=1)


def test_which_memory_each_stage_is_sized_against():
    """The driver's map of stages to memories (cluster/driver.py): reference stages share this
    host's; cuda stages their GPUs' (a process launcher's devices, round robin; a Ray share of one
    GPU packs stages on it); a joined Ray cluster's stages may be on nodes this process cannot read."""
    from tvmpipe.cluster.control.launchers import ProcessLauncher
    from tvmpipe.cluster.control.placement import Placement
    from tvmpipe.cluster.driver import _pool_memories

    assert _pool_memories("reference", "process", None, 3) == ["host"] * 3
    assert _pool_memories("cuda", ProcessLauncher(devices=["0", "1"]), None, 3) == ["cuda:0", "cuda:1", "cuda:0"]
    assert _pool_memories("cuda", "ray", Placement(gpus=1.0, grows=False), 2) == ["cuda:0", "cuda:1"]  # --local
    assert _pool_memories("cuda", "ray", Placement(gpus=0.5, grows=False), 2) == ["cuda:0", "cuda:0"]
    assert _pool_memories("reference", "ray", Placement(grows=True), 2) == ["remote:0", "remote:1"]
    assert _pool_memories("simulated", "process", None, 1) == ["none"]

