"""Writes docs/performance.md from bench/results/*.json: one row per headline figure, its newest
value, its target where there is one, and where the value comes from (date, commit, machine, file).

    python bench/perfpage.py [--check]        (or: make perf-page)

The result files differ in shape (each bench writes its own), so each has an extractor below
(`EXTRACTORS`, matched on the file name) that turns it into rows; a result file no extractor
matches is an error, so a new bench cannot be left off the page. Several files may give the same
metric (a GPU kit run kept beside a later one): the page shows the newest. Provenance comes from
the file's own stamp (bench/stamp.py: `when`, `commit`, `machine`) or its older fields (`time`,
`started`, a per-entry `date`, `device`, a `.h100-580` name); what a file does not say, git does:
the commit that last wrote it and that commit's date. The page holds no clock of its own, so
writing it twice gives the same bytes (tests/bench/test_perfpage.py keeps it current).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"
GIB, MIB = 1 << 30, 1 << 20

# The sections of the page, in order; every row names one of them.
AREAS = ("Data plane", "Compiler", "Big models", "Your own checkpoint", "Executor", "Generation", "Serving", "KV caches",
         "Partition and prediction", "Recovery", "Model zoo", "GPU")

# Result files named <bench>.<machine>[.<label>].json: the machine a suffix stands for.
SUFFIX_MACHINES = {"h100-580": "NVIDIA H100 80GB HBM3", "h200-580": "NVIDIA H200"}


class PerfPageError(Exception):
    """A result file the page cannot be made from; main() prints it as one line."""


@dataclass(frozen=True)
class Row:
    """One figure. `when` overrides the file's date where the file dates each entry itself."""

    area: str
    metric: str
    value: str
    target: str = ""
    met: bool | None = None
    when: str | None = None


@dataclass(frozen=True)
class Provenance:
    when: str  # sortable: YYYY-MM-DD[THH:MM[:SS]], UTC where the source says so
    commit: str  # short hash, "+" when measured with uncommitted changes; "-" when unknown
    machine: str


@dataclass(frozen=True)
class Placed:
    """A row with the file it came from and that file's provenance, as the page prints it."""

    row: Row
    file: str
    prov: Provenance


# ---- number formatting ---------------------------------------------------------------------------

def slash(xs: Iterable[float], spec: str = ".2f") -> str:
    """Values side by side, one per K (or S, or model), in one format."""
    return " / ".join(format(x, spec) for x in xs)


def span(xs: Iterable[float], spec: str = ".0f") -> str:
    """"a-b" over runs, or "a" when they agree to the digits shown."""
    xs = sorted(xs)
    lo, hi = format(xs[0], spec), format(xs[-1], spec)
    return lo if lo == hi else f"{lo}-{hi}"


def pct(x: float) -> str:
    return f"{x:+.1f} %"


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


# ---- extractors: one per kind of result file -----------------------------------------------------

def cluster_bench(d: dict) -> list[Row]:
    """bench/cluster_bench.py: the data plane's hop latency and throughput, shared memory against
    TCP, and a simulated pipeline's efficiency (targets: issue 27 and the bench's own)."""
    rows = []
    if "latency" in d:
        m = d["latency"]["median"]
        hop = m["tvmpipe_per_hop_p50_us"]
        rows += [
            Row("Data plane", "4 KB frames, 4-stage chain of Ray actors: latency per hop, p50",
                f"{hop:.0f} us (stage to stage {m['stage_to_stage_hop_p50_us']:.0f} us)", "<= 40 us (issue 27)",
                hop <= 40),
            Row("Data plane", "the same chain as a raw Python relay (the floor), same rounds",
                f"{m['raw_relay_per_hop_p50_us']:.0f} us per hop"),
            Row("Data plane", "4 KB hop against plain Ray actor calls, same rounds",
                f"{m['speedup_vs_ray_calls']:.1f}x faster ({m['ray_calls_per_hop_p50_us']:.0f} us a hop)", ">= 10x",
                m["speedup_vs_ray_calls"] >= 10),
            Row("Data plane", "4 KB hop against Ray Compiled Graphs, same rounds",
                f"{m['speedup_vs_ray_compiled_graph']:.1f}x faster ({m['ray_compiled_graph_per_hop_p50_us']:.0f} us a hop)",
                ">= 4x", m["speedup_vs_ray_compiled_graph"] >= 4),
            Row("Data plane", "idle stage actor's CPU, the busiest of 4",
                f"{100 * m['idle_cpu_per_stage_max']:.1f} % of a core", "<= 2 %", m["idle_cpu_per_stage_max"] <= 0.02),
        ]
    if "throughput" in d:
        m = d["throughput"]["median"]
        rows += [
            Row("Data plane", "4 MB frames, one hop over TCP loopback",
                f"{m['single_hop_gbps']:.2f} GB/s = {m['single_hop_vs_raw']:.2f}x a raw socket "
                f"({m['raw_socket_gbps']:.2f} GB/s)", ">= 1.2 GB/s and >= 0.65x",
                m["single_hop_gbps"] >= 1.2 and m["single_hop_vs_raw"] >= 0.65),
            Row("Data plane", "4 MB frames, 4-stage chain, per hop", f"{m['four_stage_chain_per_hop_gbps']:.2f} GB/s"),
        ]
    for size, target in (("64MB", 3.0), ("4MB", None)):
        s = d.get("shm", {}).get(size)
        if not s:
            continue
        one, chain = s["single_hop"]["median"], s["four_stage_chain"]["median"]
        label = size.replace("MB", " MB")
        for what, m in (("one hop", one), ("4-stage chain, per hop", chain)):
            value = (f"{m['shm_gbps_per_hop']:.2f} vs {m['tcp_gbps_per_hop']:.2f} GB/s ({m['shm_vs_tcp']:.1f}x)"
                     + (f"; memcpy {s['median_memcpy_gbps']:.1f} GB/s" if what == "one hop" else ""))
            rows.append(Row("Data plane", f"{label} frames, shared memory against TCP loopback: {what}", value,
                            f">= {target:g}x" if target else "", m["shm_vs_tcp"] >= target if target else None))
    if "efficiency" in d:
        e = d["efficiency"]
        m = e["median"]
        rows.append(Row("Data plane", f"pipeline efficiency: {e['stages']} simulated stages of {e['stage_ms']:g} ms, "
                        f"{e['micro_batches']} micro-batches",
                        f"{m['steady_efficiency']:.3f} of ideal steady ({m['steady_efficiency_vs_measured_stage_time']:.3f} "
                        f"of the measured slowest stage; {m['whole_run_efficiency']:.3f} with fill and drain)",
                        ">= 0.95", m["steady_efficiency"] >= 0.95))
    return rows


def compile_time(d: dict) -> list[Row]:
    """bench/compile_time.py: `tvmpipe compile` of the built-in models, in process."""
    models = d["models"]
    targets = [(m["model"], m["target_s"], m["total_s"]) for m in models if "target_s" in m]
    return [Row("Compiler", "compile time, in process: " + " / ".join(m["model"] for m in models),
                slash(m["total_s"] for m in models) + f" s (+{d['load_tvm_torch_onnx_s']:.1f} s importing "
                "TVM, torch, onnx)", "; ".join(f"{n} <= {t:g} s" for n, t, _ in targets),
                all(s <= t for _, t, s in targets) if targets else None)]


