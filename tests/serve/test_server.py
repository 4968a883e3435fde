"""`tvmpipe serve` end to end, one server for the module (conftest.py `server`: 2 stage processes, 4
sequence rows and 12 more waiting, a ChatML tokenizer, an API key), talked to by clients tvmpipe did
not write: the official `openai` client and raw `httpx`.

Oracles: an offline Generator run of the same requests on a pipeline of its own (`offline`) and a
`tvmpipe generate` run, for tokens; transformers' AutoTokenizer over the same tokenizer files, for
text and prompt ids."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
import transformers

from tests.serve.harness import API_KEY, EOS, MODEL, ROOT, ServerProcess, metric, slowed, sse_events, streamed_tokens
from tvmpipe.executor.sampler import Sampling

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]

MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def oracle(chat_tokenizer):
    return transformers.AutoTokenizer.from_pretrained(str(chat_tokenizer), local_files_only=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120)


def wait_metric(server, name: str, ok, timeout: float = 30.0, **labels) -> float:
    deadline = time.time() + timeout
    while True:
        value = metric(server.metrics(), name, **labels)
        if ok(value):
            return value
        assert time.time() < deadline, f"{name} stayed at {value}"
        time.sleep(0.1)


# ---- the official client ----------------------------------------------------------------------------

def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completions_plain_and_streamed(client, oracle, offline):
    """A text prompt, greedy: the prompt ids are the tokenizer's, the tokens the offline run's,
    the text the tokens' decoding; streamed, the same text in pieces, finish_reason on the last
    choice chunk, then the usage chunk."""
    prompt = "Hello world, the quick fox"
    ids = oracle.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    want = offline([(ids, 10, Sampling(), (EOS,))])[0]
    assert choice.prompt_token_ids == ids and choice.token_ids == want
    assert choice.text == oracle.decode(want, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if want[-1] == EOS else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(want),
                                                                                        len(ids) + len(want))
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    # (outputs that arrive before the stream writes are merged: a reader behind may get all in one chunk)
    assert finishes[-1] == choice.finish_reason and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts(client, offline):
    r = client.completions.create(model=MODEL, prompt=[5, 17, 3], max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == offline([([5, 17, 3], 6, Sampling(), ())])[0]
    assert r.usage.prompt_tokens == 3 and r.choices[0].finish_reason == "length"


def test_chat_plain_and_streamed(client, oracle, offline):
    """The chat goes through the tokenizer's template (the ids transformers' apply_chat_template
    gives); seeded sampling gives the offline run's tokens; streamed: the role first, the same
    content in deltas."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    ids = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0.9, top_p=0.95, seed=5)
    r = client.chat.completions.create(**kw, extra_body={"top_k": 40, "return_token_ids": True})
    want = offline([(ids, 8, Sampling(0.9, 40, 5, 0.95), (EOS,))])[0]
    choice = r.choices[0]
    assert choice.prompt_token_ids == ids and choice.token_ids == want and r.usage.prompt_tokens == len(ids)
    assert choice.message.role == "assistant" and choice.message.content == oracle.decode(want, skip_special_tokens=True)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"top_k": 40}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_stop_strings_end_the_sequence_unsent(client, oracle):
    """A stop string cuts the text before it, never sending it, and ends with finish_reason stop."""
    base = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=16, temperature=0, stop=[stop, "zzzz"],
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
    assert stop not in r.choices[0].text and len(r.choices[0].token_ids) < 16
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=16, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_unsupported_parameters_are_refused_with_openai_errors(client):
    for kw, param in [({"suffix": "end"}, "suffix"), ({"extra_body": {"functions": [{"name": "f"}]}}, "functions")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **kw)
        assert info.value.param == param and info.value.code == "unsupported_parameter", kw
    for kw, param, says in [({"n": 17}, "n", "n must be"), ({"logprobs": 21}, "logprobs", "logprobs must be"),
                            ({"best_of": 1, "n": 2}, "best_of", "best_of"),
                            ({"logit_bias": {"999": 1}}, "logit_bias", "logit_bias names token id 999, outside the vocabulary"),
                            ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias of token 5 must be a number in [-100, 100]"),
                            ({"extra_body": {"min_tokens": 3}}, "min_tokens", "min_tokens")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **kw)
        assert info.value.param == param and says in info.value.message, (kw, info.value.message)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       top_logprobs=21)
    assert info.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["one", ""], max_tokens=2)
    assert info.value.param == "prompt" and "prompt[1]" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hello")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", top_p=1.5)
    assert info.value.param == "top_p" and "top_p must be" in info.value.message


