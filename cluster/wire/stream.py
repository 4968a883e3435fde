"""Frames on a socket: sending one as an iovec, reading a connection's frames in order.

The codec (frames.py) turns frames into bytes and back; this module moves those bytes with as few
system calls and copies as a hop allows (docs/frames.md, "Per-frame cost"): a frame goes out in one
`sendmsg` of header and tensor memory, and a reader keeps a small buffer so that one `recv_into`
brings a small frame whole, and recognises a stream's repeated header without unpacking it.
Payload buffers are allocated only after the codec has checked every size against the limits.
"""

from __future__ import annotations

import socket
from typing import Any, Callable

import numpy as np

from tvmpipe.cluster.wire.shm import Inbox
from tvmpipe.core.memory import POPULATE_FROM, populated_bytes
from tvmpipe.cluster.wire.frames import (DEFAULT_LIMITS, PREFIX, SEQ_VALUE, Encoder, Frame, FrameError, FrameLimits,
                                    Layout, Repeat, attach, parse_header, parse_prefix)

RETAINED_MMAP_BYTES = POPULATE_FROM  # retained payloads from this size on get pre-populated mappings


def send(sock: socket.socket, frame: Frame, encoder: Encoder | None = None) -> int:
    """Send one frame with scatter-gather I/O (no concatenation); returns the bytes written.
    Usually one system call; a partial send carries on from where it stopped. A stream passes its
    own `encoder` (see Encoder)."""
    parts = (encoder or Encoder()).encode(frame)  # bytes and unsigned-byte memoryviews: len() counts bytes
    total = left = sum(map(len, parts))
    while True:
        sent = sock.sendmsg(parts if len(parts) <= 1024 else parts[:1024])  # IOV_MAX
        left -= sent
        if not left:
            return total
        while sent >= len(parts[0]):
            sent -= len(parts.pop(0))
        parts[0] = memoryview(parts[0])[sent:]


def fresh_buffer(size: int) -> np.ndarray:
    """A payload buffer for short-lived frames: freed memory is reused through malloc."""
    return np.empty(size, dtype=np.uint8)


def retained_buffer(size: int) -> np.ndarray:
    """A payload buffer for frames whose arrays the receiver keeps (graph outputs handed to the
    user). Short-lived payloads reuse freed memory through malloc and cost nothing; a kept one
    needs fresh pages, populated in one call (core/memory.py)."""
    return fresh_buffer(size) if size < RETAINED_MMAP_BYTES else populated_bytes(size)


