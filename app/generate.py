"""`tvmpipe generate`: autoregressive generation on a decode-step bundle run as K pipeline stages.

    tvmpipe generate BUNDLE --stages K --local --prompt-ids 5,17,3 --prompt-ids 60 --max-new-tokens N --json

prints one JSON document: per sequence its `prompt` (the ids given), the generated `tokens` and why
it stopped (`finish`), plus the run's numbers. Text is optional, through a local tokenizer directory
(`--tokenizer DIR --prompt TEXT`; nothing is downloaded). See docs/generation.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tvmpipe.app.args import COUNT, NON_NEGATIVE, NON_NEGATIVE_INT, add_cluster_args, cluster_options
from tvmpipe.core.errors import TvmpipeError


def token_ids(text: str) -> list[int]:
    """'5,17,3' -> [5, 17, 3] (an argparse type: a bad list is one line naming the option)."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 5,17,3, got {text!r}") from None
    if any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {text!r}")
    return ids


def token_id(text: str) -> int:
    ids = token_ids(text)
    if len(ids) != 1:
        raise argparse.ArgumentTypeError(f"expected one token id, got {text!r}")
    return ids[0]


def register(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser(
        "generate", help="generate tokens with a decode-step bundle run as a pipeline (KV caches stay on the stages)",
        description="Run BUNDLE (a decode step with declared state and a generation section) as K pipeline stages "
                    "that keep their KV caches, feed each prompt token by token, sample, and feed the tokens back. "
                    "Several sequences are in flight so every stage stays busy.")
    g.add_argument("bundle", help="decode-step bundle directory")
    g.add_argument("--stages", "-k", type=COUNT, default=2, help="number of stages K (default 2)")
    g.add_argument("--plan", metavar="PLAN.json", help="plan from `tvmpipe partition -o` (overrides --stages; "
                   "it must keep every state pair in one stage)")
    g.add_argument("--prompt-ids", type=token_ids, action="append", default=[], metavar="ID,ID,...",
                   help="a prompt as token ids (repeat for more sequences)")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt as text (needs --tokenizer; repeatable)")
    g.add_argument("--tokenizer", metavar="DIR", help="local transformers tokenizer directory (no downloads)")
    g.add_argument("--max-new-tokens", type=COUNT, default=16, help="tokens to generate per sequence (default 16)")
    g.add_argument("--in-flight", type=COUNT, help="sequences in flight (default: all the slots hold; more are "
                   "queued; a bundle compiled with --batch B runs B a micro-batch, so this is rounded up to whole "
                   "batches)")
    g.add_argument("--slots", type=COUNT, help="slots each stage holds caches for, each one micro-batch's sequences "
                   "(1, or the bundle's --batch B) (default: the window)")
    g.add_argument("--temperature", type=NON_NEGATIVE, default=0.0, help="0 (default): greedy; else sample")
    g.add_argument("--top-k", type=NON_NEGATIVE_INT, default=0, help="sample among the K most likely (0: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (each sequence draws from (seed, index))")
    g.add_argument("--stop-token", type=token_id, action="append", default=[], metavar="ID",
                   help="stop a sequence after this token (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON document")
    add_cluster_args(g)
    g.set_defaults(func=generate_command)


def load_tokenizer(path: str):
    from pathlib import Path

    if not Path(path).is_dir():
        raise TvmpipeError(f"--tokenizer {path}: not a directory (a local transformers tokenizer directory)")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, ...
        raise TvmpipeError(f"--tokenizer {path}: cannot load a tokenizer there ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def stage_metrics(pipe):
    """The run's per-stage figures (PipelineMetrics: each micro-batch is one step of one sequence,
    or of a static batch of them), with the weights and the KV caches each stage holds; None where
    a worker cannot say any more (a run that failed), which costs the report its table, not the
    tokens."""
    from tvmpipe.cluster.driver import PipelineError

    try:
        return pipe.metrics()
    except (PipelineError, TvmpipeError, OSError):
        return None


def generate_command(args: argparse.Namespace) -> int:
    from tvmpipe.app.connect import check_where, open_cluster, pick_backend, pipeline_kwargs
    from tvmpipe.app.sources import choose_plan
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.executor.sampler import Sampling
    from tvmpipe.generation import GenerationError, Generator, layout_of, make_requests

    options = cluster_options(args)
    check_where(options)
    bundle = load_bundle(args.bundle)
    layout = layout_of(bundle)
    if args.prompt and not args.tokenizer:
        raise TvmpipeError("--prompt TEXT needs --tokenizer DIR (or give token ids with --prompt-ids)")
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    prompts = list(args.prompt_ids) + [list(tok.encode(t)) for t in args.prompt]
    if not prompts:
        raise TvmpipeError("no prompt: give --prompt-ids 5,17,3 (repeatable) or --prompt TEXT with --tokenizer")
    requests = make_requests(prompts, args.max_new_tokens, layout, stop_tokens=args.stop_token,
                             sampling=Sampling(args.temperature, args.top_k, args.seed))
    plan = choose_plan(bundle, args.plan, args.stages, "equal")  # equal cuts, moved off the state pairs
    results: dict = {}
    t0 = time.time()
    error = None
    restarts = 0
    with open_cluster(options, plan.num_stages) as cluster:
        backend = pick_backend(options.backend, cluster.gpus)
        kw = pipeline_kwargs(options, cluster, backend, plan.num_stages)
        with Pipeline(bundle, plan, slots=args.slots, logits=False, **kw) as pipe:  # it streams tokens only
            t1 = time.time()
            try:
                for ev in Generator(pipe).generate(requests, in_flight=args.in_flight, results=results):
                    if not args.json:
                        print(f"seq {ev.seq}: {ev.token}", flush=True)
            except GenerationError as exc:
                error = str(exc)
            wall = time.time() - t1
            restarts = sum(pipe.restarts)
            slots = pipe.slots
            batch, chunk = pipe.topology.batch, pipe.topology.chunk
            metrics = stage_metrics(pipe)
    tokens = sum(len(r.tokens) for r in results.values())
    seqs = []
    for i in sorted(results):
        d = results[i].to_json()
        if tok is not None:
            d["text"] = tok.decode(results[i].tokens)
        seqs.append(d)
    doc = {"bundle": str(args.bundle), "stages": plan.num_stages, "plan": [list(s) for s in plan.stages],
           "backend": backend, "slots": slots, "batch": batch, "chunk": chunk, "sequences": seqs, "generated_tokens": tokens,
           "tokens_per_s": tokens / wall if wall > 0 else None, "wall_s": wall, "startup_s": t1 - t0,
           "restarts": restarts, "error": error, "metrics": metrics.to_json() if metrics is not None else None}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        for i, d in zip(sorted(results), seqs):
            print(f"sequence {i}: prompt {d['prompt']} -> {d['tokens']} ({d['finish']})"
                  + (f" {d['text']!r}" if "text" in d else ""))
        print(f"{tokens} tokens in {wall:.3f} s ({doc['tokens_per_s'] or 0:.1f} tokens/s), {plan.num_stages} "
              f"stage(s), " + (f"{batch} sequences a micro-batch, " if batch > 1 else "")
              + (f"prompts {chunk} tokens a step, " if chunk > 1 else "")
              + f"backend {backend}, restarts {restarts}")
        if metrics is not None:
            print(metrics.table())
    if error:
        print(f"tvmpipe generate: error: {error}", file=sys.stderr)
        return 1
    return 0
