"""Shared-memory rings: the same-node data path of one pipeline edge (docs/cluster.md "Shared memory").

Between two processes on one node a frame's bytes need not cross the TCP stack (two copies through
the kernel, one system call per 64 KB or so): the producer writes the tensors once into a slot of a
segment both processes map, and sends only a small `shm` notification frame (ring name, offset,
length, seq, tensor list) over the edge's existing authenticated connection. The consumer checks
the notification like any header (the edge's exact layout, FrameLimits.exact), checks that the
offset is the slot it expects and that offset + length lie inside the segment it mapped, and reads
the tensors in place. One copy remains per hop (producer outputs -> slot); the driver, which hands
its outputs to the user for as long as the user keeps them, copies once more out of the slot.

Layout of a segment (`/dev/shm/tvmpipe-<run>-<epoch>-<32 hex>`):

    0      magic "TVPRING1", slots (u64), slot_bytes (u64)
    24     waiting (u64): the producer sleeps on its socket for a released slot (see Inbox.release)
    64     released[slots] (u64): ticket + 1 of the last frame the consumer let go of in each slot
    4096   slot 0, slot 1, ... each `slot_bytes` (a multiple of 4096), tensors at the frame codec's
           offsets (frames.ALIGN), so a slot is a frame's payload exactly

Frame t of a ring (its ticket, counted from 0 on each connection) goes in slot t % slots, and only
once the consumer has released ticket t - slots there: memory is bounded by `slots` (a window's
worth), and a slow consumer holds its producer back (backpressure) as a full socket would.

Who can open a segment: the name has 128 random bits and is never written anywhere but the edge's
authenticated connection; the file is created O_EXCL with mode 0600 (only its uid, and root, may
open it); and the consumer unlinks it as soon as it has mapped it, so from the first frame on there
is no name left to open at all. Against other users, 0600 holds; against other processes of the
same uid (or root), which could equally ptrace the run, the unguessable name and the early unlink
are what protect. Cleanup: the consumer unlinks at open; the producer unlinks at close; a worker
removes its run's older-epoch names when re-wired and all of its run's names when closed; the
reaper (reaper.py) unlinks every segment the run's processes have mapped after a SIGKILL.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import select
import socket
import stat
import struct
import time
from dataclasses import dataclass

import numpy as np

from tvmpipe.cluster.wire.frames import Frame, FrameError, payload_bytes

SHM_DIR = "/dev/shm"
PREFIX = "tvmpipe-"
MAGIC = b"TVPRING1"
HEAD = struct.Struct("<8sQQ")  # magic, slots, slot_bytes
WAITING_AT = 24
RELEASED_AT = 64
HEADER_BYTES = 4096
PAGE = 4096
MAX_SLOTS = (HEADER_BYTES - RELEASED_AT) // 8
TRANSPORTS = ("auto", "tcp", "shm", "cuda-ipc")  # cuda-ipc: as auto (cudaipc.py takes cuda stage edges either way)
# "auto" takes shared memory for edges whose frames are at least this large: below it a frame is
# one sendmsg anyway, and the notification costs as much as the bytes it replaces (measured,
# docs/cluster.md "Shared memory").
AUTO_MIN_BYTES = 64 << 10
RING_BYTES = 1 << 30  # at most this much shared memory per edge, whatever the window (>= 2 slots)
_RUN_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
_NAME_RE = re.compile(r"tvmpipe-([A-Za-z0-9_]{1,64})-(\d{1,18})-[0-9a-f]{32}")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
SPIN_S = 50e-6  # a released slot is looked for this long before the producer sleeps on its socket
WAKE_S = 0.005  # the longest a producer sleeps between looks (a lost nudge costs at most this)


@dataclass(frozen=True)
class Node:
    """Where a process runs: its Ray node id when it is part of a Ray cluster (None otherwise), and
    its host's boot id (the same kernel, hence the same /dev/shm). Never guessed from addresses."""

    host: str
    ray: str | None = None

    def same(self, other: Node) -> bool:
        """Two processes share a node: by Ray node id when both have one (Ray may run several nodes
        on one kernel, as the multi-host bed does: those are different nodes), else by host."""
        if self.ray is not None and other.ray is not None:
            return self.ray == other.ray
        return self.host == other.host


def node_identity() -> Node:
    """This process's Node."""
    ray_id = None
    try:
        import ray

        if ray.is_initialized():
            ray_id = ray.get_runtime_context().get_node_id()
    except Exception:  # no Ray, or not connected: a plain process
        pass
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            host = f.read().strip()
    except OSError:
        host = socket.gethostname()
    return Node(host, ray_id)


def usable(run: str) -> bool:
    """Shared memory can carry this run's frames here (a run id that fits segment names, a /dev/shm)."""
    return bool(_RUN_RE.fullmatch(run)) and os.path.isdir(SHM_DIR)


