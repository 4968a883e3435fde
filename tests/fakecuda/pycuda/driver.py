"""Fake `pycuda.driver` (PyCUDA 2026.1 names and signatures) over a simulated CUDA driver.

Rules enforced, each as the real stack reports it (PyCUDA's message "<routine> failed: <CUDA error
string>[ - <detail>]", and its exception class for the code), or, where real CUDA would silently
compute garbage, as a `RuleViolation` naming the rule:
  * contexts: a per-thread context stack; a call on a thread with no current context fails;
    `Context.pop()` pops whatever is on top; a thread that exits with contexts pushed aborts the
    process in PyCUDA (here: `RuleViolation` recorded in `violations`, checked by the tests);
  * stream ordering: async copies, launches and event records run when the stream is synchronized
    (a synchronous copy drains every stream first, as the legacy default stream does); reading a
    page-locked buffer with a device-to-host copy pending, or writing one with a host-to-device copy
    pending, is a RuleViolation (pending D2H targets are also poisoned with 0xFF);
  * allocations: zero-byte allocations, copies or kernel operands outside one live allocation,
    freeing twice, using freed memory;
  * kernels: argument buffer size against the kernel's parameter table, block size against
    `__launch_bounds__` (and 1024), static + dynamic shared memory against 48 KiB unless the kernel
    opted in with MAX_DYNAMIC_SHARED_SIZE_BYTES, and against the device's opt-in limit;
  * graph capture (through the fake libcuda.so.1 that ctypes loads): no synchronous call while a
    stream captures; a violated capture is invalidated; destroyed graphs cannot be used;
  * CUDA IPC (`mem_get_ipc_handle`, `IPCMemoryHandle`, interprocess `Event`s, see "CUDA IPC" below):
    handles only for the base pointer of a live cuMemAlloc allocation; opened only in another
    process; the importer closes before the exporter frees; nothing reads opened memory before a
    wait on the producer's event that covers the producer's last write to it. Exported allocations
    and interprocess events live in files (FAKE_PYCUDA_IPC_DIR), so two processes really share them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import mmap
import os
import secrets
import struct
import tempfile
import time
import threading
import warnings
import weakref

import numpy as np

from pycuda.kernels import ModuleInfo, decode, read_fake_cubin

# ---- errors ---------------------------------------------------------------------------------------
ERRORS = {1: "invalid argument", 2: "out of memory", 3: "initialization error", 201: "invalid device context",
          400: "invalid resource handle", 600: "device not ready", 700: "an illegal memory access was encountered",
          701: "too many resources requested for launch", 900: "operation not permitted when stream is capturing",
          901: "operation failed due to a previous error during capture", 100: "no CUDA-capable device is detected"}


class Error(Exception):
    pass


class LogicError(Error):
    pass


class LaunchError(Error):
    pass


class MemoryError(Error):  # noqa: A001 - PyCUDA's name
    pass


class RuntimeError(Error):  # noqa: A001 - PyCUDA's name
    pass


class RuleViolation(AssertionError):
    """A use real CUDA would not report (it would compute garbage or abort the process)."""


violations: list[str] = []


def _violation(msg: str) -> None:
    violations.append(msg)
    raise RuleViolation(msg)


def _fail(routine: str, code: int, detail: str | None = None):
    msg = f"{routine} failed: {ERRORS[code]}" + (f" - {detail}" if detail else "")
    cls = {2: MemoryError, 100: RuntimeError, 600: RuntimeError, 701: LaunchError}.get(code, LogicError)
    raise cls(msg)  # PyCUDA's translate_cuda_error picks the class by code


# ---- enums --------------------------------------------------------------------------------------
class function_attribute:  # noqa: N801
    MAX_THREADS_PER_BLOCK = 0
    SHARED_SIZE_BYTES = 1
    MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class event_flags:  # noqa: N801
    DEFAULT = 0
    BLOCKING_SYNC = 1
    DISABLE_TIMING = 2
    INTERPROCESS = 4


class ipc_mem_flags:  # noqa: N801
    LAZY_ENABLE_PEER_ACCESS = 1


class device_attribute:  # noqa: N801
    MAX_SHARED_MEMORY_PER_BLOCK = 8
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


DEFAULT_SMEM = 48 * 1024
OPTIN_SMEM = 227 * 1024
CC = tuple(int(x) for x in os.environ.get("FAKE_PYCUDA_CC", "9.0").split("."))

# ---- the simulated driver state -----------------------------------------------------------------
_state = {"init": False}
_tls = threading.local()
_lock = threading.RLock()
_next_addr = [0x7F0000000000]


def init(flags: int = 0) -> None:
    _state["init"] = True


def _stack() -> list:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
        _watch_thread_exit(s)
    return s


def _watch_thread_exit(stack: list) -> None:
    """PyCUDA aborts the process when a thread's context stack is not empty at thread exit."""
    t = threading.current_thread()
    if t is threading.main_thread():
        return

    class _Sentinel:
        pass

    sentinel = _Sentinel()
    _tls.sentinel = sentinel  # dies with the thread's locals
    name = t.name
    weakref.finalize(sentinel, lambda: stack and violations.append(
        f"thread {name} exited with {len(stack)} context(s) pushed (PyCUDA aborts the process)"))


def _ctx(routine: str) -> "_Primary":
    if not _state["init"]:
        _fail(routine, 3)
    s = _stack()
    if not s:
        _fail(routine, 201)
    return s[-1].prim


def _acquire() -> "_Primary":
    """PyCUDA's context_dependent objects take the current context when constructed."""
    if not _stack():
        _fail("explicit_context_dependent", 201, "no currently active context?")
    return _stack()[-1].prim


