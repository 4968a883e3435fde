"""Clients that score (issue 51): log probabilities, echo, n and best_of, the penalties and min_p,
batched prompts, and lm-eval itself, against a real `tvmpipe serve` on a checkpoint, each held to a
reference: transformers' own log-softmax, and its LogitsProcessors, on the same fp32 checkpoint.

The server runs a chunked step (`--chunk 4`): plain prompts go in four tokens a step, while echo and
penalized requests go one token a step (the sampling stage scores or sees every position), side by
side in the same pipeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest

pytest.importorskip("tvm")  # the checkpoints are compiled here (the compile extra: torch, transformers, tvm)

from tests.serve.harness import ROOT, ServerProcess  # noqa: E402
from tests.support.checkpoints import COVER, load_transformers, write_checkpoint  # noqa: E402
from tests.support.json_tokenizer import JSON_EOS, build_json_tokenizer  # noqa: E402

MODEL = "gpt2-step"  # harness.MODEL, the served name
CONTEXT = 64
CHUNK = 4
TOL = 1e-4  # fp32 logits, log probabilities compared in float64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The zoo GPT-2's tiny fp32 checkpoint with its word-level tokenizer (w0 .. w125, <s>, </s>)."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "gpt2", COVER["gpt2"], with_tokenizer=True)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_transformers(checkpoint, "float32")


@pytest.fixture(scope="module")
def bundle(checkpoint, tmp_path_factory) -> Path:
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    out = tmp_path_factory.mktemp("bundle") / "gpt2_c4"
    export(str(checkpoint), progress=Progress(stream=None), decode=CONTEXT, chunk=CHUNK).write(out)
    return out


@pytest.fixture(scope="module")
def scoring_server(bundle, tmp_path_factory):
    srv = ServerProcess(bundle, "--stages", "2", "--processes", "--max-waiting", "64",
                        log_path=tmp_path_factory.mktemp("server") / "stderr.txt")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(scoring_server):
    return openai.OpenAI(base_url=scoring_server.base, api_key="unused", max_retries=0, timeout=120)


def log_softmax(hf, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax at every position of `ids` (float64 of its fp32 logits)."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def reference_tokens(hf, prompt: list[int], n: int, processors=(), seed: int | None = None, key: int = 0,
                     sampling=None) -> list[int]:
    """Greedy (or, with `sampling`, the keyed draw of executor.sampler over the processed
    distribution) continuation of `prompt` by transformers, its logits through `processors`
    (transformers LogitsProcessors: called with the ids so far and the scores)."""
    import torch

    ids = list(prompt)
    for i in range(n):
        with torch.no_grad():
            scores = hf(torch.tensor([ids])).logits[:, -1].double()
        for p in processors:
            scores = p(torch.tensor([ids]), scores)
        x = scores[0].numpy()
        if sampling is None:
            ids.append(int(np.argmax(x)))
        else:
            ids.append(sampling.pick(x, key, i))
    return ids[len(prompt):]


class OutputPenalties:
    """OpenAI's presence and frequency penalties (over the generated tokens only, as vLLM's): the
    formula of OpenAI's docs, which transformers has no processor for."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.n, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.n:].numpy()
        counts = np.bincount(out, minlength=scores.shape[-1])[:scores.shape[-1]]
        import torch

        return scores - torch.tensor(self.frequency * counts + self.presence * (counts > 0), dtype=scores.dtype)


PROMPT = [5, 17, 3, 9, 60, 2, 44, 44, 13]


def word(t: int) -> str:
    """Token t as the checkpoint's tokenizer writes it."""
    return f"w{t}" if t < 126 else ("<s>", "</s>")[t - 126]


