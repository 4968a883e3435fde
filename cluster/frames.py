"""Frames: how boundary tensors travel between stages (see docs/frames.md).

A frame is an 8-byte prefix (magic, header length), a msgpack header that describes every tensor,
then the raw tensor bytes. msgpack has no zero-copy unpack for binary data, so tensors never go
inside the msgpack document: the header is small and the payload is received straight into one
buffer whose slices become the arrays. Nothing here uses pickle, and every size a peer claims is
checked against hard limits *before* memory is allocated for it, so a hostile or corrupt peer can
make a connection fail with `FrameError` but cannot make the receiver allocate or crash.
"""

from __future__ import annotations

import mmap
import socket
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, NamedTuple

import msgpack
import numpy as np

from tvmpipe.bundle import dtypes
from tvmpipe.core.errors import TvmpipeError

MAGIC = b"TVPF"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sI")  # magic, header length in bytes
ALIGN = 64  # payload offset of every tensor: cache-line aligned views, whatever the dtype
KINDS = ("hello", "data", "error")
DRIVER = -1  # the `stage` of frames the driver sends (graph inputs)
NAME_CHARS = 256  # tensor names are for people reading traces and errors: longer ones are cut
# dtype lookups on the per-frame path: NumPy dtype -> tvmpipe name, and name -> itemsize
_BY_DTYPE = {dtypes.np_dtype(n): n for n in dtypes.DTYPES}
_ITEMSIZE = {n: dtypes.itemsize(n) for n in [*dtypes.DTYPES, "uint1"]}
HEADER_KEYS = {"v", "kind", "run", "epoch", "seq", "stage", "tensors", "error"}
_ZEROS = bytes(ALIGN)
RETAINED_MMAP_BYTES = 1 << 20  # retained payloads from this size on get pre-populated mappings
# `seq` is written as a msgpack uint 64 (0xcf + 8 bytes, big endian) whatever its value: a valid,
# merely non-minimal encoding that any msgpack reader takes, and one that lets a stream's header be
# packed once and patched per frame. The all-ones value marks the field in a freshly packed header
# (0xff never occurs in UTF-8, so no name can contain the marker).
SEQ_FIELD = b"\xa3seq\xcf"  # fixstr "seq", then the uint 64 tag
_SEQ = struct.Struct(">Q")
_SEQ_MARK = SEQ_FIELD + b"\xff" * 8


class FrameError(TvmpipeError):
    """A frame is malformed, truncated, oversized or unexpected; its connection must be closed."""


@dataclass(frozen=True)
class FrameLimits:
    """Hard bounds a receiver enforces before allocating. Tighten them per connection when the
    expected traffic is known (a stage knows every tensor each producer sends it)."""

    max_header_bytes: int = 1 << 20
    max_tensors: int = 4096
    max_ndim: int = 32
    max_name_len: int = 1024
    max_error_len: int = 64 << 10
    max_tensor_bytes: int = 4 << 30
    max_payload_bytes: int = 16 << 30


DEFAULT_LIMITS = FrameLimits()


class TensorMeta(NamedTuple):
    """One tensor as the header describes it; `offset`, `np_dtype` and `count` are derived, never sent."""

    entry: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int
    np_dtype: np.dtype
    count: int


@dataclass
class Frame:
    """A decoded (or to-be-sent) frame. `tensors` maps graph entry id -> array; on receive the
    arrays are views of one payload buffer."""

    kind: str
    run: str
    epoch: int
    seq: int
    stage: int
    tensors: dict[int, np.ndarray] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def nbytes(self) -> int:
        return sum([a.nbytes for a in self.tensors.values()])


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def contiguous(arr: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray makes them 1-d)."""
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def payload_bytes(sizes: list[int]) -> int:
    """Payload length of a frame whose tensors take `sizes` bytes, in order (alignment included)."""
    pos = 0
    for n in sizes:
        pos = _align(pos) + n
    return pos


# ---- encoding ------------------------------------------------------------------------------------

class Encoder:
    """Encodes the frames of one stream. Consecutive frames of a stream differ only in `seq` (same
    run, epoch, producer and tensor layout), so the header is packed once per layout, with `seq` at
    a fixed width, and each frame only patches those 8 bytes: on a small frame's path the packing
    would cost more than the send (a hop is latency-bound by such per-frame Python)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._head = b""  # prefix + header up to the seq value
        self._tail = b""  # the header after it
        self._pads: tuple[bytes, ...] = ()  # zero padding before each tensor

    def encode(self, frame: Frame) -> list[memoryview | bytes]:
        """The frame as an iovec (prefix+header, then tensor bytes with alignment padding) ready for
        `socket.sendmsg`; the tensors' memory is referenced, not copied (non-contiguous arrays are)."""
        arrays = [contiguous(a) for a in frame.tensors.values()]
        key = (frame.kind, frame.run, frame.epoch, frame.stage, frame.error,
               [(e, a.dtype, a.shape) for e, a in zip(frame.tensors, arrays)], frame.names)
        if key != self._key:
            key = key[:6] + (dict(frame.names),)  # a copy: the caller may change its dict later
            self._head, self._tail, self._pads = _pack_header(frame, arrays)
            self._key = key
        parts: list[memoryview | bytes] = [self._head + _SEQ.pack(frame.seq) + self._tail]
        for pad, arr in zip(self._pads, arrays):
            if pad:
                parts.append(pad)
            if arr.nbytes:
                parts.append(memoryview(arr.reshape(-1)).cast("B"))
        return parts