class _Primary:
    """One device's primary context in this process: memory, streams, the sticky error."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.allocs: dict[int, np.ndarray] = {}
        self.exported: dict[int, "_Shared"] = {}  # base -> its shared file (mem_get_ipc_handle)
        self.imported: dict[int, "_Shared"] = {}  # address -> what it maps (IPCMemoryHandle)
        self.streams: "weakref.WeakSet[Stream]" = weakref.WeakSet()
        self.sticky: str | None = None
        self.clock = 0.0  # ms, advanced by every executed operation

    def memory(self, ptr: int, nbytes: int, routine: str) -> np.ndarray:
        for base, buf in self.allocs.items():
            if base <= ptr and ptr + nbytes <= base + buf.size:
                return buf[ptr - base:ptr - base + nbytes]
        _fail(routine, 1, f"[{ptr:#x}, +{nbytes}) is not inside one live allocation")

    def span(self, ptr: int, routine: str) -> int:
        """Bytes from `ptr` to the end of the live allocation holding it."""
        for base, buf in self.allocs.items():
            if base <= ptr < base + buf.size:
                return base + buf.size - ptr
        _fail(routine, 1, f"{ptr:#x} is not inside a live allocation")

    def drain(self) -> None:
        for s in list(self.streams):
            s._run()


_primaries: dict[int, _Primary] = {}


class Device:
    def __init__(self, ordinal: int):
        if not _state["init"]:
            _fail("cuDeviceGet", 3)
        if not 0 <= ordinal < Device.count():
            _fail("cuDeviceGet", 1)
        self.ordinal = ordinal

    @staticmethod
    def count() -> int:
        if not _state["init"]:
            _fail("cuDeviceGetCount", 3)
        return int(os.environ.get("FAKE_PYCUDA_DEVICES", "1"))

    def compute_capability(self) -> tuple[int, int]:
        return CC

    def name(self) -> str:
        return "Fake GPU (tvmpipe tests)"

    def get_attribute(self, attr: int) -> int:
        return {device_attribute.MAX_SHARED_MEMORY_PER_BLOCK: DEFAULT_SMEM,
                device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: OPTIN_SMEM}[attr]

    def retain_primary_context(self) -> "Context":
        with _lock:
            prim = _primaries.setdefault(self.ordinal, _Primary(self.ordinal))
        return Context(prim)


class Context:
    """A PyCUDA context wrapper; several wrappers may share one primary context."""

    def __init__(self, prim: _Primary):
        self.prim = prim
        self.handle = id(prim)
        self.thread = threading.get_ident()  # PyCUDA may re-activate a context only in this thread

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Context) and other.prim is self.prim

    def __hash__(self) -> int:
        return self.handle

    def push(self) -> None:
        _stack().append(self)

    @staticmethod
    def pop() -> None:
        s = _stack()
        if not s:
            _fail("context::pop", 201, "cannot pop non-current context")
        s.pop()

    @staticmethod
    def get_current() -> "Context | None":
        s = _stack()
        return s[-1] if s else None

    @staticmethod
    def synchronize() -> None:
        prim = _ctx("cuCtxSynchronize")
        _no_capture("cuCtxSynchronize", prim)
        prim.drain()
        _raise_sticky("cuCtxSynchronize", prim)


def _raise_sticky(routine: str, prim: _Primary) -> None:
    if prim.sticky:
        _fail(routine, 700, prim.sticky)


def _no_capture(routine: str, prim: _Primary) -> None:
    """No synchronous call while this thread captures (thread-local capture mode)."""
    for s in list(prim.streams):
        if s._capture is not None and s._capture_thread == threading.get_ident():
            s._capture_bad = f"{routine} during capture"
            _fail(routine, 900)


# ---- memory -------------------------------------------------------------------------------------
class DeviceAllocation:
    def __init__(self, prim: _Primary, ptr: int):
        self.prim, self.ptr, self.valid = prim, ptr, True

    def __int__(self) -> int:
        return self.ptr

    __index__ = __int__

    def free(self) -> None:
        if not self.valid:
            _fail("device_allocation::free", 400)
        s = _stack()
        if not s or s[-1].prim is not self.prim:
            raise LogicError("cannot activate out-of-thread context")  # scoped_context_activation
        shared = self.prim.exported.get(self.ptr)
        if shared is not None and shared.opens() > 0:
            _violation(f"device allocation {self.ptr:#x} freed while {shared.opens()} other process(es) hold it "
                       "open through an IPC handle (the importer must close it first)")
        self.valid = False
        del self.prim.allocs[self.ptr]
        if shared is not None:
            del self.prim.exported[self.ptr]
            shared.unlink()


def mem_get_info() -> tuple[int, int]:
    """(free, total) device bytes, as cuMemGetInfo: needs a current context; `total` is
    FAKE_PYCUDA_MEMORY_GIB (default 80) and every live cuMemAlloc allocation in this process is used."""
    _ctx("cuMemGetInfo")
    total = int(float(os.environ.get("FAKE_PYCUDA_MEMORY_GIB", "80")) * (1 << 30))
    with _lock:
        used = sum(buf.size for prim in _primaries.values() for buf in prim.allocs.values())
    return total - used, total


def mem_alloc(nbytes: int) -> DeviceAllocation:
    prim = _ctx("cuMemAlloc")
    _no_capture("cuMemAlloc", prim)
    if nbytes <= 0:
        _fail("cuMemAlloc", 1)
    if nbytes > mem_get_info()[0]:
        _fail("cuMemAlloc", 2)  # CUDA_ERROR_OUT_OF_MEMORY
    with _lock:  # 1 MiB-aligned, with a gap after each, so neighbours never touch
        ptr = _next_addr[0]
        _next_addr[0] += ((nbytes >> 20) + 2) << 20
    prim.allocs[ptr] = np.full(nbytes, 0xA5, np.uint8)  # not zeros: reading unwritten memory shows
    return DeviceAllocation(prim, ptr)


class _Block:
    def __init__(self):
        self.pending_in = 0  # H2D copies not yet run that read this buffer
        self.pending_out = 0  # D2H copies not yet run that write it


class PinnedArray(np.ndarray):
    """A page-locked host buffer: host access is checked against the copies pending on it."""

    def __array_finalize__(self, obj):
        self._block = getattr(obj, "_block", None)

    def _host_access(self, write: bool, how: str) -> None:
        b = self._block
        if b is None:
            return
        if b.pending_out:
            _violation(f"page-locked buffer {how} while a device-to-host copy into it is pending "
                       "(synchronize the stream first)")
        if write and b.pending_in:
            _violation(f"page-locked buffer {how} while a host-to-device copy from it is pending "
                       "(pinned-buffer reuse before the stream is synchronized)")

    def __array_function__(self, func, types, args, kwargs):
        writes = func.__name__ in ("copyto", "put", "place", "fill") and args and args[0] is self
        self._host_access(writes, f"used by numpy.{func.__name__}")
        return super().__array_function__(func, types, args, kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out", ())
        self._host_access(any(o is self for o in outs), f"used by {ufunc.__name__}")
        inputs = [i.view(np.ndarray) if isinstance(i, PinnedArray) else i for i in inputs]
        if outs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, PinnedArray) else o for o in outs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def copy(self, order="C"):
        self._host_access(False, "copied")
        return np.array(self.view(np.ndarray), order=order)

    def tobytes(self, order="C"):
        self._host_access(False, "read (tobytes)")
        return self.view(np.ndarray).tobytes(order)

    def __getitem__(self, key):
        self._host_access(False, "read")
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        self._host_access(True, "written")
        return super().__setitem__(key, value)

    def __array__(self, dtype=None, copy=None):
        self._host_access(False, "converted to an array")
        a = self.view(np.ndarray)
        return a if dtype is None else a.astype(dtype)


# What the host side of copies looked like, for tests that bound host memory (reset them freely):
# every page-locked allocation's bytes, and every host-to-device copy as (source, bytes, how):
# source "pinned" or "pageable", how "sync" or "async".
stats: dict[str, list] = {"pinned_allocs": [], "htod": []}


def pagelocked_empty(shape, dtype, order="C", mem_flags=0) -> PinnedArray:
    prim = _acquire()
    _no_capture("cuMemHostAlloc", prim)
    a = np.empty(shape, dtype, order=order).view(PinnedArray)
    a._block = _Block()
    stats["pinned_allocs"].append(int(a.nbytes))
    return a


def _raw(a) -> np.ndarray:
    return (a.view(np.ndarray) if isinstance(a, np.ndarray) else np.frombuffer(a, np.uint8)).reshape(-1).view(np.uint8)


def memcpy_htod(dest: int, src) -> None:
    prim = _ctx("cuMemcpyHtoD")
    _no_capture("cuMemcpyHtoD", prim)
    prim.drain()  # the legacy default stream waits for every blocking stream
    data = _raw(src)
    stats["htod"].append(("pinned" if getattr(src, "_block", None) is not None else "pageable", int(data.size), "sync"))
    _stamp_writes(prim, [int(dest)])
    prim.memory(int(dest), data.size, "cuMemcpyHtoD")[...] = data


def memcpy_dtoh(dest, src: int) -> None:
    prim = _ctx("cuMemcpyDtoH")
    _no_capture("cuMemcpyDtoH", prim)
    prim.drain()
    out = _raw(dest)
    out[...] = prim.memory(int(src), out.size, "cuMemcpyDtoH")


def _stream_of(routine: str, stream) -> "Stream":
    prim = _ctx(routine)
    if stream is None or stream.prim is not prim:
        raise LogicError(f"{routine}: the fake driver needs the stage's own stream")
    return stream


def _host_copy_async(routine: str, stream, host, ptr: int, to_device: bool) -> None:
    """Enqueue a copy between page-locked `host` and device `ptr`; it runs at the synchronize."""
    s = _stream_of(routine, stream)
    ptr, raw = int(ptr), _raw(host)
    s.prim.memory(ptr, raw.size, routine)
    if to_device:
        _stamp_writes(s.prim, [ptr])
    else:
        _check_ipc_reads(s, [ptr], routine, at_enqueue=True)
    block = getattr(host, "_block", None)
    # The bytes a host-to-device copy will read, fingerprinted when it is enqueued: a source changed
    # before the copy ran (a staging buffer refilled too early, by any means) is a RuleViolation.
    digest = hash(raw.tobytes()) if to_device and s._capture is None else None
    if to_device:
        stats["htod"].append(("pinned" if block is not None else "pageable", int(raw.size), "async"))

    def run():
        dev = s.prim.memory(ptr, raw.size, routine)
        if not to_device:
            _check_ipc_reads(s, [ptr], routine)
        if to_device:
            if digest is not None and hash(raw.tobytes()) != digest:
                _violation("page-locked buffer changed while a host-to-device copy from it was pending "
                           "(reused before the copy's event completed)")
            dev[...] = raw
        else:
            raw[...] = dev
    if block is not None and not to_device and s._capture is None:
        raw[...] = 0xFF  # poison: whoever reads before the synchronize sees NaNs
    s._enqueue(run, pins=[(block, "in" if to_device else "out")] if block else [])


def memcpy_htod_async(dest: int, src, stream=None) -> None:
    _host_copy_async("cuMemcpyHtoDAsync", stream, src, dest, to_device=True)


def memcpy_dtoh_async(dest, src: int, stream=None) -> None:
    _host_copy_async("cuMemcpyDtoHAsync", stream, dest, src, to_device=False)


def memcpy_dtod_async(dest: int, src: int, size: int, stream=None) -> None:
    s = _stream_of("cuMemcpyDtoDAsync", stream)
    dest, src = int(dest), int(src)
    s.prim.memory(dest, size, "cuMemcpyDtoDAsync")
    s.prim.memory(src, size, "cuMemcpyDtoDAsync")
    _stamp_writes(s.prim, [dest])

    def run():
        _check_ipc_reads(s, [src], "cuMemcpyDtoDAsync")
        s.prim.memory(dest, size, "cuMemcpyDtoDAsync")[...] = s.prim.memory(src, size, "cuMemcpyDtoDAsync").copy()
    s._enqueue(run)


# ---- streams and events -------------------------------------------------------------------------
_handles = itertools.count(0x5000)
_streams_by_handle: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()


class Stream:
    def __init__(self, flags: int = 0):
        self.prim = _acquire()
        self.handle = next(_handles)
        self._ops: list = []  # (callable, pins)
        self._capture: list | None = None
        self._capture_thread = None
        self._capture_bad: str | None = None
        self._emu_args: dict = {}  # function name -> args gathered from its launches so far
        self._fence: dict[int, int] = {}  # exporter pid -> its IPC write stamp this stream has waited past
        self.prim.streams.add(self)
        _streams_by_handle[self.handle] = self

    def _enqueue(self, op, pins=()) -> None:
        if self._capture is not None:
            self._capture.append(op)  # a captured host buffer is read at replay, not now
            return
        for b, how in pins:
            if how == "in":
                b.pending_in += 1
            else:
                b.pending_out += 1
        self._ops.append((op, pins))

    def _run(self) -> None:
        ops, self._ops = self._ops, []
        for op, pins in ops:
            for b, how in pins:
                if how == "in":
                    b.pending_in -= 1
                else:
                    b.pending_out -= 1
            if self.prim.sticky is None:
                try:
                    op()
                except Error as exc:  # a kernel that faults: sticky, reported at the next sync
                    self.prim.sticky = str(exc)
            self.prim.clock += 0.001

    def synchronize(self) -> "Stream":
        _ctx("cuStreamSynchronize")
        _no_capture("cuStreamSynchronize", self.prim)
        self._run()
        _raise_sticky("cuStreamSynchronize", self.prim)
        return self

    def is_done(self) -> bool:
        return not self._ops

    def wait_for_event(self, event: "Event") -> None:
        """cuStreamWaitEvent: later work on this stream waits for the event's latest record as of
        now. For an interprocess event, that record's write stamp becomes this stream's fence."""
        _ctx("cuStreamWaitEvent")
        shared = event._shared
        if shared is None:
            self._enqueue(lambda: None)  # same-process events: the fake runs streams in order anyway
            return
        target = shared.records()

        def run():
            stamp = shared.wait(target)
            if stamp is not None:
                self._fence[shared.pid] = max(self._fence.get(shared.pid, 0), stamp)
        self._enqueue(run)


class Event:
    def __init__(self, flags: int = 0):
        self.prim = _acquire()
        self._home = _stack()[-1].thread
        self.time: float | None = None
        self.flags = flags
        self._shared: _SharedEvent | None = None
        if flags & event_flags.INTERPROCESS:
            if not flags & event_flags.DISABLE_TIMING:
                _fail("cuEventCreate", 1, "an INTERPROCESS event must also be DISABLE_TIMING")
            self._shared = _SharedEvent.create()
            weakref.finalize(self, self._shared.unlink)

    def record(self, stream=None) -> "Event":
        s = _stream_of("cuEventRecord", stream)
        self.time = None
        if self._shared is not None:
            if self._shared.pid != os.getpid():
                _fail("cuEventRecord", 1, "the fake records interprocess events in their exporter only")
            n, stamp = self._shared.add_record(), _ipc_clock[0]

            def run():
                self._shared.complete(n, stamp)
            s._enqueue(run)
            return self

        def run():
            self.time = s.prim.clock
        s._enqueue(run)
        return self

    def __del__(self) -> None:
        """~event: cuEventDestroy under scoped_context_activation, which works where the event's
        context is current or can be pushed (its own thread); elsewhere PyCUDA leaks the event
        with this warning (CUDAPP_CATCH_CLEANUP_ON_DEAD_CONTEXT)."""
        if not hasattr(self, "_home"):
            return  # the constructor failed: no CUDA event was made
        s = getattr(_tls, "stack", None) or []
        if not (s and s[-1].prim is self.prim) and threading.get_ident() != self._home:
            warnings.warn("event in out-of-thread context could not be cleaned up", UserWarning, stacklevel=2)

    def synchronize(self) -> "Event":
        _no_capture("cuEventSynchronize", _ctx("cuEventSynchronize"))
        self.prim.drain()
        if self._shared is not None:
            self._shared.wait(self._shared.records())
        return self

    def query(self) -> bool:
        _ctx("cuEventQuery")
        if self._shared is not None:
            return self._shared.completed() >= self._shared.records()
        return self.time is not None

    def time_since(self, other: "Event") -> float:
        prim = _ctx("cuEventElapsedTime")
        _no_capture("cuEventElapsedTime", prim)
        if self.flags & event_flags.DISABLE_TIMING or other.flags & event_flags.DISABLE_TIMING:
            _fail("cuEventElapsedTime", 400, "an event created with DISABLE_TIMING")
        if self.time is None or other.time is None:
            _fail("cuEventElapsedTime", 600)
        return self.time - other.time

    def ipc_handle(self) -> bytearray:
        """cuIpcGetEventHandle: only for INTERPROCESS | DISABLE_TIMING events."""
        _ctx("cuIpcGetEventHandle")
        if self._shared is None:
            _fail("cuIpcGetEventHandle", 1, "the event was not created with event_flags.INTERPROCESS")
        return bytearray(self._shared.handle())

    @staticmethod
    def from_ipc_handle(handle) -> "Event":
        """cuIpcOpenEventHandle, in the current context; never in the exporting process."""
        handle = _handle_arg(handle)
        _ctx("cuIpcOpenEventHandle")
        shared = _SharedEvent.open(handle)
        ev = Event.__new__(Event)
        ev.prim, ev.time, ev.flags, ev._shared = _acquire(), None, event_flags.DISABLE_TIMING, shared
        ev._home = _stack()[-1].thread
        return ev


# ---- CUDA IPC -----------------------------------------------------------------------------------
# An exported allocation moves into a file (4096-byte header, then the bytes); an importer maps the
# same file, so two processes really exchange data. Header: magic, nbytes, exporter pid, open count
# (unused), last write stamp (the exporter's _ipc_clock at its latest write into
# the allocation, counted when the write is enqueued), and the pids of the processes that hold it
# open (a dead one's opens do not count: CUDA releases its mappings). An interprocess event's file holds how many
# records were enqueued, how many have run, and the write stamp each of the last 64 records saw.
# A stream that waits on an imported event keeps the stamp of the record it waited for (its fence);
# reading opened memory whose last write stamp is above the stream's fence is a RuleViolation.
# Decision, stricter than CUDA: a handle is only given for an allocation's base pointer (CUDA
# returns the base allocation's handle for an interior pointer, and the importer then silently
# sees the base); tvmpipe exports base pointers only.
IPC_DIR = os.environ.get("FAKE_PYCUDA_IPC_DIR") or os.path.join(
    "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), f"fakecuda-ipc-{os.getuid()}")
_MEM_MAGIC, _EVT_MAGIC = b"FKIPCMEM", b"FKIPCEVT"
_HANDLE = struct.Struct("<8sQQQ32s")  # magic, pid, base, nbytes, token: 64 bytes like CUipcMemHandle


def _handle_arg(handle) -> bytes:
    """PyCUDA's own check on an IPC handle argument (both IPCMemoryHandle and Event.from_ipc_handle):
    it must be a bytearray, the type PyCUDA's getters return; `bytes` (what a handle becomes after
    msgpack, pickle or a socket) is refused, with PyCUDA's message, which names the event routine
    for both kinds."""
    if not isinstance(handle, bytearray):
        _fail("event_from_ipc_handle", 1, "argument is not a bytes array")
    return bytes(handle)


def _open_handle(routine: str, handle: bytes, magic: bytes, what: str) -> tuple[int, int, str]:
    """(base, nbytes, token) of an IPC handle opened by `routine`: CUDA's checks for both kinds
    (size, kind, and not in the process that exported it)."""
    if len(handle) != _HANDLE.size:
        _fail(routine, 1, f"a handle is {_HANDLE.size} bytes, got {len(handle)}")
    got, pid, base, nbytes, token = _HANDLE.unpack(handle)
    if got != magic:
        _fail(routine, 1, f"not {what} handle")
    if pid == os.getpid():
        _fail(routine, 201, f"an IPC {what.split()[-1]} handle cannot be opened in the process that exported it")
    return base, nbytes, token.decode()
_DATA_AT = 4096
_ipc_clock = [0]
EVENT_WAIT_S = float(os.environ.get("FAKE_PYCUDA_IPC_WAIT_S", "30"))


def _ipc_file(token: str, create_bytes: int | None = None):
    os.makedirs(IPC_DIR, mode=0o700, exist_ok=True)
    path = os.path.join(IPC_DIR, token)
    if create_bytes is not None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, create_bytes)
    else:
        fd = os.open(path, os.O_RDWR)
    try:
        return path, fd, mmap.mmap(fd, os.fstat(fd).st_size)
    except BaseException:
        os.close(fd)
        raise


class _Counters:
    """u64 fields of a shared file's header, updated under an fcntl lock."""

    def __init__(self, fd: int, mm: mmap.mmap):
        self.fd, self.mm = fd, mm

    def get(self, at: int) -> int:
        return struct.unpack_from("<Q", self.mm, at)[0]

    def add(self, at: int, n: int) -> int:
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            v = self.get(at) + n
            struct.pack_into("<Q", self.mm, at, v)
            return v
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def set(self, at: int, v: int) -> None:
        struct.pack_into("<Q", self.mm, at, v)