def compile_memory(d: dict) -> list[Row]:
    """bench/compile_memory.py: the compiler's peak memory against the weights (issue 25: the
    part above the baseline within 2x); 'before' entries are the old compiler's, kept in the file."""
    return [Row("Compiler", f"compile peak memory, {r['model']}" + (f" as {r['compile_dtype']}" if r["compile_dtype"] not in r["model"] else ""),
                f"(peak - baseline) = {r['peak_minus_baseline_over_weights']:.2f}x the weights "
                f"(peak {r['peak_bytes'] / GIB:.2f} GiB, weights {r['weights_bytes'] / GIB:.2f} GiB)",
                "<= 2x (issue 25)", r["peak_minus_baseline_over_weights"] <= 2, when=r.get("date"))
            for r in d["runs"] if r["label"] != "before"]


def bigmodel(d: dict) -> list[Row]:
    """bench/bigmodel.py: stacks of Linear(4096, 4096) compiled and run as K stages: compile
    memory, each stage's and all processes' peak memory, time to first output ('small' is the
    bench's smoke size: its baseline dwarfs its weights, so its ratios say nothing)."""
    rows = []
    for key, m in d["models"].items():
        if key == "small":
            continue
        name = f"{m['weight_gib']:.1f} GiB model ({m['layers']} x Linear({m['width']}, {m['width']})"
        name += ", written directly as a bundle)" if m.get("synthetic") else ")"
        when = m.get("date")
        if "compile_s" in m:
            rows.append(Row("Big models", f"{name}: compile", f"{m['compile_s']:.0f} s, peak {m['compile_peak_rss_gib']:.2f} GiB "
                            f"= {m['compile_peak_over_weights']:.2f}x the weights", "<= 2x the weights",
                            m["compile_peak_over_weights"] <= 2, when))
        runs = sorted(m["runs"], key=lambda r: r["stages"])
        ks = " / ".join(str(r["stages"]) for r in runs)
        stage = [max(r["stage_peak_rss_gib"]) for r in runs]
        stage_t = [r["stage_target_gib"] for r in runs]
        rows += [
            Row("Big models", f"{name}: peak memory of a stage, K = {ks}", slash(stage) + " GiB",
                "<= weights/K + 0.45 GiB: " + slash(stage_t) + " GiB", all(s <= t for s, t in zip(stage, stage_t)), when),
            Row("Big models", f"{name}: peak memory of all processes, K = {ks}",
                slash(r["all_processes_peak_gib"] for r in runs) + " GiB", f"<= {runs[0]['all_target_gib']:.1f} GiB",
                all(r["all_processes_peak_gib"] <= r["all_target_gib"] for r in runs), when),
        ]
        first = [r["time_to_first_output_s"] for r in runs]
        by_k = dict(zip((r["stages"] for r in runs), first))
        repeats = max(r.get("repeats", 1) for r in runs)
        rows.append(Row("Big models", f"{name}: time to first output, K = {ks}",
                        slash(first) + " s" + (f" (median of {repeats})" if repeats > 1 else ""),
                        "K = 4 <= K = 1" if {1, 4} <= by_k.keys() else "",
                        by_k[4] <= by_k[1] if {1, 4} <= by_k.keys() else None, when))
        rows.append(Row("Big models", f"{name}: outputs against one process (streamed check)",
                        "bit-identical" if all(r["match"] for r in runs) else "DIFFERENT", "bit-identical",
                        all(r["match"] for r in runs), when))
    return rows


def reference_cpu(d: dict) -> list[Row]:
    """bench/reference_cpu.py: the NumPy reference backend, the oracle (no target)."""
    ms = d["models"]
    return [Row("Executor", "reference backend run(), median: " + " / ".join(m["model"] for m in ms),
                slash(m["median_ms"] for m in ms) + " ms")]


def _by(rows: list[dict], **keys) -> dict:
    return next(r for r in rows if all(r.get(k) == v for k, v in keys.items()))


def generate(d: dict, area: str = "Generation", where: str = "") -> list[Row]:
    """bench/generate.py: the decode pipeline over simulated stages (tokens/s against the ideal,
    TTFT, ITL, bytes a hop, the driver's CPU), and the published decoders' steps (reference loop
    against transformers, static batches, row admission, chunked prefill)."""
    rows: list[Row] = []
    target = d["target"]["fraction_of_ideal"]
    ks = sorted({r["stages"] for r in d["rows"]})
    for stage_ms in sorted({r["stage_ms"] for r in d["rows"]}, reverse=True):
        for mult in (1, 2):
            fr = [_by(d["rows"], stage_ms=stage_ms, stages=k, in_flight=mult * k)["fraction_of_ideal"] for k in ks]
            s = "S = K" if mult == 1 else "S = 2K"
            judged = stage_ms == 1.0
            rows.append(Row(area, f"decode tokens/s over the ideal{where}, {stage_ms:g} ms simulated stages, {s}, "
                            f"K = {'-'.join(map(str, (ks[0], ks[-1])))}", slash(fr),
                            f">= {target:g} (issue 24)" if judged else "",
                            min(fr) >= target if judged else None))
    k2 = _by(d["rows"], stage_ms=1.0, stages=2, in_flight=4)
    rows.append(Row(area, f"TTFT / inter-token latency p50{where}, 1 ms stages, K = 2, S = 4",
                    f"{k2['ttft_ms_p50']:.1f} / {k2['itl_ms_p50']:.1f} ms (ITL p99 {k2['itl_ms_p99']:.1f} ms)"))
    widest = [max(r["max_hop_bytes_per_token"] for r in d["rows"] if r["stages"] == k) for k in ks]
    entry = min(r["smallest_cache_entry_bytes"] for r in d["rows"])
    rows.append(Row(area, f"bytes a token on the widest hop{where}, K = {' / '.join(map(str, ks))}",
                    slash(widest, ".0f") + f" B (one cache entry: {entry} B)", "< one cache entry",
                    d["target"]["no_cache_bytes"]))
    drv = d["driver_scaling"]
    rows.append(Row(area, f"driver CPU a token{where}, S = " + " / ".join(str(r["in_flight"]) for r in drv["rows"]),
                    slash((r["driver_cpu_us_per_token"] for r in drv["rows"]), ".0f") + f" us ({drv['growth']:.2f}x)",
                    f"<= {drv['target']:g}x", drv["growth"] <= drv["target"]))
    if "driver_by_stages" in d:
        b = d["driver_by_stages"]
        frames = sorted({r["driver_frames_per_token"] for r in b["rows"]})
        rows.append(Row(area, f"driver frames and CPU a token{where}, K = " + " / ".join(str(r["stages"]) for r in b["rows"])
                        + f", S = {b['rows'][0]['in_flight']}",
                        f"{slash(frames, 'g')} frame a token; " + slash((r["driver_cpu_us_per_token"] for r in b["rows"]), ".0f")
                        + f" us ({b['cpu_growth']:.2f}x)", "<= 1 frame a token", b["frames_per_token_at_most_one"]))
    sp = d.get("single_process")
    if sp:
        rows.append(Row(area, f"fixture decoder in one process{where}: reference loop against its torch loop",
                        f"{sp['reference_loop_tokens_per_s']:.0f} vs {sp['torch_eager_tokens_per_s']:.0f} tokens/s, "
                        f"same tokens: {yes(sp['same_tokens'])}"))
    for t in d.get("transformers") or []:
        rows.append(Row(area, f"{t['decoder']} step in one process{where}: reference loop against transformers' generate",
                        f"{t['reference_loop_tokens_per_s']:.0f} vs {t['transformers_generate_tokens_per_s']:.0f} tokens/s "
                        f"({t['reference_loop_tokens_per_s'] / t['transformers_generate_tokens_per_s']:.2f}x)",
                        "same tokens", t["same_tokens"]))
    sb = d.get("static_batches")
    if sb:
        r1 = sb["rows"][0]
        tps = [r["tokens_per_s"] for r in sb["rows"]]
        rows.append(Row(area, f"static batches{where}: {sb['decoder']} step, K = {r1['stages']}, B = "
                        + " / ".join(str(r["batch"]) for r in sb["rows"]),
                        slash(tps, ".0f") + " tokens/s (" + ", ".join(f"{t / tps[0]:.2f}x" for t in tps[1:]) + ")",
                        "same tokens at every B", all(r["same_tokens_as_batch_1"] for r in sb["rows"])))
    ra = d.get("row_admission")
    if ra:
        rows.append(Row(area, f"row admission{where}: B = {ra['batch']}, K = {ra['stages']}, "
                        f"{len(ra['prompt_lengths'])} prompts of {min(ra['prompt_lengths'])}-{max(ra['prompt_lengths'])} tokens, "
                        "a row at a time against a group at a time",
                        f"{span(ra['per_row_tokens_per_s_runs'])} vs {span(ra['per_group_tokens_per_s_runs'])} tokens/s; "
                        f"{ra['per_row_micro_batches']} vs {ra['per_group_micro_batches']} micro-batches",
                        "same tokens", ra["same_tokens"]))
    cp = d.get("chunked_prefill")
    if cp:
        one, chunk = cp["runs"]["1"], cp["runs"][str(cp["chunk"])]
        rows.append(Row(area, f"chunked prefill{where}: {cp['prompt_tokens']}-token prompts, K = {cp['stages']}, "
                        f"--chunk 1 against --chunk {cp['chunk']}",
                        f"TTFT p50 {span([r['ttft_ms_p50'] for r in one])} vs {span([r['ttft_ms_p50'] for r in chunk])} ms; "
                        f"ITL p50 {span([r['itl_ms_p50'] for r in one], '.1f')} vs {span([r['itl_ms_p50'] for r in chunk], '.1f')} ms; "
                        f"{one[0]['micro_batches']} vs {chunk[0]['micro_batches']} micro-batches",
                        "same tokens", cp["same_tokens"]))
    return rows