def _pack_header(frame: Frame, arrays: list[np.ndarray]) -> tuple[bytes, bytes, tuple[bytes, ...]]:
    """Prefix + msgpack header of `frame` split around its seq value, and the tensors' padding."""
    if frame.kind not in KINDS:
        raise FrameError(f"unknown frame kind {frame.kind!r}")
    if type(frame.seq) is not int or not 0 <= frame.seq < 1 << 64:
        raise FrameError(f"seq must be an integer in 0..2**64-1, got {frame.seq!r}")
    metas, pads = [], []
    pos = 0
    for eid, arr in zip(frame.tensors, arrays):
        name = _BY_DTYPE.get(arr.dtype)
        if name is None:
            raise FrameError(f"entry {eid}: dtype {arr.dtype} is not a tvmpipe dtype")
        start = _align(pos)
        pads.append(_ZEROS[: start - pos])
        pos = start + arr.nbytes
        metas.append((int(eid), frame.names.get(eid, "")[:NAME_CHARS], name, arr.shape, arr.nbytes))
    header = msgpack.packb({"v": FORMAT_VERSION, "kind": frame.kind, "run": frame.run, "epoch": frame.epoch,
                            "seq": (1 << 64) - 1, "stage": frame.stage, "tensors": metas, "error": frame.error})
    at = header.index(_SEQ_MARK) + len(SEQ_FIELD)  # the marker is unique (see SEQ_FIELD)
    head = PREFIX.pack(MAGIC, len(header)) + header[:at]
    return head, header[at + _SEQ.size:], tuple(pads)


def encode(frame: Frame) -> list[memoryview | bytes]:
    """One frame as an iovec (see Encoder.encode; a stream keeps an Encoder instead)."""
    return Encoder().encode(frame)


def to_bytes(frame: Frame) -> bytes:
    """The whole frame as one bytes object (tests, fuzzing; sockets use the iovec)."""
    return b"".join(bytes(p) for p in encode(frame))


# ---- decoding ------------------------------------------------------------------------------------

def parse_prefix(prefix: bytes | memoryview, limits: FrameLimits) -> int:
    """Header length announced by a prefix, after checking magic and bound."""
    magic, hlen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}: not a tvmpipe frame")
    if hlen == 0 or hlen > limits.max_header_bytes:
        raise FrameError(f"header length {hlen} outside 1..{limits.max_header_bytes}")
    return hlen


def _int(v: object, lo: int, what: str, i: int = -1) -> int:
    if type(v) is not int or v < lo:
        where = f"tensor {i} " if i >= 0 else ""
        raise FrameError(f"{where}{what} must be an integer >= {lo}, got {v!r}")
    return v


@lru_cache(maxsize=64)
def _unpack_options(limits: FrameLimits) -> dict:
    """msgpack's own bounds, so a hostile header cannot make the unpacker allocate either."""
    return dict(raw=False, use_list=True, strict_map_key=True, max_bin_len=0, max_ext_len=0,
                max_str_len=max(limits.max_name_len, limits.max_error_len),
                max_array_len=max(limits.max_tensors, limits.max_ndim, 5), max_map_len=len(HEADER_KEYS))


class Layout(NamedTuple):
    """The checked tensor list of a header, as sent (`raw`) and as decoded, under `limits`."""

    raw: list
    limits: FrameLimits
    metas: list[TensorMeta]
    names: dict[int, str]
    size: int