def test_structured_output_a_tokenizer_cannot_drive_is_400_before_it_runs(server, client):
    """The test tokenizer (a Metaspace BPE) is not one llguidance can read: a request for a JSON
    object or schema is a 400 naming response_format and saying why, before it runs (it used to
    run, and fail as a 500), and the server serves on. (A tokenizer llguidance reads that cannot
    write '{': tests/serve/test_scoring.py.)"""
    before = metric(server.metrics(), "tvmpipe_requests_submitted_total")
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string"}}}}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"response_format": fmt})
        assert info.value.param == "response_format" and "cannot drive structured output" in info.value.message
        assert "Metaspace" in info.value.message
    assert metric(server.metrics(), "tvmpipe_requests_submitted_total") == before  # nothing was submitted
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_prompts_beyond_the_context_are_400_before_anything_runs(server, client):
    before = metric(server.metrics(), "tvmpipe_requests_submitted_total")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * (MAX_CONTEXT + 6), max_tokens=1)
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:  # prompt + max_tokens beyond the context (vLLM's rule)
        client.completions.create(model=MODEL, prompt=[5] * 60, max_tokens=10)
    assert info.value.param == "max_tokens" and "10 > 64 - 60" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fox " * 60}])
    assert info.value.param == "messages"
    assert metric(server.metrics(), "tvmpipe_requests_submitted_total") == before
    # without max_tokens the default (16) is clamped to the room left
    r = client.completions.create(model=MODEL, prompt=[5] * 60, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


# ---- raw httpx: the exact lines -----------------------------------------------------------------------

def test_sse_lines_exactly(server):
    body = {"model": MODEL, "prompt": [5, 17, 3], "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    lines = raw.split("\n")
    assert lines[-3:] == ["data: [DONE]", "", ""]  # every event: one data line, then a blank line
    events = sse_events(lines[:-1])
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # one chunk a token, or fewer where the server's reader fell behind (outputs merged into one)
    assert 1 <= len(chunks) - 1 <= 5 and [len(c["choices"]) for c in chunks] == [1] * (len(chunks) - 1) + [0]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert len(streamed_tokens(chunks)) == 5 and chunks[0]["choices"][0]["prompt_token_ids"] == [5, 17, 3]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    # without include_usage: no usage anywhere, [DONE] last
    body.pop("stream_options")
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines()]
    events = sse_events(lines + [""] if lines[-1] else lines)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])


# ---- many clients -----------------------------------------------------------------------------------

