"""Engine: a request's whole life, from a checked Request to its last RequestOutput.

    engine = Engine(pipe, codec)              # the engine core (scheduler + pipeline I/O) and the output processor
    engine.add(request)                       # any number
    while engine.has_work:
        for out in engine.step():             # text, tokens, and on the last output the finish reason
            ...

`Engine` is synchronous: `tvmpipe generate` drives it on its own thread. `EngineThread` runs the
same Engine on a thread of its own for servers: requests arrive from any thread or event loop
(`submit` returns a Stream of RequestOutputs), `cancel` ends one (a client that went away), at most
`rows + max_waiting` are held (QueueFull past it), and `drain` stops taking new ones and lets the
running ones finish within a bound. Only the engine thread touches the Engine; other threads talk
to it through a locked inbox.

What one request causes ends that request alone: a stop string or a detokenizer error (the output
processor), logits that are not finite or a step that fails twice (the scheduler), a client gone
(cancel). Only the pipeline failing for good (PipelineError: a stage past its restarts) fails every
open request and closes the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.generation.core import EngineCore
from tvmpipe.generation.output import OutputProcessor, RequestOutput
from tvmpipe.generation.pages import PoolStats
from tvmpipe.generation.requests import FinishReason, Request, SequenceResult

if TYPE_CHECKING:
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation.text import TextCodec

OutputCallback = Callable[["RequestOutput | None"], None]


class Engine:
    """The engine core on `pipe` and the output processor (text through `codec`, None: tokens
    only). Keywords as Scheduler's (`in_flight`, `row_admission`, `logits_log`, `results`)."""

    def __init__(self, pipe: "Pipeline", codec: "TextCodec | None" = None, **scheduler_kw):
        self.core = EngineCore(pipe, **scheduler_kw)
        if codec is not None:  # what the sampling stage builds a grammar's tokenizer from (response_format)
            self.core.grammar_tokenizer = functools.cache(lambda: (codec.tokenizer.to_str(), tuple(codec.stop_token_ids)))
        self.pipe = pipe
        self.layout = self.core.layout
        self.codec = codec
        self.output = OutputProcessor(codec, self.core.cancel)

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    @property
    def busy(self) -> bool:
        return self.core.busy

    def add(self, request: Request, index: int | None = None) -> int:
        index = self.core.add(request, index)
        self.output.add(index, request)
        return index

    def cancel(self, index: int, why: FinishReason = FinishReason.CANCELLED) -> None:
        """End a request now; its last output comes from the next step."""
        self.core.cancel(index, why)

    def collect(self) -> list[RequestOutput]:
        """The last outputs of requests that ended without a step (cancelled while queued)."""
        return self.output.process((), self.core.take_finished())

    def step(self) -> list[RequestOutput]:
        """One step of the core, and what it made of each request."""
        events = self.core.step()
        out = self.output.process(events, self.core.take_finished())
        stopped = self.core.take_finished()  # ended by their text (stop strings) above: already out
        if stopped:
            out += self.output.process((), stopped)
        return out

    def pool_stats(self) -> "PoolStats | None":
        """A paged step's pool now (None for static caches)."""
        pool = self.core.scheduler.pool
        return pool.stats() if pool is not None else None

    def figures(self) -> tuple[int, tuple[int, ...], int, "PoolStats | None"]:
        """What a serving engine reports besides outputs (RequestBook._deliver): sequences running,
        each stage's restarts, steps failed, and a paged step's pool (None for static caches)."""
        return (self.core.scheduler.running, tuple(self.pipe.restarts), len(self.pipe.step_errors), self.pool_stats())

    def generate(self, requests: list[Request]) -> Iterator[RequestOutput]:
        """Run `requests` (indexed in order) to the end, yielding every output."""
        for r in requests:
            self.add(r)
        while self.has_work:
            yield from self.step()


def stage_info(pipe: "Pipeline") -> list[tuple[int, int | None, str | None]]:
    """(stage, pid, host) of each stage's process now (a status call to every worker)."""
    from tvmpipe.cluster.status import WorkerStatus

    hosts = [a[0] for a in pipe.addresses[:-1]]
    return [(i, st.pid if isinstance(st, WorkerStatus) else None, hosts[i] if i < len(hosts) else None)
            for i, st in enumerate(pipe.status())]


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
    finished: int  # sequences ended, for any reason (cancelled and failed ones included)
    cancelled: int  # ended by cancel() (a client that went away, a drain)
    failed_requests: int  # ended alone with an error (FinishReason.ERROR)
    generated_tokens: int
    restarts: int  # stage restarts the pipeline went through
    stage_restarts: tuple[int, ...]
    step_errors: int  # steps that raised on a live stage (each retried or ended its requests)
    draining: bool
    failed: str | None  # why the pipeline failed for good (the engine takes nothing more)
    kv: "PoolStats | None" = None  # a paged step's pool (the same page ids on every stage), else None

    @property
    def free_rows(self) -> int:
        return max(0, self.rows - self.running)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "stage_restarts": list(self.stage_restarts), "free_rows": self.free_rows,
                "kv": None if self.kv is None else dataclasses.asdict(self.kv)}


