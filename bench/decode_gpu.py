"""A decode pipeline on the GPU (docs/gpu-validation.md, step `decode`): KV caches resident on the
device, the reference's tokens, tokens/s against stages and sequences in flight.

    python bench/decode_gpu.py [BUNDLE] [--stages 1,2] [--in-flight 1,2,4] [--new 24]
                               [--batch-bundle BATCHED] [--chunk-bundle CHUNKED]
                               [--out bench/results/decode_gpu.json]

BUNDLE is a decode-step bundle (`tvmpipe compile gpt2 --decode --max-context 64`, carried by
bench/gpu_prep.sh). The oracle is the single-process greedy loop on the reference backend
(tests/support/decode_bundle.runner_greedy: caches fed by hand). For each K, a pipeline of K cuda
stage processes on GPU 0 (hops between them: CUDA IPC) runs every S of --in-flight: 2S prompts
of 4 tokens, --new tokens each, greedy. Per (K, S): whether every sequence's tokens equal the
oracle's, generated tokens/s and decode steps/s over the whole run, inter-token latency p50, and the
largest bytes per step on any hop against one slot's cache bytes (state never crosses: it must be
far below). With --batch-bundle (the same decoder compiled with `--batch B`, B > 1: static batches,
B sequences a micro-batch), for each K that bundle runs the same 2 x max(--in-flight) prompts with
every sequence in flight: its tokens against the reference backend's run of it and, for the same
model, against BUNDLE's oracle (a sequence's tokens must not depend on its batch), and tokens/s
beside the batch-1 rows (`batch` in each row); then one slot of it on the most stages with prompts
of 1-6 tokens, a queued prompt taking each row as it frees (one row of the device caches reset
while the others run on: `row_admission` in its row), against the reference backend's tokens.
With --chunk-bundle (the same decoder compiled with `--chunk C`), for each K, 8 prompts of up to
32 tokens go through BUNDLE and through the chunked step side by side: time to first token and
inter-token latency p50, tokens/s, micro-batches (`chunk` in each row), tokens against the oracle.
Exits 1 if any tokens differ. Runs on the fake PyCUDA too (tests put tests/fakecuda
first on PYTHONPATH, with the bundle in FAKE_PYCUDA_BUNDLES): numbers then mean nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gate import add_require_gpu, no_gpu_exit, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=str(ROOT / ".gpu" / "bundles" / "gpt2_decode"),
                    help="a decode-step bundle (default: .gpu/bundles/gpt2_decode, from bench/gpu_prep.sh)")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--in-flight", default="1,2,4")
    ap.add_argument("--new", type=int, default=24, help="tokens generated per sequence")
    ap.add_argument("--batch-bundle", help="the same decoder compiled with --batch B > 1: run its static batches too")
    ap.add_argument("--chunk-bundle", help="the same decoder compiled with --chunk C > 1: run long prompts through it "
                                           "and through BUNDLE (chunked prefill against a token a step)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_gpu.json"))
    add_require_gpu(ap)
    args = ap.parse_args(argv)
    if (status := no_gpu_exit("decode_gpu", args.require_gpu)) is not None:
        return status
    sys.path.insert(0, str(ROOT))
    from tests.support.decode_bundle import runner_greedy
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    b = load_bundle(args.bundle)
    gen = b.generation
    new = min(args.new, gen.max_context - 4)
    flights = [int(x) for x in args.in_flight.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(gen.vocab_size) for _ in range(4)] for _ in range(2 * max(flights))]
    t = time.perf_counter()
    want = [runner_greedy(b, p, new)[0] for p in prompts]
    print(f"[decode] oracle (reference backend, one process): {len(prompts)} sequences in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    rows, exact = [], True
    for k in [int(x) for x in args.stages.split(",")]:
        with Pipeline(b, k, backend="cuda", launcher="process", slots=max(flights)) as pipe:
            Generator(pipe).generate_all(prompts[:1], 2)  # warm: links up, kernels loaded, slot state allocated
            paths = {f"{s}->{d}": p for (s, d), p in sorted(pipe.edge_paths().items())}
            for s in flights:
                batch = prompts[:2 * s]
                before, seq0 = pipe.record(), pipe.submitted
                t = time.perf_counter()
                res = Generator(pipe).generate_all(batch, new, in_flight=s)
                wall = time.perf_counter() - t
                after = pipe.record()
                steps = pipe.submitted - seq0
                made = sum(len(r.tokens) for r in res)
                same = [r.tokens == want[i] for i, r in enumerate(res)]
                exact = exact and all(same)
                hop = max_hop_bytes(before, after, steps)
                itl = [(y - x) * 1e3 for r in res for x, y in zip(r.token_times, r.token_times[1:])]
                row = {"stages": k, "batch": 1, "in_flight": s, "sequences": len(batch), "tokens": made, "steps": steps,
                       "same_tokens_as_reference": all(same), "tokens_per_s": round(made / wall, 1),
                       "steps_per_s": round(steps / wall, 1), "itl_ms_p50": round(statistics.median(itl), 3) if itl else None,
                       "max_hop_bytes_per_step": round(hop, 1), "cache_bytes_per_slot": b.state_bytes_per_slot,
                       # device bytes of caches each stage holds (one buffer a pair and slot where the
                       # update is written in place: Bundle.state_buffers)
                       "state_bytes_per_stage": [w.state_bytes for w in after.worker_stats],
                       "state_buffers": sorted(set(b.state_buffers.values())), "edge_paths": paths}
                print(f"[decode] {json.dumps(row)}", flush=True)
                rows.append(row)
    if args.batch_bundle:
        exact = static_batches(args, b, prompts, want, new, rows) and exact
    if args.chunk_bundle:
        exact = chunked_prefill(args, b, rows) and exact
    write_result(args.out, {"bundle": str(args.bundle), "model": b.name, "max_context": gen.max_context,
                            "vocab_size": gen.vocab_size, "new_tokens": new, "all_exact": exact, "rows": rows})
    print(f"[decode] wrote {args.out}; tokens equal the reference's: {exact}")
    return 0 if exact else 1


def max_hop_bytes(before, after, steps: int) -> float:
    """The most bytes any stage sent any consumer per step between two run records."""
    return max(((n - w0.bytes_out.get(dst, 0)) / steps for w0, w1 in zip(before.worker_stats, after.worker_stats)
                for dst, n in w1.bytes_out.items()), default=0.0)


def static_batches(args: argparse.Namespace, b, prompts: list[list[int]], want: list[list[int]], new: int,
                   rows: list[dict]) -> bool:
    """The --batch-bundle rows (see the module docstring), appended to `rows`; True when every
    sequence's tokens are the reference's (and BUNDLE's, for the same model)."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    bb = load_bundle(args.batch_bundle)
    with Pipeline(bb, 1, backend="reference", launcher="process") as pipe:
        ref = [r.tokens for r in Generator(pipe).generate_all(prompts, new)]
    same_model = (bb.name, bb.generation.max_context) == (b.name, b.generation.max_context)
    exact = True
    for k in [int(x) for x in args.stages.split(",")]:
        with Pipeline(bb, k, backend="cuda", launcher="process") as pipe:
            batch = pipe.topology.batch
            Generator(pipe).generate_all(prompts[:batch], 2)  # warm
            before, seq0 = pipe.record(), pipe.submitted
            t = time.perf_counter()
            res = [r.tokens for r in Generator(pipe).generate_all(prompts, new)]
            wall = time.perf_counter() - t
            steps = pipe.submitted - seq0
            after = pipe.record()
        hop = max_hop_bytes(before, after, steps)
        made = sum(len(x) for x in res)
        ok = res == ref and (not same_model or res == want)
        exact = exact and ok
        row = {"stages": k, "batch": batch, "in_flight": len(prompts), "sequences": len(prompts), "tokens": made,
               "steps": steps, "same_tokens_as_reference": res == ref,
               "same_tokens_as_batch_1": res == want if same_model else None,
               "tokens_per_s": round(made / wall, 1), "steps_per_s": round(steps / wall, 1),
               "max_hop_bytes_per_step": round(hop, 1), "cache_bytes_per_slot": bb.state_bytes_per_slot,
               "state_bytes_per_stage": [w.state_bytes for w in after.worker_stats]}
        print(f"[decode] {json.dumps(row)}", flush=True)
        rows.append(row)
    return row_admission(args, bb, prompts, new, rows) and exact


def chunked_prefill(args: argparse.Namespace, b, rows: list[dict]) -> bool:
    """The --chunk-bundle rows: 8 prompts of up to 32 tokens (half the context), four in flight,
    through BUNDLE (a token a step; when it is the same model) and through the chunked step, side
    by side on each K: time to first token p50, inter-token latency p50, tokens/s and micro-batches
    (`chunk` in each row); True when every run gives the tokens of the chunked step's
    single-process loop on the reference backend (prompts a chunk at a time there too)."""
    from tests.support.decode_bundle import runner_greedy
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    cb = load_bundle(args.chunk_bundle)
    gen = cb.generation
    same_model = (cb.name, gen.max_context) == (b.name, b.generation.max_context)
    n = min(32, gen.max_context // 2)
    new = min(args.new, gen.max_context - n)
    rng = random.Random(1)
    prompts = [[rng.randrange(gen.vocab_size) for _ in range(n)] for _ in range(8)]
    want = [runner_greedy(cb, p, new)[0] for p in prompts]
    exact = True
    for k in [int(x) for x in args.stages.split(",")]:
        for bundle in ((b, cb) if same_model else (cb,)):
            with Pipeline(bundle, k, backend="cuda", launcher="process", slots=4) as pipe:
                chunk = pipe.topology.chunk
                Generator(pipe).generate_all(prompts[:4], 2)  # warm
                before, seq0 = pipe.record(), pipe.submitted
                t = time.perf_counter()
                res = Generator(pipe).generate_all(prompts, new, in_flight=4)
                wall = time.perf_counter() - t
                steps = pipe.submitted - seq0
                after = pipe.record()
            same = [r.tokens for r in res] == want
            exact = exact and same
            itl = [(y - x) * 1e3 for r in res for x, y in zip(r.token_times, r.token_times[1:])]
            row = {"stages": k, "batch": 1, "chunk": chunk, "in_flight": 4, "sequences": len(prompts),
                   "prompt_tokens": n, "steps": steps, "same_tokens_as_reference": same,
                   "ttft_ms_p50": round(1e3 * statistics.median(r.first_token_s for r in res), 3),
                   "itl_ms_p50": round(statistics.median(itl), 3) if itl else None,
                   "tokens_per_s": round(sum(len(r.tokens) for r in res) / wall, 1),
                   "max_hop_bytes_per_step": round(max_hop_bytes(before, after, steps), 1),
                   "cache_bytes_per_slot": bundle.state_bytes_per_slot}
            print(f"[decode] {json.dumps(row)}", flush=True)
            rows.append(row)
    return exact


def row_admission(args: argparse.Namespace, bb, prompts: list[list[int]], new: int, rows: list[dict]) -> bool:
    """One slot of the batched bundle on the most stages, prompts of 1-6 tokens: rows finish at
    different steps and a queued prompt takes each row as it frees, so a step resets one row of
    the device caches (a copy at the row's offset) while its row-mates' stay. Its tokens against
    the reference backend's run admitting whole groups; the row is appended to `rows`."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    mixed = [p[:1 + i % len(p)] + p[:i % 3] for i, p in enumerate(prompts)]
    with Pipeline(bb, 1, backend="reference", launcher="process", slots=1) as pipe:
        ref = [r.tokens for r in Generator(pipe).generate_all(mixed, new, row_admission=False)]
    k = max(int(x) for x in args.stages.split(","))
    with Pipeline(bb, k, backend="cuda", launcher="process", slots=1) as pipe:
        batch = pipe.topology.batch
        before, seq0 = pipe.record(), pipe.submitted
        res = [r.tokens for r in Generator(pipe).generate_all(mixed, new)]
        steps = pipe.submitted - seq0
        after = pipe.record()
        row_reset = pipe.topology.row_reset
    row = {"stages": k, "batch": batch, "in_flight": batch, "sequences": len(mixed), "row_admission": row_reset,
           "prompt_tokens": [len(p) for p in mixed], "steps": steps, "tokens": sum(len(x) for x in res),
           "same_tokens_as_reference": res == ref, "max_hop_bytes_per_step": round(max_hop_bytes(before, after, steps), 1),
           "cache_bytes_per_slot": bb.state_bytes_per_slot,
           "state_bytes_per_stage": [w.state_bytes for w in after.worker_stats]}
    print(f"[decode] {json.dumps(row)}", flush=True)
    rows.append(row)
    return res == ref


if __name__ == "__main__":
    sys.exit(main())