def test_completion_logprobs_and_echo_equal_transformers(client, hf):
    """echo + logprobs=5: every prompt token after the first and every generated one carries its
    log probability under transformers' log-softmax of the same checkpoint (within 1e-4), the
    first prompt token null, the top 5 the reference's; the greedy tokens are the reference's;
    streamed chunks add up to the same."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=5, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    gen = c.token_ids
    assert gen == reference_tokens(hf, PROMPT, 6)
    ids = PROMPT + gen
    lsm = log_softmax(hf, ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [lsm[i - 1, ids[i]] for i in range(1, len(ids))]
    assert np.allclose(lp.token_logprobs[1:], want, atol=TOL, rtol=0)
    assert lp.tokens == [word(t) for t in ids] and c.text.startswith("w5 w17 w3")
    for i in range(1, len(ids)):
        top = np.argsort(-lsm[i - 1], kind="stable")[:5]
        got = lp.top_logprobs[i]
        assert set(got) >= {word(t) for t in top} and len(got) in (5, 6)  # the top 5, and the token itself
        assert all(abs(got[word(t)] - lsm[i - 1, t]) < TOL for t in top)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=5, max_tokens=6,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [v for ch in chunks if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    # without echo: the generated tokens' alone
    plain = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert plain.text == c.text[len("w5 w17 w3 w9 w60 w2 w44 w44 w13"):]
    assert np.allclose(plain.logprobs.token_logprobs, want[len(PROMPT) - 1:], atol=TOL, rtol=0)


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(client, hf):
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0)
    c = r.choices[0]
    lsm = log_softmax(hf, PROMPT)
    assert c.text == " ".join(word(t) for t in PROMPT) and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None
    assert np.allclose(c.logprobs.token_logprobs[1:], [lsm[i - 1, PROMPT[i]] for i in range(1, len(PROMPT))],
                       atol=TOL, rtol=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert info.value.param == "max_tokens"


def test_chat_logprobs_equal_transformers(client, hf):
    """chat logprobs + top_logprobs=3: OpenAI's content list (token, logprob, bytes, top 3), plain
    and streamed, against transformers on the rendered chat prompt."""
    msgs = [{"role": "user", "content": "w5 w6 w7"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=3, max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    prompt, gen = c.prompt_token_ids, c.token_ids
    lsm = log_softmax(hf, prompt + gen)
    content = c.logprobs.content
    assert [e.token for e in content] == [word(t) for t in gen] and gen == reference_tokens(hf, prompt, 5)
    for i, e in enumerate(content):
        row = lsm[len(prompt) + i - 1]
        assert abs(e.logprob - row[gen[i]]) < TOL and e.bytes == list(e.token.encode())
        assert [t.token for t in e.top_logprobs] == [word(t) for t in np.argsort(-row, kind="stable")[:3]]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=3,
                                                 max_tokens=5, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_n_choices_are_seeded_per_choice_and_reproduce(client, hf):
    """n=3 seeded: three different streams, the same on a second request, choice 0 the n=1
    request's, each choice j the keyed draw (seed, j, index) of transformers' distribution."""
    from tvmpipe.executor.sampler import Sampling

    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices] and len(set(texts)) == 3
    assert client.completions.create(**kw).choices[0].text == texts[0]
    s = Sampling(1.0, 0, 11)
    for j, text in enumerate(texts):
        assert text == " ".join(word(t) for t in reference_tokens(hf, PROMPT, 6, key=j, sampling=s))
    streamed = {}
    for ch in client.completions.create(n=3, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w9"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_best_of_returns_the_most_likely_choices(client):
    """best_of=4, n=2: the two of the four seeded sequences (those of n=4) whose tokens' log
    probabilities sum highest, in that order."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    four = client.completions.create(n=4, logprobs=0, **kw).choices
    ranked = sorted(four, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 10


@pytest.mark.parametrize("kw", [{"presence_penalty": 1.5}, {"frequency_penalty": 0.7},
                                {"frequency_penalty": 1.2, "presence_penalty": -0.5},
                                {"extra_body": {"repetition_penalty": 1.5}},
                                {"extra_body": {"repetition_penalty": 0.8}}])
def test_penalties_equal_the_processor_chain(client, hf, kw):
    """Greedy with each penalty: the tokens of transformers with the same processor
    (RepetitionPenaltyLogitsProcessor over prompt and output; OpenAI's presence/frequency formula
    over the output), streamed and plain."""
    from transformers import RepetitionPenaltyLogitsProcessor

    extra = {"ignore_eos": True, "return_token_ids": True, **kw.get("extra_body", {})}
    args = {k: v for k, v in kw.items() if k != "extra_body"}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra, **args)
    procs = []
    if "repetition_penalty" in extra:
        procs.append(RepetitionPenaltyLogitsProcessor(extra["repetition_penalty"]))
    if args:
        procs.append(OutputPenalties(len(PROMPT), args.get("presence_penalty", 0), args.get("frequency_penalty", 0)))
    want = reference_tokens(hf, PROMPT, 16, procs)
    assert r.choices[0].token_ids == want
    assert want != reference_tokens(hf, PROMPT, 16)  # the penalty changed something
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       extra_body=extra, **args)
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == want


