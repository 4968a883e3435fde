"""The data plane under attack (issue 14): a local process that knows the run id (it travels in
clear), a stage that misbehaves, and a stage that stalls. Each test reproduces one attack or fault
on a real pipeline (in-process workers, real sockets) and checks the run's outputs stay exact."""

from __future__ import annotations

import re
import socket
import threading
import time

import numpy as np
import pytest
from tests.support.pipeline_harness import ThreadLauncher, assert_bit_identical, case

from tvmpipe.cluster.wire import frames, handshake, stream
from tvmpipe.cluster.driver import Pipeline, PipelineError
from tvmpipe.cluster.wire.frames import DRIVER, Frame
from tvmpipe.cluster.control.launchers import Timeouts
from tvmpipe.cluster.worker import StageWorker


def refusals(caplog, port: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"refused 127.0.0.1:{port}:" in r.getMessage()]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def head_output(pipe: Pipeline) -> tuple[int, int, np.ndarray]:
    """(stage, entry, a forged value) of a graph output: what an attacker would send the driver."""
    edge = next(e for e in pipe.topology.inbound(DRIVER) if e.entries)
    entry = edge.entries[0]
    spec = pipe.topology.specs[entry]
    return edge.src, entry, np.full(spec.shape, 42.0, dtype=spec.dtype)


def impostor(address, run: str, stage: int, epoch: int = 0) -> socket.socket:
    """A connection claiming to be `stage` of run `run` with the hello the run id alone allows
    (the protocol before authentication)."""
    s = socket.create_connection(address)
    stream.send(s, Frame("hello", run, epoch, 0, stage))
    return s


class HeldWorker(StageWorker):
    """Stage 1 holds micro-batch 1 until the test releases it, so an attack lands mid-run."""

    release = threading.Event()

    def _run(self, seq, parts):
        if self.index == 1 and seq == 1:
            HeldWorker.release.wait(30)
        super()._run(seq, parts)


def test_an_impostor_with_the_run_id_cannot_forge_outputs_or_force_restarts(bundles, caplog):
    """The run id travels in clear. With it, a local process used to open a second "stage 1" to
    the driver, have it return a forged output (all 42.0) for an in-flight micro-batch, crash its
    receive path with one it never submitted, and get a healthy stage restarted by sending garbage.
    Now each connection is refused at its hello (logged with its address) and nothing changes."""
    inputs, want = case(bundles["tiny"], 6)
    HeldWorker.release.clear()
    with Pipeline(bundles["tiny"], 2, launcher=ThreadLauncher(HeldWorker), window=4,
                  timeouts=Timeouts(progress=20)) as pipe:
        for x in inputs[:3]:
            pipe.submit(x)
        got = [pipe.get(timeout=10)]
        stage, entry, forged = head_output(pipe)
        driver = pipe.addresses[-1]
        attacks = []
        for seq in (1, 31):  # in flight, and never submitted
            s = impostor(driver, pipe.run_id, stage)
            stream.send(s, Frame("data", pipe.run_id, 0, seq, stage, {entry: forged}))
            attacks.append(s)
        for _ in range(4):  # garbage under a healthy stage's name: each used to cost it a restart
            s = impostor(driver, pipe.run_id, 0)
            s.sendall(b"TVPF\xff\xff\xff\x7fgarbage")
            attacks.append(s)
        ports = [s.getsockname()[1] for s in attacks]
        wait_for(lambda: all(refusals(caplog, p) for p in ports))
        HeldWorker.release.set()
        for x in inputs[3:]:
            pipe.submit(x)
        got += list(pipe.results())
        assert pipe.restarts == [0, 0] and pipe.errors == []
    assert_bit_identical(got, want)
    assert all("failed authentication" in refusals(caplog, p)[0] for p in ports)
    for s in attacks:
        s.close()


def test_a_second_connection_for_a_connected_producer_is_refused(bundles, caplog):
    """A producer's identity is bound to the connection it authenticated: even with the secret, a
    duplicate "stage 1" to the driver or "driver" to stage 0 is refused, and the run is unharmed."""
    inputs, want = case(bundles["tiny"], 4)
    with Pipeline(bundles["tiny"], 2, launcher=ThreadLauncher(), window=2) as pipe:
        got = [pipe.run(inputs[:2])]
        stage, entry, forged = head_output(pipe)
        ports = []
        for address, claim in ((pipe.addresses[-1], stage), (pipe.addresses[0], DRIVER)):
            s = socket.create_connection(address)
            ports.append(s.getsockname()[1])
            with pytest.raises(ConnectionError, match="refused"):  # closed instead of admitted
                handshake.greet(s, pipe._secret, Frame("hello", pipe.run_id, 0, 0, claim), 10)
            s.close()
        wait_for(lambda: all(refusals(caplog, p) for p in ports))
        assert "already connected" in refusals(caplog, ports[0])[0]
        assert "already connected" in refusals(caplog, ports[1])[0]
        got.append(pipe.run(inputs[2:]))
        assert pipe.restarts == [0, 0]
    assert_bit_identical(got[0] + got[1], want)