class _Shared:
    """One exported allocation's file, as its exporter or an importer sees it."""
    OPENS, LAST_WRITE = 24, 32

    def __init__(self, token: str, path: str, fd: int, mm: mmap.mmap):
        self.token, self.path, self.c = token, path, _Counters(fd, mm)
        magic, self.nbytes, self.pid = struct.unpack_from("<8sQQ", mm, 0)
        self.data = np.frombuffer(mm, np.uint8, self.nbytes, _DATA_AT)

    PIDS, MAX_IMPORTERS = 64, 64  # one u64 per open: the importing process's pid (0: free)

    def opens(self) -> int:
        """Opens by processes still alive: CUDA releases a dead process's mappings."""
        n = 0
        for i in range(self.MAX_IMPORTERS):
            pid = self.c.get(self.PIDS + 8 * i)
            if pid:
                try:
                    os.kill(pid, 0)
                    n += 1
                except ProcessLookupError:
                    pass
                except PermissionError:
                    n += 1
        return n

    def add_importer(self, pid: int, add: bool) -> None:
        fcntl.lockf(self.c.fd, fcntl.LOCK_EX)
        try:
            for i in range(self.MAX_IMPORTERS):
                at = self.PIDS + 8 * i
                if self.c.get(at) == (0 if add else pid):
                    self.c.set(at, pid if add else 0)
                    return
        finally:
            fcntl.lockf(self.c.fd, fcntl.LOCK_UN)
        _violation("the fake tracks at most 64 opens of one IPC allocation")

    def last_write(self) -> int:
        return self.c.get(self.LAST_WRITE)

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class _SharedEvent:
    RECORDS, DONE, STAMPS = 24, 32, 64
    KEPT = 64

    def __init__(self, token: str, path: str, fd: int, mm: mmap.mmap):
        self.token, self.path, self.c = token, path, _Counters(fd, mm)
        self.pid = struct.unpack_from("<8sQ", mm, 0)[1]

    @classmethod
    def create(cls) -> "_SharedEvent":
        token = secrets.token_hex(16)
        path, fd, mm = _ipc_file(token, create_bytes=_DATA_AT)
        struct.pack_into("<8sQ", mm, 0, _EVT_MAGIC, os.getpid())
        return cls(token, path, fd, mm)

    @classmethod
    def open(cls, handle: bytes) -> "_SharedEvent":
        _, _, token = _open_handle("cuIpcOpenEventHandle", handle, _EVT_MAGIC, "an event")
        try:
            return cls(token, *_ipc_file(token))
        except OSError:
            _fail("cuIpcOpenEventHandle", 1, "the exporting event no longer exists")

    def handle(self) -> bytes:
        return _HANDLE.pack(_EVT_MAGIC, self.pid, 0, 0, self.token.encode())

    def records(self) -> int:
        return self.c.get(self.RECORDS)

    def completed(self) -> int:
        return self.c.get(self.DONE)

    def add_record(self) -> int:
        return self.c.add(self.RECORDS, 1)

    def complete(self, n: int, stamp: int) -> None:
        self.c.set(self.STAMPS + 8 * (n % self.KEPT), stamp)
        self.c.set(self.DONE, n)

    def wait(self, target: int) -> int | None:
        """Block until record `target` has run in the exporter (None if target is 0: no record);
        its write stamp. A record that never runs is a RuleViolation after EVENT_WAIT_S."""
        if target <= 0:
            return None
        end = time.monotonic() + EVENT_WAIT_S
        while self.completed() < target:
            if time.monotonic() > end:
                _violation(f"waited {EVENT_WAIT_S:g} s for record {target} of an IPC event that never ran "
                           "(the exporter never ran its stream)")
            time.sleep(0.0005)
        if self.completed() - target >= self.KEPT:
            _violation("the fake keeps the stamps of the last 64 records of an IPC event only")
        return self.c.get(self.STAMPS + 8 * (target % self.KEPT))

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _stamp_writes(prim: _Primary, ptrs) -> None:
    """Note, at enqueue, a write into exported allocations (their importers must wait past it)."""
    if not prim.exported:
        return
    for p in ptrs:
        for base, shared in prim.exported.items():
            if base <= p < base + shared.nbytes:
                _ipc_clock[0] += 1
                shared.c.set(shared.LAST_WRITE, _ipc_clock[0])


