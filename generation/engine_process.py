"""EngineProcess: the Engine in a process of its own, for servers.

An HTTP server and the engine in one process share one GIL: while the event loop writes chunks to
its clients, the engine thread, with a stage's frame to act on, waits for it, and the stages idle.
So `tvmpipe serve` runs the Engine (scheduler, driver, output processor) in a child process, as
vLLM's API server runs its EngineCore, and talks to it over a pipe: requests and cancels go in,
each step's RequestOutputs come back in one message. The client here has EngineThread's verbs
(`submit` -> Stream, `cancel`, `stats`, `drain`, `close`), so the server cannot tell them apart.

The child opens the pipeline itself, with `opener` (a picklable callable returning a context
manager that yields an Engine: the application layer knows how to open a cluster). It ignores
SIGINT and SIGTERM: a signal to the server's process group is the server's to act on (it drains
through the pipe), and a child whose parent is gone sees EOF on the pipe and closes its pipeline.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable, ContextManager

from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.generation.engine import EngineClosed, EngineStats, OutputCallback, QueueFull, Stream
from tvmpipe.generation.output import RequestOutput
from tvmpipe.generation.requests import FinishReason, Request

Opener = Callable[[], ContextManager[Any]]  # yields an Engine
START_TIMEOUT_S = 600.0  # a cluster, its stages and their weights: minutes on a big model
CALL_TIMEOUT_S = 30.0


def _child(conn: Any, opener: Opener) -> None:
    """The engine process: open the engine, say ready, then step it and answer the parent until
    told to close or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with opener() as engine:
            s = engine.core.scheduler
            conn.send(("ready", {"rows": s.groups * s.batch, "backend": getattr(engine, "backend", None),
                                 "restarts": tuple(engine.pipe.restarts)}))
            _serve(conn, engine)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which says it in one line
        message = str(exc) if isinstance(exc, TvmpipeError) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, TvmpipeError):
            traceback.print_exc(file=sys.stderr)
        try:
            conn.send(("failed", message))
        except (OSError, ValueError):
            pass


def _serve(conn: Any, engine: Any) -> None:
    """Step the engine and send what it made; take commands between steps. Outputs of steps that
    complete back to back go in one message (a step that is complete already is taken before the
    message is sent: no client waits for it), each as a plain tuple (pickled several times faster
    than the dataclass); commands are looked for before every step that would wait."""
    pipe = engine.pipe
    pending: list[tuple] = []
    while True:
        if not (engine.has_work and pipe.ready):  # about to wait for a step, or idle: commands first
            while conn.poll(0 if engine.has_work or pending else 0.5):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                kind = msg[0]
                if kind == "add":
                    engine.add(msg[2], msg[1])
                elif kind == "cancel":
                    engine.cancel(msg[1])
                elif kind == "call":
                    conn.send(("reply", msg[1], _call(engine, msg[2])))
                elif kind == "close":
                    return
        for o in engine.step() if engine.has_work else engine.collect():
            pending.append((o.index, o.text, o.token_ids, o.finish, o.error, o.result))
        if pending and not (engine.has_work and pipe.ready):
            conn.send(("out", pending, engine.core.scheduler.running, tuple(pipe.restarts), len(pipe.step_errors)))
            pending = []


def _call(engine: Any, what: str) -> Any:
    """The answers the server asks for besides outputs (/metrics: each stage's process)."""
    if what == "stages":
        from tvmpipe.generation.engine import stage_info

        return stage_info(engine.pipe)
    raise TvmpipeError(f"unknown call {what!r}")


