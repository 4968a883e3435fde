"""Shared-memory rings (cluster/wire/shm.py): the same-node path of an edge, checked like the TCP one."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time

import numpy as np
import pytest

from tvmpipe.cluster.wire import shm
from tvmpipe.cluster.wire.frames import Frame, FrameError, FrameLimits
from tvmpipe.cluster.wire.handshake import greet
from tvmpipe.cluster.wire.tcp import Link, Listener, PolledListener

SECRET = b"k" * 32
LISTENERS = pytest.mark.parametrize("kind", [Listener, PolledListener], ids=["threaded", "polled"])
LIMITS = FrameLimits.exact([(4, "float32", (1024,)), (5, "int8", (3,))])


def segments(run: str) -> list[str]:
    return shm.segment_names(run)


class Sink:
    """A listener whose frames land in a queue; frames are released when the test says."""

    def __init__(self, kind=Listener, limits=LIMITS, retains=False):
        self.events: queue.Queue = queue.Queue()
        self.listener = kind("127.0.0.1", lambda peer: limits, lambda p, f: self.events.put(("frame", f)),
                             lambda p, e: self.events.put(("close", e)), retains_frames=retains, secret=SECRET)

    def next(self, timeout=10):
        return self.events.get(timeout=timeout)


def frame(seq: int, run="shmtest", epoch=0) -> Frame:
    return Frame("data", run, epoch, seq, 1, {4: np.arange(1024, dtype=np.float32) + seq,
                                              5: np.array([seq, 2, 3], np.int8)})


def test_nodes_compare_by_ray_id_when_both_have_one_else_by_host():
    a, b = shm.Node("boot1", "rayA"), shm.Node("boot1", "rayB")
    assert not a.same(b)  # two Ray nodes on one kernel (the multi-host bed): different nodes
    assert a.same(shm.Node("boot1", None)) and shm.Node("boot1").same(shm.Node("boot1"))
    assert not shm.Node("boot1").same(shm.Node("boot2"))
    here = shm.node_identity()
    assert here.host and here.same(shm.node_identity())


def test_choose_takes_shm_only_on_one_node():
    assert shm.choose("auto", False, 1 << 30) == "tcp"
    assert shm.choose("shm", False, 1 << 30) == "tcp"
    assert shm.choose("tcp", True, 1 << 30) == "tcp"
    assert shm.choose("shm", True, 16) == "shm"
    assert shm.choose("auto", True, 16) == "tcp" and shm.choose("auto", True, shm.AUTO_MIN_BYTES) == "shm"
    with pytest.raises(ValueError):
        shm.choose("udp", True, 1)


@LISTENERS
@pytest.mark.parametrize("retains", [False, True], ids=["in-place", "copied"])
def test_frames_cross_a_ring_in_order_and_the_name_is_gone(kind, retains):
    sink = Sink(kind, retains=retains)
    run = "shmtest"
    try:
        link = Link(sink.listener.address, Frame("hello", run, 0, 0, 1), SECRET, lambda e: None, ring_slots=2,
                    frame_bytes=8192)
        assert link.path == "shm" and segments(run) == [link._ring.name]
        st = os.stat(link._ring.path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
        got = []
        for seq in range(6):  # 3x the slots: every slot is reused only after its release
            link.put(frame(seq))
            kind_, f = sink.next()
            assert kind_ == "frame" and f.kind == "data"
            np.testing.assert_array_equal(f.tensors[4], np.arange(1024, dtype=np.float32) + seq)
            assert f.tensors[5].tolist() == [seq, 2, 3]
            assert (f.release is None) == retains
            if f.release:
                f.release()
            got.append(f.seq)
            assert segments(run) == []  # the consumer unlinked it once mapped
        assert got == list(range(6))
        assert link.bytes_sent > 6 * 4096
        link.close()
        assert sink.next() == ("close", None)
    finally:
        sink.listener.close()
    assert segments(run) == []


def test_an_unreleased_slot_holds_the_producer_back():
    sink = Sink()
    try:
        link = Link(sink.listener.address, Frame("hello", "shmtest", 0, 0, 1), SECRET, lambda e: None, ring_slots=2,
                    frame_bytes=8192)
        link.put(frame(0))
        link.put(frame(1))
        f0, f1 = sink.next()[1], sink.next()[1]
        third = threading.Thread(target=link.put, args=(frame(2),))
        third.start()
        time.sleep(0.2)
        assert third.is_alive() and sink.events.empty()  # both slots held: no overwrite of frame 0
        assert f0.tensors[4][0] == 0
        f0.release()
        third.join(5)
        assert not third.is_alive()
        assert sink.next()[1].seq == 2
        assert f1.tensors[4][0] == 1  # slot 1 untouched
        link.close(flush=False)
    finally:
        sink.listener.close()


def _liar(addr, run="shmtest"):
    """A run's peer (it holds the secret) with a real ring, that sends notifications by hand."""
    ring = shm.RingWriter(run, 0, 2, 8192)
    s = socket.create_connection(addr)
    greet(s, SECRET, Frame("hello", run, 0, 0, 1), 10)
    return ring, s