def _check_ipc_reads(s: "Stream", ptrs, routine: str, at_enqueue: bool = False) -> None:
    """A read of IPC-opened memory must come after a wait (on this stream) on the producer's event
    recorded after the producer's last write to it."""
    if not s.prim.imported or at_enqueue:
        return
    for p in ptrs:
        for base, shared in s.prim.imported.items():
            if base <= p < base + shared.nbytes:
                fence, last = s._fence.get(shared.pid, 0), shared.last_write()
                if last > fence:
                    _violation(f"{routine} reads IPC-opened memory {base:#x} before waiting on the producer's event "
                               f"that follows its last write (write stamp {last}, this stream waited past {fence})")


def mem_get_ipc_handle(devptr) -> bytearray:
    """cuIpcGetMemHandle: the 64-byte handle of a cuMemAlloc allocation, given its base pointer."""
    prim = _ctx("cuIpcGetMemHandle")
    if isinstance(devptr, np.ndarray):
        _fail("cuIpcGetMemHandle", 1, "host memory (page-locked or not) has no IPC handle; only cuMemAlloc memory")
    ptr = int(devptr)
    if ptr in prim.imported:
        _fail("cuIpcGetMemHandle", 1, "memory opened from an IPC handle cannot be exported again")
    if ptr not in prim.allocs:
        inside = [b for b, buf in prim.allocs.items() if b < ptr < b + buf.size]
        _fail("cuIpcGetMemHandle", 1, f"{ptr:#x} is inside the allocation at {inside[0]:#x}: the fake exports base "
                                      "pointers only" if inside else f"{ptr:#x} is not a cuMemAlloc allocation")
    shared = prim.exported.get(ptr)
    if shared is None:
        old = prim.allocs[ptr]
        token = secrets.token_hex(16)
        path, fd, mm = _ipc_file(token, create_bytes=_DATA_AT + old.size)
        struct.pack_into("<8sQQ", mm, 0, _MEM_MAGIC, old.size, os.getpid())
        shared = prim.exported[ptr] = _Shared(token, path, fd, mm)
        shared.data[...] = old
        prim.allocs[ptr] = shared.data
    return bytearray(_HANDLE.pack(_MEM_MAGIC, os.getpid(), ptr, shared.nbytes, shared.token.encode()))


