"""Paged against static KV (issue 53), the part that needs no scheduler: a decode step's time against
the tokens it holds, on the reference backend.

    python bench/kv.py [--quick] [--out bench/results/kv.json]

Compiles the zoo's Llama decode step (2 layers, 2 KV heads of 16, vocabulary 128; `--batch 8`) at
two max contexts, T = 64 and T = 2048, in both layouts (`--kv static` and `--kv paged`, page size 16,
the default pool: every row at T), and times one step of 8 rows each holding 64 tokens, through a
Stage keeping its state resident (as a pipeline's stage does: no cache is fed or sent), best of
--repeat runs. The static step writes and attends over all T positions a row; the paged one appends
each row's token to its page and attends over the row's 64 tokens through the page table, so its
time should follow the tokens held, not T: the issue's target is paged(T = 2048) <= 1.2 x
paged(T = 64) at 64 tokens held. `--quick` uses T = 64 and 256.

Through the scheduler (a one-stage process pipeline, the same Llama step; skipped with --quick):

* **Prefix TTFT**: a max context of 256, batch 8. A request whose prompt is a 200-token system
  prompt and 2 tokens of its own runs alone, then 7 more with the same system prompt run at once:
  the paged step shares the first request's 12 full cached pages (their prefill is skipped), the
  static one computes every prompt token. TTFT (admission to first token) of the first against the
  median of the 7 (target: >= 3x lower), the pages shared while they run, the tokens of both
  layouts compared.
* **Capacity at a fixed pool**: a max context of 2048, batch 8, a pool of 2048 tokens (128 pages)
  set at run time (`kv_tokens`, issue 53's `--kv-tokens`; the step is compiled with the default
  pool of every row at 2048). 16 requests of 8 prompt tokens and 32 to generate at once: the most
  rows busy at once (target >= 8), the tokens against the static step's; the static caches those
  rows would take (rows x 2048 tokens) against the pool, and each layout's stage process's
  resident memory after the run. Then the same through a server, as the issue asks:
  `tvmpipe serve --kv-tokens 2048` (one stage, local processes), the 16 requests streamed at once,
  the rows busy read from /metrics while they run, the texts against the static step's, the pool
  /metrics reports and the stage process's resident memory.

These times on a GPU: bench/paged_gpu.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from stamp import stamp  # noqa: E402

BATCH, PAGE, HELD = 8, 16, 64
TARGET = 1.2


def step_ms(bundle_dir: Path, repeat: int) -> float:
    """Best time of one step, 8 rows of HELD tokens each, its state resident in a Stage."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor.stage import Stage
    from tvmpipe.generation.pages import PagePool, RowWrite, step_pages

    b = load_bundle(bundle_dir)
    st = Stage(b, 0, len(b.graph.nodes), "reference", state_slots=1)
    feeds = {"input_ids": np.ones((BATCH, 1), np.int64), "position": np.full(BATCH, HELD - 1, np.int64)}
    if b.generation.paged is not None:
        pool = PagePool(b.generation.paged.pages, PAGE)
        for s in range(BATCH):
            pool.reserve(s, [], HELD)
        sp = step_pages(pool, [RowWrite(s, HELD - 1, 1) for s in range(BATCH)], 1,
                        b.graph.entry_of("page_table_values").shape[0])
        for k in ("page_table_indptr", "page_table_values", "last_page_len", "position_map"):
            feeds[k] = np.array(getattr(sp, k), np.int32)
    inputs = {e: feeds[n] for n, e in st.program.input_entries.items() if e not in st.state.inputs}
    inputs[st.slot_entry] = np.array([0] + [0] * BATCH, np.int64)
    st.run(dict(inputs))
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        st.run(dict(inputs))
        best = min(best, time.perf_counter() - t)
    st.close()
    return best * 1e3


def run(contexts: tuple[int, int], repeat: int, work: Path) -> dict:
    from tvmpipe.compiler.decoders import KvOptions
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    times: dict[str, dict[str, float]] = {"static": {}, "paged": {}}
    for t in contexts:
        for kv in ("static", "paged"):
            out = work / f"{kv}_{t}"
            export("llama", decode=t, batch=BATCH, seed=1, progress=Progress(stream=None),
                   kv=KvOptions("paged", page_size=PAGE) if kv == "paged" else "static").write(out, overwrite=True)
            times[kv][str(t)] = step_ms(out, repeat)
            print(f"{kv:6s} T = {t:5d}: {times[kv][str(t)]:.2f} ms a step ({HELD} tokens held a row)", flush=True)
    lo, hi = (str(c) for c in contexts)
    ratio = {kv: times[kv][hi] / times[kv][lo] for kv in times}
    print(f"T = {hi} over T = {lo}: paged {ratio['paged']:.2f}x (target <= {TARGET}), static {ratio['static']:.2f}x")
    return {"what": "decode step time against tokens held, reference backend, Stage with resident state",
            "model": "llama (tiny: 2 layers, 2 KV heads x 16)", "batch": BATCH, "page_size": PAGE,
            "tokens_held": HELD, "repeat": repeat, "step_ms": times, "ratio": ratio,
            "target": TARGET, "met": ratio["paged"] <= TARGET}


