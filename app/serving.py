"""`tvmpipe serve`: an OpenAI-compatible HTTP endpoint over a decode-step bundle run as K stages.

    tvmpipe serve BUNDLE --stages 2 --local                       # http://127.0.0.1:8000/v1
    TVMPIPE_API_KEY=... tvmpipe serve BUNDLE --address auto --host 0.0.0.0 --port 8000

The pipeline starts once; /v1/completions and /v1/chat/completions (streaming or not), /v1/models,
/health and /metrics are served until SIGTERM, which drains the requests in flight. This module
parses and prints; the server is tvmpipe.serve (docs/serving.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import ipaddress
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from tvmpipe.app.args import (COUNT, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, add_cluster_args, add_kv_tokens_arg,
                              cluster_options, number)
from tvmpipe.core.errors import TvmpipeError

PORT = number(int, 0, maximum=65535, what="a port number")  # 0: any free port; the ready line says which
NICE = number(int, 0, maximum=19, what="a nice increment")


DEFAULT_MAX_BODY = 1 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    s = subparsers.add_parser(
        "serve", help="serve a decode-step bundle over HTTP with the OpenAI API (completions, chat, streaming)",
        description="Run BUNDLE (a decode step) as K pipeline stages and serve it with the OpenAI protocol: "
                    "/v1/completions, /v1/chat/completions (through the tokenizer's chat template), /v1/models, "
                    "/health and /metrics. Each request joins the running pipeline as soon as a sequence row frees. "
                    "SIGTERM stops taking requests and lets the running ones finish (--drain-timeout).")
    s.add_argument("bundle", help="decode-step bundle directory")
    s.add_argument("--stages", "-k", type=COUNT, default=2, help="number of stages K (default 2)")
    s.add_argument("--plan", metavar="PLAN.json", help="plan from `tvmpipe partition -o` (overrides --stages)")
    s.add_argument("--slots", type=COUNT, help="slots each stage holds caches for (default: the window)")
    s.add_argument("--in-flight", type=COUNT, help="sequences in rows at once (default: all the slots hold)")
    add_kv_tokens_arg(s)
    s.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer directory (tokenizer.json, ...) instead of "
                   "the bundle's; without either, prompts are token ids and responses carry token ids")
    s.add_argument("--served-model-name", metavar="NAME", help="the model's name in /v1/models and in requests "
                   "(default: the bundle directory's name)")
    h = s.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: this machine "
                   "only; 0.0.0.0 for every interface, with an API key)")
    h.add_argument("--port", type=PORT, default=8000, help="port (default 8000; 0: any free one)")
    h.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on every endpoint but "
                   "/health (default: the environment variable TVMPIPE_API_KEY; prefer it, a command line is "
                   "visible to every user of the machine)")
    h.add_argument("--max-waiting", type=NON_NEGATIVE_INT, default=64, help="requests that may wait while every "
                   "sequence row is busy; more are answered 429 (default 64)")
    h.add_argument("--max-body-bytes", type=COUNT, default=DEFAULT_MAX_BODY, help="request bodies past this "
                   f"are answered 413 (default {DEFAULT_MAX_BODY})")
    h.add_argument("--drain-timeout", type=NON_NEGATIVE, default=30.0, help="on SIGTERM, seconds the running "
                   "requests may take to finish before they are cancelled (default 30)")
    h.add_argument("--header-timeout", type=POSITIVE, default=10.0, help="seconds a connection may take to send a "
                   "request's line and headers before it is closed (default 10)")
    h.add_argument("--body-timeout", type=POSITIVE, default=30.0, help="seconds a request's body may take to "
                   "arrive after its headers before it is answered 408 (default 30)")
    h.add_argument("--keep-alive-timeout", type=POSITIVE, default=5.0, help="seconds an idle connection is kept "
                   "open between requests (default 5)")
    h.add_argument("--http-nice", type=NICE, default=10, help="the HTTP process's CPU priority below the engine's "
                   "and the stages' (a nice increment, 0..19; default 10; 0: the same): where they share cores, the "
                   "pipeline's next step runs before the HTTP process relays the last one's tokens")
    add_cluster_args(s)
    s.set_defaults(func=serve_command)


# The layers below name the fields they check (core.errors.FieldError); this command's names for them
FIELD_FLAGS = {"kv_tokens": "--kv-tokens"}


def serve_command(args: argparse.Namespace) -> int:
    from tvmpipe.core.errors import FieldError

    try:
        return _serve(args)
    except FieldError as exc:  # one line, naming the option
        raise TvmpipeError(exc.render(FIELD_FLAGS)) from None


def _serve(args: argparse.Namespace) -> int:
    from tvmpipe.app.connect import check_where
    from tvmpipe.app.decoding import bundle_codec
    from tvmpipe.app.sources import choose_plan
    from tvmpipe.generation.engine_process import EngineProcess
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor.kvpool import requested_pages
    from tvmpipe.generation import layout_of
    from tvmpipe.serve.server import API_KEY_ENV, ServeSettings, bind, serve

    api_key = _api_key(args.api_key, os.environ.get(API_KEY_ENV), API_KEY_ENV)  # before anything is loaded
    options = cluster_options(args)
    check_where(options)
    bundle = load_bundle(args.bundle)
    layout = layout_of(bundle)
    if args.kv_tokens is not None:  # a paged step's pool, checked before anything starts
        requested_pages(bundle, args.kv_tokens)
    codec = bundle_codec(bundle, layout, args.tokenizer)
    model = args.served_model_name or Path(args.bundle).resolve().name
    settings = ServeSettings(model=model, host=args.host, port=args.port, api_key=api_key,
                             max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                             drain_timeout=args.drain_timeout, in_flight=args.in_flight,
                             header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                             keep_alive_timeout=args.keep_alive_timeout, http_nice=args.http_nice)
    plan = choose_plan(bundle, args.plan, args.stages, "equal")  # equal cuts, moved off the state pairs
    if api_key is None and not _loopback(args.host):
        print(f"tvmpipe serve: warning: listening on {args.host} without an API key: anyone who reaches this port "
              f"can use the model (set {API_KEY_ENV})", file=sys.stderr)
    sock = bind(args.host, args.port)  # a busy port fails here, before any stage starts
    engine = None
    try:
        opener = functools.partial(open_served_engine, options, args.bundle, plan, args.slots, args.tokenizer,
                                   args.in_flight, args.kv_tokens)
        engine = EngineProcess(opener, layout, max_waiting=args.max_waiting)

        def ready(url: str, rows: int) -> None:
            print(f"tvmpipe serve: {model} on {url}/v1 ({plan.num_stages} stage(s), backend {engine.backend}, "
                  f"{rows} sequence rows, max context {layout.max_context}, "
                  + (f"KV pool {engine.kv_tokens} tokens, " if engine.kv_tokens is not None else "")
                  + f"{'a tokenizer' if codec is not None else 'token ids only (no tokenizer)'}"
                  f"{', API key required' if api_key else ''})", flush=True)

        return serve(engine, codec, settings, sock, on_ready=ready)
    finally:
        if engine is not None:
            engine.close()
        sock.close()


@contextlib.contextmanager
def open_served_engine(options: Any, bundle_path: str, plan: Any, slots: int | None, tokenizer: str | None,
                       in_flight: int | None, kv_tokens: int | None = None) -> Iterator[Any]:
    """The engine `tvmpipe serve` runs, opened in its own process (generation.engine_process): the
    bundle and its tokenizer loaded there again, the pipeline on the cluster the options chose
    (a paged step's pool `kv_tokens`, or sized by the stages' free memory), and the Engine over it
    (its output processor detokenizes there). A field refused there is named by this command's
    option: the message crosses to the server's process as text."""
    from tvmpipe.app.decoding import bundle_codec, open_decode_pipeline
    from tvmpipe.bundle import load_bundle
    from tvmpipe.core.errors import FieldError
    from tvmpipe.generation import layout_of
    from tvmpipe.generation.engine import Engine

    bundle = load_bundle(bundle_path)
    codec = bundle_codec(bundle, layout_of(bundle), tokenizer)
    try:
        with open_decode_pipeline(options, bundle, plan, slots=slots, scores=True, kv_tokens=kv_tokens) as opened:
            engine = Engine(opened.pipe, codec, in_flight=in_flight)
            engine.backend = opened.backend
            yield engine
    except FieldError as exc:
        raise TvmpipeError(exc.render(FIELD_FLAGS)) from None


def _api_key(given: str | None, env: str | None, env_name: str) -> str | None:
    """The API key: --api-key, else the environment's; None when neither is set. An empty (or
    blank) one is refused: it would turn authentication off without a word."""
    for value, where in ((given, "--api-key"), (env, env_name)):
        if value is None:
            continue
        if not value.strip():
            raise TvmpipeError(f"{where} is empty: give a key, or unset it to serve without one")
        return value
    return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
