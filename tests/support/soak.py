"""A seeded random soak of a real `tvmpipe serve` (issue 50, item 6): the workload that
tests/serve/test_soak.py runs briefly and bench/soak.py runs for minutes.

The plan: `plan(seed)` yields `Action`s, every value drawn from `random.Random(seed)` (what is sent,
the gaps between sends, when a client gives up), so a seed names the same requests every run; only
the machine's timing differs. An action is one of:

- "gen": a valid /v1/completions or /v1/chat/completions request, streamed (SSE) or whole; greedy
  (temperature 0) or seeded sampling from a fixed pool (both compared with the offline run), or
  unseeded / extreme-but-valid sampling (checked for form); stop strings, stop_token_ids,
  ignore_eos, include_usage; some are cut by the client: a stream closed after k events, a task
  cancelled after t seconds (a disconnect at a random moment);
- "bad": an extreme or invalid body from `BAD_CASES` (raw bytes or JSON): a 4xx with OpenAI's error
  JSON, or (cases marked "any") a 200 that is well formed;
- "probe": GET /health, /v1/models, /metrics, a 404, a 405, and a client that sends its headers and
  part of its body and leaves (seen in /metrics only: no 5xx may be counted);
- "burst": more concurrent long streams than rows + --max-waiting at once: 200s and 429s, at least
  one 429;
- "kill": (once) SIGKILL of a stage process (its pid from /metrics tvmpipe_stage_info) while
  dedicated greedy streams are open: they, and everything else in flight, must come out unchanged.

`Soak.run()` sends the plan with a bound on concurrency, watching /health and the process all along;
`Soak.finish()` waits for every row to free, checks what the server process holds (threads, fds)
against the steady state measured after the warm-up, drains it with SIGTERM (exit 0, its stage
processes gone, no /dev/shm segment of its runs left), and `verify(records, reference, decode=...)`
checks every answer: tokens against the offline reference (each (prompt ids, sampling) continued to
the context once, every request's answer cut from it by its stop tokens, max_tokens, stop strings),
the text against the tokenizer's decoding, finish reasons, the SSE framing, statuses and error bodies. Every problem is collected as one
line with the request that showed it (`Problem`), none raises on the way: a run reports all it saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import httpx

from tests.serve.harness import EOS, MODEL, metric, stage_pids
from tvmpipe.executor.sampler import Sampling
from tvmpipe.serve.metrics import parse

MAX_CONTEXT = 64
VOCAB = 128
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}

# prompts: token ids (any length up to the context), text (the harness tokenizer gives <= ~15 ids),
# chats (the ChatML template adds ~10 ids: each fits in 40)
ID_PROMPTS = [[5, 17, 3], [60], [9, 9, 9, 9], [33, 0], [100, 101, 102, 103, 104, 105, 106, 107], [7, 8],
              [2], [127, 126], [(7 * j) % 120 + 4 for j in range(40)]]
TEXT_PROMPTS = ["Hello world", "The quick brown fox", "What is the capital of France?", "a",
                "Paris is. The lazy dog.", "hello tokenizer"]
CHATS = [[{"role": "user", "content": "Hi"}],  # with the room each leaves (its prompt: 21, 45, 23, 52 ids)
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}],
         [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "fox"}]}],
         [{"role": "user", "content": "The lazy dog."}, {"role": "assistant", "content": "Paris."},
          {"role": "user", "content": "Why?"}]]
CHAT_ROOM = [43, 19, 41, 12]
# seeded samplings the offline run reproduces (temperature, top_k, seed, top_p)
SEEDED = [Sampling(0.8, 30, 7, 0.9), Sampling(1.0, 0, 99, 1.0), Sampling(0.5, 5, 2 ** 63 - 1, 0.5),
          Sampling(1.3, 128, 0, 1.0)]
STOP_STRINGS = [".", " ", "e", "o", "Pa", "zz", "\n", "or"]
STOP_IDS = [85, 102, 36, 63, 100, 7, 2]


@dataclass(frozen=True)
class BadCase:
    name: str
    endpoint: str
    body: Any = None  # JSON (sent with json=)
    raw: bytes | None = None  # or raw bytes (with Content-Type application/json)
    expect: str = "4xx"  # "4xx", or "any": a well-formed 200 or a 4xx
    method: str = "POST"


def _gen(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [5, 6], "max_tokens": 4, **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


BAD_CASES: list[BadCase] = [
    # temperature
    BadCase("temperature-tiny", COMPLETIONS, _gen(temperature=1e-308, seed=1), expect="any"),
    BadCase("temperature-tiny-chat-stream", CHAT, _chat(temperature=1e-308, seed=3, stream=True), expect="any"),
    BadCase("temperature-denormal", COMPLETIONS, _gen(temperature=5e-324, seed=1), expect="any"),
    BadCase("temperature-huge", COMPLETIONS, _gen(temperature=1e308, seed=2), expect="any"),
    BadCase("temperature-negative", COMPLETIONS, _gen(temperature=-1)),
    BadCase("temperature-string", COMPLETIONS, _gen(temperature="x")),
    BadCase("temperature-bool", COMPLETIONS, _gen(temperature=True)),
    BadCase("temperature-NaN-literal", COMPLETIONS, raw=b'{"model": "gpt2-step", "prompt": [5], "temperature": NaN}'),
    BadCase("temperature-Infinity-literal", COMPLETIONS,
            raw=b'{"model": "gpt2-step", "prompt": [5], "temperature": Infinity}'),
    BadCase("temperature-overflow-exponent", COMPLETIONS,
            raw=b'{"model": "gpt2-step", "prompt": [5], "temperature": 1e999}'),
    # top_p, top_k
    BadCase("top_p-zero", COMPLETIONS, _gen(temperature=1, top_p=0, seed=1)),
    BadCase("top_p-tiny", COMPLETIONS, _gen(temperature=1, top_p=1e-300, seed=1), expect="any"),
    BadCase("top_p-huge", COMPLETIONS, _gen(temperature=1, top_p=1e308, seed=1)),
    BadCase("top_p-negative", COMPLETIONS, _gen(temperature=1, top_p=-0.5, seed=1)),
    BadCase("top_k-negative", COMPLETIONS, _gen(temperature=1, top_k=-5, seed=1)),
    BadCase("top_k-huge", COMPLETIONS, _gen(temperature=1, top_k=10 ** 9, seed=1)),
    BadCase("top_k-float-huge", COMPLETIONS, _gen(temperature=1, top_k=1e300, seed=1)),
    BadCase("top_k-float-fraction", COMPLETIONS, _gen(temperature=1, top_k=2.5, seed=1)),
    BadCase("top_k-vocab", COMPLETIONS, _gen(temperature=1, top_k=VOCAB, seed=1), expect="any"),
    # max_tokens
    BadCase("max_tokens-zero", COMPLETIONS, _gen(max_tokens=0)),
    BadCase("max_tokens-negative", COMPLETIONS, _gen(max_tokens=-1)),
    BadCase("max_tokens-huge", COMPLETIONS, _gen(max_tokens=10 ** 9)),
    BadCase("max_tokens-2^64", COMPLETIONS, _gen(max_tokens=2 ** 64)),
    BadCase("max_tokens-float-huge", COMPLETIONS, _gen(max_tokens=1e300)),
    BadCase("max_tokens-string", COMPLETIONS, _gen(max_tokens="4")),
    BadCase("max_tokens-4301-digits", COMPLETIONS,
            raw=b'{"model": "gpt2-step", "prompt": [5], "max_tokens": 1' + b"0" * 4300 + b"}"),
    BadCase("max_completion_tokens-and-max_tokens", CHAT, _chat(max_completion_tokens=3)),
    # seed
    BadCase("seed-negative", COMPLETIONS, _gen(temperature=1, seed=-1)),
    BadCase("seed-2^64", COMPLETIONS, _gen(temperature=1, seed=2 ** 64)),
    BadCase("seed-2^63", COMPLETIONS, _gen(temperature=1, seed=2 ** 63)),
    BadCase("seed-float-huge", COMPLETIONS, _gen(temperature=1, seed=1e300)),
    # prompts
    BadCase("prompt-empty-string", COMPLETIONS, _gen(prompt="")),
    BadCase("prompt-empty-list", COMPLETIONS, _gen(prompt=[])),
    BadCase("prompt-empty-nested", COMPLETIONS, _gen(prompt=[[]])),
    BadCase("prompt-id-vocab", COMPLETIONS, _gen(prompt=[VOCAB])),
    BadCase("prompt-id-negative", COMPLETIONS, _gen(prompt=[-1])),
    BadCase("prompt-id-2^70", COMPLETIONS, _gen(prompt=[2 ** 70])),
    BadCase("prompt-id-float", COMPLETIONS, _gen(prompt=[1.5])),
    BadCase("prompt-object", COMPLETIONS, _gen(prompt={"a": 1})),
    BadCase("prompt-ids-too-long", COMPLETIONS, _gen(prompt=[5] * 200)),
    BadCase("prompt-ids-fill-context", COMPLETIONS, _gen(prompt=[5] * MAX_CONTEXT, max_tokens=None)),
    BadCase("prompt-ids-63-plus-1", COMPLETIONS, _gen(prompt=[5] * (MAX_CONTEXT - 1), max_tokens=1, temperature=0),
            expect="any"),
    BadCase("prompt-text-too-long", COMPLETIONS, _gen(prompt="fox " * 2000)),
    BadCase("prompt-lone-surrogate", COMPLETIONS, raw=b'{"model": "gpt2-step", "prompt": "a\\ud800b", "max_tokens": 2}',
            expect="any"),
    BadCase("prompt-nul-and-controls", COMPLETIONS, _gen(prompt="\x00\x01\x7f<|im_end|>", temperature=0), expect="any"),
    # chat
    BadCase("messages-empty", CHAT, _chat(messages=[]), expect="any"),
    BadCase("messages-string", CHAT, _chat(messages="hi")),
    BadCase("messages-no-content", CHAT, _chat(messages=[{"role": "user"}]), expect="any"),
    BadCase("messages-numbers", CHAT, _chat(messages=[1, 2])),
    BadCase("messages-image-part", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
    BadCase("messages-content-object", CHAT, _chat(messages=[{"role": 5, "content": {"x": 1}}]), expect="any"),
    BadCase("messages-too-long", CHAT, _chat(messages=[{"role": "user", "content": "fox " * 100}])),
    BadCase("chat_template_kwargs-string", CHAT, _chat(chat_template_kwargs="x")),
    BadCase("chat_template_kwargs-override-messages", CHAT, _chat(chat_template_kwargs={"messages": 5}), expect="any"),
    BadCase("add_generation_prompt-string", CHAT, _chat(add_generation_prompt="x")),
    BadCase("chat-on-completions", COMPLETIONS, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    # stops
    BadCase("stop-empty-string", COMPLETIONS, _gen(stop="")),
    BadCase("stop-number", COMPLETIONS, _gen(stop=[1])),
    BadCase("stop-many", COMPLETIONS, _gen(stop=[f"s{i}" for i in range(500)], temperature=0), expect="any"),
    BadCase("stop_token_ids-vocab", COMPLETIONS, _gen(stop_token_ids=[VOCAB])),
    BadCase("stop_token_ids-negative", COMPLETIONS, _gen(stop_token_ids=[-1])),
    BadCase("stop_token_ids-string", COMPLETIONS, _gen(stop_token_ids=["x"])),
    BadCase("stop_token_ids-bool", COMPLETIONS, _gen(stop_token_ids=[True])),
    BadCase("stop_token_ids-not-list", COMPLETIONS, _gen(stop_token_ids=5)),
    # other parameters
    BadCase("unknown-parameter", COMPLETIONS, _gen(frobnicate=1)),
    BadCase("n-too-many", COMPLETIONS, _gen(n=17)),
    BadCase("logprobs-too-many", COMPLETIONS, _gen(logprobs=21)),
    BadCase("top_logprobs-without-logprobs", CHAT, _chat(top_logprobs=2)),
    BadCase("presence_penalty-out-of-range", COMPLETIONS, _gen(presence_penalty=3)),
    BadCase("repetition_penalty-zero", COMPLETIONS, _gen(repetition_penalty=0)),
    BadCase("logit_bias-outside-vocab", COMPLETIONS, _gen(logit_bias={str(VOCAB): 1})),
    BadCase("logit_bias-too-large", COMPLETIONS, _gen(logit_bias={"5": 150})),
    BadCase("min_tokens-above-max_tokens", COMPLETIONS, _gen(min_tokens=9)),
    BadCase("response_format-xml", CHAT, _chat(response_format={"type": "xml"})),
    BadCase("tools-without-function", CHAT, _chat(tools=[{"type": "function"}])),
    BadCase("tools-template-writes-none", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}])),
    BadCase("tool_choice-unknown-function", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                        tool_choice={"type": "function", "function": {"name": "g"}})),
    BadCase("response_format-bad-schema", COMPLETIONS,
            _gen(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})),
    BadCase("model-missing", COMPLETIONS, {"prompt": [5]}),
    BadCase("model-other", COMPLETIONS, _gen(model="gpt-4")),
    BadCase("model-number", COMPLETIONS, _gen(model=5)),
    BadCase("stream-string", COMPLETIONS, _gen(stream="yes")),
    BadCase("stream_options-without-stream", COMPLETIONS, _gen(stream_options={"include_usage": True})),
    BadCase("stream_options-unknown", COMPLETIONS, _gen(stream=True, stream_options={"x": 1})),
    BadCase("ignore_eos-number", COMPLETIONS, _gen(ignore_eos=1)),
    # bodies
    BadCase("json-malformed", COMPLETIONS, raw=b"{not json"),
    BadCase("json-empty-body", COMPLETIONS, raw=b""),
    BadCase("json-truncated", COMPLETIONS, raw=b'{"model": "gpt2-step", "prompt": [5'),
    BadCase("json-not-utf8", COMPLETIONS, raw=b'{"model": "\xff\xfe"}'),
    BadCase("json-array", COMPLETIONS, raw=b"[1, 2]"),
    BadCase("json-null", COMPLETIONS, raw=b"null"),
    BadCase("json-string", CHAT, raw=b'"hello"'),
    BadCase("json-nested-2000", COMPLETIONS, raw=b'{"model": "gpt2-step", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"),
    BadCase("json-nested-100000", CHAT, raw=b"[" * 100000),
    BadCase("json-nested-objects", COMPLETIONS, raw=b'{"a":' * 5000 + b"1" + b"}" * 5000),
    BadCase("json-duplicate-keys", COMPLETIONS,
            raw=b'{"model": "gpt2-step", "prompt": [5], "max_tokens": 2, "max_tokens": 0}'),
    # routes
    BadCase("route-unknown", "/v1/nothing", _gen()),
    BadCase("route-get-completions", COMPLETIONS, method="GET"),
    BadCase("route-put-chat", CHAT, _chat(), method="PUT"),
]
BAD_BY_NAME = {c.name: c for c in BAD_CASES}


@dataclass
class Action:
    index: int
    gap: float  # seconds after the previous action's launch
    kind: str  # "gen", "bad", "probe", "burst", "kill"
    endpoint: str = COMPLETIONS
    method: str = "POST"
    body: Any = None
    raw: bytes | None = None
    expect: str = "ok"  # "ok" (200, or 429 when the queue is full), "4xx", "any"
    cut: tuple[str, float] | None = None  # ("close", k events) / ("cancel", seconds)
    sampling: Sampling | None = None  # reproducible by the offline run (greedy or seeded from SEEDED)
    name: str = ""
    stages: int = 0  # kill: which stage

    def describe(self) -> str:
        what = self.raw[:160].decode(errors="replace") + ("..." if self.raw and len(self.raw) > 160 else "") \
            if self.raw is not None else json.dumps(self.body)[:400] if self.body is not None else ""
        cut = f" cut={self.cut}" if self.cut else ""
        return f"#{self.index} {self.kind}{'/' + self.name if self.name else ''} {self.method} {self.endpoint}{cut} {what}"


def _gen_action(rng: random.Random, index: int, gap: float) -> Action:
    chat = rng.random() < 0.35
    body: dict[str, Any] = {"model": MODEL}
    room_hint: int
    if chat:
        k = rng.randrange(len(CHATS))
        body["messages"] = CHATS[k]
        room_hint = CHAT_ROOM[k]
    elif rng.random() < 0.55:
        prompt = rng.choice(ID_PROMPTS)
        body["prompt"] = prompt
        room_hint = MAX_CONTEXT - len(prompt)
    else:
        body["prompt"] = rng.choice(TEXT_PROMPTS)
        room_hint = 40
    r = rng.random()
    sampling: Sampling | None
    if r < 0.55:  # greedy
        sampling = Sampling()
        body["temperature"] = 0
        if rng.random() < 0.15:  # irrelevant when greedy
            body.update(top_k=rng.choice([1, 40]), top_p=0.5, seed=rng.randrange(100))
    elif r < 0.85:  # seeded, reproducible
        sampling = rng.choice(SEEDED)
        body.update(temperature=sampling.temperature, top_k=sampling.top_k, seed=sampling.seed, top_p=sampling.top_p)
    else:  # unseeded or odd but valid: form only
        sampling = None
        body.update(rng.choice([{}, {"temperature": 0.7}, {"temperature": 2.0, "top_k": 1}, {"top_p": 0.01},
                                {"temperature": 1e-3, "seed": 5}, {"temperature": 50, "seed": 6}]))
    if rng.random() < 0.2:  # log probabilities: the tokens stay the offline run's
        if chat:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 2, 5]))
        else:
            body["logprobs"] = rng.choice([0, 1, 5])
    if rng.random() < 0.12:  # penalties: other tokens than the offline run's, checked for form only
        body.update(rng.choice([{"presence_penalty": 1.0}, {"frequency_penalty": 0.5, "presence_penalty": -0.3},
                                {"repetition_penalty": 1.3}, {"repetition_penalty": 0.9, "min_p": 0.05}]))
        sampling = None
    if rng.random() < 0.1:  # several choices: choice 0 is keyed as the request alone, the others form only
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.8:
        body["max_tokens" if not chat or rng.random() < 0.5 else "max_completion_tokens"] = rng.randint(1, room_hint)
    if rng.random() < 0.35:
        stops = rng.sample(STOP_STRINGS, rng.randint(1, 2))
        body["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
    if rng.random() < 0.3:
        body["stop_token_ids"] = rng.sample(STOP_IDS, rng.randint(1, 2))
    if rng.random() < 0.4:
        body["ignore_eos"] = True
    stream = rng.random() < 0.6
    if stream:
        body["stream"] = True
        if rng.random() < 0.4:
            body["stream_options"] = {"include_usage": True}
    if sampling is not None or rng.random() < 0.7:
        body["return_token_ids"] = True
    cut = None
    c = rng.random()
    if c < 0.12 and stream:
        cut = ("close", float(rng.randint(1, 6)))
    elif c < 0.22:
        cut = ("cancel", rng.choice([0.0, 0.001, 0.005, 0.02, 0.05, 0.1]))
    return Action(index, gap, "gen", CHAT if chat else COMPLETIONS, body=body, cut=cut, sampling=sampling)


PROBES = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", f"/v1/models/{MODEL}"),
          ("GET", "/v1/models/gpt-4"), ("GET", "/nothing"), ("DELETE", "/health"),
          ("HALF", COMPLETIONS)]  # HALF: headers and part of the body on a socket, then gone (seen in /metrics only)


def plan(seed: int, *, kill_at: int | None, burst_every: int, exclude: frozenset[str] = frozenset(),
         stages: int = 2) -> Iterator[Action]:
    """The seed's actions, without end: mostly "gen", "bad" about one in six, a probe now and then,
    a burst every `burst_every` actions, the kill (once) at action `kill_at`."""
    rng = random.Random(seed)
    bad = [c for c in BAD_CASES if c.name not in exclude]
    i = 0
    while True:
        gap = min(rng.expovariate(1 / 0.015), 0.2)
        if kill_at is not None and i == kill_at:
            yield Action(i, gap, "kill", stages=rng.randrange(stages), name="stage-sigkill")
        elif burst_every and i % burst_every == burst_every // 2:
            yield Action(i, gap, "burst", name=f"burst-{rng.randrange(1 << 30)}")
        else:
            r = rng.random()
            if r < 0.17 and bad:
                case = rng.choice(bad)
                yield Action(i, gap, "bad", case.endpoint, case.method, body=case.body, raw=case.raw, expect=case.expect,
                             name=case.name, cut=("cancel", 0.003) if rng.random() < 0.05 else None)
            elif r < 0.2:
                method, path = rng.choice(PROBES)
                yield Action(i, gap, "probe", path, method, name=path)
            else:
                yield _gen_action(rng, i, gap)
        i += 1


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


@dataclass
class Record:
    action: Action
    t0: float = 0.0
    t1: float = 0.0
    status: int | None = None
    content_type: str = ""
    lines: list[str] = field(default_factory=list)  # a stream's lines as received
    text: str = ""  # a whole body
    cut: bool = False  # the client left before the end (closed or cancelled)
    complete: bool = False  # the whole response was read
    exception: str | None = None
    tag: str = ""  # "burst:<name>", "kill"


@dataclass
class Problem:
    what: str
    action: str = ""
    detail: str = ""
    case: str = ""  # the bad case's name, or the action's kind: problems are grouped by (what, case)

    def __str__(self) -> str:
        return f"{self.what}: {self.detail}" + (f"\n      request {self.action}" if self.action else "")


async def half_body(url: str, path: str, headers: dict[str, str]) -> None:
    """A client that sends the headers and a part of its body, then closes the connection."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
                 f"Content-Length: 100\r\n\r\n{{\"model\": ".encode())
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()