def serve(d: dict) -> list[Row]:
    """bench/serve.py: `tvmpipe serve` at 1, 4 and 16 concurrent clients (requests/s, TTFT, ITL),
    and its tokens/s against offline generation of the same prompts in the same run."""
    area = "Serving"
    lv = d["levels"]
    at = " / ".join(str(x["clients"]) for x in lv)
    what = f"{d['decoder']} step, K = {d['stages']}, {d['backend']}, {d['new_tokens']} new tokens a request"
    rows = [Row(area, f"requests/s and tokens/s at {at} clients ({what})",
                slash((x["requests_per_s"] for x in lv), ".1f") + " requests/s; "
                + slash((x["tokens_per_s"] for x in lv), ".0f") + " tokens/s",
                "same tokens as offline", all(x["same_tokens_as_offline"] for x in lv)),
            Row(area, f"time to first token p50 / p99 at {at} clients",
                slash((x["ttft_ms_p50"] for x in lv), ".0f") + " ms; p99 " + slash((x["ttft_ms_p99"] for x in lv), ".0f")
                + " ms"),
            Row(area, f"inter-token latency p50 / p99 at {at} clients",
                slash((x["itl_ms_p50"] for x in lv), ".1f") + " ms; p99 " + slash((x["itl_ms_p99"] for x in lv), ".1f")
                + " ms")]
    sbs = d["side_by_side"]
    target = d["target"]["server_over_offline_at_16"]
    rows.append(Row(area, f"server tokens/s against offline generation of the same {sbs['requests']} prompts, "
                    f"{sbs['clients']} clients (bare socket clients; httpx clients beside)",
                    f"{span(sbs['server_tokens_per_s_runs'])} vs {span(sbs['offline_tokens_per_s_runs'])} tokens/s "
                    f"({sbs['ratio']:.2f}x; httpx clients {span(sbs['server_httpx_clients_tokens_per_s_runs'])} "
                    f"tokens/s, {sbs['ratio_httpx_clients']:.2f}x)", f">= {target:g}x with both clients (issue 50)",
                    sbs["ratio"] >= target and sbs["ratio_httpx_clients"] >= target))
    return rows


def serve_cost(d: dict) -> list[Row]:
    """bench/serve.py --logprobs K / --json-schema: tokens/s of requests asking for log
    probabilities or a response_format against plain ones, alternating rounds (issue 51)."""
    runs = next(k for k in d if k.endswith("_tokens_per_s_runs") and not k.startswith("plain"))
    what = runs[:-len("_tokens_per_s_runs")]
    what = f"logprobs={d['logprobs']}" if what == "logprobs" and "logprobs" in d else what.replace("_", " ")
    return [Row("Serving", f"{what} against plain requests, {d['clients']} clients ({d['decoder']} step, "
                           f"K = {d['stages']}, {d['backend']}, {d['new_tokens']} new tokens a request)",
                f"{span(d[runs])} vs {span(d['plain_tokens_per_s_runs'])} tokens/s ({d['ratio']:.2f}x)")]


def serve_http_nice(d: dict) -> list[Row]:
    """bench/serve.py --http-nice: the default --http-nice 10 against 0, two servers side by side,
    paired rounds (issue 50)."""
    return [Row("Serving", f"`tvmpipe serve` (--http-nice 10, the default) against --http-nice 0, {d['clients']} "
                           f"{d['client']} clients, {d['rounds']} paired rounds",
                f"{span(d['nice10_tokens_per_s_runs'])} vs {span(d['nice0_tokens_per_s_runs'])} tokens/s "
                f"({d['ratio']:.2f}x; higher in {d['rounds_higher']} of {d['rounds']})")]


def grammar(d: dict) -> list[Row]:
    """bench/grammar.py: llguidance's token mask of a JSON schema, a token, at a published
    vocabulary's size (issue 51)."""
    return [Row("Serving", f"response_format mask (llguidance) a token, {d['vocab']} ids, a nested JSON schema",
                f"p50 {d['mask_us_p50']:.0f} us, p99 {d['mask_us_p99']:.0f} us; a constrained draw "
                f"{d['constrained_draw_us_p50']:.0f} us against {d['plain_draw_us_p50']:.0f} us")]


