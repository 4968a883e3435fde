"""The weights file: safetensors, written one tensor at a time and read one tensor at a time.

A stage must hold only its own weights, so the file is read by byte range (`os.pread` into the
destination: a NumPy array, or a page-locked staging buffer on the way to the GPU), never loaded
whole, and integrity is checked per tensor (sha256 of its bytes, kept in bundle.json) instead of
re-hashing the whole file in every process. Every byte a reader takes is counted (`bytes_read`),
so a test can prove a stage never touched another stage's tensors.

The layout is the ecosystem's (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length N, N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [a, b]},
"__metadata__": {...}}` padded with spaces, then the data; offsets are relative to the data start,
the data has no holes. Files written here load with `safetensors.numpy.load_file`, and files
written by the `safetensors` package load here.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from tvmpipe.bundle import dtypes
from tvmpipe.bundle.errors import BundleError, Problem

# safetensors dtype tags <-> TVM dltype names (the whitelist of bundle.dtypes).
ST_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
TVM_TO_ST = {v: k for k, v in ST_DTYPES.items()}
MAX_HEADER = 100 << 20  # the safetensors package's own limit
CHUNK = 64 << 20  # hashing / copying granularity: bounded temporary memory
READ_CHUNK = 8 << 20  # load_into reads in pieces of this size, each hashed while the next is read
MAX_HASH_LANES = 8  # BackgroundHash threads per process, at most
DATA_ALIGN = 4096  # the writer pads the header so that the data starts on a page (safetensors_header)


def hash_lanes() -> int:
    """Helper threads for hashing: one per core this process may run on, at most MAX_HASH_LANES."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_HASH_LANES))


class BackgroundHash:
    """A sha256 fed on a helper thread, so that hashing a piece overlaps reading the next one
    (os.preadv and hashlib both release the GIL for large buffers). Verifying weights costs a core
    at ~1.2-1.8 GB/s, slower than the page cache or PCIe: done in line, it was a third of a stage's
    build on the dev VM, and with mapped weights (WeightsFile.map) it is the whole load. So hashes
    are spread over `hash_lanes()` threads: a hash stays on one lane (a single thread, which keeps
    its pieces in submission order) and starts on the lane with the fewest bytes still queued, so
    a model's large weights do not all land on one lane and its small biases on another.
    A piece's buffer must not change until its future is done; `hexdigest` waits for all."""

    _lanes: list[ThreadPoolExecutor] = []
    _queued: list[int] = []  # bytes submitted to each lane and not hashed yet
    _pool_lock = threading.Lock()

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._last = None
        self._lane = -1

    @classmethod
    def _enqueue(cls, lane: int, nbytes: int) -> int:
        """Count `nbytes` on `lane` (-1: the least loaded); returns the lane."""
        with cls._pool_lock:
            if not cls._lanes:
                cls._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"tvmpipe-sha256-{i}") for i in range(hash_lanes())]
                cls._queued = [0] * len(cls._lanes)
            if lane < 0:
                lane = min(range(len(cls._lanes)), key=cls._queued.__getitem__)
            cls._queued[lane] += nbytes
            return lane

    @classmethod
    def _hashed(cls, lane: int, nbytes: int) -> None:
        with cls._pool_lock:
            if lane < len(cls._queued):
                cls._queued[lane] -= nbytes

    def update(self, data) -> Future:
        """Hash `data` next (in the background, on this hash's lane); returns the piece's Future."""
        n = getattr(data, "nbytes", None)
        n = len(data) if n is None else n
        self._lane = lane = self._enqueue(self._lane, n)
        self._last = self._lanes[lane].submit(self._h.update, data)
        self._last.add_done_callback(lambda _: self._hashed(lane, n))
        return self._last

    def hexdigest(self) -> str:
        if self._last is not None:
            self._last.result()
        return self._h.hexdigest()


# A forked child inherits the lanes but not their threads: work submitted there would never run.
os.register_at_fork(after_in_child=lambda: setattr(BackgroundHash, "_lanes", []))
# (the child's lanes start again from nothing queued: _enqueue makes both lists anew)


def _fail(file: str, where: str, msg: str) -> BundleError:
    return BundleError([Problem(file, where, "", msg)])


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's place in the file: dtype (TVM name), shape, absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def tensor_sha256(data: bytes | memoryview | np.ndarray) -> str:
    """The checksum bundle.json keeps per tensor: sha256 of its bytes as stored (C order, little endian)."""
    if isinstance(data, np.ndarray):
        data = np.require(data, requirements="C").reshape(-1).view(np.uint8)
    return hashlib.sha256(memoryview(data)).hexdigest()


