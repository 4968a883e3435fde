"""The served model: an Engine over the pipeline, the tokenizer, and how an `Ask` becomes a
generation request. The HTTP routes (serve.app) call this and nothing below it.

Keys and seeds: a served request uses key 0, as prompt 0 of `tvmpipe generate` does, so its seeded
draws equal a one-prompt `tvmpipe generate --seed S` (executor.sampler keys each draw by seed, key
and token index). Choice j of a request with `n` (or `best_of`) choices is keyed j: the n choices
draw differently, choice 0 is the request with n = 1, and a seeded request with n reproduces. Each
prompt of a batch is keyed the same way (its choices 0..n-1), as if sent alone. A sampling request
without a seed gets a fresh random one, as OpenAI's does.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.executor.sampler import Sampling
from tvmpipe.generation.requests import Request
from tvmpipe.generation.text import TextError
from tvmpipe.serve.protocol import DEFAULT_COMPLETION_TOKENS, ApiError, Ask, bad_request, from_generation_error, resolve_max_tokens

if TYPE_CHECKING:
    from tvmpipe.generation.engine import EngineThread
    from tvmpipe.generation.engine_process import EngineProcess
    from tvmpipe.generation.text import TextCodec
    from tvmpipe.serve.metrics import StageInfo

SEED_RANGE = 2 ** 63  # the sampler's seeds: 0 .. 2^63 - 1


@lru_cache(maxsize=256)
def _json_grammar(schema: str | None) -> str:
    """A schema's grammar, compiled once (clients send the same schema request after request)."""
    from tvmpipe.executor.grammar import json_grammar

    return json_grammar(json.loads(schema) if schema is not None else None)


@dataclass(frozen=True)
class Prepared:
    """A request ready to submit: each prompt's ids, and the checked generation requests (with
    their stop strings, which the engine's output processor watches for): `runs` per prompt
    (best_of, else n), prompt after prompt; `n` of each prompt's are returned (with best_of: the
    n whose tokens are the most likely)."""

    prompts: list[list[int]]
    requests: list[Request]
    n: int = 1
    runs: int = 1
    tool_format: str | None = None  # chat with tools: the format its answers' tool calls are read in
    tool_forced: bool = False  # tool_choice required or named: every answer is a call

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0]

    @property
    def request(self) -> Request:
        return self.requests[0]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