def soak(d: dict) -> list[Row]:
    """bench/soak.py: a seeded random workload against a real server for minutes (concurrent streams,
    stop strings, cancels and disconnects, extreme and invalid bodies, bursts past the queue, a stage
    SIGKILL, then a drain), every answer checked against offline generation or OpenAI's error shape."""
    area = "Serving"
    end = d.get("end") or {}
    return [Row(area, f"soak: {d['minutes']:g} min, seed {d['seed']}, {d['concurrency']} in flight, a stage SIGKILL, "
                      "then SIGTERM",
                f"{d['actions_sent']} actions, {d['requests']} requests, {d['problems']} problem(s); "
                f"server died: {'no' if d['server_died'] is None else 'yes'}; exit {end.get('exit_status')}",
                "no problem, exit 0", d["problems"] == 0 and d["server_died"] is None and end.get("exit_status") == 0)]


def checkpoint(d: dict) -> list[Row]:
    """bench/checkpoint.py: Llama-architecture checkpoints (save_pretrained, random weights, real
    configs from 135M to 1.1B, bf16 and fp32) compiled with `tvmpipe compile DIR --decode` and run
    as 4 stages: compile peak memory, bundle size, each stage's memory; the reference loop against
    transformers' generate."""
    area = "Your own checkpoint"
    runs = list(d["runs"].values())
    names = " / ".join(f"{r['model']} {'bf16' if r['dtype'] == 'bfloat16' else 'fp32'}" for r in runs)
    rows = [Row(area, f"compile peak RSS ({names}; target 1.5x the checkpoint + 1 GiB)",
                slash((r["compile_peak_rss_gib"] for r in runs), ".2f") + " GiB for "
                + slash((r["checkpoint_gib"] for r in runs), ".2f") + " GiB checkpoints; compile "
                + slash((r["compile_s"] for r in runs), ".0f") + " s",
                "<= 1.5x checkpoint + 1 GiB", all(r["compile_within_target"] for r in runs)),
            Row(area, f"bundle weights against the checkpoint's ({names}; a tied embedding stored once)",
                slash((r["bundle_over_checkpoint"] for r in runs), ".4f") + "x", "<= 1.02x",
                all(r["bundle_over_checkpoint"] <= 1.02 for r in runs))]
    for r in runs:
        rows.append(Row(area, f"{r['model']} {r['dtype']}: each stage's peak RSS at K = 4 (weights/4 + 0.45 GiB)",
                        slash(r["k4_stage_peak_rss_gib"], ".2f") + f" GiB (target {r['k4_stage_target_gib']:.2f})",
                        "<= weights/4 + 0.45 GiB", r["k4_within_target"]))
    for r in runs:
        sp = r.get("speed")
        if sp:
            rows.append(Row(area, f"{r['model']} {r['dtype']}: single-process reference loop against transformers' "
                            "generate, same tokens, this CPU",
                            f"{sp['reference']['tokens_per_s']:.1f} vs {sp['transformers']['tokens_per_s']:.1f} tokens/s",
                            "same tokens", sp["same_tokens"]))
    return rows


def quant(d: dict) -> list[Row]:
    """bench/quant.py: GGUF files of real configurations (Q4_K_M-like mixes, random weights)
    through `tvmpipe compile FILE.gguf --decode`: compile peak memory and time, the bundle's
    weights against the file's tensor bytes (blocks kept packed), the reference loop's speed."""
    area = "Your own checkpoint"
    rows = []
    for r in d["runs"]:
        q = r.get("quantize")
        if q and "error" not in q:
            rows.append(Row(area, f"--quantize {q['scheme']} of a {r['model']} float32 checkpoint: bundle weights against "
                            "the checkpoint's; compile peak RSS", f"{q['bundle_over_checkpoint']:.3f}x; "
                            f"{q['compile_peak_gib']:.2f} GiB for {q['checkpoint_gib']:.2f} GiB, {q['compile_s']:.0f} s; "
                            f"reference {q['reference_tokens_per_s']:.2f} tokens/s", "<= 0.3x; 1.5x + 1 GiB",
                            q["within_0_3"] and q["compile_within_target"]))
        if "types" not in r:
            continue
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(r["types"].items()))
        rows.append(Row(area, f"GGUF {r['model']} ({kinds}): compile peak RSS (target 1.5x the file + 1 GiB)",
                        f"{r['compile_peak_gib']:.2f} GiB for a {r['file_gib']:.2f} GiB file; compile "
                        f"{r['compile_s']:.0f} s", "<= 1.5x file + 1 GiB", r["compile_within_target"]))
        rows.append(Row(area, f"GGUF {r['model']}: bundle weights against the file's tensor bytes (packed as stored)",
                        f"{r['bundle_over_file_tensors']:.4f}x", "<= 1.05x", r["bundle_over_file_tensors"] <= 1.05))
        rows.append(Row(area, f"GGUF {r['model']}: single-process reference loop (NumPy, unpacks every weight "
                        "every step), this CPU", f"{r['reference_tokens_per_s']:.2f} tokens/s"))
        for k, st in sorted((r.get("stages") or {}).items()):
            if "error" in st:
                rows.append(Row(area, f"GGUF {r['model']}: each stage's peak RSS at K = {k}", "not measured (failed)",
                                "", False))
                continue
            rows.append(Row(area, f"GGUF {r['model']}: each stage's peak RSS at K = {k} (packed weights/{k} + 0.45 GiB; "
                            "heaviest stage's own weights + 0.45 GiB)",
                            slash(st["stage_peak_rss_gib"], ".2f") + f" GiB (targets {st['target_gib']:.2f} / "
                            f"{st['heaviest_target_gib']:.2f})", f"<= weights/{k} + 0.45 GiB",
                            st["within_target"] and st["within_heaviest_target"]))
    return rows


def generate_gpu_host(d: dict) -> list[Row]:
    """bench/generate.py run on the GPU host's CPUs (simulated stages, no GPU): a core per process."""
    cpus = d.get("machine", {}).get("cpus")
    return generate(d, "GPU", f" on the GPU host's {cpus} cores" if cpus else " on the GPU host")


def kv_memory(d: dict) -> list[Row]:
    """bench/kv_memory.py: each stage's resident memory against the KV caches it reports."""
    rows = []
    top = max(r["slots"] for r in d["rows"])
    for r in sorted((r for r in d["rows"] if r["slots"] == top), key=lambda r: r["stages_k"]):
        st = r["stages"]
        rows.append(Row("KV caches", f"caches a stage reports and its memory growth, {d['bundle']['source']} at "
                        f"{d['bundle']['max_context']} tokens, S = {top} slots, K = {r['stages_k']}",
                        slash((s["state_bytes"] / MIB for s in st), "g") + " MiB reported; grew "
                        + slash(s["rss_growth_bytes"] / MIB for s in st) + " MiB",
                        "growth = reported within 10 % + 4 MiB", all(s["growth_matches"] for s in st)))
    one = _by(d["per_slot"], stages_k=1)
    rows += [
        Row("KV caches", "one more slot at K = 1: resident memory against its caches",
            f"{one['rss_bytes_per_slot'][0] / MIB:.3f} vs {one['state_bytes_per_slot'][0] / MIB:.3f} MiB"),
        Row("KV caches", "caches split across stages, not copied (they add up to K = 1's at every S)",
            yes(d["target"]["split_not_copied"]), "yes", d["target"]["split_not_copied"]),
        Row("KV caches", "driver's memory growth, largest over the runs",
            f"{max(r['driver_growth_bytes'] for r in d['rows']) / MIB:.2f} MiB", "< 16 MiB (holds no cache)",
            d["target"]["driver_holds_no_cache"]),
    ]
    return rows


