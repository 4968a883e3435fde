"""The connection handshake of the data plane: who may open an edge, and what it costs to try.

Every listening socket is reachable by any local process (and by the network on a multi-node
cluster), so a connection proves it belongs to this run before anything it sends is trusted:

1. the consumer sends a challenge, `b"TVPC"` + 16 random bytes (a fresh nonce per connection);
2. the producer answers with a `hello` frame whose `mac` is HMAC-SHA256 of the nonce and the
   hello's run, epoch, first seq and stage, keyed by the run's secret;
3. the consumer checks the MAC, then asks its owner whether this producer may connect now (current
   run and epoch, a producer the plan gives it, not already connected), answers `b"TVPA"` and
   hands the connection on, to be read under the limits the owner returns. A refused producer is
   closed without a word, so its `greet` fails (and a Link retries until its connect timeout:
   a listener busy with other handshakes refuses too).

The secret is 32 random bytes made by the driver for one run and given to each worker through the
control plane (a Ray call or the process launcher's pipe), never on a command line, in a file or
on the data plane; a replayed hello fails because the nonce differs. Until step 3 a connection
costs the consumer a few hundred bytes: the hello is read under `HELLO_LIMITS` (a 256-byte
header, no tensors) with a deadline for the whole hello, at most `MAX_PENDING` handshakes run at
once, and every refusal is logged with the peer's address and the reason (the peer is told
nothing). `Gate` does all of this for a listening socket on one thread with a selector, whichever
way the owner then reads its admitted connections (tcp.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

from tvmpipe.cluster.wire.frames import HELLO_LIMITS, PREFIX, Frame, FrameError, FrameLimits, parse_header, parse_prefix
from tvmpipe.cluster.wire.stream import send

log = logging.getLogger("tvmpipe.cluster.wire.handshake")

CHALLENGE = struct.Struct("<4s16s")  # magic, nonce
CHALLENGE_MAGIC = b"TVPC"
ADMITTED = b"TVPA"  # the consumer's answer to a hello it admits
SECRET_BYTES = 32
HELLO_DEADLINE_S = 5.0  # from accept to a complete hello: a slow or silent peer is cut off then
MAX_PENDING = 32  # handshakes in progress per listener; more connections are refused at once

Address = tuple[str, int]


@dataclass
class Peer:
    """What a listener's owner learns from an authenticated hello: who is sending, under which wiring."""

    stage: int
    run: str
    epoch: int


def new_secret() -> bytes:
    """A run's secret (the driver makes one per Pipeline)."""
    return secrets.token_bytes(SECRET_BYTES)


def hello_mac(secret: bytes, nonce: bytes, run: str, epoch: int, seq: int, stage: int) -> str:
    """The proof a hello carries: HMAC-SHA256 over the nonce and every field the hello asserts."""
    msg = b"tvmpipe hello\0" + nonce + f"{run}\0{epoch}\0{seq}\0{stage}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def greet(sock: socket.socket, secret: bytes, hello: Frame, timeout_s: float) -> None:
    """Producer side: read the consumer's challenge, send `hello` with its MAC, and wait to be
    admitted. Raises OSError if the consumer closes or says nothing within `timeout_s` (it
    refused, and its log says why; or it is not there)."""
    sock.settimeout(timeout_s)
    magic, nonce = CHALLENGE.unpack(_recv_exactly(sock, CHALLENGE.size, "challenge"))
    if magic != CHALLENGE_MAGIC:
        raise ConnectionError(f"not a tvmpipe data-plane listener (challenge {magic!r})")
    mac = hello_mac(secret, nonce, hello.run, hello.epoch, hello.seq, hello.stage)
    send(sock, Frame("hello", hello.run, hello.epoch, hello.seq, hello.stage, mac=mac))
    if _recv_exactly(sock, len(ADMITTED), "admission") != ADMITTED:
        raise ConnectionError("the consumer did not admit this connection")
    sock.settimeout(None)


def _recv_exactly(sock: socket.socket, n: int, what: str) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise ConnectionError(f"the consumer closed the connection instead of its {what} (refused: see its log)")
        got += chunk
    return got


@dataclass
class _Pending:
    """A connection whose hello is still being read (by the gate's thread, non-blocking)."""

    address: Address
    nonce: bytes
    deadline: float
    data: bytearray
    need: int  # bytes of the hello to have: the prefix, then prefix + header


