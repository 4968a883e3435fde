"""`tvmpipe serve` and `tvmpipe generate` on a paged decode step (issue 53): the serve tests' GPT-2
compiled with `--kv paged` (pages of 16 in a pool of 8: 128 tokens for 4 rows of up to 64, half
of what static caches hold), concurrent streams sharing a prompt prefix give the static step's
offline tokens, and /metrics and --json report the pool per stage."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from tests.serve.harness import MODEL, ROOT, ServerProcess, metric, sse_events, streamed_tokens

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]

PAGE, PAGES = 16, 8
PREFIX = list(range(10, 26))  # one full page every prompt begins with
PROMPTS = [PREFIX + [40 + i, 50 + i] for i in range(8)]
NEW = 20


@pytest.fixture(scope="module")
def paged_bundle(tmp_path_factory):
    from tvmpipe.compiler.decoders import DEFAULT_MAX_CONTEXT, KvOptions
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    out = tmp_path_factory.mktemp("paged_bundle") / "gpt2_paged"
    export("gpt2", progress=Progress(stream=None), decode=DEFAULT_MAX_CONTEXT, seed=1,
           kv=KvOptions("paged", page_size=PAGE, pages=PAGES)).write(out)
    return out


def test_a_paged_server_streams_the_static_tokens_and_reports_its_pool(paged_bundle, offline, tmp_path):
    """8 concurrent streams over 4 rows: every stream's tokens equal the static step's offline run;
    /metrics gives each stage's pool (128 tokens), none held once they end, the shared first page
    reused by the requests admitted after the first ones confirmed it."""
    from tvmpipe.executor.sampler import Sampling

    want = offline([(p, NEW, Sampling(), ()) for p in PROMPTS])
    srv = ServerProcess(paged_bundle, "--stages", "2", "--processes", log_path=tmp_path / "stderr.txt")
    try:
        async def one(c, prompt):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "stream": True, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                return streamed_tokens(sse_events([line async for line in r.aiter_lines()]))

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                return await asyncio.gather(*(one(c, p) for p in PROMPTS))

        got = asyncio.run(run())
        assert got == want
        m = srv.metrics()
        for stage in (0, 1):
            assert metric(m, "tvmpipe_kv_tokens_total", stage=stage) == PAGE * PAGES
            assert metric(m, "tvmpipe_kv_tokens_held", stage=stage) == 0
            assert metric(m, "tvmpipe_kv_prefix_hit_tokens_total", stage=stage) >= PAGE  # a later request's hit
            assert metric(m, "tvmpipe_kv_tokens_cached", stage=stage) > 0
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_generate_json_reports_the_pool(paged_bundle, offline):
    from tvmpipe.executor.sampler import Sampling

    done = subprocess.run([sys.executable, "-m", "tvmpipe", "generate", str(paged_bundle), "--processes",
                           "--stages", "2", "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens",
                           str(NEW), "--ignore-eos", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["sequences"][0]["tokens"] == offline([(PROMPTS[0], NEW, Sampling(), ())])[0]
    assert doc["kv"]["kv_tokens_total"] == PAGE * PAGES and doc["kv"]["kv_tokens_held"] == 0
