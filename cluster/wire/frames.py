"""Frames: how boundary tensors travel between stages (see docs/frames.md).

A frame is an 8-byte prefix (magic, header length), a msgpack header that describes every tensor,
then the raw tensor bytes. msgpack has no zero-copy unpack for binary data, so tensors never go
inside the msgpack document: the header is small and the payload is received straight into one
buffer whose slices become the arrays. Nothing here uses pickle, and every size a peer claims is
checked against hard limits *before* memory is allocated for it, so a hostile or corrupt peer can
make a connection fail with `FrameError` but cannot make the receiver allocate or crash.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, NamedTuple

import msgpack
import numpy as np

from tvmpipe.bundle import dtypes
from tvmpipe.core.errors import TvmpipeError

MAGIC = b"TVPF"
FORMAT_VERSION = 2  # 2: a hello carries `mac`, the proof that its sender holds the run's secret
PREFIX = struct.Struct("<4sI")  # magic, header length in bytes
ALIGN = 64  # payload offset of every tensor: cache-line aligned views, whatever the dtype
KINDS = ("hello", "data", "error", "shm", "ipc")  # ipc: a data frame whose payload waits in a device slot (cudaipc.py)  # shm: a data frame whose payload waits in a shared-memory slot (shm.py)
DRIVER = -1  # the `stage` of frames the driver sends (graph inputs)
NAME_CHARS = 256  # tensor names are for people reading traces and errors: longer ones are cut
# dtype lookups on the per-frame path: NumPy dtype -> tvmpipe name, and name -> itemsize
_BY_DTYPE = {dtypes.np_dtype(n): n for n in dtypes.DTYPES}
_ITEMSIZE = {n: dtypes.itemsize(n) for n in [*dtypes.DTYPES, "uint1"]}
HEADER_KEYS = {"v", "kind", "run", "epoch", "seq", "stage", "tensors", "error"}
HELLO_KEYS = HEADER_KEYS | {"mac"}
SHM_KEYS = HEADER_KEYS | {"ring", "at", "len"}  # which segment, the slot's offset in it, the payload's length
IPC_KEYS = HEADER_KEYS | {"ipc"}  # [slot, offer or nil] (cudaipc.Note)
_ZEROS = bytes(ALIGN)
# `seq` is written as a msgpack uint 64 (0xcf + 8 bytes, big endian) whatever its value: a valid,
# merely non-minimal encoding that any msgpack reader takes, and one that lets a stream's header be
# packed once and patched per frame. The all-ones value marks the field in a freshly packed header
# (0xff never occurs in UTF-8, so no name can contain the marker).
SEQ_FIELD = b"\xa3seq\xcf"  # fixstr "seq", then the uint 64 tag
SEQ_VALUE = struct.Struct(">Q")
_SEQ_MARK = SEQ_FIELD + b"\xff" * 8


class FrameError(TvmpipeError):
    """A frame is malformed, truncated, oversized or unexpected; its connection must be closed."""


@dataclass(frozen=True)
class FrameLimits:
    """Hard bounds a receiver enforces before allocating. Tighten them per connection when the
    expected traffic is known (a stage knows every tensor each producer sends it): `exact()`.

    `layout`, if set, is the only tensor list a frame may carry: (entry, dtype, shape) per tensor,
    in any order. It is checked with the header, before the payload buffer exists, so a peer whose
    frames do not match what its edge was wired for cannot make the receiver allocate for them."""

    max_header_bytes: int = 1 << 20
    max_tensors: int = 4096
    max_ndim: int = 32
    max_name_len: int = 1024
    max_error_len: int = 64 << 10
    max_tensor_bytes: int = 4 << 30
    max_payload_bytes: int = 16 << 30
    layout: tuple[tuple[int, str, tuple[int, ...]], ...] | None = None

    @classmethod
    def exact(cls, tensors: list[tuple[int, str, tuple[int, ...]]]) -> FrameLimits:
        """The tightest limits that admit frames carrying exactly `tensors` (entry, dtype, shape),
        an error report included (error frames carry no tensors)."""
        sizes = [itemsize(dt) * _count(shape) for _, dt, shape in tensors]
        return cls(max_header_bytes=(64 << 10) + 256 * len(tensors), max_tensors=len(tensors),
                   max_ndim=max([len(s) for _, _, s in tensors] + [0]), max_tensor_bytes=max(sizes + [0]),
                   max_payload_bytes=sum(_align(n) for n in sizes),  # in any order
                   layout=tuple((int(e), dtypes.np_dtype(dt).name, tuple(s)) for e, dt, s in tensors))


DEFAULT_LIMITS = FrameLimits()
# A hello: a short header and nothing else (the connection is not authenticated until it is read).
HELLO_LIMITS = FrameLimits(max_header_bytes=256, max_tensors=0, max_ndim=0, max_name_len=64, max_error_len=0,
                           max_tensor_bytes=0, max_payload_bytes=0, layout=())


def itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
    mac: str | None = None  # hello only: see handshake.py
    slot: tuple[str, int, int] | None = None  # shm only: (ring name, offset, length), see shm.py
    # set on a received frame whose tensors are views of a shared-memory slot: call it once they are
    # no longer read, so that the producer may reuse the slot (shm.Inbox.release)
    release: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    # ipc: the note sent (an object with pack()) / received (its packed form, which the receiving
    # transport reads: cudaipc.Note.unpack); on the consumer's data frame made of it, the
    # cudaipc.DeviceFeed its stage runs; on a producer's data frame, its outputs' device pointers
    device: Any = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes the frame puts on the wire: a notification's tensors stay in shared memory."""
        if self.slot is not None or self.kind == "ipc":
            return 0
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
        if frame.kind in ("shm", "ipc"):
            return [_pack_notification(frame)]
        arrays = [contiguous(a) for a in frame.tensors.values()]
        key = (frame.kind, frame.run, frame.epoch, frame.stage, frame.error,
               [(e, a.dtype, a.shape) for e, a in zip(frame.tensors, arrays)], frame.names)
        if key != self._key:
            key = key[:6] + (dict(frame.names),)  # a copy: the caller may change its dict later
            self._head, self._tail, self._pads = _pack_header(frame, arrays)
            self._key = key
        parts: list[memoryview | bytes] = [self._head + SEQ_VALUE.pack(frame.seq) + self._tail]
        for pad, arr in zip(self._pads, arrays):
            if pad:
                parts.append(pad)
            if arr.nbytes:  # its bytes, whatever the dtype (a buffer of ml_dtypes' bfloat16 has no format)
                parts.append(memoryview(arr.reshape(-1).view(np.uint8)))
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
    doc = {"v": FORMAT_VERSION, "kind": frame.kind, "run": frame.run, "epoch": frame.epoch,
           "seq": (1 << 64) - 1, "stage": frame.stage, "tensors": metas, "error": frame.error}
    if frame.kind == "hello":
        doc["mac"] = frame.mac
    header = msgpack.packb(doc)
    at = header.index(_SEQ_MARK) + len(SEQ_FIELD)  # the marker is unique (see SEQ_FIELD)
    head = PREFIX.pack(MAGIC, len(header)) + header[:at]
    return head, header[at + SEQ_VALUE.size:], tuple(pads)


