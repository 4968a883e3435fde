"""The fake driver's CUDA IPC (tests/fakecuda/pycuda/driver.py, "CUDA IPC"): two real processes
exchange device bytes through handles, and each IPC rule is enforced: handles only for cuMemAlloc
memory (base pointers), opened only in another process, closed by the importer before the exporter
frees, and no read of opened memory before a wait on the producer's event after its last write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.fake_cuda import FAKE_ROOT

PEER = Path(__file__).resolve().parents[1] / "support" / "ipc_peer.py"


class Peer:
    """The importing process."""

    def __init__(self, tmp_path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_ROOT), os.environ.get("PYTHONPATH", "")]),
                   FAKE_PYCUDA_IPC_DIR=os.environ["FAKE_PYCUDA_IPC_DIR"], FAKE_PYCUDA_IPC_WAIT_S="5")
        self.p = subprocess.Popen([sys.executable, str(PEER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)

    def __call__(self, code: str):
        self.p.stdin.write(json.dumps(code) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def ok(self, code: str):
        out = self(code)
        assert "ok" in out, out["err"]
        return out["ok"]

    def close(self):
        self.p.stdin.close()
        self.p.wait(10)


@pytest.fixture
def drv(fake_cuda, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PYCUDA_IPC_DIR", str(tmp_path / "ipc"))
    monkeypatch.setattr(fake_cuda, "IPC_DIR", str(tmp_path / "ipc"))
    fake_cuda.init()
    ctx = fake_cuda.Device(0).retain_primary_context()
    ctx.push()
    yield fake_cuda
    fake_cuda.Context.pop()


@pytest.fixture
def peer(drv, tmp_path):
    p = Peer(tmp_path)
    yield p
    p.close()


def exported(drv, data: np.ndarray):
    """A cuMemAlloc buffer holding `data`, its handle, and an interprocess event recorded after the write."""
    s = drv.Stream()
    buf = drv.mem_alloc(data.nbytes)
    h = drv.mem_get_ipc_handle(buf)
    drv.memcpy_htod(int(buf), data)
    ev = drv.Event(drv.event_flags.INTERPROCESS | drv.event_flags.DISABLE_TIMING)
    ev.record(s)
    s.synchronize()
    return s, buf, h, ev


def test_bytes_cross_processes_after_the_event(drv, peer):
    data = np.arange(1000, dtype=np.float32)
    s, buf, h, ev = exported(drv, data)
    assert isinstance(h, bytearray) and len(h) == 64
    peer.ok(f"m = drv.IPCMemoryHandle(bytearray.fromhex('{h.hex()}')); e = drv.Event.from_ipc_handle(bytearray.fromhex('{ev.ipc_handle().hex()}'))")
    got = peer.ok("mine = drv.mem_alloc(4000); s.wait_for_event(e); "
                  "drv.memcpy_dtod_async(int(mine), int(m), 4000, s); s.synchronize(); "
                  "out = np.empty(1000, np.float32); drv.memcpy_dtoh(out, int(mine)); result = out.tobytes().hex()")
    assert bytearray.fromhex(got) == data.tobytes()
    peer.ok("m.close()")
    buf.free()
    assert not drv.violations


def test_read_before_the_event_is_flagged(drv, peer):
    s, buf, h, ev = exported(drv, np.ones(64, np.uint8))
    peer.ok(f"m = drv.IPCMemoryHandle(bytearray.fromhex('{h.hex()}')); mine = drv.mem_alloc(64)")
    err = peer("drv.memcpy_dtod_async(int(mine), int(m), 64, s); s.synchronize()")["err"]
    assert err.startswith("RuleViolation: cuMemcpyDtoDAsync reads IPC-opened memory") and "before waiting" in err
    peer.ok("m.close()")
    buf.free()


def test_a_write_after_the_record_is_not_covered(drv, peer):
    """The producer reuses the buffer (writes after the record the consumer waits for): flagged."""
    s, buf, h, ev = exported(drv, np.ones(64, np.uint8))
    peer.ok(f"m = drv.IPCMemoryHandle(bytearray.fromhex('{h.hex()}')); e = drv.Event.from_ipc_handle(bytearray.fromhex('{ev.ipc_handle().hex()}')); mine = drv.mem_alloc(64)")
    peer.ok("s.wait_for_event(e)")  # waits for the record made so far
    drv.memcpy_htod_async(int(buf), drv.pagelocked_empty(64, np.uint8), s)
    s.synchronize()
    err = peer("drv.memcpy_dtod_async(int(mine), int(m), 64, s); s.synchronize()")["err"]
    assert "RuleViolation" in err and "before waiting" in err
    peer.ok("m.close()")
    buf.free()


def test_free_before_the_importer_closes_is_flagged(drv, peer):
    s, buf, h, ev = exported(drv, np.ones(16, np.uint8))
    peer.ok(f"m = drv.IPCMemoryHandle(bytearray.fromhex('{h.hex()}'))")
    with pytest.raises(drv.RuleViolation, match="freed while 1 other process"):
        buf.free()
    drv.violations.clear()
    peer.ok("m.close()")
    assert "err" in peer("m.close()")
    buf.free()  # now allowed
    assert "no longer exists" in peer(f"drv.IPCMemoryHandle(bytearray.fromhex('{h.hex()}'))")["err"]


def test_handles_only_for_cumemalloc_base_pointers(drv, peer):
    with pytest.raises(drv.LogicError, match=r"^cuIpcGetMemHandle failed: invalid argument - host memory"):
        drv.mem_get_ipc_handle(drv.pagelocked_empty(16, np.uint8))
    buf = drv.mem_alloc(256)
    with pytest.raises(drv.LogicError, match="inside the allocation .* base pointers only"):
        drv.mem_get_ipc_handle(int(buf) + 64)
    with pytest.raises(drv.LogicError, match="not a cuMemAlloc allocation"):
        drv.mem_get_ipc_handle(0x1234)
    h = drv.mem_get_ipc_handle(buf)
    assert "cannot be exported again" in peer(f"m = drv.IPCMemoryHandle(bytearray.fromhex('{h.hex()}')); "
                                              "drv.mem_get_ipc_handle(int(m))")["err"]
    peer.ok("m.close()")
    buf.free()


def test_opening_in_the_exporting_process_is_refused(drv):
    buf = drv.mem_alloc(64)
    h = drv.mem_get_ipc_handle(buf)
    with pytest.raises(drv.LogicError, match=r"^cuIpcOpenMemHandle failed: invalid device context - .*process that exported"):
        drv.IPCMemoryHandle(h)
    ev = drv.Event(drv.event_flags.INTERPROCESS | drv.event_flags.DISABLE_TIMING)
    with pytest.raises(drv.LogicError, match=r"^cuIpcOpenEventHandle failed: invalid device context"):
        drv.Event.from_ipc_handle(ev.ipc_handle())
    buf.free()


def test_interprocess_events_need_disable_timing(drv):
    with pytest.raises(drv.LogicError, match="must also be DISABLE_TIMING"):
        drv.Event(drv.event_flags.INTERPROCESS)
    with pytest.raises(drv.LogicError, match="not created with event_flags.INTERPROCESS"):
        drv.Event().ipc_handle()


def test_handles_are_taken_only_as_bytearray(drv, peer):
    """PyCUDA 2026.1 (src/cpp/cuda.hpp) returns handles as bytearray and refuses any other type when
    opening one, with the event routine's name for both kinds; a handle that crossed msgpack is bytes.
    The first GPU run failed here while the fake accepted bytes."""
    buf = drv.mem_alloc(64)
    h = drv.mem_get_ipc_handle(buf)
    ev = drv.Event(drv.event_flags.INTERPROCESS | drv.event_flags.DISABLE_TIMING)
    assert type(h) is bytearray and type(ev.ipc_handle()) is bytearray
    for code in (f"drv.IPCMemoryHandle(bytes.fromhex('{h.hex()}'))",
                 f"drv.Event.from_ipc_handle(bytes.fromhex('{ev.ipc_handle().hex()}'))"):
        assert peer(code)["err"].endswith("event_from_ipc_handle failed: invalid argument - argument is not a bytes array")
    peer.ok(f"m = drv.IPCMemoryHandle(bytearray.fromhex('{h.hex()}')); m.close()")
    buf.free()


def test_an_event_dropped_where_its_context_cannot_be_activated_leaks_with_a_warning(drv, recwarn):
    """PyCUDA's ~event activates the event's context; from another thread without it current that
    fails, and the event leaks with a UserWarning (seen on the H100 from cudaipc's close)."""
    import threading

    box = [drv.Event(drv.event_flags.INTERPROCESS | drv.event_flags.DISABLE_TIMING), drv.Event()]
    del box[1]  # its own thread, context current: destroyed
    assert not [w for w in recwarn if "could not be cleaned up" in str(w.message)]
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    assert [str(w.message) for w in recwarn] == ["event in out-of-thread context could not be cleaned up"]