def test_min_p_and_penalties_with_seeded_sampling_equal_the_processor_chain(client, hf):
    """temperature 1, min_p 0.3 and a repetition penalty, seeded: the keyed draws over
    transformers' RepetitionPenaltyLogitsProcessor then MinPLogitsWarper."""
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    from tvmpipe.executor.sampler import Sampling

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=8,
                                  extra_body={"ignore_eos": True, "return_token_ids": True, "min_p": 0.3,
                                              "repetition_penalty": 1.3})
    want = reference_tokens(hf, PROMPT, 12, [RepetitionPenaltyLogitsProcessor(1.3), MinPLogitsWarper(0.3)],
                            key=0, sampling=Sampling(1.0, 0, 8))
    assert r.choices[0].token_ids == want
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=8,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert plain.choices[0].token_ids != want


class Bias:
    """OpenAI's logit_bias: values added to the logits (transformers has no processor for it)."""

    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for t, v in self.bias.items():
            scores[:, t] += v
        return scores


def test_logit_bias_and_min_tokens_equal_the_processor_chain(client, hf):
    """logit_bias (greedy, and seeded with a penalty) and min_tokens (a stop token the greedy
    stream would draw first ruled out for the first 4 tokens, as transformers'
    MinNewTokensLengthLogitsProcessor), against transformers with the same processors."""
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    from tvmpipe.executor.sampler import Sampling

    bias = {30: 3.0, 102: -100.0, 44: 1.5}
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                  logit_bias={str(t): v for t, v in bias.items()}, extra_body=extra)
    want = reference_tokens(hf, PROMPT, 10, [Bias(bias)])
    assert r.choices[0].token_ids == want and want != reference_tokens(hf, PROMPT, 10) and 102 not in want
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=2,
                                  logit_bias={"30": 2.0}, extra_body={**extra, "repetition_penalty": 1.4})
    assert r.choices[0].token_ids == reference_tokens(
        hf, PROMPT, 10, [Bias({30: 2.0}), RepetitionPenaltyLogitsProcessor(1.4)], sampling=Sampling(0.8, 0, 2))
    greedy = reference_tokens(hf, PROMPT, 8)
    stop = greedy[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={**extra, "min_tokens": 4, "stop_token_ids": [stop]})
    masked = reference_tokens(hf, PROMPT, 8, [MinNewTokensLengthLogitsProcessor(len(PROMPT), 4, [stop])])
    cut = next((i + 1 for i, t in enumerate(masked) if t == stop), len(masked))  # it stops at the token after 4
    assert r.choices[0].token_ids == masked[:cut] and stop not in masked[:4]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={**extra, "stop_token_ids": [stop]})
    assert plain.choices[0].token_ids == [stop] and plain.choices[0].finish_reason == "stop"


def test_a_batch_of_prompts_gets_one_choice_each(client):
    """A list of prompts (text and ids): one choice a prompt, each the single request's; with n=2,
    prompt p's choices are 2p and 2p + 1."""
    prompts = ["w5 w6 w7", [9, 60, 2], "w100"]
    kw = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == alone
    assert r.usage.prompt_tokens == 3 + 3 + 1 and r.usage.completion_tokens == 15
    two = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.text for c in two.choices] == [t for t in alone for _ in range(2)]
    streamed = {}
    for ch in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == alone


# ---- lm-eval ----------------------------------------------------------------------------------------

TASKS = ROOT / "tests" / "data" / "lm_eval"