def _steps(core, watch=None) -> None:
    while core.has_work:
        core.step()
        if watch is not None:
            watch()


def _stage_rss(pipe) -> int:
    """The resident bytes of the pipeline's stage process (VmRSS)."""
    from tvmpipe.generation.engine import stage_info

    pid = stage_info(pipe)[0][1]
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def prefix_ttft(work: Path) -> dict:
    from tvmpipe.cluster import Pipeline
    from tvmpipe.compiler.decoders import KvOptions
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.generation import Request, layout_of
    from tvmpipe.generation.core import EngineCore

    system = [(7 * i) % 120 + 4 for i in range(200)]
    prompts = [system + [100 + j, 3] for j in range(8)]
    out: dict = {"system_tokens": len(system), "requests": len(prompts), "new_tokens": 8, "max_context": 256}
    tokens = {}
    for kv in ("static", "paged"):
        path = work / f"ttft_{kv}"
        export("llama", decode=256, batch=BATCH, seed=1, progress=Progress(stream=None),
               kv=KvOptions("paged", page_size=PAGE) if kv == "paged" else "static").write(path, overwrite=True)
        with Pipeline(path, 1, launcher="process", logits=False) as pipe:
            layout = layout_of(pipe.bundle)
            core = EngineCore(pipe, results={})
            core.add(Request.checked(prompts[0], 8, layout), 0)
            _steps(core)
            shared = [0]
            pool = core.scheduler.pool
            for i, p in enumerate(prompts[1:], 1):
                core.add(Request.checked(p, 8, layout), i)
            _steps(core, (lambda: shared.append(pool.stats().kv_pages_shared)) if pool is not None else None)
            results = core.scheduler.results
        ttft = [results[i].first_token_s * 1e3 for i in range(len(prompts))]
        rest = float(np.median(ttft[1:]))
        out[kv] = {"ttft_first_ms": ttft[0], "ttft_rest_median_ms": rest, "first_over_rest": ttft[0] / rest}
        if pool is not None:
            out[kv].update(pages_shared_max=max(shared), prefix_hit_tokens=pool.stats().kv_prefix_hit_tokens)
        tokens[kv] = [results[i].tokens for i in range(len(prompts))]
        print(f"prefix TTFT, {kv}: first {ttft[0]:.0f} ms, the 7 after it {rest:.0f} ms (median): "
              f"{ttft[0] / rest:.1f}x" + (f", {max(shared)} pages shared" if pool is not None else ""), flush=True)
    out["same_tokens"] = tokens["static"] == tokens["paged"]
    out["target_first_over_rest"] = 3.0
    out["met"] = out["same_tokens"] and out["paged"]["first_over_rest"] >= 3.0
    return out


