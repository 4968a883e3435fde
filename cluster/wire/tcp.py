"""The data plane: one TCP stream per pipeline edge, frames in sequence order.

Ray carries only control (placement, lifecycle, addresses, the run's secret); tensors go producer
-> consumer over these sockets, because a plain Ray actor call costs ~1 ms and ~210 MB/s per hop on
the machines we measured, against tens of microseconds and GB/s for a socket (docs/cluster.md).

Every listener admits connections through a `Gate` (handshake.py): an HMAC challenge-response
proves the producer holds the run's secret, the owner accepts its hello (returning the exact
limits for that peer) or refuses it, and hellos are read with a deadline, a cap on handshakes in
progress and every refusal logged, on one thread per listener. What differs is how admitted
connections are read, and both ways are kept because each saves a thread wake-up per micro-batch
where it is used (measured, docs/cluster.md "Two readers"):

* `Listener` (stage workers): a thread per admitted connection, blocked in `recv`, calls the owner
  itself, so a stage computes a small micro-batch on the thread the kernel woke. Admitted
  connections are at most one per planned producer and epoch, so the threads are bounded by the plan.
* `PolledListener` (the driver): one selector, read by whichever thread waits for outputs.

A `Link` is the sending end: small frames are sent at once by the producer, large ones by a thread
that drains a bounded queue so the producer's compute overlaps the transfer. Errors never escape
a thread: they close that connection, are logged, and are reported through a callback.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import weakref
import time
import traceback
from collections import deque
from typing import Any, Callable, Iterable

from tvmpipe.cluster.wire import frames, shm, stream
from tvmpipe.cluster.wire.frames import Frame, FrameError, FrameLimits
from tvmpipe.cluster.wire.handshake import Address, Gate, Peer, greet, tune

log = logging.getLogger("tvmpipe.cluster.wire.tcp")
INLINE_BYTES = 64 << 10  # frames up to this size are sent by the producing thread itself


def _check_follower(peer: Peer, frame: Frame) -> None:
    """Every frame after the hello repeats its producer, run and epoch."""
    if frame.kind == "hello":
        raise FrameError("a second hello on one connection")
    if frame.epoch != peer.epoch or frame.run != peer.run or frame.stage != peer.stage:
        raise FrameError(f"frame claims stage {frame.stage} epoch {frame.epoch} on a connection "
                         f"opened by stage {peer.stage} epoch {peer.epoch}")


class _Acceptor:
    """What both listeners share: the owner's callbacks, a `Gate` that admits authenticated
    connections (handshake.py: challenge, deadline, cap, refusals logged) and hands each to
    `_on_admit`, and the admitted connections. `secret` is the current run's; None refuses all."""

    def __init__(self, host: str, accept_hello: Callable[[Peer], FrameLimits],
                 on_frame: Callable[[Peer, Frame], None], on_close: Callable[[Peer, Exception | None], None],
                 retains_frames: bool = False, secret: bytes | None = None):
        self.secret = secret
        # (peer, conn) -> a cudaipc.DeviceInbox for a connection that may carry ipc notes, or None
        self.device_inbox: Callable[[Peer, socket.socket], Any] | None = None
        # connections with one: shut for reading only, so that the consumer can still tell its
        # producer that it closed the handles (cudaipc.CLOSED) before closing the connection
        self._device_conns: "weakref.WeakSet[socket.socket]" = weakref.WeakSet()
        self._alloc = stream.retained_buffer if retains_frames else stream.fresh_buffer
        self._on_frame = on_frame
        self._on_close = on_close
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # admitted and not finished
        self._dropped: set[socket.socket] = set()  # closed on purpose: their errors are not the peer's
        self._closed = False
        self._gate = Gate(host, lambda: self.secret, accept_hello, self._admitted)
        self.address: Address = self._gate.address

    def _on_admit(self, conn: socket.socket, reader: stream.FrameReader, peer: Peer) -> None:
        raise NotImplementedError

    def _admitted(self, conn: socket.socket, peer: Peer, limits: FrameLimits) -> None:
        """The gate admitted `conn` (gate thread)."""
        inbox = shm.Inbox(peer.run, peer.epoch, conn) if shm.usable(peer.run) else None
        device = self.device_inbox(peer, conn) if self.device_inbox is not None else None
        if device is not None:
            self._device_conns.add(conn)
        reader = stream.FrameReader(conn, limits, alloc=self._alloc, inbox=inbox,
                                    copy_shm=self._alloc is stream.retained_buffer, device_inbox=device)
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
            self._on_admit(conn, reader, peer)

    def _shut_down_accepted(self) -> list[socket.socket]:
        """Mark every admitted connection dropped and shut it down (its reader sees the end);
        returns them."""
        with self._lock:
            conns = list(self._conns)
            self._dropped.update(conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RD if c in self._device_conns else socket.SHUT_RDWR)
            except OSError:
                pass
        return conns

    def _stop_accepting(self) -> None:
        """Mark closed and close the gate (no more connections)."""
        with self._lock:
            self._closed = True
        self._gate.close()


