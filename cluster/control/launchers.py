"""The control plane: where stage workers live (launchers) and how the driver calls them.

Two implementations share one small interface: `RayLauncher` (ray_actors.py) places `StageActor`s in a
placement group; `ProcessLauncher` (here) runs each worker in a plain child process, for machines
without Ray (the GPU test machine) and for fast local runs. The data plane is the same either way:
workers talk to each other over transport sockets, never through the launcher.

A control call either returns, raises `WorkerError` (the worker ran the call and it failed) or
raises `WorkerLost` (the worker is dead or did not answer in time). The driver tells these apart
to decide whether a stage must be restarted.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Protocol

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.cluster.control.environment import worker_environment
from tvmpipe.cluster.wire.tcp import Address
from tvmpipe.cluster.control.shipping import Shipment, build_shipment, local_bundle
from tvmpipe.cluster.worker import StageSpec, StageWorker

# The worker methods the driver may call; anything else is refused on the worker side.
CONTROL_METHODS = frozenset({"address", "node", "prepare", "connect", "stop", "pause", "status", "stats",
                             "install_sampling"})


@dataclass(frozen=True)
class Timeouts:
    """Seconds. `start`: build + warm-up of a stage (a CUDA build can be slow); `call`: any other
    control call; `progress`: no micro-batch completed while some are in flight -> health check;
    `shutdown`: grace for a worker to close itself before it is killed."""

    start: float = 300.0
    call: float = 30.0
    progress: float = 60.0
    shutdown: float = 5.0

    def __post_init__(self) -> None:
        # A non-positive progress timeout made the supervisor's first wait raise and the thread
        # die: the run went on unsupervised and hung at the first fault.
        for name in ("start", "call", "progress", "shutdown"):
            value = getattr(self, name)
            if not value > 0:
                raise TvmpipeError(f"timeouts.{name} must be > 0 seconds, got {value}")


class WorkerError(TvmpipeError):
    """A stage worker ran a control call (or its build) and it raised."""

    def __init__(self, stage: int, message: str):
        self.stage = stage
        self.message = message
        super().__init__(f"stage {stage}: {message}")

    def __reduce__(self):
        """Ray pickles an actor's exception to the caller; the default (type, args) would call
        __init__ with the one formatted string and fail, and the caller got "actor died:
        UnserializableException" instead of the reason a stage failed to start."""
        return type(self), (self.stage, self.message)


class WorkerLost(WorkerError):
    """A stage worker is dead or unresponsive."""


class Launcher(Protocol):
    """Starts stage workers and carries the driver's control calls to them (see module docstring)."""

    def start(self, specs: list[StageSpec]) -> list[Address]: ...
    def restart(self, stage: int) -> Address: ...
    def call(self, stage: int, method: str, *args: Any) -> Any: ...
    def call_all(self, method: str, args: list[tuple] | None = None) -> list[Any]: ...
    def kill(self, stage: int) -> None: ...
    def shutdown(self) -> None: ...


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---- process launcher ----------------------------------------------------------------------------