def kv_paged(d: dict) -> list[Row]:
    """bench/kv.py: a decode step's time against the tokens it holds, static against paged KV."""
    lo, hi = sorted(d["step_ms"]["paged"], key=int)
    ms = d["step_ms"]
    return [
        Row("KV caches", f"paged KV: a decode step at T = {hi} over T = {lo}, {d['tokens_held']} tokens held a row "
            f"(reference backend, batch {d['batch']}, {d['model']})",
            f"{d['ratio']['paged']:.2f}x ({ms['paged'][lo]:.2f} -> {ms['paged'][hi]:.2f} ms)",
            f"<= {d['target']}x", d["met"]),
        Row("KV caches", f"static KV, the same step at T = {hi} over T = {lo}",
            f"{d['ratio']['static']:.2f}x ({ms['static'][lo]:.2f} -> {ms['static'][hi]:.2f} ms)"),
    ] + _kv_scheduled(d)


def _kv_scheduled(d: dict) -> list[Row]:
    """bench/kv.py's runs through the scheduler: prefix TTFT and capacity at a fixed pool."""
    rows = []
    pt = d.get("prefix_ttft")
    if pt is not None:
        pg, st = pt["paged"], pt["static"]
        rows.append(Row("KV caches", f"paged KV: TTFT of the first request with a {pt['system_tokens']}-token system "
                        f"prompt over the median of {pt['requests'] - 1} after it sharing its cached pages "
                        "(tokens equal the static step's)",
                        f"{pg['first_over_rest']:.1f}x ({pg['ttft_first_ms']:.0f} -> {pg['ttft_rest_median_ms']:.0f} ms, "
                        f"{pg['pages_shared_max']} pages shared; static {st['first_over_rest']:.1f}x)",
                        f">= {pt['target_first_over_rest']:g}x", pt["met"]))
    cap = d.get("capacity")
    if cap is not None:
        pg, st = cap["paged"], cap["static"]
        compiled = pg.get("compiled_pool_tokens")  # set at run time (kv_tokens) over the compiled pool
        rows.append(Row("KV caches", f"paged KV at max context {cap['max_context']}, batch {cap['batch']}, a pool of "
                        f"{cap['pool_tokens']} tokens" + (f" set at run time (compiled: {compiled})" if compiled else "")
                        + f": {cap['requests']} requests of {cap['prompt_tokens']} + "
                        f"{cap['new_tokens']} tokens at once, rows busy at most (tokens equal the static step's)",
                        f"{pg['rows_busy_max']} of {pg['rows']}; KV {pg['kv_bytes'] / MIB:.1f} MiB (static caches "
                        f"{st['kv_bytes'] / MIB:.1f} MiB); stage RSS {pg['stage_rss_bytes'] / MIB:.0f} MiB (static "
                        f"{st['stage_rss_bytes'] / MIB:.0f} MiB)", f">= {cap['target_rows_busy']} rows", cap["met"]))
        sv = cap.get("server")
        if sv is not None:  # the same through `tvmpipe serve --kv-tokens` (the pool set at run time)
            rows.append(Row("KV caches", f"the same through `tvmpipe serve --kv-tokens {cap['pool_tokens']}` (a step "
                            f"compiled with every row at {cap['max_context']}): rows busy at most, read from /metrics "
                            "(texts equal the static step's)",
                            f"{sv['rows_busy_max']} of {sv['rows']}; pool {sv['kv_tokens_total']} tokens (static caches "
                            f"{sv['rows_busy_max']} x {cap['max_context']}); stage RSS {sv['stage_rss_bytes'] / MIB:.0f} "
                            "MiB", f">= {cap['target_rows_busy']} rows", sv["rows_busy_max"] >= cap["target_rows_busy"]
                            and sv["same_tokens"]))
    return rows


def planner(d: dict) -> list[Row]:
    """bench/planner.py: the optimal planner's speed on a 700-op graph and its plans against equal cuts."""
    sp = d["speed"]
    ks = sorted({r["k"] for r in sp["rows"]})
    totals = [r["total_s"] for r in sp["rows"]]
    gain = [q["speedup"] for q in d["quality"]]
    return [
        Row("Partition and prediction", f"optimal planner, {sp['graph']['op_nodes']}-op graph, K = {ks[0]}-{ks[-1]} "
            "(with and without memory caps and device speeds)", f"{min(totals) * 1e3:.0f}-{max(totals) * 1e3:.0f} ms",
            f"< {sp['target_s']:g} s", all(r["under_target"] for r in sp["rows"])),
        Row("Partition and prediction", f"optimal against equal cuts, predicted bottleneck, {len(gain)} graph/K cases",
            f"{min(gain):.2f}x-{max(gain):.2f}x lower (median {statistics.median(gain):.2f}x)", "never worse",
            min(gain) >= 1.0),
    ]


def predict(d: dict) -> list[Row]:
    """bench/predict.py: `tvmpipe sweep`'s predicted against measured throughput on examples/cnn.
    Rows the bench marks CPU-bound (more processes than cores) are reported, not judged."""
    rows = []
    t = d["targets"]
    judged_all = []
    for name, s in d["sweeps"].items():
        judged = [r for r in s["rows"] if r["in_target"] is not None]
        judged_all += judged
        if not judged:
            continue
        where = f"beside {s['neighbours']} busy process" if s.get("neighbours") else ""
        rows.append(Row("Partition and prediction", f"predicted against measured throughput, examples/cnn, {name}"
                        + (f" {where}" if where else "") + ", K = " + "/".join(sorted({str(r['stages']) for r in judged})),
                        ", ".join(f"{pct(r['error_pct'])} ({r['strategy']})" for r in judged)
                        + f"; bubble within {max(abs(r['bubble_error_points']) for r in judged):.1f} points",
                        f"within {t['throughput_pct']:g} %, bubble within {t['bubble_points']:g} points",
                        all(r["in_target"] for r in judged)))
    every = [r for s in d["sweeps"].values() for r in s["rows"]]
    rows.append(Row("Partition and prediction", "predictions judged in target, all sweeps",
                    f"{sum(bool(r['in_target']) for r in judged_all)} of {len(judged_all)} "
                    f"({len(every) - len(judged_all)} CPU-bound rows not judged)", "all", all(r["in_target"] for r in judged_all)))
    return rows


def whatif(d: dict) -> list[Row]:
    """bench/whatif.py: `tvmpipe sweep --backend simulated` over cluster specs (plans, event
    simulation, plots) for a 700-op graph."""
    rs = d["rows"]
    return [Row("Partition and prediction", "what-if sweep, 700-op graph, K = 1..max on "
                + " / ".join(f"{r['cluster']} (K <= {r['max_stages']})" for r in rs),
                slash((r["sweep_s"] for r in rs), ".1f") + " s", f"< {d['target_s']:g} s each",
                all(r["under_target"] for r in rs))]