class IPCMemoryHandle:
    """cuIpcOpenMemHandle in the current context; int() is the opened pointer; close() unmaps."""

    def __init__(self, ipc_handle, flags: int = ipc_mem_flags.LAZY_ENABLE_PEER_ACCESS):
        ipc_handle = _handle_arg(ipc_handle)
        prim = _ctx("cuIpcOpenMemHandle")
        base, nbytes, token = _open_handle("cuIpcOpenMemHandle", ipc_handle, _MEM_MAGIC, "a memory")
        try:
            shared = _Shared(token, *_ipc_file(token))
        except OSError:
            _fail("cuIpcOpenMemHandle", 1, "the exported allocation no longer exists")
        shared.add_importer(os.getpid(), True)
        with _lock:
            ptr = _next_addr[0]
            _next_addr[0] += ((nbytes >> 20) + 2) << 20
        prim.allocs[ptr] = shared.data
        prim.imported[ptr] = shared
        self.prim, self.ptr, self.shared, self.valid = prim, ptr, shared, True

    def __int__(self) -> int:
        return self.ptr

    __index__ = __int__

    def close(self) -> None:
        if not self.valid:
            _fail("cuIpcCloseMemHandle", 1, "already closed")
        s = _stack()
        if not s or s[-1].prim is not self.prim:
            raise LogicError("cannot activate out-of-thread context")
        self.valid = False
        del self.prim.allocs[self.ptr]
        del self.prim.imported[self.ptr]
        self.shared.add_importer(os.getpid(), False)