def _serve(conn, spec: StageSpec, shipment: list[Shipment]) -> None:
    """Child process main: build the worker, then answer control calls until told to stop or the
    parent goes away (EOF on the pipe), so a crashed driver never leaves workers behind.
    `shipment` is [] (the bundle is read in place) or [the stage's Shipment], handed over in a
    list so the worker can drop the last reference once it is unpacked.

    SIGINT and SIGTERM are ignored: a worker shares its driver's process group, and Ctrl-C or a
    SIGTERM to the whole group (systemd's stop, `kill -TERM -PGID`) is for the driver to act on (a
    server drains, a run keeps what completed); the driver stops its workers (a close call, then
    SIGKILL), and a worker whose driver is gone sees EOF on the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        worker = StageWorker(spec, local_bundle(shipment, spec.index))
    except BaseException as exc:  # report any build failure to the parent instead of dying silently
        conn.send(("err", describe(exc)))
        return
    conn.send(("ok", worker.address()))
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                return
            if method == "close":
                return
            try:
                if method not in CONTROL_METHODS:
                    raise TvmpipeError(f"unknown control method {method!r}")
                conn.send(("ok", getattr(worker, method)(*args)))
            except Exception as exc:  # the parent decides what a failed call means
                conn.send(("err", describe(exc) if isinstance(exc, TvmpipeError) else traceback.format_exc()))
    finally:
        worker.close()
        conn.close()


class _Child:
    def __init__(self, ctx, spec: StageSpec, shipment: Shipment | None):
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child_conn, spec, [shipment] if shipment else []), daemon=True,
                                name=f"tvmpipe-stage{spec.index}")
        self.proc.start()
        self.proc._args = ()  # pickled to the child by start(): the parent keeps no shipment
        child_conn.close()
        self.lock = threading.Lock()


class ProcessLauncher:
    """Each stage worker in its own `spawn`ed child process on this machine; control over a pipe.

    `devices[i]`, if given, becomes stage i's CUDA_VISIBLE_DEVICES (one GPU per stage, or shared);
    `env` is extra environment for every worker.
    """

    def __init__(self, timeouts: Timeouts = Timeouts(), ship_bundle: bool = False,
                 devices: list[str] | None = None, env: dict[str, str] | None = None):
        self.timeouts = timeouts
        self.env = dict(env or {})
        self.ship_bundle = ship_bundle
        self.devices = devices
        self._ctx = mp.get_context("spawn")
        self._specs: list[StageSpec] = []
        self._children: list[_Child | None] = []
        self._slots_lock = threading.Lock()  # kill() takes a child out of _children under it
        self.shipped: dict[int, int] = {}  # stage -> bytes sent to it (ship_bundle)

    def _spawn(self, spec: StageSpec) -> _Child:
        env = {"CUDA_VISIBLE_DEVICES": self.devices[spec.index % len(self.devices)]} if self.devices else {}
        # Ship path: each child process stands for a node of its own, so it is sent its own
        # stage's weights only, built when it is spawned and dropped once pickled to it.
        shipment = build_shipment(spec.bundle_path, [(spec.start, spec.end)], [spec.index]) if self.ship_bundle else None
        if shipment is not None:
            self.shipped[spec.index] = shipment.nbytes
        with worker_environment({**self.env, **env}):
            return _Child(self._ctx, spec, shipment)

    def _await_ready(self, stage: int) -> Address:
        child = self._children[stage]
        if not child.conn.poll(self.timeouts.start):
            self.kill(stage)
            raise WorkerLost(stage, f"did not start within {self.timeouts.start:.0f} s")
        try:
            status, value = child.conn.recv()
        except (EOFError, OSError):
            child.proc.join(timeout=5)
            raise WorkerLost(stage, f"worker process exited while starting (exit code {child.proc.exitcode})") from None
        if status != "ok":
            child.proc.join(timeout=5)
            raise WorkerError(stage, f"failed to start: {value}")
        return tuple(value)

    def start(self, specs: list[StageSpec]) -> list[Address]:
        self._specs = list(specs)
        self._children = [self._spawn(s) for s in specs]
        try:
            return [self._await_ready(i) for i in range(len(specs))]
        except BaseException:
            self.shutdown()
            raise

    def restart(self, stage: int) -> Address:
        self.kill(stage)
        self._children[stage] = self._spawn(self._specs[stage])
        return self._await_ready(stage)

    def _request(self, stage: int, method: str, args: tuple) -> _Child:
        child = self._children[stage]
        if child is None or not child.proc.is_alive():
            raise WorkerLost(stage, "worker process is not running"
                             + (f" (exit code {child.proc.exitcode})" if child else " (killed)"))
        try:
            child.conn.send((method, args))
        except (OSError, EOFError) as exc:
            raise WorkerLost(stage, f"control pipe broken: {describe(exc)}") from None
        return child

    def _reply(self, stage: int, child: _Child, method: str, timeout: float) -> Any:
        try:
            if not child.conn.poll(timeout):
                raise WorkerLost(stage, f"no answer to {method}() within {timeout:.0f} s")
            status, value = child.conn.recv()
        except (OSError, EOFError):
            child.proc.join(timeout=1)
            raise WorkerLost(stage, f"worker process died (exit code {child.proc.exitcode})") from None
        if status != "ok":
            raise WorkerError(stage, value)
        return value

    def call(self, stage: int, method: str, *args: Any) -> Any:
        child = self._children[stage]
        if child is None:
            raise WorkerLost(stage, "worker process is not running (killed)")
        with child.lock:
            self._request(stage, method, args)
            return self._reply(stage, child, method, self.timeouts.call)

    def call_all(self, method: str, args: list[tuple] | None = None) -> list[Any]:
        """The call on every stage at once; a failed stage's slot holds its WorkerError."""
        args = args or [()] * len(self._children)
        sent: list[Any] = []
        held = []
        for i, a in enumerate(args):
            child = self._children[i]
            if child:
                child.lock.acquire()
                held.append(child.lock)
            try:
                sent.append(self._request(i, method, a))
            except WorkerError as exc:
                sent.append(exc)
        try:
            return [s if isinstance(s, WorkerError) else self._catch(i, s, method) for i, s in enumerate(sent)]
        finally:
            for lock in held:
                lock.release()

    def _catch(self, stage: int, child: _Child, method: str) -> Any:
        try:
            return self._reply(stage, child, method, self.timeouts.call)
        except WorkerError as exc:
            return exc

    def kill(self, stage: int) -> None:
        """SIGKILL the stage's process. Thread-safe: the child is taken out of its slot first, so
        of two concurrent kills (a fault injected from one thread, the supervisor's restart on
        another) one does the work, and the other can neither close the pipe a second time (its
        fd number may already belong to the replacement's pipe) nor empty the slot after the
        replacement has been put there."""
        with self._slots_lock:
            child = self._children[stage]
            self._children[stage] = None
        if child is None:
            return
        child.proc.kill()
        child.proc.join(timeout=10)
        child.conn.close()

    def shutdown(self) -> None:
        """Ask each worker to close (sockets, stage), then make sure the process is gone."""
        for child in self._children:
            if child is not None and child.proc.is_alive():
                try:
                    child.conn.send(("close", ()))
                except OSError:
                    pass
        for i, child in enumerate(self._children):
            if child is None:
                continue
            child.proc.join(timeout=self.timeouts.shutdown)
            if child.proc.is_alive():
                child.proc.kill()
                child.proc.join(timeout=10)
            child.conn.close()
            self._children[i] = None