def test_lm_eval_scores_as_transformers(scoring_server, checkpoint, hf, monkeypatch, tmp_path):
    """lm-eval's `local-completions` model on the local multiple-choice task (its loglikelihood
    path: token-id prompts, echo, logprobs=1, max_tokens=1, batches of 2 prompts, 4 concurrent
    requests) and a generate_until task: each choice's log-likelihood is transformers' own within
    1e-4, the accuracy the same, and the generations transformers' greedy ones."""
    import json

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(ROOT)  # the task files name their data relative to the repository
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    args = (f"model={MODEL},base_url={scoring_server.base}/completions,tokenizer_backend=huggingface,"
            f"tokenizer={checkpoint},num_concurrent=4,max_retries=1,tokenized_requests=True,max_length={CONTEXT},"
            "batch_size=2")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args,
                                  tasks=["tvmpipe_choices", "tvmpipe_words"],
                                  task_manager=TaskManager(include_path=str(TASKS)), log_samples=True)
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    docs = [json.loads(line) for line in (TASKS / "choices.jsonl").read_text().splitlines()]
    samples = sorted(out["samples"]["tvmpipe_choices"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    right = 0
    for doc, s in zip(docs, samples):
        ctx = tok.encode(doc["context"])
        want = []
        for choice in doc["choices"]:
            ids = tok.encode(doc["context"] + " " + choice)
            lsm = log_softmax(hf, ids)
            want.append(sum(lsm[i - 1, ids[i]] for i in range(len(ctx), len(ids))))
        got = [ll for ll, _ in s["filtered_resps"]]
        assert np.allclose(got, want, atol=TOL, rtol=0), (doc, got, want)
        right += int(np.argmax(want)) == doc["gold"]
    assert out["results"]["tvmpipe_choices"]["acc,none"] == pytest.approx(right / len(docs))
    words = [json.loads(line) for line in (TASKS / "words.jsonl").read_text().splitlines()]
    gens = sorted(out["samples"]["tvmpipe_words"], key=lambda s: s["doc_id"])
    assert len(gens) == len(words)
    for doc, s in zip(words, gens):
        ids = tok.encode(doc["context"])
        text = tok.decode(reference_tokens(hf, ids, 5), skip_special_tokens=True)  # as vLLM's and tvmpipe's text
        assert s["filtered_resps"][0] == text.split("w7")[0], (doc, s["filtered_resps"], text)
    assert sum(bool(s["filtered_resps"][0]) for s in gens) >= len(gens) // 2  # words, not only special tokens


# ---- response_format: JSON through llguidance's token masks ---------------------------------------

@pytest.fixture(scope="module")
def json_tokenizer(tmp_path_factory) -> Path:
    return build_json_tokenizer(tmp_path_factory.mktemp("tok") / "json")


@pytest.fixture(scope="module")
def json_client(bundle, json_tokenizer, tmp_path_factory):
    srv = ServerProcess(bundle, "--stages", "2", "--processes", "--tokenizer", str(json_tokenizer),
                        log_path=tmp_path_factory.mktemp("server") / "stderr.txt")
    yield openai.OpenAI(base_url=srv.base, api_key="unused", max_retries=0, timeout=120)
    assert srv.stop() == 0, srv.log()[-3000:]


def constrained_reference(hf, tokenizer_dir: Path, prompt: list[int], n: int, schema: dict | None,
                          sampling=None, grammar: str | None = None) -> list[int]:
    """transformers' continuation with llguidance's mask over its logits (a matcher of its own, of
    `schema` or `grammar`), greedy or the keyed draw, until the eos or n tokens."""
    import json

    import llguidance
    import torch

    lt = llguidance.LLTokenizer((tokenizer_dir / "tokenizer.json").read_text(), n_vocab=128, eos_token=[JSON_EOS])
    from tvmpipe.executor.grammar import JSON_OPTIONS  # ", " and ": ", no other whitespace

    m = llguidance.LLMatcher(lt, grammar or llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema if schema is not None else {"type": "object"}), defaults=JSON_OPTIONS))
    ids, out = list(prompt), []
    for i in range(n):
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[0, -1].double().numpy()
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:128]
        x = np.where(bits.astype(bool), x, -np.inf)
        t = int(np.argmax(x)) if sampling is None else sampling.pick(x, 0, i)
        out.append(t)
        ids.append(t)
        if t == JSON_EOS:
            break
        assert m.consume_token(t)
    return out


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}