def _pack_notification(frame: Frame) -> bytes:
    """A shm notification: prefix and header (tensor list, ring, offset, length), no payload. Packed
    whole each time (its offset changes); only same-node frames large enough to gain take this path."""
    metas = []
    for eid, arr in frame.tensors.items():
        name = _BY_DTYPE.get(arr.dtype)
        if name is None:
            raise FrameError(f"entry {eid}: dtype {arr.dtype} is not a tvmpipe dtype")
        metas.append((int(eid), frame.names.get(eid, "")[:NAME_CHARS], name, arr.shape, arr.nbytes))
    doc = {"v": FORMAT_VERSION, "kind": frame.kind, "run": frame.run, "epoch": frame.epoch,
           "seq": frame.seq, "stage": frame.stage, "tensors": metas, "error": None}
    if frame.kind == "ipc":
        doc["ipc"] = frame.device.pack()
    else:
        ring, at, length = frame.slot
        doc.update(ring=ring, at=at, len=length)
    header = msgpack.packb(doc)
    return PREFIX.pack(MAGIC, len(header)) + header


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
                max_array_len=max(limits.max_tensors, limits.max_ndim, 5),
                max_map_len=max(len(HELLO_KEYS), len(SHM_KEYS)))


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
    kind = h.get("kind") if type(h) is dict else None
    keys = HELLO_KEYS if kind == "hello" else SHM_KEYS if kind == "shm" else IPC_KEYS if kind == "ipc" else HEADER_KEYS
    if type(h) is not dict or h.keys() != keys:
        got = sorted(h) if isinstance(h, dict) else type(h).__name__
        raise FrameError(f"header must be a map with keys {sorted(keys)}, got {got}")
    if h["v"] != FORMAT_VERSION or type(h["v"]) is not int:
        raise FrameError(f"frame format version {h['v']!r}, this tvmpipe reads {FORMAT_VERSION}")
    if h["kind"] not in KINDS:
        raise FrameError(f"unknown frame kind {h['kind']!r}")
    if type(h["run"]) is not str or len(h["run"]) > limits.max_name_len:
        raise FrameError("run id must be a short string")
    error = h["error"]
    if error is not None and type(error) is not str:
        raise FrameError("error must be a string or nil")
    mac = h.get("mac")
    if mac is not None and type(mac) is not str:
        raise FrameError("mac must be a string or nil")
    raw = h["tensors"]
    layout = last if last is not None and last.limits is limits and last.raw == raw else _layout(raw, limits)
    if limits.layout is not None:  # data frames carry exactly the wired tensors; others none
        _check_exact(layout.metas, limits.layout if h["kind"] in ("data", "shm", "ipc") else ())
    slot = None
    if h["kind"] == "shm":
        if type(h["ring"]) is not str or error is not None:
            raise FrameError("a shm notification names its ring and carries no error")
        slot = (h["ring"], _int(h["at"], 0, "offset"), _int(h["len"], 0, "length"))
    device = None
    if h["kind"] == "ipc":
        if error is not None:
            raise FrameError("a cuda-ipc notification carries no error")
        device = h["ipc"]  # the note as sent: the connection's device inbox reads it (cudaipc.Note.unpack)
    frame = Frame(h["kind"], h["run"], _int(h["epoch"], 0, "epoch"), _int(h["seq"], 0, "seq"),
                  _int(h["stage"], DRIVER, "stage"), names=dict(layout.names), error=error, mac=mac, slot=slot,
                  device=device)
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