def capacity(work: Path) -> dict:
    from tvmpipe.bundle.dtypes import np_dtype
    from tvmpipe.cluster import Pipeline
    from tvmpipe.compiler.decoders import KvOptions
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.generation import Request, layout_of
    from tvmpipe.generation.core import EngineCore

    t, pool, new = 2048, 2048, 32
    prompts = [[(11 * i + 5 * j) % 120 + 4 for j in range(8)] for i in range(16)]
    out: dict = {"max_context": t, "batch": BATCH, "pool_tokens": pool, "requests": len(prompts),
                 "prompt_tokens": 8, "new_tokens": new}
    tokens = {}
    for kv in ("static", "paged"):
        path = work / f"cap_{kv}"
        export("llama", decode=t, batch=BATCH, seed=1, progress=Progress(stream=None),
               kv=KvOptions("paged", page_size=PAGE) if kv == "paged" else "static").write(path, overwrite=True)
        with Pipeline(path, 1, launcher="process", logits=False, kv_tokens=pool if kv == "paged" else None) as pipe:
            layout = layout_of(pipe.bundle)
            core = EngineCore(pipe, results={})
            for i, p in enumerate(prompts):
                core.add(Request.checked(p, new, layout, key=i), i)
            busy = [0]
            _steps(core, lambda: busy.append(core.scheduler.running))
            rows = pipe.slots * BATCH
            rss = _stage_rss(pipe)
            g = pipe.bundle.graph
            state = sum(int(np.prod(g.entry_of(p.input).shape)) * np.dtype(np_dtype(g.entry_of(p.input).dtype)).itemsize
                        for p in pipe.bundle.state)
            tokens[kv] = [core.scheduler.results[i].tokens for i in range(len(prompts))]
        held = state if kv == "paged" else state * pipe.slots  # the pool once; static caches a slot each
        out[kv] = {"rows": rows, "rows_busy_max": max(busy), "kv_bytes": held, "stage_rss_bytes": rss}
        print(f"capacity, {kv}: {rows} rows, at most {max(busy)} busy at once; KV {held / 2**20:.1f} MiB, "
              f"the stage's RSS {rss / 2**20:.0f} MiB", flush=True)
    out["paged"]["compiled_pool_tokens"] = BATCH * t  # the pool compiled in, every row at the max context
    out["server"] = served_capacity(work / "cap_paged", prompts, new, pool, tokens["static"])
    out["same_tokens"] = tokens["static"] == tokens["paged"] and out["server"]["same_tokens"]
    out["target_rows_busy"] = BATCH
    out["met"] = out["same_tokens"] and min(out["paged"]["rows_busy_max"], out["server"]["rows_busy_max"]) >= BATCH
    return out


def served_capacity(path: Path, prompts: list[list[int]], new: int, pool: int, want: list[list[int]]) -> dict:
    """`tvmpipe serve PATH --kv-tokens POOL` (one stage, local processes): every prompt streamed at
    once, /metrics polled while they run for the rows busy; the texts against `want`, the pool and
    the stage process's resident memory after the run."""
    import asyncio
    import os
    import threading

    import httpx

    from tests.serve.harness import MODEL, ServerProcess, metric, sse_events, stage_pids, streamed_tokens

    log = Path(os.environ.get("TMPDIR", "/tmp")) / "tvmpipe-bench-kv-serve.log"
    srv = ServerProcess(path, "--stages", "1", "--processes", "--kv-tokens", str(pool), log_path=log)
    busy, done = [0], threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while not done.is_set():
                running = next(float(line.split()[-1]) for line in c.get("/metrics").text.splitlines()
                               if line.startswith("tvmpipe_requests_running"))
                busy[0] = max(busy[0], int(running))
                time.sleep(0.01)

    async def one(c: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": new, "stream": True, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            return streamed_tokens(sse_events([line async for line in r.aiter_lines()]))

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    try:
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        runs = asyncio.run(run())
        wall = time.perf_counter() - t0
        done.set()
        watcher.join(30)
        m = srv.metrics()
        pid = stage_pids(m)[0]
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        result = {"rows": int(metric(m, "tvmpipe_rows")), "rows_busy_max": busy[0],
                  "kv_tokens_total": int(metric(m, "tvmpipe_kv_tokens_total", stage=0)),
                  "same_tokens": runs == want, "wall_s": wall, "stage_rss_bytes": rss}
    finally:
        done.set()
        status = srv.stop()
    if status != 0:
        raise RuntimeError(f"the server exited with status {status}:\n{srv.log()[-2000:]}")
    print(f"capacity, served with --kv-tokens {pool}: {result['rows']} rows, at most {result['rows_busy_max']} busy at "
          f"once; pool {result['kv_tokens_total']} tokens; same tokens: {result['same_tokens']}; the stage's RSS "
          f"{rss / 2**20:.0f} MiB", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 64 and 256, fewer repeats")
    ap.add_argument("--repeat", type=int, default=None, help="runs timed a step (best taken; default 60, quick 5)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/kv.json unless --quick)")
    args = ap.parse_args()
    contexts = (HELD, 256) if args.quick else (HELD, 2048)
    repeat = args.repeat or (5 if args.quick else 60)
    with tempfile.TemporaryDirectory(prefix="tvmpipe-kv-") as work:
        result = run(contexts, repeat, Path(work))
        if not args.quick:
            result["prefix_ttft"] = prefix_ttft(Path(work))
            result["capacity"] = capacity(Path(work))
    out = args.out or (None if args.quick else ROOT / "bench" / "results" / "kv.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(stamp(result), indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