# ---- modules and kernels ------------------------------------------------------------------------
class Module:
    def __init__(self, prim: _Primary, info: ModuleInfo):
        self.prim, self.info = prim, info

    def get_function(self, name: str) -> "Function":
        _ctx("cuModuleGetFunction")
        if name not in self.info.kernels:
            _fail("cuModuleGetFunction", 500 if 500 in ERRORS else 1, name)
        return Function(self, self.info.kernels[name])


ERRORS[500] = "named symbol not found"


def module_from_buffer(buffer, options=None, message_handler=None) -> Module:
    prim = _ctx("cuModuleLoadDataEx")
    try:
        info = read_fake_cubin(bytes(buffer))
    except ValueError:
        _fail("cuModuleLoadDataEx", 1, "the fake driver loads fake cubins only (tests/fakecuda/bin/nvcc)")
    arch = "sm_{}{}".format(*CC)
    if info.arch != arch:
        raise RuntimeError(f"cuModuleLoadDataEx failed: no kernel image is available for execution on the device "
                           f"(cubin for {info.arch}, device {arch})")
    return Module(prim, info)


class Function:
    def __init__(self, module: Module, info):
        self.module, self.info = module, info
        self.max_dynamic = DEFAULT_SMEM - info.static_smem

    def get_attribute(self, attr: int) -> int:
        _ctx("cuFuncGetAttribute")
        return {function_attribute.SHARED_SIZE_BYTES: self.info.static_smem,
                function_attribute.MAX_THREADS_PER_BLOCK: self.info.max_threads,
                function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES: self.max_dynamic}[attr]

    def set_attribute(self, attr: int, value: int) -> None:
        _ctx("cuFuncSetAttribute")
        if attr != function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES:
            _fail("cuFuncSetAttribute", 1)
        if value < 0 or self.info.static_smem + value > OPTIN_SMEM:
            _fail("cuFuncSetAttribute", 1)
        self.max_dynamic = value

    def _launch_kernel(self, grid, block, args, shared, stream) -> None:
        s = _stream_of("cuLaunchKernel", stream)
        if len(grid) > 3 or len(block) > 3:
            _fail("function::launch_kernel", 400, "too many grid dimensions in kernel launch")
        info = self.info
        threads = int(np.prod(block))
        if min(list(grid) + list(block)) < 1:
            _fail("cuLaunchKernel", 1)
        if threads > min(1024, info.max_threads):
            _fail("cuLaunchKernel", 1, f"{threads} threads > __launch_bounds__({info.max_threads})")
        if shared > self.max_dynamic:
            _fail("cuLaunchKernel", 1, f"{shared} bytes of dynamic shared memory > the kernel's limit "
                                       f"{self.max_dynamic} (static {info.static_smem})")
        argbuf = bytes(args)
        if len(argbuf) != info.argbytes:
            _fail("cuLaunchKernel", 1, f"parameter buffer of {len(argbuf)} bytes, kernel {info.name} takes "
                                       f"{info.argbytes}")
        emu = self.module.info.emulation
        if emu is None or info.name not in emu.by_kernel:  # every check above passed
            raise RuleViolation(f"kernel {info.name}: no registered bundle computes it (FAKE_PYCUDA_BUNDLES)")
        ptrs = [int.from_bytes(argbuf[o:o + 8], "little") for o, size, p in info.params if p]
        _stamp_writes(s.prim, ptrs)  # conservative: every exported operand counts as written
        s._enqueue(lambda: _run_kernel(s, info, emu, argbuf))