class ShiftingWorker(StageWorker):
    """Once, sends its outputs of micro-batch 2 labelled as micro-batch 31 (a stage gone wrong)."""

    shifted = False

    def connect(self):
        super().connect()
        for link, _, _ in self._data_links:
            put = link.put

            def shifted_put(frame, put=put):
                if frame.seq == 2 and frame.stage == 1 and not ShiftingWorker.shifted:
                    ShiftingWorker.shifted = True
                    frame = Frame(frame.kind, frame.run, frame.epoch, 31, frame.stage, frame.tensors, frame.names)
                put(frame)

            link.put = shifted_put


def test_outputs_of_a_micro_batch_never_submitted_are_rejected_not_a_crash(bundles, caplog):
    """`KeyError: 31` in the driver's receive path used to follow; now the frame is refused with
    the stage named and logged, the stage is restarted, and micro-batch 2 replays."""
    inputs, want = case(bundles["tiny"], 6)
    ShiftingWorker.shifted = False
    with Pipeline(bundles["tiny"], 2, launcher=ThreadLauncher(ShiftingWorker), window=4,
                  timeouts=Timeouts(progress=5)) as pipe:
        got = pipe.run(inputs)
        assert pipe.restarts == [0, 1]
        assert any("micro-batch 31, which was never submitted" in e for e in pipe.errors)
    assert_bit_identical(got, want)
    assert any("dropped stage 1" in r.getMessage() and "never submitted" in r.getMessage() for r in caplog.records)


class PausedWorker(StageWorker):
    """Stage 1 stops taking micro-batch 3 in (not computing: like a process stopped while idle)
    until the driver has asked every worker for its status, or for good (`forever`: until it is
    stopped; first instance only, so a restarted stage 1 works)."""

    forever = False
    paused = 0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked = threading.Event()
        self.stopped = threading.Event()
        self.hold = self.index == 1 and PausedWorker.paused == 0
        if self.hold:
            PausedWorker.paused += 1

    def status(self):
        self.asked.set()
        return super().status()

    def stop(self):
        if self._running:  # a rewire (not the first prepare) releases the receiving thread
            self.stopped.set()
        super().stop()

    def _on_frame(self, peer, frame):
        if self.hold and frame.seq == 3:
            self.hold = False
            (self.stopped if PausedWorker.forever else self.asked).wait(30)
            time.sleep(0.1)
        super()._on_frame(peer, frame)


@pytest.mark.parametrize("forever", [False, True], ids=["clears", "never-clears"])
def test_a_stall_is_checked_again_and_fails_only_with_a_stage_named(bundles, forever):
    """A stall nobody is at fault for (no stage dead, failed or computing) used to end the run with
    "pipeline stalled". Now the driver looks again: one that clears by itself costs nothing; one
    that does not restarts the stage furthest behind (stage 1, waiting at micro-batch 3)."""
    inputs, want = case(bundles["tiny"], 8)
    PausedWorker.forever, PausedWorker.paused = forever, 0
    with Pipeline(bundles["tiny"], 2, launcher=ThreadLauncher(PausedWorker), window=3,
                  timeouts=Timeouts(progress=0.5)) as pipe:
        got = pipe.run(inputs)
        assert pipe.restarts == ([0, 1] if forever else [0, 0]), pipe.errors
        if forever:
            assert re.match(r"stage 1 \(host [^)]+\): waits at micro-batch 3", pipe.errors[0]), pipe.errors
    assert_bit_identical(got, want)


def test_a_stall_that_never_clears_ends_the_run_naming_the_stage(bundles):
    inputs, _ = case(bundles["tiny"], 8)
    PausedWorker.forever, PausedWorker.paused = True, 0
    with Pipeline(bundles["tiny"], 2, launcher=ThreadLauncher(PausedWorker), window=3, max_restarts=0,
                  timeouts=Timeouts(progress=0.5)) as pipe:
        with pytest.raises(PipelineError, match="stage 1 failed 1 times.*waits at micro-batch 3") as info:
            pipe.run(inputs)
    assert info.value.stage == 1 and len(info.value.completed) == 3


def test_frames_layout_is_checked_before_the_payload_exists():
    """A data frame whose tensors differ from what its edge was wired for is refused from its
    header: the payload buffer is never allocated (not even the planned size)."""
    limits = frames.FrameLimits.exact([(4, "float32", (2, 3))])
    allocated = []
    for tensors in ({4: np.zeros((3, 2), np.float32)}, {4: np.zeros((2, 3), np.int32)},
                    {5: np.zeros((2, 3), np.float32)}, {}):
        a, b = socket.socketpair()
        stream.send(a, Frame("data", "r", 0, 0, 1, tensors))
        reader = stream.FrameReader(b, limits, alloc=lambda n: allocated.append(n) or np.empty(n, np.uint8))
        with pytest.raises(frames.FrameError, match="expected"):
            reader.read()
        a.close()
        b.close()
    assert allocated == []
