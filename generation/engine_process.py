"""EngineProcess: the Engine in a process of its own, for servers.

An HTTP server and the engine in one process share one GIL: while the event loop writes chunks to
its clients, the engine thread, with a stage's frame to act on, waits for it, and the stages idle.
So `tvmpipe serve` runs the Engine (scheduler, driver, output processor) in a child process, as
vLLM's API server runs its EngineCore, and talks to it over a pipe: requests and cancels go in,
each step's RequestOutputs come back in one message. The client here has EngineThread's verbs
(`submit` -> Stream, `cancel`, `stats`, `drain`, `close`), so the server cannot tell them apart.
The server's event loop reads the pipe (`attach`, before the first submit): the outputs reach the
streams on the loop's thread, with no thread here to take the GIL from the loop.

The child opens the pipeline itself, with `opener` (a picklable callable returning a context
manager that yields an Engine: the application layer knows how to open a cluster). It ignores
SIGINT and SIGTERM: a signal to the server's process group is the server's to act on (it drains
through the pipe), and a child whose parent is gone sees EOF on the pipe and closes its pipeline.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import select
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable, ContextManager

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.generation.engine import EngineClosed, RequestBook, Stream
from tvmpipe.generation.output import RequestOutput

Opener = Callable[[], ContextManager[Any]]  # yields an Engine
START_TIMEOUT_S = 600.0  # a cluster, its stages and their weights: minutes on a big model
CALL_TIMEOUT_S = 30.0


def _child(conn: Any, opener: Opener) -> None:
    """The engine process: open the engine, say ready, then step it and answer the parent until
    told to close or the parent is gone."""
    _ignore_signals()
    try:
        with opener() as engine:
            _ignore_signals()  # again: opening may have set its own (ray.init's SIGTERM handler exits)
            s = engine.core.scheduler
            pool = getattr(engine.pipe, "kv_pool", None)  # a paged step's pool as the run sized it
            conn.send(("ready", {"rows": s.groups * s.batch, "backend": getattr(engine, "backend", None),
                                 "kv_tokens": None if pool is None else pool.tokens,
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


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _serve(conn: Any, engine: Any) -> None:
    """Step the engine and send what it made; take commands between steps. Outputs of steps that
    complete back to back go in one message (a step that is complete already is taken before the
    message is sent: no client waits for it), each as a plain tuple (pickled several times faster
    than the dataclass), with the engine's figures where they changed since the last message (the
    pool's stats are a dataclass to pickle); commands are looked for before every step that would
    wait."""
    pipe = engine.pipe
    pending: list[tuple] = []
    figures: tuple = ()  # the engine's figures as last sent: sent again only when they change
    poller = _poller(conn)
    while True:
        if not (engine.has_work and pipe.ready):  # about to wait for a step, or idle: commands first
            while poller.poll(0 if engine.has_work or pending else 500):
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
            pending.append((o.index, o.text, o.token_ids, o.finish, o.error, o.result, o.logprobs, o.prompt_logprobs))
        if pending and not (engine.has_work and pipe.ready):
            now = engine.figures()
            conn.send(("out", pending) if now == figures else ("out", pending, *now))
            pending, figures = [], now


def _poller(conn: Any) -> "select.poll":
    """A poll object on `conn`'s data, made once: Connection.poll builds a selector a call."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return poller


def _call(engine: Any, what: str) -> Any:
    """The answers the server asks for besides outputs (/metrics: each stage's process)."""
    if what == "stages":
        from tvmpipe.generation.engine import stage_info

        return stage_info(engine.pipe)
    raise TvmpipeError(f"unknown call {what!r}")


class EngineProcess(RequestBook):
    """An Engine in a child process, served from any thread of this one (EngineThread's verbs).
    `layout`: the decode step's (the server checks requests against it before submitting)."""

    def __init__(self, opener: Opener, layout: Any, *, max_waiting: int = 64):
        super().__init__(0, max_waiting)  # rows: the child says, once its pipeline is up
        self.layout = layout
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        # not a daemon: it starts processes of its own (the stages); it ends on EOF from this side
        self._proc = ctx.Process(target=_child, args=(child_conn, opener), name="tvmpipe-engine")
        self._proc.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        kind, info = self._first_message()
        if kind != "ready":
            self._proc.join(10)
            raise TvmpipeError(info)
        self.rows = info["rows"]
        self.backend = info["backend"]
        self.kv_tokens = info["kv_tokens"]  # a paged step's KV pool in tokens (None: static caches)
        self._restarts = info["restarts"]
        self._loop: Any = None  # the event loop that reads the pipe (attach)

    def attach(self, loop: Any) -> None:
        """Read the engine's messages on `loop` (an asyncio event loop on this thread, running until
        close): each step's outputs reach their streams on the loop's own thread, with no second
        thread taking the GIL from the loop and no wake-up of the loop from outside (a system call
        a step). Before anything is submitted."""
        if self._loop is not None:
            raise TvmpipeError("the engine process is attached to an event loop already")
        self._loop = loop
        self._poller = _poller(self._conn)
        loop.add_reader(self._conn.fileno(), self._readable)

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

    def _send(self, msg: tuple) -> bool:
        """`_write` a message that expects an answer: refused before an event loop reads the pipe
        (nothing would read the answer)."""
        if self._loop is None:
            raise TvmpipeError("attach the engine process to an event loop before using it")
        return self._write(msg)

    def _write(self, msg: tuple) -> bool:
        """Whether it went (a child that is gone is noticed by the reader: EOF)."""
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, ValueError):
            return False

    def _send_request(self, stream: Stream) -> None:
        self._send(("add", stream.index, stream.request))

    def _send_cancel(self, index: int) -> None:
        self._send(("cancel", index))

    def stage_info(self, timeout: float = CALL_TIMEOUT_S) -> list[tuple[int, int | None, str | None]]:
        """(stage, pid, host) of each stage's process now."""
        future: Future = Future()
        call = next(self._call_ids)
        self._calls[call] = future
        try:
            if not self._send(("call", call, "stages")):
                raise EngineClosed("the engine process is gone")
            return future.result(timeout)
        finally:
            self._calls.pop(call, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._write(("close",))  # attached or not
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._fail_all("the engine was closed")
        self._conn.close()

    # ---- reading the pipe, on the attached event loop ----------------------------------------------------
    def _readable(self) -> None:
        """The event loop's callback when the pipe has data: every message there now. (A message is
        one write of the engine's, or two past 16 KiB: recv may wait for the second, microseconds.)"""
        try:
            while True:
                self._handle(self._conn.recv())
                if not self._poller.poll(0):
                    return
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fileno())
            self._gone()

    def _gone(self) -> None:
        code = self._proc.exitcode
        self._fail_all("the engine process exited" + (f" (exit code {code})" if code is not None else ""))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":  # with the engine's figures, or without where they have not changed
            self._deliver([RequestOutput(*fields) for fields in msg[1]], msg[2:] or None)
        elif kind == "reply":
            future = self._calls.get(msg[1])
            if future is not None:
                future.set_result(msg[2])
        elif kind == "failed":
            self._fail_all(msg[1])

    def _fail_all(self, why: str) -> None:
        super()._fail_all(why)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(EngineClosed(why))