@pytest.mark.parametrize("slot, why", [
    (lambda r: (r.name, shm.HEADER_BYTES + 4096, 4160), "is not the next slot's"),
    (lambda r: (r.name, r.geometry.size - 64, 4160), "is not the next slot's"),
    (lambda r: (r.name, shm.HEADER_BYTES, 1 << 40), "does not fit"),
    (lambda r: (r.name, shm.HEADER_BYTES, 64), "does not fit"),
    (lambda r: ("tvmpipe-otherrun-0-" + "0" * 32, shm.HEADER_BYTES, 4160), "is not a segment of run shmtest"),
    (lambda r: ("../../etc/passwd", shm.HEADER_BYTES, 4160), "is not a segment of run"),
])
def test_a_lying_notification_gets_a_one_line_refusal(slot, why):
    from tvmpipe.cluster.wire.frames import _pack_notification

    sink = Sink()
    ring, s = _liar(sink.listener.address)
    try:
        note = frame(0)
        note.kind, note.slot = "shm", slot(ring)
        s.sendall(_pack_notification(note))
        kind, err = sink.next()
        assert kind == "close" and isinstance(err, FrameError) and why in str(err) and "\n" not in str(err)
    finally:
        s.close()
        ring.close()
        sink.listener.close()


def test_a_ring_too_small_for_the_layout_is_refused():
    sink = Sink()
    ring = shm.RingWriter("shmtest", 0, 2, 64)
    s = socket.create_connection(sink.listener.address)
    greet(s, SECRET, Frame("hello", "shmtest", 0, 0, 1), 10)
    try:
        note = frame(0)
        note.kind, note.slot = "shm", (ring.name, shm.HEADER_BYTES, 4160)
        os.truncate(ring.path, shm.HEADER_BYTES + 64)  # a peer shrinking its segment under the geometry
        from tvmpipe.cluster.wire.frames import _pack_notification

        s.sendall(_pack_notification(note))
        kind, err = sink.next()
        assert kind == "close" and "bad geometry" in str(err)
    finally:
        s.close()
        ring.close()
        sink.listener.close()


def test_a_notification_without_shared_memory_is_refused():
    """A run id that cannot name a segment: its connections take no notifications at all."""
    sink = Sink()
    s = socket.create_connection(sink.listener.address)
    greet(s, SECRET, Frame("hello", "not-a-shm-run", 0, 0, 1), 10)
    try:
        from tvmpipe.cluster.wire.frames import _pack_notification

        note = frame(0, run="not-a-shm-run")
        note.kind, note.slot = "shm", ("tvmpipe-x-0-" + "0" * 32, shm.HEADER_BYTES, 4160)
        s.sendall(_pack_notification(note))
        kind, err = sink.next()
        assert kind == "close" and "takes no shared memory" in str(err)
    finally:
        s.close()
        sink.listener.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another uid")
def test_another_user_cannot_open_a_runs_segment():
    """Mode 0600 and the owner keep other uids out (root itself is not: it is kept out by the
    name's 128 random bits and by the consumer unlinking the name at its first frame)."""
    ring = shm.RingWriter("shmtest", 0, 2, 4096)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become nobody, try to open and map it
            os.close(r)
            try:
                os.setgid(65534)
                os.setuid(65534)
                try:
                    fd = os.open(ring.path, os.O_RDONLY)
                    os.write(w, b"opened")
                    os.close(fd)
                except PermissionError:
                    os.write(w, b"refused")
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        assert os.read(r, 100) == b"refused"
        os.close(r)
    finally:
        ring.close()
    assert not os.path.exists(ring.path)


def test_sweep_removes_only_older_epochs_of_the_run():
    a, b = shm.RingWriter("shmtest", 0, 2, 64), shm.RingWriter("shmtest", 1, 2, 64)
    c = shm.RingWriter("other", 0, 2, 64)
    try:
        assert shm.sweep("shmtest", below_epoch=1) == 1
        assert sorted(segments("shmtest")) == [b.name] and segments("other") == [c.name]
        assert shm.sweep("shmtest") == 1 and segments("shmtest") == []
    finally:
        for r in (a, b, c):
            r.close()
    assert segments("other") == []


# ---- pipelines ---------------------------------------------------------------------------------------

from tests.support.pipeline_harness import assert_bit_identical, case, run_killing  # noqa: E402

from tvmpipe.cluster.control.launchers import Timeouts  # noqa: E402
from tvmpipe.cluster.driver import Pipeline  # noqa: E402


