"""Frames: round trips, zero-copy views, and hostile input (only FrameError, bounded allocation)."""

from __future__ import annotations

import socket
import struct
import threading
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tvmpipe.bundle import dtypes
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.cluster.wire import frames, stream
from tvmpipe.cluster.wire.frames import Frame, FrameError, FrameLimits

DTYPES = list(dtypes.DTYPES)  # every dtype a bundle may hold, bfloat16 included


def sample(seed: int = 0) -> Frame:
    rng = np.random.default_rng(seed)
    tensors = {3: rng.standard_normal((2, 5)).astype(np.float32), 7: np.arange(3, dtype=np.int64),
               9: np.zeros((0, 4), np.float16), 11: np.array(True), 12: rng.integers(0, 255, 13).astype(np.uint8)}
    return Frame("data", "run1", 2, 41, 1, tensors, {3: "a", 7: "b", 9: "empty", 11: "flag", 12: "odd"})


def header_bytes(h: dict) -> bytes:
    body = msgpack.packb(h)
    return frames.PREFIX.pack(frames.MAGIC, len(body)) + body


def base_header(**kw) -> dict:
    h = {"v": frames.FORMAT_VERSION, "kind": "data", "run": "r", "epoch": 0, "seq": 0, "stage": 0, "tensors": [], "error": None}
    h.update(kw)
    return h


def assert_same(a: Frame, b: Frame) -> None:
    assert (a.kind, a.run, a.epoch, a.seq, a.stage, a.error) == (b.kind, b.run, b.epoch, b.seq, b.stage, b.error)
    assert list(a.tensors) == list(b.tensors)
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype and a.tensors[k].shape == b.tensors[k].shape
        assert np.array_equal(a.tensors[k], b.tensors[k])
    assert a.names == {k: b.names.get(k, "") for k in b.tensors}


def test_frame_error_is_a_tvmpipe_error():
    assert issubclass(FrameError, TvmpipeError)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype(dtype):
    arr = (np.arange(24) % 7).astype(dtypes.np_dtype(dtype)).reshape(2, 3, 4)
    f = Frame("data", "r", 0, 5, 2, {1: arr, 2: arr[:, 1:, ::2]}, {1: "x", 2: "strided"})
    assert_same(frames.decode(frames.to_bytes(f)), f)


def test_round_trip_views_share_the_buffer_and_are_aligned():
    f = sample()
    buf = bytearray(frames.to_bytes(f))
    got = frames.decode(buf)
    assert_same(got, f)
    for arr in got.tensors.values():
        if arr.size:
            assert np.shares_memory(arr, np.frombuffer(buf, np.uint8))
    payload_start = np.frombuffer(buf, np.uint8).ctypes.data + len(buf) - frames.payload_bytes(
        [a.nbytes for a in f.tensors.values()])
    for arr in got.tensors.values():
        if arr.size:
            assert (arr.ctypes.data - payload_start) % frames.ALIGN == 0


def test_error_and_hello_frames():
    for f in (Frame("error", "r", 1, 9, 3, error="boom: ValueError"), Frame("hello", "r", 0, 0, -1)):
        assert_same(frames.decode(frames.to_bytes(f)), f)


def test_socket_round_trip_large_and_many():
    a, b = socket.socketpair()
    big = np.random.default_rng(1).standard_normal(3 << 20).astype(np.float32)  # 12 MB: partial sends
    long_header = Frame("error", "r", 0, 98, 0, error="x" * 3000)  # header larger than the reader's buffer
    sent = [sample(i) for i in range(20)] + [long_header, Frame("data", "r", 0, 99, 0, {5: big})]

    def tx():
        for f in sent:
            stream.send(a, f)
        a.close()

    t = threading.Thread(target=tx)
    t.start()
    got = []
    reader = stream.FrameReader(b, buffer_bytes=1000)  # frames straddle the buffer
    while (f := reader.read()) is not None:
        got.append(f)
    t.join()
    b.close()
    assert len(got) == len(sent)
    for x, y in zip(got, sent):
        assert_same(x, y)


def test_encode_refuses_unknown_dtype():
    with pytest.raises(FrameError, match="complex64"):
        frames.encode(Frame("data", "r", 0, 0, 0, {1: np.zeros(2, np.complex64)}))


