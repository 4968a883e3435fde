"""CUDA IPC: the same-node path of an edge between two cuda-backend stages (docs/cluster.md "CUDA IPC").

The producer owns a ring of `slots` device buffers (cuMemAlloc, one micro-batch's payload each, the
tensors at the frame codec's offsets) and one interprocess event per slot; it exports their handles
once, in the first notification of a connection (`Offer`). Per micro-batch it copies its outputs
device to device into the next slot on its own stream, records the slot's event after the copy, and
sends an `ipc` notification (slot, seq, the tensor list: checked against the edge's exact layout
like any header) over the edge's authenticated connection. The consumer opens the handles once, and
per notification enqueues on ITS stream: a wait on the slot's event, then device-to-device copies
into its input buffers, ahead of its kernels (`DeviceFeed`, run by CudaBackend). When its micro-batch
has run (its stream synchronized, so the copies are done) it acknowledges with one byte on the same
connection, and the producer may refill that slot: memory is bounded by `slots` per edge and a slow
consumer holds its producer back (backpressure).

Teardown order is CUDA's rule: the importer closes its handles before the exporter frees. The
consumer closes them when the connection ends and every notification it took has been released (a
stopping worker releases the micro-batches it will not compute; at most 5 s), then says CLOSED on
the connection; the producer shuts its side down and frees the ring after CLOSED, or after EOF when
the process that opened the handles is gone (CUDA releases a dead process's mappings). Otherwise
(a live consumer that never says CLOSED within 10 s) the ring stays allocated, logged, until the
producer's process ends, rather than free memory another process maps.

What stays on the host: the producer still copies its outputs to page-locked memory as well (what it
retains for upstream replay after a fault, and what replays are sent as, over TCP, as plain data
frames); a consumer takes either kind of frame on one connection.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from tvmpipe.cluster.wire.frames import FrameError
from tvmpipe.executor.errors import DeviceError

log = logging.getLogger("tvmpipe.cluster.wire.cudaipc")
HANDLE_BYTES = 64  # CUipcMemHandle, CUipcEventHandle
MAX_SLOTS = 64
WAKE_S = 0.005
# What the consumer sends back on the connection: ACK per released micro-batch; OPENED + its pid
# (8 bytes) once it has opened the handles; CLOSED once it has closed them. The producer frees its
# ring after CLOSED, or after EOF when the process that opened it is gone (CUDA released its
# mappings); after an EOF from a live opener (it cannot say CLOSED), the ring stays allocated.
ACK, CLOSED, OPENED = b"\x01", b"\x02", b"\x03"


def eligible(backend: str, same_node: bool, src_is_stage: bool, dst_is_stage: bool, transport: str) -> bool:
    """An edge between two stage processes of the cuda backend on one node, unless a host path
    ("tcp" or "shm") is forced."""
    return backend == "cuda" and same_node and src_is_stage and dst_is_stage and transport in ("auto", "cuda-ipc")


@dataclass(frozen=True)
class Offer:
    """What the consumer opens once: per slot a memory handle and an event handle."""

    mem: tuple[bytes, ...]
    events: tuple[bytes, ...]
    slot_bytes: int

    def pack(self) -> list:
        return [b"".join(self.mem).hex(), b"".join(self.events).hex(), self.slot_bytes]

    @staticmethod
    def unpack(raw: Any) -> "Offer":
        if (type(raw) is not list or len(raw) != 3 or type(raw[0]) is not str or type(raw[1]) is not str
                or type(raw[2]) is not int):
            raise FrameError("a cuda-ipc offer is [memory handles, event handles, slot bytes]")
        try:
            mem, ev = bytes.fromhex(raw[0]), bytes.fromhex(raw[1])
        except ValueError:
            raise FrameError("cuda-ipc handles must be hex") from None
        n = len(mem) // HANDLE_BYTES
        if len(mem) != n * HANDLE_BYTES or len(ev) != len(mem) or not 1 <= n <= MAX_SLOTS or raw[2] <= 0:
            raise FrameError(f"a cuda-ipc offer needs 1..{MAX_SLOTS} memory and event handles of "
                             f"{HANDLE_BYTES} bytes each")
        split = lambda b: tuple(b[i * HANDLE_BYTES:(i + 1) * HANDLE_BYTES] for i in range(n))  # noqa: E731
        return Offer(split(mem), split(ev), raw[2])


@dataclass(frozen=True)
class Note:
    """One micro-batch waits in `slot` (the offer rides on a connection's first note only)."""

    slot: int
    offer: Offer | None = None

    def pack(self) -> list:
        return [self.slot, self.offer.pack() if self.offer else None]

    @staticmethod
    def unpack(raw: Any) -> "Note":
        if type(raw) is not list or len(raw) != 2 or type(raw[0]) is not int or not 0 <= raw[0] < MAX_SLOTS:
            raise FrameError("a cuda-ipc note is [slot, offer or nil]")
        return Note(raw[0], None if raw[1] is None else Offer.unpack(raw[1]))


def slot_layout(sizes: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """(entry, offset, nbytes) of each tensor in a slot, at the frame codec's 64-byte alignment, and
    the payload's size."""
    out, pos = [], 0
    for e, n in sizes:
        start = (pos + 63) // 64 * 64
        out.append((e, start, n))
        pos = start + n
    return tuple(out), max(pos, 1)


@dataclass(frozen=True)
class DeviceFeed:
    """A consumer's part of one micro-batch: wait on the producer's event, then copy each tensor
    from the opened slot into the stage's input buffer, all on the stage's stream."""

    src: int
    event: Any
    copies: tuple[tuple[int, int, int], ...]  # (entry, offset in the slot, nbytes)

    @property
    def entries(self) -> frozenset[int]:
        return frozenset(e for e, _, _ in self.copies)

    def enqueue(self, dev: Any, ptr: dict[int, int]) -> None:
        dev.stream.wait_for_event(self.event)
        for e, off, n in self.copies:
            if n:
                dev.copy(ptr[e], self.src + off, n)


class DeviceRing:
    """The producer's end: `slots` exported device buffers, an interprocess event each."""

    def __init__(self, dev: Any, slots: int, sizes: list[tuple[int, int]]):
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
        self.dev, self.slots = dev, slots
        self.layout, self.slot_bytes = slot_layout(sizes)
        cuda = dev.cuda
        self.bufs: list[Any] = []
        with dev.current(), dev.check("exporting device buffers for CUDA IPC"):
            flags = cuda.event_flags.INTERPROCESS | cuda.event_flags.DISABLE_TIMING
            try:
                for _ in range(slots):
                    self.bufs.append(cuda.mem_alloc(self.slot_bytes))
                self.events = [cuda.Event(flags) for _ in range(slots)]
                self.offer = Offer(tuple(bytes(cuda.mem_get_ipc_handle(b)) for b in self.bufs),
                                   tuple(bytes(ev.ipc_handle()) for ev in self.events), self.slot_bytes)
            except BaseException:
                for b in self.bufs:
                    b.free()
                raise
        self.ticket = 0  # of the next micro-batch
        self.acked = 0  # micro-batches the consumer has released
        self.opener: int | None = None  # the consumer's pid, once it opened the handles
        self.closed = False  # the consumer said it closed them
        self._rx = b""

    def _take(self, data: bytes) -> None:
        buf = self._rx + data
        i = 0
        while i < len(buf):
            c = buf[i:i + 1]
            if c == ACK:
                self.acked += 1
            elif c == CLOSED:
                self.closed = True
            elif c == OPENED:
                if len(buf) - i < 9:
                    break
                self.opener = int.from_bytes(buf[i + 1:i + 9], "little")
                i += 8
            i += 1
        self._rx = buf[i:]

    def free(self) -> bool:
        return self.ticket < self.slots or self.acked >= self.ticket - self.slots + 1

    def _read_acks(self, sock: socket.socket, timeout: float) -> bool:
        """Count acknowledgements that arrive within `timeout`; False once the consumer closed."""
        readable, _, _ = select.select([sock], [], [], timeout)
        if readable:
            try:
                data = sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            if not data:
                return False
            self._take(data)
        return True

    def wait_free(self, sock: socket.socket, alive) -> bool:
        """Block until the next slot is released (True), or the connection ends (False)."""
        while not self.free():
            if not alive() or not self._read_acks(sock, WAKE_S):
                return False
        return True

    def write(self, ptrs: dict[int, int]) -> Note:
        """Copy the outputs at `ptrs` (entry -> device pointer) into the next slot on the stage's
        stream and record the slot's event after them; the slot must be free (wait_free)."""
        slot = self.ticket % self.slots
        dev = self.dev
        with dev.current(), dev.check("copying outputs into a CUDA IPC slot"):
            base = int(self.bufs[slot])
            for e, off, n in self.layout:
                if n:
                    dev.copy(base + off, ptrs[e], n)
            self.events[slot].record(dev.stream)
            # The backend synchronizes after every micro-batch anyway; done here too, the copy is
            # finished before the notification leaves (and the consumer's wait returns at once).
            dev.synchronize()
        note = Note(slot, self.offer if self.ticket == 0 else None)
        self.ticket += 1
        return note

    def close(self, sock: socket.socket, wait_s: float = 10.0) -> None:
        """After the consumer has closed the connection (its handles closed first), free the ring."""
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        end = time.monotonic() + (wait_s if self.ticket else 0.0)
        eof = False
        while not self.closed and time.monotonic() < end:
            try:
                if not self._read_acks(sock, 0.05):
                    eof = True
                    break
            except OSError:
                eof = True
                break
        if self.ticket and not self.closed and not (eof and not _alive(self.opener)):
            log.warning("CUDA IPC ring of %d slots left allocated: its consumer did not say it closed the handles "
                        "within %.1f s (it may still map it)", self.slots, wait_s)
            return
        if self.dev.ctx is None:
            return
        with self.dev.current():
            for b in self.bufs:
                try:
                    with self.dev.check("freeing a CUDA IPC slot"):
                        b.free()
                except DeviceError as exc:  # a link's close never raises for it
                    log.warning("%s", exc)
        self.bufs = []


def _alive(pid: int | None) -> bool:
    """Whether the process that opened a ring still runs (None: nobody opened it)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class DeviceInbox:
    """The consumer's end of one connection: opens the producer's handles at the first note,
    checks each note's slot, and acknowledges released micro-batches on the connection."""

    def __init__(self, dev: Any, sock: socket.socket):
        self.dev, self.sock = dev, sock
        self.mems: list[Any] | None = None
        self.events: list[Any] = []
        self.ticket = 0
        self._outstanding = 0
        self._cond = threading.Condition()
        self._closing = False

    def _open(self, offer: Offer, size: int) -> None:
        if offer.slot_bytes < size:
            raise FrameError(f"cuda-ipc slots of {offer.slot_bytes} bytes for {size}-byte micro-batches")
        cuda, mems = self.dev.cuda, []
        try:
            with self.dev.current(), self.dev.check("opening the producer's CUDA IPC handles"):
                # PyCUDA takes a handle only as a bytearray (what its getters return); the offer's
                # handles arrived through msgpack as bytes.
                for h in offer.mem:
                    mems.append(cuda.IPCMemoryHandle(bytearray(h)))
                self.events = [cuda.Event.from_ipc_handle(bytearray(h)) for h in offer.events]
        except BaseException:
            with self.dev.current():
                for m in mems:
                    m.close()
            raise
        self.mems = mems
        self._say(OPENED + os.getpid().to_bytes(8, "little"))

    def _say(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # the producer is gone, or the connection is closing

    def take(self, raw: object, metas: list) -> DeviceFeed:
        """The feed of one notification whose header (tensor list `metas`) was checked; `raw` is its
        note as the codec read it (checked here: Note.unpack)."""
        note = Note.unpack(raw)
        copies, size = slot_layout([(m.entry, m.nbytes) for m in metas])
        if note.offer is not None:
            if self.mems is not None:
                raise FrameError("a second cuda-ipc offer on one connection")
            try:
                self._open(note.offer, size)
            except DeviceError as exc:  # the connection ends with a one-line refusal
                raise FrameError(f"cuda-ipc: {exc}") from None
        if self.mems is None:
            raise FrameError("a cuda-ipc note before the offer of its handles")
        want = self.ticket % len(self.mems)
        if note.slot != want:
            raise FrameError(f"cuda-ipc note for slot {note.slot}, expected slot {want}")
        self.ticket += 1
        with self._cond:
            self._outstanding += 1
        return DeviceFeed(int(self.mems[want]), self.events[want], copies)

    def release(self) -> None:
        """One micro-batch taken from this connection has run: its slot may be refilled."""
        with self._cond:
            self._outstanding -= 1
            self._cond.notify_all()
        self._say(ACK)

    def close(self, wait_s: float = 5.0) -> None:
        """Close the handles once every micro-batch taken has been released (at most `wait_s`: a
        micro-batch dropped by a re-wiring is never released)."""
        end = time.monotonic() + wait_s
        with self._cond:
            while self._outstanding > 0 and time.monotonic() < end:
                self._cond.wait(0.05)
        if self.mems is not None and self.dev.ctx is not None:
            with self.dev.current():
                for m in self.mems:
                    with self.dev.check("closing a CUDA IPC handle"):
                        m.close()
                # The events are destroyed here, with their context current: PyCUDA cannot
                # activate it from this (data-plane) thread and would leak them with a warning.
                self.mems, self.events = None, []
        if self.mems is None:
            self._say(CLOSED)
