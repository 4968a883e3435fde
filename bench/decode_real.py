"""Decode at real model sizes on one GPU (docs/gpu-validation.md, step `decode_real`; issue 47): tokens/s
against the memory-bandwidth floor and against transformers on the same GPU.

    python bench/decode_real.py [REAL] [--work DIR] [--stages 1,2] [--sequences 8] [--prompt 2] [--new 8]
                                [--out bench/results/decode_real.json] [--require-gpu]

REAL (default .gpu/bundles/real) holds bench/real_bundles.py's decode-step bundles: per model
(SmolLM-135M's and TinyLlama-1.1B's Llama configurations, float16) one bundle per max context T and
batch B, compiled without their weights, and the model's config.json. In one call, on GPU 0:

  * weights: each bundle is copied under --work with its weights written (real_bundles.materialize:
    weight matrices generated, seeded by name; the compiled constants);
  * floor: device-to-device copy bandwidth (cuMemcpyDtoDAsync of --copy-mib, CUDA events), counted
    as bytes read + bytes written per second; a step's floor is the bytes it must read, weights +
    the KV cache of the positions in use (mean over the run's steps), over that bandwidth
    (`floor_step_ms`); `static_floor_step_ms` counts the whole static cache instead (what a step
    over the full T reads at least);
  * tokens/s: for each bundle and K in --stages (K > 1 on the smallest T), a pipeline of K cuda
    stage processes (caches resident on the device, CUDA IPC between stages, each stage's step a
    CUDA graph replayed: backend_opts graphs=True) generates --new tokens after --prompt prompt
    tokens for --sequences x B sequences (every sequence --prompt + --new tokens long, the same
    sequences at every T), with S = 1 and S = K micro-batches in flight: tokens/s, decode steps/s,
    ms a step, its fraction of the floor (`floor_fraction`: floor ms / measured ms);
  * where a step's time goes: the per-kernel profile of one step (GraphRunner.profile, CUDA events
    between kernels, so the sum runs over the replayed step) mapped to graph nodes and split into
    matmuls (a node reading a weight matrix), attention (nodes reading the updated caches, their
    expansion for grouped-query attention, scores, softmax, the value product), cache update (the
    nodes writing a state output) and the rest; launches per step; the nodes with the most time over
    their own bytes' floor (`over_floor`), the kernels to look at when a step is far from it;
  * cost against the static context: ms a step at the largest T over the smallest, same model,
    batch and sequences (target <= 1.2x);
  * transformers: `generate(do_sample=False)` of the model's configuration (its own random init:
    the same sizes, so the same work per token, not the same tokens) in float16 on the same GPU,
    eager torch (`attn_implementation` sdpa and eager), the same prompts and number of new tokens,
    one sequence or one batch at a time; a plain torch loop over the same modules if generate fails;
  * tokens: K = 1 against K > 1 (identical: the same kernels), batch B against batch 1 and the
    largest T against the smallest (same weights; fp16 sums over other shapes may flip a near tie),
    and the cuda tokens of the first --reference-sequences sequences against the reference backend's
    (NumPy, one process; fp16 rounding differs from the kernels'): each as the number of sequences
    whose tokens differ and the first differing position, with the reference's logit gap between
    its token and the cuda token there (a near tie when small).

int4 (issue 52; only where bench/real_bundles.py prepared `<model>-int4` bundles, its
`--quantize-models`): the same runs of each model's `--quantize int4` decode steps (int4 codes and
float16 scales kept packed, unpacked inside the matmul kernels; their weights generated as codes 0
and random scales), and `int4_over_fp16`: their tokens/s over the float16 bundle's at the same
context and batch (target >= 2.5x at the largest model, batch 1; reported).

Targets (reported, not enforced; `verdicts`): the largest model's (1.1B) batch-1 step >= 50 % of
the floor at K = 1; tokens/s >= 2x transformers' (sdpa) at every batch (K = 1, smallest T); T
largest <= 1.2x T smallest. Exit status 1 when the tokens differ between K or between S in flight
(the same kernels and weights: identical), or a part failed (its `errors`; the other parts still
run), else 0; batch and T differences are reported, not enforced (other shapes sum in another
order, and random weights make near ties). With --budget-s, bundles not started in time are listed
in `not_run` and `complete` is false. Runs on the fake PyCUDA too (tests put tests/fakecuda first
on PYTHONPATH with REAL in FAKE_PYCUDA_BUNDLES): numbers then mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gate import add_require_gpu, no_gpu_exit, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"floor_fraction": 0.5, "over_transformers": 2.0, "largest_over_smallest_context": 1.2}
QUANT_SUFFIX = "-int4"  # bench/real_bundles.py: OUT/<model>-int4 holds the model's --quantize int4 steps
INT4_TARGET = 2.5  # issue 52: int4 over fp16 tokens/s, the largest model at batch 1
CATEGORIES = ("matmul", "attention", "cache_update", "rest")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("real", nargs="?", default=str(ROOT / ".gpu" / "bundles" / "real"),
                    help="bench/real_bundles.py's bundles (default: .gpu/bundles/real, from bench/gpu_prep.sh)")
    ap.add_argument("--work", default=None, help="where the bundles with weights go (default: a temporary directory)")
    ap.add_argument("--models", default=None, help="comma-separated models of REAL (default: all)")
    ap.add_argument("--stages", default="1,2", help="K values; K > 1 runs on each model's smallest T")
    ap.add_argument("--sequences", type=int, default=8, help="micro-batches of sequences per run (x the bundle's batch)")
    ap.add_argument("--prompt", type=int, default=2, help="prompt tokens a sequence")
    ap.add_argument("--new", type=int, default=8, help="tokens generated a sequence")
    ap.add_argument("--reference-sequences", type=int, default=1,
                    help="sequences whose cuda tokens are compared with the reference backend's (batch 1, smallest T)")
    ap.add_argument("--reference-max-s", type=float, default=40.0,
                    help="seconds a model's reference run may take (NumPy: a 1.1B step takes seconds); tokens "
                         "compared as far as it got")
    ap.add_argument("--copy-mib", type=int, default=1024, help="buffer of the device-to-device copy")
    ap.add_argument("--profile-repeat", type=int, default=5)
    ap.add_argument("--transformers", choices=["auto", "off"], default="auto",
                    help="auto: run transformers where torch and transformers import")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop starting bundles, the reference or transformers after this many seconds (0: no limit); "
                         "what ran is written, with complete false")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_real.json"))
    add_require_gpu(ap)
    args = ap.parse_args(argv)
    if (status := no_gpu_exit("decode_real", args.require_gpu)) is not None:
        return status
    # gpu_check.sh's timeout sends SIGTERM: unwind, so that the stage processes are closed and
    # what ran is written (an orphaned stage would hold the GPU and the kit's log pipe open)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    sys.path.insert(0, str(ROOT))
    from real_bundles import bundles_in, materialize

    real = Path(args.real)
    found = bundles_in(real) if real.is_dir() else {}
    if args.models:
        found = {m: found[m] for m in args.models.split(",") if m in found}
    if not found:
        print(f"decode_real: no bundles in {real} (run bench/gpu_prep.sh, carry .gpu)", file=sys.stderr)
        return 1
    work = Path(args.work or tempfile.mkdtemp(prefix="tvmpipe-decode-real-"))
    stages = [int(x) for x in args.stages.split(",")]
    doc: dict[str, Any] = {"real": str(real), "prompt_tokens": args.prompt, "new_tokens": args.new,
                           "sequence_tokens": args.prompt + args.new, "targets": TARGETS, "complete": False,
                           "weights": "generated from seed 0 by name (real_bundles.materialize), the compiled "
                                      "constants kept; transformers: its own random init of the same configuration "
                                      "(same sizes, same work per token, not the same tokens)",
                           "models": {}}
    t0 = time.perf_counter()

    def save() -> None:
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        write_result(args.out, doc)

    def time_left(what: str) -> bool:
        if not args.budget_s or time.perf_counter() - t0 < args.budget_s:
            return True
        doc.setdefault("not_run", []).append(what)
        print(f"[decode_real] no time left for {what}", flush=True)
        return False

    # weights on this host, then every kernels.cu compiled at once (nvcc is single-threaded)
    t = time.perf_counter()
    ready: dict[str, dict[tuple[int, int], Path]] = {}
    for model, combos in found.items():
        cache: dict = {}
        ready[model] = {tb: materialize(src, work / model / src.name, cache) for tb, src in sorted(combos.items())}
        del cache
    doc["materialize_s"] = round(time.perf_counter() - t, 1)
    doc["device"], doc["nvcc_s"] = precompile([p for m in ready.values() for p in m.values()])
    doc["copy"] = copy_bandwidth(args.copy_mib)
    bw = doc["copy"]["gbps"] * 1e9
    print(f"[decode_real] {doc['device']}: weights written in {doc['materialize_s']} s, kernels compiled in "
          f"{doc['nvcc_s']} s, device copy {doc['copy']['gbps']:.0f} GB/s (read + write)", flush=True)
    save()
    ok = True
    if args.transformers != "off":  # first: the user's alternative, whatever the budget leaves for the rest
        ok = transformers_side(args, real, ready, doc)
        save()
    exact = True
    for model, combos in ready.items():
        m = doc["models"][model] = {"config": json.loads((real / model / "config.json").read_text()), "bundles": {}}
        exact = run_model(args, model, combos, stages, bw, m, save, time_left) and exact
        vs_transformers(doc, model)
        save()
    doc["verdicts"] = verdicts(doc)
    doc["int4_over_fp16"] = int4_over_fp16(doc)
    doc["all_exact"], doc["complete"] = exact, "not_run" not in doc
    save()
    print(f"[decode_real] wrote {args.out} in {doc['wall_s']} s; verdicts: {json.dumps(doc['verdicts'])}")
    return 0 if exact and ok else 1


# ---- device facts ---------------------------------------------------------------------------------

def precompile(bundles: list[Path]) -> tuple[str, float]:
    """(GPU 0's name, seconds): every bundle's kernels.cu through nvcc at once, into the cubin
    cache the stage processes read (executor/cubin.py), so no stage waits on nvcc."""
    from concurrent.futures import ThreadPoolExecutor

    import pycuda.driver as cuda

    from tvmpipe.executor.cubin import compile_cubin

    cuda.init()
    dev = cuda.Device(0)
    arch = "sm_{}{}".format(*dev.compute_capability())
    t = time.perf_counter()
    sources = {(p / "kernels.cu").read_text() for p in bundles}
    with ThreadPoolExecutor(min(len(sources), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda s: compile_cubin(s, arch), sources))
    return dev.name(), round(time.perf_counter() - t, 1)


def copy_bandwidth(mib: int, repeat: int = 20) -> dict:
    """Device-to-device copy of `mib` MiB on GPU 0, `repeat` times between two CUDA events:
    bytes read + written per second (the bandwidth a step's reads are held to), best of 3."""
    from tvmpipe.executor.backend_cuda import PyCudaDevice

    n = mib << 20
    dev = PyCudaDevice()
    try:
        with dev.current():
            src, dst = dev.alloc(n), dev.alloc(n)
            dev.copy(dst, src, n)
            dev.synchronize()
            best = 0.0
            for _ in range(3):
                e0 = dev.record()
                for _ in range(repeat):
                    dev.copy(dst, src, n)
                e1 = dev.record()
                dev.synchronize()
                best = max(best, 2 * n * repeat / dev.elapsed(e0, e1))
    finally:
        dev.close()
    return {"mib": mib, "repeat": repeat, "gbps": round(best / 1e9, 1), "counted": "bytes read + bytes written"}


# ---- one model ------------------------------------------------------------------------------------

def sig(x: float) -> float:
    """`x` to 4 significant figures (floors of microseconds and steps of milliseconds alike)."""
    return float(f"{x:.4g}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """How two runs' tokens of the same sequences differ: sequences that differ, first positions."""
    firsts = [first_difference(g, w) for g, w in zip(got, want)]
    return {"sequences": len(got), "differ": sum(f is not None for f in firsts),
            "first_difference": [f for f in firsts if f is not None]}


def run_model(args, model: str, combos: dict[tuple[int, int], Path], stages: list[int], bw: float, m: dict,
              save, time_left) -> bool:
    """Every bundle of `model`: pipelines, profile, tokens; rows into m["bundles"]. True when
    the tokens of different K are identical and every part ran (a failed part is recorded as
    `errors` of its bundle and the others still run)."""
    from tvmpipe.bundle import load_bundle

    smallest = min(t for t, _ in combos)
    vocab = load_bundle(next(iter(combos.values()))).generation.vocab_size
    rng = random.Random(0)
    longest = max(b for _, b in combos) * args.sequences
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(longest)]
    exact = True
    tokens: dict[tuple[int, int], list[list[int]]] = {}
    for (t_ctx, batch), path in sorted(combos.items(), key=lambda x: (x[0][1], x[0][0])):
        name = f"T{t_ctx}_b{batch}"
        if not time_left(f"{model} {name}"):
            continue
        b = load_bundle(path)
        rec = m["bundles"][name] = bundle_facts(b, args.prompt, args.new, bw)
        mine = prompts[:batch * args.sequences]
        rec["runs"] = []
        for k in [k for k in stages if k == 1 or t_ctx == smallest]:
            try:
                runs, toks = pipeline_runs(b, k, mine, args.new, rec)
            except Exception as exc:  # noqa: BLE001 - one failed run is reported; the others still run
                rec.setdefault("errors", []).append(f"K = {k}: {type(exc).__name__}: {exc}"[:2000])
                print(f"[decode_real] {model} {name} K = {k} failed: {exc}", flush=True)
                exact = False
                continue
            rec["runs"] += runs
            exact = exact and all(r.get("same_tokens_as_in_flight_1", True) for r in runs)
            if (t_ctx, batch) in tokens:
                same = toks == tokens[t_ctx, batch]
                rec[f"same_tokens_k{k}_as_k1"] = same
                exact = exact and same
            else:
                tokens[t_ctx, batch] = toks
            save()
        try:
            rec["profile"] = profile(b, args.profile_repeat, bw)
        except Exception as exc:  # noqa: BLE001
            rec.setdefault("errors", []).append(f"profile: {type(exc).__name__}: {exc}"[:2000])
            exact = False
        print(f"[decode_real] {model} {name}: {json.dumps(rec)}", flush=True)
        if batch != 1 and (t_ctx, 1) in tokens:  # a sequence's tokens must not depend on its batch
            n = len(tokens[t_ctx, 1])
            rec["tokens_vs_batch_1"] = compare(tokens[t_ctx, batch][:n], tokens[t_ctx, 1])
        if t_ctx != smallest and (smallest, batch) in tokens:
            rec["tokens_vs_smallest_context"] = compare(tokens[t_ctx, batch], tokens[smallest, batch])
        save()
    if (smallest, 1) in tokens and args.reference_sequences > 0 and time_left(f"{model} reference"):
        try:
            m["reference"] = reference_tokens(combos[smallest, 1], prompts[:args.reference_sequences], args.new,
                                              tokens[smallest, 1][:args.reference_sequences], args.reference_max_s)
        except Exception as exc:  # noqa: BLE001
            m["reference"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            exact = False
    m["context_cost"] = context_cost(m["bundles"])
    return exact


def bundle_facts(b, prompt: int, new: int, bw: float) -> dict:
    """Sizes and floors of a decode-step bundle running sequences of `prompt` + `new` tokens."""
    gen = b.generation
    cache = b.state_bytes_per_slot
    per_position = cache / gen.max_context
    steps = prompt + new - 1
    live = per_position * sum(p + 1 for p in range(steps)) / steps  # mean cache bytes in use a step
    w = b.weight_bytes
    return {"max_context": gen.max_context, "batch": b.graph.entry_of(gen.token).shape[0],
            "weight_bytes": w, "cache_bytes": cache, "live_cache_bytes_mean": round(live),
            "floor_step_ms": sig((w + live) / bw * 1e3), "static_floor_step_ms": sig((w + cache) / bw * 1e3)}


def pipeline_runs(b, k: int, prompts: list[list[int]], new: int, rec: dict) -> tuple[list[dict], list[list[int]]]:
    """K cuda stage processes with graph replay, caches on the device: S = 1 and S = K micro-batches
    in flight over the same prompts. The rows, and the tokens of the S = 1 run."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    batch = rec["batch"]
    flights = sorted({1, k})
    rows, first = [], None
    t = time.perf_counter()
    with Pipeline(b, k, backend="cuda", backend_opts={"graphs": True}, launcher="process", slots=max(flights),
                  logits=False) as pipe:
        Generator(pipe).generate_all(prompts[:batch * max(flights)], 2, in_flight=max(flights))  # warm: graphs captured
        start = round(time.perf_counter() - t, 1)
        for s in flights:
            seq0 = pipe.submitted
            t = time.perf_counter()
            res = Generator(pipe).generate_all(prompts, new, in_flight=s)
            wall = time.perf_counter() - t
            after = pipe.record()
            steps = pipe.submitted - seq0
            made = sum(len(r.tokens) for r in res)
            step_ms = wall / steps * 1e3
            itl = [(y - x) * 1e3 for r in res for x, y in zip(r.token_times, r.token_times[1:])]
            row = {"stages": k, "in_flight": s, "sequences": len(prompts), "tokens": made, "steps": steps,
                   "tokens_per_s": round(made / wall, 1), "steps_per_s": round(steps / wall, 1),
                   "step_ms": sig(step_ms), "floor_fraction": sig(rec["floor_step_ms"] / step_ms),
                   "static_floor_fraction": sig(rec["static_floor_step_ms"] / step_ms),
                   "itl_ms_p50": round(statistics.median(itl), 3) if itl else None,
                   "state_bytes_per_stage": [w.state_bytes for w in after.worker_stats],
                   "edge_paths": sorted(set(pipe.edge_paths().values())), "start_s": start}
            if first is None:
                first = [r.tokens for r in res]
            else:
                row["same_tokens_as_in_flight_1"] = [r.tokens for r in res] == first
            rows.append(row)
    return rows, first or []


# ---- where a step's time goes ---------------------------------------------------------------------

def node_categories(b) -> dict[int, str]:
    """Graph node -> matmul / attention / cache_update / rest (see the module docstring). A node
    writing a state output (through `__nop` views) updates the cache; a node reading the updated
    caches or what was computed from them, and no weight matrix, is attention; a node with a weight
    matrix input and a matmul is a matmul."""
    g = b.graph
    targets = {g.head_entries[p.output] for p in b.state}
    changed = True
    while changed:  # a state output made by a view of another entry: that entry is written too
        changed = False
        for nid in g.op_nodes:
            n = g.nodes[nid]
            if n.is_nop and set(g.node_entry_ids(nid)) & targets and not set(g.input_entry_ids(nid)) <= targets:
                targets |= set(g.input_entry_ids(nid))
                changed = True
    params = set(b.param_names)
    weights = {g.entry_id(i) for i in g.null_nodes if g.nodes[i].name in params and len(g.entry_of(i).shape) >= 2}
    derived, out = set(targets), {}
    for nid in g.op_nodes:
        n = g.nodes[nid]
        ins, outs = g.input_entry_ids(nid), list(g.node_entry_ids(nid))
        if n.is_nop:
            if derived & set(ins):
                derived |= set(outs)
            continue
        ops = b.ops[n.func_name].op_names if n.func_name in b.ops else []
        if set(outs) & targets:
            out[nid] = "cache_update"
        elif derived & set(ins) and not weights & set(ins):
            out[nid] = "attention"
            derived |= set(outs)
        elif weights & set(ins) and "matmul" in ops:
            out[nid] = "matmul"
        else:
            out[nid] = "rest"
    return out


def profile(b, repeat: int, bw: float) -> dict:
    """One decode step's per-kernel profile (cuda, one process; caches fed from the host, as the
    profile's events leave host copies out) at position 8, split by node category."""
    from tvmpipe.executor.decode_loop import DecodeLoop

    loop = DecodeLoop(b, backend="cuda")
    try:
        rows = loop.batch
        for tok in range(8):
            loop.step([tok % b.generation.vocab_size] * rows)
        prof = loop.runner.profile(repeat=repeat)
    finally:
        loop.runner.close()
    cats = node_categories(b)
    g = b.graph
    by: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    launches = copies = 0
    nodes = []
    for n in prof.nodes:
        us = sum(k.time_us for k in n.kernels)
        by[cats.get(n.node, "rest")] += us
        launches += sum(k.kernel != "__copy" for k in n.kernels)
        copies += sum(k.kernel == "__copy" for k in n.kernels)
        if n.kernels:
            moved = sum(g.entries[e].nbytes for e in set(g.input_entry_ids(n.node)) | set(g.node_entry_ids(n.node)))
            ideal = moved / bw * 1e6
            nodes.append({"node": n.name, "category": cats.get(n.node, "rest"), "ops": ",".join(n.ops)[:120],
                          "us": round(us, 2), "floor_us": round(ideal, 2), "over_floor_us": round(us - ideal, 2)})
    total = sum(by.values())
    nodes.sort(key=lambda x: -x["over_floor_us"])
    return {"repeat": repeat, "kernel_sum_us": round(total, 1), "launches_per_step": launches,
            "nodes": {c: sum(x == c for x in cats.values()) for c in CATEGORIES},
            "copies_per_step": copies, "us": {c: round(v, 1) for c, v in by.items()},
            "fraction": {c: round(v / total, 4) if total else None for c, v in by.items()},
            "over_floor": nodes[:8]}


def context_cost(bundles: dict[str, dict]) -> list[dict]:
    """Per batch: ms a step (K = 1, one micro-batch in flight) at the largest T over the smallest."""
    out = []
    by_batch: dict[int, dict[int, float]] = {}
    for rec in bundles.values():
        for r in rec.get("runs", []):
            if r["stages"] == 1 and r["in_flight"] == 1:
                by_batch.setdefault(rec["batch"], {})[rec["max_context"]] = r["step_ms"]
    for batch, ms in sorted(by_batch.items()):
        if len(ms) > 1:
            lo, hi = min(ms), max(ms)
            out.append({"batch": batch, "contexts": [lo, hi], "step_ms": [ms[lo], ms[hi]],
                        "ratio": round(ms[hi] / ms[lo], 3), "target": TARGETS["largest_over_smallest_context"],
                        "met": ms[hi] / ms[lo] <= TARGETS["largest_over_smallest_context"]})
    return out


# ---- tokens against the reference backend --------------------------------------------------------

def reference_tokens(path: Path, prompts: list[list[int]], new: int, cuda_tokens: list[list[int]],
                     max_s: float) -> dict:
    """The reference backend's greedy tokens (NumPy, one process: executor.decode_loop.DecodeLoop,
    argmax of each step's logits) of `prompts` against the cuda pipeline's, each sequence cut short
    once `max_s` seconds have passed (a 1.1B step takes seconds there); at a first difference, the
    reference logits' gap between its token and the cuda one (a near tie when small)."""
    import numpy as np

    from tvmpipe.executor.decode_loop import DecodeLoop

    t = time.perf_counter()
    loop = DecodeLoop(path)
    seqs, steps = [], 0
    for p, got in zip(prompts, cuda_tokens):
        loop.reset()
        for tok in p:
            logits = loop.step([tok])[0]
            steps += 1
        want, gaps = [], []
        while len(want) < new:
            nxt = int(np.argmax(logits))
            want.append(nxt)
            if len(want) <= len(got) and got[len(want) - 1] != nxt:
                gaps.append(float(logits[nxt]) - float(logits[got[len(want) - 1]]))
            if len(want) == new or time.perf_counter() - t > max_s:
                break
            logits = loop.step([nxt])[0]
            steps += 1
        f = first_difference(got[:len(want)], want)
        row: dict[str, Any] = {"reference": want, "cuda": got, "first_difference": f}
        if f is not None:
            row["reference_logit_gap"] = round(gaps[0], 5)
            row["reference_logit_scale"] = round(float(np.abs(np.asarray(logits, dtype=np.float64)).max()), 3)
        seqs.append(row)
        if time.perf_counter() - t > max_s:
            break
    loop.runner.close()
    s = time.perf_counter() - t
    return {"sequences": seqs, "differ": sum(x["first_difference"] is not None for x in seqs), "seconds": round(s, 1),
            "steps": steps, "ms_per_step": round(s / max(steps, 1) * 1e3, 1), "max_s": max_s,
            "compared": "greedy tokens of the same bundle and weights, as far as the reference got in max_s: the "
                        "reference backend (NumPy, fp16 operands, float32 matmul sums) against the cuda pipeline "
                        "at K = 1; a sequence counts as differing from its first differing token on"}


# ---- transformers on the same GPU ----------------------------------------------------------------

HF = r"""
import json, sys, time
from tvmpipe.compiler.zoo import ensure_torchvision
ensure_torchvision()
import torch, transformers
spec = json.loads(sys.argv[1])
dev = "cuda" if torch.cuda.is_available() else "cpu"
def sync():
    if dev == "cuda":
        torch.cuda.synchronize()
out = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
       "transformers": transformers.__version__, "models": {}}
for model, m in spec.items():
    cfg = transformers.AutoConfig.from_pretrained(m["config"], local_files_only=True)
    torch.manual_seed(0)
    rows = []
    for impl in ("sdpa", "eager"):
        with torch.device(dev):
            net = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl,
                                                                dtype=torch.float16).eval()
        for batch in m["batches"]:
            groups = [m["prompts"][i:i + batch] for i in range(0, batch * m["sequences"], batch)]
            kw = dict(do_sample=False, max_new_tokens=m["new"], min_new_tokens=m["new"], pad_token_id=0,
                      eos_token_id=None)
            how = "generate"
            def run(ids):
                global how
                if how == "generate":
                    try:
                        return net.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                    except Exception as exc:  # the same modules, stepped by hand
                        how = f"loop ({type(exc).__name__}: {exc})"[:200]
                cache, x, out_ids = transformers.DynamicCache(), ids, ids
                for _ in range(m["new"]):
                    logits = net(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1]
                    x = logits.argmax(-1, keepdim=True)
                    out_ids = torch.cat([out_ids, x], 1)
                return out_ids
            with torch.no_grad():
                run(torch.tensor(groups[0], device=dev))  # warm
                sync()
                t = time.perf_counter()
                made = 0
                for g in groups:
                    ids = torch.tensor(g, device=dev)
                    made += (run(ids).shape[1] - ids.shape[1]) * ids.shape[0]
                sync()
                wall = time.perf_counter() - t
            rows.append({"attn_implementation": impl, "batch": batch, "sequences": batch * len(groups),
                         "tokens": made, "tokens_per_s": round(made / wall, 1), "how": how})
        del net
        if dev == "cuda":
            torch.cuda.empty_cache()
    out["models"][model] = rows
print(json.dumps(out))
"""


def transformers_side(args, real: Path, ready: dict[str, dict[tuple[int, int], Path]], doc: dict) -> bool:
    """transformers' generate on the same GPU for every model and batch of `ready`, the same prompts
    (run_model draws them from the same seed) and new tokens, in a subprocess (torch's CUDA context
    apart from the stages'); into doc["transformers"]. False when it failed."""
    spec = {}
    for model, combos in ready.items():
        if model.endswith(QUANT_SUFFIX):  # the base model's configuration, measured once under its own name
            continue
        vocab = json.loads((real / model / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        batches = sorted({b for _, b in combos})
        n = max(batches) * args.sequences
        spec[model] = {"config": str(real / model), "batches": batches, "sequences": args.sequences, "new": args.new,
                       "prompts": [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(n)]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", HF, json.dumps(spec)], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        doc["transformers"] = {"error": (r.stderr or r.stdout)[-2000:]}
        print(f"[decode_real] transformers failed: {doc['transformers']['error']}", flush=True)
        return False
    doc["transformers"] = json.loads(r.stdout.strip().splitlines()[-1])
    doc["transformers"]["seconds"] = round(time.perf_counter() - t, 1)
    print(f"[decode_real] transformers: {json.dumps(doc['transformers'])}", flush=True)
    return True


def vs_transformers(doc: dict, model: str) -> None:
    """`model`'s tokens/s (K = 1, one micro-batch in flight, smallest T) over transformers' at each
    batch and attention implementation: doc["models"][model]["vs_transformers"]."""
    m = doc["models"][model]
    hf = (doc.get("transformers") or {}).get("models", {}).get(model, [])
    if not hf or not m["bundles"]:
        return
    smallest = min(x["max_context"] for x in m["bundles"].values())
    m["vs_transformers"] = []
    for rec in m["bundles"].values():
        ours = next((r for r in rec["runs"] if r["stages"] == 1 and r["in_flight"] == 1), None)
        if rec["max_context"] != smallest or ours is None:
            continue
        for h in hf:
            if h["batch"] == rec["batch"]:
                m["vs_transformers"].append({"batch": rec["batch"], "attn_implementation": h["attn_implementation"],
                                             "tokens_per_s": ours["tokens_per_s"],
                                             "transformers_tokens_per_s": h["tokens_per_s"],
                                             "ratio": round(ours["tokens_per_s"] / h["tokens_per_s"], 3)})


def int4_over_fp16(doc: dict) -> dict | None:
    """Issue 52: each `<model>-int4` bundle's tokens/s (K = 1, one micro-batch in flight) over the
    float16 bundle of the same model, context and batch; the target (>= INT4_TARGET) is judged on
    the largest model's batch-1 rows. None when no int4 bundle ran."""
    rows = []
    for model, m in doc["models"].items():
        base = doc["models"].get(model[: -len(QUANT_SUFFIX)]) if model.endswith(QUANT_SUFFIX) else None
        if base is None:
            continue
        for name, rec in m["bundles"].items():
            other = base["bundles"].get(name)
            q = next((r for r in rec.get("runs", []) if r["stages"] == 1 and r["in_flight"] == 1), None)
            f = next((r for r in (other or {}).get("runs", []) if r["stages"] == 1 and r["in_flight"] == 1), None)
            if q and f and f["tokens_per_s"] > 0:
                rows.append({"model": model[: -len(QUANT_SUFFIX)], "bundle": name, "batch": rec["batch"],
                             "max_context": rec["max_context"], "int4_tokens_per_s": q["tokens_per_s"],
                             "fp16_tokens_per_s": f["tokens_per_s"], "int4_weight_bytes": rec["weight_bytes"],
                             "fp16_weight_bytes": other["weight_bytes"],
                             "ratio": round(q["tokens_per_s"] / f["tokens_per_s"], 3)})
    if not rows:
        return None
    largest = max(rows, key=lambda r: r["fp16_weight_bytes"])["model"]
    judged = [r for r in rows if r["model"] == largest and r["batch"] == 1]
    return {"rows": rows, "target": INT4_TARGET, "judged_on": largest,
            "met": all(r["ratio"] >= INT4_TARGET for r in judged) if judged else None}


def verdicts(doc: dict) -> dict:
    """The three targets, each with the figures it was judged on (None: not measured). The floor
    target is judged on the largest model (the 1.1B in the kit) at batch 1, K = 1, smallest T."""
    floor = None
    if doc["models"]:
        model = max(doc["models"], key=lambda m: max(r["weight_bytes"] for r in doc["models"][m]["bundles"].values()))
        b1 = [r for r in doc["models"][model]["bundles"].values() if r["batch"] == 1]
        rec = min(b1, key=lambda r: r["max_context"]) if b1 else None
        run = next((r for r in rec["runs"] if r["stages"] == 1 and r["in_flight"] == 1), None) if rec else None
        if run:
            floor = {"model": model, "max_context": rec["max_context"], "fraction": run["floor_fraction"],
                     "target": TARGETS["floor_fraction"], "met": run["floor_fraction"] >= TARGETS["floor_fraction"]}
    vs = [dict(x, model=m) for m, d in doc["models"].items() for x in d.get("vs_transformers", [])]
    sdpa = [x for x in vs if x["attn_implementation"] == "sdpa"]
    over = {"rows": vs, "target": TARGETS["over_transformers"],
            "met": all(x["ratio"] >= TARGETS["over_transformers"] for x in sdpa)} if sdpa else None
    ctx = [dict(x, model=m) for m, d in doc["models"].items() for x in d.get("context_cost", [])]
    return {"floor": floor, "over_transformers": over,
            "context_cost": {"rows": ctx, "target": TARGETS["largest_over_smallest_context"],
                             "met": all(x["met"] for x in ctx)} if ctx else None}


if __name__ == "__main__":
    sys.exit(main())