def test_truncation_at_every_byte_is_a_frame_error():
    data = frames.to_bytes(sample())
    for n in range(len(data)):
        with pytest.raises(FrameError):
            frames.decode(data[:n])
    with pytest.raises(FrameError, match="payload"):
        frames.decode(data + b"\0")


def test_truncated_stream_is_a_frame_error_but_clean_eof_is_none():
    data = frames.to_bytes(sample())
    for cut in (0, 3, 8, 20, len(data) - 1):
        a, b = socket.socketpair()
        a.sendall(data[:cut])
        a.close()
        if cut == 0:
            assert stream.FrameReader(b).read() is None
        else:
            with pytest.raises(FrameError, match="truncated"):
                stream.FrameReader(b).read()
        b.close()


@pytest.mark.parametrize("header, match", [
    (base_header(v=1), "version"),
    (base_header(v=True), "version"),
    (base_header(kind="shout"), "kind"),
    (base_header(epoch=-1), "epoch"),
    (base_header(seq=1.5), "seq"),
    (base_header(stage=-2), "stage"),
    (base_header(stage=False), "stage"),
    (base_header(run=5), "run id"),
    (base_header(error=3), "error"),
    (base_header(tensors={}), "tensors"),
    (base_header(tensors=[[1, "x", "float32", [2]]]), r"\[entry, name"),
    (base_header(tensors=[[1, "x", "complex64", [2], 16]]), "dtype"),
    (base_header(tensors=[[1, "x", "object", [2], 16]]), "dtype"),
    (base_header(tensors=[[1, "x", "float32", [2], 9]]), "does not take"),
    (base_header(tensors=[[1, "x", "float32", [-2], 8]]), "shape"),
    (base_header(tensors=[[1, "x", "float32", [1 << 62, 1 << 62], 0]]), "does not take"),
    (base_header(tensors=[[1, "x", "float32", [1], 4], [1, "y", "float32", [1], 4]]), "twice"),
    (base_header(tensors=[[-1, "x", "float32", [1], 4]]), "entry"),
    ({"v": 1}, "keys"),
    ([1, 2, 3], "map"),
])
def test_bad_headers(header, match):
    with pytest.raises(FrameError, match=match):
        frames.decode(header_bytes(header) + bytes(64))


def test_bad_prefix_and_garbage_header():
    good = frames.to_bytes(sample())
    with pytest.raises(FrameError, match="magic"):
        frames.decode(b"XXXX" + good[4:])
    with pytest.raises(FrameError, match="header length"):
        frames.decode(frames.PREFIX.pack(frames.MAGIC, 0))
    with pytest.raises(FrameError, match="header length"):
        frames.decode(frames.PREFIX.pack(frames.MAGIC, (1 << 20) + 1) + bytes(16))
    with pytest.raises(FrameError, match="msgpack"):
        frames.decode(frames.PREFIX.pack(frames.MAGIC, 3) + b"\xc1\xc1\xc1")
    deep = b"\x91" * 5000 + b"\xc0"  # 5000 nested arrays
    with pytest.raises(FrameError):
        frames.decode(frames.PREFIX.pack(frames.MAGIC, len(deep)) + deep)


def test_limits_are_enforced_before_allocation():
    limits = FrameLimits(max_tensor_bytes=1 << 20, max_payload_bytes=2 << 20, max_tensors=4, max_ndim=3)
    huge = base_header(tensors=[[1, "x", "uint8", [1 << 40], 1 << 40]])
    with pytest.raises(FrameError, match="exceeds the limit"):
        frames.decode(header_bytes(huge), limits)
    three = base_header(tensors=[[i, "x", "uint8", [1 << 20], 1 << 20] for i in range(3)])
    with pytest.raises(FrameError, match="payload exceeds"):
        frames.decode(header_bytes(three), limits)
    many = base_header(tensors=[[i, "x", "uint8", [1], 1] for i in range(5)])
    with pytest.raises(FrameError, match="at most 4"):
        frames.decode(header_bytes(many), limits)
    deep = base_header(tensors=[[1, "x", "uint8", [1, 1, 1, 1], 1]])
    with pytest.raises(FrameError):
        frames.decode(header_bytes(deep), limits)

    # over a socket: a peer announcing 1 TB costs nothing
    a, b = socket.socketpair()
    a.sendall(header_bytes(huge))
    tracemalloc.start()
    try:
        with pytest.raises(FrameError):
            stream.FrameReader(b, limits).read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        a.close()
        b.close()
    assert peak < 1 << 20


