"""Transport and worker edges: a bad peer loses its connection and nothing else."""

from __future__ import annotations

import queue
import socket
import threading
import time

import numpy as np
import pytest

from tvmpipe.bundle import load_bundle
from tvmpipe.cluster.wire import frames, handshake, stream
from tvmpipe.cluster.wire.frames import Frame, FrameError, FrameLimits
from tvmpipe.cluster.topology import build_topology
from tvmpipe.cluster.wire.handshake import greet
from tvmpipe.cluster.wire.tcp import Link, Listener, Peer, PolledListener
from tvmpipe.cluster.worker import StageSpec, StageWorker, Wiring
from tvmpipe.partition import plan_equal_ops


SECRET = b"k" * 32  # the run's data-plane secret in these tests
LISTENERS = pytest.mark.parametrize("kind", [Listener, PolledListener], ids=["threaded", "polled"])


class Recorder:
    """Collects a listener's callbacks, with the thread each ran on."""

    def __init__(self, accept=lambda peer: FrameLimits(), kind=Listener):
        self.events: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.accept = accept
        self.kind = kind

    def _on_frame(self, p, f):
        self.threads.append(threading.current_thread())
        self.events.put(("frame", p, f))

    def listener(self):
        return self.kind("127.0.0.1", self.accept, self._on_frame, lambda p, e: self.events.put(("close", p, e)),
                         secret=SECRET)

    def next(self):
        return self.events.get(timeout=10)


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:  # closed with our unread bytes in its buffer
        return True


def raw_peer(addr, stage=0, epoch=0, secret=SECRET) -> socket.socket:
    """A producer that has said its authenticated hello."""
    s = socket.create_connection(addr)
    greet(s, secret, Frame("hello", "run", epoch, 0, stage), 10)
    return s


@LISTENERS
def test_a_garbage_peer_is_dropped_and_others_keep_flowing(kind):
    rec = Recorder(kind=kind)
    lst = rec.listener()
    try:
        good = Link(lst.address, Frame("hello", "run", 0, 0, 1), SECRET, on_error=lambda e: None)
        bad = raw_peer(lst.address, stage=2)
        bad.sendall(b"TVPF\xff\xff\xff\x7fgarbage")
        kind, peer, err = rec.next()
        assert (kind, peer.stage) == ("close", 2) and isinstance(err, FrameError)
        for seq in range(3):
            good.put(Frame("data", "run", 0, seq, 1, {4: np.full(3, seq, np.float32)}))
        got = [rec.next() for _ in range(3)]
        assert [f.seq for _, _, f in got] == [0, 1, 2] and all(p.stage == 1 for _, p, _ in got)
        good.close()
        assert rec.next() == ("close", Peer(1, "run", 0), None)
    finally:
        lst.close()


@LISTENERS
def test_hello_refused_and_protocol_violations_close_the_connection(kind):
    def accept(peer):
        if peer.epoch != 3:
            raise FrameError("wrong epoch")
        return FrameLimits(max_payload_bytes=64)

    rec = Recorder(accept, kind)
    lst = rec.listener()
    try:
        with pytest.raises(ConnectionError, match="refused"):  # closed without a callback (never a peer)
            raw_peer(lst.address, epoch=1)
        assert rec.events.empty()
        for bad in (Frame("hello", "run", 3, 0, 0), Frame("data", "run", 3, 0, 5),
                    Frame("data", "run", 3, 0, 0, {1: np.zeros(100, np.float32)})):
            s = raw_peer(lst.address, epoch=3)
            stream.send(s, bad)
            kind, peer, err = rec.next()
            assert kind == "close" and isinstance(err, FrameError), err
            assert closed_by_peer(s)
            s.close()
    finally:
        lst.close()


def test_polled_listener_reads_on_the_pumping_thread():
    """The thread waiting in pump() gets the frames itself (no hand-off), in order, including a
    frame that arrived in the same segment as the hello (buffered: the socket never turns readable
    for it again)."""
    rec = Recorder(kind=PolledListener)
    lst = rec.listener()
    enc = frames.Encoder()

    def later(fn):  # runs while the main thread is already pumping
        threading.Timer(0.05, fn).start()

    try:
        s = socket.create_connection(lst.address)
        nonce = s.recv(handshake.CHALLENGE.size)[4:]
        mac = handshake.hello_mac(SECRET, nonce, "run", 0, 0, 1)
        later(lambda: s.sendall(frames.to_bytes(Frame("hello", "run", 0, 0, 1, mac=mac)) +
                                frames.to_bytes(Frame("data", "run", 0, 0, 1, {2: np.arange(4, dtype=np.int64)}))))
        t = time.monotonic()
        lst.pump(lambda: rec.events.qsize() >= 1, timeout=10)
        assert s.recv(len(handshake.ADMITTED)) == handshake.ADMITTED  # else our close would be a reset
        assert rec.threads == [threading.current_thread()] and time.monotonic() - t < 5
        kind, peer, frame = rec.next()
        assert (kind, peer.stage, frame.seq) == ("frame", 1, 0)
        np.testing.assert_array_equal(frame.tensors[2], np.arange(4))
        later(lambda: [stream.send(s, Frame("data", "run", 0, seq, 1, {2: np.full(4, seq, np.int64)}), enc)
                       for seq in range(1, 4)])
        lst.pump(lambda: rec.events.qsize() >= 3, timeout=10)
        assert [rec.next()[2].seq for _ in range(3)] == [1, 2, 3]
        assert set(rec.threads) == {threading.current_thread()}
        # nobody pumps: the background reader delivers, after the grace period
        stream.send(s, Frame("data", "run", 0, 4, 1, {2: np.zeros(4, np.int64)}), enc)
        assert rec.next()[2].seq == 4 and rec.threads[-1] is not threading.current_thread()
        s.close()
        assert rec.next() == ("close", Peer(1, "run", 0), None)
    finally:
        lst.close()


