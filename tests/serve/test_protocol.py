"""Request bodies as tvmpipe serve reads them (no server): what is built, what is refused and how
it is named, vLLM's context rule for max_tokens, and the shape of responses and chunks."""

from __future__ import annotations

import json

import pytest

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.core import jsonlimits
from tvmpipe.serve.protocol import (
    DEFAULT_TEMPERATURE,
    DONE,
    MAX_JSON_DEPTH,
    TEMPLATE_NAMES,
    ApiError,
    Reply,
    from_generation_error,
    read_ask,
    read_json_body,
    resolve_max_tokens,
    sse,
)


def refused(body: dict, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as info:
        read_ask(body, chat=chat)
    assert info.value.status == 400
    return info.value


def test_completions_body():
    ask = read_ask({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": -1,
                    "seed": 7, "stop": "\n", "stream": True, "stream_options": {"include_usage": True},
                    "n": 1, "logprobs": None, "echo": False, "user": "u1", "ignore_eos": True,
                    "stop_token_ids": [3], "return_token_ids": True}, chat=False)
    assert (ask.prompt, ask.max_tokens, ask.temperature, ask.top_p, ask.top_k, ask.seed) == ("hi", 5, 0, 0.5, 0, 7)
    assert ask.stop == ("\n",) and ask.stream and ask.include_usage and ask.ignore_eos and ask.return_token_ids
    assert ask.stop_token_ids == (3,)
    assert read_ask({"model": "m", "prompt": [5, 17, 3]}, chat=False).prompt == [5, 17, 3]
    assert read_ask({"model": "m", "prompt": [[5, 17]]}, chat=False).prompt == [5, 17]  # a batch of one
    plain = read_ask({"model": "m", "prompt": "x"}, chat=False)
    assert plain.temperature == DEFAULT_TEMPERATURE and plain.seed is None and plain.max_tokens is None


def test_chat_body():
    ask = read_ask({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 9, "chat_template_kwargs": {"enable_thinking": False},
                    "response_format": {"type": "text"}, "tools": [], "logprobs": False}, chat=True)
    assert ask.messages == [{"role": "user", "content": "ab"}] and ask.max_tokens == 9
    assert ask.tokens_param == "max_completion_tokens" and ask.chat_template_kwargs == {"enable_thinking": False}


def test_scoring_and_choices_are_read():
    ask = read_ask({"model": "m", "prompt": [[1, 2], "b"], "logprobs": 5, "echo": True, "n": 2, "best_of": 3,
                    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1},
                   chat=False)
    assert ask.prompts == ([1, 2], "b") and ask.prompt == [1, 2] and ask.logprobs == 5 and ask.echo
    assert (ask.n, ask.best_of, ask.presence_penalty, ask.frequency_penalty, ask.repetition_penalty, ask.min_p) == (
        2, 3, 0.5, -0.5, 1.2, 0.1)
    chat = read_ask({"model": "m", "messages": [], "logprobs": True, "top_logprobs": 3}, chat=True)
    assert chat.logprobs == 3
    assert read_ask({"model": "m", "messages": [], "logprobs": True}, chat=True).logprobs == 0
    assert read_ask({"model": "m", "messages": [], "logprobs": False}, chat=True).logprobs is None
    assert read_ask({"model": "m", "prompt": "x", "logprobs": False}, chat=False).logprobs is None
    biased = read_ask({"model": "m", "prompt": "x", "logit_bias": {"5": -100, "17": 2.5}, "min_tokens": 3}, chat=False)
    assert biased.logit_bias == {5: -100, 17: 2.5} and biased.min_tokens == 3


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "n": 17}, "n"),
    ({"model": "m", "prompt": "x", "n": True}, "n"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": -1}, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"model": "m", "prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"model": "m", "prompt": "x", "echo": 1}, "echo"),
    ({"model": "m", "prompt": "x", "logit_bias": {"x5": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": [5]}, "logit_bias"),
    ({"model": "m", "prompt": "x", "min_tokens": 1.5}, "min_tokens"),
    ({"model": "m", "prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "suffix": "end"}, "suffix"),
    ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": "m", "prompt": [[1]] * 65}, "prompt"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m"}, "prompt"),
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "stop": 5}, "stop"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options"),
])
def test_completions_refusals_name_the_parameter(body, param):
    assert refused(body).param == param


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": [], "tools": [{"type": "function"}]}, "tools"),
    ({"model": "m", "messages": [], "logprobs": 1}, "logprobs"),
    ({"model": "m", "messages": [], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "m", "messages": [], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": "m", "messages": [], "echo": True}, "echo"),
    ({"model": "m", "messages": [], "best_of": 2}, "best_of"),
    ({"model": "m", "messages": [], "response_format": {"type": "xml"}}, "response_format"),
    ({"model": "m", "messages": [], "response_format": {"type": "json_schema", "json_schema": []}}, "response_format"),
    ({"model": "m", "messages": [], "max_tokens": 3, "max_completion_tokens": 3}, "max_completion_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": [], "prompt": "x"}, "prompt"),
])
def test_chat_refusals_name_the_parameter(body, param):
    assert refused(body, chat=True).param == param


