"""The OpenAI protocol as tvmpipe serves it: request bodies read into an `Ask`, errors as OpenAI's
error JSON, and the response and chunk objects of /v1/completions and /v1/chat/completions.

Every parameter a body may carry is named here, once: the ones tvmpipe builds (`max_tokens`,
`temperature`, `top_p`, `seed`, `stop`, `stream`, `stream_options.include_usage`, `logprobs`
(chat: with `top_logprobs`), `echo`, `n`, `best_of`, `presence_penalty`, `frequency_penalty`, a
list of prompts, `logit_bias`, `response_format` (JSON), chat `tools` / `tool_choice` /
`parallel_tool_calls`, and vLLM's `top_k`, `min_p`, `min_tokens`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `return_token_ids`, `chat_template_kwargs`), and the ones it does
not, which are accepted only at the value that asks for nothing (`suffix` "", `functions` [], ...). Any other
value, and any name not listed, is refused with a 400 naming the parameter: a client never gets a
silent default in place of what it asked for.

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
from typing import Any, Callable, Mapping, Sequence

from tvmpipe.core import jsonlimits
from tvmpipe.bundle.decode_layout import MAX_LOGPROBS
from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.generation.requests import FinishReason, Logprob

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's (and vLLM's) default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: sampling, unless the client asks for 0 (greedy)

# The generation layer names the fields it checks (core.errors.FieldError); a served request names
# its JSON parameters, where they differ
FIELD_PARAMS = {"max_new_tokens": "max_tokens", "stop_tokens": "stop_token_ids", "prompt_logprobs": "logprobs"}
MAX_CHOICES = 16  # n and best_of at most: each choice is a sequence in a row of its own
LOGPROB_FLOOR = -9999.0  # a log probability of -inf (a token the model rules out) as vLLM writes it: JSON has no inf


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
    prompt: str | list[int] | None = None  # /v1/completions (the first prompt of a batch)
    prompts: tuple[str | list[int], ...] = ()  # /v1/completions: every prompt of a batch (one choice each, x n)
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
    logprobs: int | None = None  # the most likely tokens to return beside each token's log probability
    echo: bool = False  # /v1/completions: the prompt (and its log probabilities) before the completion
    n: int = 1
    best_of: int | None = None  # /v1/completions: choices generated, the n most likely returned
    min_p: Any = 0.0
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    repetition_penalty: Any = 1.0
    logit_bias: dict[int, Any] = field(default_factory=dict)
    min_tokens: int = 0
    json_output: bool = False  # response_format json_object or json_schema: the output is JSON
    json_schema: dict[str, Any] | None = None  # json_schema's schema (None: any JSON object)
    tools: list[dict[str, Any]] = field(default_factory=list)  # chat: OpenAI's tool objects, as given
    tool_choice: str | dict[str, Any] = "auto"  # "none", "auto", "required", or a function's name as {"name": ...}
    parallel_tool_calls: bool = True

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "stop_token_ids", "ignore_eos", "return_token_ids", "logprobs", "n", "min_p", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "response_format"}
_SUPPORTED = {False: _COMMON | {"prompt", "echo", "best_of"},
              True: _COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "add_generation_prompt",
                               "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}}

# Parameters tvmpipe does not build: accepted only at the value that asks for nothing
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "functions": ([],), "function_call": ("none",),
    "store": (False,), "metadata": ({},),
    "user": None,  # an end-user id for abuse monitoring: any string, nothing to build
}
_WHY = {"suffix": "no insertion: the models served here complete left to right",
        "functions": "the deprecated functions API: send tools", "function_call": "the deprecated functions API: "
        "send tool_choice"}


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


def _response_format(value: Any) -> tuple[bool, dict[str, Any] | None]:
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema (its
    `json_schema.schema`); whether the output is JSON, and its schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return False, None
    if kind == "json_object" and set(value) == {"type"}:
        return True, None
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request("response_format: json_schema must be an object with a `schema` object", "response_format")
        extra = set(spec) - {"name", "schema", "strict", "description"}
        if extra:
            raise bad_request(f"response_format.json_schema: unknown field(s) {', '.join(sorted(extra))}",
                              "response_format")
        return True, spec.get("schema", {})
    raise bad_request(f"response_format must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                      f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}}, got {json.dumps(value)[:200]}",
                      "response_format", "unsupported_parameter")


MAX_LOGIT_BIAS = 1024  # tokens one logit_bias may name (installed on the sampling stage per sequence)


def _logit_bias(value: Any) -> dict[int, Any]:
    """OpenAI's logit_bias: an object from token ids (as strings) to numbers (their range is the
    generation layer's to check)."""
    if not isinstance(value, dict):
        raise bad_request(f"logit_bias must be an object of token ids to numbers, got {json.dumps(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias names {len(value)} tokens, more than {MAX_LOGIT_BIAS}", "logit_bias")
    out = {}
    for k, v in value.items():
        if not (isinstance(k, str) and k.strip().lstrip("-").isdigit()):
            raise bad_request(f"logit_bias: {json.dumps(k)} is not a token id", "logit_bias")
        out[int(k)] = _number(v, "logit_bias")
    return out