POOL_ARG = {"paged_append": 0, "paged_decode": 1, "paged_prefill": 2}  # the pool's position among an op's inputs


def _run_kernel(s: Stream, info, emu, argbuf: bytes) -> None:
    """Pointer operands must address live memory; the function's last launch computes it."""
    ptrs = [int.from_bytes(argbuf[o:o + 8], "little") for o, size, p in info.params if p]
    for p in ptrs:
        s.prim.memory(p, 1, f"kernel {info.name}")  # an illegal address faults the context
    _check_ipc_reads(s, ptrs, f"kernel {info.name}")
    fe, i = emu.by_kernel[info.name]
    launch = fe.launches[i]
    got = s._emu_args.setdefault(fe.name, {})
    if i == 0:
        got.clear()
    for o, v in zip(launch.args, decode(launch, argbuf)):
        if o.kind == "arg":
            got[o.index] = v
    if i != len(fe.launches) - 1:
        return
    from tvmpipe.bundle.dtypes import np_dtype
    from tvmpipe.executor.reference_ops import run_function

    def arr(k):
        shape, dt = fe.arg_specs[k]
        d = np_dtype(dt)
        if k in pools:  # a page pool: the kernels index pages by id at a fixed stride, whatever their
            page = int(np.prod(shape[1:])) * d.itemsize  # count (sized at run time: bundle/pool.py),
            shape = (s.prim.span(got[k], f"kernel {info.name}") // page, *shape[1:])  # so the allocation says
        n = int(np.prod(shape)) * d.itemsize
        return s.prim.memory(got[k], max(n, 1), f"kernel {info.name}")[:n].view(d).reshape(shape)

    # the page-pool argument of each paged op (ops.json paged_append / paged_decode / paged_prefill)
    pools = {r.index for op in fe.fn.ops if op.op in POOL_ARG for j, r in enumerate(op.inputs)
             if j == POOL_ARG[op.op] and r.kind == "arg"}

    def unread(k):  # an input no launch passes (the paged kernels' rope offsets, rotary off): no kernel reads it
        shape, dt = fe.arg_specs[k]
        return np.zeros(shape, np_dtype(dt))

    args = [arr(k).copy() if k in got else unread(k) for k in range(fe.n_inputs)]
    # an in-place function (a paged pool's append: ops.json attrs `inplace`) has no output
    # parameters: its kernel writes output j over input inplace[j]
    inplace = next((op.attrs["inplace"] for op in fe.fn.ops if "inplace" in op.attrs), None)
    fn = fe.fn
    sized = {args[k].shape[0] for k in pools if k < len(args)} - {fe.arg_specs[k][0][0] for k in pools}
    if sized:  # the pool's size at run time: the function's records resized as the bundle's were
        from tvmpipe.bundle.pool import resize_function

        fn = resize_function(fn, pools, {j for j, k in enumerate(inplace or ()) if k in pools}, sized.pop())
    outs = run_function(fn, args)
    for k, v in enumerate(outs, start=fe.n_inputs):
        np.copyto(arr(inplace[k - fe.n_inputs] if inplace else k), v)
    del s._emu_args[fe.name]


# ---- the driver API that tvmpipe reaches through ctypes (libcuda.so.1): graph capture ----------
class _FakeLibcuda:
    """cuStreamBeginCapture_v2 ... cuGraphExecDestroy, with ctypes-style arguments."""

    def __init__(self):
        self.graphs: dict[int, list] = {}
        self.execs: dict[int, list] = {}

    def _stream(self, h) -> Stream:
        return _streams_by_handle[int(h.value if isinstance(h, ctypes.c_void_p) else h)]

    def cuStreamBeginCapture_v2(self, stream, mode):
        s = self._stream(stream)
        if s._capture is not None:
            return 1
        s._capture, s._capture_thread, s._capture_bad = [], threading.get_ident(), None
        return 0

    def cuStreamEndCapture(self, stream, graph_ref):
        s = self._stream(stream)
        if s._capture is None:
            return 1
        ops, bad = s._capture, s._capture_bad
        s._capture = s._capture_thread = None
        if bad:
            return 901
        h = next(_handles)
        self.graphs[h] = ops
        graph_ref._obj.value = h
        return 0

    def cuGraphInstantiateWithFlags(self, exe_ref, graph, flags):
        ops = self.graphs.get(int(graph.value or 0))
        if ops is None:
            return 400
        h = next(_handles)
        self.execs[h] = list(ops)
        exe_ref._obj.value = h
        return 0

    def cuGraphLaunch(self, exe, stream):
        ops = self.execs.get(int(exe.value or 0))
        if ops is None:
            return 400
        s = self._stream(stream)
        for op in ops:
            s._enqueue(op)
        return 0

    def cuGraphDestroy(self, graph):
        return 0 if self.graphs.pop(int(graph.value or 0), None) is not None else 400

    def cuGraphExecDestroy(self, exe):
        return 0 if self.execs.pop(int(exe.value or 0), None) is not None else 400

    def cuGetErrorString(self, rc, ref):
        ref._obj.value = ERRORS.get(rc, "unknown error").encode()
        return 0

    def __getattr__(self, name):  # `lib.f.argtypes = ...` assignments
        raise AttributeError(name)


class _Fn:
    def __init__(self, f):
        self.f = f
        self.argtypes = None

    def __call__(self, *a):
        return self.f(*a)


class _LibProxy:
    def __init__(self, lib):
        for name in dir(lib):
            if name.startswith("cu"):
                setattr(self, name, _Fn(getattr(lib, name)))


libcuda = _LibProxy(_FakeLibcuda())
_real_cdll = ctypes.CDLL


def _cdll(name, *args, **kwargs):
    return libcuda if name == "libcuda.so.1" else _real_cdll(name, *args, **kwargs)


ctypes.CDLL = _cdll  # the driver library is part of what this package fakes
