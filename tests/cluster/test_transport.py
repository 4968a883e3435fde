"""Transport and worker edges: a bad peer loses its connection and nothing else."""

from __future__ import annotations

import queue
import socket

import numpy as np

from tvmpipe.bundle import load_bundle
from tvmpipe.cluster import frames
from tvmpipe.cluster.frames import Frame, FrameError, FrameLimits
from tvmpipe.cluster.topology import build_topology
from tvmpipe.cluster.transport import Link, Listener, Peer
from tvmpipe.cluster.worker import StageSpec, StageWorker, Wiring
from tvmpipe.partition import plan_equal_ops


class Recorder:
    def __init__(self, accept=lambda peer: FrameLimits()):
        self.events: queue.Queue = queue.Queue()
        self.accept = accept

    def listener(self) -> Listener:
        return Listener("127.0.0.1", self.accept, lambda p, f: self.events.put(("frame", p, f)),
                        lambda p, e: self.events.put(("close", p, e)))

    def next(self):
        return self.events.get(timeout=10)


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:  # closed with our unread bytes in its buffer
        return True


def raw_peer(addr, stage=0, epoch=0) -> socket.socket:
    s = socket.create_connection(addr)
    frames.send(s, Frame("hello", "run", epoch, 0, stage))
    return s


def test_a_garbage_peer_is_dropped_and_others_keep_flowing():
    rec = Recorder()
    lst = rec.listener()
    try:
        good = Link(lst.address, Frame("hello", "run", 0, 0, 1), on_error=lambda e: None)
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


def test_hello_refused_and_protocol_violations_close_the_connection():
    def accept(peer):
        if peer.epoch != 3:
            raise FrameError("wrong epoch")
        return FrameLimits(max_payload_bytes=64)

    rec = Recorder(accept)
    lst = rec.listener()
    try:
        s = raw_peer(lst.address, epoch=1)
        assert closed_by_peer(s)  # refused: closed without a callback (it never became a peer)
        s.close()
        for bad in (Frame("hello", "run", 3, 0, 0), Frame("data", "run", 3, 0, 5),
                    Frame("data", "run", 3, 0, 0, {1: np.zeros(100, np.float32)})):
            s = raw_peer(lst.address, epoch=3)
            frames.send(s, bad)
            kind, peer, err = rec.next()
            assert kind == "close" and isinstance(err, FrameError), err
            assert closed_by_peer(s)
            s.close()
    finally:
        lst.close()


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
        worker.prepare(Wiring("run", 0, 0, inbound, outbound))
        worker.connect()
        (src, entries), = inbound.items()
        s = raw_peer(worker.address(), stage=src)
        frames.send(s, Frame("data", "run", 0, 0, src, {entries[0]: np.zeros(3, np.int32)}))
        kind, peer, frame = rec.next()
        assert kind == "frame" and frame.kind == "error" and "expected" in frame.error and peer.stage == 1
        assert closed_by_peer(s)
        assert worker.status()["peer_errors"]
        # re-wired under a new epoch, the same worker computes correctly
        worker.prepare(Wiring("run", 1, 0, inbound, outbound))
        worker.connect()
        s2 = raw_peer(worker.address(), stage=src, epoch=1)
        spec = topo.specs[entries[0]]
        x = np.arange(3, dtype=np.float32).reshape(spec.shape)
        frames.send(s2, Frame("data", "run", 1, 0, src, {entries[0]: x}))
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
