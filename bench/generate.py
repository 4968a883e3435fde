"""Generation over stateful pipeline stages: tokens/s against sequences in flight and stage count.

    python bench/generate.py [--quick] [--bundle DIR] [--out bench/results/generate.json]

The decode step is the tiny 2-layer GPT-style fixture (tests/support/decode_bundle.py, compiled once
into --bundle, default a cache directory under /tmp) run on the *simulated* backend, whose stages
take a fixed time per micro-batch: every op node of stage s is given 1/n of the stage time, so each
stage takes exactly `stage_ms` (1 ms and 0.1 ms). Each micro-batch is one decode step of one
sequence; prompts are one token long, so every step yields one token.

For K = 1..4 stages (stage processes, no Ray) and S = 1, K, 2K sequences in flight:
- tokens/s over the whole run, against the ideal 1/(slowest stage) = 1/stage_ms;
- time to first token (admission -> first token) and inter-token latency, p50 and p99;
- bytes moved per token on every hop (the workers' and the driver's byte counters, frame headers
  included), and the largest of them against the smallest cache entry: no cache byte may cross.
Target: with S >= K and 1 ms stages, tokens/s >= 0.85 x 1/(slowest stage).

The driver's cost per token, with zero-time stages so that it is the whole cost: its CPU against
the sequences in flight (S = 16, 256, 1024: `driver_scaling`; target: the most within 1.5x of the
fewest), and against the stages (K = 1, 2, 4 at S = 8: `driver_by_stages`): its frames per token
(target: one a step, whatever K) and its CPU per token.

Also, side by side in one run on this CPU (tokens/s):
- the fixture: the single-process reference loop (GraphRunner, caches fed by hand) against the same
  model's greedy loop in torch eager;
- published decoders (GPT-2, Llama; the zoo's tiny configs, seeded weights, `tvmpipe compile NAME
  --decode`): the single-process reference loop against transformers' own `generate(do_sample=False)`
  in torch on the same weights and prompts, with their tokens compared.
Static batches (`static_batches`): GPT-2's decode step (the zoo's tiny config, `--decode --batch B`)
compiled at B = 1, 2, 4 and run as K = 2 stage processes on the reference backend, 16 prompts of
1-3 tokens, 24 new tokens each, every slot in use: tokens/s per B, two alternating rounds, and
each B's tokens against B = 1's (greedy: the same streams). Row admission (`row_admission`): the
batch-4 step on prompts of 1-24 tokens, a queued prompt taking each row as its sequence finishes
against admitting a group's rows together: tokens/s and micro-batches of each, alternating.
Chunked prefill (`chunked_prefill`): GPT-2's step compiled with --chunk 8 against --chunk 1, 40-token
prompts: time to first token, inter-token latency, tokens/s and micro-batches of each, alternating.
Writes bench/results/generate.json.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stamp import stamp  # noqa: E402  (when, commit, machine: bench/perfpage.py reads them)

TARGET = 0.85


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def stage_profile(bundle, plan, stage_ms: float) -> dict:
    """A cost profile (simulated backend) giving every stage of `plan` exactly `stage_ms`."""
    g = bundle.graph
    nodes = []
    for s, e in plan.stages:
        ops = [n for n in range(s, e) if g.nodes[n].is_op]
        for n in ops:
            nodes.append({"node": n, "name": g.nodes[n].name, "time_us": stage_ms * 1000.0 / len(ops)})
    return {"nodes": nodes}


def trip(first_seq: int, record, submit_times: dict, done_times: dict, fed_from: dict | None = None) -> dict:
    """Where one step's time goes, in microseconds (means over the run's steps from `first_seq`):
    `stage` (each stage's compute), `i->i+1` (stage i ends -> stage i+1 starts, queueing behind
    another step included), `last->driver` (the last stage ends -> its outputs are complete at the
    driver), and for the two ways a step gets its token:
    - fed back by the sampling stage (`fed_from`: step -> the micro-batch whose draw it takes;
      generation/scheduler.py): `feedback` (the last stage ends that micro-batch -> stage 0 starts
      this step). Its cycle is the stages, the hops and the feedback hop: the driver is off it.
    - fed by the driver: `driver->0` (submitted -> stage 0 starts) and `driver turnaround` (an output
      in -> the driver submits the next step). Its cycle also has last->driver.
    `fed_back` is the share of steps fed back; `cycle` is the cycle of the way most steps took. With
    S = K and no queueing, tokens/s is S / cycle."""
    ev = [{e.seq: (e.start, e.end) for e in w.events if e.seq >= first_seq} for w in record.worker_stats]
    steps = sorted(set.intersection(*(set(e) for e in ev)) & set(submit_times) & set(done_times))
    if not steps:
        return {}

    def mean_us(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs) * 1e6, 1) if xs else None

    last_end = {e.seq: e.end for e in record.worker_stats[-1].events}  # a step may take an earlier run's draw
    fed = {q: m for q, m in (fed_from or {}).items() if q in ev[0] and m in last_end}
    out = {"driver->0": mean_us([ev[0][q][0] - submit_times[q] for q in steps if q not in fed]),
           "stage": [mean_us([e[q][1] - e[q][0] for q in steps]) for e in ev]}
    for i in range(len(ev) - 1):
        out[f"{i}->{i + 1}"] = mean_us([ev[i + 1][q][0] - ev[i][q][1] for q in steps])
    out["last->driver"] = mean_us([done_times[q] - ev[-1][q][1] for q in steps])
    subs = sorted(submit_times.values())
    turn = []
    for q in steps:  # the first submission after this output arrived
        i = bisect.bisect_left(subs, done_times[q])
        if i < len(subs):
            turn.append(subs[i] - done_times[q])
    out["driver turnaround"] = mean_us(turn)
    out["feedback"] = mean_us([ev[0][q][0] - last_end[m] for q, m in fed.items() if q in steps])
    out["fed_back"] = round(sum(q in fed for q in steps) / len(steps), 3)
    ring = sum(out["stage"]) + sum(out[f"{i}->{i + 1}"] for i in range(len(ev) - 1))
    legs = ("feedback",) if out["fed_back"] > 0.5 else ("driver->0", "last->driver", "driver turnaround")
    out["cycle"] = round(ring + sum(out[key] or 0.0 for key in legs), 1)
    return out


def measure(bundle_dir: Path, k: int, stage_ms: float, tokens: int) -> list[dict]:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator
    from tvmpipe.partition import checked_plan

    b = load_bundle(bundle_dir)
    plan = checked_plan(b, k)
    gen = b.generation
    per_seq = gen.max_context - 1
    rows = []
    with Pipeline(b, plan, backend="simulated", backend_opts={"cost_profile": stage_profile(b, plan, stage_ms)},
                  launcher="process", slots=2 * k, window=2 * k, logits=False) as pipe:  # as `tvmpipe generate`
        Generator(pipe).generate_all([[1]] * k, 2)  # warm: every slot's state allocated, links up
        for s in sorted({1, k, 2 * k}):
            n_seq = max(s, -(-tokens // per_seq))
            prompts = [[i % gen.vocab_size] for i in range(n_seq)]
            before = pipe.record()
            before_seq = pipe.submitted
            t0 = time.perf_counter()
            generator = Generator(pipe)
            res = generator.generate_all(prompts, per_seq, in_flight=s)
            wall = time.perf_counter() - t0
            after = pipe.record()
            path = trip(before_seq, after, pipe.submit_times, pipe.done_times, generator.scheduler.fed_from)
            made = sum(len(r.tokens) for r in res)
            steps = made  # one-token prompts: every step yields a token
            ttft = [r.first_token_s * 1e3 for r in res]
            itl = [(b2 - a2) * 1e3 for r in res for a2, b2 in zip(r.token_times, r.token_times[1:])]
            hops = {}
            for i, (w0, w1) in enumerate(zip(before.worker_stats, after.worker_stats)):
                for dst, n in w1.bytes_out.items():
                    hops[f"{i}->{'driver' if dst == -1 else dst}"] = (n - w0.bytes_out.get(dst, 0)) / steps
            for dst, n in after.driver_bytes_out.items():
                hops[f"driver->{dst}"] = (n - before.driver_bytes_out.get(dst, 0)) / steps
            ideal = 1000.0 / stage_ms
            busy = []  # per stage: time computing / wall (1.0: never waiting for input)
            took = []  # per stage: mean wall time of one step as measured (a loaded machine stretches the nominal)
            for w in after.worker_stats:
                spans = [e for e in w.events if e.seq >= before_seq]
                busy.append(round(sum(e.end - e.start for e in spans) / wall, 3))
                took.append(sum(e.end - e.start for e in spans) / max(len(spans), 1) * 1e3)
            rows.append({
                "stage_ms": stage_ms, "stages": k, "in_flight": s, "sequences": n_seq, "tokens": made,
                "wall_s": round(wall, 4), "tokens_per_s": round(made / wall, 1), "ideal_tokens_per_s": ideal,
                "fraction_of_ideal": round(made / wall / ideal, 3), "stage_busy": busy,
                "measured_stage_ms": [round(t, 3) for t in took],
                "fraction_of_measured_slowest": round(made / wall * max(took) / 1000.0, 3),
                "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
                "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99),
                "bytes_per_token_per_hop": {h: round(v, 1) for h, v in sorted(hops.items())},
                "max_hop_bytes_per_token": round(max(hops.values()), 1),
                "smallest_cache_entry_bytes": min(b.graph.entry_of(p.input).nbytes for p in b.state),
                "cache_bytes_per_slot": b.state_bytes_per_slot,
                "step_path_us": path,
            })
            r = rows[-1]
            print(f"  {stage_ms:g} ms x K={k} S={s:>2}: {r['tokens_per_s']:8.1f} tok/s ({r['fraction_of_ideal']:.2f} "
                  f"of ideal), TTFT p50 {r['ttft_ms_p50']:.2f} ms, ITL p50 {r['itl_ms_p50']:.2f} p99 "
                  f"{r['itl_ms_p99']:.2f} ms, max hop {r['max_hop_bytes_per_token']:.0f} B/token, stages busy "
                  f"{r['stage_busy']}, step {max(took):.2f} ms measured ({r['fraction_of_measured_slowest']:.2f} of "
                  f"1/measured)", flush=True)
            if s == k and path:
                hops = ", ".join(f"{key} {v:.0f}" for key, v in path.items()
                                 if key not in ("stage", "cycle", "fed_back") and v is not None)
                print(f"    one step's trip (us, means): stages {[round(x) for x in path['stage']]}, {hops}; "
                      f"{path['fed_back']:.0%} of steps fed back by the last stage; a sequence's "
                      f"cycle {path['cycle'] / 1e3:.2f} ms -> S/cycle = {s / path['cycle'] * 1e6:.0f} tok/s", flush=True)
    return rows


def single_process(bundle_dir: Path, tokens: int) -> dict:
    """The reference backend's single-process loop against torch eager's, same model, same prompts."""
    from tests.support.decode_bundle import runner_greedy, torch_greedy
    from tvmpipe.bundle import load_bundle

    b = load_bundle(bundle_dir)
    per = b.generation.max_context - 1
    n = max(1, tokens // per)
    t0 = time.perf_counter()
    ref = [runner_greedy(b, [i], per)[0] for i in range(n)]
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    eager = [torch_greedy([i], per)[0] for i in range(n)]
    t_eager = time.perf_counter() - t0
    made = n * per
    return {"tokens": made, "reference_loop_tokens_per_s": round(made / t_ref, 1),
            "torch_eager_tokens_per_s": round(made / t_eager, 1), "same_tokens": ref == eager}


DRIVER_S = (16, 256, 1024)  # sequences in flight for the driver's cost per token
DRIVER_GROWTH = 1.5  # target: the driver's CPU per token at the most sequences, against the fewest


def _driver_run(b, k: int, s: int, window: int, tokens: int) -> tuple[float, float, int, int]:
    """One measured generation on K zero-time stages with S sequences in flight: the driver's CPU
    per token (us; the generation loop, sampling, frames, all its threads), tokens/s, tokens made,
    and the frames the driver sent during it."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator
    from tvmpipe.partition import checked_plan

    plan = checked_plan(b, k)
    per = b.generation.max_context - 1
    with Pipeline(b, plan, backend="simulated", backend_opts={"cost_profile": stage_profile(b, plan, 0.0)},
                  launcher="process", slots=s, window=window, logits=False) as pipe:
        Generator(pipe).generate_all([[1]] * 4, 2)  # warm
        frames0 = sum(pipe.record().driver_frames_out.values())
        n = max(s, -(-tokens // per))
        t0, c0 = time.perf_counter(), time.process_time()
        res = Generator(pipe).generate_all([[i % b.generation.vocab_size] for i in range(n)], per, in_flight=s)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        frames = sum(pipe.record().driver_frames_out.values()) - frames0
    made = sum(len(x.tokens) for x in res)
    return round(cpu / made * 1e6, 1), round(made / wall, 1), made, frames


def _alternating(values: tuple[int, ...], repeat: int, run) -> dict[int, list]:
    """`run(v)` for every value, `repeat` rounds, the order reversed every round (16, 256, 1024,
    1024, 256, 16, ...): a drift of the machine during the rounds falls on every value alike."""
    runs: dict[int, list] = {v: [] for v in values}
    for r in range(repeat):
        for v in (values if r % 2 == 0 else values[::-1]):
            runs[v].append(run(v))
    return runs


def driver_scaling(bundle_dir: Path, tokens: int, repeat: int = 3) -> list[dict]:
    """The driver's CPU per generated token against the sequences in flight, with one stage of zero
    time so that the driver is the whole cost. It should not grow with S: each step's bookkeeping is
    O(1) in the sequences.

    Each S runs `repeat` times (_alternating), and each row is the median of its runs (all kept in
    `runs_us_per_token`): on the 2-core VM runs of the same S and code spread by up to 1.6x
    (S = 1024: 129-208 us a token on 2026-11-27), so one run per S read the noise as growth or its
    absence (1.06x-1.99x)."""
    import statistics

    from tvmpipe.bundle import load_bundle

    b = load_bundle(bundle_dir)

    def run(s: int) -> tuple:
        out = _driver_run(b, 1, s, s, tokens)
        print(f"driver, S={s:>4}: {out[0]} us of driver CPU per token, {out[1]} tok/s (one zero-time stage)",
              flush=True)
        return out

    runs = _alternating(DRIVER_S, repeat, run)
    return [{"in_flight": s, "tokens": runs[s][0][2],
             "driver_cpu_us_per_token": statistics.median(x[0] for x in runs[s]),
             "tokens_per_s": statistics.median(x[1] for x in runs[s]),
             "runs_us_per_token": [x[0] for x in runs[s]]} for s in DRIVER_S]


DRIVER_K = (1, 2, 4)  # stages, for the driver's cost per token against K
DRIVER_K_S = 8  # sequences in flight there (the window holds two steps of each: feedback on)


def driver_by_stages(bundle_dir: Path, tokens: int, repeat: int = 3) -> list[dict]:
    """The driver's CPU per generated token against the number of stages, zero-time stages and
    S = DRIVER_K_S at every K, so that only K changes. It should not grow with K: the driver sends
    one frame a step to the first stage (the per-step inputs go along the chain, topology.
    relay_inputs) and takes one from the last; its frames per token are counted over the measured
    run only. Rounds as in driver_scaling. Its CPU per token still grows with K on a small machine:
    a cProfile at K = 1 and 4 (2026-11-27, 2 cores) counted the same calls per token, each one
    20-80% slower with five processes on two cores than with two (sendmsg 10 -> 18 us)."""
    import statistics

    from tvmpipe.bundle import load_bundle

    b = load_bundle(bundle_dir)
    s = DRIVER_K_S

    def run(k: int) -> tuple:
        out = _driver_run(b, k, s, 2 * s, tokens)
        print(f"driver, K={k}, S={s}: {out[0]} us of driver CPU per token, {out[1]} tok/s (zero-time stages)",
              flush=True)
        return out

    runs = _alternating(DRIVER_K, repeat, run)
    return [{"stages": k, "in_flight": s, "tokens": runs[k][0][2],
             "driver_cpu_us_per_token": statistics.median(x[0] for x in runs[k]),
             "tokens_per_s": statistics.median(x[1] for x in runs[k]),
             "runs_us_per_token": [x[0] for x in runs[k]],
             "driver_frames_per_token": round(max(x[3] / x[2] for x in runs[k]), 3)} for k in DRIVER_K]


HF_DECODERS = ("gpt2", "llama")
HF_SEED = 1  # the token-exact tests' seed: seed 0's GPT-2 and Llama repeat one token
HF_MAX_CONTEXT = 64


def transformers_side_by_side(cache: Path, prompts: int) -> list[dict]:
    """Per decoder: the reference loop's tokens/s against transformers' `generate` on the same
    random weights, prompts of 4 tokens, max context - 4 new tokens each; tokens compared."""
    from tests.support.decode_bundle import runner_greedy
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import build_decoder, transformers_generate
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    out = []
    rng = __import__("random").Random(0)
    for name in HF_DECODERS:
        bdir = cache / f"{name}-T{HF_MAX_CONTEXT}-s{HF_SEED}-paged"  # the default layout
        if not (bdir / "bundle.json").is_file():
            export(name, progress=Progress(stream=None), decode=HF_MAX_CONTEXT, seed=HF_SEED).write(bdir)
        b = load_bundle(bdir)
        model = build_decoder(name, HF_SEED)
        vocab = b.generation.vocab_size
        ps = [[rng.randrange(vocab) for _ in range(4)] for _ in range(prompts)]
        new = HF_MAX_CONTEXT - 4
        transformers_generate(model, ps[0], 2)  # warm: first-call costs out of the timing
        runner_greedy(b, ps[0], 2)
        t0 = time.perf_counter()
        ref = [runner_greedy(b, p, new)[0] for p in ps]
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf = [transformers_generate(model, p, new) for p in ps]
        t_hf = time.perf_counter() - t0
        made = prompts * new
        out.append({"decoder": name, "max_context": HF_MAX_CONTEXT, "sequences": prompts, "tokens": made,
                    "reference_loop_tokens_per_s": round(made / t_ref, 1),
                    "transformers_generate_tokens_per_s": round(made / t_hf, 1),
                    "same_tokens": ref == hf})
        r = out[-1]
        print(f"{name}: reference loop {r['reference_loop_tokens_per_s']} tok/s, transformers generate "
              f"{r['transformers_generate_tokens_per_s']} tok/s, same tokens: {r['same_tokens']}", flush=True)
    return out


BATCHES = (1, 2, 4)


def batch_bundle(cache: Path, b: int, chunk: int = 1) -> Path:
    """GPT-2's decode step at batch `b` (the zoo's tiny config), up to `chunk` tokens a row a step,
    with static caches (`--kv static`: the static batches' slots and row resets are what these
    benches measure), compiled once under `cache`."""
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    out = cache / (f"gpt2-T{HF_MAX_CONTEXT}-s{HF_SEED}-b{b}" + (f"-c{chunk}" if chunk > 1 else "") + "-static")
    if not (out / "bundle.json").is_file():
        export("gpt2", progress=Progress(stream=None), decode=HF_MAX_CONTEXT, seed=HF_SEED, batch=b,
               chunk=chunk, kv="static").write(out)
    return out


CHUNK = 8


def chunked_prefill(cache: Path, rounds: int = 2, k: int = 2, prompt: int = 40, new: int = 16) -> dict:
    """Chunked prefill against a token a step: GPT-2's step compiled with --chunk 1 and --chunk 8,
    K processes on the reference backend, 8 prompts of `prompt` tokens x `new` tokens, four in
    flight. Per mode (alternating, per round): time to first token p50 (from admission), the
    inter-token latency p50 after it, tokens/s over the run, and micro-batches; the same tokens."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    prompts = [[(11 * i + 3 * j) % 128 for j in range(prompt)] for i in range(8)]
    runs: dict[int, list[dict]] = {1: [], CHUNK: []}
    tokens: dict[int, list[list[int]]] = {}
    for r in range(rounds):
        for c in ((1, CHUNK) if r % 2 == 0 else (CHUNK, 1)):
            with Pipeline(batch_bundle(cache, 1, c), k, launcher="process", logits=False, slots=4) as pipe:
                Generator(pipe).generate_all(prompts[:4], 2)  # warm
                first = pipe.submitted
                t0 = time.perf_counter()
                res = Generator(pipe).generate_all(prompts, new, in_flight=4)
                wall = time.perf_counter() - t0
                steps = pipe.submitted - first
            tokens[c] = [x.tokens for x in res]
            itl = [b - a for x in res for a, b in zip(x.token_times, x.token_times[1:])]
            runs[c].append({"ttft_ms_p50": round(1e3 * pct([x.first_token_s for x in res], 0.5), 1),
                            "itl_ms_p50": round(1e3 * pct(itl, 0.5), 2),
                            "tokens_per_s": round(sum(len(t) for t in tokens[c]) / wall, 1), "micro_batches": steps})
    out = {"stages": k, "prompt_tokens": prompt, "new_tokens": new, "sequences": len(prompts), "in_flight": 4,
           "chunk": CHUNK, "runs": {str(c): v for c, v in runs.items()}, "same_tokens": tokens[1] == tokens[CHUNK]}
    for c in (1, CHUNK):
        print(f"chunked prefill: GPT-2 decode, K={k}, prompts of {prompt} tokens, chunk {c}: "
              + "; ".join(f"TTFT p50 {x['ttft_ms_p50']} ms, ITL p50 {x['itl_ms_p50']} ms, {x['tokens_per_s']} tok/s, "
                          f"{x['micro_batches']} micro-batches" for x in runs[c]), flush=True)
    print(f"chunked prefill: same tokens: {out['same_tokens']}", flush=True)
    return out


def row_admission(cache: Path, rounds: int = 2, k: int = 2, b: int = 4, new: int = 16) -> dict:
    """Per-row admission against admitting a group's rows together, on 32 prompts of mixed lengths
    (1-24 tokens, so sequences take 16-39 steps): GPT-2's step at batch `b`, K processes on the
    reference backend, K slots (a group each: K x b sequences in flight, the rest queued).
    Tokens/s and micro-batches per mode (alternating, per round), and whether both give the same
    tokens."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    lengths = [1, 12, 3, 24, 6, 2, 18, 9, 1, 15, 4, 21, 7, 2, 11, 5]
    prompts = [[(5 * i + j) % 128 for j in range(n)] for i, n in enumerate(lengths + lengths[::-1])]
    runs: dict[bool, list[float]] = {True: [], False: []}
    steps: dict[bool, int] = {}
    tokens: dict[bool, list[list[int]]] = {}
    for r in range(rounds):
        for per_row in ((True, False) if r % 2 == 0 else (False, True)):
            with Pipeline(batch_bundle(cache, b), k, launcher="process", logits=False, slots=k) as pipe:
                Generator(pipe).generate_all(prompts[:pipe.slots * b], 2)  # warm: every slot allocated, links up
                first = pipe.submitted
                t0 = time.perf_counter()
                res = Generator(pipe).generate_all(prompts, new, row_admission=per_row)
                wall = time.perf_counter() - t0
                steps[per_row] = pipe.submitted - first
                slots = pipe.slots
            tokens[per_row] = [x.tokens for x in res]
            runs[per_row].append(sum(len(t) for t in tokens[per_row]) / wall)
    out = {"batch": b, "stages": k, "slots": slots, "prompt_lengths": lengths, "new_tokens": new,
           "per_row_tokens_per_s_runs": [round(x, 1) for x in runs[True]],
           "per_group_tokens_per_s_runs": [round(x, 1) for x in runs[False]],
           "per_row_micro_batches": steps[True], "per_group_micro_batches": steps[False],
           "same_tokens": tokens[True] == tokens[False]}
    print(f"row admission: GPT-2 decode batch {b}, K={k}, {slots} slots, prompts of 1-24 tokens: per row "
          f"{out['per_row_tokens_per_s_runs']} tok/s in {steps[True]} micro-batches, per group "
          f"{out['per_group_tokens_per_s_runs']} tok/s in {steps[False]}; same tokens: {out['same_tokens']}", flush=True)
    return out


def static_batches(cache: Path, rounds: int = 2, k: int = 2, new: int = 24) -> dict:
    """GPT-2's decode step at batch 1, 2 and 4 as K processes on the reference backend: tokens/s
    (per round, alternating B) and whether every batch gives B = 1's tokens."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator

    prompts = [[(7 * i + j) % 128 for j in range(1 + i % 3)] for i in range(16)]
    dirs = {b: batch_bundle(cache, b) for b in BATCHES}
    runs: dict[int, list[float]] = {b: [] for b in BATCHES}
    tokens: dict[int, list[list[int]]] = {}
    for r in range(rounds):
        for b in (BATCHES if r % 2 == 0 else BATCHES[::-1]):
            with Pipeline(dirs[b], k, launcher="process", logits=False) as pipe:
                Generator(pipe).generate_all(prompts[:pipe.slots * b], 2)  # warm: every slot allocated, links up
                t0 = time.perf_counter()
                res = Generator(pipe).generate_all(prompts, new)
                wall = time.perf_counter() - t0
            tokens[b] = [x.tokens for x in res]
            runs[b].append(sum(len(t) for t in tokens[b]) / wall)
    rows = [{"batch": b, "stages": k, "sequences": len(prompts), "new_tokens": new,
             "tokens_per_s_runs": [round(x, 1) for x in runs[b]], "tokens_per_s": round(max(runs[b]), 1),
             "same_tokens_as_batch_1": tokens[b] == tokens[1]} for b in BATCHES]
    for row in rows:
        print(f"static batch {row['batch']}: GPT-2 decode, K={k}, reference backend: {row['tokens_per_s_runs']} "
              f"tok/s ({row['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x batch 1), same tokens as batch 1: "
              f"{row['same_tokens_as_batch_1']}", flush=True)
    return {"decoder": "gpt2", "max_context": HF_MAX_CONTEXT, "backend": "reference", "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens per point")
    ap.add_argument("--bundle", type=Path, default=Path("/tmp/tvmpipe-bench-decode"),
                    help="where the decode fixture is compiled (reused when present)")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "generate.json")
    ap.add_argument("--no-published", action="store_true",
                    help="skip the published decoders (the side by side with transformers and the static batches: they "
                         "compile with TVM, and the GPU host of bench/gpu_check.sh has no TVM; --bundle must then "
                         "hold the compiled fixture)")
    args = ap.parse_args()
    from tests.support.decode_bundle import decode_bundle

    bundle_dir = decode_bundle(args.bundle)
    rows = []
    for stage_ms, tokens in ((1.0, 150 if args.quick else 600), (0.1, 300 if args.quick else 1500)):
        for k in [int(x) for x in args.stages.split(",")]:
            rows += measure(bundle_dir, k, stage_ms, tokens)
    drv = driver_scaling(bundle_dir, 2000 if args.quick else 8000, 2 if args.quick else 3)
    growth = drv[-1]["driver_cpu_us_per_token"] / drv[0]["driver_cpu_us_per_token"]
    by_k = driver_by_stages(bundle_dir, 1000 if args.quick else 4000, 2 if args.quick else 3)
    growth_k = by_k[-1]["driver_cpu_us_per_token"] / by_k[0]["driver_cpu_us_per_token"]
    sp = single_process(bundle_dir, 60 if args.quick else 300)
    print(f"single process: reference loop {sp['reference_loop_tokens_per_s']} tok/s, torch eager "
          f"{sp['torch_eager_tokens_per_s']} tok/s, same tokens: {sp['same_tokens']}")
    hf_cache = args.bundle.parent / (args.bundle.name + "-hf")
    hf = [] if args.no_published else transformers_side_by_side(hf_cache, 2 if args.quick else 6)
    batches = None if args.no_published else static_batches(hf_cache, 1 if args.quick else 2)
    rows_in = None if args.no_published else row_admission(hf_cache, 1 if args.quick else 2)
    chunked = None if args.no_published else chunked_prefill(hf_cache, 1 if args.quick else 2)
    checked = [r for r in rows if r["stage_ms"] == 1.0 and r["in_flight"] >= r["stages"]]
    ok_rate = all(r["fraction_of_ideal"] >= TARGET for r in checked)
    ok_bytes = all(r["max_hop_bytes_per_token"] < r["smallest_cache_entry_bytes"] for r in rows)
    for r in checked:
        print(f"target S>=K, 1 ms, K={r['stages']} S={r['in_flight']}: {r['fraction_of_ideal']:.3f} of ideal "
              f"(>= {TARGET}): {'PASS' if r['fraction_of_ideal'] >= TARGET else 'FAIL'}; "
              f"{r['fraction_of_measured_slowest']:.3f} of 1/(slowest stage as measured)")
    print(f"no cache bytes on the data plane (every hop < one cache entry per token): {'PASS' if ok_bytes else 'FAIL'}")
    print(f"driver CPU per token at S={DRIVER_S[-1]} against S={DRIVER_S[0]} (medians): {growth:.2f}x (<= {DRIVER_GROWTH}): "
          f"{'PASS' if growth <= DRIVER_GROWTH else 'FAIL'}")
    frames_k = [r["driver_frames_per_token"] for r in by_k]
    print(f"driver frames per token at K={', '.join(map(str, DRIVER_K))} (one a step, whatever K): {frames_k}: "
          f"{'PASS' if max(frames_k) <= 1.0 else 'FAIL'}; driver CPU per token at K={DRIVER_K[-1]} against "
          f"K={DRIVER_K[0]} (S={DRIVER_K_S}, medians): {growth_k:.2f}x (the same calls per token; each one slower "
          f"with more processes on these {os.cpu_count()} cores)")
    doc = {"bench": "generate", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                            "python": platform.python_version(),
                                            "load_average_at_end": os.getloadavg()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": args.quick,
           "target": {"fraction_of_ideal": TARGET, "met": ok_rate, "no_cache_bytes": ok_bytes},
           "rows": rows, "driver_scaling": {"rows": drv, "growth": round(growth, 3), "target": DRIVER_GROWTH},
           "driver_by_stages": {"rows": by_k, "cpu_growth": round(growth_k, 3),
                                "frames_per_token_at_most_one": max(frames_k) <= 1.0},
           "single_process": sp, "transformers": hf, "static_batches": batches, "row_admission": rows_in,
           "chunked_prefill": chunked}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp(doc), indent=1) + "\n")
    print(f"wrote {args.out}")
    same_batches = batches is None or all(r["same_tokens_as_batch_1"] for r in batches["rows"])
    same_batches = same_batches and (rows_in is None or rows_in["same_tokens"]) \
        and (chunked is None or chunked["same_tokens"])
    return 0 if ok_bytes and all(r["same_tokens"] for r in hf) and sp["same_tokens"] and same_batches else 1


if __name__ == "__main__":
    sys.exit(main())