# ---- fuzzing ---------------------------------------------------------------------------------------

FUZZ_LIMITS = FrameLimits(max_header_bytes=4096, max_tensors=8, max_ndim=4, max_tensor_bytes=1 << 16,
                          max_payload_bytes=1 << 17)
VALID = [frames.to_bytes(sample(i)) for i in range(3)] + [frames.to_bytes(Frame("error", "r", 0, 1, 2, error="e"))]


def decode_or_frame_error(data: bytes) -> None:
    try:
        f = frames.decode(data, FUZZ_LIMITS)
    except FrameError:
        return
    assert sum(a.nbytes for a in f.tensors.values()) <= FUZZ_LIMITS.max_payload_bytes


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    decode_or_frame_error(data)
    decode_or_frame_error(frames.PREFIX.pack(frames.MAGIC, len(data)) + data)


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
       st.integers(0, 10_000), st.binary(max_size=20))
def test_fuzz_mutated_frames(base, flips, cut, tail):
    data = bytearray(base)
    for pos, val in flips:
        data[pos % len(data)] = val
    decode_or_frame_error(bytes(data[: cut % (len(data) + 1)]) + tail)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=8)
tensor_meta = st.lists(st.one_of(json_like, st.tuples(
    st.integers(-2, 20), st.text(max_size=4), st.sampled_from(DTYPES + ["complex64", ""]),
    st.lists(st.integers(-3, 1 << 40), max_size=5), st.integers(-3, 1 << 41)).map(list)), max_size=6)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional={
    "v": st.sampled_from([1, 1, 2, True, "1"]), "kind": st.sampled_from(["data", "hello", "error", "x", 1]),
    "run": json_like, "epoch": json_like, "seq": json_like, "stage": st.integers(-3, 3) | json_like,
    "tensors": tensor_meta | json_like, "error": json_like, "extra": json_like}), st.binary(max_size=600))