def test_refusals_are_openai_error_json():
    e = refused({"model": "m", "prompt": "x", "suffix": "end"})
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": "suffix",
                                  "code": "unsupported_parameter"}}
    assert "not supported" in e.message
    assert refused({"model": "m", "prompt": "x", "frobnicate": 1}).message.startswith("unknown parameter 'frobnicate'")


def test_max_tokens_follows_vllm():
    """prompt + max_tokens must fit the context (a 400 otherwise); without max_tokens, the
    endpoint's default clamped to the room left, or all of it."""
    assert resolve_max_tokens(None, 16, 10, 64, prompt_param="prompt", tokens_param="max_tokens") == 16
    assert resolve_max_tokens(None, 16, 60, 64, prompt_param="prompt", tokens_param="max_tokens") == 4
    assert resolve_max_tokens(None, None, 10, 64, prompt_param="messages", tokens_param="max_tokens") == 54
    assert resolve_max_tokens(54, None, 10, 64, prompt_param="messages", tokens_param="max_tokens") == 54
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(55, None, 10, 64, prompt_param="messages", tokens_param="max_completion_tokens")
    assert info.value.param == "max_completion_tokens" and info.value.code == "context_length_exceeded"
    assert "55 > 64 - 10" in info.value.message
    for n in (64, 70):
        with pytest.raises(ApiError) as info:
            resolve_max_tokens(None, 16, n, 64, prompt_param="prompt", tokens_param="max_tokens")
        assert info.value.param == "prompt" and f"has {n}" in info.value.message


def test_generation_checks_name_the_json_parameters():
    """The generation layer's FieldErrors name their field; the server renders them with the JSON
    parameter (max_new_tokens is max_tokens, or max_completion_tokens where the body said so)."""
    from tvmpipe.core.errors import FieldError
    from tvmpipe.executor.sampler import Sampling
    from tvmpipe.generation.requests import check_max_new_tokens, check_stop_tokens

    with pytest.raises(FieldError) as info:
        Sampling(top_p=2).check(128)
    e = from_generation_error(info.value, "prompt")
    assert (e.param, e.message) == ("top_p", "top_p must be a number in (0, 1], got 2")
    with pytest.raises(FieldError) as info:
        check_max_new_tokens(0)
    e = from_generation_error(info.value, "messages", "max_completion_tokens")
    assert (e.param, e.message) == ("max_completion_tokens", "max_completion_tokens must be an integer >= 1, got 0")
    with pytest.raises(FieldError) as info:
        check_stop_tokens([500], 128)
    assert from_generation_error(info.value, "prompt").param == "stop_token_ids"
    e = from_generation_error(TvmpipeError("prompt: token id 500 is outside the vocabulary 0..127"), "prompt")
    assert e.param == "prompt" and "--" not in e.message


def test_chunks_and_bodies():
    ask = read_ask({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True}, chat=True)
    reply = Reply(ask, "m", [1, 2, 3])
    first = reply.chunk("", [], None, first=True)
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    assert first["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    last = reply.chunk("yo", [9], "stop")
    assert last["choices"][0] == {"index": 0, "delta": {"content": "yo"}, "logprobs": None, "finish_reason": "stop",
                                  "token_ids": [9]}
    assert reply.usage_chunk(4)["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert reply.usage_chunk(4)["choices"] == []
    body = Reply(read_ask({"model": "m", "prompt": "x"}, chat=False), "m", [1]).body("hi", [5, 6], "length")
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hi"
    assert "token_ids" not in body["choices"][0] and body["usage"]["total_tokens"] == 3
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and DONE == b"data: [DONE]\n\n"
    assert json.loads(sse({"t": "é"})[6:]) == {"t": "é"}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("ids", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_token_events_are_the_chunks_json(chat, ids, usage):
    """The templated SSE event of a mid-stream chunk is byte for byte the generic chunk's, whatever
    the text (quotes, escapes, what looks like the template's placeholders) and the model name."""
    body = {"model": "m", "stream": True, "return_token_ids": ids}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    if usage:
        body["stream_options"] = {"include_usage": True}
    for model in ('m"odel [-987654321]', "gpt2-step"):
        reply = Reply(read_ask(body, chat=chat), model, [1, 2])
        for text in ('hé "q" \\n [0] \u0000', "\u0000text\u0000", "plain", " ", "\t\x1f\u2028\U0001f600"):
            for token_ids in ([5, 6], [7], []):
                assert reply.token_event(text, token_ids) == sse(reply.chunk(text, token_ids, None))


# --- issue 50, item 5: bodies json.loads cannot take, or that failed later (500s before) ---


def body_refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        read_json_body(raw)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    json.dumps(info.value.body()).encode("utf-8")  # the error itself is sendable
    return info.value


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 100_000])
def test_deep_bodies_are_refused_naming_the_limit(depth):
    e = body_refused(b"[" * depth + b"]" * depth)
    assert f"{depth} levels deep" in e.message and f"limit of {MAX_JSON_DEPTH}" in e.message
    deep = ('{"model": "m", "prompt": ' + '{"a": ' * depth + "1" + "}" * depth + "}").encode()
    assert f"limit of {MAX_JSON_DEPTH}" in body_refused(deep).message
    assert "levels deep" in body_refused(b"[" * depth).message  # unterminated: still refused for its depth


def test_depth_is_counted_outside_strings_and_the_limit_itself_is_served():
    ok = "[" * (MAX_JSON_DEPTH - 1) + json.dumps({"p": "[{" * 1000 + '\\"[['}) + "]" * (MAX_JSON_DEPTH - 1)
    assert jsonlimits.depth(ok) == MAX_JSON_DEPTH
    assert read_json_body(ok.encode())  # brackets in strings, escaped quotes: not nesting
    assert jsonlimits.depth('"[[[') == 0 and jsonlimits.depth('["a\\"[", [[]]]') == 3


def test_depth_check_is_linear_on_hostile_text():
    """Strings that never close, or close only at the end, would make a backtracking string
    pattern quadratic; the body bound is 1 MiB by default."""
    for text in ['"' + '\\"' * 300_000, '"' * 600_000, '["' + "\\" * 600_000, "[" * 600_000 + '"']:
        body_refused(text.encode())  # returns at once (pytest's timeout is the bound)


@pytest.mark.parametrize("raw,where,key", [
    (b'{"model": "m", "prompt": "a\\ud800"}', "prompt", False),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content", False),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text", False),
    (b'{"model": "m", "chat_template_kwargs": {"\\ud800": 1}}', "chat_template_kwargs", True),
    (b'{"model": "m", "\\udbff": 1}', None, True),
])
def test_lone_surrogates_are_refused_naming_the_field(raw, where, key):
    e = body_refused(raw)
    assert e.param == where and "cannot be encoded as UTF-8" in e.message and e.code == "invalid_string"
    assert e.message.startswith(where or "the request body")
    assert ("object key" in e.message) == key