class EngineProcess:
    """An Engine in a child process, served from any thread of this one (EngineThread's verbs).
    `layout`: the decode step's (the server checks requests against it before submitting)."""

    def __init__(self, opener: Opener, layout: Any, *, max_waiting: int = 64):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise FieldError("max_waiting", f"must be an integer >= 0, got {max_waiting!r}")
        self.layout = layout
        self.max_waiting = max_waiting
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        # not a daemon: it starts processes of its own (the stages); it ends on EOF from this side
        self._proc = ctx.Process(target=_child, args=(child_conn, opener), name="tvmpipe-engine")
        self._proc.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Condition()
        self._streams: dict[int, Stream] = {}
        self._next = 0
        self._draining = self._closed = False
        self._failed: str | None = None
        self._finished = self._cancelled = self._errors = self._tokens = self._rejected = 0
        self._running = 0
        self._restarts: tuple[int, ...] = ()
        self._step_errors = 0
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        kind, info = self._first_message()
        if kind != "ready":
            self._proc.join(10)
            raise TvmpipeError(info)
        self.rows = info["rows"]
        self.backend = info["backend"]
        self._restarts = info["restarts"]
        self._reader = threading.Thread(target=self._read, daemon=True, name="tvmpipe-engine-reader")
        self._reader.start()

    def _first_message(self) -> tuple[str, Any]:
        deadline = time.time() + START_TIMEOUT_S
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                return "failed", f"the engine process exited while starting (exit code {self._proc.exitcode})"
            if time.time() > deadline:
                self._proc.kill()
                return "failed", f"the engine process did not start within {START_TIMEOUT_S:g} s"
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return "failed", f"the engine process exited while starting (exit code {self._proc.exitcode})"

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    # ---- EngineThread's verbs ------------------------------------------------------------------------
    def submit(self, request: Request, on_output: OutputCallback | None = None) -> Stream:
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
        try:
            self._send(("add", stream.index, request))
        except (OSError, ValueError) as exc:
            self._fail_all(f"the engine process is gone ({type(exc).__name__}: {exc})")
        return stream

    def cancel(self, index: int) -> None:
        with self._lock:
            if index not in self._streams:
                return
        try:
            self._send(("cancel", index))
        except (OSError, ValueError):
            pass

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(self._running, len(self._streams) - self._running, self.rows, self.max_waiting,
                               self._next, self._rejected, self._finished, self._cancelled, self._errors,
                               self._tokens, sum(self._restarts), self._restarts, self._step_errors,
                               self._draining, self._failed)

    def stage_info(self, timeout: float = CALL_TIMEOUT_S) -> list[tuple[int, int | None, str | None]]:
        """(stage, pid, host) of each stage's process now."""
        return self._call("stages", timeout)

    def drain(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        with self._lock:
            self._draining = True
            clean = self._lock.wait_for(lambda: not self._streams or self._failed is not None,
                                        max(0.0, deadline - time.time()))
            left = list(self._streams)
        for index in left:
            self.cancel(index)
        with self._lock:
            self._lock.wait_for(lambda: not self._streams or self._failed is not None, 10.0)
        return clean

    def close(self) -> None:
        with self._lock:
            self._closed = True
        try:
            self._send(("close",))
        except (OSError, ValueError):
            pass
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._fail_all("the engine was closed")
        self._conn.close()

    # ---- the reader thread ---------------------------------------------------------------------------
    def _call(self, what: str, timeout: float) -> Any:
        future: Future = Future()
        call = next(self._call_ids)
        self._calls[call] = future
        try:
            self._send(("call", call, what))
            return future.result(timeout)
        finally:
            self._calls.pop(call, None)

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                code = self._proc.exitcode
                self._fail_all("the engine process exited" + (f" (exit code {code})" if code is not None else ""))
                return
            kind = msg[0]
            if kind == "out":
                self._deliver(*msg[1:])
            elif kind == "reply":
                future = self._calls.get(msg[1])
                if future is not None:
                    future.set_result(msg[2])
            elif kind == "failed":
                self._fail_all(msg[1])

    def _deliver(self, outputs: list[tuple], running: int, restarts: tuple[int, ...], step_errors: int) -> None:
        ended: list[Stream] = []
        tokens = 0
        with self._lock:
            streams = self._streams
        for fields in outputs:
            out = RequestOutput(*fields)
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
            self._running, self._restarts, self._step_errors = running, restarts, step_errors
            self._lock.notify_all()
        for stream in ended:
            stream._end()

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._failed = self._failed or (None if self._closed and why == "the engine was closed" else why)
            streams, self._streams = list(self._streams.values()), {}
            self._running = 0
            self._lock.notify_all()
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(EngineClosed(why))
        for stream in streams:
            stream._end(why)