def replay(d: dict) -> list[Row]:
    """bench/replay.py: a stage process SIGKILLed mid-run; its micro-batches replayed from the
    upstream neighbour against from the driver."""
    c, m = d["config"], d["median"]
    rows = []
    for who, label in (("upstream", "from the upstream neighbour"), ("driver", "from the driver")):
        r = m[who]
        rows.append(Row("Recovery", f"a stage SIGKILLed, {c['stages']} stages, window {c['window']}: replay {label}",
                        f"{r['recovery_s']:.2f} s to the first new output, {r['catch_up_s']:.2f} s to catch up, "
                        f"{r['recomputed']:.0f} micro-batches recomputed by survivors"))
    return rows


def zoo(d: dict) -> list[Row]:
    """bench/zoo.py: published architectures exported both ways, compiled and checked against torch."""
    from zoo import KNOWN_FAILURES  # bench/zoo.py: the TVM importer failures it expects

    rows = []
    for dtype in sorted({r.get("dtype", "float32") for r in d["results"]}):
        rs = [r for r in d["results"] if r.get("dtype", "float32") == dtype]
        ok = [r for r in rs if r["ok"]]
        export = sum(bool(r.get("exporter_failed")) for r in rs)
        known = sum((r["model"], r["path"]) in KNOWN_FAILURES for r in rs if not r["ok"])
        worst = max(r["ref_error"] for r in ok)
        split = all(all(r["split_identical"].values()) for r in ok)
        rows.append(Row("Model zoo", f"published architectures (torch.export and ONNX), {dtype}: rows that compile and match torch",
                        f"{len(ok)} of {len(rs)} ({export} torch cannot export, {known} known TVM importer failures); "
                        f"largest error {worst:.1e} of max|out|; K = 2, 3 bit-identical: {yes(split)}",
                        "every other row passes", len(ok) + export + known == len(rs) and split))
    return rows


def gpu_check(d: dict) -> list[Row]:
    """bench/gpu_check.sh's summary: the GPU test suite and the kit's steps (their figures come
    from the per-step files)."""
    p = d["pytest_gpu"]
    steps = d["steps"]
    ok = sum(s["exit"] == 0 for s in steps)
    return [Row("GPU", "`pytest -m gpu`: cuda backend against the reference",
                f"{p['passed']} of {p['tests']} passed, {p['skipped']} skipped", "all pass",
                p["passed"] == p["tests"] and not p["skipped"]),
            Row("GPU", "GPU kit steps (bench/gpu_check.sh)", f"{ok} of {len(steps)} passed", "all pass",
                ok == len(steps))]


def executor_gpu(d: dict) -> list[Row]:
    """bench/executor_gpu.py: run() with CUDA-graph replay against the device work, a whole request
    against PyTorch eager."""
    from executor_gpu import target_met  # the bench's own check: both ratios within the target

    rows = []
    for m in d["models"]:
        device = "graph_ratio_device" in m  # files before one replay's device time was measured lack it
        rows.append(Row("GPU", f"run() with CUDA-graph replay over the device work, {m['model']}",
                        f"{m['graph_ratio']:.2f}x kernels + copies"
                        + (f", {m['graph_ratio_device']:.3f}x one replay" if device else ""),
                        f"<= {d['target_graph_ratio']:g}x", target_met(m) if device else None))
    torch = [m for m in d["models"] if m.get("vs_torch")]
    if torch:
        rows.append(Row("GPU", "a whole request (set_input, run, get_output) over PyTorch eager's",
                        ", ".join(f"{m['model']} {m['vs_torch']:.2f}x" for m in torch)))
    return rows


def gpu_pipeline(d: dict) -> list[Row]:
    """bench/gpu_pipeline.py: 1-4 stage processes on one GPU, CUDA IPC hops: exactness and
    throughput against one stage (one GPU is time-sliced, so this prices the hop)."""
    runs = [(m["model"], r) for m in d["models"] for r in m["runs"]]
    n = sum(len(r["pipelines"]) for _, r in runs)
    rows = [Row("GPU", f"1-{max(d['stages'])} stage pipelines on one GPU: outputs against one process",
                f"{n} runs, " + ("all byte-identical" if d["all_exact"] else "NOT all identical"), "byte-identical",
                bool(d["all_exact"]))]
    for m in d["models"]:
        parts = []
        for r in m["runs"]:
            ps = [p for p in r["pipelines"] if p["stages"] > 1]
            parts.append(("CUDA graphs " if r["graphs"] else "plain launches ") + slash(p["speedup_vs_1_stage"] for p in ps))
        ks = " / ".join(str(p["stages"]) for p in m["runs"][0]["pipelines"] if p["stages"] > 1)
        rows.append(Row("GPU", f"{m['model']}: throughput over one stage, K = {ks}", "; ".join(parts)))
    return rows


def ipc_gpu(d: dict) -> list[Row]:
    """bench/ipc_gpu.py: one same-node hop, CUDA IPC against the host path."""
    return [Row("GPU", f"{r['mb']:g} MB hop between two GPU stage processes: CUDA IPC against the host path",
                f"{r['cuda-ipc_gbps']:.1f} vs {r['host_gbps']:.1f} GB/s ({r['speedup']:.1f}x)") for r in d["rows"]]


def upload_gpu(d: dict) -> list[Row]:
    """bench/upload_gpu.py: a 2 GiB model's stages built at K = 1, 2, 4: device memory against the
    weights, staged upload speed against the page-locked copy limit."""
    runs = sorted(d["runs"], key=lambda r: r["stages"])
    ks = " / ".join(str(r["stages"]) for r in runs)
    size = f"{d['weight_bytes'] / GIB:.0f} GiB model"
    return [
        Row("GPU", f"{size}'s stages on the device, K = {ks}: device memory over the weights",
            slash((max(s["device_over_weights"] for s in r["per_stage"]) for r in runs), ".3f") + "x"),
        Row("GPU", f"{size}'s stages, K = {ks}: upload speed a stage",
            " / ".join(span([s["upload_gbps"] for s in r["per_stage"]], ".1f") for r in runs)
            + f" GB/s (page-locked copy: {d['limit']['pinned_htod_gbps']:.0f} GB/s)"),
        Row("GPU", f"{size}'s stages: host memory growth a stage (the staging buffer: "
            f"{d['staging_bytes'] / MIB:.0f} MiB)",
            f"{max(s['host_rss_growth_bytes'] for r in runs for s in r['per_stage']) / MIB:.0f} MiB at most"),
    ]


def decode_gpu(d: dict) -> list[Row]:
    """bench/decode_gpu.py: a decode step's pipeline with its caches on the device."""
    rows = []
    for k in sorted({r["stages"] for r in d["rows"] if "in_flight" in r and "batch" not in r}):
        rs = sorted((r for r in d["rows"] if r["stages"] == k and "batch" not in r and "in_flight" in r),
                    key=lambda r: r["in_flight"])
        rows.append(Row("GPU", f"{d['model']} on the device, K = {k}: tokens/s with "
                        + " / ".join(str(r["in_flight"]) for r in rs) + " sequences in flight",
                        slash((r["tokens_per_s"] for r in rs), ".0f"), "the reference's tokens",
                        all(r["same_tokens_as_reference"] for r in rs)))
    return rows


