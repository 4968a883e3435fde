"""Helpers for the cluster tests: reference outputs, an in-process launcher for fault injection,
and socket/process leak checks."""

from __future__ import annotations

import functools
import subprocess
import threading
from typing import Any

import numpy as np

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.cluster.control.launchers import WorkerError, WorkerLost
from tvmpipe.cluster.worker import StageSpec, StageWorker
from tvmpipe.app.oracle import reference_outputs
from tvmpipe.executor import random_inputs

_PORTS: set[int] = set()  # every data-plane port a pipeline in this session listened on


def record_ports(pipe) -> None:
    """Remember the workers' and driver's listening ports, to check later that they were closed."""
    _PORTS.update(port for _, port in pipe.addresses)


def opened_ports() -> set[int]:
    return set(_PORTS)


def listening_ports() -> set[int]:
    """Local ports of every listening TCP socket on this machine (/proc/net/tcp{,6}; state 0A)."""
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def tcp_sockets(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every TCP socket the processes hold, from `ss -tanp`."""
    import re
    import subprocess

    out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((pid, cols[3]))
    return found


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): field 3
    (state) first, so field N of proc(5) is at index N - 3. OSError if the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def niceness(pid: int) -> int:
    return int(stat_fields(pid)[16])


def mapped_file(addr: int) -> str | None:
    """The file this process's /proc/self/maps says the page at `addr` maps, or None (anonymous)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5] if len(parts) > 5 and parts[5].startswith("/") else None
    return None


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, except multiprocessing's resource tracker (started by the
    first `spawn`, it lives as long as this process and is not something a test started)."""
    import os

    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(stat_fields(int(d))[1])
            except OSError:
                continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - out
        out |= frontier
    return {p for p in out if alive(p) and "multiprocessing.resource_tracker" not in cmdline(p)}


def local_run(stages: int, underway) -> subprocess.Popen:
    """`tvmpipe run --stages N --local` for a long while, returned once `underway(command lines of
    its processes)` holds (mid-run); fails if the run ends or 180 s pass first. The caller stops it."""
    import sys
    import time

    driver = subprocess.Popen([sys.executable, "-m", "tvmpipe", "run", "--stages", str(stages), "--local",
                               "-n", "20000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    try:
        while not underway([cmdline(p) for p in descendants(driver.pid)]):
            assert driver.poll() is None and time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
    except BaseException:
        driver.kill()
        driver.wait()
        raise
    return driver


def batches(bundle, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    from tvmpipe.bundle import load_bundle

    b = load_bundle(bundle)
    return [random_inputs(b, seed=seed + i) for i in range(n)]


@functools.lru_cache(maxsize=None)
def case(bundle, n: int) -> tuple[list[dict[str, np.ndarray]], list[list[np.ndarray]]]:
    """`n` seeded micro-batches for `bundle` and their single-process outputs (reference backend),
    computed once per session."""
    inputs = batches(bundle, n)
    return inputs, reference_outputs(bundle, inputs)


def assert_bit_identical(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w), f"micro-batch {i}"
        for k, (a, b) in enumerate(zip(g, w)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"micro-batch {i} output {k}"
            assert a.tobytes() == b.tobytes(), f"micro-batch {i} output {k} differs"


def run_killing(pipe, inputs: list, at: int, stage: int, before_kill=None) -> list:
    """Submit `inputs` to `pipe` in order, SIGKILL stage `stage`'s process right after submitting
    micro-batch `at` (`before_kill()` runs just before), and collect every output, in order."""
    got = []
    for i, x in enumerate(inputs):
        pipe.submit(x)
        if i == at:
            if before_kill is not None:
                before_kill()
            pipe.launcher.kill(stage)
        while pipe.ready:
            got.append(pipe.get())
    return got + list(pipe.results())


class FlakyWorker(StageWorker):
    """A worker whose stage raises on chosen micro-batches: `fail[(stage, seq)]` = how many times."""

    fail: dict[tuple[int, int], int] = {}
    lock = threading.Lock()

    def __init__(self, spec: StageSpec, bundle_files=None):
        super().__init__(spec, bundle_files)
        run = self.stage.run

        def flaky_run(feed, device=None):
            key = (spec.index, self._busy[0] if self._busy else -1)
            with FlakyWorker.lock:
                left = FlakyWorker.fail.get(key, 0)
                if left:
                    FlakyWorker.fail[key] = left - 1
            if left:
                raise RuntimeError(f"injected failure at micro-batch {key[1]}")
            return run(feed, device=device)

        self.stage.run = flaky_run


class ThreadLauncher:
    """Stage workers as objects in this process: the driver's logic without process start-up, and
    with faults injectable from the test. `kill` closes a worker the way a crash looks from outside
    (its sockets close) and makes every later call fail as WorkerLost."""

    def __init__(self, worker_cls: type = StageWorker):
        self.worker_cls = worker_cls
        self.workers: list[Any] = []
        self.specs: list[StageSpec] = []

    def start(self, specs: list[StageSpec]) -> list[tuple[str, int]]:
        self.specs = list(specs)
        self.workers = [self.worker_cls(s) for s in specs]
        return [w.address() for w in self.workers]

    def restart(self, stage: int) -> tuple[str, int]:
        self.kill(stage)
        self.workers[stage] = self.worker_cls(self.specs[stage])
        return self.workers[stage].address()

    def call(self, stage: int, method: str, *args: Any) -> Any:
        w = self.workers[stage]
        if w is None:
            raise WorkerLost(stage, "killed")
        try:
            return getattr(w, method)(*args)
        except TvmpipeError as exc:
            raise WorkerError(stage, str(exc)) from None

    def call_all(self, method: str, args: list[tuple] | None = None) -> list[Any]:
        out = []
        for i, a in enumerate(args or [()] * len(self.workers)):
            try:
                out.append(self.call(i, method, *a))
            except WorkerError as exc:
                out.append(exc)
        return out

    def kill(self, stage: int) -> None:
        if self.workers[stage] is not None:
            self.workers[stage].close()
            self.workers[stage] = None

    def shutdown(self) -> None:
        for i in range(len(self.workers)):
            self.kill(i)