def _peer_address(conn: socket.socket) -> str:
    try:
        return "%s:%d" % conn.getpeername()[:2]
    except OSError:
        return "?"


def _log_end(address: Address, conn: socket.socket, peer: Peer, error: Exception | None) -> None:
    """A connection the owner or a bad frame ended (before it is closed): logged with the peer."""
    if error is not None:
        log.warning("data plane %s:%d dropped stage %d (epoch %d) at %s: %s: %s", *address, peer.stage,
                    peer.epoch, _peer_address(conn), type(error).__name__, error)


class Listener(_Acceptor):
    """Accepts producer connections and feeds their frames to the owner.

    `accept_hello(peer)` returns the `FrameLimits` for that peer or raises FrameError to refuse it;
    `on_frame(peer, frame)` gets every later frame; `on_close(peer, error)` is called once per
    accepted peer when its stream ends (error None: clean EOF or local close). `retains_frames`:
    the owner keeps received arrays for long (the driver's outputs), see stream.retained_buffer.

    Each admitted connection gets a thread that blocks in `recv` and calls `on_frame` itself (a
    worker computes small micro-batches right there: one wake-up per hop). Only authenticated
    producers the owner accepts get one, at most one per producer and epoch, so the threads are
    bounded by the plan; hellos are read by the gate.
    """

    def __init__(self, host: str, accept_hello: Callable[[Peer], FrameLimits],
                 on_frame: Callable[[Peer, Frame], None], on_close: Callable[[Peer, Exception | None], None],
                 retains_frames: bool = False, secret: bytes | None = None):
        super().__init__(host, accept_hello, on_frame, on_close, retains_frames, secret)
        self._threads: list[threading.Thread] = []
        self._gate.start()

    def _on_admit(self, conn: socket.socket, reader: stream.FrameReader, peer: Peer) -> None:
        t = threading.Thread(target=self._serve, args=(conn, reader, peer), daemon=True,
                             name=f"recv-{self.address[1]}")
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _serve(self, conn: socket.socket, reader: stream.FrameReader, peer: Peer) -> None:
        error: Exception | None = None
        try:
            while True:
                frame = reader.read()
                if frame is None:
                    return
                _check_follower(peer, frame)
                self._on_frame(peer, frame)
        except (FrameError, OSError) as exc:
            error = exc
        finally:
            with self._lock:
                self._conns.discard(conn)
                if self._closed or conn in self._dropped:
                    error = None
                self._dropped.discard(conn)
            _log_end(self.address, conn, peer, error)
            if reader.device_inbox is not None:  # CUDA's rule: handles closed before the producer frees
                try:
                    reader.device_inbox.close()
                except Exception as exc:  # noqa: BLE001 - reported, the connection still ends
                    log.warning("closing CUDA IPC handles from stage %d: %s", peer.stage, exc)
            conn.close()
            if reader.inbox is not None:
                reader.inbox.close()
            self._on_close(peer, error)

    def drop_connections(self) -> None:
        """Close every accepted connection (a new wiring epoch starts); keep listening."""
        with self._lock:
            threads = list(self._threads)
        self._shut_down_accepted()
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=5)

    def close(self) -> None:
        self._stop_accepting()
        self.drop_connections()


