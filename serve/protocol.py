"""The OpenAI protocol as tvmpipe serves it: request bodies read into an `Ask`, errors as OpenAI's
error JSON, and the response and chunk objects of /v1/completions and /v1/chat/completions.

Every parameter a body may carry is named here, once: the ones tvmpipe builds (`max_tokens`,
`temperature`, `top_p`, `seed`, `stop`, `stream`, `stream_options.include_usage`, and vLLM's
`top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids`, `chat_template_kwargs`), and the ones
it does not, which are accepted only at the value that asks for nothing (`n` 1, `logprobs`
null/false, `presence_penalty` 0, ...). Any other value, and any name not listed, is refused with a
400 naming the parameter: a client never gets a silent default in place of what it asked for.

Values are checked where the generation layer checks them (requests.Request.checked, the
sampler's Sampling.check), whose FieldErrors name the field; this module only checks what JSON
adds (types of the fields it reads itself) and renders those errors with the HTTP parameter's
name (`FIELD_PARAMS`, `from_generation_error`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from tvmpipe.core import jsonlimits
from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.generation.requests import FinishReason

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's (and vLLM's) default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: sampling, unless the client asks for 0 (greedy)

# The generation layer names the fields it checks (core.errors.FieldError); a served request names
# its JSON parameters, where they differ
FIELD_PARAMS = {"max_new_tokens": "max_tokens", "stop_tokens": "stop_token_ids"}


class ApiError(Exception):
    """An HTTP error as OpenAI's JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or self.TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_generation_error(exc: TvmpipeError, prompt_param: str, tokens_param: str = "max_tokens") -> ApiError:
    """A 400 from a generation-layer check: a FieldError names its field by the JSON parameter;
    any other is about the prompt."""
    if isinstance(exc, FieldError):
        names = {**FIELD_PARAMS, "max_new_tokens": tokens_param}
        return bad_request(exc.render(names), names.get(exc.field, exc.field))
    return bad_request(str(exc), prompt_param)


# ---------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------

MAX_JSON_DEPTH = jsonlimits.MAX_DEPTH  # nesting of arrays and objects a body may have


def read_json_body(raw: bytes) -> Any:
    """A request body's JSON; ApiError 400 for anything else: not JSON (or not UTF-8), nested
    deeper than MAX_JSON_DEPTH (checked before parsing, without recursion), or a string or object
    key that cannot be encoded as UTF-8 (a lone surrogate escape), naming where it is."""
    try:
        return jsonlimits.loads(raw, MAX_JSON_DEPTH)
    except jsonlimits.JsonError as exc:
        if exc.kind == "string":
            raise bad_request(f"{exc.where or 'the request body'}: {exc.message}", exc.where or None,
                              "invalid_string") from None
        if exc.kind == "depth":
            raise bad_request(f"the request body is {exc.message}", None, "too_deeply_nested") from None
        raise bad_request(f"the request body is {exc.message}") from None



@dataclass(frozen=True)
class Ask:
    """What one request body asks for, its JSON types checked; the values are checked where the
    request is made (serve.service)."""

    chat: bool
    model: str
    prompt: str | list[int] | None = None  # /v1/completions
    messages: list[Any] | None = None  # /v1/chat/completions
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    max_tokens: int | None = None  # None: the endpoint's default, within the context's room
    tokens_param: str = "max_tokens"  # the name the client gave it (chat: or max_completion_tokens)
    temperature: Any = DEFAULT_TEMPERATURE
    top_p: Any = 1.0
    top_k: Any = 0
    seed: Any = None  # None: a fresh seed per request (sampling), irrelevant when greedy
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[Any, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "stop_token_ids", "ignore_eos", "return_token_ids"}
_SUPPORTED = {False: _COMMON | {"prompt"},
              True: _COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "add_generation_prompt"}}

# Parameters tvmpipe does not build: accepted only at the value that asks for nothing
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False,), "top_logprobs": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "store": (False,), "metadata": ({},), "min_tokens": (0,),
    "user": None,  # an end-user id for abuse monitoring: any string, nothing to build
}
_WHY = {"n": "one choice a request (send n requests: they run concurrently)",
        "best_of": "one choice a request", "logprobs": "no log probabilities",
        "top_logprobs": "no log probabilities", "echo": "no echo of the prompt",
        "tools": "no tool calls", "tool_choice": "no tool calls", "functions": "no tool calls",
        "function_call": "no tool calls", "parallel_tool_calls": "no tool calls",
        "response_format": "plain text only", "logit_bias": "no logit bias",
        "presence_penalty": "no penalties", "frequency_penalty": "no penalties", "repetition_penalty": "no penalties"}


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality without Python's True == 1."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _number(value: Any, param: str) -> Any:
    """A JSON number (its range is the sampler's to check)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{param} must be a number, got {json.dumps(value)}", param)
    return value


def _integer(value: Any, param: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{param} must be an integer, got {json.dumps(value)}", param)
    return value


def _boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"{param} must be true or false, got {json.dumps(value)}", param)
    return value


def _stops(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop must be a string or a list of strings, got {json.dumps(value)}", "stop")
    if any(not s for s in stops):
        raise bad_request("stop: stop strings must not be empty", "stop")
    return tuple(dict.fromkeys(stops))


def _prompt(value: Any) -> str | list[int]:
    """A string or a list of token ids; a list of one of these is that one (OpenAI's batched form
    with a single prompt); several prompts are refused (one request each runs as fast)."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1:
            raise bad_request(f"prompt: a batch of {len(value)} prompts; tvmpipe serve takes one prompt a request "
                              "(send one request per prompt: they run concurrently)", "prompt")
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise bad_request("prompt must be a string or a list of token ids", "prompt")