def decode_real(d: dict) -> list[Row]:
    """bench/decode_real.py (issue 47): the largest real-size model's batch-1 decode step on the
    device against the bandwidth floor and transformers' generate, and the static context's cost:
    one row, its three targets judged by the bench (`verdicts`)."""
    v = d["verdicts"]
    floor, over, ctx = v["floor"], v["over_transformers"], v["context_cost"]
    if floor is None:  # a run cut short before the largest model's batch-1 step
        return [Row("GPU", "Real-size Llama decode (bench/decode_real.py)", "the batch-1 step was not measured "
                    f"(not run: {', '.join(d.get('not_run') or []) or 'see its errors'})", "", None)]
    model = floor["model"]
    rec = min((r for r in d["models"][model]["bundles"].values() if r["batch"] == 1), key=lambda r: r["max_context"])
    run = next(r for r in rec["runs"] if r["stages"] == 1 and r["in_flight"] == 1)
    sdpa = [x for x in (over or {}).get("rows", []) if x["model"] == model and x["batch"] == 1
            and x["attn_implementation"] == "sdpa"]
    cost = [x for x in (ctx or {}).get("rows", []) if x["model"] == model and x["batch"] == 1]
    parts = [f"{run['tokens_per_s']:.0f} tokens/s, {100 * floor['fraction']:.0f} % of the floor "
             f"({d['copy']['gbps']:.0f} GB/s device copy)"]
    parts.append(f"{sdpa[0]['ratio']:.2f}x transformers" if sdpa else "transformers not measured")
    if cost:
        parts.append(f"T {cost[0]['contexts'][1]} {cost[0]['ratio']:.2f}x T {cost[0]['contexts'][0]}")
    verdicts = [x["met"] for x in (floor, over, ctx) if x is not None]
    return [Row("GPU", f"{model.upper()} Llama decode, fp16, batch 1, K = 1, CUDA graphs (T {rec['max_context']}): "
                "tokens/s, share of the bandwidth floor, over transformers' generate; static context's cost",
                "; ".join(parts), f">= {100 * floor['target']:.0f} % of the floor, >= {d['targets']['over_transformers']:g}x "
                f"transformers, <= {d['targets']['largest_over_smallest_context']:g}x",
                all(verdicts) if len(verdicts) == 3 else None)] + int4_rows(d)


def int4_rows(d: dict) -> list[Row]:
    """decode_real's `int4_over_fp16` (issue 52: --quantize int4 steps beside fp16 ones), where it ran."""
    q = d.get("int4_over_fp16")
    return [] if not q else [Row(
        "GPU", f"int4 (--quantize int4, packed) over fp16 decode tokens/s, K = 1 ({q['judged_on'].upper()} at "
        "batch 1 judged)", "; ".join(f"{r['model']} b{r['batch']} T{r['max_context']}: {r['ratio']:.2f}x "
                                     f"({r['int4_tokens_per_s']:.0f} vs {r['fp16_tokens_per_s']:.0f})" for r in q["rows"]),
        f">= {q['target']:g}x", q["met"])]


def decode_schedules(d: dict) -> list[Row]:
    """bench/decode_schedules.py (issue 54): decode_real's run over the same steps compiled under other
    dlight rules, each variant's tokens/s and matmul device time against the default rules' (base)."""
    models = d["models"]
    rows = []
    for name in sorted(m for m in models if not m.endswith("_base")):
        model, var = name.rsplit("_", 1)
        base = models.get(f"{model}_base", {}).get("bundles", {})
        for combo, rec in sorted(models[name]["bundles"].items()):
            ref = base.get(combo)
            if ref is None or rec is ref or combo.endswith("_b1") and var != "norm":
                continue  # a variant folder's copy of the base batch-1 step
            run, was = rec["runs"][0], ref["runs"][0]
            mm, mm0 = rec["profile"]["us"]["matmul"], ref["profile"]["us"]["matmul"]
            same = rec.get("tokens_vs_batch_1", {}).get("differ") == ref.get("tokens_vs_batch_1", {}).get("differ")
            rows.append(Row("GPU", f"{model} {combo}: dlight rules '{var}' over the default (bench/decode_schedules.py)",
                            f"{run['tokens_per_s'] / was['tokens_per_s']:.2f}x tokens/s ({run['tokens_per_s']:.0f} vs "
                            f"{was['tokens_per_s']:.0f}), matmuls {mm / 1e3:.1f} vs {mm0 / 1e3:.1f} ms a step"
                            + ("" if same else "; tokens against batch 1 differ from the default's")))
    return rows


@dataclass(frozen=True)
class Extractor:
    pattern: str  # fnmatch over the file name in bench/results
    rows: Callable[[dict], list[Row]]
    awaiting: str = ""  # no such file yet: the run that makes the first one (tests/bench/test_perfpage.py)


EXTRACTORS = (
    Extractor("cluster_bench.json", cluster_bench),
    Extractor("compile_time.json", compile_time),
    Extractor("compile_memory.json", compile_memory),
    Extractor("bigmodel.json", bigmodel),
    Extractor("reference_cpu.json", reference_cpu),
    Extractor("generate.json", generate),
    Extractor("serve.json", serve),
    Extractor("serve_logprobs.json", serve_cost),
    Extractor("serve_json_schema.json", serve_cost),
    Extractor("serve_http_nice.json", serve_http_nice),
    Extractor("grammar.json", grammar),
    Extractor("soak.json", soak),
    Extractor("checkpoint.json", checkpoint),
    Extractor("quant.json", quant),
    Extractor("kv_memory.json", kv_memory),
    Extractor("kv.json", kv_paged),
    Extractor("planner.json", planner),
    Extractor("predict.json", predict),
    Extractor("whatif.json", whatif),
    Extractor("replay.json", replay),
    Extractor("zoo.json", zoo),
    Extractor("gpu_check.json", gpu_check),
    Extractor("gpu_check.h100-580*.json", gpu_check),
    Extractor("executor_gpu.h100-580*.json", executor_gpu),
    Extractor("gpu_pipeline.h100-580*.json", gpu_pipeline),
    Extractor("ipc_gpu.h100-580*.json", ipc_gpu),
    Extractor("upload_gpu.h100-580*.json", upload_gpu),
    Extractor("decode_gpu.h100-580*.json", decode_gpu),
    Extractor("generate_gpu_host.h100-580*.json", generate_gpu_host),
    Extractor("decode_real.*.json", decode_real),
    Extractor("decode_schedules.*.json", decode_schedules),
    Extractor("decode_int4.*.json", int4_rows),  # a decode_real run of int4 and fp16 steps alone
)


def extractor_for(name: str) -> Extractor:
    """The one extractor of a result file; none or several is an error naming the file."""
    found = [e for e in EXTRACTORS if fnmatch.fnmatchcase(name, e.pattern)]
    if len(found) != 1:
        why = "no extractor in bench/perfpage.py matches it: add one" if not found else \
            "several extractors match it: " + ", ".join(e.pattern for e in found)
        raise PerfPageError(f"bench/results/{name}: {why}")
    return found[0]


# ---- provenance ----------------------------------------------------------------------------------

def sortable(when: str) -> str:
    """'2026-11-26 15:42 UTC', '2026-11-27T15:28:48Z', '2026-11-26T19:12:54', '...+00:00' and
    '2026-11-25' as YYYY-MM-DD[THH:MM[:SS]], which sorts as time does."""
    s = when.strip().replace(" UTC", "").replace("Z", "").replace(" ", "T")
    return re.sub(r"[+-]\d\d:\d\d$", "", s)