def proc_counts(pid: int) -> dict[str, int]:
    try:
        return {"threads": len(os.listdir(f"/proc/{pid}/task")), "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except OSError:  # gone
        return {"threads": 0, "fds": 0}


def shm_runs(pids: list[int]) -> set[str]:
    """The run ids of the tvmpipe shared-memory segments these processes map (tvmpipe-<run>-...)."""
    runs = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find("/dev/shm/tvmpipe-")
                    if at >= 0:
                        runs.add(line[at + len("/dev/shm/tvmpipe-"):].split("-")[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/tvmpipe-"):
                    runs.add(target[len("/dev/shm/tvmpipe-"):].split("-")[0])
        except OSError:
            continue
    return runs


def shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("tvmpipe-")}
    except OSError:
        return set()


def log_exceptions(text: str) -> dict[str, int]:
    """The exceptions in a server's stderr (the line that ends each traceback) and how often each came."""
    out: dict[str, int] = {}
    in_tb = False
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            in_tb = True
        elif in_tb and line and not line[0].isspace():
            if line.startswith(("During handling", "The above exception")):
                continue
            key = line[:200]
            out[key] = out.get(key, 0) + 1
            in_tb = False
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Soak:
    """One run of the plan against `srv` (a tests.serve.harness.ServerProcess)."""

    def __init__(self, srv: Any, seed: int, *, rows: int, max_waiting: int, actions: int | None = None,
                 seconds: float | None = None, deadline_s: float = 600.0, concurrency: int = 8,
                 kill_at: int | None = None, burst_every: int = 0, warmup: int = 40,
                 exclude: frozenset[str] = frozenset(), log: Callable[[str], None] = lambda s: None):
        self.srv = srv
        self.seed = seed
        self.rows = rows
        self.max_waiting = max_waiting
        self.actions = actions
        self.seconds = seconds
        self.deadline_s = deadline_s
        self.concurrency = concurrency
        self.kill_at = kill_at
        self.burst_every = burst_every
        self.warmup = warmup
        self.exclude = exclude
        self.log = log
        self.records: list[Record] = []
        self.problems: list[Problem] = []
        self.notes: list[str] = []
        self.health_checks = 0
        self.server_died: dict[str, Any] | None = None
        self.killed: dict[str, Any] | None = None
        self.baseline: dict[str, int] | None = None
        self.shm_before = shm_entries()
        self.runs: set[str] = set()
        self.stage_pids_seen: set[int] = set()
        self.sent = 0
        self.t_start = 0.0
        self.t_soak = 0.0
        self._stop = False
        self._in_flight: dict[int, Record] = {}

    # -- the plan ------------------------------------------------------------------------------

    def run(self) -> None:
        self.t_start = time.time()
        asyncio.run(self._main())
        self.t_soak = time.time() - self.t_start

    def _client(self, n: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.srv.url, headers=self.srv.headers, timeout=httpx.Timeout(60.0),
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n,
                                                     keepalive_expiry=2.0))  # well inside uvicorn's 5 s

    async def _main(self) -> None:
        watch = asyncio.ensure_future(self._watch())
        try:
            actions = plan(self.seed, kill_at=self.kill_at, burst_every=self.burst_every, exclude=self.exclude)
            first = [next(actions) for _ in range(self.warmup)]
            await self._send(iter(first), limit=len(first))
            if self.server_died is None:
                await self._idle()
            if self.srv.proc.poll() is not None:
                self._died(self.srv.proc.returncode)
            else:
                self.baseline = await asyncio.to_thread(self._settled_counts, None)
                self.log(f"steady state after {self.warmup} warm-up actions: {self.baseline}")
                limit = None if self.actions is None else self.actions - self.warmup
                await self._send(actions, limit=limit)
        finally:
            self._stop = True
            await watch

    async def _send(self, actions: Iterator[Action], limit: int | None) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        async with self._client(self.concurrency + 8) as client:
            sent = 0
            next_at = time.time()
            for action in actions:
                if limit is not None and sent >= limit:
                    break
                now = time.time()
                if self.seconds is not None and now - self.t_start >= self.seconds:
                    break
                if now - self.t_start >= self.deadline_s:
                    self.notes.append(f"stopped at the deadline ({self.deadline_s:g} s) after {self.sent} actions")
                    break
                if self.server_died is not None:
                    break
                next_at += action.gap
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                else:
                    next_at = now
                if action.kind in ("burst", "kill"):  # alone in the plan's order: what is in flight stays
                    await self._special(action)
                else:
                    await sem.acquire()
                    task = asyncio.ensure_future(self._one(client, action))
                    tasks.add(task)
                    task.add_done_callback(lambda t: (tasks.discard(t), sem.release()))
                sent += 1
                self.sent += 1
                if self.sent % 200 == 0:
                    self.log(f"{self.sent} actions sent, {time.time() - self.t_start:.0f} s")
            if tasks:
                await asyncio.wait(tasks)

    async def _special(self, action: Action) -> None:
        try:
            if action.kind == "burst":
                await self._burst(action)
            elif self.killed is None:
                await self._kill(action)
        except Exception as exc:  # noqa: BLE001
            self.problems.append(Problem(f"the {action.kind} could not be done", action.describe(),
                                         f"{type(exc).__name__}: {exc}"))

    async def _watch(self) -> None:
        """/health every 0.25 s and the process's state, until the plan is done."""
        polls = 0
        async with self._client(2) as client:
            while not self._stop:
                status = self.srv.proc.poll()
                if status is not None:
                    self._died(status)
                    return
                try:
                    r = await client.get("/health", timeout=10)
                    self.health_checks += 1
                    if r.status_code != 200 or r.json() != {"status": "ok"}:
                        why = ""
                        if "draining" in r.text:  # this run sends its SIGTERM only after the plan
                            why = (" -- a signal this run did not send (another process on the machine?); the server's "
                                   "stderr: " + " | ".join(line for line in self.srv.log().splitlines()
                                                            if "draining" in line)[-300:])
                        self.problems.append(Problem("/health not ok during the run",
                                                     detail=f"{r.status_code} {r.text[:300]}{why}"))
                except Exception as exc:  # noqa: BLE001
                    if self.srv.proc.poll() is None:
                        self.problems.append(Problem("/health failed during the run", detail=repr(exc)))
                polls += 1
                if polls % 8 == 1:  # every 2 s: the stages' pids and their shared-memory runs
                    try:
                        self.stage_pids_seen.update((await self._metrics(client))[1].values())
                        self.runs |= shm_runs([self.srv.proc.pid, *self.stage_pids_seen])
                    except Exception:  # noqa: BLE001
                        pass
                await asyncio.sleep(0.25)

    def _died(self, status: int) -> None:
        if self.server_died is not None:
            return
        now = time.time()
        flight = sorted(self._in_flight.values(), key=lambda r: r.t0)
        # the requests sent in the last 3 s, and where the failure first showed: a 5xx or an error event
        recent = [r for r in self.records if r.t0 > now - 3.0 and r not in flight]
        failed = [r for r in self.records if r.t1 and ("generation failed" in r.text
                                                       or any("generation failed" in line for line in r.lines))]
        t_fail = min((r.t1 for r in failed), default=None)
        # the requests open when the first one was answered "generation failed": the cause is among them
        suspects = [] if t_fail is None else sorted(
            (r for r in self.records if r.t0 <= t_fail and (r.t1 == 0 or r.t1 >= t_fail - 0.05)),
            key=lambda r: (r.action.kind != "bad", r.t0))
        self.server_died = {"status": status, "at_s": now - self.t_start,
                            "in_flight": [r.action.describe() for r in flight],
                            "recent": [r.action.describe() for r in recent],
                            "open_at_first_generation_failure": [r.action.describe() for r in suspects]}
        log = self.srv.log()
        self.problems.append(Problem("the server exited on its own", detail=(
            f"status {status} at {self.server_died['at_s']:.1f} s into the run\n      open when the first answer "
            f"said 'generation failed' ({len(suspects)}, bad cases first):\n        " +
            "\n        ".join(self.server_died["open_at_first_generation_failure"][:12]) + "\n      in flight "
            f"({len(flight)}):\n        " + "\n        ".join(self.server_died["in_flight"][-12:]) +
            f"\n      sent in its last 3 s ({len(recent)}), the last 8:\n        " +
            "\n        ".join(self.server_died["recent"][-8:]) +
            "\n      its stderr ends:\n        " + "\n        ".join(log.strip().splitlines()[-15:]))))

    async def _metrics(self, client: httpx.AsyncClient) -> tuple[dict, dict[int, int]]:
        r = await client.get("/metrics", timeout=30)
        r.raise_for_status()
        samples = parse(r.text)
        return samples, stage_pids(samples)

    async def _one(self, client: httpx.AsyncClient, action: Action, tag: str = "",
                   started: asyncio.Event | None = None) -> Record:
        rec = Record(action, t0=time.time(), tag=tag)
        self.records.append(rec)
        self._in_flight[id(rec)] = rec
        try:
            if action.cut and action.cut[0] == "cancel":
                try:
                    await asyncio.wait_for(self._request(client, action, rec, started), action.cut[1])
                except asyncio.TimeoutError:
                    rec.cut = True
            else:
                await self._request(client, action, rec, started)
        except Exception as exc:  # noqa: BLE001
            rec.exception = f"{type(exc).__name__}: {exc}"
        finally:
            rec.t1 = time.time()
            self._in_flight.pop(id(rec), None)
            if started is not None:
                started.set()
        return rec

    async def _request(self, client: httpx.AsyncClient, action: Action, rec: Record,
                       started: asyncio.Event | None) -> None:
        kw: dict[str, Any] = {}
        if action.raw is not None:
            kw = {"content": action.raw, "headers": {"content-type": "application/json"}}
        elif action.body is not None:
            kw = {"json": action.body}
        stream = streamed(action)
        if action.method == "HALF":
            await half_body(self.srv.url, action.endpoint, self.srv.headers)
            rec.complete = True
            return
        if not stream:
            r = await client.request(action.method, action.endpoint, **kw)
            rec.status, rec.content_type, rec.text = r.status_code, r.headers.get("content-type", ""), r.text
            rec.complete = True
            return
        async with client.stream(action.method, action.endpoint, **kw) as r:
            rec.status, rec.content_type = r.status_code, r.headers.get("content-type", "")
            if r.status_code != 200:
                rec.text = (await r.aread()).decode(errors="replace")
                rec.complete = True
                return
            events = 0
            close_after = int(action.cut[1]) if action.cut and action.cut[0] == "close" else None
            async for line in r.aiter_lines():
                rec.lines.append(line)
                if line.startswith("data: "):
                    events += 1
                    if started is not None and events >= 3:
                        started.set()
                    if close_after is not None and events >= close_after and line != "data: [DONE]":
                        rec.cut = True
                        return
            rec.complete = True

    async def _idle(self, timeout: float = 30.0) -> dict | None:
        """Wait until no request runs or waits and every row is free (/metrics); the samples."""
        async with self._client(1) as client:
            deadline = time.time() + timeout
            while True:
                try:
                    samples, _ = await self._metrics(client)
                    running = metric(samples, "tvmpipe_requests_running")
                    waiting = metric(samples, "tvmpipe_requests_waiting")
                    free = metric(samples, "tvmpipe_rows_free")
                    if running == 0 and waiting == 0 and free == self.rows:
                        return samples
                except Exception as exc:  # noqa: BLE001
                    if self.srv.proc.poll() is not None:
                        return None
                    running = waiting = free = f"? ({exc!r})"
                if time.time() > deadline:
                    self.problems.append(Problem("rows still held after the run", detail=(
                        f"{timeout:g} s after the last answer /metrics says running {running}, waiting {waiting}, "
                        f"rows free {free} of {self.rows}")))
                    return None
                await asyncio.sleep(0.2)

    def _settled_counts(self, limit: dict[str, int] | None, timeout: float = 15.0) -> dict[str, int]:
        """The server process's threads and fds once they stop falling (or are within `limit`)."""
        pid = self.srv.proc.pid
        deadline = time.time() + timeout
        last = proc_counts(pid)
        while time.time() < deadline:
            time.sleep(0.5)
            now = proc_counts(pid)
            if limit is not None and all(now[k] <= limit[k] for k in limit):
                return now
            if limit is None and now == last:
                return now
            last = now
        return last

    # -- specials ------------------------------------------------------------------------------

    async def _burst(self, action: Action) -> None:
        """2 x (rows + max_waiting) + 4 long greedy streams at once; some read to the end, some closed."""
        rng = random.Random(action.name)
        n = 2 * (self.rows + self.max_waiting) + 4
        actions = []
        for j in range(n):
            prompt = rng.choice(ID_PROMPTS[:8])
            body = {"model": MODEL, "prompt": prompt, "max_tokens": min(40, MAX_CONTEXT - len(prompt)), "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}
            cut = ("close", float(rng.randint(1, 5))) if rng.random() < 0.3 else None
            actions.append(Action(action.index, 0.0, "gen", COMPLETIONS, body=body, cut=cut, sampling=Sampling(),
                                  name=f"{action.name}.{j}"))
        async with self._client(n) as client:
            await asyncio.gather(*(self._one(client, a, tag=f"burst:{action.name}") for a in actions))

    async def _kill(self, action: Action) -> None:
        """Three long greedy streams; once each has 3 events, SIGKILL one stage's process."""
        async with self._client(4) as client:
            samples, pids = await self._metrics(client)
            if sorted(pids) != list(range(len(pids))) or not pids:
                self.problems.append(Problem("no stage pids in /metrics", detail=str(pids)))
                return
            actions = [Action(action.index, 0.0, "gen", COMPLETIONS, sampling=Sampling(), name=f"kill-stream-{j}",
                              body={"model": MODEL, "prompt": p, "max_tokens": MAX_CONTEXT - len(p), "temperature": 0,
                                    "ignore_eos": True, "stream": True, "return_token_ids": True})
                       for j, p in enumerate([[60], [2], [33, 0]])]
            started = [asyncio.Event() for _ in actions]
            tasks = [asyncio.ensure_future(self._one(client, a, tag="kill", started=e)) for a, e in zip(actions, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            stage = action.stages % len(pids)
            pid = pids[stage]
            os.kill(pid, signal.SIGKILL)
            open_at_kill = sum(1 for t in tasks if not t.done())
            self.killed = {"stage": stage, "pid": pid, "at_s": time.time() - self.t_start, "streams_open": open_at_kill}
            self.log(f"SIGKILLed stage {stage} (pid {pid}) with {open_at_kill} of 3 dedicated streams open")
            await asyncio.gather(*tasks)

    # -- after the run -------------------------------------------------------------------------

    def finish(self, drain_timeout: float = 60.0) -> dict[str, Any]:
        """Rows free, nothing leaked, SIGTERM drains to exit 0; what was measured."""
        out: dict[str, Any] = {}
        srv = self.srv
        if self.server_died is None and srv.proc.poll() is not None:
            self._died(srv.proc.returncode)
        pids: dict[int, int] = {}
        if self.server_died is None:
            samples = asyncio.run(self._idle())
            if samples is not None:
                out["metrics"] = {k: metric(samples, k) for k in (
                    "tvmpipe_requests_submitted_total", "tvmpipe_requests_rejected_total",
                    "tvmpipe_requests_finished_total", "tvmpipe_requests_cancelled_total",
                    "tvmpipe_generation_tokens_total")}
                out["metrics"]["stage_restarts"] = [metric(samples, "tvmpipe_stage_restarts_total", stage=i)
                                                    for i in range(2)]
                out["metrics"]["http_responses"] = {dict(ls)["code"]: v for (n, ls), v in samples.items()
                                                    if n == "tvmpipe_http_responses_total"}
                pids = stage_pids(samples)
                if self.killed is not None:
                    restarts = out["metrics"]["stage_restarts"][self.killed["stage"]]
                    if restarts < 1:
                        self.problems.append(Problem("the killed stage's restart is not in /metrics",
                                                     detail=f"tvmpipe_stage_restarts_total {out['metrics']['stage_restarts']}"))
                for code, v in out["metrics"]["http_responses"].items():
                    if int(code) >= 500:
                        self.problems.append(Problem(f"/metrics counts {v:g} HTTP {code} response(s)", detail=(
                            f"the exceptions in the server's stderr: {log_exceptions(srv.log())}")))
            self.stage_pids_seen.update(pids.values())
            self.runs |= shm_runs([srv.proc.pid, *self.stage_pids_seen])
            if self.baseline is not None:
                limit = {"threads": self.baseline["threads"] + 6, "fds": self.baseline["fds"] + 8}
                end = self._settled_counts(limit)
                out["process"] = {"steady": self.baseline, "end": end}
                for k in limit:
                    if end[k] > limit[k]:
                        self.problems.append(Problem(f"the server process holds more {k} than in its steady state",
                                                     detail=f"{end[k]} at the end vs {self.baseline[k]} after the warm-up"))
            t = time.time()
            status = srv.stop(signal.SIGTERM, timeout=drain_timeout)
            out["drain_s"] = time.time() - t
            out["exit_status"] = status
            if status != 0:
                self.problems.append(Problem("SIGTERM did not exit 0", detail=f"status {status}; stderr ends:\n        " +
                                             "\n        ".join(srv.log().strip().splitlines()[-15:])))
        else:
            out["exit_status"] = self.server_died["status"]
            srv.kill()
        deadline = time.time() + 15
        while any(alive(p) for p in self.stage_pids_seen) and time.time() < deadline:
            time.sleep(0.2)
        left = [p for p in self.stage_pids_seen if alive(p)]
        if left:
            self.problems.append(Problem("stage processes outlived the server", detail=str(left)))
        out["server_exceptions"] = log_exceptions(srv.log())
        leaked = sorted(n for n in shm_entries() - self.shm_before if n[len("tvmpipe-"):].split("-")[0] in self.runs)
        out["shm_runs"] = sorted(self.runs)
        others = sorted(shm_entries() - self.shm_before - set(leaked))
        if others:  # not known to be the server's (another run on this machine may hold them): said, not judged
            self.notes.append(f"/dev/shm entries new since the start, of runs not seen mapped by the server: {others[:10]}")
        if leaked:
            self.problems.append(Problem("/dev/shm segments of the server's runs left behind", detail=", ".join(leaked[:10])))
        return out


# ---------------------------------------------------------------------------------------------
# Checking the answers
# ---------------------------------------------------------------------------------------------


def streamed(action: Action) -> bool:
    return action.method == "POST" and isinstance(action.body, dict) and action.body.get("stream") is True


def sse_events(lines: list[str]) -> tuple[list[Any], str | None]:
    """The data payloads of a stream's lines and what is wrong with its framing (None: nothing)."""
    events: list[Any] = []
    for i, line in enumerate(lines):
        if not line:
            if i == 0 or not lines[i - 1].startswith("data: "):
                return events, f"a blank line not after a data line at line {i}"
            continue
        if not line.startswith("data: "):
            return events, f"line {i} is not a data line: {line[:200]!r}"
        if i + 1 < len(lines) and lines[i + 1] != "":
            return events, f"data line {i} not followed by a blank line"
        payload = line[6:]
        if payload == "[DONE]":
            events.append(payload)
            continue
        try:
            events.append(json.loads(payload))
        except ValueError:
            return events, f"line {i} is not JSON: {payload[:200]!r}"
    return events, None


def error_form(status: int | None, content_type: str, text: str) -> str | None:
    """What is wrong with a 4xx body as OpenAI's error JSON (None: nothing)."""
    if "application/json" not in content_type:
        return f"content-type {content_type!r}, body {text[:200]!r}"
    try:
        body = json.loads(text)
    except ValueError:
        return f"not JSON: {text[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict) \
            or set(body["error"]) != ERROR_KEYS or not isinstance(body["error"]["message"], str) \
            or not isinstance(body["error"]["type"], str):
        return f"not OpenAI's error object: {text[:300]}"
    return None


@dataclass
class Answer:
    """What a 200 said: tokens (None: not asked), prompt ids, finish reason (None: cut), text."""

    tokens: list[int] | None
    prompt_ids: list[int] | None
    finish: str | None
    text: str


def read_whole(rec: Record) -> tuple[Answer | None, list[str]]:
    a, body = rec.action, rec.action.body
    chat = a.endpoint == CHAT
    bad = []
    try:
        out = json.loads(rec.text)
    except ValueError:
        return None, [f"200 body is not JSON: {rec.text[:200]!r}"]
    try:
        assert out["object"] == ("chat.completion" if chat else "text_completion"), out["object"]
        assert out["model"] == MODEL and isinstance(out["id"], str)
        n = body.get("n", 1)
        assert [c["index"] for c in out["choices"]] == list(range(n)), [c["index"] for c in out["choices"]]
        for c in out["choices"]:
            text = c["message"]["content"] if chat else c["text"]
            if chat:
                assert c["message"]["role"] == "assistant"
            assert isinstance(text, str)
            assert c["finish_reason"] in ("stop", "length"), c["finish_reason"]
            check_logprobs(c["logprobs"], body, c.get("token_ids"), chat)
        c = out["choices"][0]
        text = c["message"]["content"] if chat else c["text"]
        finish = c["finish_reason"]
        tokens = c.get("token_ids")
        u = out["usage"]
        if tokens is not None:
            assert u["completion_tokens"] == sum(len(x["token_ids"]) for x in out["choices"]), (u, len(tokens))
            assert u["prompt_tokens"] == len(c["prompt_token_ids"])
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert u["completion_tokens"] >= n
        if body.get("return_token_ids") and tokens is None:
            bad.append("return_token_ids asked, no token_ids")
        return Answer(tokens, c.get("prompt_token_ids"), finish, text), bad
    except (AssertionError, KeyError, TypeError, IndexError) as exc:
        return None, [f"malformed 200 body ({type(exc).__name__} {exc}): {rec.text[:300]}"]


def check_logprobs(lp: Any, body: dict, token_ids: list[int] | None, chat: bool) -> None:
    """A choice's (or chunk's) logprobs: absent unless asked; else OpenAI's shape, one entry a
    token, k most likely (completions: and the token itself) each, every value a finite number <= 0."""
    asked = body.get("logprobs")
    if asked is None or asked is False:
        assert lp is None, f"logprobs not asked, got {lp}"
        return
    if lp is None:  # a chunk of no token (a chat's role, a last one that adds no token) has none
        assert token_ids == [] or (token_ids is None and chat), "logprobs asked, none returned"
        return
    if chat:
        k = body.get("top_logprobs", 0)
        entries = lp["content"]
        values = [e["logprob"] for e in entries] + [t["logprob"] for e in entries for t in e["top_logprobs"]]
        assert all(len(e["top_logprobs"]) == k and e["bytes"] == list(e["token"].encode()) for e in entries), entries
    else:
        entries = lp["token_logprobs"]
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(entries)
        values = list(entries) + [v for top in lp["top_logprobs"] for v in top.values()]
        # the k most likely and the token itself (fewer where tokens decode to the same text: one key)
        assert all(1 <= len(top) <= asked + 1 for top in lp["top_logprobs"]), lp["top_logprobs"]
    if token_ids is not None:
        assert len(entries) == len(token_ids), (len(entries), len(token_ids))
    assert all(isinstance(v, float) and -1e4 <= v <= 0 for v in values), values


def read_stream(rec: Record) -> tuple[Answer | None, list[str]]:
    a, body = rec.action, rec.action.body
    chat = a.endpoint == CHAT
    if "text/event-stream" not in rec.content_type:
        return None, [f"a stream's content-type is {rec.content_type!r}"]
    lines = list(rec.lines)
    events, framing = sse_events(lines if rec.cut or not lines or lines[-1] == "" else lines + [""])
    bad = [f"SSE framing: {framing}"] if framing else []
    if not rec.cut and (not events or events[-1] != "[DONE]"):
        bad.append(f"the stream does not end with [DONE] (last event {str(events[-1:])[:200]})")
    if "[DONE]" in events[:-1]:
        bad.append("[DONE] before the end of the stream")
    chunks = [e for e in events if isinstance(e, dict)]
    errors = [e for e in chunks if "error" in e]
    if errors:
        bad.append(f"an error event in the stream: {json.dumps(errors[0])[:300]}")
        return None, bad
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    n = body.get("n", 1)
    tokens: list[int] = []  # choice 0's (keyed as the request alone)
    prompt_ids = None
    finishes: dict[int, str] = {}  # each choice's
    all_tokens = 0
    text = []
    try:
        ids = {c["id"] for c in chunks}
        assert len(ids) <= 1, ids
        started: set[int] = set()
        for k, c in enumerate(chunks):
            assert c["object"] == ("chat.completion.chunk" if chat else "text_completion"), c["object"]
            if not c["choices"]:
                assert include_usage and k == len(chunks) - 1 and len(finishes) == n, "a chunk without choices"
                u = c["usage"]
                assert u["completion_tokens"] == (all_tokens if body.get("return_token_ids") else u["completion_tokens"])
                assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
                continue
            assert ("usage" in c and c["usage"] is None) if include_usage else "usage" not in c, "usage in a choice chunk"
            assert len(c["choices"]) == 1
            ch = c["choices"][0]
            i = ch["index"]
            assert 0 <= i < n and i not in finishes, f"a chunk of choice {i} (n {n}) after its finish_reason"
            if chat and i not in started:
                assert ch["delta"].get("role") == "assistant", ch
            started.add(i)
            check_logprobs(ch["logprobs"], body, ch.get("token_ids"), chat)
            all_tokens += len(ch.get("token_ids", []))
            if ch["finish_reason"] is not None:
                assert ch["finish_reason"] in ("stop", "length"), ch["finish_reason"]
                finishes[i] = ch["finish_reason"]
            if i != 0:
                continue
            text.append((ch["delta"].get("content") or "") if chat else ch["text"])
            if "prompt_token_ids" in ch:
                assert prompt_ids is None
                prompt_ids = ch["prompt_token_ids"]
            tokens += ch.get("token_ids", [])
        finish = finishes.get(0)
        if not rec.cut:
            assert len(finishes) == n, f"finish_reasons of {sorted(finishes)}, n {n}"
            if include_usage:
                assert chunks and not chunks[-1]["choices"], "include_usage: no usage chunk at the end"
    except (AssertionError, KeyError, TypeError, IndexError) as exc:
        bad.append(f"malformed stream ({type(exc).__name__} {exc}): {' | '.join(lines)[:600]}")
        return None, bad
    asked = bool(body.get("return_token_ids"))
    if asked and chunks and prompt_ids is None:
        bad.append("return_token_ids asked: no prompt_token_ids in the first chunk")
    return Answer(tokens if asked else None, prompt_ids, finish, "".join(text)), bad


def ref_key(prompt_ids: list[int], sampling: Sampling) -> tuple[tuple[int, ...], Sampling]:
    return tuple(prompt_ids), sampling


def reference_cases(records: list[Record]) -> list[tuple[tuple[int, ...], Sampling]]:
    """The (prompt ids, sampling) pairs the offline run must reproduce: each a full continuation
    (to the context, no stop token), from which any request's tokens are cut."""
    keys = set()
    for rec in records:
        a = rec.action
        if a.kind != "gen" or a.sampling is None or rec.status != 200:
            continue
        ans, _ = (read_stream(rec) if streamed(a) else read_whole(rec))
        if ans is not None and ans.prompt_ids and ans.tokens is not None:
            keys.add(ref_key(ans.prompt_ids, a.sampling))
    return sorted(keys, key=lambda k: (k[0], k[1].temperature, k[1].seed, k[1].top_k, k[1].top_p))


def expected(full: list[int], body: dict, prompt_len: int, chat: bool) -> tuple[list[int], str, set[int]]:
    """The tokens and finish reason a request asks for, cut from the full continuation."""
    stops = set(body.get("stop_token_ids") or ())
    if not body.get("ignore_eos"):
        stops.add(EOS)
    room = MAX_CONTEXT - prompt_len
    n = body.get("max_tokens", body.get("max_completion_tokens"))
    n = min(n, room) if n is not None else (room if chat else min(16, room))
    out = []
    for t in full[:n]:
        out.append(t)
        if t in stops:
            return out, "stop", stops
    return out, "length", stops


def verify(records: list[Record], reference: dict | None, *, server_died: bool = False,
           decode: Callable[[list[int]], str] | None = None) -> tuple[list[Problem], dict]:
    """Every answer against what it must be; the problems and counts by kind and status. With
    `decode` (token ids -> text, special tokens skipped: the tokenizer's own decoding), the text of
    a finished greedy or seeded answer too: the decoding of its tokens, cut before the first stop
    string the decoding of the whole continuation holds."""
    problems: list[Problem] = []
    counts: dict[str, int] = {}
    compared = 0

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    bursts: dict[str, list[int | None]] = {}
    for rec in records:
        a = rec.action
        if a.method == "HALF":
            count("probe:half-body")
            continue
        count(f"{a.kind}:{rec.status if rec.status is not None else ('cut' if rec.cut else 'no answer')}")
        if rec.tag.startswith("burst:"):
            bursts.setdefault(rec.tag, []).append(rec.status)

        def bad(what: str, detail: str = "") -> None:
            problems.append(Problem(what, a.describe(), detail, a.name if a.kind == "bad" else a.kind))

        if rec.exception is not None:
            if not server_died:
                bad("no answer", rec.exception)
            continue
        if rec.status is None:
            continue  # cut before the status line
        s = rec.status
        if rec.cut and not rec.complete and s != 200:  # left while the error body came: its status alone
            if s >= 500:
                bad(f"HTTP {s}", "(the client left before the body)")
            continue
        if a.kind == "probe":
            want = {"/health": 200, "/v1/models": 200, "/metrics": 200, f"/v1/models/{MODEL}": 200}.get(a.endpoint, None)
            if a.method != "GET":
                want = 405
            if want is not None and s != want:
                bad(f"{a.method} {a.endpoint} is {s}", rec.text[:200])
            if s >= 400 and (err := error_form(s, rec.content_type, rec.text)):
                bad(f"a {s} that is not OpenAI's error JSON", err)
            continue
        if s >= 500:
            bad(f"HTTP {s}", f"content-type {rec.content_type!r}, body {rec.text[:300]!r}")
            continue
        if 400 <= s < 500:
            if (err := error_form(s, rec.content_type, rec.text)):
                bad(f"a {s} that is not OpenAI's error JSON", err)
            elif a.expect == "ok" and not (s == 429 and json.loads(rec.text)["error"]["code"] == "queue_full"):
                bad(f"a valid request answered {s}", rec.text[:300])
            continue
        if s != 200:
            bad(f"HTTP {s}", rec.text[:300])
            continue
        if a.expect == "4xx":
            bad("an invalid request answered 200", rec.text[:300] or " | ".join(rec.lines)[:300])
            continue
        body = a.body if isinstance(a.body, dict) else {}
        ans, wrong = read_stream(rec) if streamed(a) else read_whole(rec)
        for w in wrong:
            bad("malformed answer", w)
        if ans is None:
            continue
        for stop in ([body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []):
            if stop in ans.text:
                bad("a stop string was sent", f"{stop!r} in {ans.text!r}")
        if ans.tokens is not None:
            if any(not 0 <= t < VOCAB for t in ans.tokens):
                bad("a token outside the vocabulary", str(ans.tokens))
        if a.kind != "gen" or a.sampling is None or ans.tokens is None or not ans.prompt_ids or reference is None:
            continue
        full = reference.get(ref_key(ans.prompt_ids, a.sampling))
        if full is None:
            continue
        want, want_finish, stops = expected(full, body, len(ans.prompt_ids), a.endpoint == CHAT)
        compared += 1
        got = ans.tokens
        if got != want[:len(got)]:
            bad("tokens differ from the offline run", f"got {got}, want {'a prefix of ' if rec.cut else ''}{want} "
                f"(prompt ids {ans.prompt_ids}, {a.sampling})")
            continue
        if rec.cut or ans.finish is None:
            continue
        stop_strings = [body["stop"]] if isinstance(body.get("stop"), str) else list(body.get("stop") or [])

        def visible(ids: list[int]) -> list[int]:  # a stop token's text is not sent (vLLM's way)
            return ids[:-1] if ids and ids[-1] in stops else ids

        if not got:
            bad("a finished answer without tokens")
        elif stop_strings and decode is not None:
            whole = decode(visible(want))
            at = min((k for k in (whole.find(x) for x in stop_strings) if k >= 0), default=None)
            if at is None:  # no stop string in the continuation: as without them
                if got != want or ans.finish != want_finish or ans.text != whole:
                    bad("a stop string that the text does not hold ended the answer", (
                        f"got {got} {ans.finish} {ans.text!r}, want {want} {want_finish} {whole!r} (stop {stop_strings})"))
            elif ans.finish != "stop" or ans.text != whole[:at]:
                bad("not cut at the first stop string", (
                    f"got {ans.text!r} ({ans.finish}, tokens {got}), want {whole[:at]!r} (stop) of the continuation "
                    f"{whole!r} (tokens {want}), stop {stop_strings}"))
        elif stop_strings:
            if len(got) < len(want) and ans.finish != "stop":
                bad("cut short without finish_reason stop", f"{ans.finish}: got {got}, want {want}")
            elif len(got) == len(want) and ans.finish not in (want_finish, "stop"):
                bad("wrong finish_reason", f"{ans.finish}, want {want_finish}")
        else:
            if decode is not None and got == want and ans.text != decode(visible(got)):
                bad("the text is not the decoding of the tokens", (
                    f"got {ans.text!r}, want {decode(visible(got))!r} (tokens {got}, stop tokens {sorted(stops)})"))
            if got != want:
                bad("tokens cut short", f"got {got}, want {want} (finish {ans.finish})")
            elif ans.finish != want_finish:
                bad("wrong finish_reason", f"{ans.finish}, want {want_finish} (tokens {got}, stops {sorted(stops)})")
    for tag, statuses in bursts.items():
        n429 = statuses.count(429)
        counts[f"{tag}:429"] = n429
        if n429 == 0 and not server_died:
            problems.append(Problem(f"a burst of {len(statuses)} streams past {'rows + --max-waiting'} got no 429",
                                    detail=f"statuses {statuses}"))
    counts["compared_with_offline"] = compared
    return problems, counts


def report(problems: list[Problem], limit: int = 40) -> str:
    """The problems, the same kind of problem once with its count and first request."""
    groups: dict[str, list[Problem]] = {}
    for p in problems:
        key = f"{p.what}|{p.case}" + ("" if p.action else p.detail[:80])
        groups.setdefault(key, []).append(p)
    lines = []
    for key, ps in list(groups.items())[:limit]:
        lines.append(f"  [{len(ps)}x] {ps[0]}")
    return "\n".join(lines)
