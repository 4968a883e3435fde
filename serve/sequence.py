"""One request's outputs, read from the server's event loop.

The engine (`tvmpipe serve`: generation.engine_process.EngineProcess, an Engine in its own
process whose pipe the event loop reads; a library or test: EngineThread) runs the
request, its output processor turning tokens into text (stop strings held back and never sent, a
stop string ending the sequence at once), and calls the stream's callback with each RequestOutput
on that thread (the loop's, or the engine thread). `ServedSequence` hands
them to the event loop through the loop's `Bridge` (into the sequence's asyncio.Queue). A reader
that goes away (a client that disconnected) closes the sequence, which cancels it in the engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import TYPE_CHECKING, AsyncIterator

from tvmpipe.generation.output import RequestOutput
from tvmpipe.generation.requests import FinishReason, Request

if TYPE_CHECKING:
    from tvmpipe.generation.engine import EngineThread, Stream
    from tvmpipe.generation.engine_process import EngineProcess


class Bridge:
    """Outputs into one event loop's queues. From the loop's own thread (an EngineProcess the loop
    reads: attach) straight in; from another (an EngineThread's) with one
    wake-up of the loop for all the outputs that arrive before it runs (a step's tokens for every
    sequence in it), not one each: waking a loop writes to its self-pipe, a system call on that
    thread, between the steps it submits. Made on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._pending: deque[tuple[asyncio.Queue, RequestOutput | None]] = deque()
        self._woken = False

    def put(self, queue: asyncio.Queue, output: RequestOutput | None) -> None:  # any thread
        if threading.get_ident() == self._loop_thread:
            if not self.loop.is_closed():  # (the engine closed after the loop: nobody reads)
                queue.put_nowait(output)
            return
        with self._lock:
            self._pending.append((queue, output))
            if self._woken:
                return
            self._woken = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:  # the event loop
        with self._lock:
            pending, self._pending = self._pending, deque()
            self._woken = False
        for queue, output in pending:
            queue.put_nowait(output)


_NOTHING = object()  # ServedSequence.outputs: no output held back


class SequenceFailed(Exception):
    """The request ended without finishing: it failed alone (`status` 500: its logits were not
    finite, its step failed twice), the pipeline failed, or the server shut down (`shutdown`, 503)
    before it was done."""

    def __init__(self, message: str, shutdown: bool = False):
        super().__init__(message)
        self.shutdown = shutdown


class ServedSequence:
    """Submit `request` to `engine` and read its outputs, which come through `bridge` (`async for
    out in seq.outputs()`). QueueFull / EngineClosed from the engine propagate from the
    constructor."""

    def __init__(self, engine: "EngineThread | EngineProcess", bridge: Bridge, request: Request):
        self.engine = engine
        self.bridge = bridge
        self.queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        self.finish: FinishReason | None = None
        self.stream: "Stream" = engine.submit(request, on_output=self._on_output)

    @property
    def index(self) -> int:
        return self.stream.index

    def _on_output(self, output: RequestOutput | None) -> None:  # the engine thread
        self.bridge.put(self.queue, output)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Each step's output as it comes, the last one with its finish reason (STOP or LENGTH;
        CONTEXT reads as LENGTH); the outputs that arrived while the reader was busy come as one
        (RequestOutput.merged), so a reader behind its sequence writes one event, not one a token. Leaving the loop early (a client gone) cancels the sequence;
        SequenceFailed if it ends unfinished."""
        held: RequestOutput | None | object = _NOTHING
        try:
            while self.finish is None:
                out = await self.queue.get() if held is _NOTHING else held
                held = _NOTHING
                if out is None:
                    self.finish = FinishReason.ERROR
                    raise SequenceFailed(f"generation failed: {self.stream.error or 'the request ended early'}")
                if out.finish in (FinishReason.CANCELLED, FinishReason.ERROR):
                    self.finish = out.finish
                    if out.finish == FinishReason.CANCELLED:  # not by us: the server's drain gave it up
                        raise SequenceFailed("the server shut down before this request finished", shutdown=True)
                    raise SequenceFailed(f"generation failed: {out.error}")
                while out.finish is None and not self.queue.empty():  # fell behind: one piece for all
                    later = self.queue.get_nowait()
                    if later is None or later.finish in (FinishReason.CANCELLED, FinishReason.ERROR):
                        held = later  # what came before a failure is still sent first
                        break
                    out = out.merged(later)
                self.finish = out.finish
                yield out
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the sequence unless it has ended (its row frees at the engine's next step)."""
        if self.finish is None:
            self.finish = FinishReason.CANCELLED
            self.engine.cancel(self.index)

