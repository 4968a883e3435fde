"""The handshake and the gate (cluster/wire/handshake.py): only a producer holding the run's secret gets
in, a hello costs a few hundred bytes and no thread, slow and excess connections are cut off, and
every refusal is logged with the peer's address."""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import threading
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tvmpipe.cluster.wire import frames, handshake, stream
from tvmpipe.cluster.wire.frames import Frame, FrameError, FrameLimits
from tvmpipe.cluster.wire.handshake import Gate, greet
from tvmpipe.cluster.wire.tcp import Link, Listener, PolledListener

SECRET = b"s" * 32
SMALL = 32 << 10  # what an unauthenticated connection may cost the listener, at most (bytes)


def closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


class GateUnderTest:
    """A Gate whose owner admits stage 0 of run "run", epoch 0, and records who got in."""

    def __init__(self, **kw):
        self.admitted: queue.Queue = queue.Queue()
        self.gate = Gate("127.0.0.1", lambda: SECRET, self.accept, self.admit, **kw)
        self.gate.start()

    @staticmethod
    def accept(peer):
        if (peer.stage, peer.run, peer.epoch) != (0, "run", 0):
            raise FrameError(f"stage {peer.stage} is not a producer here")
        return FrameLimits()

    def admit(self, conn, peer, limits):
        self.admitted.put(peer)
        conn.close()

    def challenge(self) -> tuple[socket.socket, bytes]:
        s = socket.create_connection(self.gate.address)
        s.settimeout(10)
        got = b""
        while len(got) < handshake.CHALLENGE.size:
            got += s.recv(handshake.CHALLENGE.size - len(got))
        magic, nonce = handshake.CHALLENGE.unpack(got)
        assert magic == handshake.CHALLENGE_MAGIC
        return s, nonce


@pytest.fixture(scope="module")
def gate():
    g = GateUnderTest(hello_deadline_s=2.0)
    yield g
    g.gate.close()


def hello_bytes(nonce: bytes, secret: bytes = SECRET, stage: int = 0, run: str = "run", epoch: int = 0) -> bytes:
    mac = handshake.hello_mac(secret, nonce, run, epoch, 0, stage)
    return frames.to_bytes(Frame("hello", run, epoch, 0, stage, mac=mac))


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("append"), st.integers(1, 64), st.just(0)),
    st.tuples(st.sampled_from(["other secret", "replayed", "other stage", "other epoch", "no mac"]),
              st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MUTATIONS)
def test_fuzz_the_authenticated_hello(gate, mutation):
    """A valid hello with one thing changed: a flipped byte anywhere, a truncation, a MAC made
    with another secret or for another connection's nonce (a replay), a valid MAC for a stage or
    epoch the owner refuses, no MAC. It gets in only if its bytes are the valid hello's."""
    while not gate.admitted.empty():
        gate.admitted.get()
    s, nonce = gate.challenge()
    good = hello_bytes(nonce)
    kind, n, value = mutation
    data = {
        "flip": lambda: good[:n % len(good)] + bytes([good[n % len(good)] ^ value]) + good[n % len(good) + 1:],
        "truncate": lambda: good[:n % len(good)],
        "append": lambda: good + os.urandom(n),
        "other secret": lambda: hello_bytes(nonce, secret=b"t" * 32),
        "replayed": lambda: hello_bytes(os.urandom(16)),
        "other stage": lambda: hello_bytes(nonce, stage=1),
        "other epoch": lambda: hello_bytes(nonce, epoch=1),
        "no mac": lambda: frames.to_bytes(Frame("hello", "run", 0, 0, 0)),
    }[kind]()
    refused = gate.gate.refused
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    except OSError:  # already admitted (and closed by the owner) or refused
        pass
    assert closed_by_peer(s)  # admitted or refused, the gate never leaves it hanging
    s.close()
    should = data[:len(good)] == good
    assert (not gate.admitted.empty()) == should, (kind, data)
    if not should:
        wait_for(lambda: gate.gate.refused > refused)
    assert gate.gate.pending == 0


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