class Service:
    """What the routes serve: `model` (its name in /v1/models and in requests) on `engine`, with
    `codec` (None: no tokenizer; prompts are token ids and responses carry token ids, no text)."""

    def __init__(self, engine: "EngineProcess | EngineThread", codec: "TextCodec | None", model: str):
        self.engine = engine
        self.codec = codec
        self.model = model
        self.layout = engine.layout
        self.created = int(time.time())

    @property
    def max_context(self) -> int:
        return self.layout.max_context

    def stage_info(self) -> list["StageInfo"]:
        """Each stage's process now (a blocking call to every worker: run it off the event loop)."""
        from tvmpipe.serve.metrics import StageInfo

        return [StageInfo(i, pid, host) for i, pid, host in self.engine.stage_info()]

    def check_model(self, ask: Ask) -> None:
        if ask.model != self.model:
            raise ApiError(404, f"the model {ask.model!r} does not exist: this server serves {self.model!r}",
                           param="model", code="model_not_found")

    def token_text(self, token: int) -> str:
        """One token as text, for log probabilities (as vLLM writes them: the token decoded alone;
        without a tokenizer `token_id:N`)."""
        return self._token_text(token)

    @lru_cache(maxsize=65536)
    def _token_text(self, token: int) -> str:
        if self.codec is None:
            return f"token_id:{token}"
        try:
            return self.codec.decode([token])
        except Exception:  # noqa: BLE001 - a token with no text of its own: its id
            return f"token_id:{token}"

    def grammar(self, ask: Ask) -> str:
        """The grammar of an Ask's response_format (llguidance's, executor.grammar); a 400 naming
        response_format for a schema it cannot compile, without a tokenizer, or when the model's
        vocabulary has no token an answer can begin with."""
        if self.codec is None:
            raise bad_request("response_format needs a tokenizer: this server has none", "response_format")
        try:
            grammar = _json_grammar(json.dumps(ask.json_schema, sort_keys=True) if ask.json_schema is not None else None)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"response_format: the schema cannot be compiled: {str(exc)[:300]}",
                              "response_format") from None
        self.check_startable(grammar, "response_format", "JSON answer")
        return grammar

    def check_startable(self, grammar: str, param: str, what: str) -> None:
        """A 400 naming `param` when no token of the vocabulary can begin output that `grammar`
        allows (a tokenizer that cannot write '{'), or when llguidance cannot read the tokenizer:
        found here, before the request runs, rather than as the sequence's failure at its first
        draw on the sampling stage."""
        tokenizer, error = self._grammar_tokenizer()
        if tokenizer is None:
            raise bad_request(f"{param}: the tokenizer of {self.model!r} cannot drive structured output ({error})", param)
        if not self._can_begin(grammar):
            raise bad_request(f"{param}: no token of {self.model!r}'s vocabulary can begin a {what} "
                              "(its tokenizer cannot write the first character)", param)

    @lru_cache(maxsize=256)
    def _can_begin(self, grammar: str) -> bool:
        """executor.grammar.can_begin for the codec's tokenizer, once a grammar (clients send the
        same schema request after request, as _json_grammar caches)."""
        from tvmpipe.executor.grammar import can_begin

        return can_begin(self._grammar_tokenizer()[0], grammar, self.layout.vocab_size)

    @lru_cache(maxsize=1)
    def _grammar_tokenizer(self) -> tuple[Any, str | None]:
        """llguidance's tokenizer of the codec, as the sampling stage builds its own (the vocab of
        the model's logits, the codec's stop tokens as eos); (None, why) for a tokenizer llguidance
        cannot read (a Metaspace decoder)."""
        from tvmpipe.executor.grammar import make_tokenizer

        try:
            return make_tokenizer(self.codec.tokenizer.to_str(), self.layout.vocab_size,
                                  tuple(self.codec.stop_token_ids)), None
        except ValueError as exc:
            return None, str(exc)[:200]

    def tool_grammar(self, ask: Ask) -> tuple[str, str | None]:
        """The tool call format of the chat template (generation.tools), and the grammar that forces
        a call for tool_choice required or a named function (None for auto); a 400 naming tools
        when the template writes no tool calls."""
        from tvmpipe.generation.tools import ToolError, call_grammar, tool_format

        if self.codec is None or not self.codec.has_chat_template:
            raise bad_request("tools need a chat template: this server has none", "tools")
        try:
            fmt = tool_format(self.codec.chat_template().source)
        except TextError as exc:
            raise bad_request(str(exc), "tools") from None
        if fmt is None:
            raise bad_request(f"the chat template of {self.model!r} writes no tool calls that tvmpipe serve reads "
                              "(Qwen2/Hermes <tool_call> or Llama 3.x JSON): tools cannot be served", "tools")
        if ask.tool_choice == "auto":
            return fmt, None
        functions = [t["function"] for t in ask.tools]
        if isinstance(ask.tool_choice, dict):
            functions = [f for f in functions if f["name"] == ask.tool_choice["name"]]
        try:
            grammar = call_grammar(fmt, functions)
        except ToolError as exc:
            raise bad_request(str(exc), "tools") from None
        self.check_startable(grammar, "tools", "tool call")
        return fmt, grammar

    def prompt_text(self, ask: Ask, prompt: str | list[int], ids: list[int]) -> str:
        """The prompt as text, for echo: as given, or its ids decoded."""
        if isinstance(prompt, str) or ask.chat:
            return prompt if isinstance(prompt, str) else ""
        return "".join(self.token_text(t) for t in ids) if self.codec is None else self.codec.decode(ids)

    def prompt_ids(self, ask: Ask, prompt: str | list[int] | None = None) -> list[int]:
        """The prompt's token ids: given as ids, encoded, or the chat rendered by the template."""
        prompt = ask.prompt if prompt is None else prompt
        if not ask.chat and isinstance(prompt, list):
            return list(prompt)
        codec = self.codec
        if codec is None:
            what = "chat" if ask.chat else "a text prompt"
            raise bad_request(f"this server has no tokenizer, so {what} cannot be served: send the prompt as token ids "
                              "to /v1/completions, or start the server with --tokenizer DIR", ask.prompt_param,
                              "no_tokenizer")
        try:
            if not ask.chat:
                return codec.encode(prompt)
            if not codec.has_chat_template:
                raise bad_request(f"the model {self.model!r} has no chat template (its tokenizer directory {codec.directory} "
                                  "has no chat_template.jinja nor chat_template in tokenizer_config.json): use "
                                  "/v1/completions with a plain prompt", "messages", "no_chat_template")
            return codec.apply_chat_template(ask.messages, add_generation_prompt=ask.add_generation_prompt,
                                             variables=ask.chat_template_kwargs, tools=ask.tools or None)
        except TextError as exc:
            raise bad_request(str(exc), ask.prompt_param) from None

    def prepare(self, ask: Ask) -> Prepared:
        """The generation request of an Ask, every value checked (ApiError 400 naming the
        parameter), before anything runs."""
        self.check_model(ask)
        if ask.stop and self.codec is None:
            raise bad_request("stop strings need a tokenizer: this server has none (stop_token_ids work without)", "stop")
        seed = ask.seed if ask.seed is not None else secrets.randbelow(SEED_RANGE)
        stops = list(ask.stop_token_ids)
        if self.codec is not None and not ask.ignore_eos:
            stops += [t for t in self.codec.stop_token_ids if t not in stops]
        grammar = self.grammar(ask) if ask.json_output else None
        fmt, forced = None, None
        if ask.tools and ask.tool_choice != "none":
            fmt, forced = self.tool_grammar(ask)
            grammar = forced or grammar
        runs = ask.best_of or ask.n
        sampling = Sampling(ask.temperature, ask.top_k, seed, ask.top_p, ask.min_p, ask.presence_penalty,
                            ask.frequency_penalty, ask.repetition_penalty)
        # best_of ranks choices by their tokens' log probabilities; echo scores the prompt (max_tokens 0: only that)
        logprobs = 0 if ask.logprobs is None and runs > ask.n else ask.logprobs
        prompt_logprobs = (ask.logprobs if ask.logprobs is not None else 0 if ask.max_tokens == 0 else None
                           ) if ask.echo else None
        prompts, requests = [], []
        for i, prompt in enumerate(ask.prompts or (ask.prompt,) if not ask.chat else (None,)):
            what = ask.prompt_param if len(ask.prompts) < 2 else f"prompt[{i}]"
            ids = self.prompt_ids(ask, prompt)
            if not ids:
                raise bad_request(f"the {what} is empty (no tokens)", ask.prompt_param)
            default = None if ask.chat else DEFAULT_COMPLETION_TOKENS
            n = resolve_max_tokens(ask.max_tokens, default, len(ids), self.max_context, prompt_param=what,
                                   tokens_param=ask.tokens_param)
            try:
                requests += [Request.checked(ids, n, self.layout, what=what, stop_tokens=stops, key=j,
                                             sampling=sampling, stop=ask.stop, logprobs=logprobs,
                                             prompt_logprobs=prompt_logprobs, logit_bias=ask.logit_bias,
                                             min_tokens=ask.min_tokens, grammar=grammar) for j in range(runs)]
            except TvmpipeError as exc:
                raise from_generation_error(exc, ask.prompt_param, ask.tokens_param) from None
            prompts.append(ids)
        return Prepared(prompts, requests, ask.n, runs, fmt, forced is not None)
