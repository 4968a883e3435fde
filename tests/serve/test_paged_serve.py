"""`tvmpipe serve` and `tvmpipe generate` on a paged decode step with its pool sized at run time
(issue 53, `--kv-tokens`). The zoo's Llama compiled as the issue's capacity case (`--max-context
2048 --batch 8 --kv paged`, pages of 16) with a compiled pool of 136 pages (2176 tokens), run:

* by one server with `--kv-tokens 2048` (smaller than compiled: 128 pages, less than one eighth of
  what 8 rows of static caches at 2048 hold): concurrent streams sharing a prompt prefix, and the
  issue's capacity proof (16 requests of 40 tokens at once, at least 8 rows busy together), every
  text the static step's offline tokens; /metrics reports the run-time pool;
* by `tvmpipe generate --kv-tokens 8192` (larger than compiled): the static tokens, and `--json`
  reports the run-time pool; values the bundle cannot take are one line naming --kv-tokens.

The static reference is the same Llama (same weights) compiled with static caches at a max context
of 64, which every sequence here stays under (rotary positions: the context is only a bound).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serve.harness import MODEL, ROOT, ServerProcess, metric, sse_events, streamed_tokens
from tvmpipe.generation.requests import Request

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]

T, BATCH, PAGE, COMPILED_PAGES = 2048, 8, 16, 136
SERVED_TOKENS, LARGER_TOKENS = 2048, 8192
PREFIX = list(range(10, 26))  # one full page every prompt begins with
PROMPTS = [PREFIX + [40 + i, 50 + i] for i in range(8)]
NEW = 20
CAPACITY = [[(11 * i + 5 * j) % 120 + 4 for j in range(8)] for i in range(16)]  # 16 requests of 8 + 32 tokens
CAPACITY_NEW = 32


def _llama(out, decode: int, kv):
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    export("llama", progress=Progress(stream=None), decode=decode, batch=BATCH, seed=1, kv=kv).write(out)
    return out


@pytest.fixture(scope="module")
def paged_bundle(tmp_path_factory):
    from tvmpipe.compiler.decoders import KvOptions

    return _llama(tmp_path_factory.mktemp("paged") / "llama_paged", T, KvOptions("paged", page_size=PAGE,
                                                                                   pages=COMPILED_PAGES))


@pytest.fixture(scope="module")
def static_bundle(tmp_path_factory):
    from tvmpipe.compiler.decoders import KvOptions

    return _llama(tmp_path_factory.mktemp("static") / "llama_static", 64, KvOptions("static"))


@pytest.fixture(scope="module")
def offline(static_bundle):
    """`offline(prompts, new)`: each prompt's greedy tokens from the static step (Generator on a
    pipeline of its own, K = 2), each keyed 0 as a one-prompt `tvmpipe generate` keys its prompt."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator, layout_of

    with Pipeline(static_bundle, 2, launcher="process", logits=False) as pipe:
        gen, layout = Generator(pipe), layout_of(pipe.bundle)
        yield lambda prompts, new: [r.tokens for r in gen.generate_all(
            [Request.checked(p, new, layout, key=0) for p in prompts])]


@pytest.fixture(scope="module")
def server(paged_bundle, tmp_path_factory):
    srv = ServerProcess(paged_bundle, "--stages", "2", "--processes", "--kv-tokens", str(SERVED_TOKENS),
                        log_path=tmp_path_factory.mktemp("paged_server") / "stderr.txt")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


async def _stream(c: httpx.AsyncClient, prompt: list[int], new: int) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": new, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        return streamed_tokens(sse_events([line async for line in r.aiter_lines()]))


def test_a_served_pool_smaller_than_compiled_streams_the_static_tokens(server, offline):
    """The first request alone, then 7 sharing its prompt's first page at once: every stream's
    tokens equal the static step's offline run; /metrics gives each stage's run-time pool (2048
    tokens, not the compiled 2176), none held once they end, the shared page reused."""
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            first = await _stream(c, PROMPTS[0], NEW)  # its pages confirmed: the others share the first
            return [first, *await asyncio.gather(*(_stream(c, p, NEW) for p in PROMPTS[1:]))]

    assert asyncio.run(run()) == offline(PROMPTS, NEW)
    assert f"max context {T}, KV pool {SERVED_TOKENS} tokens, " in server.stdout[0]  # the ready line
    m = server.metrics()
    for stage in (0, 1):
        assert metric(m, "tvmpipe_kv_tokens_total", stage=stage) == SERVED_TOKENS
        assert metric(m, "tvmpipe_kv_tokens_held", stage=stage) == 0
        assert metric(m, "tvmpipe_kv_prefix_hit_tokens_total", stage=stage) >= 7 * PAGE  # each later request's hit
        assert metric(m, "tvmpipe_kv_tokens_cached", stage=stage) > 0


def test_the_issues_capacity_proof_through_a_server(server, offline):
    """Max context 2048, batch 8, a pool of 2048 tokens: 16 requests of 8 prompt tokens and 32 to
    generate, all at once. At least 8 rows are busy together (/metrics' running gauge, polled),
    which static caches would hold as 8 x 2048 tokens (16 x 2048 for all 16), and every text is the
    static step's."""
    rows = metric(server.metrics(), "tvmpipe_rows")
    busy = [0]
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not done.is_set():
                text = c.get("/metrics").text
                running = next(float(line.split()[-1]) for line in text.splitlines()
                               if line.startswith("tvmpipe_requests_running"))
                busy[0] = max(busy[0], int(running))
                time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(_stream(c, p, CAPACITY_NEW) for p in CAPACITY))

    try:
        got = asyncio.run(run())
    finally:
        done.set()
        watcher.join(30)
    assert got == offline(CAPACITY, CAPACITY_NEW)
    assert busy[0] >= BATCH, busy[0]
    assert rows >= 16 and busy[0] * T > SERVED_TOKENS  # a static cache for each busy row: far more than the pool
    m = server.metrics()
    assert metric(m, "tvmpipe_kv_tokens_total", stage=0) == SERVED_TOKENS
    assert metric(m, "tvmpipe_kv_tokens_held", stage=0) == 0


def _generate(bundle, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmpipe", "generate", str(bundle), "--processes", "--stages", "2",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_generate_runs_a_pool_larger_than_compiled_and_reports_it(paged_bundle, offline):
    done = _generate(paged_bundle, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", str(NEW),
                     "--ignore-eos", "--kv-tokens", str(LARGER_TOKENS), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["sequences"][0]["tokens"] == offline([PROMPTS[0]], NEW)[0]
    assert doc["kv"]["kv_tokens_total"] == LARGER_TOKENS and doc["kv"]["kv_tokens_held"] == 0
    assert doc["kv_pool"]["pages"] == LARGER_TOKENS // PAGE and doc["kv_pool"]["requested"] == LARGER_TOKENS


@pytest.mark.parametrize("which, tokens, says", [
    ("paged", "2000", "--kv-tokens 2000: a pool of 125 pages of 16 tokens (2000 tokens) holds less than one row at "
                      "the max context (2048)"),
    ("static", "4096", "--kv-tokens sizes a paged KV pool, and this bundle's decode step keeps static caches "
                       "(compile it with --kv paged)"),
])
def test_generate_refuses_a_pool_the_bundle_cannot_take_in_one_line(paged_bundle, static_bundle, which, tokens, says):
    done = _generate(paged_bundle if which == "paged" else static_bundle, "--prompt-ids", "5,6", "--kv-tokens", tokens)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"tvmpipe generate: error: {says}"]