class PolledListener(_Acceptor):
    """A Listener (same callbacks, same guarantees) whose frames are read by the thread that waits
    for them.

    The driver's get() would otherwise sleep until a receiving thread hands it the outputs: a
    second wake-up on every micro-batch's path, ~50 us on a 2-vCPU VM (half a hop). Here accepted
    connections sit in one selector and a *reader role* (a lock) says who reads: a thread waiting
    for frames calls `pump(until, timeout)` and reads them itself; when nobody has pumped for
    GRACE_S a background thread takes the role, so results and error reports keep flowing while the
    owner is busy elsewhere. Frames are handled one at a time, in order per connection. Hellos are
    read by the gate, as in Listener.
    """

    GRACE_S = 0.005

    def __init__(self, host: str, accept_hello: Callable[[Peer], FrameLimits],
                 on_frame: Callable[[Peer, Frame], None], on_close: Callable[[Peer, Exception | None], None],
                 retains_frames: bool = False, secret: bytes | None = None):
        super().__init__(host, accept_hello, on_frame, on_close, retains_frames, secret)
        self._changed = threading.Condition(self._lock)  # a connection ended, or closing
        self._round = threading.Condition(self._lock)  # the reader ended a round (for pumpers waiting)
        self._round_waiters = 0
        self._role = threading.Lock()  # held by the thread that reads; only it touches _sel
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()  # a byte here: the reader looks up
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._new: list[tuple[socket.socket, stream.FrameReader, Peer]] = []  # for the reader to register
        self._pumpers = 0
        self._last_pump = 0.0
        self._background_thread = threading.Thread(target=self._background, name=f"poll-{self.address[1]}",
                                                   daemon=True)
        self._gate.start()
        self._background_thread.start()

    # ---- connections -------------------------------------------------------------------------
    def _on_admit(self, conn: socket.socket, reader: stream.FrameReader, peer: Peer) -> None:
        """(lock held) The reader registers it in its next round."""
        self._new.append((conn, reader, peer))
        self.wake()

    def _finish(self, conn: socket.socket, peer: Peer, error: Exception | None) -> None:
        """A connection ended (role held): forget it, close it, tell the owner."""
        try:
            key = self._sel.unregister(conn)
            if key.data is not None and key.data[0].inbox is not None:
                key.data[0].inbox.close()
        except (KeyError, ValueError):
            pass
        with self._lock:
            if self._closed or conn in self._dropped:
                error = None  # closed on purpose: not the peer's fault
        _log_end(self.address, conn, peer, error)
        conn.close()
        try:
            self._on_close(peer, error)
        except Exception:  # the owner's bug must not stop the reader (a threaded Listener loses one thread)
            traceback.print_exc()
        finally:  # only now: drop_connections() returns after every on_close
            with self._lock:
                self._conns.discard(conn)
                self._dropped.discard(conn)
                self._changed.notify_all()

    def wake(self) -> None:
        """Make the reading thread look up now: a pumper re-checks its `until()` (the owner's state
        changed elsewhere), the background reader sees a pumper waiting or the listener closing."""
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (the reader has plenty to look at) or closed
            pass

    # ---- reading -----------------------------------------------------------------------------
    def _read(self, conn: socket.socket, reader: stream.FrameReader, peer: Peer) -> None:
        """Frames from a readable connection: at least one, and every one already buffered."""
        error: Exception | None = None
        try:
            while True:
                frame = reader.read()
                if frame is None:
                    break  # clean end of stream
                _check_follower(peer, frame)
                self._on_frame(peer, frame)
                if not reader.buffered:
                    return
        except Exception as exc:  # a bad frame, a broken socket, or the owner refusing a frame
            error = exc
        self._finish(conn, peer, error)

    def _poll(self, timeout: float | None) -> None:
        """One round of reading (role held): new connections, then what is readable."""
        with self._lock:
            new, self._new = self._new, []
        handled = False
        for conn, reader, peer in new:
            self._sel.register(conn, selectors.EVENT_READ, (reader, peer))
            if reader.buffered:  # frames that came in with the hello
                self._read(conn, reader, peer)
                handled = True
        for key, _ in self._sel.select(0 if handled else timeout):  # the caller looks at what was read
            if key.data is None:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
            elif key.fileobj.fileno() >= 0:  # not finished earlier in this round
                self._read(key.fileobj, *key.data)

    def pump(self, until: Callable[[], bool], timeout: float) -> None:
        """Read frames on this thread until `until()` holds, `timeout` passes or the listener closes.

        Several threads may pump at once (a producer in submit(), a consumer in get()): one holds the
        reader role a round at a time, the others wait for the end of a round and look at their own
        `until()`, so nobody waits for frames that another thread has already read."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return
            self._pumpers += 1
        try:
            while not until() and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                if self._role.acquire(blocking=False):
                    try:
                        self._poll(left)
                    finally:
                        self._role.release()
                        self._end_round()
                    continue
                self.wake()  # the reader ends its round (the background reader lets go for good)
                with self._lock:
                    if self._role.locked():
                        self._round_waiters += 1
                        try:
                            self._round.wait(min(left, 0.05))
                        finally:
                            self._round_waiters -= 1
        finally:
            with self._lock:
                self._pumpers -= 1
                self._last_pump = time.monotonic()

    def _background(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (self._pumpers or time.monotonic() - self._last_pump < self.GRACE_S):
                    self._changed.wait(self.GRACE_S)
                if self._closed:
                    return
            try:
                with self._role:
                    while not self._closed and not self._pumpers:
                        self._poll(None)
            finally:
                self._end_round()

    def _end_round(self) -> None:
        """The role was released: pumpers waiting for it look at their `until()` and may take it."""
        with self._lock:
            if self._round_waiters:
                self._round.notify_all()

    # ---- ending ------------------------------------------------------------------------------
    def drop_connections(self) -> None:
        """Close every accepted connection (a new wiring epoch starts); keep listening. Returns
        once each has been finished (its on_close called), or after 5 s."""
        conns = self._shut_down_accepted()
        self.wake()
        deadline = time.monotonic() + 5
        with self._lock:
            while any(c in self._conns for c in conns) and time.monotonic() < deadline:
                self._changed.wait(0.05)

    def close(self) -> None:
        self._stop_accepting()
        with self._lock:
            self._changed.notify_all()
            self._round.notify_all()
        self.wake()
        with self._role:  # the background reader and any pumper have let go
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    self._finish(key.fileobj, key.data[1], None)
            with self._lock:
                new, self._new = self._new, []
            for conn, _, peer in new:  # handshaken but never registered
                self._finish(conn, peer, None)
            self._sel.close()
        self._background_thread.join(timeout=5)
        self._wake_r.close()
        self._wake_w.close()


class Link:
    """The sending end of one edge: connects, says hello, then sends frames in order.

    A small frame is sent by the caller itself when nothing is queued or being sent: a hand-off to
    another thread costs a wake-up (tens of microseconds on a busy 2-core machine), more than the
    send. Larger frames go to a queue that a sender thread drains, so the producer computes the
    next micro-batch while a big tensor is on the wire. `put` blocks while `depth` frames are queued
    (backpressure on the producer). After a send error the link is dead: `on_error` has been called
    once and further frames are dropped.
    """

    def __init__(self, address: Address, hello: Frame, secret: bytes, on_error: Callable[[Exception], None],
                 depth: int = 8, connect_timeout_s: float = 10.0, inline_bytes: int = INLINE_BYTES,
                 ring_slots: int = 0, frame_bytes: int = 0, device_ring: Callable[[], Any] | None = None):
        """`ring_slots` > 0: the consumer runs on this node, so data frames go through a shared-memory
        ring of that many slots of `frame_bytes` (shm.py; at least 2, at most shm.RING_BYTES); if the ring cannot be made (no /dev/shm,
        no room) the link says so in the log and stays on TCP. `path` says which it took.
        `device_ring`: makes the cudaipc.DeviceRing of an edge between two cuda stages on this node;
        data frames that carry their outputs' device pointers (Frame.device) then go through it
        ("cuda-ipc"), others (replays) over TCP; if it cannot be made, the edge stays on TCP."""
        self.address = address
        self.bytes_sent = 0
        self.frames_sent = 0
        self._on_error = on_error
        self._depth = depth
        self._inline_bytes = inline_bytes
        self._lock = threading.Lock()  # the fast path (nothing queued, small frame) takes only this
        self._work = threading.Condition(self._lock)  # the sender thread waits here for queued frames
        self._room = threading.Condition(self._lock)  # producers wait here while the queue is full
        self._settled = threading.Condition(self._lock)  # counts() waits here for a send in progress
        self._pending: deque[Frame] = deque()
        self._busy = False  # a frame is being sent (by the caller or the thread)
        self._dead = False
        self._closing = False
        self._encoder = frames.Encoder()  # used by one sending thread at a time (_busy)
        self._sock = _connect(address, hello, secret, connect_timeout_s)
        self._ring: shm.RingWriter | None = None
        self._ring_lock = threading.Lock()  # a ticket's slot, copy and notification go out in order
        if ring_slots:
            try:
                self._ring = shm.RingWriter(hello.run, hello.epoch, shm.slot_count(ring_slots, frame_bytes),
                                            frame_bytes)
            except (OSError, ValueError) as exc:
                log.warning("edge from stage %d to %s:%d stays on TCP: no shared-memory ring (%s)", hello.stage,
                            *address, exc)
        self._device_ring = None
        if device_ring is not None:
            try:
                self._device_ring = device_ring()
            except Exception as exc:  # noqa: BLE001 - any driver refusal: the host path
                log.warning("edge from stage %d to %s:%d stays on TCP: no CUDA IPC ring (%s)", hello.stage,
                            *address, exc)
        self.path = "shm" if self._ring is not None else "cuda-ipc" if self._device_ring is not None else "tcp"
        self._thread = threading.Thread(target=self._send_loop, daemon=True, name=f"send-{address[1]}")
        self._thread.start()

    def put(self, frame: Frame) -> None:
        dring = self._device_ring
        if dring is not None and frame.kind == "data" and frame.device is not None:
            with self._ring_lock:  # wait for a released slot (backpressure), copy on the device, notify
                if not dring.wait_free(self._sock, lambda: not self._dead):
                    self._fail(ConnectionError("the consumer closed the connection"))
                    return
                note = dring.write(frame.device)
                self._put(Frame("ipc", frame.run, frame.epoch, frame.seq, frame.stage, frame.tensors, frame.names,
                                device=note))
            return
        if frame.device is not None:  # device pointers mean nothing to another path
            frame = Frame(frame.kind, frame.run, frame.epoch, frame.seq, frame.stage, frame.tensors, frame.names)
        ring = self._ring
        if ring is not None and frame.kind == "data":
            with self._ring_lock:  # wait for a released slot (backpressure), fill it, notify
                if not ring.wait_free(self._sock, lambda: not self._dead):
                    self._fail(ConnectionError("the consumer closed the connection"))
                    return
                self._put(ring.write(frame))
            return
        self._put(frame)

    def _fail(self, error: Exception) -> None:
        """The link is dead: drop what is queued, wake everyone, tell the owner once."""
        with self._lock:
            if self._dead:
                return
            self._dead = True
            self._pending.clear()
            self._work.notify()
            self._room.notify_all()
        self._on_error(error)

    def _put(self, frame: Frame) -> None:
        with self._lock:
            if self._busy or self._pending or self._dead or frame.nbytes > self._inline_bytes:
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
            n = stream.send(self._sock, frame, self._encoder)
            if frame.slot is not None:
                n += frame.slot[2]  # the tensor bytes it carried through shared memory
            elif frame.kind == "ipc":
                n += sum([a.nbytes for a in frame.tensors.values()])  # copied device to device
        except Exception as exc:  # noqa: BLE001 - a socket error or a frame the codec refuses: the link dies,
            error = exc           # reported once; never a dead sender thread with the link left busy
        with self._lock:
            self._busy = False
            self._settled.notify_all()
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

    def counts(self, wait_s: float = 1.0) -> tuple[int, int]:
        """(bytes, frames) sent, once the send in progress (if any) has been counted: the peer may
        already hold a frame whose sendmsg has returned but whose count is not yet added, and stats
        read right after a run must include the last frame. Waits at most `wait_s`."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while self._busy and not self._dead and (left := deadline - time.monotonic()) > 0:
                self._settled.wait(left)
            return self.bytes_sent, self.frames_sent

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
        if self._device_ring is not None:  # waits for the consumer to close its handles, then frees
            with self._ring_lock:
                self._device_ring.close(self._sock)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # unblocks a send in progress
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()
        if self._ring is not None:
            self._ring.close(grace_s=2.0 if flush else 0.0)


def tally(links: Iterable[tuple[int, Link]], bytes_out: dict[int, int], frames_out: dict[int, int]) -> None:
    """Add each (consumer, link)'s counts (Link.counts) to the per-consumer totals, in place."""
    for dst, link in links:
        nbytes, frames = link.counts()
        bytes_out[dst] = bytes_out.get(dst, 0) + nbytes
        frames_out[dst] = frames_out.get(dst, 0) + frames


def _connect(address: Address, hello: Frame, secret: bytes, timeout_s: float) -> socket.socket:
    """Connect and say hello (handshake.greet), retrying briefly: a peer's listener may be a moment
    behind the control plane, or busy with other handshakes (it closes us without a challenge)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = None
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
            tune(sock)
            greet(sock, secret, hello, max(0.1, deadline - time.monotonic()))
            return sock
        except OSError:
            if sock is not None:
                sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