class Gate:
    """Accepts connections on `host` and admits those that complete the handshake (module docstring).

    `secret()` is the current run's secret (None: refuse everything, nothing is wired yet);
    `accept_hello(peer)` returns the `FrameLimits` for that authenticated peer or raises FrameError
    to refuse it; `admit(conn, peer, limits)` gets each admitted, blocking connection, positioned
    right after its hello. All on the gate's one thread, so a hello costs no thread of its own.
    """

    def __init__(self, host: str, secret: Callable[[], bytes | None], accept_hello: Callable[[Peer], FrameLimits],
                 admit: Callable[[socket.socket, Peer, FrameLimits], None], *, max_pending: int | None = None,
                 hello_deadline_s: float | None = None):
        self._secret = secret
        self._accept_hello = accept_hello
        self._admit = admit
        self.max_pending = MAX_PENDING if max_pending is None else max_pending
        self.hello_deadline_s = HELLO_DEADLINE_S if hello_deadline_s is None else hello_deadline_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.address: Address = self._sock.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: dict[socket.socket, _Pending] = {}
        self._closed = False
        self.refused = 0  # connections refused so far (tests, diagnostics)
        self._thread = threading.Thread(target=self._loop, name=f"gate-{self.address[1]}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting; handshakes in progress are closed."""
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for conn in list(self._pending):
            conn.close()
        self._pending.clear()
        self._sel.close()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def pending(self) -> int:
        """Handshakes in progress."""
        return len(self._pending)

    # ---- the gate's thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closed:
            timeout = None
            if self._pending:
                timeout = max(0.0, min(p.deadline for p in self._pending.values()) - time.monotonic())
            try:
                events = self._sel.select(timeout)
            except (OSError, ValueError):  # closed under us
                return
            for key, _ in events:
                if self._closed:
                    return
                try:
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(4096)
                    else:
                        self._read(key.fileobj)
                except OSError:
                    pass
                except Exception:  # a bug here must not end admissions for the listener's lifetime
                    log.exception("data plane %s:%d: gate error", *self.address)
            now = time.monotonic()
            for conn, p in list(self._pending.items()):
                if now >= p.deadline:
                    self._refuse(conn, f"no complete hello within {self.hello_deadline_s:g} s")

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed
            if len(self._pending) >= self.max_pending:
                self.refused += 1
                log.warning("data plane %s:%d refused %s:%d: %d handshakes already in progress",
                            *self.address, *addr[:2], len(self._pending))
                conn.close()
                continue
            nonce = os.urandom(16)
            try:
                conn.setblocking(False)
                tune(conn)
                conn.send(CHALLENGE.pack(CHALLENGE_MAGIC, nonce))  # 20 bytes into an empty buffer
            except OSError as exc:
                conn.close()
                log.info("data plane %s:%d: %s:%d went away before its challenge (%s)", *self.address,
                         *addr[:2], exc)
                continue
            self._pending[conn] = _Pending(addr[:2], nonce, time.monotonic() + self.hello_deadline_s, bytearray(),
                                           PREFIX.size)
            self._sel.register(conn, selectors.EVENT_READ, None)

    def _read(self, conn: socket.socket) -> None:
        p = self._pending[conn]
        try:
            chunk = conn.recv(p.need - len(p.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._refuse(conn, f"{type(exc).__name__}: {exc}")
        if not chunk:
            return self._refuse(conn, f"closed after {len(p.data)} bytes of its hello")
        p.data += chunk
        if len(p.data) < p.need:
            return
        try:
            if p.need == PREFIX.size:  # the prefix is in: now the header, under the hello's bound
                p.need += parse_prefix(bytes(p.data), HELLO_LIMITS)
                return
            peer, limits = self._check(p)
        except FrameError as exc:
            return self._refuse(conn, str(exc))
        except Exception as exc:  # the owner's bug must not stop the gate: refuse this one, log why
            log.exception("data plane %s:%d: accept_hello failed", *self.address)
            return self._refuse(conn, f"{type(exc).__name__}: {exc}")
        del self._pending[conn]
        self._sel.unregister(conn)
        try:
            conn.send(ADMITTED)  # 4 bytes; the socket's buffer holds only the challenge, long sent
        except OSError as exc:
            conn.close()
            log.info("data plane %s:%d: %s:%d went away before its admission (%s)", *self.address, *p.address, exc)
            return
        conn.setblocking(True)
        self._admit(conn, peer, limits)

    def _check(self, p: _Pending) -> tuple[Peer, FrameLimits]:
        """The hello's proof, then the owner's say (FrameError: refused)."""
        hello, _ = parse_header(bytes(p.data[PREFIX.size:]), HELLO_LIMITS)
        if hello.kind != "hello":
            raise FrameError(f"first frame is {hello.kind!r}, expected hello")
        secret = self._secret()
        if secret is None:
            raise FrameError("no run is wired here yet")
        want = hello_mac(secret, p.nonce, hello.run, hello.epoch, hello.seq, hello.stage)
        if hello.mac is None or not hmac.compare_digest(hello.mac.encode(), want.encode()):
            raise FrameError(f"hello claiming stage {hello.stage} epoch {hello.epoch} failed authentication")
        peer = Peer(hello.stage, hello.run, hello.epoch)
        return peer, self._accept_hello(peer)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        p = self._pending.pop(conn)
        self.refused += 1
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        log.warning("data plane %s:%d refused %s:%d: %s", *self.address, *p.address, why)