def choose(transport: str, same_node: bool, frame_bytes: int) -> str:
    """The path of one edge: "shm" only between processes of one node; "auto" also needs frames
    of at least AUTO_MIN_BYTES; "tcp" never."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if not same_node or transport == "tcp":
        return "tcp"
    return "shm" if transport == "shm" or frame_bytes >= AUTO_MIN_BYTES else "tcp"


def slot_count(window: int, frame_bytes: int, budget: int = RING_BYTES) -> int:
    """A window's worth of slots, at least 2 (one being read, one being written), at most what
    `budget` bytes hold beyond that."""
    slot = _slot_bytes(frame_bytes)
    return max(2, min(window, MAX_SLOTS, budget // slot))


def _slot_bytes(frame_bytes: int) -> int:
    return max(PAGE, (frame_bytes + PAGE - 1) // PAGE * PAGE)


def segment_names(run: str | None = None, below_epoch: int | None = None) -> list[str]:
    """Names in /dev/shm of this run's segments (every tvmpipe segment if `run` is None), those
    of epochs below `below_epoch` only if given."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    out = []
    for n in names:
        m = _NAME_RE.fullmatch(n)
        if m and (run is None or m.group(1) == run) and (below_epoch is None or int(m.group(2)) < below_epoch):
            out.append(n)
    return out


def sweep(run: str, below_epoch: int | None = None) -> int:
    """Unlink the run's segments (older epochs only, if given); returns how many were removed."""
    n = 0
    for name in segment_names(run, below_epoch):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            n += 1
        except OSError:
            pass
    return n


@dataclass(frozen=True)
class Geometry:
    """A ring's shape, as its consumer read and checked it once at open (the producer cannot change
    it afterwards: the consumer never reads the segment's header again)."""

    slots: int
    slot_bytes: int
    size: int  # mapped bytes

    def offset(self, ticket: int) -> int:
        return HEADER_BYTES + (ticket % self.slots) * self.slot_bytes