def test_polled_listener_two_pumpers_each_return_on_their_own_condition():
    """A producer waiting in submit() and a consumer in get() pump at once: the one whose condition
    a frame satisfies returns at once, although the other holds the reader role."""
    rec = Recorder(kind=PolledListener)
    lst = rec.listener()
    s = raw_peer(lst.address, stage=0)
    done = {}

    def pump(name, n):
        lst.pump(lambda: len(rec.threads) >= n, timeout=20)
        done[name] = time.monotonic()

    try:
        long = threading.Thread(target=pump, args=("long", 3))
        long.start()
        time.sleep(0.1)  # it holds the role, waiting in select
        short = threading.Thread(target=pump, args=("short", 1))
        short.start()
        time.sleep(0.1)
        sent = time.monotonic()
        stream.send(s, Frame("data", "run", 0, 0, 0))
        short.join(timeout=5)
        assert "short" in done and done["short"] - sent < 2 and "long" not in done
        for seq in (1, 2):
            stream.send(s, Frame("data", "run", 0, seq, 0))
        long.join(timeout=5)
        assert "long" in done and [rec.next()[2].seq for _ in range(3)] == [0, 1, 2]
    finally:
        s.close()
        lst.close()


def test_polled_listener_pump_times_out_and_close_releases_a_pumper():
    rec = Recorder(kind=PolledListener)
    lst = rec.listener()
    s = raw_peer(lst.address, stage=0)
    t = time.monotonic()
    lst.pump(lambda: False, timeout=0.2)
    assert 0.15 < time.monotonic() - t < 5
    pumper = threading.Thread(target=lst.pump, args=(lambda: False, 60.0))
    pumper.start()
    time.sleep(0.1)
    t = time.monotonic()
    lst.close()
    pumper.join(timeout=10)
    assert not pumper.is_alive() and time.monotonic() - t < 10
    assert rec.next() == ("close", Peer(0, "run", 0), None)  # closed by us: not the peer's fault
    assert closed_by_peer(s)
    s.close()


def test_polled_listener_drop_connections_waits_for_their_close():
    rec = Recorder(kind=PolledListener)
    lst = rec.listener()
    try:
        peers = [raw_peer(lst.address, stage=i) for i in range(3)]
        for p in peers:  # once each has delivered a frame, each is a registered connection
            stream.send(p, Frame("data", "run", 0, 0, peers.index(p)))
        assert [rec.next()[0] for _ in peers] == ["frame"] * 3
        lst.drop_connections()
        closes = [rec.events.get_nowait() for _ in range(3)]  # all reported before it returned
        assert sorted(p.stage for _, p, _ in closes) == [0, 1, 2] and all(e is None for *_, e in closes)
        assert all(closed_by_peer(p) for p in peers)
        # still listening: a new epoch's peer is served
        s = raw_peer(lst.address, stage=5, epoch=1)
        stream.send(s, Frame("data", "run", 1, 0, 5))
        t = time.monotonic()
        lst.pump(lambda: not rec.events.empty(), timeout=10)
        assert time.monotonic() - t < 5  # returned on the frame, not on the timeout
        assert rec.next()[1] == Peer(5, "run", 1)
        for p in [*peers, s]:
            p.close()
    finally:
        lst.close()


def test_polled_listener_owner_refusing_a_frame_closes_only_that_connection():
    def on_frame(peer, frame):
        if frame.seq == 1:
            raise FrameError("seq 1 is unwelcome")
        events.put(("frame", peer.stage, frame.seq))

    events: queue.Queue = queue.Queue()
    lst = PolledListener("127.0.0.1", lambda p: FrameLimits(), on_frame, lambda p, e: events.put(("close", p.stage, e)),
                         secret=SECRET)
    try:
        a, b = raw_peer(lst.address, stage=0), raw_peer(lst.address, stage=1)
        for seq in (0, 1):
            stream.send(a, Frame("data", "run", 0, seq, 0))
        kind, stage, err = [events.get(timeout=10) for _ in range(2)][1]
        assert (kind, stage) == ("close", 0) and "unwelcome" in str(err)
        stream.send(b, Frame("data", "run", 0, 1 - 1, 1))
        assert events.get(timeout=10) == ("frame", 1, 0)
        a.close()
        b.close()
    finally:
        lst.close()