def _check_exact(metas: list[TensorMeta], want: tuple[tuple[int, str, tuple[int, ...]], ...]) -> None:
    """The frame's tensors are exactly `want` (entry, dtype, shape; any order). A stream's repeated
    headers skip parse_header (Repeat), so this runs when a stream's header changes, not per frame."""
    got = {m.entry: (m.np_dtype.name, m.shape) for m in metas}
    expected = {e: (dt, shape) for e, dt, shape in want}
    if got == expected:
        return
    if got.keys() != expected.keys():
        raise FrameError(f"frame carries entries {sorted(got)}, expected {sorted(expected)} (what the edge was wired for)")
    e = next(e for e in got if got[e] != expected[e])
    raise FrameError(f"entry {e} is {got[e][0]}{list(got[e][1])}, expected {expected[e][0]}{list(expected[e][1])} "
                     "(what the edge was wired for)")


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


class Repeat(NamedTuple):
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
    def learn(cls, header: bytes, frame: Frame, layout: Layout) -> Repeat | None:
        """The repeat pattern of `header` (parsed into `frame`, `layout`) if its seq is fixed-width.
        The field is found by its bytes and then proven: with other seq bytes the header must parse
        to the same frame but for seq (bytes that merely look like the field, inside a name, fail)."""
        at = header.find(SEQ_FIELD)
        if frame.kind != "data" or frame.error is not None or at < 0 or header.find(SEQ_FIELD, at + 1) >= 0:
            return None
        at += len(SEQ_FIELD)
        if len(header) < at + SEQ_VALUE.size or SEQ_VALUE.unpack_from(header, at)[0] != frame.seq:
            return None
        other = frame.seq ^ 1
        try:
            twin, twin_layout = parse_header(header[:at] + SEQ_VALUE.pack(other) + header[at + SEQ_VALUE.size:],
                                             layout.limits, layout)
        except FrameError:
            return None
        if twin_layout is not layout or twin.seq != other or (twin.kind, twin.run, twin.epoch, twin.stage, twin.error) \
                != (frame.kind, frame.run, frame.epoch, frame.stage, frame.error):
            return None
        return cls(header[:at], header[at + SEQ_VALUE.size:], at, PREFIX.pack(MAGIC, len(header)) + header[:at],
                   PREFIX.size + len(header) + layout.size, layout.limits, layout, frame.run, frame.epoch, frame.stage)

    def frame(self, buf: bytearray, header_at: int) -> Frame:
        """The repeated frame (no tensors yet), with the seq of the header at `header_at` in `buf`."""
        return Frame("data", self.run, self.epoch, SEQ_VALUE.unpack_from(buf, header_at + self.seq_at)[0], self.stage,
                     {}, self.layout.names)

    def matches(self, buf: bytearray, at: int, hlen: int, limits: FrameLimits) -> bool:
        return (hlen == len(self.head) + SEQ_VALUE.size + len(self.tail) and limits is self.limits
                and buf.startswith(self.head, at) and buf.startswith(self.tail, at + self.seq_at + SEQ_VALUE.size))