class RingWriter:
    """The producer's end: creates the segment, copies each frame's tensors into the next free slot."""

    def __init__(self, run: str, epoch: int, slots: int, frame_bytes: int):
        if not _RUN_RE.fullmatch(run):
            raise ValueError(f"run id {run!r} cannot name a segment")
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
        self.name = f"{PREFIX}{run}-{epoch}-{secrets.token_hex(16)}"
        self.path = os.path.join(SHM_DIR, self.name)
        slot_bytes = _slot_bytes(frame_bytes)
        self.geometry = Geometry(slots, slot_bytes, HEADER_BYTES + slots * slot_bytes)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask could only narrow it; said explicitly all the same
            # reserve the pages now: a full /dev/shm fails here (ENOSPC, we fall back to TCP)
            # instead of killing a process with SIGBUS at its first touch of a slot
            os.posix_fallocate(fd, 0, self.geometry.size)
            self._mm = mmap.mmap(fd, self.geometry.size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        HEAD.pack_into(self._mm, 0, MAGIC, slots, slot_bytes)
        self._released = np.frombuffer(self._mm, np.uint64, slots, RELEASED_AT)
        self._waiting = np.frombuffer(self._mm, np.uint64, 1, WAITING_AT)
        self._bytes = np.frombuffer(self._mm, np.uint8)
        self.ticket = 0  # of the next frame

    def free(self) -> bool:
        """The next frame's slot was released by the consumer (or never used)."""
        t = self.ticket
        return t < self.geometry.slots or int(self._released[t % self.geometry.slots]) >= t - self.geometry.slots + 1

    def wait_free(self, sock: socket.socket, alive) -> bool:
        """Block until the next slot is free (True) or the connection ends or `alive()` turns false
        (False). Spins SPIN_S first (a consumer about to release costs no sleep), then sleeps on
        `sock`, where the consumer sends a byte when it releases a slot while we wait (WAITING flag),
        at most WAKE_S at a time: a nudge lost to a race costs that much, never a hang."""
        if self.free():
            return True
        end = time.perf_counter() + SPIN_S
        while time.perf_counter() < end:
            if self.free():
                return True
        while alive():
            self._waiting[0] = 1
            try:
                if self.free():
                    return True
                readable, _, _ = select.select([sock], [], [], WAKE_S)
                if readable:
                    try:
                        if not sock.recv(4096, socket.MSG_DONTWAIT):
                            return False  # the consumer closed the connection
                    except BlockingIOError:
                        pass
            finally:
                self._waiting[0] = 0
            if self.free():
                return True
        return False

    def write(self, frame: Frame) -> Frame:
        """Copy `frame`'s tensors into the next slot (the one copy left on this path) and return the
        notification that names it; the slot must be free (wait_free). The tensors keep the codec's
        payload offsets, so the slot reads back as the payload of the same frame."""
        at = self.geometry.offset(self.ticket)
        pos = 0
        for arr in frame.tensors.values():
            start = (pos + 63) // 64 * 64
            n = arr.nbytes
            if n:
                dst = self._bytes[at + start: at + start + n]
                np.copyto(dst, np.ascontiguousarray(arr).reshape(-1).view(np.uint8), casting="no")
            pos = start + n
        size = payload_bytes([a.nbytes for a in frame.tensors.values()])
        if size > self.geometry.slot_bytes:
            raise FrameError(f"frame of {size} bytes does not fit a {self.geometry.slot_bytes}-byte slot")
        self.ticket += 1
        return Frame("shm", frame.run, frame.epoch, frame.seq, frame.stage, frame.tensors, frame.names,
                     slot=(self.name, at, size))

    def close(self, grace_s: float = 0.0) -> None:
        """Unlink the name if the consumer has not (it never opened it), after waiting up to
        `grace_s` for it to do so (a link closed after flushing: its first notification may still
        be on its way to a consumer that will open the ring). The mapping goes with this object: a
        put still in progress on another thread may be touching it."""
        end = time.monotonic() + (grace_s if self.ticket else 0.0)
        while os.path.exists(self.path) and time.monotonic() < end:
            time.sleep(0.005)
        try:
            os.unlink(self.path)
        except OSError:
            pass


class Inbox:
    """The consumer's end of one connection: opens the producer's ring at its first notification
    (checked: name, owner, mode, size, geometry), unlinks its name, and turns each notification
    into a view of its slot after checking offset and length against what it expects."""

    def __init__(self, run: str, epoch: int, sock: socket.socket | None = None):
        self.run = run
        self.epoch = epoch
        self.sock = sock
        self.name: str | None = None
        self.geometry: Geometry | None = None
        self._mm: mmap.mmap | None = None
        self._released: np.ndarray | None = None
        self._waiting: np.ndarray | None = None
        self.ticket = 0  # of the next notification

    def _open(self, name: str, frame_bytes: int) -> None:
        m = _NAME_RE.fullmatch(name) if type(name) is str else None
        if not m or m.group(1) != self.run or int(m.group(2)) != self.epoch:
            raise FrameError(f"shared-memory ring {str(name)[:80]!r} is not a segment of run {self.run} "
                             f"epoch {self.epoch}")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise FrameError(f"shared-memory ring {name} cannot be opened: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise FrameError(f"shared-memory ring {name} is not a private file of this user "
                                 f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid})")
            size = st.st_size
            if size < HEADER_BYTES:
                raise FrameError(f"shared-memory ring {name} is {size} bytes, less than its header")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        try:
            os.unlink(path)  # mapped: from now on nobody can open it by name, and nothing can leak
        except OSError:
            pass
        magic, slots, slot_bytes = HEAD.unpack_from(mm, 0)
        if (magic != MAGIC or not 1 <= slots <= MAX_SLOTS or slot_bytes < frame_bytes or slot_bytes % PAGE
                or HEADER_BYTES + slots * slot_bytes > size):
            mm.close()
            raise FrameError(f"shared-memory ring {name}: bad geometry ({slots} slots of {slot_bytes} bytes in "
                             f"{size}) for {frame_bytes}-byte frames")
        self.name, self.geometry, self._mm = name, Geometry(slots, slot_bytes, size), mm
        self._released = np.frombuffer(mm, np.uint64, slots, RELEASED_AT)
        self._waiting = np.frombuffer(mm, np.uint64, 1, WAITING_AT)

    def payload(self, slot: tuple[str, int, int], size: int) -> tuple[np.ndarray, int]:
        """The view of a notified slot holding a payload of `size` bytes (the size the checked
        header describes), and its ticket for release(). Refuses, in one line, a ring other than
        this connection's, an offset other than the next slot's, or a length that is not `size`
        or does not lie inside the mapping: nothing outside the segment is ever read."""
        name, at, length = slot
        if self._mm is None:
            self._open(name, size)
        elif name != self.name:
            raise FrameError(f"notification names ring {str(name)[:80]!r}, this connection's is {self.name}")
        g = self.geometry
        want = g.offset(self.ticket)
        if type(at) is not int or at != want:
            raise FrameError(f"notification offset {at!r} is not the next slot's ({want})")
        if type(length) is not int or length != size or length > g.slot_bytes or at + length > g.size:
            raise FrameError(f"notification length {length!r} at {at} does not fit: the header describes {size} "
                             f"bytes, slots are {g.slot_bytes}, the segment {g.size}")
        ticket = self.ticket
        self.ticket += 1
        return np.frombuffer(self._mm, np.uint8, length, at), ticket

    def release(self, ticket: int) -> None:
        """Give slot `ticket` back to the producer; nudge it if it sleeps waiting for one."""
        released, waiting = self._released, self._waiting  # close() may run on another thread
        if released is None or waiting is None:
            return
        released[ticket % len(released)] = ticket + 1
        if waiting[0] and self.sock is not None:
            try:
                self.sock.send(b"\x01", socket.MSG_DONTWAIT)
            except OSError:  # closed, or a full buffer of nudges: the producer looks again soon anyway
                pass

    def close(self) -> None:
        """Forget the mapping: it is unmapped when the last tensor viewing it is gone."""
        self._released = self._waiting = None
        self._mm = None