class Stream:
    """The outputs of one request as they come. Iterating blocks for the next RequestOutput and
    ends after the last; `result` is then its SequenceResult, or `error` the message of a pipeline
    failure. `on_output` (given to EngineThread.submit) is called on the engine thread for each
    output and once more with None at the end: a server bridges it into its event loop."""

    def __init__(self, index: int, request: Request, on_output: OutputCallback | None = None):
        self.index = index
        self.request = request
        self.result: SequenceResult | None = None
        self.error: str | None = None
        self.on_output = on_output
        self._outputs: deque[RequestOutput] = deque()
        self._done = False
        self._cond = threading.Condition()

    @property
    def done(self) -> bool:
        return self._done

    def _push(self, output: RequestOutput) -> None:
        with self._cond:
            self._outputs.append(output)
            if output.result is not None:
                self.result = output.result
            self._cond.notify_all()
        self._call(output)

    def _end(self, error: str | None = None) -> None:
        with self._cond:
            if self._done:
                return
            self.error, self._done = error, True
            self._cond.notify_all()
        self._call(None)

    def _call(self, output: RequestOutput | None) -> None:
        """The callback, which must never stop the engine thread: one that raises (its event loop
        closed under it) is dropped, and the stream stays readable by iteration."""
        if self.on_output is None:
            return
        try:
            self.on_output(output)
        except Exception as exc:  # noqa: BLE001 - the caller's code; the engine serves everyone else
            print(f"tvmpipe engine: the output callback of request {self.index} failed and was dropped "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)
            self.on_output = None

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            with self._cond:
                while not self._outputs and not self._done:
                    self._cond.wait()
                if self._outputs:
                    output = self._outputs.popleft()
                else:
                    return
            yield output

    def wait(self, timeout: float | None = None) -> SequenceResult | None:
        """Block until the request ends; its result (None on a pipeline failure or timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done, timeout)
            return self.result


class RequestBook:
    """What a serving engine holds of its requests, on the side of the threads that submit them:
    the admission rule (at most `rows + max_waiting` at once), each request's Stream, the counts,
    the drain and the failure that ends them all. EngineThread (the engine on a thread here) and
    EngineProcess (in a process of its own) are both one; each says how a request and a cancel
    reach its engine (`_send_request`, `_send_cancel`) and hands back outputs to `_deliver`."""

    def __init__(self, rows: int, max_waiting: int):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise FieldError("max_waiting", f"must be an integer >= 0, got {max_waiting!r}")
        self.rows = rows
        self.max_waiting = max_waiting
        self._lock = threading.Condition()
        self._streams: dict[int, Stream] = {}  # every request accepted and not ended yet
        self._next = 0
        self._draining = self._closed = False
        self._failed: str | None = None
        self._finished = self._cancelled = self._errors = self._tokens = self._rejected = 0
        self._running = 0
        self._restarts: tuple[int, ...] = ()
        self._step_errors = 0
        self._kv: PoolStats | None = None

    def _send_request(self, stream: Stream) -> None:  # _lock held
        raise NotImplementedError

    def _send_cancel(self, index: int) -> None:  # _lock held
        raise NotImplementedError

    # ---- any thread ---------------------------------------------------------------------------------
    def submit(self, request: Request, on_output: OutputCallback | None = None) -> Stream:
        """Queue a checked request (requests.Request.checked); its Stream, whose `on_output` is set
        before the engine can see it (so no output is missed). QueueFull when every row is busy and
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
            stream = Stream(self._next, request, on_output)
            self._next += 1
            self._streams[stream.index] = stream
            self._send_request(stream)
        return stream

    def cancel(self, index: int) -> None:
        """End request `index` now (the client went away): its row frees at the next step, and its
        last output has finish CANCELLED. A request that already ended: nothing."""
        with self._lock:
            if index in self._streams:
                self._send_cancel(index)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(self._running, len(self._streams) - self._running, self.rows, self.max_waiting,
                               self._next, self._rejected, self._finished, self._cancelled, self._errors,
                               self._tokens, sum(self._restarts), self._restarts, self._step_errors,
                               self._draining, self._failed, self._kv)

    def drain(self, timeout: float) -> bool:
        """Take no new requests; wait up to `timeout` s for the running and queued ones to finish,
        then cancel what is left. Whether everything finished in time."""
        deadline = time.time() + timeout
        with self._lock:
            self._draining = True
            self._lock.notify_all()
            clean = self._lock.wait_for(lambda: not self._streams or self._failed is not None,
                                        max(0.0, deadline - time.time()))
            for index in list(self._streams):
                self._send_cancel(index)
            self._lock.notify_all()
            self._lock.wait_for(lambda: not self._streams or self._failed is not None, 10.0)
        return clean

    # ---- outputs coming back ------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], figures: tuple | None = None) -> None:
        """Hand each output to its stream; end the streams whose request ended; take the engine's
        figures (Engine.figures: running, each stage's restarts, steps failed, a paged step's pool)
        where given (None: unchanged since the last)."""
        ended: list[Stream] = []
        tokens = 0
        with self._lock:
            streams = self._streams
        for out in outputs:
            tokens += len(out.token_ids)
            stream = streams.get(out.index)
            if stream is None:
                continue
            stream._push(out)
            if out.finish is not None:
                ended.append(stream)
        with self._lock:
            for stream in ended:
                self._streams.pop(stream.index, None)
                self._finished += 1
                finish = stream.result.finish if stream.result is not None else None
                self._cancelled += finish == FinishReason.CANCELLED
                self._errors += finish == FinishReason.ERROR
            self._tokens += tokens
            if figures is not None:
                self._running, self._restarts, self._step_errors, self._kv = figures
            self._lock.notify_all()
        for stream in ended:
            stream._end()

    def _fail_all(self, why: str) -> None:
        """The engine is gone (its pipeline failed for good, or it was closed): every open stream
        ends with `why`, and nothing more is taken."""
        with self._lock:
            if not self._closed:
                self._failed = self._failed or why
            streams, self._streams = list(self._streams.values()), {}
            self._running = 0
            self._lock.notify_all()
        for stream in streams:
            stream._end(why)