def git_last(path: Path) -> tuple[str, str] | None:
    """(commit, committer date) of the commit that last wrote `path`; None outside git or when
    the file was never committed."""
    try:
        r = subprocess.run(["git", "log", "-1", "--format=%H %cI", "--", str(path.relative_to(ROOT))],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    out = r.stdout.split()
    return (out[0], out[1]) if r.returncode == 0 and len(out) == 2 else None


def file_when(d: dict) -> str | None:
    """The file's own date: the stamp's `when`, a GPU bench's `time`, or cluster_bench's `started`."""
    if d.get("when"):
        return d["when"]
    if d.get("time"):
        return d["time"]
    if isinstance(d.get("started"), (int, float)):
        return datetime.fromtimestamp(d["started"], timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return None


def file_commit(d: dict) -> str | None:
    """The code measured: the stamp's `commit` (+ when dirty), or the GPU kit's prepared head."""
    head, dirty = d.get("commit"), d.get("dirty")
    if not head and isinstance(d.get("prep"), dict):
        head, dirty = d["prep"].get("git_head"), d["prep"].get("git_dirty")
    return f"{head[:8]}{'+' if dirty else ''}" if head else None


def machine_label(name: str, d: dict) -> str:
    """GPU name (where there is one), architecture, cores and memory, from whichever fields the
    file has: `machine` (a stamp, a dict or a string), `device`, `gpu`, or the file name's suffix."""
    m = d.get("machine")
    gpu = None
    if isinstance(m, dict) and isinstance(m.get("gpu"), dict):
        gpu = m["gpu"].get("name")
    dev = d.get("device")
    if not gpu and isinstance(dev, str):
        gpu = dev
    if not gpu and isinstance(dev, dict):
        gpu = dev.get("name")
    if not gpu and isinstance(d.get("gpu"), list) and d["gpu"]:
        gpu = str(d["gpu"][0]).split(",")[0]
    if not gpu:
        gpu = next((v for k, v in SUFFIX_MACHINES.items() if f".{k}." in f".{name}"), None)
    text = m if isinstance(m, str) else " ".join(str(m.get(k, "")) for k in ("platform",)) if isinstance(m, dict) else ""
    text += " " + str(d.get("platform", ""))
    arch = re.search(r"x86_64|aarch64|arm64", text)
    cpus = None
    if isinstance(m, dict):
        cpus = m.get("cpus") or m.get("cpu_count")
    elif isinstance(m, str):
        found = re.search(r"(\d+) cores", m)
        cpus = int(found.group(1)) if found else None
    parts = [gpu] if gpu else []
    if arch and not gpu:
        parts.append(arch.group(0))
    if cpus:
        parts.append(f"{cpus} cores")
    if isinstance(m, dict) and m.get("mem_gib") and not gpu:
        parts.append(f"{m['mem_gib']:g} GiB")
    return ", ".join(parts) or "not recorded"


def provenance(path: Path, d: dict) -> Provenance:
    when, commit = file_when(d), file_commit(d)
    if when is None or commit is None:
        last = git_last(path)
        if last:
            commit = commit or last[0][:8]
            when = when or last[1]
    return Provenance(sortable(when) if when else "-", commit or "-", machine_label(path.name, d))


# ---- the page ------------------------------------------------------------------------------------

def collect(results: Path = RESULTS) -> list[Placed]:
    """Every row of every result file, the newest of each (area, metric), in the order the
    extractors give them."""
    placed: dict[tuple[str, str], Placed] = {}
    order: dict[tuple[str, str], int] = {}
    files = sorted(results.glob("*.json"))
    ranked = sorted(files, key=lambda p: next(i for i, e in enumerate(EXTRACTORS) if e is extractor_for(p.name)))
    for path in ranked:
        ext = extractor_for(path.name)
        try:
            doc = json.loads(path.read_text())
            if isinstance(doc, dict) and doc.get("fake"):
                raise PerfPageError(f"bench/results/{path.name}: made over the fake PyCUDA (tests/fakecuda), not on a "
                                    "GPU: its figures mean nothing")
            rows = ext.rows(doc)
        except (ValueError, KeyError, TypeError, StopIteration, ZeroDivisionError) as e:
            raise PerfPageError(f"bench/results/{path.name}: cannot read it with {ext.rows.__name__}(): "
                                f"{type(e).__name__}: {e}") from None
        prov = provenance(path, doc)
        for row in rows:
            if row.area not in AREAS:
                raise PerfPageError(f"bench/results/{path.name}: row '{row.metric}' names an unknown area '{row.area}'")
            p = Placed(row, path.name, replace(prov, when=sortable(row.when)) if row.when else prov)
            key = (row.area, row.metric)
            order.setdefault(key, len(order))
            if key not in placed or (p.prov.when, p.file) > (placed[key].prov.when, placed[key].file):
                placed[key] = p
    return sorted(placed.values(), key=lambda p: (AREAS.index(p.row.area), order[(p.row.area, p.row.metric)]))


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(placed: list[Placed]) -> str:
    lines = [
        "# Performance",
        "",
        "<!-- Generated by bench/perfpage.py from bench/results/*.json; edits here are overwritten. -->",
        "",
        "This page is generated: `make perf-page` (or `.venv/bin/python bench/perfpage.py`) writes it from",
        "the result files in [bench/results/](../bench/results/), which the scripts in bench/ write",
        "(`make bench` runs them all; on a GPU machine `bench/gpu_check.sh` runs the GPU ones, see",
        "[gpu-validation.md](gpu-validation.md)). `tests/bench/test_perfpage.py` fails when it is out of date.",
        "",
        "Each row is the newest value of one figure. **date** and **commit** say when and on which code it",
        "was measured: the bench's own stamp (bench/stamp.py), or else the commit that last wrote the file",
        "and that commit's date; a `+` after a commit means uncommitted changes on top of it. **machine** is",
        "the one the file names. Earlier values are in the files' git history. Timings from a shared",
        "2-core machine move between runs; compare figures measured side by side in one run (the ratios",
        "in the rows), not rows of different dates.",
    ]
    for area in AREAS:
        rows = [p for p in placed if p.row.area == area]
        if not rows:
            continue
        lines += ["", f"## {area}", "", "| metric | value | target | met | date | commit | machine | source |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in rows:
            r = p.row
            met = "" if r.met is None else yes(r.met)
            lines.append("| " + " | ".join(cell(c) for c in (
                r.metric, r.value, r.target, met, p.prov.when[:10], p.prov.commit, p.prov.machine,
                f"[{p.file}](../bench/results/{p.file})")) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/performance.md is out of date")
    ap.add_argument("--out", type=Path, default=PAGE)
    args = ap.parse_args(argv)
    try:
        page = render(collect())
    except PerfPageError as e:
        print(f"perfpage: {e}", file=sys.stderr)
        return 1
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != page:
            print(f"perfpage: {args.out} is out of date: run `make perf-page`", file=sys.stderr)
            return 1
        return 0
    sys.path.insert(0, str(ROOT))
    from tvmpipe.core.files import write_text

    write_text(args.out, page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