def test_polled_listener_survives_an_owner_callback_that_raises(capsys):
    """A bug in the owner's on_close must not stop the reader: with a threaded Listener it costs one
    connection's thread; here every connection shares the reader, so it is printed and reading goes on."""
    events: queue.Queue = queue.Queue()

    def on_close(peer, error):
        events.put(("close", peer.stage))
        raise RuntimeError("owner bug")

    lst = PolledListener("127.0.0.1", lambda p: FrameLimits(), lambda p, f: events.put(("frame", p.stage, f.seq)),
                         on_close, secret=SECRET)
    try:
        a, b = raw_peer(lst.address, stage=0), raw_peer(lst.address, stage=1)
        stream.send(a, Frame("data", "run", 0, 0, 0))
        assert events.get(timeout=10) == ("frame", 0, 0)
        a.close()
        assert events.get(timeout=10) == ("close", 0)
        stream.send(b, Frame("data", "run", 0, 0, 1))
        assert events.get(timeout=10) == ("frame", 1, 0)
        b.close()
    finally:
        lst.close()
    assert "owner bug" in capsys.readouterr().err


def test_worker_rejects_a_bad_frame_and_reports_it(bundles):
    """A producer sending the wrong shape: the worker drops that connection, tells the driver, and
    keeps its listener (a later wiring works)."""
    b = load_bundle(bundles["tiny"])
    plan = plan_equal_ops(b.graph, 2)
    topo = build_topology(b, plan)
    (start, end) = plan.stages[1]
    worker = StageWorker(StageSpec(1, start, end, str(b.path)))
    rec = Recorder()
    driver = rec.listener()
    try:
        inbound = {e.src: e.entries for e in topo.inbound(1)}
        outbound = [(e, driver.address) for e in topo.outbound(1)]
        worker.prepare(Wiring("run", 0, 0, inbound, outbound, secret=SECRET))
        worker.connect()
        (src, entries), = inbound.items()
        s = raw_peer(worker.address(), stage=src)
        stream.send(s, Frame("data", "run", 0, 0, src, {entries[0]: np.zeros(3, np.int32)}))
        kind, peer, frame = rec.next()
        assert kind == "frame" and frame.kind == "error" and "expected" in frame.error and peer.stage == 1
        assert closed_by_peer(s)
        assert worker.status().peer_errors
        # re-wired under a new epoch, the same worker computes correctly
        worker.prepare(Wiring("run", 1, 0, inbound, outbound, secret=SECRET))
        worker.connect()
        s2 = raw_peer(worker.address(), stage=src, epoch=1)
        spec = topo.specs[entries[0]]
        x = np.arange(3, dtype=np.float32).reshape(spec.shape)
        stream.send(s2, Frame("data", "run", 1, 0, src, {entries[0]: x}))
        while True:
            kind, peer, frame = rec.next()
            if kind == "frame" and frame.kind == "data":
                break
        np.testing.assert_array_equal(list(frame.tensors.values())[0], x.reshape(-1) * 2)
        s.close()
        s2.close()
    finally:
        worker.close()
        driver.close()


def test_a_bfloat16_tensor_crosses_a_tcp_link_and_a_frame_the_codec_refuses_kills_only_the_link(monkeypatch):
    """bf16 checkpoints' boundary tensors go stage to stage over TCP like any other dtype (the codec's
    memoryview cast refused bfloat16: "cannot include dtype 'E' in a buffer"); and a frame the sender
    cannot encode, whatever the error, ends its link with one on_error report instead of killing the
    sender thread with the link left busy (what made that run hang rather than fail)."""
    import ml_dtypes

    rec = Recorder()
    listener = rec.listener()
    errors: queue.Queue = queue.Queue()
    try:
        link = Link(listener.address, Frame("hello", "run", 0, 0, 0), SECRET, errors.put, inline_bytes=0)
        half = (np.arange(4096, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16).reshape(64, 64)
        link.put(Frame("data", "run", 0, 0, 0, {3: half}, {3: "hidden"}))  # queued: the sender thread sends it
        kind, _, got = rec.next()
        assert kind == "frame" and got.tensors[3].dtype == half.dtype and np.array_equal(got.tensors[3], half)
        encode = frames.Encoder.encode

        def refuse(self, frame):
            if frame.seq == 1:
                raise ValueError("cannot include dtype 'E' in a buffer")
            return encode(self, frame)

        monkeypatch.setattr(frames.Encoder, "encode", refuse)
        link.put(Frame("data", "run", 0, 1, 0, {3: half}, {3: "hidden"}))
        assert "cannot include dtype" in str(errors.get(timeout=10))
        link.put(Frame("data", "run", 0, 2, 0, {3: half}, {3: "hidden"}))  # dropped: the link is dead
        assert link.counts(wait_s=2) == (link.bytes_sent, 1) and errors.empty()
        link.close(flush=False)
    finally:
        listener.close()