def parse_header(data: bytes | memoryview, limits: FrameLimits,
                 last: Layout | None = None) -> tuple[Frame, Layout]:
    """Decode and check a header; returns the frame (no tensors yet) and its tensor layout, whose
    payload size is safe to allocate.

    Every count and size is bounded before it is used. This runs once per frame per hop, so
    messages are only formatted on failure, and the tensor list is checked only when it differs
    from `last` (the previous layout on the same stream, which usually repeats it exactly).
    """
    try:
        h = msgpack.unpackb(data, **_unpack_options(limits))
    except Exception as exc:  # msgpack raises ValueError, FormatError, StackError, UnicodeDecodeError, ...
        raise FrameError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if type(h) is not dict or h.keys() != HEADER_KEYS:
        got = sorted(h) if isinstance(h, dict) else type(h).__name__
        raise FrameError(f"header must be a map with keys {sorted(HEADER_KEYS)}, got {got}")
    if h["v"] != FORMAT_VERSION or type(h["v"]) is not int:
        raise FrameError(f"frame format version {h['v']!r}, this tvmpipe reads {FORMAT_VERSION}")
    if h["kind"] not in KINDS:
        raise FrameError(f"unknown frame kind {h['kind']!r}")
    if type(h["run"]) is not str or len(h["run"]) > limits.max_name_len:
        raise FrameError("run id must be a short string")
    error = h["error"]
    if error is not None and type(error) is not str:
        raise FrameError("error must be a string or nil")
    raw = h["tensors"]
    layout = last if last is not None and last.limits is limits and last.raw == raw else _layout(raw, limits)
    frame = Frame(h["kind"], h["run"], _int(h["epoch"], 0, "epoch"), _int(h["seq"], 0, "seq"),
                  _int(h["stage"], DRIVER, "stage"), names=dict(layout.names), error=error)
    return frame, layout


def _layout(raw: object, limits: FrameLimits) -> Layout:
    """Check a header's tensor list: [entry, name, dtype, shape, nbytes] each, within `limits`."""
    if type(raw) is not list or len(raw) > limits.max_tensors:
        raise FrameError(f"tensors must be a list of at most {limits.max_tensors}")
    metas: list[TensorMeta] = []
    names: dict[int, str] = {}
    pos = 0
    for i, t in enumerate(raw):
        if type(t) is not list or len(t) != 5:
            raise FrameError(f"tensor {i}: must be [entry, name, dtype, shape, nbytes]")
        eid, name, dt, shape, nbytes = t
        _int(eid, 0, "entry", i)
        if eid in names:
            raise FrameError(f"tensor {i}: entry {eid} appears twice")
        if type(name) is not str or len(name) > limits.max_name_len:
            raise FrameError(f"tensor {i}: name must be a string of at most {limits.max_name_len}")
        itemsize = _ITEMSIZE.get(dt) if type(dt) is str else None
        if itemsize is None:
            raise FrameError(f"tensor {i}: dtype {dt!r} is not allowed")
        if type(shape) is not list or len(shape) > limits.max_ndim:
            raise FrameError(f"tensor {i}: shape must be a list of at most {limits.max_ndim} dims")
        count = 1
        for d in shape:
            count *= _int(d, 0, "shape", i)  # Python ints: no overflow on huge dims
        _int(nbytes, 0, "nbytes", i)
        if nbytes > limits.max_tensor_bytes:
            raise FrameError(f"tensor {i}: {nbytes} bytes exceeds the limit {limits.max_tensor_bytes}")
        if count * itemsize != nbytes:
            raise FrameError(f"tensor {i}: shape {shape} of {dt} does not take {nbytes} bytes")
        start = _align(pos)
        pos = start + nbytes
        if pos > limits.max_payload_bytes:
            raise FrameError(f"payload exceeds the limit {limits.max_payload_bytes} bytes")
        names[eid] = name
        metas.append(TensorMeta(eid, dt, tuple(shape), nbytes, start, dtypes.np_dtype(dt), count))
    return Layout(raw, limits, metas, names, pos)


def attach(frame: Frame, metas: list[TensorMeta], payload: np.ndarray | memoryview | bytes) -> Frame:
    """Fill `frame.tensors` with views of `payload` (no copy)."""
    tensors = frame.tensors
    for m in metas:
        arr = np.frombuffer(payload, m.np_dtype, m.count, m.offset)
        tensors[m.entry] = arr if len(m.shape) == 1 else arr.reshape(m.shape)
    return frame


def decode(data: bytes | bytearray | memoryview, limits: FrameLimits = DEFAULT_LIMITS) -> Frame:
    """Decode one complete frame held in memory; the arrays are views of `data`."""
    view = memoryview(data).cast("B")
    if len(view) < PREFIX.size:
        raise FrameError(f"truncated frame: {len(view)} bytes, the prefix alone is {PREFIX.size}")
    hlen = parse_prefix(view[: PREFIX.size], limits)
    body = PREFIX.size + hlen
    if len(view) < body:
        raise FrameError(f"truncated frame: header needs {hlen} bytes, {len(view) - PREFIX.size} present")
    frame, layout = parse_header(view[PREFIX.size: body], limits)
    if len(view) - body != layout.size:
        raise FrameError(f"payload is {len(view) - body} bytes, the header describes {layout.size}")
    return attach(frame, layout.metas, view[body:])