# What the server itself passes to a chat template (generation.text's render_chat): a kwarg of the
# same name would collide with it. The special tokens (bos_token, ...) are passed too, and may be
# overridden, as transformers' apply_chat_template lets its kwargs override them.
TEMPLATE_NAMES = ("messages", "add_generation_prompt", "tools", "documents")


def _chat_kwargs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"chat_template_kwargs must be an object, got {json.dumps(value)}", "chat_template_kwargs")
    taken = [name for name in TEMPLATE_NAMES if name in value]
    if taken:
        hint = (" (give add_generation_prompt as a top-level parameter)" if "add_generation_prompt" in taken else
                " (the chat is the messages parameter)" if "messages" in taken else "")
        raise bad_request(f"chat_template_kwargs: {', '.join(taken)} cannot be given here, the server passes "
                          f"{'it' if len(taken) == 1 else 'them'} to the chat template itself{hint}",
                          "chat_template_kwargs")
    return dict(value)


def _content_text(content: Any, i: int) -> Any:
    """A message's content as the template reads it: a string, or OpenAI's list of parts of which
    only text parts are served (joined)."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"messages[{i}].content[{j}]: only text parts are served, got {kind!r}",
                              f"messages[{i}].content")
        texts.append(part["text"])
    return "".join(texts)


def _messages(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise bad_request("messages must be a list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        if isinstance(m, dict) and "content" in m:
            m = {**m, "content": _content_text(m["content"], i)}
        out.append(m)
    return out


def read_ask(body: Any, *, chat: bool) -> Ask:
    """The Ask of a /v1/completions (chat False) or /v1/chat/completions body; ApiError 400 naming
    the parameter for anything refused."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    given = {k: v for k, v in body.items() if v is not None}  # OpenAI: null means "not given"
    for name, value in given.items():
        if name in _SUPPORTED[chat]:
            continue
        if name not in _NEUTRAL:
            raise bad_request(f"unknown parameter {name!r} (tvmpipe serve refuses what it does not build rather "
                              "than ignore it)", name)
        neutral = _NEUTRAL[name]
        if neutral is None:
            if not isinstance(value, str):
                raise bad_request(f"{name} must be a string", name)
            continue
        if not any(_same(value, v) for v in neutral):
            why = _WHY.get(name, "not built")
            raise bad_request(f"{name}={json.dumps(value)} is not supported by tvmpipe serve ({why})", name,
                              "unsupported_parameter")
    model = given.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: required, the served model's name (GET /v1/models)", "model")
    kw: dict[str, Any] = {"chat": chat, "model": model}
    if chat:
        if "messages" not in given:
            raise bad_request("messages: required", "messages")
        kw["messages"] = _messages(given["messages"])
        if "chat_template_kwargs" in given:
            kw["chat_template_kwargs"] = _chat_kwargs(given["chat_template_kwargs"])
        if "add_generation_prompt" in given:
            kw["add_generation_prompt"] = _boolean(given["add_generation_prompt"], "add_generation_prompt")
        if "max_tokens" in given and "max_completion_tokens" in given:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        if "max_completion_tokens" in given:
            kw["max_tokens"] = _integer(given["max_completion_tokens"], "max_completion_tokens")
            kw["tokens_param"] = "max_completion_tokens"
    else:
        if "prompt" not in given:
            raise bad_request("prompt: required (a string or a list of token ids)", "prompt")
        kw["prompt"] = _prompt(given["prompt"])
    if "max_tokens" in given:
        kw["max_tokens"] = _integer(given["max_tokens"], "max_tokens")
    for name in ("temperature", "top_p"):
        if name in given:
            kw[name] = _number(given[name], name)
    if "top_k" in given:
        top_k = _integer(given["top_k"], "top_k")
        kw["top_k"] = 0 if top_k == -1 else top_k  # vLLM's -1: every token
    if "seed" in given:
        kw["seed"] = _integer(given["seed"], "seed")
    if "stop" in given:
        kw["stop"] = _stops(given["stop"])
    if "stop_token_ids" in given:
        ids = given["stop_token_ids"]
        if not isinstance(ids, list):
            raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
        kw["stop_token_ids"] = tuple(ids)
    for name in ("ignore_eos", "return_token_ids", "stream"):
        if name in given:
            kw[name] = _boolean(given[name], name)
    if "stream_options" in given:
        opts = given["stream_options"]
        if not kw.get("stream"):
            raise bad_request("stream_options: only with stream=true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad_request(f"stream_options: only include_usage is supported, got {json.dumps(opts)}",
                              "stream_options")
        if opts.get("include_usage") is not None:
            kw["include_usage"] = _boolean(opts["include_usage"], "stream_options.include_usage")
    return Ask(**kw)