def test_surrogate_pairs_and_utf8_are_text():
    assert read_json_body(b'{"p": "\\ud83d\\ude00 \\\\ud800"}') == {"p": "\U0001F600 \\ud800"}
    assert read_json_body('{"p": "é😀"}'.encode()) == {"p": "é😀"}
    assert read_json_body('{"p": "é"}'.encode("utf-16")) == {"p": "é"}  # as json.loads reads bytes


@pytest.mark.parametrize("raw,words", [
    (b"", "not valid JSON"), (b"{", "not valid JSON"), (b"\xff\xfe\xfd", "not valid"),
    (b'"\xed\xa0\x80"', "not valid UTF-8"),  # a surrogate encoded in UTF-8 bytes
    (b"[" + b"9" * 5000 + b"]", "not valid JSON"),  # past Python's int-from-text limit (a ValueError)
])
def test_bodies_that_are_not_json(raw, words):
    e = body_refused(raw)
    assert words in e.message and e.message.startswith("the request body is")


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_chat_template_kwargs_cannot_hold_what_the_server_passes(name):
    e = refused({"model": "m", "messages": [], "chat_template_kwargs": {name: [], "enable_thinking": True}}, chat=True)
    assert e.param == "chat_template_kwargs" and name in e.message
    assert set(TEMPLATE_NAMES) >= {"messages", "add_generation_prompt"}
    ok = read_ask({"model": "m", "messages": [], "chat_template_kwargs": {"bos_token": "<s>"}}, chat=True)
    assert ok.chat_template_kwargs == {"bos_token": "<s>"}  # a special token may be overridden, as transformers lets


def test_a_json_answer_the_vocabulary_cannot_begin_is_refused_before_it_runs(tmp_path):
    """A tokenizer llguidance reads that cannot write '{': a response_format json_object or
    json_schema is a 400 naming response_format (found from the grammar's first mask, as the
    sampling stage would find it at the request's first draw and end it with an error); the same
    tokenizer with '{' serves it."""
    pytest.importorskip("llguidance")
    import types

    from tests.support.json_tokenizer import build_json_tokenizer
    from tvmpipe.generation.text import load_text_codec
    from tvmpipe.serve.protocol import read_ask
    from tvmpipe.serve.service import Service

    engine = types.SimpleNamespace(layout=types.SimpleNamespace(vocab_size=128, max_context=64))
    body = {"model": "m", "prompt": "Answer in JSON.", "max_tokens": 8}
    fmts = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]
    without = Service(engine, load_text_codec(build_json_tokenizer(tmp_path / "no-brace", without="{")), "m")
    for fmt in fmts:
        with pytest.raises(ApiError) as info:
            without.grammar(read_ask({**body, "response_format": fmt}, chat=False))
        assert info.value.status == 400 and info.value.param == "response_format"
        assert "cannot write the first character" in info.value.message
    with_brace = Service(engine, load_text_codec(build_json_tokenizer(tmp_path / "json")), "m")
    for fmt in fmts:
        assert with_brace.grammar(read_ask({**body, "response_format": fmt}, chat=False))
