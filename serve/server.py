"""Running the HTTP server: uvicorn in this process, the engine (the pipeline's driver among it) in
a process of its own (generation.engine_process), until SIGTERM.

Why FastAPI and uvicorn, not Ray Serve: the pipeline's stage actors are already placed by tvmpipe
(its own placement group, data plane and fault recovery), and the server is one process beside the
engine that owns them. Ray Serve would add its controller and proxy actors and place a replica of
its own, a second placement around the first, for a single driver that cannot be replicated
anyway (the stages keep each sequence's KV cache). uvicorn serves the one event loop the routes
need; the engine process does the stepping.

Priority: the HTTP process runs `http_nice` (`--http-nice`, 10 by default) below the engine process
and the stages. Where they share cores (local mode, the reference backend, a busy head node), a
step's outputs reaching this process would otherwise preempt the stage that runs the next step
(the scheduler favours a process waking from sleep); `bench/serve.py --http-nice` measures the
difference, two servers side by side (bench/results/serve_http_nice.json). This process then takes
the cores the pipeline leaves, and falls behind rather than holding it up: outputs that arrive
meanwhile go out as one event (ServedSequence.outputs).

Shutdown (SIGTERM or Ctrl-C): the listening socket closes at once (new connections are refused),
requests on open connections get 503, the sequences in flight run on for up to `drain_timeout`
seconds and are cancelled after it (their streams end with an error event), then uvicorn closes
the connections and `serve` returns. A second signal exits at once. If the pipeline fails for
good (a stage past its restarts) the server exits too, with status 1, after answering the open
requests with the error: an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.serve import metrics
from tvmpipe.serve.app import create_app
from tvmpipe.serve.service import Service

if TYPE_CHECKING:
    from tvmpipe.generation.engine import EngineThread
    from tvmpipe.generation.engine_process import EngineProcess
    from tvmpipe.generation.text import TextCodec

API_KEY_ENV = "TVMPIPE_API_KEY"
# An EngineThread (the engine on a thread of this process: a library's server) and the event loop
# share this process's GIL: a step's outputs wait for the loop to let go of it, up to the switch
# interval (5 ms by default). 0.5 ms keeps that wait short. (An EngineProcess is read by the loop.)
SWITCH_INTERVAL_S = 0.0005
CLOSE_GRACE_S = 5.0  # after the drain: for the last chunks to reach their clients


@dataclass(frozen=True)
class ServeSettings:
    """How the server runs; the command's options (app/serving.py)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting: int = 64
    max_body_bytes: int = 1 << 20
    drain_timeout: float = 30.0
    in_flight: int | None = None
    header_timeout: float = 10.0  # a request's line and headers must arrive within it, or the connection is closed
    body_timeout: float = 30.0  # a request's body must arrive within it of the headers, or it is answered 408
    keep_alive_timeout: float = 5.0  # an idle connection is closed after it (uvicorn's timeout_keep_alive)
    http_nice: int = 0  # this process's nice increment once the engine runs in its own process (Runner.run)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the pipeline starts, so a busy port is a one-line error
    before anything else is started (port 0: any free port; `sock.getsockname()` says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise TvmpipeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a timeout on reading a request's line and headers.

    uvicorn (0.54) times a connection out only between requests, after a response (its
    timeout_keep_alive): a connection that sends nothing, or never finishes its headers, has no
    timer at all and was held until the client left (1,000 of them for as long as a test kept
    them open). Here the headers must be complete within `header_timeout` seconds of the
    connection being accepted, or of the first byte of a later request on a kept-alive connection;
    else the connection is closed, without a response (as nginx does for its client_header_timeout).
    A subclass per server sets `header_timeout` (`with_header_timeout`)."""

    header_timeout: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type["HeaderTimeoutProtocol"]:
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_message_begin(self) -> None:  # the first byte of a request (the parser's callback)
        super().on_message_begin()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:  # armed at the connection (first request) or the first byte (later ones)
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server with tvmpipe's signal handling: a first SIGTERM/SIGINT drains, a second exits
    now; unlike uvicorn's own, it does not re-raise the signal when serving ends, so the pipeline
    and the cluster are closed by their owners afterwards."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None], on_started: Callable[[], None]):
        super().__init__(config)
        self._on_signal = on_signal
        self._on_started = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_signal(sig)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._on_started()


class Runner:
    """One server over `engine` (generation.engine_process.EngineProcess, or an EngineThread): the
    app, uvicorn, the drain. The engine is the server's to close."""

    def __init__(self, engine: "EngineProcess | EngineThread", codec: "TextCodec | None", settings: ServeSettings,
                 sock: socket.socket, on_ready: Callable[[str, int], None] = lambda url, rows: None,
                 log: Callable[[str], None] | None = None):
        self.settings = settings
        self.sock = sock
        self.url = url_of(sock)
        self.on_ready = on_ready
        self.log = log or (lambda line: print(f"tvmpipe serve: {line}", file=sys.stderr, flush=True))
        self.engine = engine
        self.attached = hasattr(engine, "attach")  # an EngineProcess: its pipe read on this loop
        self.service = Service(self.engine, codec, settings.model)
        self.counters = metrics.Counters()
        app = create_app(self.service, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                         body_timeout=settings.body_timeout, counters=self.counters)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=CLOSE_GRACE_S,
                                http=HeaderTimeoutProtocol.with_header_timeout(settings.header_timeout),
                                timeout_keep_alive=settings.keep_alive_timeout)  # type: ignore[arg-type]
        self.server = _Uvicorn(config, self._on_signal, self._on_started)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.failed: str | None = None
        self.drained_clean: bool | None = None

    def run(self) -> int:
        """Serve until a signal and the drain, or a pipeline failure; the exit status (0, or 1 when
        the pipeline failed)."""
        interval = sys.getswitchinterval()
        if not self.attached:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        elif self.settings.http_nice:  # the engine and its stages, started already, keep their priority
            os.nice(self.settings.http_nice)
        factory = self.server.config.get_loop_factory()  # uvloop where installed, as uvicorn picks it
        try:
            if factory is None or not hasattr(asyncio, "Runner"):  # asyncio.Runner: Python 3.11+
                asyncio.run(self._main())
            else:
                with asyncio.Runner(loop_factory=factory) as runner:
                    runner.run(self._main())
        finally:
            self.engine.close()
            sys.setswitchinterval(interval)
        return 1 if self.failed else 0

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.attached:
            self.engine.attach(self.loop)
        watch = asyncio.ensure_future(self._watch_pipeline())
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            watch.cancel()

    def _on_started(self) -> None:
        self.on_ready(self.url, self.engine.rows)

    def _on_signal(self, sig: int) -> None:  # a signal handler, on the main thread (the event loop's)
        if self.draining or self.loop is None:
            self.log(f"{signal.Signals(sig).name} again: exiting now")
            self.server.should_exit = self.server.force_exit = True
            return
        self.draining = True
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(sig)))

    async def _drain(self, sig: int) -> None:
        for listener in self.server.servers:  # new connections are refused from here on
            listener.close()
        stats = self.engine.stats()
        self.log(f"{signal.Signals(sig).name}: draining {stats.running + stats.waiting} request(s) "
                 f"(at most {self.settings.drain_timeout:g} s)")
        self.drained_clean = await asyncio.to_thread(self.engine.drain, self.settings.drain_timeout)
        if not self.drained_clean:
            self.log(f"drain timeout: the requests still running after {self.settings.drain_timeout:g} s were cancelled")
        self.server.should_exit = True

    async def _watch_pipeline(self) -> None:
        """A pipeline that failed for good ends the server (status 1) once open requests have their error."""
        while True:
            await asyncio.sleep(0.5)
            failed = self.engine.stats().failed
            if failed is not None and not self.draining:
                self.failed = failed
                self.log(f"the pipeline failed: {failed}; exiting")
                self.draining = True
                for listener in self.server.servers:
                    listener.close()
                self.server.should_exit = True
                return


def serve(engine: "EngineProcess | EngineThread", codec: "TextCodec | None", settings: ServeSettings,
          sock: socket.socket, on_ready: Callable[[str, int], None] = lambda url, rows: None) -> int:
    """Serve `engine` on `sock` until SIGTERM (drained) or a pipeline failure; the exit status."""
    return Runner(engine, codec, settings, sock, on_ready).run()
