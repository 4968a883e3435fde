"""`tvmpipe generate`: text (or token ids) in, text out, from a decode-step bundle run as K pipeline
stages that keep their KV caches.

    tvmpipe generate BUNDLE --local --prompt "The capital of France is"          # streams the text
    tvmpipe generate BUNDLE --local --chat --prompt "Hi!" --system "Be brief."   # the chat template
    tvmpipe generate BUNDLE --local --prompt-ids 5,17,3 --max-new-tokens 8 --json
    tvmpipe generate BUNDLE --address auto --prompts-file in.jsonl --output out.jsonl   # a batch job

Text goes through the bundle's tokenizer (`tvmpipe compile DIR` copies a checkpoint's; `--tokenizer
DIR` overrides) with the `tokenizers` library; nothing is downloaded. `--json` prints one JSON document
and nothing else on stdout (Ray's own lines go to stderr). A batch job writes one line per prompt to
its output as each sequence finishes, and a rerun skips what the output already holds. This module
parses and prints; app/generating.py runs it (docs/generation.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from typing import Iterator

from tvmpipe.app.args import (COUNT, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, add_cluster_args, add_kv_tokens_arg,
                              cluster_options)
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
        "generate", help="generate text with a decode-step bundle run as a pipeline (KV caches stay on the stages)",
        description="Run BUNDLE (a decode step with declared state and a generation section) as K pipeline stages "
                    "that keep their KV caches: prompts go in, each sequence's tokens are drawn on the last stage "
                    "and fed back, and several sequences are in flight so every stage stays busy.")
    g.add_argument("bundle", help="decode-step bundle directory")
    g.add_argument("--stages", "-k", type=COUNT, default=2, help="number of stages K (default 2)")
    g.add_argument("--plan", metavar="PLAN.json", help="plan from `tvmpipe partition -o` (overrides --stages; "
                   "it must keep every state pair in one stage)")
    p = g.add_argument_group("prompts")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt as text (repeatable)")
    p.add_argument("--prompt-ids", type=token_ids, action="append", default=[], metavar="ID,ID,...",
                   help="a prompt as token ids (repeatable)")
    p.add_argument("--chat", action="store_true", help="each --prompt is a user message, through the checkpoint's "
                   "chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat (or a prompts file's \"messages\" lines): a system "
                   "message first")
    p.add_argument("--prompts-file", metavar="IN.jsonl", help="a batch job: one JSON object a line, {\"prompt\": "
                   "TEXT} or {\"prompt_ids\": [...]} or {\"messages\": [...]}, optionally with an \"id\"; needs --output")
    p.add_argument("--output", metavar="OUT.jsonl", help="with --prompts-file: one line per prompt, written as each "
                   "sequence finishes; a rerun skips the ids already there")
    p.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer directory (tokenizer.json, ...) instead of "
                   "the bundle's")
    s = g.add_argument_group("sampling and stopping")
    s.add_argument("--max-new-tokens", type=COUNT, default=16, help="tokens to generate per sequence (default 16)")
    s.add_argument("--temperature", type=NON_NEGATIVE, default=0.0, help="0 (default): greedy; else sample")
    s.add_argument("--top-k", type=NON_NEGATIVE_INT, default=0, help="sample among the K most likely (0: all)")
    s.add_argument("--top-p", type=POSITIVE, default=1.0, help="sample among the most likely tokens that reach this "
                   "probability (1, the default: all)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i draws from (seed, i))")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a sequence where this text appears; it is not shown (repeatable)")
    s.add_argument("--stop-token", type=token_id, action="append", default=[], metavar="ID",
                   help="end a sequence after this token (repeatable; the checkpoint's eos ids always stop it)")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop on the checkpoint's eos ids")
    r = g.add_argument_group("run")
    r.add_argument("--in-flight", type=COUNT, help="sequences in flight (default: all the slots hold; more are "
                   "queued; a bundle compiled with --batch B runs B a micro-batch, so this is rounded up to whole "
                   "batches)")
    r.add_argument("--slots", type=COUNT, help="slots each stage holds caches for, each one micro-batch's sequences "
                   "(1, or the bundle's --batch B) (default: the window)")
    r.add_argument("--json", action="store_true", help="print one JSON document, and nothing else, on stdout")
    add_kv_tokens_arg(r)
    add_cluster_args(g)
    g.set_defaults(func=generate_command)


@contextmanager
def stdout_reserved(reserve: bool) -> Iterator[None]:
    """With `reserve`: while the block runs, stdout (file descriptor 1 and sys.stdout) points at
    stderr, so whatever Ray, its workers' forwarded logs or a library prints lands there; the caller
    prints its document after the block, alone on stdout."""
    if not reserve:
        yield
        return
    sys.stdout.flush()
    saved, python = os.dup(1), sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = python
        os.dup2(saved, 1)
        os.close(saved)


# The generation layer names the fields it checks (core.errors.FieldError); this command's names for them
FIELD_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
               "max_new_tokens": "--max-new-tokens", "stop_tokens": "--stop-token", "stop": "--stop",
               "in_flight": "--in-flight", "kv_tokens": "--kv-tokens"}


def generate_command(args: argparse.Namespace) -> int:
    from tvmpipe.core.errors import FieldError

    try:
        return _generate(args)
    except FieldError as exc:  # one line, naming the option
        raise TvmpipeError(exc.render(FIELD_FLAGS)) from None


def _generate(args: argparse.Namespace) -> int:
    from tvmpipe.app.connect import check_where
    from tvmpipe.app.decoding import bundle_codec
    from tvmpipe.app.generating import GenerationRun
    from tvmpipe.app.prompts import make_prompts, prompts_from_options, read_prompts_file
    from tvmpipe.app.sources import choose_plan
    from tvmpipe.bundle import load_bundle
    from tvmpipe.core.files import JsonLines
    from tvmpipe.executor.kvpool import requested_pages
    from tvmpipe.executor.sampler import Sampling
    from tvmpipe.generation import layout_of

    options = cluster_options(args)
    check_where(options)
    if bool(args.prompts_file) != bool(args.output):
        raise TvmpipeError("--prompts-file and --output go together (a batch job reads one and writes the other)")
    if args.prompts_file and (args.prompt or args.prompt_ids):
        raise TvmpipeError("--prompts-file replaces --prompt and --prompt-ids: give one or the other")
    if args.prompts_file and args.chat:
        raise TvmpipeError("--chat is for --prompt TEXT: in a prompts file, a line with \"messages\" is a chat")
    bundle = load_bundle(args.bundle)
    layout = layout_of(bundle)
    if args.kv_tokens is not None:  # a paged step's pool, checked before anything starts
        requested_pages(bundle, args.kv_tokens)
    codec = bundle_codec(bundle, layout, args.tokenizer)
    if args.stop and codec is None:
        raise TvmpipeError("--stop TEXT needs a tokenizer: the bundle has none, give --tokenizer DIR")
    entries = (read_prompts_file(args.prompts_file) if args.prompts_file else
               prompts_from_options(args.prompt_ids, args.prompt, chat=args.chat, system=args.system, codec=codec))
    stops = list(args.stop_token) + ([] if codec is None or args.ignore_eos else list(codec.stop_token_ids))
    prompts = make_prompts(entries, layout, codec=codec, max_new_tokens=args.max_new_tokens, stop_tokens=stops,
                           sampling=Sampling(args.temperature, args.top_k, args.seed, args.top_p),
                           system=args.system, stop=args.stop)
    output = JsonLines(args.output) if args.output else None
    if output is not None:  # a rerun: what the output holds is done
        have = {r.get("id") for r in output.records if isinstance(r, dict)}
        prompts = [p for p in prompts if p.id not in have]
    plan = choose_plan(bundle, args.plan, args.stages, "equal")  # equal cuts, moved off the state pairs
    run = GenerationRun(bundle, plan, options, prompts, codec=codec, slots=args.slots, in_flight=args.in_flight,
                        kv_tokens=args.kv_tokens)
    with stdout_reserved(args.json or output is not None):
        if prompts:
            _execute(run, args, output)
    if args.json:
        print(json.dumps(run.summary(), indent=1))
    elif output is None:
        _print_summary(run)
    if output is not None:
        output.close()
        print(f"tvmpipe generate: {len(run.done)} sequence(s) written to {args.output}, "
              f"{len(entries) - len(prompts)} already there", file=sys.stderr)
    if run.error:
        print(f"tvmpipe generate: error: {run.error}", file=sys.stderr)
        return 1
    return 0


def _execute(run, args: argparse.Namespace, output) -> None:
    """Run, showing it as it goes: one text prompt streams to the terminal; otherwise each sequence
    is printed (or, in a batch job, written to the output) as it ends, with progress on stderr."""
    from tvmpipe.app.progressbar import ProgressBar

    out = sys.stdout
    stream_one = not args.json and output is None and run.codec is not None and len(run.prompts) == 1
    bar = ProgressBar(len(run.prompts), sys.stderr, enabled=output is not None)

    def on_text(i: int, piece: str) -> None:
        if stream_one:
            out.write(piece)
            out.flush()

    def on_done(f) -> None:
        if output is not None:
            output.append(f.to_json())
        elif stream_one:
            out.write("\n")
        elif not args.json:
            d = f.to_json()
            print(f"[{d['id']}] {d['text']!r}" if "text" in d else f"[{d['id']}] {d['tokens']}", f"({d['finish']})",
                  file=out, flush=True)
        bar.update(len(run.done), run.generated_tokens)

    try:
        run.execute(on_text, on_done, on_start=bar.begin)
    finally:
        bar.close()


def _print_summary(run) -> None:
    doc = run.summary()
    tokens, wall = doc["generated_tokens"], doc["wall_s"]
    print(f"{tokens} tokens in {wall:.3f} s ({doc['tokens_per_s'] or 0:.1f} tokens/s), {doc['stages']} stage(s), "
          + (f"{run.batch} sequences a micro-batch, " if run.batch > 1 else "")
          + (f"prompts {run.chunk} tokens a step, " if run.chunk > 1 else "")
          + (f"KV pool {run.kv_pool.tokens} tokens, " if run.kv_pool is not None else "")
          + f"backend {run.backend}, restarts {run.restarts}")
    if run.metrics is not None:
        print(run.metrics.table())