def test_fuzz_structured_headers(header, payload):
    decode_or_frame_error(header_bytes(header) + payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_socket_stream(data):
    a, b = socket.socketpair()
    try:
        a.sendall(struct.pack("<4sI", frames.MAGIC, len(data)) + data)
        a.close()
        reader = stream.FrameReader(b, FUZZ_LIMITS, buffer_bytes=64)
        try:
            while reader.read() is not None:
                pass
        except FrameError:
            pass
    finally:
        b.close()


def test_reader_checks_a_changed_tensor_list_again():
    """The reader skips re-checking a tensor list identical to the last one; a different one (here
    over the connection's limits) is checked in full, and the frames before it are unharmed."""
    a, b = socket.socketpair()
    limits = FrameLimits(max_tensors=1, max_ndim=1, max_tensor_bytes=16, max_payload_bytes=16)
    ok = [Frame("data", "r", 0, s, 0, {4: np.full(4, s, np.float32)}, {4: "x"}) for s in range(3)]
    for f in ok + [Frame("data", "r", 0, 3, 0, {4: np.zeros(8, np.float32)}, {4: "x"})]:
        stream.send(a, f)
    reader = stream.FrameReader(b, limits)
    for f in ok:
        assert_same(reader.read(), f)
    with pytest.raises(FrameError, match="exceeds the limit"):
        reader.read()
    a.close()
    b.close()



# ---- fixed-width seq: one header per stream, patched per frame --------------------------------

def test_seq_is_written_fixed_width_and_plain_msgpack_reads_it():
    """seq is a msgpack uint 64 whatever its value: any msgpack reader decodes it, and a stream's
    headers all have one length."""
    heads = []
    for seq in (0, 1, 300, 1 << 40, (1 << 64) - 1):
        head = bytes(frames.encode(Frame("data", "r", 0, seq, 1, {2: np.zeros(3, np.float32)}, {2: "x"}))[0])
        body = head[frames.PREFIX.size:]
        assert msgpack.unpackb(body)["seq"] == seq and frames.SEQ_FIELD in body
        heads.append(head)
    assert len({len(h) for h in heads}) == 1


@pytest.mark.parametrize("seq", [-1, 1 << 64, 1.0, True])
def test_encode_refuses_a_seq_outside_uint64(seq):
    with pytest.raises(FrameError, match="seq"):
        frames.encode(Frame("data", "r", 0, seq, 1))


def test_encoder_patches_seq_and_packs_again_when_the_layout_changes():
    enc = frames.Encoder()
    f = lambda seq, n=4, epoch=0: Frame("data", "r", epoch, seq, 1, {2: np.full(n, seq, np.float32)}, {2: "x"})  # noqa: E731
    a, b = bytes(enc.encode(f(5))[0]), bytes(enc.encode(f(6))[0])
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1  # only seq's last byte
    for frame in (f(7, n=6), f(8, epoch=3), f(9)):  # shape, epoch, then back: each header is fresh
        parts = enc.encode(frame)
        assert_same(frames.decode(b"".join(bytes(p) for p in parts)), frame)


class BytesSock:
    """A socket that only has recv_into, over fixed bytes (FrameReader needs no more)."""

    def __init__(self, data: bytes, chunk: int = 97):
        self.data, self.pos, self.chunk = data, 0, chunk

    def recv_into(self, view) -> int:
        n = min(len(view), len(self.data) - self.pos, self.chunk)  # short reads straddle headers
        view[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def read_all(data: bytes, limits: FrameLimits, chunk: int) -> list:
    """Every frame of a stream, then None (clean end) or the FrameError's class."""
    reader = stream.FrameReader(BytesSock(data, chunk), limits, buffer_bytes=4096)
    out = []
    while True:
        try:
            f = reader.read()
        except FrameError:
            return out + [FrameError]
        out.append(f)
        if f is None:
            return out


def minimal_header(f: Frame) -> bytes:
    """f as a non-tvmpipe sender might write it: msgpack's own smallest encodings, same payload."""
    metas = [[e, f.names.get(e, ""), str(a.dtype), list(a.shape), a.nbytes] for e, a in f.tensors.items()]
    body = msgpack.packb({"v": frames.FORMAT_VERSION, "kind": f.kind, "run": f.run, "epoch": f.epoch, "seq": f.seq, "stage": f.stage,
                          "tensors": metas, "error": f.error})
    return frames.PREFIX.pack(frames.MAGIC, len(body)) + body


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, (1 << 64) - 1), st.sampled_from([0, 1]), st.sampled_from([(4,), (2, 2), (3,)]),
                          st.sampled_from(["x", "£seqϐ", "seq\xcf"]), st.sampled_from(["tvmpipe", "minimal"])),
                min_size=1, max_size=8),
       st.none() | st.tuples(st.integers(0, 10_000), st.integers(0, 255)))
def test_fuzz_repeat_fast_path_changes_nothing(specs, flip):
    """The reader's repeat fast path (a header equal to the last one but for its seq bytes skips
    unpacking and checks) must give exactly what full parsing gives: the same frames, the same
    errors, for tvmpipe's and other encoders' headers, names that contain the seq field's bytes,
    and a corrupted header byte."""
    enc = frames.Encoder()
    data = b""
    for i, (seq, epoch, shape, name, style) in enumerate(specs):
        f = Frame("data", "run", epoch, seq, 1, {3: np.arange(np.prod(shape), dtype=np.float32).reshape(shape)},
                  {3: name})
        parts = [bytes(p) for p in enc.encode(f)]
        head = parts[0] if style == "tvmpipe" else minimal_header(f)
        if flip is not None and i == len(specs) - 1:  # corrupt the last frame's header
            pos = frames.PREFIX.size + flip[0] % (len(head) - frames.PREFIX.size)
            head = head[:pos] + bytes([flip[1]]) + head[pos + 1:]
        data += head + b"".join(parts[1:])
    limits = FrameLimits(max_payload_bytes=64, max_tensor_bytes=64, max_tensors=2, max_ndim=2)
    # chunks of 97 bytes straddle headers (the header-level repeat check); 4096 brings whole frames
    # at once (the whole-frame one)
    fast = {chunk: read_all(data, limits, chunk) for chunk in (97, 4096)}
    learn = frames.Repeat.learn
    try:
        frames.Repeat.learn = classmethod(lambda cls, *a: None)  # no fast path: every header parsed
        slow = read_all(data, limits, 97)
    finally:
        frames.Repeat.learn = learn
    for got in fast.values():
        assert len(got) == len(slow)
        for a, b in zip(got, slow):
            if isinstance(a, Frame) and isinstance(b, Frame):
                assert_same(a, b)
            else:
                assert a == b
