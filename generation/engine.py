"""Engine: the scheduler on its own thread, so that requests arrive and leave at any time.

A server (tvmpipe.serve) hands each request to `submit` from whatever thread or event loop it runs
on and reads the returned `Stream`; the engine thread admits it into the running pipeline as soon as
a row frees (continuous batching: requests are never served one after another), steps the scheduler,
and pushes each token to its stream. `cancel` (a client that went away) frees the row at the next
step. The queue of requests waiting for a row is bounded (`QueueFull` past it), and `drain` stops
taking new requests and lets the running ones finish within a bound.

Only the engine thread touches the scheduler; other threads talk to it through a locked inbox.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.generation.requests import Request, SequenceResult, TokenEvent
from tvmpipe.generation.scheduler import Scheduler

if TYPE_CHECKING:
    from tvmpipe.cluster.driver import Pipeline


class QueueFull(TvmpipeError):
    """More requests wait for a row than the engine's bound: try again later (HTTP 429)."""


class EngineClosed(TvmpipeError):
    """The engine takes no new requests: it is draining, closed, or its pipeline failed (HTTP 503)."""


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds now, and counts since it started."""

    running: int  # sequences in a row of the pipeline
    waiting: int  # sequences queued for a row
    rows: int  # rows the pipeline holds for sequences (slots x batch)
    finished: int
    cancelled: int
    generated_tokens: int
    restarts: int  # stage restarts the pipeline went through
    draining: bool

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Stream:
    """The tokens of one request, as they are drawn. Iterating blocks for the next TokenEvent and
    ends after the last; `result` is then the SequenceResult (its `finish` says why it ended), or
    `error` the message of a failure. `on_event`, if set, is called on the engine thread for each
    event and once more with None at the end (a server bridges it into its event loop)."""

    def __init__(self, index: int, request: Request):
        self.index = index
        self.request = request
        self.result: SequenceResult | None = None
        self.error: str | None = None
        self.on_event: Callable[[TokenEvent | None], None] | None = None
        self._events: deque[TokenEvent] = deque()
        self._done = False
        self._cond = threading.Condition()

    @property
    def done(self) -> bool:
        return self._done

    def _push(self, event: TokenEvent) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()
        if self.on_event is not None:
            self.on_event(event)

    def _end(self, result: SequenceResult | None, error: str | None = None) -> None:
        with self._cond:
            if self._done:
                return
            self.result, self.error, self._done = result, error, True
            self._cond.notify_all()
        if self.on_event is not None:
            self.on_event(None)

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            with self._cond:
                while not self._events and not self._done:
                    self._cond.wait()
                if self._events:
                    event = self._events.popleft()
                else:
                    return
            yield event

    def wait(self, timeout: float | None = None) -> SequenceResult | None:
        """Block until the sequence ends; its result (None on failure or timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done, timeout)
            return self.result


class Engine:
    """Serve requests on `pipe` (a Pipeline of a decode-step bundle) from any thread.

    `max_waiting`: requests that may wait for a row; one more is refused with QueueFull.
    `in_flight` and `row_admission`: as Scheduler's."""

    def __init__(self, pipe: "Pipeline", *, max_waiting: int = 64, in_flight: int | None = None,
                 row_admission: bool = True):
        self.pipe = pipe
        self.scheduler = Scheduler(pipe, in_flight=in_flight, row_admission=row_admission)
        self.layout = self.scheduler.layout
        self.rows = self.scheduler.groups * self.scheduler.batch
        self.max_waiting = max_waiting
        self._lock = threading.Condition()
        self._inbox: deque[Stream] = deque()
        self._cancels: deque[int] = deque()
        self._streams: dict[int, Stream] = {}
        self._next = 0
        self._draining = False
        self._closed = False
        self._failed: str | None = None
        self._finished = self._cancelled = self._tokens = 0
        self._running = self._waiting = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tvmpipe-engine")
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------------
    def submit(self, request: Request) -> Stream:
        """Queue a checked request (requests.Request.checked); its Stream. QueueFull when
        `max_waiting` requests already wait for a row, EngineClosed when draining or failed."""
        with self._lock:
            if self._failed is not None:
                raise EngineClosed(f"the pipeline failed: {self._failed}")
            if self._draining or self._closed:
                raise EngineClosed("the server is shutting down")
            free = max(0, self.rows - self._running)
            if self._waiting + len(self._inbox) - free >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting for a sequence slot")
            stream = Stream(self._next, request)
            self._next += 1
            self._streams[stream.index] = stream
            self._inbox.append(stream)
            self._lock.notify_all()
        return stream

    def cancel(self, index: int) -> None:
        """Give up request `index` (a client that disconnected): its row frees at the next step."""
        with self._lock:
            if index in self._streams:
                self._cancels.append(index)
                self._lock.notify_all()

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(self._running, self._waiting + len(self._inbox), self.rows, self._finished,
                               self._cancelled, self._tokens, sum(self.pipe.restarts), self._draining)

    def drain(self, timeout: float) -> bool:
        """Take no new requests; wait up to `timeout` s for the running and queued ones to finish,
        then cancel what is left. Whether everything finished in time."""
        deadline = time.time() + timeout
        with self._lock:
            self._draining = True
            self._lock.notify_all()
            clean = self._lock.wait_for(lambda: not self._streams or self._failed is not None,
                                        max(0.0, deadline - time.time()))
            left = list(self._streams)
            self._cancels.extend(left)
            self._lock.notify_all()
        with self._lock:
            self._lock.wait_for(lambda: not self._streams or self._failed is not None, 5.0)
        return clean

    def close(self) -> None:
        """Stop the engine thread; streams still open end with an error."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=30)
        self._fail_all("the engine was closed")

    # ---- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        s = self.scheduler
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._inbox and not self._cancels and not s.busy:
                        self._lock.wait()
                    if self._closed:
                        return
                    arrivals, self._inbox = list(self._inbox), deque()
                    cancels, self._cancels = list(self._cancels), deque()
                for stream in arrivals:
                    s.add(stream.request, stream.index)
                for index in cancels:
                    s.cancel(index)
                self._deliver(s.step() if s.busy else [])
        except Exception as exc:  # the pipeline failed for good: every open stream ends with its error
            self._fail_all(f"{type(exc).__name__}: {exc}" if not isinstance(exc, TvmpipeError) else str(exc))

    def _deliver(self, events: list[TokenEvent]) -> None:
        """Push each event to its stream; end the streams of the sequences that finished."""
        s = self.scheduler
        for event in events:
            stream = self._streams.get(event.seq)
            if stream is not None:
                stream._push(event)
        ended: list[tuple[Stream, SequenceResult]] = []
        with self._lock:
            while s.finished:
                r = s.finished.popleft()
                self._finished += 1
                self._cancelled += r.finish == "cancelled"
                stream = self._streams.pop(r.index, None)
                if stream is not None:
                    ended.append((stream, r))
            self._tokens += len(events)
            self._running = sum(len(g.running) for g in s.active.values())
            self._waiting = len(s.queue)
            self._lock.notify_all()
        for stream, r in ended:
            stream._end(r)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._failed = self._failed or why
            streams, self._streams = list(self._streams.values()), {}
            self._inbox.clear()
            self._lock.notify_all()
        for stream in streams:
            stream._end(None, why)
