"""Engine: the scheduler on its own thread, so that requests arrive and leave at any time.

A server (tvmpipe.serve) hands each request to `submit` from whatever thread or event loop it runs
on and reads the returned `Stream`; the engine thread admits it into the running pipeline as soon as
a row frees (continuous batching: requests are never served one after another), steps the scheduler,
and pushes each token to its stream. `cancel` (a client that went away, or a stop string the server
saw in the text) frees the row at the next step. The engine holds at most `rows + max_waiting`
requests at once (`QueueFull` past it: every row busy and `max_waiting` requests queued for one),
and `drain` stops taking new requests and lets the running ones finish within a bound.

Only the engine thread touches the scheduler and the pipeline's submit/receive; other threads talk
to it through a locked inbox. The thread also collects the steps still in flight once every
sequence has ended (steps submitted ahead for a sequence that then stopped): left unread, they
would look like a stalled pipeline to the driver's supervisor, which restarts stages that hold up
progress.
"""

from __future__ import annotations

import sys
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

EventCallback = Callable[[TokenEvent | None], None]


class QueueFull(TvmpipeError):
    """Every row is busy and `max_waiting` requests already wait for one: try again later (HTTP 429)."""


class EngineClosed(TvmpipeError):
    """The engine takes no new requests: it is draining, closed, or its pipeline failed (HTTP 503)."""


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds now, and counts since it started."""

    running: int  # sequences in a row of the pipeline
    waiting: int  # requests accepted and not in a row yet
    rows: int  # rows the pipeline holds for sequences (slots in use x batch)
    max_waiting: int
    submitted: int  # requests accepted
    rejected: int  # requests refused with QueueFull
    finished: int  # sequences ended, for any reason (cancelled ones included)
    cancelled: int  # ended by cancel() with why "cancelled" (a client that went away, a drain)
    generated_tokens: int
    restarts: int  # stage restarts the pipeline went through
    stage_restarts: tuple[int, ...]
    draining: bool
    failed: str | None  # why the pipeline failed for good (the engine takes nothing more)

    @property
    def free_rows(self) -> int:
        return max(0, self.rows - self.running)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "stage_restarts": list(self.stage_restarts), "free_rows": self.free_rows}


class Stream:
    """The tokens of one request, as they are drawn. Iterating blocks for the next TokenEvent and
    ends after the last; `result` is then the SequenceResult (its `finish` says why it ended), or
    `error` the message of a failure. `on_event` (given to Engine.submit) is called on the engine
    thread for each event and once more with None at the end: a server bridges it into its event
    loop."""

    def __init__(self, index: int, request: Request, on_event: EventCallback | None = None):
        self.index = index
        self.request = request
        self.result: SequenceResult | None = None
        self.error: str | None = None
        self.on_event = on_event
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
        self._call(event)

    def _end(self, result: SequenceResult | None, error: str | None = None) -> None:
        with self._cond:
            if self._done:
                return
            self.result, self.error, self._done = result, error, True
            self._cond.notify_all()
        self._call(None)

    def _call(self, event: TokenEvent | None) -> None:
        """The callback, which must never stop the engine thread: one that raises (its event loop
        closed under it) is dropped, and the stream stays readable by iteration."""
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception as exc:  # noqa: BLE001 - the caller's code; the engine serves everyone else
            print(f"tvmpipe engine: the event callback of request {self.index} failed and was dropped "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)
            self.on_event = None

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

    `max_waiting`: requests that may wait for a row while every row is busy; one more is refused
    with QueueFull. `in_flight` and `row_admission`: as Scheduler's."""

    def __init__(self, pipe: "Pipeline", *, max_waiting: int = 64, in_flight: int | None = None,
                 row_admission: bool = True):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise TvmpipeError(f"--max-waiting must be an integer >= 0, got {max_waiting!r}")
        self.pipe = pipe
        self.scheduler = Scheduler(pipe, in_flight=in_flight, row_admission=row_admission)
        self.layout = self.scheduler.layout
        self.rows = self.scheduler.groups * self.scheduler.batch
        self.max_waiting = max_waiting
        self._lock = threading.Condition()
        self._inbox: deque[Stream] = deque()
        self._cancels: deque[tuple[int, str]] = deque()
        self._streams: dict[int, Stream] = {}  # every request accepted and not ended yet
        self._next = 0
        self._draining = False
        self._closed = False
        self._failed: str | None = None
        self._finished = self._cancelled = self._tokens = self._rejected = 0
        self._running = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tvmpipe-engine")
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------------
    def submit(self, request: Request, on_event: EventCallback | None = None) -> Stream:
        """Queue a checked request (requests.Request.checked); its Stream, whose `on_event` is set
        before the engine can see it (so no event is missed). QueueFull when every row is busy and
        `max_waiting` requests wait already, EngineClosed when draining, closed or failed."""
        with self._lock:
            if self._failed is not None:
                raise EngineClosed(f"the pipeline failed: {self._failed}")
            if self._draining or self._closed:
                raise EngineClosed("the server is shutting down and takes no new requests")
            if len(self._streams) >= self.rows + self.max_waiting:
                self._rejected += 1
                raise QueueFull(f"all {self.rows} sequence rows are busy and {self.max_waiting} requests already "
                                "wait for one")
            stream = Stream(self._next, request, on_event)
            self._next += 1
            self._streams[stream.index] = stream
            self._inbox.append(stream)
            self._lock.notify_all()
        return stream

    def cancel(self, index: int, why: str = "cancelled") -> None:
        """End request `index` now, its result's `finish` being `why` ("cancelled": the client went
        away; "stop": the caller saw a stop string): its row frees at the next step. A request
        that already ended: nothing."""
        with self._lock:
            if index in self._streams:
                self._cancels.append((index, why))
                self._lock.notify_all()

    def stats(self) -> EngineStats:
        with self._lock:
            restarts = tuple(self.pipe.restarts)
            return EngineStats(self._running, len(self._streams) - self._running, self.rows, self.max_waiting,
                               self._next, self._rejected, self._finished, self._cancelled, self._tokens,
                               sum(restarts), restarts, self._draining, self._failed)

    def drain(self, timeout: float) -> bool:
        """Take no new requests; wait up to `timeout` s for the running and queued ones to finish,
        then cancel what is left. Whether everything finished in time."""
        deadline = time.time() + timeout
        with self._lock:
            self._draining = True
            self._lock.notify_all()
            clean = self._lock.wait_for(lambda: not self._streams or self._failed is not None,
                                        max(0.0, deadline - time.time()))
            self._cancels.extend((i, "cancelled") for i in self._streams)
            self._lock.notify_all()
            self._lock.wait_for(lambda: not self._streams or self._failed is not None, 10.0)
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
                    while not (self._closed or self._inbox or self._cancels or s.busy or s.steps):
                        self._lock.wait()
                    if self._closed:
                        return
                    arrivals, self._inbox = list(self._inbox), deque()
                    cancels, self._cancels = list(self._cancels), deque()
                for stream in arrivals:
                    s.add(stream.request, stream.index)
                for index, why in cancels:
                    s.cancel(index, why)
                # a step while sequences run; else the steps left in flight are collected
                self._deliver(s.step() if s.busy or s.steps else [])
        except Exception as exc:  # the pipeline failed for good: every open stream ends with its error
            self._fail_all(str(exc) if isinstance(exc, TvmpipeError) else f"{type(exc).__name__}: {exc}")

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
            self._lock.notify_all()
        for stream, r in ended:
            stream._end(r)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._failed = self._failed or why
            streams, self._streams = list(self._streams.values()), {}
            self._inbox.clear()
            self._running = 0
            self._lock.notify_all()
        for stream in streams:
            stream._end(None, why)
