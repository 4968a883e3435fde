"""One request's sequence, read from the server's event loop.

The engine (generation.engine) draws tokens on its own thread and calls the stream's callback
there; `ServedSequence` hands each event to the event loop through the loop's `Bridge` (into the
sequence's asyncio.Queue) and turns tokens into text pieces with the tokenizer's TextStream: incremental
detokenization, stop strings held back and never sent. A stop string ends the sequence at once
(Engine.cancel with "stop": its row frees at the next step, and tokens already drawn after it are
dropped). A reader that goes away (a client that disconnected) closes the sequence, which cancels
it the same way.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from tvmpipe.generation.requests import Request, TokenEvent

if TYPE_CHECKING:
    from tvmpipe.generation.engine import Engine, Stream
    from tvmpipe.generation.text import TextCodec


class Bridge:
    """Events from the engine thread into one event loop's queues, with one wake-up of the loop for
    all the events that arrive before it runs (a step's tokens for every sequence in it), not one
    each: waking a loop writes to its self-pipe, a system call on the engine thread, between the
    steps it submits."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: deque[tuple[asyncio.Queue, TokenEvent | None]] = deque()
        self._woken = False

    def put(self, queue: asyncio.Queue, event: TokenEvent | None) -> None:  # any thread
        with self._lock:
            self._pending.append((queue, event))
            if self._woken:
                return
            self._woken = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:  # the event loop
        with self._lock:
            pending, self._pending = self._pending, deque()
            self._woken = False
        for queue, event in pending:
            queue.put_nowait(event)


class SequenceFailed(Exception):
    """The sequence ended without finishing: the pipeline failed, or the server shut down
    (`shutdown`) before it was done."""

    def __init__(self, message: str, shutdown: bool = False):
        super().__init__(message)
        self.shutdown = shutdown


@dataclass(frozen=True)
class Piece:
    """What one token adds to the response: its text (may be empty while characters or a possible
    stop string are held), the token, and on the last piece why the sequence ended ("stop" or
    "length", as OpenAI's finish_reason)."""

    text: str
    token_ids: tuple[int, ...]
    finish: str | None = None


class ServedSequence:
    """Submit `request` to `engine` and read its pieces, its events coming through `bridge` (`async for piece in seq.pieces()`).
    QueueFull / EngineClosed from the engine propagate from the constructor."""

    def __init__(self, engine: "Engine", bridge: Bridge, request: Request, codec: "TextCodec | None",
                 stop: Sequence[str] = ()):
        self.engine = engine
        self.bridge = bridge
        self.queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self.text = codec.text_stream(stop, stop_token_ids=request.stop_tokens) if codec is not None else None
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.stream: "Stream" = engine.submit(request, on_event=self._on_event)

    @property
    def index(self) -> int:
        return self.stream.index

    def _on_event(self, event: TokenEvent | None) -> None:  # the engine thread
        self.bridge.put(self.queue, event)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Each token's piece as it is drawn, the last one with its finish reason. Leaving the loop
        early (a client gone) cancels the sequence; SequenceFailed if it ends unfinished."""
        try:
            while self.finish is None:
                event = await self.queue.get()
                if event is None:
                    raise self._failure()
                yield self._piece(event)
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the sequence unless it has ended (its row frees at the engine's next step)."""
        if self.finish is None:
            self.finish = "cancelled"
            self.engine.cancel(self.index)

    def _piece(self, event: TokenEvent) -> Piece:
        self.tokens.append(event.token)
        if self.text is None:
            text, stopped = "", False
        else:
            step = self.text.push(event.token)
            text, stopped = step.text, step.reason == "stop_string"
            if event.finish and not step.finished:
                text += self.text.finish()  # a length limit: what the detokenizer still held
                stopped = stopped or self.text.reason == "stop_string"
        if stopped:  # a stop string: the sequence ends here, whatever the engine draws after it
            self.finish = "stop"
            self.engine.cancel(self.index, "stop")
        elif event.finish:
            self.finish = "stop" if event.finish == "stop" else "length"
        return Piece(text, (event.token,), self.finish)

    def _failure(self) -> SequenceFailed:
        self.finish = "failed"
        stream = self.stream
        if stream.result is not None and stream.result.finish == "cancelled":  # the server's drain gave it up
            return SequenceFailed("the server shut down before this request finished", shutdown=True)
        return SequenceFailed(f"generation failed: {stream.error or 'the sequence ended early'}")