HUGE = st.sampled_from([0, 1, 7, 1 << 20, 1 << 30, (1 << 32) - 1])
DTYPE = st.sampled_from(["float32", "int64", "uint8", "float64", "bool"])
META = st.tuples(st.sampled_from([4, 7, 9]), DTYPE, st.lists(HUGE, max_size=3))


def header_doc(kind: str, tensors: list, **kw) -> dict:
    doc = {"v": frames.FORMAT_VERSION, "kind": kind, "run": "run", "epoch": 0, "seq": 0, "stage": 0,
           "tensors": [[e, "t", dt, shape, min(int(np.prod(shape, dtype=object)) * frames.itemsize(dt), (1 << 64) - 1)]
                       for e, dt, shape in tensors], "error": None}
    if kind == "hello":
        doc["mac"] = kw.get("mac", "0" * 64)
    return doc


def packed(doc: dict, hlen: int | None = None) -> bytes:
    body = msgpack.packb(doc)
    return frames.PREFIX.pack(frames.MAGIC, len(body) if hlen is None else hlen) + body


def _gate_host(conn) -> None:
    """A process holding only a gate (and this loop), so tracemalloc sees nothing but what the
    gate allocates for its peers; the test's own process may run Ray's threads."""
    tracemalloc.start()
    g = GateUnderTest(hello_deadline_s=2.0)
    conn.send(g.gate.address)
    base = 0
    while True:
        cmd = conn.recv()
        if cmd == "reset":
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            conn.send(g.gate.refused)
        elif cmd == "peak":
            conn.send((tracemalloc.get_traced_memory()[1] - base, g.gate.refused, g.admitted.qsize()))
        else:
            g.gate.close()
            return


@pytest.fixture(scope="module")
def gate_host():
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_gate_host, args=(there,), daemon=True)
    proc.start()
    assert here.poll(60)
    address = here.recv()
    yield here, address
    here.send("stop")
    proc.join(10)
    if proc.is_alive():
        proc.kill()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["hello", "data", "error"]), st.lists(META, max_size=4), st.none() | HUGE,
       st.binary(max_size=512))
def test_no_unauthenticated_frame_allocates_more_than_a_small_bound(gate_host, kind, tensors, hlen, tail):
    """Whatever an unauthenticated peer sends first (a hello or data frame claiming GiB tensors, a
    prefix announcing a 4 GiB header, random bytes), the listener allocates less than SMALL for it
    (tracemalloc in the listener's own process) and refuses it. (Before the gate, a 96-byte header
    claiming 1 GiB cost the driver 1 GiB.)"""
    control, address = gate_host
    control.send("reset")
    refused = control.recv()
    s = socket.create_connection(address)
    data = packed(header_doc(kind, tensors), hlen) + tail
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    except OSError:  # refused while we were still sending
        pass
    assert closed_by_peer(s)
    s.close()
    deadline = time.monotonic() + 10
    while True:
        control.send("peak")
        peak, now_refused, admitted = control.recv()
        if now_refused > refused or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    assert now_refused == refused + 1 and admitted == 0
    assert peak < SMALL, peak


PLANNED = [(4, "float32", (2, 3)), (7, "int64", (5,))]
PLANNED_LIMITS = FrameLimits.exact(PLANNED)
PLANNED_BYTES = frames.payload_bytes([24, 40])


