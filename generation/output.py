"""The output processor: what each request's tokens become, inside the engine.

One owner of a sequence's visible output, for every front end (`tvmpipe generate`, `tvmpipe serve`,
a library user of `Engine`): it runs each request's tokens through its TextStream (incremental
detokenization, stop strings held back and never shown), decides the final FinishReason, and ends
a sequence at once when a stop string appears: it calls the engine core's cancel with STOP on the
same thread, before the next step is planned, so no step is submitted for a sequence that has
stopped and no token after the stop string ever leaves the engine. A detokenizer that fails ends
that one sequence with ERROR.

Every request gets RequestOutputs: one per token it draws (its new text, possibly empty while
characters or a possible stop string are held), and a last one with `finish` set and the whole
`result` (its SequenceResult, whose `text` is the whole visible text).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Sequence

from tvmpipe.generation.requests import FinishReason, Logprob, Request, SequenceResult, TokenEvent

if TYPE_CHECKING:
    from tvmpipe.generation.text import TextCodec, TextStream

Abort = Callable[[int, FinishReason, "str | None"], "SequenceResult | None"]


@dataclass(frozen=True)
class RequestOutput:
    """What one step added to request `index`: `text` (new visible text; "" without a tokenizer),
    `token_ids` (the tokens drawn), and on its last output `finish`, `error` (FinishReason.ERROR)
    and `result`. `logprobs`: one per token id where the request asked for them; `prompt_logprobs`:
    on the request's first output, where it asked for the prompt's (an echo)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish: FinishReason | None = None
    error: str | None = None
    result: SequenceResult | None = None
    logprobs: tuple[Logprob, ...] | None = None
    prompt_logprobs: tuple[Logprob | None, ...] | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    def merged(self, later: "RequestOutput") -> "RequestOutput":
        """This output and the `later` one of the same request as one: what a reader that fell
        behind takes in one piece (a server writes one event for both, as vLLM's output collector
        merges the deltas its client has not yet taken), so a slow reader costs fewer writes, not
        more. The finish, error and result are the later one's; every other field holds what the
        output's tokens added (a str, tuple or list, or None where none), so the two are joined:
        a field added here later is merged without changing this method."""
        joined = {f.name: _join(getattr(self, f.name), getattr(later, f.name)) for f in fields(self)
                  if f.name not in _ENDING}
        return RequestOutput(**{**joined, "index": self.index, "finish": later.finish, "error": later.error,
                                "result": later.result})


_ENDING = ("index", "finish", "error", "result")  # RequestOutput fields that are not a token's additions


def _join(a, b):
    return b if a is None else a if b is None else a + b


class _State:
    __slots__ = ("stream", "finish")

    def __init__(self, stream: "TextStream | None"):
        self.stream = stream
        self.finish: FinishReason | None = None


class OutputProcessor:
    """Per-request text and finish reasons. `abort(index, why, error)` ends a sequence in the core
    (EngineCore.cancel) and returns its SequenceResult."""

    def __init__(self, codec: "TextCodec | None", abort: Abort):
        self.codec = codec
        self.abort = abort
        self._states: dict[int, _State] = {}

    def add(self, index: int, request: Request) -> None:
        stream = None
        if self.codec is not None:
            stream = self.codec.text_stream(request.stop, stop_token_ids=request.stop_tokens)
        self._states[index] = _State(stream)

    def __len__(self) -> int:
        return len(self._states)

    def process(self, events: Sequence[TokenEvent], ended: Sequence[SequenceResult]) -> list[RequestOutput]:
        """The outputs of one step: `events` (its tokens) and `ended` (the sequences the core ended
        in it, with or without a token of their own)."""
        results = {r.index: r for r in ended}
        out: list[RequestOutput] = []
        for ev in events:
            st = self._states.get(ev.seq)
            if st is None:
                continue  # ended already (a stop string): the core drew past it
            text, finish, error = self._text(ev, st)
            lps = None if ev.logprob is None else (ev.logprob,)
            if finish is None and ev.finish is None:
                out.append(RequestOutput(ev.seq, text, (ev.token,), logprobs=lps, prompt_logprobs=ev.prompt_logprobs))
                continue
            if finish is not None and ev.finish is None:  # ended here by its text: stop the core now
                result = self.abort(ev.seq, finish, error)
            else:
                result = results.pop(ev.seq, None)
                finish = finish or ev.finish
            out.append(self._last(ev.seq, st, text, (ev.token,), finish, error, result, lps, ev.prompt_logprobs))
        for index, result in results.items():  # ended without a token: cancelled, failed, or an echo alone
            st = self._states.get(index)
            if st is not None:
                prompt = None if result.prompt_logprobs is None or result.tokens else tuple(result.prompt_logprobs)
                out.append(self._last(index, st, "", (), result.finish or FinishReason.CANCELLED, result.error, result,
                                      None, prompt))
        return out

    def _text(self, ev: TokenEvent, st: _State) -> tuple[str, FinishReason | None, str | None]:
        """The token's new text; a finish reason where the text ends the sequence (a stop string;
        a detokenizer error); flushed text when the core ended it (length, stop token)."""
        if st.stream is None:
            return "", None, None
        try:
            step = st.stream.push(ev.token)
            text = step.text
            if step.reason == "stop_string":
                return text, FinishReason.STOP, None
            if ev.finish is not None and not step.finished:
                text += st.stream.finish()  # what the detokenizer still held
                if st.stream.reason == "stop_string":  # the last characters completed a stop string
                    return text, FinishReason.STOP, None
            return text, None, None
        except Exception as exc:  # noqa: BLE001 - a decoding failure is this sequence's alone
            why = f"its text could not be decoded at token {ev.index} (id {ev.token}): {type(exc).__name__}: {exc}"
            print(f"tvmpipe engine: sequence {ev.seq}: {why}", file=sys.stderr)
            return "", FinishReason.ERROR, why

    def _last(self, index: int, st: _State, text: str, ids: tuple[int, ...], finish: FinishReason,
              error: str | None, result: SequenceResult | None, logprobs: tuple[Logprob, ...] | None = None,
              prompt_logprobs: tuple[Logprob | None, ...] | None = None) -> RequestOutput:
        del self._states[index]
        if result is not None:
            if finish == FinishReason.STOP or result.finish is None:
                result.finish = finish
            if error is not None:
                result.finish, result.error = FinishReason.ERROR, error
            if st.stream is not None:
                result.text = st.stream.text
            finish, error = result.finish, result.error
        return RequestOutput(index, text, ids, finish, error, result, logprobs, prompt_logprobs)