# ---- sockets -------------------------------------------------------------------------------------

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
    needs fresh pages, and NumPy asks for huge pages on large arrays, which with the usual THP
    setting (defrag=madvise) stalls in compaction: ~5 ms per fresh 4 MB array against ~1 ms for
    an anonymous mapping populated in one call (measured, docs/cluster.md)."""
    if size < RETAINED_MMAP_BYTES:
        return fresh_buffer(size)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=np.uint8)


class _Repeat(NamedTuple):
    """A data header that passed every check, split around its fixed-width seq value: a header
    with the same bytes everywhere else is the same frame but for `seq` (which any 8 bytes encode
    validly), so it needs no unpacking and no checks. Anything else goes through `parse_header`.
    Only `data` frames without an error are learnt, so those fields need no keeping."""

    head: bytes
    tail: bytes
    seq_at: int  # in the header
    lead: bytes  # prefix + head: a whole frame's first bytes
    size: int  # the whole frame's bytes: prefix, header, payload
    limits: FrameLimits
    layout: Layout
    run: str
    epoch: int
    stage: int

    @classmethod
    def learn(cls, header: bytes, frame: Frame, layout: Layout) -> _Repeat | None:
        """The repeat pattern of `header` (parsed into `frame`, `layout`) if its seq is fixed-width.
        The field is found by its bytes and then proven: with other seq bytes the header must parse
        to the same frame but for seq (bytes that merely look like the field, inside a name, fail)."""
        at = header.find(SEQ_FIELD)
        if frame.kind != "data" or frame.error is not None or at < 0 or header.find(SEQ_FIELD, at + 1) >= 0:
            return None
        at += len(SEQ_FIELD)
        if len(header) < at + _SEQ.size or _SEQ.unpack_from(header, at)[0] != frame.seq:
            return None
        other = frame.seq ^ 1
        try:
            twin, twin_layout = parse_header(header[:at] + _SEQ.pack(other) + header[at + _SEQ.size:],
                                             layout.limits, layout)
        except FrameError:
            return None
        if twin_layout is not layout or twin.seq != other or (twin.kind, twin.run, twin.epoch, twin.stage, twin.error) \
                != (frame.kind, frame.run, frame.epoch, frame.stage, frame.error):
            return None
        return cls(header[:at], header[at + _SEQ.size:], at, PREFIX.pack(MAGIC, len(header)) + header[:at],
                   PREFIX.size + len(header) + layout.size, layout.limits, layout, frame.run, frame.epoch, frame.stage)

    def frame(self, buf: bytearray, header_at: int) -> Frame:
        """The repeated frame (no tensors yet), with the seq of the header at `header_at` in `buf`."""
        return Frame("data", self.run, self.epoch, _SEQ.unpack_from(buf, header_at + self.seq_at)[0], self.stage,
                     {}, self.layout.names)

    def matches(self, buf: bytearray, at: int, hlen: int, limits: FrameLimits) -> bool:
        return (hlen == len(self.head) + _SEQ.size + len(self.tail) and limits is self.limits
                and buf.startswith(self.head, at) and buf.startswith(self.tail, at + self.seq_at + _SEQ.size))


class FrameReader:
    """Reads frames from one connection, in order.

    One `recv_into` usually brings a small frame's prefix, header and payload at once (three
    separate reads cost three system calls per hop), so the reader keeps a small buffer; bytes of
    the next frame stay in it for the next `read`. A payload larger than what is buffered is
    received straight into its own array: big tensors are not copied twice.
    """

    def __init__(self, sock: socket.socket, limits: FrameLimits = DEFAULT_LIMITS, buffer_bytes: int = 64 << 10,
                 alloc: Callable[[int], np.ndarray] = fresh_buffer):
        self.sock = sock
        self.limits = limits
        self.alloc = alloc
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._start = 0  # buffered bytes are _buf[_start:_end]
        self._end = 0
        self._layout: Layout | None = None  # of the last frame: the next one's tensors are usually the same
        self._repeat: _Repeat | None = None  # the last data header, to recognise its repeats

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
                and self._buf.startswith(rep.tail, at + PREFIX.size + rep.seq_at + _SEQ.size)):
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
                self._repeat = _Repeat.learn(header, frame, self._layout)
        else:  # a header larger than the buffer (allowed by the limits): read it on its own
            big = bytearray(hlen)
            self._take(memoryview(big), "header")
            frame, self._layout = parse_header(big, limits, self._layout)
            self._repeat = None
        payload = self.alloc(self._layout.size)  # a repeat's layout is the last one parsed
        self._take(memoryview(payload), "payload")
        return attach(frame, self._layout.metas, payload)