async def stream_one(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed request: its token ids and when each chunk arrived."""
    times, events = [], []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                times.append(time.time())
    assert events[-1] == "[DONE]"
    finish = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    return {"tokens": streamed_tokens(events), "times": times, "finish": finish}


def run_concurrently(server, bodies: list[dict]) -> list[dict]:
    async def main():
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(stream_one(c, b) for b in bodies))
    return asyncio.run(main())


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = now = 0
    for _, d in edges:
        now += d
        best = max(best, now)
    return best


PROMPTS16 = [[(7 * i + j) % 100 + 4 for j in range(1 + i % 5)] for i in range(16)]


@pytest.mark.parametrize("case", ["greedy", "sampled"])
def test_16_concurrent_streams_equal_offline_generation(server, offline, case):
    """16 streaming requests at once (4 rows, 12 waiting): each stream's tokens equal the offline
    run of its prompt and seed; they run side by side (at least 3 streams between their first
    and last chunk at one moment, never one after another)."""
    n = 12
    if case == "greedy":
        params = [dict(temperature=0) for _ in PROMPTS16]
        samplings = [Sampling() for _ in PROMPTS16]
    else:
        params = [dict(temperature=0.8, top_k=30, top_p=1.0 if i % 2 == 0 else 0.9, seed=100 + i)
                  for i in range(len(PROMPTS16))]
        samplings = [Sampling(p["temperature"], p["top_k"], p["seed"], p["top_p"]) for p in params]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": n, "stream": True, "return_token_ids": True, **kw}
              for p, kw in zip(PROMPTS16, params)]
    got = run_concurrently(server, bodies)
    want = offline([(p, n, s, (EOS,)) for p, s in zip(PROMPTS16, samplings)])
    assert [g["tokens"] for g in got] == want
    for g, w in zip(got, want):
        assert g["finish"] == ["stop" if w[-1] == EOS else "length"]
    assert max_overlap([(g["times"][0], g["times"][-2]) for g in got]) >= 3


def test_seeded_stream_equals_the_generate_command(server, serve_bundle):
    """`tvmpipe generate --seed S` of one prompt (keyed 0) gives the tokens of the served request
    with the same seed."""
    prompt, n = [9, 44, 3], 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0.7, "top_k": 50, "seed": 1234,
            "return_token_ids": True, "stream": True}
    got = run_concurrently(server, [body])[0]["tokens"]
    done = subprocess.run([sys.executable, "-m", "tvmpipe", "generate", str(serve_bundle), "--processes", "--stages", "2",
                           "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(n), "--temperature",
                           "0.7", "--top-k", "50", "--seed", "1234", "--stop-token", str(EOS), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["sequences"][0]["tokens"] == got


@pytest.fixture(scope="module")
def slow_server(serve_bundle, tmp_path_factory):
    """A server like `server` (4 rows, 12 more may wait) whose stages take 50 ms a step
    (tests/support/slowstage): a 60-token stream lasts at least 6 s on any machine, however fast."""
    log = tmp_path_factory.mktemp("slow-server") / "stderr.txt"
    srv = ServerProcess(serve_bundle, "--stages", "2", "--processes", "--max-waiting", "12", log_path=log,
                        env={"TVMPIPE_API_KEY": API_KEY, **slowed(0.05)}, api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_past_the_wait_bound_is_429_and_disconnects_free_rows(slow_server):
    """16 long streams fill the 4 rows and the 12 places in the queue: a 17th is 429 (OpenAI
    error JSON), counted in /metrics. Closing the 16 streams (clients gone) cancels their
    sequences: every row is free again and no request is left, in /metrics. The stages are slowed
    so that no stream can end before the 17th is sent."""
    server = slow_server
    m0 = server.metrics()
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120,
                                     limits=httpx.Limits(max_connections=20)) as c:
            opened = []
            for _ in range(16):
                cm = c.stream("POST", "/v1/completions", json=body)
                r = await cm.__aenter__()
                assert r.status_code == 200
                opened.append(cm)
            extra = await c.post("/v1/completions", json=body)
            for cm in opened:
                await cm.__aexit__(None, None, None)
            return extra

    extra = asyncio.run(main())
    assert extra.status_code == 429, extra.text
    err = extra.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error" and "12 requests" in err["message"]
    m = server.metrics()
    assert metric(m, "tvmpipe_requests_rejected_total") == metric(m0, "tvmpipe_requests_rejected_total") + 1
    assert metric(m, "tvmpipe_http_responses_total", code=429) >= 1
    wait_metric(server, "tvmpipe_requests_running", lambda v: v == 0)
    wait_metric(server, "tvmpipe_requests_waiting", lambda v: v == 0)
    m = server.metrics()
    assert metric(m, "tvmpipe_rows_free") == 4
    assert metric(m, "tvmpipe_requests_cancelled_total") - metric(m0, "tvmpipe_requests_cancelled_total") >= 12
    assert metric(m, "tvmpipe_generation_tokens_total") - metric(m0, "tvmpipe_generation_tokens_total") < 16 * 60


def test_a_disconnected_client_frees_its_row(server):
    """A streaming client that reads its first chunk and leaves, and a non-streaming one that gives
    up waiting: each sequence is cancelled (before its 60-odd tokens) and its row frees, in /metrics."""
    body = {"model": MODEL, "prompt": [7, 8], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    m0 = server.metrics()
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[len("data: "):])["choices"][0]["finish_reason"] is None  # running
    wait_metric(server, "tvmpipe_requests_cancelled_total",
                lambda v: v == metric(m0, "tvmpipe_requests_cancelled_total") + 1)
    wait_metric(server, "tvmpipe_rows_free", lambda v: v == 4)
    with server.client(timeout=httpx.Timeout(120, read=0.05)) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={**body, "max_tokens": 62, "prompt": [9, 9]})
    wait_metric(server, "tvmpipe_requests_cancelled_total",
                lambda v: v == metric(m0, "tvmpipe_requests_cancelled_total") + 2)
    wait_metric(server, "tvmpipe_rows_free", lambda v: v == 4)
    m = server.metrics()
    assert metric(m, "tvmpipe_generation_tokens_total") - metric(m0, "tvmpipe_generation_tokens_total") < 60 + 62
    assert metric(m, "tvmpipe_http_responses_total", code=499) >= 1


# ---- safety -------------------------------------------------------------------------------------------

def test_the_api_key(server):
    """Every endpoint but /health needs the key (401 with OpenAI's error JSON without it or with a
    wrong one); /health is open; the ready line says 127.0.0.1 (the default bind)."""
    assert server.url.startswith("http://127.0.0.1:")
    body = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    for headers in ({}, {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": "Bearer"},
                    {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")):
            r = httpx.request(method, server.url + path, headers=headers, json=body, timeout=30)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(server.url + "/v1/models", headers=server.headers, timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base, api_key="wrong", max_retries=0).models.list()


def test_bodies_past_the_bound_are_413(server):
    """The server's bound is 64 KiB: a larger body is 413, said from its Content-Length before any
    of it is read, and from the bytes themselves for a chunked body (no Content-Length)."""
    big = json.dumps({"model": MODEL, "prompt": "x" * 70000})
    r = httpx.post(server.url + "/v1/completions", content=big, headers={**server.headers,
                   "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192].encode()

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={**server.headers,
                   "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "65536 bytes" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 1}),
                    headers={**server.headers, "content-type": "application/json"}, timeout=30)
    assert ok.status_code == 200


def test_bad_bodies_are_openai_errors(server):
    with server.client() as c:
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert c.get("/v1/nothing").status_code == 404
        assert set(c.get("/v1/nothing").json()["error"]) == {"message", "type", "param", "code"}
        assert c.get("/v1/completions").status_code == 405


def test_no_torch_or_transformers_at_run_time(server):
    """The server (and its stage processes) run under `python -X importtime`: the modules they
    imported include the server's own and neither torch nor transformers. Runs last: by now every
    route has been served."""
    names = [m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", server.log(), re.M)]
    assert "tvmpipe.serve.app" in names and "tokenizers" in names and "tvmpipe.executor.stage" in names
    assert not [n for n in names if n.split(".")[0] in ("torch", "transformers")]
