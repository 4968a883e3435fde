"""What goes into the generation layer and what comes out: requests, checked once where they enter,
and the events and results of each sequence.

A `Request` is built only by `make_requests` (or `Request.checked`), which checks its prompt, limits,
stop tokens and sampling against the decode step's layout; the scheduler below takes requests as
they are. The application layer makes them from command-line options or a prompts file, the server
from an HTTP body, a library user from plain lists through `Generator.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import enum

import numpy as np

from tvmpipe.bundle.decode_layout import MAX_LOGPROBS, DecodeLayout, decode_layout
from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.executor.sampler import Sampling


class FinishReason(str, enum.Enum):
    """Why a sequence ended: the one set of reasons, from the scheduler to every front end.

    LENGTH: max new tokens; STOP: a stop token (kept as its last token) or a stop string (cut
    before it); CONTEXT: the cache is full; CANCELLED: its caller gave it up (a client gone, a
    drain); ERROR: this sequence failed alone (its logits were not finite, its step raised twice,
    its text could not be decoded): `SequenceResult.error` says why, and the others run on."""

    LENGTH = "length"
    STOP = "stop"
    CONTEXT = "context"
    CANCELLED = "cancelled"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


# A token's log probability and the most likely tokens' (id, log probability), from the model's raw
# log-softmax at that position (executor.sampler.score_into)
Logprob = tuple[float, tuple[tuple[int, float], ...]]


class GenerationError(TvmpipeError):
    """A generation run ended early; `finished` holds the sequences that completed (by index)."""

    def __init__(self, message: str, finished: dict[int, "SequenceResult"] | None = None):
        self.finished = dict(finished or {})
        super().__init__(message)


def layout_of(bundle: Any) -> DecodeLayout:
    """The bundle's decode-step layout; a one-line error unless it is a decode-step bundle."""
    layout = decode_layout(bundle)
    if layout is None:
        raise TvmpipeError(f"{bundle.path} is not a decode-step bundle: bundle.json declares no `generation` "
                           "section and state pairs (compile a decoder with `tvmpipe compile NAME --decode`; "
                           "see docs/generation.md)")
    return layout