def data_edges(pipe: Pipeline) -> set[tuple[int, int]]:
    return {(e.src, e.dst) for e in pipe.topology.edges if e.carries_data}


@pytest.mark.parametrize("model,k", [("mlp", 2), ("mlp", 3), ("cnn", 2), ("cnn", 3), ("skipnet", 3)])
def test_shm_and_tcp_give_byte_identical_outputs(bundles, model, k):
    """Every data edge of a process pipeline on one host takes the path forced, and the outputs of
    both paths are byte for byte those of a single process (skipnet: a stage reading from two
    producers, and skip edges past a stage)."""
    inputs, want = case(bundles[model], 10)
    got = {}
    for transport in ("tcp", "shm"):
        with Pipeline(bundles[model], k, launcher="process", transport=transport) as pipe:
            got[transport] = pipe.run(inputs)
            paths = pipe.edge_paths()
            assert set(paths) == data_edges(pipe) and set(paths.values()) == {transport}, paths
            run = pipe.run_id
        assert segments(run) == []
    assert_bit_identical(got["tcp"], want)
    assert_bit_identical(got["shm"], want)


def test_auto_takes_shm_for_large_frames_only(bundles):
    with Pipeline(bundles["cnn"], 3, launcher="process", transport="auto") as pipe:
        pipe.run(case(bundles["cnn"], 2)[0])
        paths = pipe.edge_paths()
        for e in pipe.topology.edges:
            if e.carries_data:
                assert paths[(e.src, e.dst)] == shm.choose("auto", True, pipe._edge_payload(e)), (e, paths)


def test_a_stage_killed_mid_run_leaves_no_segment_and_the_run_recovers(bundles):
    """cnn in 3 stage processes on shared memory, stage 1 SIGKILLed while frames stream: every
    output once, equal to a clean run; no segment of the run is left in /dev/shm, during the run
    (consumers unlink at open) or after it."""
    inputs, want = case(bundles["cnn"], 80)
    with Pipeline(bundles["cnn"], 3, launcher="process", window=6, transport="shm",
                  timeouts=Timeouts(progress=20)) as pipe:
        run = pipe.run_id
        got = run_killing(pipe, inputs, at=30, stage=1)
        assert pipe.restarts == [0, 1, 0]
        assert set(pipe.edge_paths().values()) == {"shm"}
        assert segments(run) == []
    assert segments(run) == []
    assert_bit_identical(got, want)


def test_the_reaper_unlinks_the_segments_a_killed_run_had_mapped(tmp_path):
    """A run's process SIGKILLed between creating a ring and its consumer opening it: the name
    would stay in /dev/shm. The reaper finds it in the process's maps and unlinks it."""
    import subprocess
    import sys

    from tvmpipe.cluster.control import reaper

    home = str(tmp_path / "tvp-home-test")
    os.makedirs(home)
    code = ("import sys, time; from tvmpipe.cluster.wire import shm; r = shm.RingWriter('reapertest', 0, 2, 4096); "
            "print(r.name, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             env={**os.environ, "HOME": home, "PYTHONPATH": os.getcwd()}, cwd=os.getcwd())
    try:
        name = child.stdout.readline().decode().strip()
        assert segments("reapertest") == [name]
        killed = reaper.sweep(home, str(tmp_path / "tvp-ray-none"), [], spare=os.getpid(), budget_s=3)
        assert child.pid in killed
        assert segments("reapertest") == []
    finally:
        child.kill()
        child.wait()
        shm.sweep("reapertest")


def test_a_stage_killed_while_8_mb_frames_stream_through_rings(tmp_path):
    """Frames of 8 MB (the producer's copy into a slot takes milliseconds, so the SIGKILL lands
    while slots are being written and read): the run recovers with every output once, in order,
    and no segment of the run is left in /dev/shm."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from cluster_bench import chain_bundle, op_profile

    from tvmpipe.bundle import load_bundle

    b = load_bundle(chain_bundle(tmp_path / "big", [16, 2 << 20, 2 << 20, 16]))
    x = {"x": np.arange(16, dtype=np.float32)}
    with Pipeline(b, 3, launcher="process", backend="simulated", backend_opts={"cost_profile": op_profile(b, 2000.0)},
                  window=4, transport="shm", warmup=0, timeouts=Timeouts(progress=20)) as pipe:
        run = pipe.run_id
        assert set(pipe.edge_paths().values()) == {"shm"}
        got = run_killing(pipe, [x] * 40, at=15, stage=1)
        assert pipe.restarts == [0, 1, 0]
        assert set(pipe.edge_paths().values()) == {"shm"}
    assert len(got) == 40 and all(o[0].shape == (16,) for o in got)
    assert segments(run) == []