class EngineThread(RequestBook):
    """An Engine on its own thread, serving requests from any thread.

    `max_waiting`: requests that may wait for a row while every row is busy; one more is refused
    with QueueFull. Other keywords as Engine's."""

    def __init__(self, pipe: "Pipeline", codec: "TextCodec | None" = None, *, max_waiting: int = 64,
                 in_flight: int | None = None, row_admission: bool = True):
        self.engine = Engine(pipe, codec, in_flight=in_flight, row_admission=row_admission)
        s = self.engine.core.scheduler
        super().__init__(s.groups * s.batch, max_waiting)
        self.pipe = pipe
        self.layout = self.engine.layout
        self._restarts = tuple(pipe.restarts)
        self._inbox: deque[Stream] = deque()
        self._cancels: deque[int] = deque()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tvmpipe-engine")
        self._thread.start()

    def _send_request(self, stream: Stream) -> None:
        self._inbox.append(stream)
        self._lock.notify_all()

    def _send_cancel(self, index: int) -> None:
        self._cancels.append(index)
        self._lock.notify_all()

    def stage_info(self) -> list[tuple[int, int | None, str | None]]:
        """(stage, pid, host) of each stage's process now (a call to every worker)."""
        return stage_info(self.pipe)

    def close(self) -> None:
        """Stop the engine thread; streams still open end with an error."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=30)
        self._fail_all("the engine was closed")

    # ---- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        pipe = self.pipe
        try:
            while True:
                with self._lock:
                    while not (self._closed or self._inbox or self._cancels or engine.has_work):
                        self._lock.wait()
                    if self._closed:
                        return
                    arrivals, self._inbox = list(self._inbox), deque()
                    cancels, self._cancels = list(self._cancels), deque()
                for stream in arrivals:
                    engine.add(stream.request, stream.index)
                for index in cancels:
                    engine.cancel(index)
                outputs = engine.step() if engine.has_work else engine.collect()
                self._deliver(outputs, engine.figures())
        except Exception as exc:  # the pipeline failed for good: every open stream ends with its error
            self._fail_all(str(exc) if isinstance(exc, TvmpipeError) else f"{type(exc).__name__}: {exc}")