@settings(max_examples=300, deadline=None)
@given(st.lists(META, max_size=4), st.booleans())
def test_no_frame_from_a_mismatched_peer_allocates(tensors, shuffle):
    """An authenticated producer whose data frame differs in any way from what its edge was wired
    for (entries, dtypes, shapes, GiB claims) gets no payload buffer at all; one that matches gets
    exactly the planned size. Measured at the allocation point (tracemalloc would also count this
    process's other threads: Ray's, in a full test session)."""
    if shuffle:  # the planned tensors themselves, in the other order, some of the time
        tensors = PLANNED[::-1] if not tensors else tensors
    a, b = socket.socketpair()
    allocs: list[int] = []
    doc = header_doc("data", tensors)
    matches = sorted((e, np.dtype(dt).name, tuple(s)) for e, dt, s in tensors) == sorted(PLANNED) and \
        len({e for e, _, _ in tensors}) == len(tensors)
    size = frames.payload_bytes([m[4] for m in doc["tensors"]]) if matches else 0
    a.sendall(packed(doc) + bytes(size))
    a.close()
    reader = stream.FrameReader(b, PLANNED_LIMITS, alloc=lambda n: allocs.append(n) or np.empty(n, np.uint8))
    result: list = []

    def read():
        try:
            result.append(reader.read())
        except FrameError as exc:
            result.append(exc)

    read()
    b.close()
    if matches:
        assert isinstance(result[0], Frame) and allocs == [size] and size <= PLANNED_BYTES + 64
    else:
        assert isinstance(result[0], FrameError) and allocs == [], (tensors, result)


@pytest.mark.parametrize("kind", [Listener, PolledListener], ids=["threaded", "polled"])
def test_slow_and_excess_connections_are_cut_off_and_logged(kind, monkeypatch, caplog):
    """200 slow connections used to cost a thread and a descriptor each, for as long as they
    trickled. Now at most MAX_PENDING wait for their hello, on the gate's one thread, for at most
    HELLO_DEADLINE_S; the rest are closed at once; each refusal is logged with the peer's address;
    and a real producer still gets in."""
    monkeypatch.setattr(handshake, "MAX_PENDING", 4)
    monkeypatch.setattr(handshake, "HELLO_DEADLINE_S", 1.0)
    got: queue.Queue = queue.Queue()
    lst = kind("127.0.0.1", lambda p: FrameLimits(), lambda p, f: got.put(f.seq), lambda p, e: None, secret=SECRET)
    try:
        threads = threading.active_count()
        slow = [socket.create_connection(lst.address) for _ in range(12)]
        t0 = time.monotonic()
        for s in slow:
            s.sendall(b"T")  # a slowloris: the first byte of a prefix, and then nothing for long
        wait_for(lambda: lst._gate.refused >= 8, timeout=5)
        assert threading.active_count() == threads
        assert lst._gate.pending == 4
        wait_for(lambda: lst._gate.refused == 12, timeout=10)
        assert time.monotonic() - t0 < 8
        assert all(closed_by_peer(s, 2) for s in slow)
        ports = {s.getsockname()[1] for s in slow}
        logged = {int(m.split("refused 127.0.0.1:")[1].split(":")[0]): m for m in
                  (r.getMessage() for r in caplog.records) if "refused 127.0.0.1:" in m}
        assert set(logged) == ports
        reasons = sorted("in progress" in m or "no complete hello within 1 s" in m for m in logged.values())
        assert all(reasons)
        link = Link(lst.address, Frame("hello", "run", 0, 0, 1), SECRET, lambda e: None)
        link.put(Frame("data", "run", 0, 0, 1))
        if kind is PolledListener:
            lst.pump(lambda: not got.empty(), 10)
        assert got.get(timeout=10) == 0
        link.close()
        for s in slow:
            s.close()
    finally:
        lst.close()


def test_a_producer_without_the_secret_cannot_connect():
    lst = Listener("127.0.0.1", lambda p: FrameLimits(), lambda p, f: None, lambda p, e: None, secret=SECRET)
    try:
        s = socket.create_connection(lst.address)
        with pytest.raises(ConnectionError, match="refused"):
            greet(s, b"x" * 32, Frame("hello", "run", 0, 0, 1), 10)
        s.close()
        t = time.monotonic()
        with pytest.raises(OSError):  # a Link with the wrong secret: refused until its connect timeout
            Link(lst.address, Frame("hello", "run", 0, 0, 1), b"x" * 32, lambda e: None, connect_timeout_s=0.5)
        assert time.monotonic() - t < 5
    finally:
        lst.close()