class FrameReader:
    """Reads frames from one connection, in order.

    One `recv_into` usually brings a small frame's prefix, header and payload at once (three
    separate reads cost three system calls per hop), so the reader keeps a small buffer; bytes of
    the next frame stay in it for the next `read`. A payload larger than what is buffered is
    received straight into its own array: big tensors are not copied twice.
    """

    def __init__(self, sock: socket.socket, limits: FrameLimits = DEFAULT_LIMITS, buffer_bytes: int = 64 << 10,
                 alloc: Callable[[int], np.ndarray] = fresh_buffer, inbox: Inbox | None = None,
                 copy_shm: bool = False, device_inbox: Any = None):
        self.sock = sock
        # shm notifications are taken only with an inbox (a listener's connection from a run's peer);
        # `copy_shm`: copy each slot out at once (the driver keeps outputs) instead of reading in place
        self.inbox = inbox
        self.copy_shm = copy_shm
        self.device_inbox = device_inbox  # cudaipc.DeviceInbox: this connection takes ipc notes
        self.limits = limits
        self.alloc = alloc
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._start = 0  # buffered bytes are _buf[_start:_end]
        self._end = 0
        self._layout: Layout | None = None  # of the last frame: the next one's tensors are usually the same
        self._repeat: Repeat | None = None  # the last data header, to recognise its repeats

    @property
    def buffered(self) -> bool:
        """Bytes of a next frame are already here (a poller waiting for the socket would miss them)."""
        return self._end > self._start

    def _fill(self, need: int, what: str, at_boundary: bool = False) -> bool:
        """Buffer at least `need` bytes (need <= buffer size). False on a clean EOF before the first
        byte when `at_boundary`; a FrameError on EOF anywhere else (a truncated frame)."""
        have = self._end - self._start
        if have >= need:
            return True
        if self._start:
            self._view[:have] = self._view[self._start:self._end]
            self._start, self._end = 0, have
        while self._end < need:
            n = self.sock.recv_into(self._view[self._end:])
            if n == 0:
                if at_boundary and self._end == 0:
                    return False
                raise FrameError(f"truncated frame: connection closed after {self._end} of {need} {what} bytes")
            self._end += n
        return True

    def _take(self, out: memoryview, what: str) -> None:
        """Fill `out`: buffered bytes first, then straight from the socket."""
        n = min(len(out), self._end - self._start)
        out[:n] = self._view[self._start:self._start + n]
        self._start += n
        while n < len(out):
            k = self.sock.recv_into(out[n:])
            if k == 0:
                raise FrameError(f"truncated frame: connection closed after {n} of {len(out)} {what} bytes")
            n += k

    def read(self, limits: FrameLimits | None = None) -> Frame | None:
        """The next frame; None when the peer closed the connection cleanly between frames.

        The payload is one fresh array (from `alloc`) and the tensors are views of it, so a frame's
        memory lives exactly as long as its arrays do.
        """
        limits = limits or self.limits
        if not self._fill(PREFIX.size, "prefix", at_boundary=self._start == self._end):
            return None
        rep = self._repeat
        at = self._start
        if (rep is not None and self._end - at >= rep.size and limits is rep.limits
                and self._buf.startswith(rep.lead, at)
                and self._buf.startswith(rep.tail, at + PREFIX.size + rep.seq_at + SEQ_VALUE.size)):
            # the whole frame is here and repeats the last header but for seq: one copy, no parsing
            # (a small frame's usual case; every call saved is paid cold on each hop)
            frame = rep.frame(self._buf, at + PREFIX.size)
            payload = self.alloc(rep.layout.size)
            self._start = at + rep.size
            memoryview(payload)[:] = self._view[self._start - rep.layout.size:self._start]
            return attach(frame, rep.layout.metas, payload)
        hlen = parse_prefix(self._view[self._start:self._start + PREFIX.size], limits)
        self._start += PREFIX.size
        if hlen <= len(self._buf):
            self._fill(hlen, "header")
            at = self._start
            self._start += hlen
            if rep is not None and rep.matches(self._buf, at, hlen, limits):
                frame = rep.frame(self._buf, at)
            else:
                header = bytes(self._view[at:at + hlen])
                frame, self._layout = parse_header(header, limits, self._layout)
                self._repeat = Repeat.learn(header, frame, self._layout)
        else:  # a header larger than the buffer (allowed by the limits): read it on its own
            big = bytearray(hlen)
            self._take(memoryview(big), "header")
            frame, self._layout = parse_header(big, limits, self._layout)
            self._repeat = None
        if frame.kind == "shm":
            return self._from_slot(frame)
        if frame.kind == "ipc":
            return self._from_device(frame)
        payload = self.alloc(self._layout.size)  # a repeat's layout is the last one parsed
        self._take(memoryview(payload), "payload")
        return attach(frame, self._layout.metas, payload)

    def _from_slot(self, frame: Frame) -> Frame:
        """A notification (its header checked like a data frame's): the payload is the named slot
        of the connection's ring (shm.Inbox checks offset and length), read in place, or copied
        out once and released at once with `copy_shm`. Returned as the data frame it stands for."""
        if self.inbox is None:
            raise FrameError("a shm notification on a connection that takes no shared memory")
        view, ticket = self.inbox.payload(frame.slot, self._layout.size)
        frame.kind, frame.slot = "data", None
        if self.copy_shm:
            payload = self.alloc(len(view))
            payload[:] = view
            self.inbox.release(ticket)
            return attach(frame, self._layout.metas, payload)
        inbox = self.inbox
        frame.release = lambda: inbox.release(ticket)
        return attach(frame, self._layout.metas, view)

    def _from_device(self, frame: Frame) -> Frame:
        """A cuda-ipc notification (its header checked like a data frame's): the data frame it
        stands for carries no host tensors, only the DeviceFeed its stage runs (cudaipc.py)."""
        if self.device_inbox is None:
            raise FrameError("a cuda-ipc notification on a connection that takes none")
        inbox = self.device_inbox
        frame.device = inbox.take(frame.device, self._layout.metas)
        frame.kind = "data"
        frame.release = inbox.release
        return frame