MAX_PROMPTS = 64  # prompts of one batched /v1/completions request (each runs as a sequence of its own)


def _prompts(value: Any) -> tuple[str | list[int], ...]:
    """A string or a list of token ids, or OpenAI's batch: a list of several of these (one choice
    each, all run concurrently)."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > MAX_PROMPTS:
            raise bad_request(f"prompt: a batch of {len(value)} prompts, more than {MAX_PROMPTS} (send several "
                              "requests: they run concurrently)", "prompt")
        return tuple(_prompt(p) for p in value)
    return (_prompt(value),)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise bad_request("prompt must be a string, a list of token ids, or a list of these", "prompt")


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
        if isinstance(m, dict) and m.get("tool_calls") is not None:
            m = {**m, "tool_calls": _history_calls(m["tool_calls"], i)}
        out.append(m)
    return out


def _history_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as templates read them: each function's arguments an object
    (OpenAI sends them as JSON text; templates write them with `tojson`, as vLLM passes them)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list of tool calls", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{j}]: expected {{\"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\"}}}}", where)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"{where}[{j}].function.arguments is not JSON", where) from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    """OpenAI's tools: function objects, each with a name and (optionally) a parameters schema."""
    if not isinstance(value, list):
        raise bad_request("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    names = set()
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                              "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if fn["name"] in names:
            raise bad_request(f"tools[{i}]: a second function named {fn['name']!r}", "tools")
        names.add(fn["name"])
    return list(value)


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise bad_request("tool_choice required: no tools given", "tool_choice")
        return value
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {fn['name']!r}, which is not one of the tools", "tool_choice")
    return {"name": fn["name"]}


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
        prompts = _prompts(given["prompt"])
        kw["prompt"], kw["prompts"] = prompts[0], prompts
        if "echo" in given:
            kw["echo"] = _boolean(given["echo"], "echo")
        if "logprobs" in given and given["logprobs"] is not False:  # vLLM also reads false as none
            kw["logprobs"] = _integer(given["logprobs"], "logprobs")
        if "best_of" in given:
            kw["best_of"] = _integer(given["best_of"], "best_of")
    if chat:
        if _boolean(given.get("logprobs", False), "logprobs"):
            kw["logprobs"] = _integer(given.get("top_logprobs", 0), "top_logprobs")
        elif "top_logprobs" in given:
            raise bad_request("top_logprobs: only with logprobs=true", "top_logprobs")
    if kw.get("logprobs") is not None and not 0 <= kw["logprobs"] <= MAX_LOGPROBS:
        param = "top_logprobs" if chat else "logprobs"
        raise bad_request(f"{param} must be from 0 to {MAX_LOGPROBS}, got {kw['logprobs']}", param)
    if "n" in given:
        kw["n"] = _integer(given["n"], "n")
        if not 1 <= kw["n"] <= MAX_CHOICES:
            raise bad_request(f"n must be from 1 to {MAX_CHOICES}, got {kw['n']}", "n")
    if kw.get("best_of") is not None:
        if not kw.get("n", 1) <= kw["best_of"] <= MAX_CHOICES:
            raise bad_request(f"best_of must be from n ({kw.get('n', 1)}) to {MAX_CHOICES}, got {kw['best_of']}",
                              "best_of")
        if kw["best_of"] > kw.get("n", 1) and given.get("stream"):
            raise bad_request("best_of > n cannot be streamed (the choices are known only once all have ended)",
                              "best_of")
    if "response_format" in given:
        kw["json_output"], kw["json_schema"] = _response_format(given["response_format"])
    if chat and "tools" in given:
        kw["tools"] = _tools(given["tools"])
    if chat and "tool_choice" in given:
        kw["tool_choice"] = _tool_choice(given["tool_choice"], kw.get("tools", []))
    if chat and "parallel_tool_calls" in given:
        kw["parallel_tool_calls"] = _boolean(given["parallel_tool_calls"], "parallel_tool_calls")
    if kw.get("tools") and kw.get("tool_choice", "auto") != "none" and kw.get("json_output"):
        raise bad_request("response_format and tools: give one (a tool call is JSON of its own format)",
                          "response_format")
    if "logit_bias" in given:
        kw["logit_bias"] = _logit_bias(given["logit_bias"])
    if "min_tokens" in given:
        kw["min_tokens"] = _integer(given["min_tokens"], "min_tokens")
    if "max_tokens" in given:
        kw["max_tokens"] = _integer(given["max_tokens"], "max_tokens")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
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


def _floor(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass
class Reply:
    """The response objects of one request: a whole body, or its stream's chunks. `token_text`
    writes a token as log probabilities name it; `prompts` and `prompt_texts`: each prompt's ids
    and text (a batch's; an echo's text); choice i answers prompt i // n."""

    ask: Ask
    model: str
    prompt_ids: list[int]
    id: str = ""
    created: int = 0
    token_text: Callable[[int], str] = field(default=lambda t: f"token_id:{t}", repr=False)
    prompts: list[list[int]] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)
    tool_format: str | None = None  # chat with tools: answers are read for tool calls (generation.tools)
    tool_forced: bool = False  # tool_choice required or named: every answer is a call
    _template: tuple[str, list[str]] | None = field(default=None, repr=False)
    _offsets: dict[int, int] = field(default_factory=dict, repr=False)  # choice -> text offset so far (streams)

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())
        self.prompts = self.prompts or [self.prompt_ids]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def _top(self, entry: Logprob, k: int) -> list[tuple[int, float]]:
        return list(entry[1][:k])

    def logprobs(self, token_ids: Sequence[int], entries: Sequence[Logprob | None], choice: int = 0
                 ) -> dict[str, Any] | None:
        """A choice's (or chunk's) `logprobs` object for `token_ids`, one entry each (None: the
        first prompt token of an echo), in OpenAI's shape for the endpoint: completions' parallel
        lists (the top log probabilities as a dict holding the chosen token too, as vLLM's), chat's
        `content` list. Log probabilities of -inf are written as LOGPROB_FLOOR (JSON has no inf)."""
        k = self.ask.logprobs
        if k is None:
            return None
        tt = self.token_text
        if self.ask.chat:
            content = []
            for t, e in zip(token_ids, entries):
                s = tt(t)
                top = [{"token": tt(i), "logprob": _floor(lp), "bytes": list(tt(i).encode("utf-8"))}
                       for i, lp in self._top(e, k)]
                content.append({"token": s, "logprob": _floor(e[0]), "bytes": list(s.encode("utf-8")),
                                "top_logprobs": top})
            return {"content": content}
        tokens, lps, tops, offsets = [], [], [], []
        at = self._offsets.get(choice, 0)
        for t, e in zip(token_ids, entries):
            s = tt(t)
            tokens.append(s)
            offsets.append(at)
            at += len(s)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_floor(e[0]))
            top = {tt(i): _floor(lp) for i, lp in self._top(e, k)}
            top.setdefault(s, _floor(e[0]))
            tops.append(top)
        self._offsets[choice] = at
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.ask.chat else "text_completion") + (".chunk" if chunk and self.ask.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def echoed(self, choice: int, prompt_logprobs: Sequence[Logprob | None] | None) -> tuple[str, list[int], list]:
        """What an echo puts before choice `choice`'s completion: its prompt's text, ids, and log
        probabilities (None each where none were asked for)."""
        p = choice // max(1, self.ask.n)
        ids = self.prompts[p]
        entries = list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(ids)
        return (self.prompt_texts[p] if p < len(self.prompt_texts) else ""), ids, entries

    def choice(self, text: str, token_ids: list[int], finish: str, *, index: int = 0,
               logprobs: Sequence[Logprob] | None = None,
               prompt_logprobs: Sequence[Logprob | None] | None = None) -> dict[str, Any]:
        """One choice of a non-streamed response (an echo puts its prompt first)."""
        ids, entries = list(token_ids), list(logprobs or ())
        if self.ask.echo and not self.ask.chat:
            head, pids, pentries = self.echoed(index, prompt_logprobs)
            text, ids, entries = head + text, pids + ids, pentries + entries
        lp = self.logprobs(ids, entries, index) if self.ask.logprobs is not None else None
        if self.ask.chat:
            message, finish = self.message(text, finish)
            choice = {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        if self.ask.return_token_ids:
            choice["prompt_token_ids"] = list(self.prompts[index // max(1, self.ask.n)])
            choice["token_ids"] = list(token_ids)
        return choice

    def message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """A chat answer's message and finish_reason: with tools, the calls its text holds
        (OpenAI's tool_calls, finish_reason "tool_calls"; the text before them the content)."""
        if self.tool_format is None:
            return {"role": "assistant", "content": text}, finish
        from tvmpipe.generation.tools import parse_tool_calls

        content, calls = parse_tool_calls(text, self.tool_format)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        if not self.ask.parallel_tool_calls:
            calls = calls[:1]
        return {"role": "assistant", "content": content, "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}, "tool_calls"

    def tool_stream(self) -> Any:
        """What a streamed chat with tools sends of each answer as it comes (generation.tools.ToolStream)."""
        from tvmpipe.generation.tools import ToolStream

        return ToolStream(self.tool_format, self.tool_forced)

    def tool_chunk(self, stream: Any, finish: str, index: int = 0) -> dict[str, Any]:
        """The last chunk of a streamed answer of a chat with tools (a call is known only at its
        end): the content not sent yet, the calls in one delta, and the finish_reason."""
        content, calls = stream.finish()
        if not self.ask.parallel_tool_calls:
            calls = calls[:1]
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": k, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}}
                                   for k, c in enumerate(calls)]
            finish = "tool_calls"
        out = {**self._head(True), "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                "finish_reason": finish}]}
        if self.ask.include_usage:
            out["usage"] = None
        return out

    def body(self, text: str, token_ids: list[int], finish: str, **choice: Any) -> dict[str, Any]:
        """The non-streaming response of one choice."""
        return self.bodies([self.choice(text, token_ids, finish, **choice)], len(token_ids))

    def bodies(self, choices: list[dict[str, Any]], completion_tokens: int) -> dict[str, Any]:
        """The non-streaming response of every choice."""
        return {**self._head(False), "choices": choices, "usage": usage(self.prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, token_ids: list[int] | None, finish: str | None, *, first: bool = False,
              index: int = 0, logprobs: Sequence[Logprob] | None = None,
              prompt_logprobs: Sequence[Logprob | None] | None = None) -> dict:
        """One streamed chunk of choice `index`: text (chat: the delta's content; None with `first`:
        the role alone), the tokens it covers (and their log probabilities where asked for), and
        the finish_reason on the last one. A completions echo puts the prompt in the first chunk."""
        lp = None
        if self.ask.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
                delta["content"] = text or ""
            elif text:
                delta["content"] = text
            if self.ask.logprobs is not None and token_ids:
                lp = self.logprobs(token_ids, logprobs or (), index)
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            ids, entries = list(token_ids or ()), list(logprobs or ())
            if first and self.ask.echo:
                head, pids, pentries = self.echoed(index, prompt_logprobs)
                text, ids, entries = head + (text or ""), pids + ids, pentries + entries
            if self.ask.logprobs is not None:
                lp = self.logprobs(ids, entries, index)
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        if self.ask.return_token_ids and token_ids is not None:
            if first:
                choice["prompt_token_ids"] = list(self.prompts[index // max(1, self.ask.n)])
            choice["token_ids"] = list(token_ids)
        out = {**self._head(True), "choices": [choice]}
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
        ids = f"[{','.join(map(str, token_ids))}]" if len(tail) == 2 else ""  # json.dumps' bytes, without an encoder a call
        return f"{head}{_json_str(text)}{ids.join(tail)}\n\n".encode()

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(self.prompt_tokens, completion_tokens)}


_TEXT_PROBE = "\u0000text\u0000"  # placeholders of Reply.token_event's template
_IDS_PROBE = -987654321
_json_str = json.encoder.encode_basestring  # json.dumps(s, ensure_ascii=False) of a str, C, no encoder made


def sse(obj: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: {json}` and a blank line (or `data: [DONE]`)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")