def test_json_schema_output_parses_validates_and_equals_the_masked_reference(json_client, json_tokenizer, hf):
    """response_format json_schema, greedy, plain and streamed: JSON that parses and validates
    against the schema, ended by the eos (finish_reason stop), token for token transformers' greedy
    continuation under llguidance's mask of the same schema; chat the same way; a schema that does
    not compile is a 400 naming response_format."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = json_client.completions.create(model=MODEL, prompt="Answer in JSON.", max_tokens=40, temperature=0,
                                       extra_body={"response_format": fmt, "return_token_ids": True})
    c = r.choices[0]
    import json

    value = json.loads(c.text)
    assert set(value) == {"city", "ok"} and value["city"] in ("Paris", "Rome", "Oslo") and isinstance(value["ok"], bool)
    assert c.finish_reason == "stop" and c.token_ids[-1] == JSON_EOS
    assert c.token_ids == constrained_reference(hf, json_tokenizer, c.prompt_token_ids, 40, SCHEMA)
    chunks = json_client.completions.create(model=MODEL, prompt="Answer in JSON.", max_tokens=40, temperature=0,
                                            stream=True, extra_body={"response_format": fmt})
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    chat = json_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}],
                                               max_tokens=36, temperature=0, response_format=fmt)
    assert json.loads(chat.choices[0].message.content)["city"] in ("Paris", "Rome", "Oslo")
    with pytest.raises(openai.BadRequestError) as info:
        json_client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}})
    assert info.value.param == "response_format"


def test_json_object_output_with_seeded_sampling_equals_the_masked_reference(json_client, json_tokenizer, hf):
    """response_format json_object, seeded sampling: the keyed draws under the mask of any JSON
    object (a random model's strings rarely close within 30 tokens: an answer that ended, stop,
    parses as an object)."""
    import json

    from tvmpipe.executor.sampler import Sampling

    for seed in range(3):
        r = json_client.completions.create(model=MODEL, prompt=[60, 61], max_tokens=30, temperature=1.0, seed=seed,
                                           extra_body={"response_format": {"type": "json_object"},
                                                       "return_token_ids": True})
        c = r.choices[0]
        assert c.token_ids == constrained_reference(hf, json_tokenizer, [60, 61], 30, None, Sampling(1.0, 0, seed))
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


# ---- tools ------------------------------------------------------------------------------------------

# one short tool: the tokenizer spends about a token a character, and the context is 256
TOOLS = [{"type": "function", "function": {"name": "city", "parameters": {
    "properties": {"c": {"enum": ["Paris", "Rome"]}}, "required": ["c"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tools_client(checkpoint, json_tokenizer, tmp_path_factory):
    """A server on the checkpoint at context 256 (a prompt with tools is long), the JSON tokenizer
    and its Qwen2.5-style template."""
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    out = tmp_path_factory.mktemp("bundle") / "gpt2_256"
    export(str(checkpoint), progress=Progress(stream=None), decode=256, chunk=8).write(out)
    srv = ServerProcess(out, "--stages", "2", "--processes", "--tokenizer", str(json_tokenizer),
                        log_path=tmp_path_factory.mktemp("server") / "stderr.txt")
    yield openai.OpenAI(base_url=srv.base, api_key="unused", max_retries=0, timeout=120)
    assert srv.stop() == 0, srv.log()[-3000:]


def test_a_named_or_required_tool_choice_calls_a_tool(tools_client, json_tokenizer, hf):
    """tool_choice naming a function: the answer is a call of it, its arguments valid for its
    schema, finish_reason tool_calls, token for token transformers' greedy continuation under the
    mask of that call's grammar; streamed, one delta with the same call; `required` (sampled)
    calls the tool too."""
    import json

    from tvmpipe.generation.tools import call_grammar

    msgs = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "city"}}
    r = tools_client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named,
                                             max_tokens=70, temperature=0, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "city" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["c"] in ("Paris", "Rome")
    grammar = call_grammar("hermes", [TOOLS[0]["function"]])
    assert c.token_ids == constrained_reference(hf, json_tokenizer, c.prompt_token_ids, 70, None, grammar=grammar)
    chunks = list(tools_client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named,
                                                       max_tokens=70, temperature=0, stream=True))
    calls = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in calls] == [("city", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    r = tools_client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                             max_tokens=70, temperature=0.9, seed=4)
    call = r.choices[0].message.tool_calls[0].function
    assert call.name == "city" and json.loads(call.arguments)["c"] in ("Paris", "Rome")


def test_tool_history_renders_as_transformers_and_auto_reads_plain_text(tools_client, json_tokenizer):
    """An assistant turn with tool_calls and no content, and the tool's result, are rendered by the
    template exactly as transformers' apply_chat_template renders them (arguments as an object; the
    tools themselves left out, for the context's sake: tests/generation/test_text.py renders them);
    with tool_choice auto an answer without a call is plain content, streamed as it comes."""
    import json

    from transformers import AutoTokenizer

    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "city", "arguments": json.dumps({"c": "Rome"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = tools_client.chat.completions.create(model=MODEL, messages=history, max_tokens=3, temperature=0,
                                             extra_body={"return_token_ids": True})
    tok = AutoTokenizer.from_pretrained(str(json_tokenizer))
    as_objects = [history[0], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "city", "arguments": {"c": "Rome"}}}]}, history[2]]
    want = tok.apply_chat_template(as_objects, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert r.choices[0].prompt_token_ids == list(want)
    assert "<tool_response>\nsunny" in tok.decode(want)
    auto = tools_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                tools=TOOLS, tool_choice="auto", max_tokens=4, temperature=0)
    c = auto.choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "length" and isinstance(c.message.content, str)
    chunks = list(tools_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                       tools=TOOLS, tool_choice="auto", max_tokens=4, temperature=0,
                                                       stream=True))
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices[0].delta.content]
    assert "".join(pieces) == c.message.content and chunks[-1].choices[0].finish_reason == "length"


def test_tools_need_a_template_that_writes_calls(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], tools=TOOLS,
                                       max_tokens=2)
    assert info.value.param == "tools" and "writes no tool calls" in info.value.message
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], tools=TOOLS,
                                       tool_choice="none", max_tokens=2)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