@dataclass(frozen=True)
class Request:
    """One sequence to generate: its prompt ids, how many tokens at most, how to draw them, which
    tokens end it (kept as its last token), and `key`, which with the seed and the token index keys
    its draws (executor.sampler): `tvmpipe generate` keys prompt i with i, a served request with 0
    (choice i of a served request with n choices: i), so that a request's tokens equal a
    one-prompt `tvmpipe generate` with the same seed.

    `logprobs` k (None: none): each generated token's log probability and the k most likely;
    `prompt_logprobs` k: the same for each prompt token after the first (an echo), and then
    `max_new_tokens` may be 0 (the prompt scored, nothing generated). `logit_bias`: (token id, value
    added to its logit) pairs; `min_tokens`: the stop tokens are ruled out until that many were
    generated; `grammar`: llguidance's grammar the output follows (a response_format; all three
    installed on the sampling stage: executor.sampler.SequenceExtras)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_tokens: frozenset[int] = frozenset()
    key: int = 0
    stop: tuple[str, ...] = ()  # stop strings: the output processor ends the sequence where one appears
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    grammar: str | None = None  # llguidance's grammar its output follows (executor.grammar.json_grammar)

    @classmethod
    def checked(cls, prompt: Sequence[int], max_new_tokens: int, layout: DecodeLayout, *,
                sampling: Sampling = Sampling(), stop_tokens: Iterable[int] = (), key: int = 0,
                what: str = "prompt", stop: Sequence[str] = (), logprobs: int | None = None,
                prompt_logprobs: int | None = None, logit_bias: Mapping[int, float] | None = None,
                min_tokens: int = 0, grammar: str | None = None) -> "Request":
        """A request whose every field fits `layout` (FieldErrors naming the field; prompt errors
        name `what`)."""
        n = check_max_new_tokens(max_new_tokens, 0 if prompt_logprobs is not None else 1)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, (int, np.integer)) or not 0 <= min_tokens <= n:
            raise FieldError("min_tokens", f"must be an integer from 0 to max_new_tokens ({n}), got {min_tokens!r}")
        return cls(check_prompt(prompt, layout, what), n,
                   sampling.check(layout.vocab_size), check_stop_tokens(stop_tokens, layout.vocab_size), key,
                   check_stop_strings(stop), check_logprobs(logprobs, "logprobs"),
                   check_logprobs(prompt_logprobs, "prompt_logprobs"), check_logit_bias(logit_bias or {}, layout.vocab_size),
                   int(min_tokens), grammar)


MAX_BIAS = 100.0  # OpenAI's bound on a logit bias


def check_logit_bias(bias: Mapping[int, float], vocab: int) -> tuple[tuple[int, float], ...]:
    """Token ids inside the vocabulary, each with a finite value in [-100, 100] (OpenAI's range)."""
    out = []
    for t, v in bias.items():
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            raise FieldError("logit_bias", f"names token id {t!r}, outside the vocabulary 0..{vocab - 1}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or not -MAX_BIAS <= v <= MAX_BIAS:
            raise FieldError("logit_bias", f"of token {t} must be a number in [-100, 100], got {v!r}")
        out.append((int(t), float(v)))
    return tuple(sorted(out))


def check_logprobs(k: Any, field: str) -> int | None:
    """None, or how many most likely tokens to return beside each token's log probability."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= MAX_LOGPROBS:
        raise FieldError(field, f"must be an integer from 0 to {MAX_LOGPROBS}, got {k!r}")
    return int(k)


def check_prompt(prompt: Sequence[int], layout: DecodeLayout, what: str = "prompt") -> tuple[int, ...]:
    """A non-empty list of token ids inside the vocabulary, no longer than the context (errors name
    `what`: "prompt", "prompt 3", "in.jsonl line 7")."""
    p = list(prompt)
    if not p:
        raise TvmpipeError(f"{what} is empty")
    vocab = layout.vocab_size
    bad = [t for t in p if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise TvmpipeError(f"{what}: token id {bad[0]!r} is outside the vocabulary 0..{vocab - 1}")
    if len(p) > layout.max_context:
        raise TvmpipeError(f"{what} has {len(p)} tokens, more than the bundle's max_context {layout.max_context}")
    return tuple(int(t) for t in p)


def check_max_new_tokens(n: Any, least: int = 1) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < least:
        raise FieldError("max_new_tokens", f"must be an integer >= {least}, got {n!r}")
    return int(n)


def check_stop_tokens(tokens: Iterable[int], vocab: int) -> frozenset[int]:
    """Stop token ids, each inside the vocabulary."""
    stops = set()
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            raise FieldError("stop_tokens", f"{t!r} is outside the vocabulary 0..{vocab - 1}")
        stops.add(int(t))
    return frozenset(stops)


def check_stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    """Stop strings: non-empty strings, each once, in order."""
    if isinstance(stop, str):
        stop = (stop,)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise FieldError("stop", f"must be non-empty strings, got {s!r}")
    return tuple(dict.fromkeys(stop))


def make_requests(prompts: Sequence[Sequence[int]], max_new_tokens: int, layout: DecodeLayout, *,
                  sampling: Sampling = Sampling(), stop_tokens: Iterable[int] = (),
                  stop: Sequence[str] = ()) -> list[Request]:
    """The requests of a prompt set: prompt i keyed i, every other field shared (checked once)."""
    if not prompts:
        raise TvmpipeError("no prompts: give at least one (--prompt-ids 5,17,3)")
    checked = [check_prompt(p, layout, f"prompt {i}") for i, p in enumerate(prompts)]
    n = check_max_new_tokens(max_new_tokens)
    stops = check_stop_tokens(stop_tokens, layout.vocab_size)
    strings = check_stop_strings(stop)
    sampling.check(layout.vocab_size)
    return [Request(p, n, sampling, stops, i, strings) for i, p in enumerate(checked)]


@dataclass
class SequenceResult:
    """One sequence: its prompt, the tokens generated, why it stopped (FinishReason), its text
    when the engine has a tokenizer (cut before a stop string), and the error of one that failed."""

    index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    first_token_s: float | None = None  # seconds from admission to the first generated token
    token_times: list[float] = field(default_factory=list)  # wall clock of each generated token
    replays: int = 0  # times its caches were rebuilt after a stage restart
    text: str | None = None  # the output processor's (generation.output), with a tokenizer
    error: str | None = None  # why it failed (finish ERROR)
    prompt_logprobs: list[Logprob | None] | None = None  # Request.prompt_logprobs: by position (0: None)
    cumulative_logprob: float = 0.0  # the generated tokens' log probabilities summed (Request.logprobs)

    def to_json(self) -> dict:
        out = {"prompt": list(self.prompt), "tokens": list(self.tokens),
               "finish": None if self.finish is None else self.finish.value}
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True)
class TokenEvent:
    """Sequence `seq` generated `token`, its `index`-th; `finish` says why it was the last (None:
    more follow), and `done` is whether it was. A sequence that ends without a token (cancelled,
    or failed: FinishReason.ERROR) has no last event: its SequenceResult says so (and holds the prompt's
    log probabilities of one that generated nothing)."""

    seq: int
    token: int
    index: int
    finish: FinishReason | None = None
    logprob: Logprob | None = None  # Request.logprobs
    prompt_logprobs: tuple[Logprob | None, ...] | None = None  # Request.prompt_logprobs, with the first token

    @property
    def done(self) -> bool:
        return self.finish is not None