def _adjacent(infos: list[TensorInfo]) -> list[list[TensorInfo]]:
    """`infos` (sorted by offset) cut into runs of tensors that follow each other in the file."""
    runs: list[list[TensorInfo]] = []
    for t in infos:
        if runs and runs[-1][-1].end == t.begin:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _itemsize(name: str) -> int:
    return 1 if name == "bool" else dtypes.itemsize(name)


def _np_dtype(name: str) -> np.dtype:
    return dtypes.np_dtype(name)


class WeightsFile:
    """A safetensors file opened for reading by tensor. The header is parsed and checked against
    the file size at open (a truncated file is refused at once, naming the first tensor it cuts);
    data is read only when asked for, and each tensor's checksum (when bundle.json has one) is
    verified on its first read."""

    def __init__(self, path: str | Path, checksums: Mapping[str, str] | None = None):
        self.path = Path(path)
        self.checksums = dict(checksums or {})
        self.bytes_read = 0
        self.reads: dict[str, int] = {}  # name -> bytes read for it (per process: what a test counts)
        self._verified: set[str] = set()
        self.missing_hint = ""  # said when a tensor is not in the file (a shipped slice: whose it is)
        f = str(self.path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise _fail(f, "", "file not found") from None
        except OSError as exc:
            raise _fail(f, "", f"cannot open: {exc.strerror}") from None
        try:
            self.size = os.fstat(self._fd).st_size
            self.tensors, self.metadata = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        self.bytes_read += len(data)
        return data

    def _read_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        f = str(self.path)
        if self.size < 8:
            raise _fail(f, "", f"truncated: {self.size} bytes, not even a safetensors header length")
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        if n > MAX_HEADER or 8 + n > self.size:
            raise _fail(f, "", f"not a safetensors file: header length {n} does not fit the {self.size}-byte file")
        try:
            obj = json.loads(self._pread(n, 8).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise _fail(f, "header", f"not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise _fail(f, "header", "must be a JSON object")
        meta = obj.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise _fail(f, "header", "__metadata__ must map strings to strings")
        base = self.header_bytes = 8 + n  # the data starts here
        tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, t in obj.items():
            where = f"tensor '{name}'"
            if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
                raise _fail(f, where, "needs exactly dtype, shape and data_offsets")
            dt = ST_DTYPES.get(t["dtype"]) if isinstance(t["dtype"], str) else None
            if dt is None:
                raise _fail(f, where, f"unsupported dtype {t['dtype']!r}")
            shape, offs = t["shape"], t["data_offsets"]
            if not (isinstance(shape, list) and len(shape) <= 32 and all(_count(d) for d in shape)):
                raise _fail(f, where, f"bad shape {shape!r}")
            if not (isinstance(offs, list) and len(offs) == 2 and all(_count(o) for o in offs) and offs[0] <= offs[1]):
                raise _fail(f, where, f"bad data_offsets {offs!r}")
            want = math.prod(shape) * _itemsize(dt)
            if offs[1] - offs[0] != want:
                raise _fail(f, where, f"data_offsets span {offs[1] - offs[0]} bytes but {t['dtype']}{shape} needs {want}")
            if base + offs[1] > self.size:
                raise _fail(f, where, f"truncated: the tensor ends at byte {base + offs[1]} of a {self.size}-byte file")
            tensors[name] = TensorInfo(name, dt, tuple(shape), base + offs[0], base + offs[1])
            spans.append((offs[0], offs[1], name))
        spans.sort()
        pos = 0
        for a, b, name in spans:
            if a != pos:
                raise _fail(f, f"tensor '{name}'", f"data starts at {a}, not {pos}: overlapping tensors or a hole")
            pos = b
        if base + pos != self.size:
            raise _fail(f, "", f"{self.size - base - pos} trailing bytes after the last tensor")
        return tensors, meta

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise _fail(str(self.path), f"tensor '{name}'", "not in the file" + self.missing_hint) from None

    def read_into(self, name: str, out: np.ndarray | memoryview, offset: int = 0, length: int | None = None) -> int:
        """Copy bytes [offset, offset+length) of tensor `name` into `out` (a writable buffer of at
        least that size): the one place data leaves the file. Returns the bytes copied."""
        t = self.info(name)
        length = t.nbytes - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > t.nbytes:
            raise _fail(str(self.path), f"tensor '{name}'", f"range [{offset}, {offset + length}) outside its {t.nbytes} bytes")
        dst = memoryview(out).cast("B") if not isinstance(out, np.ndarray) else out.reshape(-1).view(np.uint8).data
        done = 0
        while done < length:
            n = os.preadv(self._fd, [dst[done:length]], t.begin + offset + done)
            if n <= 0:
                raise _fail(str(self.path), f"tensor '{name}'", "truncated: the file shrank while reading")
            done += n
        self._count(name, length)
        return length

    def _count(self, name: str, nbytes: int) -> None:
        """Account `nbytes` of tensor `name` as taken from the file (read, or mapped by `map`)."""
        self.bytes_read += nbytes
        self.reads[name] = self.reads.get(name, 0) + nbytes

    def chunks(self, name: str, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
        """(offset, length) pieces of a tensor, for bounded staging copies."""
        n = self.info(name).nbytes
        for off in range(0, n, chunk):
            yield off, min(chunk, n - off)

    def verify(self, name: str, digest_of: "hashlib._Hash | BackgroundHash", pending: list | None = None) -> None:
        """Compare a running sha256 of the tensor's bytes with bundle.json's; once per tensor.
        With a `pending` list: append (name, hash) to it instead, for the caller's `settle(pending)`
        (the hash may still be running until then). Each caller keeps its own list, so stages built
        on threads from one bundle never settle each other's tensors."""
        if pending is not None:
            pending.append((name, digest_of))
            return
        want = self.checksums.get(name)
        if want is not None and digest_of.hexdigest() != want:
            raise _fail(str(self.path), f"tensor '{name}'", "sha256 differs from bundle.json: the weights changed after export")
        self._verified.add(name)

    def load_into(self, name: str, out: np.ndarray | memoryview, pending: list | None = None) -> None:
        """The whole tensor read straight into `out` (a param's storage view: no second copy),
        its checksum verified on the first read: piece by piece, each piece hashed while the next
        is read (BackgroundHash).

        With a `pending` list: return as soon as the bytes are in `out`; the checksum is compared at
        `settle(pending)`, which the caller must reach before it uses `out` or lets it go. A stage
        loading many tensors then reads (and fills fresh pages for) the next tensor while the
        helper thread still hashes this one, instead of waiting at every tensor's end: on the
        2-core dev VM a 1.5 GiB stage built in 0.93 s instead of 1.41 s (docs/bundle-format.md)."""
        if name in self._verified:
            self.read_into(name, out)
            return
        flat = memoryview(out).cast("B") if not isinstance(out, np.ndarray) else out.reshape(-1).view(np.uint8)
        h = BackgroundHash()
        try:
            for off, n in self.chunks(name, READ_CHUNK):
                self.read_into(name, flat[off:off + n], off, n)
                h.update(flat[off:off + n])
        except BaseException:
            h.hexdigest()  # never return while the helper still reads `out`
            raise
        self.verify(name, h, pending)

    def map(self, names: Iterable[str], pending: list) -> dict[str, np.ndarray]:
        """Tensors `names` as uint8 arrays over the file's own pages, with no copy: each run of
        tensors that follow each other in the file is one private mapping (copy-on-write: a write
        changes this process's page, never the file; few mappings, few file descriptors).

        Reading into fresh memory costs zeroing the pages and copying every byte, on top of the
        hash that has to read them anyway: on the 2-core dev VM 2.15 CPU-s for 1.5 GiB, against
        1.3 CPU-s mapped (docs/bundle-format.md). The page cache's pages are shared, so K stages on
        one node hold the weights once in memory, not once in the cache and again in the stages.

        Each tensor is hashed on the helper thread (the hash faults its pages in) and verified at
        `settle(pending)`, which the caller must reach before it uses the arrays. Left out, for the
        caller to read with `load_into`: a tensor whose first or last page holds bytes of a tensor
        not asked for (a mapping shows whole pages, and another stage's bytes must never be in
        this process: files this writer makes start the data on a page, so with page-sized
        tensors that is none), one at an offset that is not a multiple of its item size (NumPy
        would see an unaligned array), and every tensor of a file its filesystem cannot map."""
        infos = sorted((self.info(n) for n in dict.fromkeys(names)), key=lambda t: t.begin)
        infos = [t for t in infos if t.nbytes]
        page = mmap.PAGESIZE
        runs: list[list[TensorInfo]] = []
        for own in _adjacent(infos):
            # the bytes a mapping of this run may show: its own tensors, plus the header before the
            # first tensor of the file and the zeros after the end of the file, never another tensor
            lo = 0 if own[0].begin == self.header_bytes else own[0].begin
            hi = math.inf if own[-1].end == self.size else own[-1].end
            ok = [t for t in own if t.begin % _itemsize(t.dtype) == 0
                  and t.begin - t.begin % page >= lo and -(-t.end // page) * page <= hi]
            runs.extend(_adjacent(ok))
        out: dict[str, np.ndarray] = {}
        size = os.fstat(self._fd).st_size  # a file cut after open must not be mapped past its end (SIGBUS)
        for run in runs:
            if run[-1].end > size:
                raise _fail(str(self.path), f"tensor '{run[-1].name}'", "truncated: the file shrank after it was opened")
            start = run[0].begin - run[0].begin % mmap.ALLOCATIONGRANULARITY
            try:
                m = mmap.mmap(self._fd, run[-1].end - start, flags=mmap.MAP_PRIVATE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
            except OSError:
                continue  # a filesystem that cannot map files: the caller reads these tensors instead
            try:
                m.madvise(mmap.MADV_WILLNEED)  # read ahead now, while the hash walks the pages
            except (AttributeError, OSError):
                pass
            for t in run:
                arr = out[t.name] = np.frombuffer(m, np.uint8, t.nbytes, t.begin - start)
                self._count(t.name, t.nbytes)
                if t.name in self._verified:
                    continue
                h = BackgroundHash()
                for off, n in self.chunks(t.name, READ_CHUNK):
                    h.update(arr[off:off + n])
                self.verify(t.name, h, pending)
        return out

    def settle(self, pending: list, compare: bool = True) -> None:
        """Verify every tensor in `pending` (waiting for its hash) and empty the list; the first
        mismatch is the usual one-line error naming the file and the tensor. All hashes are waited
        for either way; `compare=False` only waits (a load that failed: its own error is the one
        to report)."""
        items = list(pending)
        pending.clear()
        try:
            for name, h in items if compare else ():
                self.verify(name, h)
        finally:
            for _, h in items:
                h.hexdigest()

    def read(self, name: str) -> np.ndarray:
        """The tensor as a new array (checksum verified on the first read)."""
        t = self.info(name)
        arr = np.empty(t.shape, dtype=_np_dtype(t.dtype))
        self.load_into(name, arr)
        return arr

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def safetensors_header(specs: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None,
                       file: str = "<weights>") -> tuple[bytes, dict[str, TensorInfo], int]:
    """The first bytes of a safetensors file holding `specs` (name, TVM dtype, shape) in that
    order: (length prefix + padded JSON header, each tensor's range relative to the data start,
    data bytes). The header is padded with spaces (as the format allows) so that the data starts
    on a page (DATA_ALIGN): tensors whose sizes are whole pages then start and end on pages, and a
    stage can map its own tensors without sharing a page with another stage's (WeightsFile.map)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    tensors: dict[str, TensorInfo] = {}
    for name, dt, shape in specs:
        if dt not in TVM_TO_ST:
            raise _fail(file, f"tensor '{name}'", f"dtype {dt} has no safetensors tag")
        if name in tensors:
            raise _fail(file, f"tensor '{name}'", "listed twice")
        n = math.prod(shape) * _itemsize(dt)
        header[name] = {"dtype": TVM_TO_ST[dt], "shape": list(shape), "data_offsets": [pos, pos + n]}
        tensors[name] = TensorInfo(name, dt, tuple(shape), pos, pos + n)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)
    return struct.pack("<Q", len(raw)) + raw, tensors, pos


class WeightsWriter:
    """Writes a safetensors file tensor by tensor. The header is fixed up front from the tensors'
    specs (names, dtypes, shapes), so each tensor can be written as soon as it is final and then
    dropped: the writer holds none of them. `close()` refuses a file with a tensor never written,
    fsyncs, and returns the per-tensor sha256 for bundle.json."""

    def __init__(self, path: str | Path, specs: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        head, self.tensors, pos = safetensors_header(specs, metadata, str(self.path))
        self.base = len(head)
        self.checksums: dict[str, str] = {}
        self._f = open(self.path, "wb")
        self._f.write(head)
        self._f.truncate(self.base + pos)

    def write(self, name: str, value: np.ndarray) -> None:
        t = self.tensors.get(name)
        if t is None:
            raise _fail(str(self.path), f"tensor '{name}'", "not declared when the file was opened")
        arr = np.require(value, requirements="C")  # not ascontiguousarray: it turns a 0-d array into 1-d
        if tuple(arr.shape) != t.shape or arr.dtype != _np_dtype(t.dtype):
            raise _fail(str(self.path), f"tensor '{name}'",
                        f"is {arr.dtype}{list(arr.shape)} but was declared {t.dtype}{list(t.shape)}")
        flat = arr.reshape(-1).view(np.uint8)
        h = hashlib.sha256()
        self._f.seek(self.base + t.begin)
        for off in range(0, flat.size, CHUNK):
            piece = flat[off:off + CHUNK]
            h.update(piece)
            self._f.write(piece)
        self.checksums[name] = h.hexdigest()

    def close(self) -> dict[str, str]:
        missing = [n for n in self.tensors if n not in self.checksums]
        if missing:
            self._f.close()
            raise _fail(str(self.path), f"tensor '{missing[0]}'", f"never written ({len(missing)} tensors missing)")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return dict(self.checksums)

    def abort(self) -> None:
        self._f.close()


def save_safetensors(path: str | Path, params: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Write a dict of arrays (small bundles, tests); big models go through WeightsWriter directly."""
    specs = [(n, _tvm_name(a.dtype), tuple(a.shape)) for n, a in params.items()]
    w = WeightsWriter(path, specs)
    try:
        for n, a in params.items():
            w.write(n, a)
    except BaseException:
        w.abort()
        raise
    return w.close()


def _tvm_name(dt: np.dtype) -> str:
    for name in ST_DTYPES.values():
        try:
            if dtypes.np_dtype(name) == dt:
                return name
        except KeyError:
            continue
    raise KeyError(f"no TVM dtype for {dt}")


class LazyParams(Mapping[str, np.ndarray]):
    """bundle.params for a safetensors bundle: a mapping that reads a tensor when it is looked up.

    Looking names up is free (the header is parsed); values are read, checksummed and cached on
    first access, so a stage that touches only its own names reads only their bytes. `release()`
    drops cached arrays (the streamed single-process check releases each stage's weights)."""

    def __init__(self, file: WeightsFile, names: Iterable[str]):
        self.file = file
        self._names = list(names)
        self._set = set(self._names)
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._set:
            raise KeyError(name)
        arr = self._cache.get(name)
        if arr is None:
            arr = self._cache[name] = self.file.read(name)
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def info(self, name: str) -> TensorInfo:
        return self.file.info(name)

    def read_into(self, name: str, out: np.ndarray, pending: list | None = None) -> None:
        """Tensor `name` read straight into `out` (a stage's storage view), checksum verified
        (with `pending`, at `settle(pending)`: WeightsFile.load_into), and NOT cached: the
        caller's buffer is the only copy in this process."""
        if name not in self._set:
            raise KeyError(name)
        cached = self._cache.get(name)
        if cached is not None:
            np.copyto(out, cached)
        else:
            self.file.load_into(name, out, pending)

    def map(self, names: Iterable[str], pending: list) -> dict[str, np.ndarray]:
        """Tensors mapped from the file, not cached (WeightsFile.map); cached ones are left out."""
        names = [n for n in names if n not in self._cache]
        for n in names:
            if n not in self._set:
                raise KeyError(n)
        return self.file.map(names, pending)

    def settle(self, pending: list, compare: bool = True) -> None:
        """Verify the checksums of the tensors read into `pending` (WeightsFile.settle)."""
        self.file.settle(pending, compare)

    def nbytes(self, name: str) -> int:
        return self.file.info(name).nbytes

    def release(self, names: Iterable[str] | None = None) -> None:
        for n in list(self._cache) if names is None else names:
            self._cache.pop(n, None)


def param_into(params: Mapping[str, np.ndarray], name: str, out: np.ndarray, pending: list | None = None) -> None:
    """Param `name` copied into `out`: read straight from the file for a LazyParams (no cached
    second copy; with `pending`, its checksum compared at `settle_params`), copied from the array
    otherwise."""
    if isinstance(params, LazyParams):
        params.read_into(name, out, pending)
    else:
        np.copyto(out, params[name])


def map_params(params: Mapping[str, np.ndarray], names: Iterable[str], pending: list) -> dict[str, np.ndarray]:
    """Params `names` mapped from the weights file (WeightsFile.map: no copy; checksums compared at
    `settle_params(pending)`); {} for in-memory params, and tensors it cannot map are left out:
    the caller copies those with `param_into`."""
    if isinstance(params, LazyParams):
        return params.map(names, pending)
    return {}


def settle_params(params: Mapping[str, np.ndarray], pending: list, compare: bool = True) -> None:
    """Verify what `param_into(..., pending)` read (nothing to do for in-memory params);
    `compare=False`: only wait for the hashing to end (the load failed)."""
    if isinstance(params, LazyParams):
        params.settle(pending, compare)
