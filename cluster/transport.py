"""The data plane: one TCP stream per pipeline edge, frames in sequence order.

Ray carries only control (placement, lifecycle, addresses); tensors go producer -> consumer over
these sockets, because a plain Ray actor call costs ~1 ms and ~210 MB/s per hop on the machines we
measured, against tens of microseconds and GB/s for a socket (docs/cluster.md has the numbers).

A `Listener` accepts connections; each starts with a `hello` frame naming the producer, the run and
the wiring epoch, which the owner accepts (returning the limits for that peer) or refuses. A `Link`
is the sending end: small frames are sent at once by the producer, large ones by a thread that
drains a bounded queue so the producer's compute overlaps the transfer.
Errors never escape a thread: they close that connection and are reported through a callback.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tvmpipe.cluster import frames
from tvmpipe.cluster.frames import Frame, FrameError, FrameLimits

Address = tuple[str, int]
HELLO_TIMEOUT_S = 10.0
INLINE_BYTES = 64 << 10  # frames up to this size are sent by the producing thread itself


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class Peer:
    """What a listener's owner learns from a hello: who is sending, under which wiring."""

    stage: int
    run: str
    epoch: int


class Listener:
    """Accepts producer connections and feeds their frames to the owner.

    `accept_hello(peer)` returns the `FrameLimits` for that peer or raises FrameError to refuse it;
    `on_frame(peer, frame)` gets every later frame; `on_close(peer, error)` is called once per
    accepted peer when its stream ends (error None: clean EOF or local close). `retains_frames`:
    the owner keeps received arrays for long (the driver's outputs), see frames.retained_buffer.
    """

    def __init__(self, host: str, accept_hello: Callable[[Peer], FrameLimits],
                 on_frame: Callable[[Peer, Frame], None], on_close: Callable[[Peer, Exception | None], None],
                 retains_frames: bool = False):
        self._accept_hello = accept_hello
        self._alloc = frames.retained_buffer if retains_frames else frames.fresh_buffer
        self._on_frame = on_frame
        self._on_close = on_close
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.address: Address = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._dropped: set[socket.socket] = set()  # closed on purpose: their errors are not the peer's
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"accept-{self.address[1]}", daemon=True)
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name=f"recv-{self.address[1]}")
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        peer: Peer | None = None
        error: Exception | None = None
        try:
            _tune(conn)
            conn.settimeout(HELLO_TIMEOUT_S)
            reader = frames.FrameReader(conn, alloc=self._alloc)
            hello = reader.read()
            if hello is None:
                return
            if hello.kind != "hello":
                raise FrameError(f"first frame is {hello.kind!r}, expected hello")
            candidate = Peer(hello.stage, hello.run, hello.epoch)
            reader.limits = self._accept_hello(candidate)
            peer = candidate
            conn.settimeout(None)
            while True:
                frame = reader.read()
                if frame is None:
                    return
                if frame.kind == "hello":
                    raise FrameError("a second hello on one connection")
                if frame.epoch != peer.epoch or frame.run != peer.run or frame.stage != peer.stage:
                    raise FrameError(f"frame claims stage {frame.stage} epoch {frame.epoch} on a connection "
                                     f"opened by stage {peer.stage} epoch {peer.epoch}")
                self._on_frame(peer, frame)
        except (FrameError, OSError) as exc:
            error = exc
        finally:
            with self._lock:
                self._conns.discard(conn)
                if self._closed or conn in self._dropped:
                    error = None
                self._dropped.discard(conn)
            conn.close()
            if peer is not None:
                self._on_close(peer, error)

    def drop_connections(self) -> None:
        """Close every accepted connection (a new wiring epoch starts); keep listening."""
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
            self._dropped.update(conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=5)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self.drop_connections()
        self._accept_thread.join(timeout=5)


class Link:
    """The sending end of one edge: connects, says hello, then sends frames in order.

    A small frame is sent by the caller itself when nothing is queued or being sent: a hand-off to
    another thread costs a wake-up (tens of microseconds on a busy 2-core machine), more than the
    send. Larger frames go to a queue that a sender thread drains, so the producer computes the
    next micro-batch while a big tensor is on the wire. `put` blocks while `depth` frames are queued
    (backpressure on the producer). After a send error the link is dead: `on_error` has been called
    once and further frames are dropped.
    """

    def __init__(self, address: Address, hello: Frame, on_error: Callable[[Exception], None],
                 depth: int = 8, connect_timeout_s: float = 10.0, inline_bytes: int = INLINE_BYTES):
        self.address = address
        self.bytes_sent = 0
        self.frames_sent = 0
        self._on_error = on_error
        self._depth = depth
        self._inline_bytes = inline_bytes
        lock = threading.Lock()
        self._work = threading.Condition(lock)  # the sender thread waits here for queued frames
        self._room = threading.Condition(lock)  # producers wait here while the queue is full
        self._pending: deque[Frame] = deque()
        self._busy = False  # a frame is being sent (by the caller or the thread)
        self._dead = False
        self._closing = False
        self._sock = _connect(address, connect_timeout_s)
        try:
            frames.send(self._sock, hello)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._send_loop, daemon=True, name=f"send-{address[1]}")
        self._thread.start()

    def put(self, frame: Frame) -> None:
        with self._room:
            while len(self._pending) >= self._depth and not self._dead:
                self._room.wait()
            if self._dead:
                return
            if self._busy or self._pending or frame.nbytes > self._inline_bytes:
                self._pending.append(frame)
                if not self._busy:
                    self._work.notify()
                return
            self._busy = True
        self._send(frame)

    def _send(self, frame: Frame) -> None:
        """Send one frame; the caller has set _busy, which this clears. Wakes the sender thread
        only when there is queued work for it: a needless wake-up costs as much as the send."""
        error = None
        try:
            n = frames.send(self._sock, frame)
        except (OSError, FrameError) as exc:
            error = exc
        with self._work:
            self._busy = False
            if error is None:
                self.bytes_sent += n
                self.frames_sent += 1
                if self._pending:
                    self._work.notify()
            elif not self._dead:
                self._dead = True
                self._pending.clear()
                self._work.notify()
                self._room.notify_all()
            else:
                error = None  # closed on purpose
        if error is not None:
            self._on_error(error)

    def _send_loop(self) -> None:
        while True:
            with self._work:
                while not self._dead and (self._busy or (not self._pending and not self._closing)):
                    self._work.wait()
                if self._dead or not self._pending:
                    return  # dead, or closing with everything sent
                frame = self._pending.popleft()
                self._busy = True
                self._room.notify()
            self._send(frame)

    def close(self, flush: bool = True) -> None:
        """Stop the link: after sending what is queued (`flush`), or at once."""
        with self._work:
            self._closing = True
            if not flush:
                self._dead = True
                self._pending.clear()
            self._work.notify()
            self._room.notify_all()
        self._thread.join(timeout=30 if flush else 5)
        with self._work:
            self._dead = True
            self._room.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # unblocks a send in progress
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()


def _connect(address: Address, timeout_s: float) -> socket.socket:
    """Connect, retrying briefly: a peer's listener may be a moment behind the control plane."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
            sock.settimeout(None)
            _tune(sock)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
