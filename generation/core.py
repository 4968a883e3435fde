"""EngineCore: the scheduler and the pipeline's I/O, one step at a time.

The scheduler decides (generation.scheduler: `schedule()` returns the steps to submit, `update()`
takes a step's result back); the core submits the planned steps to the pipeline and receives the
oldest one. It runs on one thread: the caller's (`Engine.step`, `tvmpipe generate`) or the
serving loop's (generation.engine.EngineThread).

What one request causes ends that request alone (the scheduler ends a sequence whose logits were
not finite, or whose step failed twice); only the pipeline failing for good (a stage past its
restarts: PipelineError) raises from `step`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.generation.requests import FinishReason, Request, SequenceResult, TokenEvent
from tvmpipe.generation.scheduler import Scheduler

if TYPE_CHECKING:
    from tvmpipe.cluster.driver import Pipeline

STALLED = "internal error: the scheduler had sequences but no step to submit (a tvmpipe bug; please report it)"


class EngineCore:
    """Continuous batching on `pipe` (a Pipeline of a decode-step bundle); keywords as Scheduler's."""

    def __init__(self, pipe: "Pipeline", **scheduler_kw):
        self.pipe = pipe
        while pipe.in_flight:  # steps of an earlier engine abandoned mid-way: drop them
            pipe.receive()
        self.scheduler = Scheduler(pipe, **scheduler_kw)
        self.layout = self.scheduler.layout
        self.stalls = 0  # times the scheduler had nothing to submit while busy (a bug, survived)
        # -> (tokenizer.json's text, eos ids): what the sampling stage builds a grammar's tokenizer from,
        # made when a grammar first needs it (generation.engine.Engine sets it from its codec)
        self.grammar_tokenizer: Callable[[], tuple[str, tuple[int, ...]]] | None = None

    @property
    def busy(self) -> bool:
        """Sequences queued or running."""
        return self.scheduler.busy

    @property
    def has_work(self) -> bool:
        """Sequences to run, or steps in flight to collect (a sequence that stopped may leave steps
        submitted ahead for it: left unread they would look like a stalled pipeline to the driver)."""
        return self.scheduler.busy or bool(self.scheduler.steps)

    def add(self, request: Request, index: int | None = None) -> int:
        return self.scheduler.add(request, index)

    def cancel(self, index: int, why: FinishReason = FinishReason.CANCELLED,
               error: str | None = None) -> SequenceResult | None:
        return self.scheduler.cancel(index, why, error)

    def take_finished(self) -> list[SequenceResult]:
        """The sequences that ended since the last call."""
        s = self.scheduler
        out = list(s.finished)
        s.finished.clear()
        return out

    def step(self) -> list[TokenEvent]:
        """Submit what the scheduler plans while the window has room, then wait for the oldest step
        in flight and return the tokens it drew ([] when nothing is in flight)."""
        s, pipe = self.scheduler, self.pipe
        while s.installs:  # what sequences' draws need beyond their tags, before their steps go in
            index, extras = s.installs.popleft()
            try:
                if not pipe.install_sampling(index, extras):  # a grammar: the stage needs the tokenizer first
                    if self.grammar_tokenizer is None:
                        s.cancel(index, FinishReason.ERROR, "a grammar needs a tokenizer: this engine has none")
                        continue
                    pipe.install_sampling(index, extras, self.grammar_tokenizer())
            except TvmpipeError as exc:  # the stage is restarting: its rows draw STATE_LOST, installed again then
                print(f"tvmpipe engine: sequence {index}: sampling extras not installed ({exc}); "
                      "installed again when its step asks", file=sys.stderr)
        for planned in s.schedule(pipe.submitted, pipe.window - pipe.in_flight):
            seq = pipe.submit(planned.inputs)
            if seq != planned.seq:
                raise TvmpipeError(f"the pipeline numbered a step {seq}, the scheduler planned {planned.seq}")
        if not s.steps:
            if s.busy:  # cannot happen; if it does, the requests end with an error and the engine goes on
                self.stalls += 1
                print(f"tvmpipe engine: {STALLED}", file=sys.stderr)
                s.cancel_all(FinishReason.ERROR, STALLED)
            return []
        return s.update(pipe.receive())