def resolve_max_tokens(asked: int | None, default: int | None, prompt_tokens: int, max_context: int, *,
                       prompt_param: str, tokens_param: str) -> int:
    """Tokens to generate, as vLLM decides: the prompt and the completion must fit the context, so
    a prompt that fills it, or an explicit max_tokens beyond the room left, is a 400; without one,
    the endpoint's default (None: all the room) clamped to the room."""
    room = max_context - prompt_tokens
    if room < 1:
        raise bad_request(f"this model's maximum context length is {max_context} tokens and the {prompt_param} has "
                          f"{prompt_tokens}: no room to generate, shorten it", prompt_param, "context_length_exceeded")
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise bad_request(f"{tokens_param} {asked} is too large: this model's maximum context length is {max_context} "
                          f"tokens and the {prompt_param} has {prompt_tokens} ({asked} > {max_context} - "
                          f"{prompt_tokens})", tokens_param, "context_length_exceeded")
    return asked


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def finish_reason(finish: FinishReason) -> str:
    """OpenAI's finish_reason of a sequence's end: a stop token or string is "stop"; the length
    limit is "length" (and a full context, which cannot happen: requests fit the context)."""
    return "stop" if finish == FinishReason.STOP else "length"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Reply:
    """The response objects of one request: a whole body, or its stream's chunks."""

    ask: Ask
    model: str
    prompt_ids: list[int]
    id: str = ""
    created: int = 0
    _template: tuple[str, list[str]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.ask.chat else "text_completion") + (".chunk" if chunk and self.ask.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _ids(self, choice: dict[str, Any], token_ids: list[int] | None, first: bool) -> dict[str, Any]:
        if self.ask.return_token_ids and token_ids is not None:
            if first:
                choice["prompt_token_ids"] = list(self.prompt_ids)
            choice["token_ids"] = list(token_ids)
        return choice

    def body(self, text: str, token_ids: list[int], finish: str) -> dict[str, Any]:
        """The non-streaming response."""
        if self.ask.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(False), "choices": [self._ids(choice, token_ids, True)],
                "usage": usage(len(self.prompt_ids), len(token_ids))}

    def chunk(self, text: str | None, token_ids: list[int] | None, finish: str | None, *, first: bool = False) -> dict:
        """One streamed chunk: text (chat: the delta's content; None with `first`: the role alone),
        the tokens it covers, and the finish_reason on the last one."""
        if self.ask.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
                delta["content"] = text or ""
            elif text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = {**self._head(True), "choices": [self._ids(choice, token_ids, first)]}
        if self.ask.include_usage:
            out["usage"] = None
        return out

    def token_event(self, text: str, token_ids: list[int]) -> bytes:
        """The SSE event of a chunk amid the stream (not the first, not the last; chat: with text):
        `chunk()`'s JSON, written from a template made once a request. A stream writes one a token,
        and every microsecond here is taken from the stages on a machine whose cores they share."""
        if self._template is None:
            probe = self.chunk(_TEXT_PROBE, [_IDS_PROBE] if self.ask.return_token_ids else None, None)
            flat = json.dumps(probe, separators=(",", ":"), ensure_ascii=False)
            head, tail = flat.split(json.dumps(_TEXT_PROBE), 1)  # the text comes after id, model, ...
            self._template = (f"data: {head}", tail.split(f"[{_IDS_PROBE}]", 1))  # two parts with token ids
        head, tail = self._template
        ids = json.dumps(token_ids, separators=(",", ":")) if len(tail) == 2 else ""
        return f"{head}{json.dumps(text, ensure_ascii=False)}{ids.join(tail)}\n\n".encode()

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(len(self.prompt_ids), completion_tokens)}


_TEXT_PROBE = "\u0000text\u0000"  # placeholders of Reply.token_event's template
_IDS_PROBE = -987654321


def sse(obj: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: {json}` and a blank line (or `data: [DONE]`)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")
